//! `gpu-dra check --workload`: the end-to-end check. In a namespace of its own (generated name
//! `gpu-dra-check-*`, created and deleted by the check), a ResourceClaim for one device of the
//! GPU DeviceClass and a pod using it (pinned to `--node` by a node selector, or on any GPU
//! node) that runs `nvidia-smi -L` from the driver tools the CDI spec injects. It passes only
//! when the pod completes and its log lists exactly one GPU whose UUID is the `uuid` attribute
//! of the device the claim was allocated (from the claim's status and our ResourceSlice).
//!
//! [`run`] is the thin shell that creates, waits, reads and deletes; [`judge`] is the pure
//! decision from what was observed ([`Observed`]) to the [`CheckResult`], tested with fixtures.
//! The namespace is deleted on every path (passed, failed, timed out); a failed deletion is
//! said in the result.
//!
//! The command runs without a shell (the driver's image, the default, has none): it is split
//! into words as a shell would (quotes kept together), so `sh -c '...'` works in images that
//! have one.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use serde_json::json;

use super::checks::{CheckResult, Status};

/// Name of the check.
pub const NAME: &str = "workload";
/// Its title.
pub const TITLE: &str = "a one-GPU pod sees exactly its GPU";
/// The default command.
pub const DEFAULT_COMMAND: &str = "nvidia-smi -L";
/// Name of the claim, the pod's claim entry and its container.
const OBJECT: &str = "gpu-dra-check";
/// How often the pod and claim are read while waiting: often, since the claim's allocation
/// can be read only while the pod runs (a quick command runs for a second or two).
const POLL: Duration = Duration::from_millis(250);

/// Settings of the workload check.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Driver name (of our slices).
    pub driver: String,
    /// DeviceClass of the claim.
    pub gpu_class: String,
    /// Node to run on; any node with a fitting device when `None`.
    pub node: Option<String>,
    /// Image of the pod.
    pub image: String,
    /// Command and arguments.
    pub command: Vec<String>,
    /// How long the pod may take to complete.
    pub timeout: Duration,
}

/// The device the claim was allocated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// `pool/device`.
    pub device: String,
    /// Its `uuid` attribute in our ResourceSlice; `None` when the slice or attribute is absent.
    pub uuid: Option<String>,
}

/// What the check saw of its claim and pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// The namespace the check made.
    pub namespace: String,
    /// Why the namespace, claim or pod could not be created.
    pub setup_error: Option<String>,
    /// The node the pod was bound to.
    pub node: Option<String>,
    /// The device the claim got; `None` when not allocated.
    pub allocated: Option<AllocatedDevice>,
    /// The pod's `status.phase` when the wait ended.
    pub phase: String,
    /// The message of the pod's `PodScheduled=False` condition (the scheduler's reason).
    pub unschedulable: Option<String>,
    /// Why its container waits (`ImagePullBackOff: ...`, `CreateContainerError: ...`).
    pub waiting: Option<String>,
    /// Its container's exit code, when it ended.
    pub exit_code: Option<i32>,
    /// Its log, or why it could not be read; `None` when the pod did not complete.
    pub log: Option<Result<String, String>>,
    /// Warning Events of the namespace: (reason, message).
    pub events: Vec<(String, String)>,
    /// The pod did not complete within the timeout.
    pub timed_out: bool,
    /// The timeout, seconds.
    pub timeout_s: u64,
    /// Seconds from the claim's creation to the end of the wait.
    pub seconds: f64,
    /// Why the namespace could not be deleted, when it could not.
    pub cleanup_error: Option<String>,
}

/// The GPUs an `nvidia-smi -L` output lists: the UUID of each `GPU <i>: ... (UUID: ...)` line
/// (MIG devices, indented under their GPU, are not GPUs).
pub fn gpus_listed(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.starts_with("GPU "))
        .filter_map(|l| {
            let start = l.find("(UUID: ")? + "(UUID: ".len();
            let end = l[start..].find(')')? + start;
            Some(l[start..end].trim().to_owned())
        })
        .collect()
}

