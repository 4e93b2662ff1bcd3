//! MPS control daemons as pods of their own, so that they outlive the plugin.
//!
//! The problem: a daemon started as a child of the plugin lives in the plugin's container. A
//! plugin crash, an OOM kill, a liveness restart or a DaemonSet rollout ends that container,
//! and with it every daemon, every MPS server and every client context on the node; the
//! daemons' memory also counts against the plugin's limit.
//!
//! The fix: with a Kubernetes client and an image (`--mps-daemon-image`, set by the chart to
//! the driver's own image), each claim group's daemon runs in a pod the plugin creates in its
//! own namespace, bound to this node (`nodeName`), running `nvidia-cuda-mps-control -f` from
//! the driver root with the daemon's pipe and log directories mounted at their host paths
//! (the same paths the plugin and the client containers use). The pod's environment carries
//! the claim's limits (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`:
//! on the control daemon they are the defaults of every server it starts), so when the
//! kubelet restarts a crashed daemon container it comes back with the claim's limits without
//! the plugin. The plugin still applies and reads back the limits through the pipe before a
//! prepare returns.
//!
//! - A plugin restart, crash or rolling update leaves the pods untouched; the next plugin
//!   re-adopts each daemon whose pod exists and answers on its pipe (`recovery`). A pod of
//!   an older shape (an earlier version's, or other account or pull secrets: the
//!   `mps-pod-shape` digest) is replaced once its daemon serves no client (`reshape`).
//! - A daemon whose claim is gone is removed by the unprepare, by the plugin's periodic
//!   cleanup of claims gone from the API server, and at start (pods on this node that no
//!   record owns are deleted), so also when the claim went while the plugin was down.
//! - Admins see them: `kubectl get pods -n <namespace> -l
//!   app.kubernetes.io/component=mps-control-daemon`, with the claim in the annotations and
//!   the daemon's log as the container log.
//!
//! Alternatives rejected: owner references to the ResourceClaim (an owner must be in the
//! dependent's namespace, and a privileged daemon pod in the user's namespace would be refused
//! by Pod Security admission there); a second container in the plugin's pod (a rollout
//! replaces the pod and ends it too); daemons outside any container via the host's PID
//! namespace (invisible to `kubectl`, and the plugin's cgroup still owns them).
//!
//! Without a client (tests with a claim file) or without an image, daemons stay children of
//! the plugin (`supervise`).
//!
//! What a daemon pod may be is fixed by the chart's node-restriction policy, which refuses any
//! other pod the plugin's credentials try to create (a compromised node must not get a pod
//! running as another service account, reading Secrets or running another image): the
//! chart's daemon service account (`--mps-daemon-service-account`, no API rights) with no
//! token mounted, only hostPath volumes (the driver root and the daemon's folder under the
//! plugin folder), the chart's image, plain environment values. The plugin pod's image pull
//! secrets and pull policy (`--mps-daemon-image-pull-secrets`, `--mps-daemon-image-pull-policy`,
//! set by the chart from the same values as the plugin's) go on every daemon pod: the image
//! comes from the same registry, and without them a private registry fails every MPS prepare
//! with `ImagePullBackOff`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Container, EnvVar, HostPathVolumeSource, LocalObjectReference, Pod, PodSpec,
    ResourceRequirements, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use super::error::SharingError;
use super::mps;
use super::state::MpsRecord;
use super::tools::{DriverRoot, MPS_CONTROL};
use crate::digest::sha256_hex;

