//! Sharing against the simulator's real processes: its `nvidia-smi` and
//! `nvidia-cuda-mps-control` stand-ins found under a simulated driver root, with state in its
//! state file. Each test builds a fresh simulated host and plugin directory.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_dra_api::{DeviceKey, Interval, MpsConfig, Sharing};
use gpu_dra_core::cdi::ContainerEdits;
use gpu_dra_kubelet_plugin::node_layout;
use gpu_dra_kubelet_plugin::sharing::state::MpsPhase;
use gpu_dra_kubelet_plugin::sharing::{
    DriverRoot, FileStore, SharedDevice, SharingError, SharingManager, SharingMetrics,
    SharingOptions, SharingStore, daemon_id,
};
use gpu_dra_sim::state::ComputeMode;
use gpu_dra_sim::testing::SimHost;

const CLAIM_A: &str = "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b";
const CLAIM_B: &str = "5f1c7d2a-8b3e-4f6a-9c0d-1e2f3a4b5c6d";

// dgx-a100-40gb: GPUs 0-3 have MIG enabled, 4-7 are whole.
const PROFILE: &str = "dgx-a100-40gb";

struct Node {
    host: SimHost,
    plugin_dir: tempfile::TempDir,
    metrics: SharingMetrics,
}

impl Node {
    fn new(profile: &str) -> Node {
        Node {
            host: SimHost::new(profile),
            plugin_dir: tempfile::tempdir().unwrap(),
            metrics: SharingMetrics::default(),
        }
    }

    fn options(&self) -> SharingOptions {
        let mut o = SharingOptions::new(
            DriverRoot::new(self.host.root(), None),
            self.plugin_dir.path(),
        );
        o.restart_backoff_initial = Duration::from_millis(20);
        o.restart_backoff_max = Duration::from_millis(500);
        o.liveness_interval = Duration::from_millis(20);
        o
    }

    fn store(&self) -> Arc<FileStore> {
        Arc::new(FileStore::new(node_layout::sharing_state_in(
            self.plugin_dir.path(),
        )))
    }

    /// A manager as a (re)started plugin process would build it.
    fn manager(&self) -> SharingManager {
        SharingManager::new(self.options(), self.store(), self.metrics.clone()).unwrap()
    }

    fn gpu_uuid(&self, index: usize) -> String {
        self.host.profile().gpus[index].uuid.clone()
    }

    fn mig_uuid(&self, gpu: usize) -> String {
        self.host.state().mig_devices(gpu)[0].ci.uuid.clone()
    }

    fn compute_mode(&self, index: usize) -> ComputeMode {
        self.host.state().gpus[index].compute_mode
    }

    fn timeslice(&self, index: usize) -> u32 {
        self.host.state().gpus[index].timeslice
    }

    fn daemon_dir(&self, claim: &str, group: &str) -> PathBuf {
        node_layout::mps_root_in(self.plugin_dir.path())
            .join(gpu_dra_core::sharing::daemon_dir_name(claim, group))
    }

    /// Runs the MPS client against a daemon's pipe and returns its exit code and stdout.
    fn mps_client(&self, dir: &Path, commands: &str) -> (i32, String) {
        use std::io::Write;
        let mut child = std::process::Command::new(self.host.tool("nvidia-cuda-mps-control"))
            .env_clear()
            .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A client that finds no daemon exits without reading its input (callers retry until
        // the daemon answers), so a broken pipe here is an answer, not a test failure.
        let _ = child.stdin.take().unwrap().write_all(commands.as_bytes());
        let out = child.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }
}

fn gpu(uuid: &str) -> SharedDevice {
    SharedDevice::gpu(uuid)
}

fn mig(uuid: &str) -> SharedDevice {
    SharedDevice::mig(uuid)
}

/// A plan's sharing group, as the manager gets it.
#[derive(Clone)]
struct Group {
    name: String,
    devices: Vec<SharedDevice>,
    sharing: Sharing,
}

fn ts(devices: Vec<SharedDevice>, interval: Interval) -> Group {
    Group {
        name: "0".into(),
        devices,
        sharing: Sharing::TimeSlicing { interval },
    }
}

fn mps(devices: Vec<SharedDevice>, config: MpsConfig) -> Group {
    Group {
        name: "0".into(),
        devices,
        sharing: Sharing::Mps(config),
    }
}

async fn prepare(
    m: &SharingManager,
    claim: &str,
    g: &Group,
) -> Result<ContainerEdits, SharingError> {
    prepare_in(m, TENANT, claim, g).await
}

/// The namespace of the claims the tests prepare, unless a test says otherwise.
const TENANT: &str = "tenant-a";

async fn prepare_in(
    m: &SharingManager,
    namespace: &str,
    claim: &str,
    g: &Group,
) -> Result<ContainerEdits, SharingError> {
    m.prepare(namespace, claim, &g.name, &g.devices, &g.sharing)
        .await
}

fn environ(pid: u32) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default())
        .replace('\0', "\n")
}

fn alive(pid: u32) -> bool {
    gpu_dra_kubelet_plugin::sharing::mps::pid_alive(pid)
}