/// Splits a command line into words as a shell does: whitespace separates, single and double
/// quotes keep what they enclose together, a backslash outside single quotes escapes the next
/// character. No expansion.
pub fn split_command(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err(format!("{s:?}: a single quote is not closed")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c) => word.push(c),
                            None => return Err(format!("{s:?}: a double quote is not closed")),
                        },
                        Some(c) => word.push(c),
                        None => return Err(format!("{s:?}: a double quote is not closed")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    word.push(c);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    if words.is_empty() {
        return Err("the workload command is empty; e.g. \"nvidia-smi -L\"".into());
    }
    Ok(words)
}

/// The verdict from what was observed.
pub fn judge(o: &Observed) -> CheckResult {
    let mut detail = Vec::new();
    let result = |status, detail, fix: Option<String>| CheckResult {
        name: NAME,
        title: TITLE,
        status,
        detail,
        fix,
    };
    let cleanup_line = |detail: &mut Vec<String>| {
        if let Some(e) = &o.cleanup_error {
            detail.push(format!(
                "namespace {} could not be deleted: {e}",
                o.namespace
            ));
        }
    };
    let delete_fix = format!("kubectl delete namespace {}", o.namespace);
    if let Some(e) = &o.setup_error {
        detail.push(e.clone());
        cleanup_line(&mut detail);
        return result(
            Status::Failed,
            detail,
            Some(
                "run the check with rights to create and delete namespaces and to create \
                 resourceclaims and pods in them (and read their logs, events and \
                 resourceslices)"
                    .into(),
            ),
        );
    }
    if let Some(node) = &o.node {
        detail.push(format!("node {node}"));
    }
    if let Some(a) = &o.allocated {
        detail.push(format!(
            "device {} (UUID {})",
            a.device,
            a.uuid.as_deref().unwrap_or("unknown")
        ));
    }
    let (status, fix) = verdict(o, &mut detail);
    detail.push(format!("{:.1}s", o.seconds));
    cleanup_line(&mut detail);
    match (status, &o.cleanup_error) {
        (Status::Passed, Some(_)) => result(Status::Warning, detail, Some(delete_fix)),
        (Status::Passed, None) => result(Status::Passed, detail, None),
        (status, _) => result(status, detail, fix),
    }
}