/// `app.kubernetes.io/component` of daemon pods.
pub const COMPONENT: &str = "mps-control-daemon";
/// Label naming the claim a daemon pod serves.
pub const CLAIM_UID_LABEL: &str = "resource.nvidia.com/claim-uid";
/// Annotation with the daemon id (`<claimUID>-<group>`).
pub const DAEMON_ID_ANNOTATION: &str = "resource.nvidia.com/mps-daemon-id";
/// Annotation with a digest of the daemon container, to tell a pod for other devices or
/// limits from the one wanted.
pub const SPEC_ANNOTATION: &str = "resource.nvidia.com/mps-spec";
/// Annotation with a digest of the whole pod as the plugin makes it (account, pull settings,
/// volumes, everything): a running pod of another shape was made by an earlier version or
/// with other settings, and is replaced once no client would lose its work
/// ([`super::reshape`]).
pub const SHAPE_ANNOTATION: &str = "resource.nvidia.com/mps-pod-shape";
/// Name of the daemon's container.
pub const CONTAINER: &str = "mps-control-daemon";

/// Where daemon pods go and what they run.
#[derive(Clone)]
pub struct PodDaemons {
    api: Api<Pod>,
    settings: PodSettings,
}

/// The plain settings of daemon pods (everything but the client).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSettings {
    /// The plugin's namespace.
    pub namespace: String,
    /// This node.
    pub node: String,
    /// The image (the driver's own).
    pub image: String,
    /// The driver root on the host (the pod's hostPath).
    pub host_driver_root: PathBuf,
    /// Priority class of the pods (empty: none).
    pub priority_class: String,
    /// Service account of the pods (empty: the namespace's default). Its token is never
    /// mounted.
    pub service_account: String,
    /// Pull policy of the image (empty: the API server's default).
    pub image_pull_policy: String,
    /// Names of the image pull secrets.
    pub image_pull_secrets: Vec<String>,
}

/// Flags of daemon pods besides the image and priority class: who they run as and how their
/// image is pulled (the chart sets them to its daemon service account and to the plugin pod's
/// own pull policy and secrets).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DaemonPodArgs {
    /// Service account of MPS daemon pods (the chart's, which has no API rights); empty: the
    /// namespace's default. Daemon pods never mount its token.
    #[arg(long, env = "MPS_DAEMON_SERVICE_ACCOUNT", default_value = "")]
    pub mps_daemon_service_account: String,
    /// Image pull policy of MPS daemon pods (the plugin's); empty: the API server's default.
    #[arg(
        long,
        env = "MPS_DAEMON_IMAGE_PULL_POLICY",
        default_value = "",
        value_parser = ["", "Always", "IfNotPresent", "Never"]
    )]
    pub mps_daemon_image_pull_policy: String,
    /// Image pull secrets of MPS daemon pods (the plugin's), comma-separated names.
    #[arg(
        long,
        env = "MPS_DAEMON_IMAGE_PULL_SECRETS",
        value_delimiter = ',',
        default_value = ""
    )]
    pub mps_daemon_image_pull_secrets: Vec<String>,
}

impl DaemonPodArgs {
    /// Sets these flags' parts of `settings` (empty secret names are dropped).
    pub fn apply(&self, settings: PodSettings) -> PodSettings {
        PodSettings {
            service_account: self.mps_daemon_service_account.clone(),
            image_pull_policy: self.mps_daemon_image_pull_policy.clone(),
            image_pull_secrets: self
                .mps_daemon_image_pull_secrets
                .iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
            ..settings
        }
    }
}

impl std::fmt::Debug for PodDaemons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodDaemons")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

fn api_error(what: &str, name: &str, e: kube::Error) -> SharingError {
    SharingError::DaemonPod {
        pod: name.to_string(),
        message: format!("{what}: {e}"),
    }
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// The daemon pod [`PodDaemons::ensure`] found or made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ensured {
    /// It was there already, as wanted (adopted).
    pub kept: bool,
    /// Its UID (tells it from an earlier pod of the same name).
    pub uid: Option<String>,
}