fn kill9(pid: u32) {
    gpu_dra_kubelet_plugin::sharing::mps::kill(pid);
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn time_slicing_on_a_whole_gpu_sets_and_resets_the_interval() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let edits = prepare(&m, CLAIM_A, &ts(vec![gpu(&uuid)], Interval::Long))
        .await
        .unwrap();
    assert!(edits.env.is_empty() && edits.mounts.is_empty());
    assert_eq!(node.timeslice(4), 3);
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    m.unprepare(CLAIM_A).await.unwrap();
    assert_eq!(node.timeslice(4), 0);
    assert!(m.state().time_slicing.is_empty());
}

#[tokio::test]
async fn time_slicing_on_a_mig_device_calls_no_tool() {
    let node = Node::new(PROFILE);
    // Any nvidia-smi call now fails: time-slicing a MIG device must not need one.
    let smi = node.host.tool("nvidia-smi");
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o644)).unwrap();
    let m = node.manager();
    let before = node.host.state();
    prepare(
        &m,
        CLAIM_A,
        &ts(vec![mig(&node.mig_uuid(0))], Interval::Short),
    )
    .await
    .unwrap();
    m.unprepare(CLAIM_A).await.unwrap();
    assert_eq!(node.host.state().gpus, before.gpus);
    assert!(m.state().time_slicing.is_empty());
    // A whole GPU does need the tool, and the error says where it was looked for.
    let err = prepare(
        &m,
        CLAIM_B,
        &ts(vec![gpu(&node.gpu_uuid(4))], Interval::Short),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("nvidia-smi not found") && err.contains("usr/bin/nvidia-smi"),
        "{err}"
    );
}

#[tokio::test]
async fn time_slicing_on_an_unsupported_gpu_is_a_clear_error() {
    let node = Node::new("p4");
    let m = node.manager();
    let uuid = node.gpu_uuid(0);
    let err = prepare(&m, CLAIM_A, &ts(vec![gpu(&uuid)], Interval::Medium))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&uuid), "{err}");
    assert!(err.contains("Not Supported"), "{err}");
    // The failed claim holds nothing.
    assert!(m.state().time_slicing.is_empty());
}

#[tokio::test]
async fn time_slice_is_reset_only_after_the_last_claim_even_across_a_restart() {
    let node = Node::new(PROFILE);
    let uuid = node.gpu_uuid(5);
    let m = node.manager();
    prepare(&m, CLAIM_A, &ts(vec![gpu(&uuid)], Interval::Medium))
        .await
        .unwrap();
    prepare(&m, CLAIM_B, &ts(vec![gpu(&uuid)], Interval::Medium))
        .await
        .unwrap();
    m.unprepare(CLAIM_A).await.unwrap();
    assert_eq!(
        node.timeslice(5),
        2,
        "reset while claim B still uses the GPU"
    );
    // The reference count is persisted: a new plugin process knows about claim B.
    drop(m);
    let m = node.manager();
    m.recover().await.unwrap();
    assert_eq!(node.timeslice(5), 2);
    m.unprepare(CLAIM_B).await.unwrap();
    assert_eq!(node.timeslice(5), 0);
    // Unprepare is idempotent.
    m.unprepare(CLAIM_B).await.unwrap();
}

#[tokio::test]
async fn mps_on_one_gpu_runs_a_ready_daemon_with_limits_and_cleans_up() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let req = MpsConfig {
        active_thread_percentage: Some(50),
        pinned_memory_limit_mib: Some(1536),
        ..Default::default()
    };
    let edits = prepare(&m, CLAIM_A, &mps(vec![gpu(&uuid)], req.clone()))
        .await
        .unwrap();
    let dir = node.daemon_dir(CLAIM_A, "0");
    // Exactly what a client container receives for the group: the pipe directory and the
    // variable naming it; its own /dev/shm stays (device nodes come with the devices).
    assert_eq!(
        edits,
        gpu_dra_core::sharing::mps_edits(&dir.join("pipe").display().to_string())
    );
    assert_eq!(edits.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
    assert_eq!(edits.mounts.len(), 1);
    assert_eq!(
        edits.mounts[0].host_path,
        dir.join("pipe").display().to_string()
    );
    assert_eq!(edits.mounts[0].container_path, "/tmp/nvidia-mps");
    assert!(edits.device_nodes.is_empty() && edits.hooks.is_empty());
    let mut made: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    made.sort();
    assert_eq!(made, ["log", "pipe"], "no shm directory");
    assert_eq!(node.compute_mode(4), ComputeMode::ExclusiveProcess);

    // The daemon answers on the claim's pipe with the limits applied.
    let (code, out) = node.mps_client(
        &dir,
        &format!(
            "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit {uuid}\n"
        ),
    );
    assert_eq!(code, 0);
    assert_eq!(out, "50.0\n1536M\n");
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    let env = environ(pid);
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={uuid}\n")),
        "{env}"
    );
    assert!(env.contains(&format!(
        "CUDA_MPS_LOG_DIRECTORY={}\n",
        dir.join("log").display()
    )));
    let saved = node.store().load().unwrap();
    let rec = &saved.mps[&daemon_id(CLAIM_A, "0")];
    assert_eq!(rec.phase, MpsPhase::Ready);
    assert_eq!(rec.pid, Some(pid));

    // Repeating prepare is a no-op returning the same edits.
    assert_eq!(
        prepare(&m, CLAIM_A, &mps(vec![gpu(&uuid)], req))
            .await
            .unwrap(),
        edits
    );
    assert_eq!(m.mps_pid(CLAIM_A, "0"), Some(pid));

    m.unprepare(CLAIM_A).await.unwrap();
    assert!(!alive(pid));
    assert!(!dir.exists());
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    assert!(node.store().load().unwrap().mps.is_empty());
    m.unprepare(CLAIM_A).await.unwrap();
}