/// Passed, or failed with the fix; adds what explains it to `detail`.
fn verdict(o: &Observed, detail: &mut Vec<String>) -> (Status, Option<String>) {
    let failed = |fix: String| (Status::Failed, Some(fix));
    let prepare = o
        .events
        .iter()
        .find(|(reason, _)| reason == "FailedPrepareDynamicResources");
    match &o.log {
        Some(Ok(log)) => {
            let seen = gpus_listed(log);
            detail.push(match seen.as_slice() {
                [] => "no GPU seen".to_owned(),
                [one] => format!("UUID seen {one}"),
                many => format!("{} GPUs seen: {}", many.len(), many.join(", ")),
            });
            if o.phase != "Succeeded" {
                detail.push(format!(
                    "the command ended with exit code {} (phase {}); log: {}",
                    o.exit_code.map_or("unknown".into(), |c| c.to_string()),
                    o.phase,
                    log.trim()
                ));
                return failed(
                    "the command failed in the container: see its log above; the driver's \
                     tools (nvidia-smi) come from the CDI spec of the claim's device — check \
                     the plugin's log on that node, or pass --workload-image with an image \
                     that can run the command"
                        .into(),
                );
            }
            let Some(a) = &o.allocated else {
                return failed(
                    "the claim's allocation was not seen while its pod ran (the pod ended \
                     before the first read, or the claim's status could not be read): rerun \
                     the check with a command that runs longer, e.g. \
                     --workload-command \"sh -c 'nvidia-smi -L; sleep 5'\" in an image with a \
                     shell"
                        .into(),
                );
            };
            let Some(uuid) = &a.uuid else {
                return failed(format!(
                    "device {} has no uuid attribute in a ResourceSlice of the driver: check \
                     the slices with kubectl get resourceslices -o yaml",
                    a.device
                ));
            };
            match seen.as_slice() {
                [] => failed(format!(
                    "the container lists no GPU (log: {}): the device's CDI spec did not give \
                     it the GPU or nvidia-smi; check the plugin's log and the CDI specs it \
                     wrote on the node",
                    log.trim()
                )),
                [one] if one == uuid => (Status::Passed, None),
                [one] => failed(format!(
                    "the container sees {one}, not {uuid} that its claim was allocated: the \
                     device's CDI spec or the container runtime hands out the wrong GPU; check \
                     the CDI spec the plugin wrote for the claim and NVIDIA_VISIBLE_DEVICES in \
                     the image"
                )),
                _ => failed(format!(
                    "the container sees GPUs it was not allocated (only {uuid} is its own): \
                     the container runtime exposes every GPU (nvidia-container-runtime with \
                     NVIDIA_VISIBLE_DEVICES=all, or a privileged pod); configure the runtime \
                     for CDI only (accept-nvidia-visible-devices-envvar-when-unprivileged = \
                     false)"
                )),
            }
        }
        Some(Err(e)) => {
            detail.push(format!("phase {}: its log could not be read: {e}", o.phase));
            failed("check that the API server can read logs from the node's kubelet".into())
        }
        None => {
            detail.push(format!(
                "the pod did not complete{} (phase {})",
                if o.timed_out {
                    format!(" within {}s", o.timeout_s)
                } else {
                    String::new()
                },
                if o.phase.is_empty() {
                    "unknown"
                } else {
                    &o.phase
                }
            ));
            if let Some((_, message)) = prepare {
                detail.push(format!("FailedPrepareDynamicResources: {message}"));
                return failed(format!(
                    "the node's plugin could not prepare the claim's device: see the message \
                     and the plugin's log on {} (kubectl logs -n <release namespace> the \
                     kubelet-plugin pod of that node)",
                    o.node.as_deref().unwrap_or("the node")
                ));
            }
            if let Some(message) = &o.unschedulable {
                detail.push(format!("Pending, not scheduled: {message}"));
                return failed(
                    "no node has a free device of the GPU class that the pod may use: check \
                     that the node is Ready and has a plugin and slices (the checks above), \
                     that its devices are not all allocated or tainted (gpu-dra usage), and \
                     the node's taints"
                        .into(),
                );
            }
            if let Some(waiting) = &o.waiting {
                detail.push(format!("container waiting: {waiting}"));
                if waiting.contains("ImagePull") || waiting.contains("ErrImage") {
                    return failed(
                        "the node cannot pull the image: pass --workload-image with an image \
                         it can pull"
                            .into(),
                    );
                }
                return failed(
                    "the container cannot start: see the reason; kubectl describe pod shows \
                     the kubelet's events (rerun the check to keep it failing the same way)"
                        .into(),
                );
            }
            for (reason, message) in &o.events {
                detail.push(format!("event {reason}: {message}"));
            }
            failed(format!(
                "the pod did not finish in time: raise --workload-timeout (now {}s) or look at \
                 the events above",
                o.timeout_s
            ))
        }
    }
}

/// Runs the workload: creates the namespace, claim and pod, waits for the pod, reads what it
/// saw and deletes the namespace; returns the verdict.
pub async fn run(client: &kube::Client, opts: &WorkloadOptions) -> CheckResult {
    let mut o = Observed {
        timeout_s: opts.timeout.as_secs(),
        ..Observed::default()
    };
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = match serde_json::from_value(json!({
        "metadata": {"generateName": "gpu-dra-check-",
            "labels": {"app.kubernetes.io/managed-by": "gpu-dra-check"}},
    })) {
        Ok(ns) => ns,
        Err(e) => {
            o.setup_error = Some(format!("namespace object: {e}"));
            return judge(&o);
        }
    };
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(created) => o.namespace = created.metadata.name.unwrap_or_default(),
        Err(e) => {
            o.setup_error = Some(format!("cannot create a namespace: {e}"));
            return judge(&o);
        }
    }
    let start = Instant::now();
    if let Err(e) = observe(client, opts, &mut o, start).await {
        o.setup_error = Some(e);
    }
    o.seconds = start.elapsed().as_secs_f64();
    if let Err(e) = namespaces
        .delete(&o.namespace, &DeleteParams::background())
        .await
    {
        o.cleanup_error = Some(e.to_string());
    }
    judge(&o)
}

