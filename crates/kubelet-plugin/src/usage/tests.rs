//! Tests of the usage module: cgroup parsing, attribution rules, series lifecycle.

use super::*;
use gpu_dra_core::checkpoint::{ClaimEntry, PreparedDevice};
use gpu_dra_device::usage::ProcessUsage;

const POD_A: &str = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1";
const POD_B: &str = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";

fn device(uid: &str, name: &str, dev: &str, uuid: &str) -> ClaimDevice {
    ClaimDevice {
        claim_uid: uid.into(),
        namespace: "ns".into(),
        name: name.into(),
        device: dev.into(),
        pool: "node-a".into(),
        uuid: uuid.into(),
        strategy: String::new(),
        share_bytes: None,
        mig_profile: String::new(),
        admin_access: false,
    }
}

fn process(pid: u32, used: u64, sm: Option<u32>) -> ProcessUsage {
    ProcessUsage {
        pid,
        used_bytes: Some(used),
        sm_percent: sm,
    }
}

fn sample(uuid: &str, processes: Vec<ProcessUsage>, util: Option<u32>) -> DeviceUsage {
    DeviceUsage {
        uuid: uuid.into(),
        processes,
        memory_total: Some(40 << 30),
        memory_used: None,
        utilization_percent: util,
    }
}

fn owner(pod: &str, container: &str) -> Owner {
    Owner {
        pod_uid: pod.into(),
        container: container.into(),
        container_id: String::new(),
    }
}

fn owner_id(pod: &str, id: &str) -> Owner {
    Owner {
        container_id: id.into(),
        ..owner(pod, "")
    }
}

#[test]
fn cgroups_of_every_driver_name_the_pod() {
    let cases = [
        (
            "0::/kubepods/burstable/pod0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1/4f9c0d0e8d1b2f",
            Some(owner_id(POD_A, "4f9c0d0e8d1b2f")),
        ),
        (
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e2d3c_4b5a_4978_8695_a4b3c2d1e0f1.slice/cri-containerd-4f9c.scope",
            Some(owner_id(POD_A, "4f9c")),
        ),
        (
            "12:memory:/kubepods/pod0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1/abc\n0::/",
            Some(owner_id(POD_A, "abc")),
        ),
        (
            "0::/1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d_trainer",
            Some(owner(POD_B, "trainer")),
        ),
        (
            "0::/kubepods.slice/kubepods-pod0f1e2d3c_4b5a_4978_8695_a4b3c2d1e0f1.slice/crio-77aa.scope",
            Some(owner_id(POD_A, "77aa")),
        ),
        // The pod's own cgroup (its sandbox): no container.
        (
            "0::/kubepods/pod0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1",
            Some(owner(POD_A, "")),
        ),
        ("0::/user.slice/user-0.slice/session-1.scope", None),
        ("0::/kubepods/podnot-a-uuid/abc", None),
        ("", None),
    ];
    for (text, want) in cases {
        assert_eq!(owner_from_cgroup(text), want, "{text}");
    }
}

#[test]
fn processes_go_to_the_claim_their_pod_is_reserved_for() {
    // Two claims time-slice one GPU; a third holds a MIG device alone; a fourth is idle.
    let devices = vec![
        device("c1", "a", "gpu-4", "GPU-4"),
        device("c2", "b", "gpu-4", "GPU-4"),
        device("c3", "mig", "gpu-0-mig-1g5gb-9-0", "MIG-0"),
        device("c4", "idle", "gpu-5", "GPU-5"),
    ];
    let samples = vec![
        sample(
            "GPU-4",
            vec![
                process(10, 2 << 30, Some(40)),
                process(11, 1 << 30, Some(0)),
                process(12, 5, Some(7)),
            ],
            Some(47),
        ),
        sample("MIG-0", vec![process(20, 3 << 30, None)], None),
        sample("GPU-5", vec![], Some(0)),
    ];
    let owners = HashMap::from([
        (10, owner(POD_A, "main")),
        (11, owner(POD_B, "")),
        // Pod of no claim on a shared device: nobody's.
        (12, owner("9a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d", "")),
    ]);
    let pods = HashMap::from([
        (
            "c1".to_string(),
            vec![PodRef {
                name: "pa".into(),
                uid: POD_A.into(),
            }],
        ),
        (
            "c2".to_string(),
            vec![PodRef {
                name: "pb".into(),
                uid: POD_B.into(),
            }],
        ),
    ]);
    let got = attribute(&devices, &samples, &owners, &pods);
    let by = |name: &str| got.iter().find(|u| u.device.name == name).expect(name);

    let a = by("a");
    assert_eq!(a.pods.len(), 1);
    assert_eq!(
        (a.pods[0].pod.as_str(), a.pods[0].container.as_str()),
        ("pa", "main")
    );
    assert_eq!(
        (a.pods[0].used_bytes, a.pods[0].sm_percent),
        (Some(2 << 30), Some(40))
    );
    assert!(a.active);
    assert_eq!(
        a.device_utilization_percent, None,
        "a shared GPU's utilisation is everyone's"
    );
    let b = by("b");
    assert_eq!(
        (b.pods[0].pod.as_str(), b.pods[0].used_bytes),
        ("pb", Some(1 << 30))
    );
    assert!(!b.active, "a process with no SM activity is idle");

    // Alone on its device, the process is the claim's though its pod is unknown.
    let mig = by("mig");
    assert_eq!((mig.pods[0].pod.as_str(), mig.pods[0].processes), ("", 1));
    assert_eq!(mig.pods[0].sm_percent, None, "no per-process SM on MIG");
    assert!(
        mig.active,
        "where SM activity is not exposed, a process counts"
    );
    assert_eq!(mig.allocated_bytes, Some(40 << 30));

    let idle = by("idle");
    assert!(!idle.active);
    assert_eq!(idle.pods.len(), 1);
    assert_eq!(
        (
            idle.pods[0].used_bytes,
            idle.pods[0].sm_percent,
            idle.pods[0].processes
        ),
        (Some(0), Some(0), 0)
    );
    assert_eq!(idle.device_utilization_percent, Some(0));
}