#[tokio::test]
async fn mps_on_two_gpus_applies_a_per_device_limit() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let (a, b) = (node.gpu_uuid(6), node.gpu_uuid(7));
    let mut sorted = [a.clone(), b.clone()];
    sorted.sort();
    let req = MpsConfig {
        pinned_memory_limit_mib: Some(1024),
        // Index 1 is the larger UUID (NVIDIA's rule: indexes count in the sorted UUIDs).
        per_device_pinned_memory_limit_mib: [(DeviceKey::Index(1), 3000)].into(),
        ..Default::default()
    };
    // Allocated in the reverse of sorted order: the limit follows the sorted order.
    let devices = vec![gpu(&sorted[1]), gpu(&sorted[0])];
    prepare(&m, CLAIM_A, &mps(devices, req)).await.unwrap();
    let dir = node.daemon_dir(CLAIM_A, "0");
    let (_, out) = node.mps_client(
        &dir,
        &format!(
            "get_default_device_pinned_mem_limit {}\nget_default_device_pinned_mem_limit {}\n",
            sorted[0], sorted[1]
        ),
    );
    assert_eq!(out, "1G\n3000M\n");
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    assert!(environ(pid).contains(&format!(
        "CUDA_VISIBLE_DEVICES={},{}\n",
        sorted[0], sorted[1]
    )));
    assert_eq!(node.compute_mode(6), ComputeMode::ExclusiveProcess);
    assert_eq!(node.compute_mode(7), ComputeMode::ExclusiveProcess);

    // A second claim cannot time-slice a GPU that MPS holds.
    let err = prepare(&m, CLAIM_B, &ts(vec![gpu(&a)], Interval::Short))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&a) && err.contains("MPS"), "{err}");

    m.unprepare(CLAIM_A).await.unwrap();
    assert_eq!(node.compute_mode(6), ComputeMode::Default);
    assert_eq!(node.compute_mode(7), ComputeMode::Default);
}

#[tokio::test]
async fn mps_on_a_mig_device_leaves_the_compute_mode_alone() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.mig_uuid(1);
    let before = node.compute_mode(1);
    let req = MpsConfig {
        active_thread_percentage: Some(25),
        per_device_pinned_memory_limit_mib: [(DeviceKey::Uuid(uuid.clone()), 2048)].into(),
        ..Default::default()
    };
    prepare(&m, CLAIM_A, &mps(vec![mig(&uuid)], req))
        .await
        .unwrap();
    let dir = node.daemon_dir(CLAIM_A, "0");
    let (_, out) = node.mps_client(
        &dir,
        &format!(
            "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit {uuid}\n"
        ),
    );
    assert_eq!(out, "25.0\n2G\n");
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    assert!(environ(pid).contains(&format!("CUDA_VISIBLE_DEVICES={uuid}\n")));
    assert_eq!(node.compute_mode(1), before);
    m.unprepare(CLAIM_A).await.unwrap();
    assert!(!alive(pid));
    assert_eq!(node.compute_mode(1), before);
}

#[tokio::test]
async fn a_daemon_dying_during_start_fails_prepare_and_leaves_nothing() {
    let node = Node::new(PROFILE);
    // Wrap the tool so that its daemon mode dies at once (the client still works).
    let tool = node.host.tool("nvidia-cuda-mps-control");
    let real = tool.with_file_name("mps-control-real");
    std::fs::rename(&tool, &real).unwrap();
    std::fs::write(
        &tool,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -f ]; then echo 'simulated crash' >&2; exit 1; fi\nexec {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let err = prepare(&m, CLAIM_A, &mps(vec![gpu(&uuid)], MpsConfig::default()))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&daemon_id(CLAIM_A, "0")), "{err}");
    assert!(err.contains("simulated crash"), "{err}");
    assert!(!node.daemon_dir(CLAIM_A, "0").exists());
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    assert!(node.store().load().unwrap().mps.is_empty());
}