impl PodDaemons {
    /// Daemon pods through `client`.
    pub fn new(client: kube::Client, settings: PodSettings) -> Self {
        Self {
            api: Api::namespaced(client, &settings.namespace),
            settings,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &PodSettings {
        &self.settings
    }

    /// Makes the daemon pod of `record` exist as wanted: an existing pod with the same spec
    /// digest that is not being deleted is kept (adopted as it is); any other pod of that name
    /// is deleted first. Returns whether the pod was already there, and its UID.
    pub async fn ensure(
        &self,
        root: &DriverRoot,
        id: &str,
        record: &MpsRecord,
        timeout: Duration,
    ) -> Result<Ensured, SharingError> {
        let pod = daemon_pod(&self.settings, root, id, record)?;
        let name = pod_name(record);
        match self.api.get_opt(&name).await {
            Ok(Some(old)) if old.metadata.deletion_timestamp.is_none() && same_spec(&old, &pod) => {
                return Ok(Ensured {
                    kept: true,
                    uid: old.metadata.uid,
                });
            }
            Ok(Some(_)) => self.delete(&name, timeout).await?,
            Ok(None) => {}
            Err(e) => return Err(api_error("reading", &name, e)),
        }
        match self.api.create(&PostParams::default(), &pod).await {
            Ok(made) => Ok(Ensured {
                kept: false,
                uid: made.metadata.uid,
            }),
            Err(e) => Err(api_error("creating", &name, e)),
        }
    }

    /// The daemon pods' API (their namespace), for the node's watch on them
    /// ([`super::pod_watch`]).
    pub(super) fn api(&self) -> Api<Pod> {
        self.api.clone()
    }

    /// Whether the daemon pod exists and is not being deleted; `None` when the API server
    /// cannot tell (callers must not act on an outage).
    pub async fn alive(&self, name: &str) -> Option<bool> {
        match self.api.get_opt(name).await {
            Ok(Some(p)) => Some(
                p.metadata.deletion_timestamp.is_none()
                    && !matches!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Failed" | "Succeeded")
                    ),
            ),
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

    /// Why the daemon container is not running, from the pod's status (for error messages).
    pub async fn status_message(&self, name: &str) -> String {
        let Ok(Some(p)) = self.api.get_opt(name).await else {
            return format!("pod {name} not found");
        };
        let status = p.status.unwrap_or_default();
        let container = status
            .container_statuses
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.name == CONTAINER);
        let state = container.and_then(|c| c.state);
        if let Some(w) = state.as_ref().and_then(|s| s.waiting.as_ref()) {
            return format!(
                "pod {name}: container waiting ({}: {})",
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default()
            );
        }
        if let Some(t) = state.as_ref().and_then(|s| s.terminated.as_ref()) {
            return format!(
                "pod {name}: container terminated ({}, exit {}: {})",
                t.reason.clone().unwrap_or_default(),
                t.exit_code,
                t.message.clone().unwrap_or_default()
            );
        }
        format!(
            "pod {name}: phase {}",
            status.phase.unwrap_or_else(|| "Pending".into())
        )
    }

    /// Deletes the pod and waits until it is gone; a missing pod is fine.
    pub async fn delete(&self, name: &str, timeout: Duration) -> Result<(), SharingError> {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => return Err(api_error("deleting", name, e)),
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.api.get_opt(name).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) | Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(Some(_)) => {
                    return Err(SharingError::DaemonPod {
                        pod: name.to_string(),
                        message: format!("still there {timeout:?} after its deletion"),
                    });
                }
                Err(e) => return Err(api_error("waiting for the deletion of", name, e)),
            }
        }
    }

    /// Daemon pods on this node: `(pod name, daemon id, pod)`.
    pub async fn list(&self) -> Result<Vec<(String, String, Pod)>, SharingError> {
        let params = ListParams::default()
            .labels(&format!("app.kubernetes.io/component={COMPONENT}"))
            .fields(&format!("spec.nodeName={}", self.settings.node));
        let pods = self
            .api
            .list(&params)
            .await
            .map_err(|e| api_error("listing", "daemon pods", e))?;
        Ok(pods
            .items
            .into_iter()
            .filter_map(|p| {
                let name = p.metadata.name.clone()?;
                let id = p
                    .metadata
                    .annotations
                    .as_ref()?
                    .get(DAEMON_ID_ANNOTATION)?
                    .clone();
                Some((name, id, p))
            })
            .collect())
    }

    /// The daemon pod `name`, when it exists.
    pub async fn get(&self, name: &str) -> Result<Option<Pod>, SharingError> {
        self.api
            .get_opt(name)
            .await
            .map_err(|e| api_error("reading", name, e))
    }
}