#[test]
fn a_memory_share_allocates_the_share() {
    let mut d = device("c1", "share", "gpu-1", "GPU-1");
    d.share_bytes = Some(10 << 30);
    let got = attribute(
        &[d],
        &[sample("GPU-1", vec![], Some(0))],
        &HashMap::new(),
        &HashMap::new(),
    );
    assert_eq!(got[0].allocated_bytes, Some(10 << 30));
}

fn prepared(uuid: &str) -> PreparedDevice {
    PreparedDevice {
        device: "gpu-4".into(),
        pool: "node-a".into(),
        request_names: Vec::new(),
        cdi_device_ids: Vec::new(),
        uuid: uuid.into(),
        admin_access: false,
        share_id: None,
        memory_share_bytes: None,
        sharing_strategy: Some("TimeSlicing".into()),
        extra: Default::default(),
    }
}

fn entry(devices: Vec<PreparedDevice>) -> ClaimEntry {
    ClaimEntry {
        state: PrepareState::PrepareCompleted,
        namespace: "ns".into(),
        name: "train".into(),
        devices,
        sharing: None,
        boot_id: None,
        driver_version: None,
        imported: None,
        dynamic_mig: Vec::new(),
        extra: Default::default(),
    }
}

/// A source that reports one fixed device.
struct Fixed(Vec<DeviceUsage>);

impl UsageSource for Fixed {
    fn sample(
        &self,
        uuids: &[String],
        _: Duration,
    ) -> Result<Vec<DeviceUsage>, gpu_dra_device::DeviceError> {
        Ok(self
            .0
            .iter()
            .filter(|d| uuids.contains(&d.uuid))
            .cloned()
            .collect())
    }
}