#[tokio::test]
async fn a_plugin_crash_during_mps_start_leaves_no_orphan_after_recovery() {
    let node = Node::new(PROFILE);
    // The daemon's client mode (the readiness check that follows the saved pid) answers only
    // after 3 s, so the "crash" below lands between the two however loaded the machine is:
    // otherwise a prepare that finishes within one poll of the wait leaves nothing to recover.
    let tool = node.host.tool("nvidia-cuda-mps-control");
    let real = tool.with_file_name("mps-control-real");
    std::fs::rename(&tool, &real).unwrap();
    std::fs::write(
        &tool,
        format!(
            "#!/bin/sh\nif [ \"$1\" != -f ]; then sleep 3; fi\nexec {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let group = mps(vec![gpu(&uuid)], MpsConfig::default());
    let m2 = m.clone();
    let task = tokio::spawn(async move { prepare(&m2, CLAIM_A, &group).await });
    // "Crash" as soon as the daemon's pid is saved: the prepare future is dropped mid-way.
    let store = node.store();
    wait_until("a saved daemon pid", || {
        store
            .load()
            .ok()
            .and_then(|s| s.mps.values().next().and_then(|r| r.pid))
            .is_some()
    })
    .await;
    task.abort();
    assert!(
        task.await.is_err_and(|e| e.is_cancelled()),
        "the prepare finished before the crash"
    );
    m.detach();
    drop(m);
    std::fs::rename(&real, &tool).unwrap();
    let pid = store
        .load()
        .unwrap()
        .mps
        .values()
        .next()
        .unwrap()
        .pid
        .unwrap();

    let m = node.manager();
    let report = m.recover().await.unwrap();
    assert_eq!(report.cleaned, [daemon_id(CLAIM_A, "0")]);
    wait_until("the daemon to be gone", || !alive(pid)).await;
    assert!(!node.daemon_dir(CLAIM_A, "0").exists());
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    assert!(m.state().mps.is_empty());
}

#[tokio::test]
async fn a_stray_daemon_directory_is_cleaned_on_recovery() {
    let node = Node::new(PROFILE);
    let stray = node_layout::mps_root_in(node.plugin_dir.path()).join("unknown-0/pipe");
    std::fs::create_dir_all(&stray).unwrap();
    let m = node.manager();
    let report = m.recover().await.unwrap();
    assert_eq!(report.cleaned.len(), 1);
    assert!(!stray.exists());
}

#[tokio::test]
async fn a_crashed_daemon_is_restarted_with_its_limits() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let req = MpsConfig {
        active_thread_percentage: Some(30),
        ..Default::default()
    };
    prepare(&m, CLAIM_A, &mps(vec![gpu(&uuid)], req))
        .await
        .unwrap();
    let dir = node.daemon_dir(CLAIM_A, "0");
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let pipe_inode = inode(&dir.join("pipe"));
    kill9(pid);
    wait_until("a restarted daemon", || {
        m.mps_pid(CLAIM_A, "0")
            .is_some_and(|p| p != pid && alive(p))
    })
    .await;
    wait_until("the restarted daemon to answer with its limits", || {
        node.mps_client(&dir, "get_default_active_thread_percentage\n")
            .1
            == "30.0\n"
    })
    .await;
    assert_eq!(node.metrics.mps_daemon_restarts.get(), 1);
    // Containers keep their bind mount: the pipe directory is still the same inode.
    assert_eq!(inode(&dir.join("pipe")), pipe_inode);
    let new_pid = m.mps_pid(CLAIM_A, "0").unwrap();
    assert_eq!(node.compute_mode(4), ComputeMode::ExclusiveProcess);
    m.unprepare(CLAIM_A).await.unwrap();
    assert!(!alive(new_pid));
    assert_eq!(
        node.compute_mode(4),
        ComputeMode::Default,
        "the last user gone after a crash: compute mode restored"
    );
    assert_eq!(
        node.metrics.mps_daemon_restarts.get(),
        1,
        "an unprepare is not a crash"
    );
}

#[tokio::test]
async fn daemons_are_readopted_after_a_plugin_restart_or_restarted_if_dead() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let req = MpsConfig {
        active_thread_percentage: Some(60),
        ..Default::default()
    };
    let mut g1 = mps(vec![gpu(&node.gpu_uuid(4))], req.clone());
    g1.name = "g1".into();
    let mut g2 = mps(vec![gpu(&node.gpu_uuid(5))], req);
    g2.name = "g2".into();
    prepare(&m, CLAIM_A, &g1).await.unwrap();
    prepare(&m, CLAIM_B, &g2).await.unwrap();
    let pid1 = m.mps_pid(CLAIM_A, "g1").unwrap();
    let pid2 = m.mps_pid(CLAIM_B, "g2").unwrap();

    // The plugin goes away; its daemons keep running. One dies while the plugin is down.
    m.detach();
    drop(m);
    assert!(alive(pid1) && alive(pid2));
    kill9(pid2);
    wait_until("daemon 2 to die", || !alive(pid2)).await;

    let m = node.manager();
    let report = m.recover().await.unwrap();
    assert_eq!(report.adopted, [daemon_id(CLAIM_A, "g1")]);
    assert_eq!(report.restarted, [daemon_id(CLAIM_B, "g2")]);
    assert_eq!(m.mps_pid(CLAIM_A, "g1"), Some(pid1));
    let new2 = m.mps_pid(CLAIM_B, "g2").unwrap();
    assert_ne!(new2, pid2);
    assert_eq!(
        node.mps_client(
            &node.daemon_dir(CLAIM_B, "g2"),
            "get_default_active_thread_percentage\n"
        )
        .1,
        "60.0\n"
    );

    // The adopted daemon is supervised again: killing it gets it restarted.
    kill9(pid1);
    wait_until("the adopted daemon restarted", || {
        m.mps_pid(CLAIM_A, "g1")
            .is_some_and(|p| p != pid1 && alive(p))
    })
    .await;
    let new1 = m.mps_pid(CLAIM_A, "g1").unwrap();

    m.unprepare(CLAIM_A).await.unwrap();
    m.unprepare(CLAIM_B).await.unwrap();
    assert!(!alive(new1) && !alive(new2));
    assert_eq!(
        node_layout::mps_root_in(node.plugin_dir.path())
            .read_dir()
            .unwrap()
            .count(),
        0
    );
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    assert_eq!(node.compute_mode(5), ComputeMode::Default);
}