/// The pod name of `record`'s daemon: `mps-<claimUID>-<digest of the group>` (group names
/// may hold characters pod names may not).
pub fn pod_name(record: &MpsRecord) -> String {
    format!(
        "mps-{}-{}",
        record.claim_uid,
        &sha256_hex(record.group.as_bytes())[..8]
    )
}

fn same_spec(old: &Pod, new: &Pod) -> bool {
    let digest = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SPEC_ANNOTATION).cloned())
    };
    digest(old).is_some() && digest(old) == digest(new)
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for the record: `<ordinal>=<MiB>M,...` in the daemon's
/// device numbering (its `CUDA_VISIBLE_DEVICES` order).
pub fn pinned_limit_env(record: &MpsRecord) -> Option<String> {
    let items: Vec<String> = record
        .devices
        .iter()
        .enumerate()
        .filter_map(|(i, uuid)| {
            let mib = record.limits.pinned_memory_mib.get(uuid)?;
            Some(format!("{i}={mib}M"))
        })
        .collect();
    (!items.is_empty()).then(|| items.join(","))
}

/// The daemon pod of `record` (pure: the same inputs give the same pod).
pub fn daemon_pod(
    settings: &PodSettings,
    root: &DriverRoot,
    id: &str,
    record: &MpsRecord,
) -> Result<Pod, SharingError> {
    let tool = root.find_tool(MPS_CONTROL)?;
    let mut env: Vec<(String, String)> = root.tool_env(MPS_CONTROL);
    env.extend(mps::daemon_env(record));
    if let Some(p) = record.limits.active_thread_percentage {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), p.to_string()));
    }
    if let Some(v) = pinned_limit_env(record) {
        env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), v));
    }
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let mut container = Container {
        name: CONTAINER.into(),
        image: Some(settings.image.clone()),
        command: Some(
            std::iter::once(path(&tool))
                .chain(mps::daemon_args(record).into_iter().map(String::from))
                .collect(),
        ),
        env: Some(
            env.into_iter()
                .map(|(name, value)| EnvVar {
                    name,
                    value: Some(value),
                    ..EnvVar::default()
                })
                .collect(),
        ),
        security_context: Some(SecurityContext {
            // The daemon and its servers open every GPU device node; root like the plugin.
            privileged: Some(true),
            run_as_user: Some(0),
            run_as_group: Some(0),
            run_as_non_root: Some(false),
            ..SecurityContext::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), Quantity("10m".into())),
                ("memory".into(), Quantity("32Mi".into())),
            ])),
            ..ResourceRequirements::default()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "driver-root".into(),
                mount_path: path(root.root()),
                read_only: Some(true),
                mount_propagation: Some("HostToContainer".into()),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "mps".into(),
                mount_path: path(&record.dir),
                ..VolumeMount::default()
            },
        ]),
        ..Container::default()
    };
    // The digest covers what the daemon runs with, not how its image is pulled or which
    // account it runs as: a plugin upgrade that changes only those keeps running daemons
    // (a new pod would end every client's MPS context).
    let digest = sha256_hex(
        serde_json::to_string(&(&container, &settings.host_driver_root, &settings.node))
            .unwrap_or_default()
            .as_bytes(),
    );
    container.image_pull_policy =
        (!settings.image_pull_policy.is_empty()).then(|| settings.image_pull_policy.clone());
    let host_path = |name: &str, p: &Path, kind: &str| Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path(p),
            type_: Some(kind.into()),
        }),
        ..Volume::default()
    };
    let mut pod = Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(record)),
            namespace: Some(settings.namespace.clone()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/component".into(), COMPONENT.into()),
                (
                    "app.kubernetes.io/managed-by".into(),
                    "gpu-kubelet-plugin".into(),
                ),
                (CLAIM_UID_LABEL.into(), record.claim_uid.clone()),
            ])),
            annotations: Some(BTreeMap::from([
                (DAEMON_ID_ANNOTATION.into(), id.to_string()),
                (SPEC_ANNOTATION.into(), digest),
                (
                    "resource.nvidia.com/mps-devices".into(),
                    record.devices.join(","),
                ),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(settings.node.clone()),
            restart_policy: Some("Always".into()),
            priority_class_name: (!settings.priority_class.is_empty())
                .then(|| settings.priority_class.clone()),
            // The chart's daemon account, never its token: the daemon needs no API access,
            // and the node-restriction policy refuses any other account or a mounted token.
            service_account_name: (!settings.service_account.is_empty())
                .then(|| settings.service_account.clone()),
            automount_service_account_token: Some(false),
            image_pull_secrets: (!settings.image_pull_secrets.is_empty()).then(|| {
                settings
                    .image_pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(10),
            // Bound to the node: taints must not evict the daemon of running clients.
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Toleration::default()
            }]),
            containers: vec![container],
            volumes: Some(vec![
                host_path("driver-root", &settings.host_driver_root, "Directory"),
                host_path("mps", &record.dir, "Directory"),
            ]),
            ..PodSpec::default()
        }),
        status: None,
    };
    // Everything above, so a pod of any other shape (another account, other pull secrets,
    // mounts written otherwise by an earlier version) is told apart.
    let shape = sha256_hex(
        serde_json::to_string(&(&pod.metadata.labels, &pod.spec))
            .unwrap_or_default()
            .as_bytes(),
    );
    if let Some(a) = pod.metadata.annotations.as_mut() {
        a.insert(SHAPE_ANNOTATION.into(), shape);
    }
    Ok(pod)
}