#[tokio::test]
async fn series_exist_while_the_claim_is_prepared_and_go_with_it() {
    let metrics = crate::metrics::Metrics::default();
    let claims = Arc::new(crate::testing::MemoryClaims::default());
    let source = Arc::new(Fixed(vec![sample(
        "GPU-4",
        vec![process(1, 3 << 30, Some(25))],
        Some(25),
    )]));
    let mut sampler = Sampler::new(
        source,
        claims,
        PathBuf::from("/nonexistent"),
        Duration::from_secs(15),
    );
    let mut cp = Checkpoint::default();
    cp.claims
        .insert("c1".into(), entry(vec![prepared("GPU-4")]));
    let inv = Inventory {
        driver_version: String::new(),
        cuda_driver_version: String::new(),
        gpus: Vec::new(),
        lost_gpus: Vec::new(),
    };
    let usage = sampler.sample(&cp, &inv, &metrics.usage).await;
    assert_eq!(usage.len(), 1);
    let text = metrics.render();
    let labels = r#"namespace="ns",claim="train",claim_namespace="ns",device="gpu-4",pool="node-a",uuid="GPU-4""#;
    for series in [
        format!(
            r#"gpu_dra_claim_info{{{labels},strategy="TimeSlicing",mig_profile="",share=""}} 1"#
        ),
        format!(
            "gpu_dra_claim_memory_allocated_bytes{{{labels}}} {}",
            40u64 << 30
        ),
        format!(
            r#"gpu_dra_claim_memory_used_bytes{{{labels},pod="",container=""}} {}"#,
            3u64 << 30
        ),
        format!(r#"gpu_dra_claim_sm_utilization_percent{{{labels},pod="",container=""}} 25"#),
        format!(r#"gpu_dra_claim_processes{{{labels},pod="",container=""}} 1"#),
        format!("gpu_dra_claim_device_utilization_percent{{{labels}}} 25"),
        format!("gpu_dra_claim_last_active_timestamp_seconds{{{labels}}} "),
        "gpu_dra_usage_samples_total 1".to_string(),
    ] {
        assert!(text.contains(&series), "{series} missing:\n{text}");
    }
    // Unprepared: every claim series is gone at the next sample.
    cp.claims.clear();
    sampler.sample(&cp, &inv, &metrics.usage).await;
    let text = metrics.render();
    for name in CLAIM_SERIES {
        assert!(!text.contains(&format!("{name}{{")), "{name} left:\n{text}");
    }
}

/// A source whose device reports whatever the test last set.
#[derive(Default)]
struct Settable(std::sync::Mutex<Vec<DeviceUsage>>);

impl UsageSource for Settable {
    fn sample(
        &self,
        uuids: &[String],
        _: Duration,
    ) -> Result<Vec<DeviceUsage>, gpu_dra_device::DeviceError> {
        let now = self.0.lock().map(|d| d.clone()).unwrap_or_default();
        Ok(now
            .into_iter()
            .filter(|d| uuids.contains(&d.uuid))
            .collect())
    }
}

/// Claims in memory that count the reads.
#[derive(Default)]
struct CountedClaims {
    inner: crate::testing::MemoryClaims,
    reads: std::sync::atomic::AtomicUsize,
}

impl ClaimSource for CountedClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> futures::future::BoxFuture<
        'a,
        Result<
            Option<k8s_openapi::api::resource::v1::ResourceClaim>,
            crate::claims::ClaimSourceError,
        >,
    > {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.get(namespace, name)
    }
}

/// Claim `ns/train` (UID `c1`, reserved for pod `trainer-0` = [`POD_A`]) prepared on GPU-4,
/// a sampler over it that counts the claim's reads, and the processes `pids` in the pods
/// named (their cgroups under a fake proc root).
struct Reads {
    metrics: crate::metrics::Metrics,
    claims: Arc<CountedClaims>,
    source: Arc<Settable>,
    sampler: Sampler,
    cp: Checkpoint,
    inv: Inventory,
    _proc_root: tempfile::TempDir,
}

impl Reads {
    fn new(pids: &[(u32, &str)]) -> Reads {
        let claims = Arc::new(CountedClaims::default());
        let claim: k8s_openapi::api::resource::v1::ResourceClaim =
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "ns", "name": "train", "uid": "c1"},
                "spec": {},
                "status": {"reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": POD_A}]},
            }))
            .expect("claim");
        claims.inner.insert(claim);
        let proc_root = tempfile::tempdir().expect("tempdir");
        for (pid, pod) in pids {
            std::fs::create_dir(proc_root.path().join(pid.to_string())).expect("pid dir");
            std::fs::write(
                proc_root.path().join(format!("{pid}/cgroup")),
                format!("0::/kubepods/burstable/pod{pod}/4f9c0d0e8d1b2f\n"),
            )
            .expect("cgroup");
        }
        let source = Arc::new(Settable::default());
        let sampler = Sampler::new(
            source.clone(),
            claims.clone(),
            proc_root.path().to_path_buf(),
            Duration::from_secs(15),
        );
        let mut cp = Checkpoint::default();
        cp.claims
            .insert("c1".into(), entry(vec![prepared("GPU-4")]));
        Reads {
            metrics: crate::metrics::Metrics::default(),
            claims,
            source,
            sampler,
            cp,
            inv: Inventory {
                driver_version: String::new(),
                cuda_driver_version: String::new(),
                gpus: Vec::new(),
                lost_gpus: Vec::new(),
            },
            _proc_root: proc_root,
        }
    }

    /// GPU-4 reports `processes` from now on.
    fn set(&self, processes: Vec<ProcessUsage>, util: Option<u32>) {
        *self.source.0.lock().expect("lock") = vec![sample("GPU-4", processes, util)];
    }

    async fn sample(&mut self) -> Vec<ClaimDeviceUsage> {
        self.sampler
            .sample(&self.cp, &self.inv, &self.metrics.usage)
            .await
    }

    fn reads(&self) -> usize {
        self.claims.reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A fresh sampler over the same node, as a restarted plugin has: pods from `pods`,
    /// history in `history` where given.
    fn restart(&mut self, pods: Option<Arc<CountedPods>>, history: Option<&Path>) {
        let mut sampler = Sampler::new(
            self.source.clone(),
            self.claims.clone(),
            self._proc_root.path().to_path_buf(),
            Duration::from_secs(15),
        );
        if let Some(pods) = pods {
            sampler = sampler.with_pods(pods);
        }
        if let Some(path) = history {
            sampler = sampler.with_history_file(path.to_path_buf());
        }
        self.sampler = sampler;
    }

    /// Process `pid` of `pod` now runs in the container with ID `id` (a CRI runtime's cgroup).
    fn container(&self, pid: u32, pod: &str, id: &str) {
        std::fs::write(
            self._proc_root.path().join(format!("{pid}/cgroup")),
            format!(
                "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{id}.scope\n",
                pod.replace('-', "_")
            ),
        )
        .expect("cgroup");
    }
}