#[tokio::test]
async fn the_executor_applies_a_plan_group_with_edits_and_releases_without_state() {
    use gpu_dra_core::plan::{DeviceNodesNeed, DevicePlan, Plan, SharingGroup as PlanGroup};
    use gpu_dra_kubelet_plugin::sharing::SharingExecutor;

    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.gpu_uuid(4);
    let device = DevicePlan {
        device: "gpu-4".into(),
        request_names: vec!["gpu".into()],
        uuid: uuid.clone(),
        gpu_uuid: uuid.clone(),
        nodes: DeviceNodesNeed {
            gpu_minor: 4,
            mig: None,
        },
        admin_access: false,
        share_id: None,
        memory_share: None,
        shares: None,
        group: 0,
    };
    let decoded = gpu_dra_api::decode(&serde_json::json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 20,
            "defaultPerDevicePinnedMemoryLimit": {"0": "3Gi"}}}}))
    .unwrap();
    let plan = |claim: &str, sharing: Sharing| Plan {
        claim_uid: claim.into(),
        namespace: TENANT.into(),
        devices: vec![device.clone()],
        groups: vec![PlanGroup {
            name: "c0".into(),
            config_index: Some(0),
            sharing: Some(sharing),
            devices: vec![0],
        }],
    };
    let p = plan(CLAIM_A, decoded.sharing().unwrap().clone());
    let applied = m.apply(&p, &p.groups[0]).await.unwrap();
    assert!(applied.state.is_some());
    assert_eq!(
        applied.edits.env,
        ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    );
    let dir = node.daemon_dir(CLAIM_A, "c0");
    let (_, out) = node.mps_client(
        &dir,
        &format!(
            "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit {uuid}\n"
        ),
    );
    assert_eq!(out, "20.0\n3G\n");
    // A crash may lose the state the pipeline keeps; release works from the claim UID.
    m.release(CLAIM_A, None).await.unwrap();
    assert!(!dir.exists());
    assert_eq!(node.compute_mode(4), ComputeMode::Default);

    // Time-slicing, with the api crate's interval as the plan carries it.
    let p = plan(
        CLAIM_B,
        Sharing::TimeSlicing {
            interval: Interval::Short,
        },
    );
    m.apply(&p, &p.groups[0]).await.unwrap();
    assert_eq!(node.timeslice(4), 1);
    m.release(CLAIM_B, None).await.unwrap();
    assert_eq!(node.timeslice(4), 0);
}

#[tokio::test]
async fn after_a_reboot_recorded_sharing_is_forgotten_not_restarted_and_nvidia_dirs_are_kept() {
    let node = Node::new(PROFILE);
    let booted = |boot: &str| {
        let mut o = node.options();
        o.boot_id = Some(boot.to_owned());
        SharingManager::new(o, node.store(), node.metrics.clone()).unwrap()
    };
    let m = booted("boot-1");
    m.recover().await.unwrap();
    let req = MpsConfig {
        active_thread_percentage: Some(50),
        ..Default::default()
    };
    prepare(&m, CLAIM_A, &mps(vec![gpu(&node.gpu_uuid(4))], req))
        .await
        .unwrap();
    prepare(
        &m,
        CLAIM_B,
        &ts(vec![gpu(&node.gpu_uuid(5))], Interval::Long),
    )
    .await
    .unwrap();
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    assert_eq!(
        node.store().load().unwrap().boot_id.as_deref(),
        Some("boot-1")
    );
    // The reboot: the daemon is gone, the plugin starts in a new boot. NVIDIA's driver left
    // an MPS directory of a claim this plugin imported.
    m.detach();
    drop(m);
    kill9(pid);
    wait_until("the daemon to die", || !alive(pid)).await;
    let nvidia_dir =
        node_layout::mps_root_in(node.plugin_dir.path()).join("nvidia-claim-4e1a9/pipe");
    std::fs::create_dir_all(&nvidia_dir).unwrap();

    let m = booted("boot-2");
    m.keep_foreign_dirs(vec!["nvidia-claim-4e1a9".into()]);
    let report = m.recover().await.unwrap();
    assert_eq!(
        report.previous_boot,
        [daemon_id(CLAIM_A, "0"), node.gpu_uuid(5)]
    );
    assert!(
        report.restarted.is_empty() && report.adopted.is_empty(),
        "{report:?}"
    );
    assert_eq!(m.mps_pid(CLAIM_A, "0"), None);
    assert!(
        !node.daemon_dir(CLAIM_A, "0").exists(),
        "old daemon directory removed"
    );
    assert!(
        nvidia_dir.exists(),
        "NVIDIA's directory is not ours to remove"
    );
    let saved = node.store().load().unwrap();
    assert!(saved.mps.is_empty() && saved.time_slicing.is_empty());
    assert_eq!(saved.boot_id.as_deref(), Some("boot-2"));
    // The next prepare applies sharing again.
    prepare(
        &m,
        CLAIM_A,
        &mps(vec![gpu(&node.gpu_uuid(4))], MpsConfig::default()),
    )
    .await
    .unwrap();
    assert!(m.mps_pid(CLAIM_A, "0").is_some_and(alive));
    m.unprepare(CLAIM_A).await.unwrap();
}