/// How the running pod `old` differs from `new`, the pod this version makes for the same
/// daemon: `None` when it has the same shape. Otherwise the fields that differ, among those
/// the API server does not fill in by itself, or, when none of those does (a pod of an
/// earlier version, without the shape digest), that it was made by an earlier version.
pub fn shape_differences(old: &Pod, new: &Pod) -> Option<Vec<String>> {
    let shape = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SHAPE_ANNOTATION).cloned())
    };
    if shape(old).is_some() && shape(old) == shape(new) {
        return None;
    }
    let (Some(o), Some(n)) = (old.spec.as_ref(), new.spec.as_ref()) else {
        return Some(vec!["spec".into()]);
    };
    let mut out = Vec::new();
    let mut differs = |field: &str, a: serde_json::Value, b: serde_json::Value| {
        if a != b {
            out.push(field.to_string());
        }
    };
    use serde_json::json;
    let account = |s: &PodSpec| {
        s.service_account_name
            .clone()
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "default".into())
    };
    differs("serviceAccountName", json!(account(o)), json!(account(n)));
    differs(
        "automountServiceAccountToken",
        json!(o.automount_service_account_token.unwrap_or(true)),
        json!(n.automount_service_account_token.unwrap_or(true)),
    );
    differs(
        "imagePullSecrets",
        json!(o.image_pull_secrets.clone().unwrap_or_default()),
        json!(n.image_pull_secrets.clone().unwrap_or_default()),
    );
    differs(
        "priorityClassName",
        json!(o.priority_class_name.clone().unwrap_or_default()),
        json!(n.priority_class_name.clone().unwrap_or_default()),
    );
    differs(
        "hostNetwork, hostPID, hostIPC",
        json!([o.host_network, o.host_pid, o.host_ipc].map(|v| v.unwrap_or(false))),
        json!([n.host_network, n.host_pid, n.host_ipc].map(|v| v.unwrap_or(false))),
    );
    let volumes = |s: &PodSpec| {
        s.volumes
            .iter()
            .flatten()
            .map(|v| json!([v.name, v.host_path.as_ref().map(|h| &h.path)]))
            .collect::<Vec<_>>()
    };
    differs("volumes", json!(volumes(o)), json!(volumes(n)));
    let container = |s: &PodSpec| s.containers.iter().find(|c| c.name == CONTAINER).cloned();
    match (container(o), container(n)) {
        (Some(oc), Some(nc)) => {
            differs("image", json!(oc.image), json!(nc.image));
            if nc.image_pull_policy.is_some() {
                differs(
                    "imagePullPolicy",
                    json!(oc.image_pull_policy),
                    json!(nc.image_pull_policy),
                );
            }
            differs("command", json!(oc.command), json!(nc.command));
            differs("args", json!(oc.args), json!(nc.args));
            differs("env", json!(oc.env), json!(nc.env));
            let mounts = |c: &Container| {
                c.volume_mounts
                    .iter()
                    .flatten()
                    .map(|m| json!([m.name, m.mount_path, m.read_only.unwrap_or(false)]))
                    .collect::<Vec<_>>()
            };
            differs("volumeMounts", json!(mounts(&oc)), json!(mounts(&nc)));
        }
        _ => out.push(format!("container {CONTAINER}")),
    }
    if out.is_empty() {
        out.push("made by an earlier version of the plugin".into());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharing::state::MpsPhase;
    use gpu_dra_core::sharing::MpsLimits;

    fn record(dir: &Path) -> MpsRecord {
        MpsRecord {
            claim_uid: "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b".into(),
            group: "c_0".into(),
            phase: MpsPhase::Starting,
            pid: None,
            dir: dir.join("mps/0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b-c_0"),
            devices: vec!["GPU-a".into(), "GPU-b".into()],
            whole_gpus: vec!["GPU-a".into(), "GPU-b".into()],
            limits: MpsLimits {
                active_thread_percentage: Some(40),
                pinned_memory_mib: BTreeMap::from([("GPU-b".into(), 2048)]),
                multi_user: false,
            },
            share_claims: Default::default(),
            namespace: None,
        }
    }

    fn settings() -> PodSettings {
        PodSettings {
            namespace: "gpu-dra".into(),
            node: "node-a".into(),
            image: "registry.example/gpu-dra-driver:1.0".into(),
            host_driver_root: "/".into(),
            priority_class: "system-node-critical".into(),
            service_account: "rel-gpu-dra-driver-mps-daemon".into(),
            image_pull_policy: "Always".into(),
            image_pull_secrets: vec!["registry-a".into(), "registry-b".into()],
        }
    }

    /// A driver root with the MPS tool, as the plugin sees it at /driver-root.
    fn root(tmp: &Path) -> DriverRoot {
        let bin = tmp.join("driver-root/usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let tool = bin.join(MPS_CONTROL);
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        DriverRoot::new(tmp.join("driver-root"), None)
    }

    fn env_of(pod: &Pod) -> BTreeMap<String, String> {
        pod.spec.as_ref().unwrap().containers[0]
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap_or_default()))
            .collect()
    }

    #[test]
    fn the_pod_runs_the_daemon_with_the_claims_limits_on_this_node() {
        let tmp = tempfile::tempdir().unwrap();
        let root = root(tmp.path());
        let rec = record(tmp.path());
        let pod = daemon_pod(&settings(), &root, "the-id", &rec).unwrap();
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("gpu-dra"));
        let c = &spec.containers[0];
        assert_eq!(
            c.command.as_ref().unwrap(),
            &vec![
                root.find_tool(MPS_CONTROL).unwrap().display().to_string(),
                "-f".to_string()
            ]
        );
        let env = env_of(&pod);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "40");
        let mut multi_user = rec.clone();
        multi_user.limits.multi_user = true;
        let pod = daemon_pod(&settings(), &root, "the-id", &multi_user).unwrap();
        assert_eq!(
            pod.spec.as_ref().unwrap().containers[0]
                .command
                .as_ref()
                .unwrap()[1..],
            ["-f", "-M"]
        );
        // Ordinal 1 is GPU-b in the daemon's numbering.
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "1=2048M");
        assert_eq!(
            env["CUDA_MPS_PIPE_DIRECTORY"],
            rec.pipe_dir().display().to_string()
        );
        // Host paths: the driver root from the host's "/", mounted where the plugin reads it;
        // the daemon's directory at its own path (the plugin folder is the same on both).
        let volumes = spec.volumes.as_ref().unwrap();
        assert_eq!(volumes[0].host_path.as_ref().unwrap().path, "/");
        let mounts = c.volume_mounts.as_ref().unwrap();
        assert_eq!(mounts[0].mount_path, root.root().display().to_string());
        assert_eq!(
            volumes[1].host_path.as_ref().unwrap().path,
            rec.dir.display().to_string()
        );
        assert_eq!(mounts[1].mount_path, rec.dir.display().to_string());
        let annotations = pod.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations[DAEMON_ID_ANNOTATION], "the-id");
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[CLAIM_UID_LABEL], rec.claim_uid);
        assert_eq!(labels["app.kubernetes.io/component"], COMPONENT);
    }

    #[test]
    fn names_are_valid_pod_names_and_the_digest_follows_the_spec() {
        let tmp = tempfile::tempdir().unwrap();
        let root = root(tmp.path());
        let rec = record(tmp.path());
        let name = pod_name(&rec);
        assert!(name.len() <= 63, "{name}");
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
            "{name}"
        );
        let a = daemon_pod(&settings(), &root, "id", &rec).unwrap();
        let again = daemon_pod(&settings(), &root, "id", &rec).unwrap();
        assert!(same_spec(&a, &again));
        let mut other = rec.clone();
        other.limits.active_thread_percentage = Some(50);
        let b = daemon_pod(&settings(), &root, "id", &other).unwrap();
        assert!(!same_spec(&a, &b), "other limits, other pod");
        assert_eq!(pod_name(&other), name, "one pod name per daemon");
    }

    /// What the chart's node-restriction policy admits from the plugin: its daemon account
    /// with no token, only hostPath volumes (driver root, the daemon's folder), the one image,
    /// plain environment values; and the plugin's pull settings, so a private registry works.
    #[test]
    fn the_pod_is_what_the_node_policy_admits_and_pulls_as_the_plugin_does() {
        let tmp = tempfile::tempdir().unwrap();
        let rec = record(tmp.path());
        let pod = daemon_pod(&settings(), &root(tmp.path()), "id", &rec).unwrap();
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("rel-gpu-dra-driver-mps-daemon")
        );
        assert_eq!(spec.automount_service_account_token, Some(false));
        let volumes = spec.volumes.as_ref().unwrap();
        let host_paths: Vec<&str> = volumes
            .iter()
            .map(|v| {
                v.host_path
                    .as_ref()
                    .expect("only hostPath volumes")
                    .path
                    .as_str()
            })
            .collect();
        assert_eq!(host_paths, ["/", rec.dir.to_str().unwrap()]);
        assert!(spec.init_containers.is_none() && spec.containers.len() == 1);
        let c = &spec.containers[0];
        assert_eq!(
            c.image.as_deref(),
            Some("registry.example/gpu-dra-driver:1.0")
        );
        assert!(c.env_from.is_none());
        assert!(c.env.iter().flatten().all(|e| e.value_from.is_none()));
        assert_eq!(c.image_pull_policy.as_deref(), Some("Always"));
        let secrets: Vec<&str> = spec
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(secrets, ["registry-a", "registry-b"]);
    }

    #[test]
    fn without_pull_settings_or_account_the_pod_names_none() {
        let tmp = tempfile::tempdir().unwrap();
        let rec = record(tmp.path());
        let bare = PodSettings {
            service_account: String::new(),
            image_pull_policy: String::new(),
            image_pull_secrets: vec![],
            ..settings()
        };
        let pod = daemon_pod(&bare, &root(tmp.path()), "id", &rec).unwrap();
        let spec = pod.spec.as_ref().unwrap();
        assert!(spec.service_account_name.is_none());
        assert!(spec.image_pull_secrets.is_none());
        assert!(spec.containers[0].image_pull_policy.is_none());
        assert_eq!(spec.automount_service_account_token, Some(false));
        // Same daemon, same digest: a plugin upgrade that adds pull settings or the account
        // keeps the running pod.
        let full = daemon_pod(&settings(), &root(tmp.path()), "id", &rec).unwrap();
        assert!(same_spec(&pod, &full));
    }

    #[test]
    fn the_flags_fill_the_settings_and_drop_empty_secret_names() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            pods: DaemonPodArgs,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--mps-daemon-service-account=sa",
            "--mps-daemon-image-pull-policy=IfNotPresent",
            "--mps-daemon-image-pull-secrets=a,,b",
        ])
        .unwrap();
        let s = cli.pods.apply(settings());
        assert_eq!(s.service_account, "sa");
        assert_eq!(s.image_pull_policy, "IfNotPresent");
        assert_eq!(s.image_pull_secrets, ["a", "b"]);
        assert_eq!(s.image, settings().image, "the rest is kept");
        let none = Cli::try_parse_from(["x"]).unwrap().pods.apply(settings());
        assert!(none.image_pull_secrets.is_empty() && none.service_account.is_empty());
        assert!(
            Cli::try_parse_from(["x", "--mps-daemon-image-pull-policy=Sometimes"]).is_err(),
            "only Kubernetes' pull policies"
        );
    }

    #[test]
    fn no_limits_no_limit_variables() {
        let tmp = tempfile::tempdir().unwrap();
        let mut rec = record(tmp.path());
        rec.limits = MpsLimits::default();
        assert_eq!(pinned_limit_env(&rec), None);
        let pod = daemon_pod(&settings(), &root(tmp.path()), "id", &rec).unwrap();
        let env = env_of(&pod);
        assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
        assert!(!env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
    }

    #[test]
    fn a_pod_of_another_shape_is_told_apart_by_what_differs() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, rec) = (root(tmp.path()), record(tmp.path()));
        let now = daemon_pod(&settings(), &root, "id", &rec).unwrap();
        assert_eq!(shape_differences(&now, &now.clone()), None);

        // Made with other settings by this version: the fields that differ are named.
        let other = PodSettings {
            service_account: String::new(),
            image_pull_secrets: vec!["registry-a".into()],
            priority_class: String::new(),
            ..settings()
        };
        let before = daemon_pod(&other, &root, "id", &rec).unwrap();
        assert_eq!(
            shape_differences(&before, &now),
            Some(vec![
                "serviceAccountName".to_string(),
                "imagePullSecrets".to_string(),
                "priorityClassName".to_string(),
            ])
        );

        // An earlier version's pod: no shape digest, the driver root mounted read-write.
        let mut earlier = now.clone();
        earlier
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(SHAPE_ANNOTATION);
        assert_eq!(
            shape_differences(&earlier, &now),
            Some(vec!["made by an earlier version of the plugin".to_string()])
        );
        earlier.spec.as_mut().unwrap().containers[0]
            .volume_mounts
            .as_mut()
            .unwrap()[0]
            .read_only = None;
        earlier.spec.as_mut().unwrap().host_pid = Some(true);
        assert_eq!(
            shape_differences(&earlier, &now),
            Some(vec![
                "hostNetwork, hostPID, hostIPC".to_string(),
                "volumeMounts".to_string()
            ])
        );
    }
}