/// Pods in memory that count the reads.
#[derive(Default)]
struct CountedPods {
    pods: std::sync::Mutex<Vec<k8s_openapi::api::core::v1::Pod>>,
    reads: std::sync::atomic::AtomicUsize,
}

impl CountedPods {
    /// Pod `ns/name` (UID `uid`) with `containers` as (name, container ID).
    fn set(&self, name: &str, uid: &str, containers: &[(&str, &str)]) {
        let statuses: Vec<serde_json::Value> = containers
            .iter()
            .map(|(n, id)| serde_json::json!({"name": n, "containerID": format!("containerd://{id}"), "image": "", "imageID": "", "ready": true, "restartCount": 0}))
            .collect();
        let pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "status": {"containerStatuses": statuses},
        }))
        .expect("pod");
        *self.pods.lock().expect("lock") = vec![pod];
    }

    fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl pods::PodSource for CountedPods {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Option<k8s_openapi::api::core::v1::Pod>, kube::Error>>
    {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let found = self
            .pods
            .lock()
            .expect("lock")
            .iter()
            .find(|p| {
                p.metadata.namespace.as_deref() == Some(namespace)
                    && p.metadata.name.as_deref() == Some(name)
            })
            .cloned();
        Box::pin(async move { Ok(found) })
    }
}