/// A plugin that starts with sharing recorded for claims its checkpoint does not know (the
/// checkpoint was lost or replaced while the plugin was down) undoes it: nobody would ever
/// unprepare those claims. Sharing of known claims stays.
#[tokio::test]
async fn sharing_of_claims_the_checkpoint_does_not_know_is_undone_at_start() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let req = MpsConfig {
        active_thread_percentage: Some(40),
        ..Default::default()
    };
    prepare(&m, CLAIM_A, &mps(vec![gpu(&node.gpu_uuid(4))], req))
        .await
        .unwrap();
    let shared = ts(vec![gpu(&node.gpu_uuid(5))], Interval::Long);
    prepare(
        &m,
        CLAIM_A,
        &ts(vec![gpu(&node.gpu_uuid(6))], Interval::Short),
    )
    .await
    .unwrap();
    prepare(&m, CLAIM_B, &shared).await.unwrap();
    let pid = m.mps_pid(CLAIM_A, "0").unwrap();
    m.detach();
    drop(m);
    assert_eq!(node.compute_mode(4), ComputeMode::ExclusiveProcess);
    assert_eq!(node.timeslice(5), 3);
    assert_eq!(node.timeslice(6), 1);

    // Only claim B is in the checkpoint.
    let m = node.manager();
    m.keep_claims([CLAIM_B.to_string()].into());
    let report = m.recover().await.unwrap();
    assert_eq!(report.released, [CLAIM_A]);
    assert!(report.adopted.is_empty() && report.restarted.is_empty());
    assert!(!alive(pid), "the unknown claim's daemon is stopped");
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    assert_eq!(node.timeslice(6), 0, "its time-sliced GPU is reset");
    assert_eq!(node.timeslice(5), 3, "the known claim keeps its GPU");
    assert!(!node.daemon_dir(CLAIM_A, "0").exists());

    // Neither is known: the last time-sliced GPU goes back to default too.
    drop(m);
    let m = node.manager();
    m.keep_claims(Default::default());
    assert_eq!(m.recover().await.unwrap().released, [CLAIM_B]);
    assert_eq!(node.timeslice(5), 0);
    assert_eq!(m.state().time_slicing.len() + m.state().mps.len(), 0);
}

/// A share of GPU `index` of `node`: `gib` of its 40Gi.
fn share(node: &Node, index: usize, gib: u64) -> SharedDevice {
    SharedDevice {
        share: Some(gpu_dra_core::memory_shares::MemoryShare {
            bytes: gib << 30,
            total_bytes: 40 << 30,
            compute_capability: (8, 0),
        }),
        ..gpu(&node.gpu_uuid(index))
    }
}