/// Creates the claim and pod in `o.namespace` and fills `o` with what they show; `Err` when
/// they could not be created.
async fn observe(
    client: &kube::Client,
    opts: &WorkloadOptions,
    o: &mut Observed,
    start: Instant,
) -> Result<(), String> {
    let ns = o.namespace.clone();
    let deadline = start + opts.timeout;
    // The serviceaccount controller creates "default" shortly after the namespace; a pod
    // created before is refused by the ServiceAccount admission.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    while accounts.get_opt("default").await.ok().flatten().is_none() {
        if Instant::now() >= deadline {
            return Err(format!(
                "namespace {ns} got no default ServiceAccount within {}s",
                opts.timeout.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &ns);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": OBJECT},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": opts.gpu_class, "allocationMode": "ExactCount", "count": 1}}]}},
    }))
    .map_err(|e| format!("claim object: {e}"))?;
    claims
        .create(&PostParams::default(), &claim)
        .await
        .map_err(|e| format!("cannot create ResourceClaim {ns}/{OBJECT}: {e}"))?;
    let mut spec = json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": false,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "containers": [{"name": OBJECT, "image": opts.image, "command": opts.command,
            "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": OBJECT}],
    });
    if let Some(node) = &opts.node {
        spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    }
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": OBJECT}, "spec": spec}))
        .map_err(|e| format!("pod object: {e}"))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(|e| format!("cannot create pod {ns}/{OBJECT}: {e}"))?;

    let mut last: Option<Pod> = None;
    loop {
        // Read while the pod runs: once it ends, its claim is no longer reserved and the
        // resourceclaim controller deallocates it.
        if o.allocated.is_none()
            && let Ok(c) = claims.get(OBJECT).await
        {
            o.allocated = allocated(client, &opts.driver, &c).await;
        }
        if let Ok(p) = pods.get(OBJECT).await {
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            last = Some(p);
            if phase == "Succeeded" || phase == "Failed" {
                break;
            }
        }
        if Instant::now() >= deadline {
            o.timed_out = true;
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    if let Some(p) = &last {
        pod_state(p, o);
    }
    if !o.timed_out {
        o.log = Some(
            pods.logs(
                OBJECT,
                &LogParams {
                    container: Some(OBJECT.into()),
                    ..LogParams::default()
                },
            )
            .await
            .map_err(|e| e.to_string()),
        );
    }
    if o.allocated.is_none()
        && let Ok(c) = claims.get(OBJECT).await
    {
        o.allocated = allocated(client, &opts.driver, &c).await;
    }
    if let Ok(events) = Api::<Event>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
    {
        o.events = events
            .items
            .iter()
            .filter(|e| e.type_.as_deref() == Some("Warning"))
            .map(|e| {
                (
                    e.reason.clone().unwrap_or_default(),
                    e.message.clone().unwrap_or_default(),
                )
            })
            .collect();
    }
    Ok(())
}

/// The pod's node, phase, scheduling condition and container state into `o`.
fn pod_state(p: &Pod, o: &mut Observed) {
    o.node = p.spec.as_ref().and_then(|s| s.node_name.clone());
    let Some(status) = &p.status else {
        return;
    };
    o.phase = status.phase.clone().unwrap_or_default();
    o.unschedulable = status.conditions.iter().flatten().find_map(|c| {
        (c.type_ == "PodScheduled" && c.status == "False").then(|| {
            format!(
                "{}: {}",
                c.reason.as_deref().unwrap_or("Unschedulable"),
                c.message.as_deref().unwrap_or_default()
            )
        })
    });
    let state = status
        .container_statuses
        .iter()
        .flatten()
        .find_map(|c| c.state.as_ref());
    if let Some(state) = state {
        o.waiting = state.waiting.as_ref().map(|w| {
            format!(
                "{}: {}",
                w.reason.as_deref().unwrap_or_default(),
                w.message.as_deref().unwrap_or_default()
            )
        });
        o.exit_code = state.terminated.as_ref().map(|t| t.exit_code);
    }
}

/// The claim's one allocated device and its `uuid` attribute in the driver's slices.
async fn allocated(
    client: &kube::Client,
    driver: &str,
    claim: &ResourceClaim,
) -> Option<AllocatedDevice> {
    let result = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .iter()
        .flatten()
        .next()?
        .clone();
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await
        .ok();
    let qualified = format!("{driver}/uuid");
    let uuid = slices.iter().flat_map(|l| &l.items).find_map(|s| {
        if s.spec.pool.name != result.pool {
            return None;
        }
        let device = s
            .spec
            .devices
            .iter()
            .flatten()
            .find(|d| d.name == result.device)?;
        let attrs = device.attributes.as_ref()?;
        attrs
            .get("uuid")
            .or_else(|| attrs.get(&qualified))?
            .string
            .clone()
    });
    Some(AllocatedDevice {
        device: format!("{}/{}", result.pool, result.device),
        uuid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const OTHER: &str = "GPU-99999999-2222-3333-4444-555555555555";

    /// A pod that ran on node-a with device node-a/gpu-0 allocated and printed `log`.
    fn completed(log: &str) -> Observed {
        Observed {
            namespace: "gpu-dra-check-x1".into(),
            node: Some("node-a".into()),
            allocated: Some(AllocatedDevice {
                device: "node-a/gpu-0".into(),
                uuid: Some(UUID.into()),
            }),
            phase: "Succeeded".into(),
            exit_code: Some(0),
            log: Some(Ok(log.into())),
            timeout_s: 120,
            seconds: 4.2,
            ..Observed::default()
        }
    }

    /// A pod still Pending when the wait ended.
    fn pending() -> Observed {
        Observed {
            namespace: "gpu-dra-check-x1".into(),
            phase: "Pending".into(),
            timed_out: true,
            timeout_s: 120,
            seconds: 120.0,
            ..Observed::default()
        }
    }

    fn line(uuid: &str, i: u32) -> String {
        format!("GPU {i}: Tesla T4 (UUID: {uuid})\n")
    }

    #[test]
    fn its_own_gpu_alone_passes_with_node_device_uuid_and_seconds() {
        let r = judge(&completed(&line(UUID, 0)));
        assert_eq!(r.status, Status::Passed, "{r:?}");
        assert_eq!(r.name, "workload");
        assert_eq!(r.fix, None);
        assert_eq!(
            r.detail,
            vec![
                "node node-a".to_owned(),
                format!("device node-a/gpu-0 (UUID {UUID})"),
                format!("UUID seen {UUID}"),
                "4.2s".to_owned(),
            ]
        );
    }

    #[test]
    fn several_gpus_seen_fail() {
        let r = judge(&completed(&(line(UUID, 0) + &line(OTHER, 1))));
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail.iter().any(|l| l.starts_with("2 GPUs seen")),
            "{r:?}"
        );
        assert!(r.fix.as_deref().unwrap().contains("not allocated"), "{r:?}");
    }

    #[test]
    fn the_wrong_gpu_fails() {
        let r = judge(&completed(&line(OTHER, 0)));
        assert_eq!(r.status, Status::Failed, "{r:?}");
        let fix = r.fix.unwrap();
        assert!(fix.contains(&format!("sees {OTHER}, not {UUID}")), "{fix}");
    }

    #[test]
    fn no_gpu_seen_and_a_device_without_uuid_fail() {
        let r = judge(&completed("No devices found.\n"));
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(r.detail.contains(&"no GPU seen".to_owned()), "{r:?}");
        let mut o = completed(&line(UUID, 0));
        o.allocated.as_mut().unwrap().uuid = None;
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(r.fix.unwrap().contains("no uuid attribute"));
    }

    #[test]
    fn a_failed_command_fails_with_its_exit_code_and_log() {
        let mut o = completed("sh: nvidia-smi: not found\n");
        o.phase = "Failed".into();
        o.exit_code = Some(127);
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("exit code 127") && l.contains("not found")),
            "{r:?}"
        );
    }

    #[test]
    fn pending_fails_with_the_schedulers_reason() {
        let mut o = pending();
        o.unschedulable =
            Some("Unschedulable: 0/2 nodes are available: 2 cannot allocate all claims.".into());
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("did not complete within 120s (phase Pending)")),
            "{r:?}"
        );
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("not scheduled: Unschedulable: 0/2 nodes")),
            "{r:?}"
        );
        assert!(r.fix.unwrap().contains("free device"));
    }

    #[test]
    fn a_prepare_failure_fails_with_its_message_and_the_node() {
        let mut o = pending();
        o.node = Some("node-b".into());
        o.allocated = Some(AllocatedDevice {
            device: "node-b/gpu-1".into(),
            uuid: Some(UUID.into()),
        });
        o.events = vec![
            ("FailedMount".into(), "unrelated".into()),
            (
                "FailedPrepareDynamicResources".into(),
                "prepare dynamic resources: NVML: GPU is lost".into(),
            ),
        ];
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail.contains(
                &"FailedPrepareDynamicResources: prepare dynamic resources: NVML: GPU is lost"
                    .to_owned()
            ),
            "{r:?}"
        );
        assert!(r.fix.unwrap().contains("node-b"));
    }

    #[test]
    fn an_image_that_cannot_be_pulled_names_the_flag() {
        let mut o = pending();
        o.node = Some("node-a".into());
        o.waiting = Some("ImagePullBackOff: Back-off pulling image \"x\"".into());
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(r.fix.unwrap().contains("--workload-image"));
    }

    #[test]
    fn a_timeout_without_other_reason_names_the_timeout_flag() {
        let mut o = pending();
        o.phase = "Running".into();
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("did not complete within 120s (phase Running)")),
            "{r:?}"
        );
        assert!(r.fix.unwrap().contains("--workload-timeout (now 120s)"));
    }

    #[test]
    fn setup_errors_and_failed_deletions_are_said() {
        let o = Observed {
            setup_error: Some("cannot create a namespace: forbidden".into()),
            ..Observed::default()
        };
        let r = judge(&o);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert_eq!(r.detail[0], "cannot create a namespace: forbidden");
        // A pass whose namespace stays is a warning that says how to remove it.
        let mut o = completed(&line(UUID, 0));
        o.cleanup_error = Some("forbidden".into());
        let r = judge(&o);
        assert_eq!(r.status, Status::Warning, "{r:?}");
        assert!(
            r.detail
                .contains(&"namespace gpu-dra-check-x1 could not be deleted: forbidden".to_owned())
        );
        assert_eq!(
            r.fix.as_deref(),
            Some("kubectl delete namespace gpu-dra-check-x1")
        );
    }

    /// An API server for [`run`]: the pod ends in `phase` (after one read as Running), its
    /// claim is allocated node-a/gpu-0 only while it runs; every request is recorded.
    fn fake_api_server(
        phase: &'static str,
        log: &'static str,
    ) -> (kube::Client, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use std::sync::{Arc, Mutex};
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let record = seen.clone();
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let record = record.clone();
            async move {
                let path = req.uri().path().to_owned();
                let call = format!("{} {path}", req.method());
                let (reads, pod_reads) = {
                    let mut calls = record.lock().expect("lock");
                    calls.push(call.clone());
                    let pod = "GET /api/v1/namespaces/gpu-dra-check-x1/pods/gpu-dra-check";
                    (
                        calls.iter().filter(|c| *c == &call).count(),
                        calls.iter().filter(|c| *c == pod).count(),
                    )
                };
                let ns = "/api/v1/namespaces/gpu-dra-check-x1";
                let claim = "/apis/resource.k8s.io/v1/namespaces/gpu-dra-check-x1/resourceclaims";
                let body = match (req.method().as_str(), path.as_str()) {
                    ("POST", "/api/v1/namespaces") => {
                        json!({"metadata": {"name": "gpu-dra-check-x1"}})
                    }
                    ("GET", p) if p == format!("{ns}/pods/gpu-dra-check/log") => {
                        return Ok::<_, std::convert::Infallible>(http::Response::new(
                            kube::client::Body::from(log.as_bytes().to_vec()),
                        ));
                    }
                    ("GET", p) if p == format!("{ns}/pods/gpu-dra-check") => {
                        let phase = if reads > 1 { phase } else { "Running" };
                        json!({"metadata": {"name": "gpu-dra-check"},
                            "spec": {"nodeName": "node-a", "containers": []},
                            "status": {"phase": phase, "conditions": [
                                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/1 nodes are available"}]}})
                    }
                    // Deallocated once the pod ended, as the resourceclaim controller does.
                    ("GET", p) if p == format!("{claim}/gpu-dra-check") && pod_reads > 1 => {
                        json!({"metadata": {"name": "gpu-dra-check"}, "spec": {}})
                    }
                    ("GET", p) if p == format!("{claim}/gpu-dra-check") => {
                        json!({"metadata": {"name": "gpu-dra-check"}, "spec": {},
                            "status": {"allocation": {"devices": {"results": [{"request": "gpu",
                                "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]}}}})
                    }
                    ("GET", "/apis/resource.k8s.io/v1/resourceslices") => {
                        json!({"metadata": {}, "items": [{"metadata": {"name": "s"},
                            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                                "devices": [{"name": "gpu-0",
                                    "attributes": {"uuid": {"string": UUID}}}]}}]})
                    }
                    ("GET", p) if p == format!("{ns}/events") => {
                        json!({"metadata": {}, "items": []})
                    }
                    _ => json!({"metadata": {"name": "x"}}),
                };
                Ok(http::Response::new(kube::client::Body::from(
                    serde_json::to_vec(&body).expect("json"),
                )))
            }
        });
        (kube::Client::new(service, "default"), seen)
    }

    fn options(timeout: Duration) -> WorkloadOptions {
        WorkloadOptions {
            driver: "gpu.nvidia.com".into(),
            gpu_class: "gpu.nvidia.com".into(),
            node: Some("node-a".into()),
            image: "img:1".into(),
            command: vec!["nvidia-smi".into(), "-L".into()],
            timeout,
        }
    }

    #[tokio::test]
    async fn run_reads_the_allocation_while_the_pod_runs_and_deletes_its_namespace() {
        let (client, calls) = fake_api_server(
            "Succeeded",
            "GPU 0: T4 (UUID: GPU-11111111-2222-3333-4444-555555555555)\n",
        );
        let r = run(&client, &options(Duration::from_secs(30))).await;
        assert_eq!(r.status, Status::Passed, "{r:?}");
        assert!(
            r.detail.contains(
                &"device node-a/gpu-0 (UUID GPU-11111111-2222-3333-4444-555555555555)".to_owned()
            ),
            "{r:?}"
        );
        let calls = calls.lock().expect("lock");
        assert!(
            calls.contains(
                &"POST /apis/resource.k8s.io/v1/namespaces/gpu-dra-check-x1/resourceclaims"
                    .to_owned()
            ),
            "{calls:?}"
        );
        assert_eq!(
            calls.last().map(String::as_str),
            Some("DELETE /api/v1/namespaces/gpu-dra-check-x1"),
            "{calls:?}"
        );
    }

    #[tokio::test]
    async fn a_timed_out_pod_fails_and_its_namespace_is_deleted_too() {
        let (client, calls) = fake_api_server("Pending", "");
        let r = run(&client, &options(Duration::from_millis(600))).await;
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("within 0s (phase Pending)")),
            "{r:?}"
        );
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("not scheduled: Unschedulable: 0/1 nodes")),
            "{r:?}"
        );
        let calls = calls.lock().expect("lock");
        assert!(
            !calls.iter().any(|c| c.ends_with("/log")),
            "a pod that did not end has no log to read: {calls:?}"
        );
        assert_eq!(
            calls.last().map(String::as_str),
            Some("DELETE /api/v1/namespaces/gpu-dra-check-x1"),
            "{calls:?}"
        );
    }

    #[test]
    fn gpu_lines_are_read_and_mig_lines_are_not() {
        let log = format!(
            "{}  MIG 1g.10gb     Device  0: (UUID: MIG-aaaa)\nGPU 1: H100 (UUID: {OTHER})\n",
            line(UUID, 0)
        );
        assert_eq!(gpus_listed(&log), vec![UUID.to_owned(), OTHER.to_owned()]);
        assert!(gpus_listed("No devices were found\n").is_empty());
    }

    #[test]
    fn commands_are_split_as_a_shell_splits_them() {
        assert_eq!(
            split_command("nvidia-smi -L").unwrap(),
            ["nvidia-smi", "-L"]
        );
        assert_eq!(
            split_command(r#"sh -c 'nvidia-smi -L; ls "/dev"'"#).unwrap(),
            ["sh", "-c", "nvidia-smi -L; ls \"/dev\""]
        );
        assert_eq!(
            split_command(r#"echo "a \"b\"" c\ d ''"#).unwrap(),
            ["echo", "a \"b\"", "c d", ""]
        );
        assert!(
            split_command("sh -c 'x")
                .unwrap_err()
                .contains("single quote")
        );
        assert!(split_command("   ").unwrap_err().contains("empty"));
    }
}