#[tokio::test]
async fn container_ids_get_their_names_from_the_pod_once_per_container_start() {
    let mut r = Reads::new(&[(7, POD_A)]);
    let pods = Arc::new(CountedPods::default());
    pods.set(
        "trainer-0",
        POD_A,
        &[("trainer", "4f9c"), ("sidecar", "5e5e")],
    );
    r.restart(Some(pods.clone()), None);
    r.container(7, POD_A, "4f9c");
    r.set(vec![process(7, 1 << 30, Some(5))], Some(5));
    let usage = r.sample().await;
    assert_eq!(
        (
            usage[0].pods[0].pod.as_str(),
            usage[0].pods[0].container.as_str()
        ),
        ("trainer-0", "trainer")
    );
    assert_eq!(pods.reads(), 1);
    for _ in 0..3 {
        r.sample().await;
    }
    assert_eq!(pods.reads(), 1, "a named container makes no further read");
    assert!(
        r.metrics
            .render()
            .contains(r#"pod="trainer-0",container="trainer"} 1"#),
        "{}",
        r.metrics.render()
    );

    // The container restarts: a new ID, one read.
    pods.set("trainer-0", POD_A, &[("trainer", "99bb")]);
    r.container(7, POD_A, "99bb");
    let usage = r.sample().await;
    assert_eq!(usage[0].pods[0].container, "trainer");
    assert_eq!(pods.reads(), 2);

    // An ID the pod does not list: read once, then left unnamed.
    r.container(7, POD_A, "dead");
    for _ in 0..3 {
        let usage = r.sample().await;
        assert_eq!(usage[0].pods[0].container, "");
    }
    assert_eq!(
        pods.reads(),
        3,
        "an unknown ID makes one read, not one per sample"
    );
}

#[tokio::test]
async fn history_survives_a_restart_and_goes_with_the_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("usage-history.json");
    let mut r = Reads::new(&[(7, POD_A)]);
    r.restart(None, Some(&file));
    r.set(vec![process(7, 3 << 30, Some(40))], Some(40));
    for _ in 0..history::WRITE_EVERY + 2 {
        r.sample().await;
    }
    let on_disk = History::from_bytes(&std::fs::read(&file).expect("written")).expect("parse");
    assert_eq!(
        on_disk.get("c1", "GPU-4").map(|h| h.samples),
        Some(history::WRITE_EVERY),
        "written every {} samples",
        history::WRITE_EVERY
    );
    r.sampler.save().await;

    // A restarted plugin goes on from what was written.
    r.restart(None, Some(&file));
    assert_eq!(
        r.sampler.history().get("c1", "GPU-4").map(|h| h.samples),
        Some(history::WRITE_EVERY + 2)
    );
    r.set(vec![process(7, 5 << 30, Some(90))], Some(90));
    r.sample().await;
    let text = r.metrics.render();
    let labels = r#"namespace="ns",claim="train",claim_namespace="ns",device="gpu-4",pool="node-a",uuid="GPU-4""#;
    for series in [
        format!(
            "gpu_dra_claim_usage_samples{{{labels}}} {}",
            history::WRITE_EVERY + 3
        ),
        format!(
            "gpu_dra_claim_memory_used_peak_bytes{{{labels}}} {}",
            5u64 << 30
        ),
        format!("gpu_dra_claim_memory_used_p95_bytes{{{labels}}} "),
        format!("gpu_dra_claim_sm_utilization_p95_percent{{{labels}}} 40"),
        format!("gpu_dra_claim_sm_utilization_peak_percent{{{labels}}} 90"),
        format!("gpu_dra_claim_first_sample_timestamp_seconds{{{labels}}} "),
        format!("gpu_dra_claim_last_sample_timestamp_seconds{{{labels}}} "),
    ] {
        assert!(text.contains(&series), "{series} missing:\n{text}");
    }

    // Unprepared: gone from memory and, at the next write, from the file.
    r.sampler
        .sample(&Checkpoint::default(), &r.inv, &r.metrics.usage)
        .await;
    assert!(r.sampler.history().is_empty());
    r.sampler.save().await;
    let on_disk = History::from_bytes(&std::fs::read(&file).expect("written")).expect("parse");
    assert!(on_disk.is_empty());

    // A damaged file is reported and history starts empty.
    std::fs::write(&file, b"{not json").expect("write");
    r.restart(None, Some(&file));
    assert!(r.sampler.history().is_empty());
}

#[tokio::test]
async fn a_claim_is_read_once_a_process_of_an_unknown_pod_runs_on_its_device_and_never_while_idle()
{
    let mut r = Reads::new(&[(7, POD_A)]);
    r.set(Vec::new(), Some(0));
    for _ in 0..3 {
        r.sample().await;
    }
    assert_eq!(r.reads(), 0, "an idle claim is not read");

    // A process outside any pod: its claim's pods could not name it, so no read either.
    r.set(vec![process(8, 1 << 30, Some(5))], Some(5));
    r.sample().await;
    assert_eq!(r.reads(), 0, "a process of no pod makes no read");

    r.set(vec![process(7, 1 << 30, Some(5))], Some(5));
    let usage = r.sample().await;
    assert_eq!(r.reads(), 1, "the pod's process makes one read");
    assert_eq!(usage[0].pods[0].pod, "trainer-0");
    for _ in 0..3 {
        r.sample().await;
    }
    assert_eq!(r.reads(), 1, "a known pod makes no further read");
}

#[tokio::test]
async fn a_pod_outside_the_claims_reserved_for_makes_one_read_not_one_per_sample() {
    let mut r = Reads::new(&[(7, POD_A), (9, POD_B)]);
    // A process of a pod the claim was never reserved for sits on its device.
    r.set(vec![process(9, 1 << 30, Some(5))], Some(5));
    for _ in 0..5 {
        r.sample().await;
    }
    assert_eq!(
        r.reads(),
        1,
        "the stranger's process makes one read, not one per sample"
    );

    // The claim's own pod starts as well: it is known from that read.
    r.set(
        vec![process(9, 1 << 30, Some(5)), process(7, 1 << 30, Some(5))],
        Some(10),
    );
    let usage = r.sample().await;
    assert_eq!(r.reads(), 1);
    // The claim holds the device alone: the stranger's process is its use too, unnamed.
    let pods: Vec<&str> = usage[0].pods.iter().map(|p| p.pod.as_str()).collect();
    assert_eq!(pods, ["", "trainer-0"]);

    // Unprepared and prepared again: the claim is read afresh.
    r.sampler
        .sample(&Checkpoint::default(), &r.inv, &r.metrics.usage)
        .await;
    r.sample().await;
    assert_eq!(r.reads(), 2);
}