#[tokio::test]
async fn memory_shares_of_a_gpu_share_one_daemon_started_first_and_stopped_last() {
    use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER as OWNER;
    const CLAIM_C: &str = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d";
    let node = Node::new(PROFILE);
    let m = node.manager();
    let gpu4 = node.gpu_uuid(4);
    let a = prepare(
        &m,
        CLAIM_A,
        &mps(vec![share(&node, 4, 10)], MpsConfig::default()),
    )
    .await
    .unwrap();
    let pid = m.mps_pid(OWNER, &gpu4).expect("the GPU's daemon");
    assert_eq!(node.compute_mode(4), ComputeMode::ExclusiveProcess);
    assert!(
        a.env
            .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G".to_string()),
        "{:?}",
        a.env
    );
    assert!(
        a.env
            .contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_string())
    );
    // The daemon has no defaults of its own: each client brings its limits.
    assert_eq!(
        node.mps_client(
            &node.daemon_dir(OWNER, &gpu4),
            "get_default_active_thread_percentage\n"
        )
        .1,
        "100.0\n"
    );
    let config = MpsConfig {
        active_thread_percentage: Some(70),
        ..Default::default()
    };
    let b = prepare(&m, CLAIM_B, &mps(vec![share(&node, 4, 20)], config))
        .await
        .unwrap();
    assert_eq!(m.mps_pid(OWNER, &gpu4), Some(pid), "the same daemon");
    assert_eq!(a.mounts, b.mounts, "the same pipe directory");
    assert!(
        b.env
            .contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70".to_string())
    );
    assert!(
        b.env
            .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20G".to_string())
    );
    // Repeating a prepare changes nothing.
    prepare(
        &m,
        CLAIM_A,
        &mps(vec![share(&node, 4, 10)], MpsConfig::default()),
    )
    .await
    .unwrap();

    // A plugin restart re-adopts the shared daemon with its claims.
    m.detach();
    drop(m);
    let m = node.manager();
    m.keep_claims([CLAIM_A.to_string(), CLAIM_B.to_string()].into());
    let report = m.recover().await.unwrap();
    assert_eq!(report.adopted, [daemon_id(OWNER, &gpu4)]);
    let c = prepare(
        &m,
        CLAIM_C,
        &mps(vec![share(&node, 4, 10)], MpsConfig::default()),
    )
    .await
    .unwrap();
    assert_eq!(c.mounts, a.mounts);
    assert_eq!(m.mps_pid(OWNER, &gpu4), Some(pid));

    // Time-slicing cannot take the GPU while MPS shares hold it.
    let err = prepare(&m, "ts-claim", &ts(vec![gpu(&gpu4)], Interval::Long))
        .await
        .expect_err("conflict");
    assert!(matches!(err, SharingError::Conflict { .. }), "{err}");

    // Stopped with the last claim, not before.
    m.unprepare(CLAIM_A).await.unwrap();
    m.unprepare(CLAIM_B).await.unwrap();
    assert!(alive(pid));
    assert_eq!(node.compute_mode(4), ComputeMode::ExclusiveProcess);
    m.unprepare(CLAIM_C).await.unwrap();
    assert!(!alive(pid));
    assert_eq!(m.mps_pid(OWNER, &gpu4), None);
    assert_eq!(node.compute_mode(4), ComputeMode::Default);
    m.unprepare(CLAIM_C).await.unwrap();
}

/// A shared daemon serves one namespace at a time: any of its clients can stop it (its
/// `control` socket takes `quit` from a root peer), so a share of the device for a second
/// namespace is refused while the first holds one, also after a plugin restart, and prepared
/// once the first namespace's claims are gone. Clients get the pipe directory read-only.
#[tokio::test]
async fn a_shared_mps_daemon_serves_one_namespace_at_a_time() {
    use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER as OWNER;
    const CLAIM_C: &str = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d";
    let node = Node::new(PROFILE);
    let m = node.manager();
    let gpu4 = node.gpu_uuid(4);
    let id = daemon_id(OWNER, &gpu4);
    let group = mps(vec![share(&node, 4, 10)], MpsConfig::default());
    let a = prepare_in(&m, "tenant-a", CLAIM_A, &group).await.unwrap();
    assert!(
        a.mounts
            .iter()
            .all(|mount| mount.options.iter().any(|o| o == "ro")
                && !mount.options.iter().any(|o| o == "rw")),
        "the pipe directory must reach clients read-only: {:?}",
        a.mounts
    );
    let pid = m.mps_pid(OWNER, &gpu4).expect("the GPU's daemon");

    let refused = |err: SharingError| {
        let msg = err.to_string();
        assert!(matches!(err, SharingError::Conflict { .. }), "{msg}");
        assert!(
            msg.contains("\"tenant-a\"") && msg.contains("\"tenant-b\""),
            "the refusal names both namespaces: {msg}"
        );
    };
    refused(
        prepare_in(&m, "tenant-b", CLAIM_B, &group)
            .await
            .expect_err("another namespace on the same daemon"),
    );
    assert_eq!(
        m.state().mps[&id].share_claims,
        [CLAIM_A.to_string()].into(),
        "a refused claim is not recorded"
    );
    // The same namespace joins the daemon.
    let c = prepare_in(&m, "tenant-a", CLAIM_C, &group).await.unwrap();
    assert_eq!(c.mounts, a.mounts);
    assert_eq!(m.mps_pid(OWNER, &gpu4), Some(pid));

    // The rule survives a plugin restart (the namespace is in the state).
    m.detach();
    drop(m);
    let m = node.manager();
    m.keep_claims([CLAIM_A.to_string(), CLAIM_C.to_string()].into());
    assert_eq!(
        m.recover().await.unwrap().adopted,
        std::slice::from_ref(&id)
    );
    refused(
        prepare_in(&m, "tenant-b", CLAIM_B, &group)
            .await
            .expect_err("still another namespace"),
    );

    // The first namespace gone, the second gets the device, on a daemon of its own.
    m.unprepare(CLAIM_A).await.unwrap();
    m.unprepare(CLAIM_C).await.unwrap();
    assert!(!alive(pid));
    prepare_in(&m, "tenant-b", CLAIM_B, &group).await.unwrap();
    let pid_b = m.mps_pid(OWNER, &gpu4).expect("a daemon for tenant-b");
    assert_ne!(pid_b, pid);
    assert_eq!(m.state().mps[&id].namespace.as_deref(), Some("tenant-b"));
    m.unprepare(CLAIM_B).await.unwrap();
    assert!(!alive(pid_b));
}

/// The arguments `pid` runs with, after the program.
fn daemon_args(pid: u32) -> Vec<String> {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
        .split('\0')
        .skip(1)
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_claims_daemon_runs_multi_user_only_when_its_config_says_so() {
    let node = Node::new(PROFILE);
    let m = node.manager();
    let multi_user = MpsConfig {
        multi_user: true,
        ..Default::default()
    };
    prepare(&m, CLAIM_A, &mps(vec![gpu(&node.gpu_uuid(4))], multi_user))
        .await
        .unwrap();
    let pid = m.mps_pid(CLAIM_A, "0").expect("daemon");
    assert_eq!(daemon_args(pid), ["-f", "-M"]);
    prepare(
        &m,
        CLAIM_B,
        &mps(vec![gpu(&node.gpu_uuid(5))], MpsConfig::default()),
    )
    .await
    .unwrap();
    let pid = m.mps_pid(CLAIM_B, "0").expect("daemon");
    assert_eq!(
        daemon_args(pid),
        ["-f"],
        "one claim's daemon keeps its mode"
    );
    m.unprepare(CLAIM_A).await.unwrap();
    m.unprepare(CLAIM_B).await.unwrap();
}

#[tokio::test]
async fn a_memory_share_daemon_runs_multi_user_where_the_gpu_supports_it() {
    use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER as OWNER;
    let node = Node::new(PROFILE);
    let m = node.manager();
    prepare(
        &m,
        CLAIM_A,
        &mps(vec![share(&node, 4, 10)], MpsConfig::default()),
    )
    .await
    .unwrap();
    let pid = m.mps_pid(OWNER, &node.gpu_uuid(4)).expect("daemon");
    assert_eq!(
        daemon_args(pid),
        ["-f", "-M"],
        "claims' pods of different users share its server"
    );
    // A GPU older than Volta cannot: one user's pods at a time (docs/STATUS.md).
    let mut pascal = share(&node, 5, 10);
    if let Some(s) = pascal.share.as_mut() {
        s.compute_capability = (6, 1);
    }
    prepare(&m, CLAIM_B, &mps(vec![pascal], MpsConfig::default()))
        .await
        .unwrap();
    let pid = m.mps_pid(OWNER, &node.gpu_uuid(5)).expect("daemon");
    assert_eq!(daemon_args(pid), ["-f"]);
    m.unprepare(CLAIM_A).await.unwrap();
    m.unprepare(CLAIM_B).await.unwrap();
}

/// Consumable shares: two claims holding one MIG device as shares (no memory consumed, as in
/// NVIDIA's `unlimited` and `<N>` modes) join one MPS daemon serving that MIG device, which
/// sets no compute mode (the parent GPU stays DEFAULT) and stops with the last claim. The
/// clients get only the limits their configs set.
#[tokio::test]
async fn shares_of_a_mig_device_join_its_one_daemon() {
    use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER as OWNER;
    let node = Node::new(PROFILE);
    let m = node.manager();
    let uuid = node.mig_uuid(0);
    let device = SharedDevice {
        share: Some(gpu_dra_core::memory_shares::MemoryShare {
            bytes: 0,
            total_bytes: 4864 << 20,
            compute_capability: (8, 0),
        }),
        ..mig(&uuid)
    };
    let a = prepare(
        &m,
        CLAIM_A,
        &mps(vec![device.clone()], MpsConfig::default()),
    )
    .await
    .unwrap();
    let pid = m.mps_pid(OWNER, &uuid).expect("the MIG device's daemon");
    assert!(
        !a.env.iter().any(|e| e.starts_with("CUDA_MPS_PINNED")),
        "no memory consumed, no limit: {:?}",
        a.env
    );
    let config = MpsConfig {
        active_thread_percentage: Some(40),
        ..Default::default()
    };
    let b = prepare(&m, CLAIM_B, &mps(vec![device.clone()], config))
        .await
        .unwrap();
    assert_eq!(m.mps_pid(OWNER, &uuid), Some(pid), "the same daemon");
    assert_eq!(a.mounts, b.mounts);
    assert!(
        b.env
            .contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40".to_string()),
        "{:?}",
        b.env
    );
    assert!(environ(pid).contains(&format!("CUDA_VISIBLE_DEVICES={uuid}\n")));
    assert_eq!(node.compute_mode(0), ComputeMode::Default);
    m.unprepare(CLAIM_A).await.unwrap();
    assert!(alive(pid));
    m.unprepare(CLAIM_B).await.unwrap();
    assert!(!alive(pid));
    assert_eq!(m.mps_pid(OWNER, &uuid), None);
}
