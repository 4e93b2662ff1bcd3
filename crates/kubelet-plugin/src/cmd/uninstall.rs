//! `gpu-kubelet-plugin uninstall`: what the chart's `pre-delete` hook Job runs on
//! `helm uninstall`, so that no node is left with GPUs in `EXCLUSIVE_PROCESS`, a changed
//! time-slice, MPS daemons or our files.
//!
//! Steps, in the release's namespace:
//! 1. The node-plugin DaemonSet is parked: an annotation records the nodes that run its pods,
//!    and its pod template gets a node selector no node matches, so the DaemonSet controller
//!    removes every plugin pod (nothing re-applies sharing behind the cleanup). Then this waits
//!    until those pods are gone.
//!    MPS control daemon pods are deleted next (their nodes are cleaned too).
//! 2. On each recorded node a cleanup pod runs `gpu-kubelet-plugin cleanup`
//!    ([`super::cleanup`]): the DaemonSet's own pod spec (image, privileges, environment,
//!    hostPath volumes), pinned with `nodeName`, tolerating every taint, never restarted.
//! 3. Succeeded cleanup pods are deleted; a failed or unfinished one is kept for its logs and
//!    the command fails with a message naming each such node and pod.
//!
//! Why park instead of delete: a Job whose pod fails is retried (backoffLimit), and a retry
//! must still find the node list and the pod template; a deleted DaemonSet has neither. Helm
//! deletes the parked DaemonSet right after the hook, with the rest of the release.
//! The whole command is idempotent: a rerun reads the recorded nodes, waits for nothing that
//! is already gone and cleans again (cleanup itself is idempotent).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gpu_dra_telemetry::LogArgs;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Pod, PodSpec, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tracing::{info, warn};

use crate::kube_client::KubeArgs;

/// Annotation on the parked DaemonSet: the nodes whose plugin pods it removed, comma separated.
pub const NODES_ANNOTATION: &str = "gpu.nvidia.com/uninstall-nodes";
/// Node label the parked DaemonSet selects; no node has it.
pub const PARK_LABEL: &str = "gpu.nvidia.com/uninstalling-driver";
/// `app.kubernetes.io/component` of cleanup pods (the DaemonSet's is another, so it never
/// adopts them).
pub const CLEANUP_COMPONENT: &str = "uninstall-cleanup";
/// Annotation of a cleanup pod naming its node.
pub const NODE_ANNOTATION: &str = "gpu.nvidia.com/cleanup-node";
/// The plugin binary in the image, when the DaemonSet's container names none.
const DEFAULT_BINARY: &str = "/usr/local/bin/gpu-kubelet-plugin";

/// Flags of `uninstall`.
#[derive(Debug, Clone, clap::Args)]
pub struct UninstallArgs {
    /// Namespace of the release (the DaemonSet's and the cleanup pods').
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: String,
    /// Name of the node-plugin DaemonSet.
    #[arg(long, env = "PLUGIN_DAEMONSET")]
    pub daemonset: String,
    /// The API server.
    #[command(flatten)]
    pub kube: KubeArgs,
    /// Seconds to wait for the plugin pods to go, and then for the cleanup pods to finish.
    #[arg(long, env = "UNINSTALL_TIMEOUT_SECONDS", default_value_t = 240)]
    pub timeout_seconds: u64,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// Why the uninstall cleanup failed. Messages name the node and pod, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// An API call failed.
    #[error("{what}: {source}")]
    Api {
        /// What was attempted.
        what: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// The DaemonSet's pod template cannot be made into a cleanup pod.
    #[error("DaemonSet {daemonset}: {reason}")]
    Template {
        /// The DaemonSet.
        daemonset: String,
        /// What is missing.
        reason: String,
    },
    /// Plugin pods did not go in time.
    #[error(
        "node plugin pods still present after {timeout:?}: {pods}; their nodes may be unreachable: delete the pods (or the nodes) and run `helm uninstall` again"
    )]
    PluginPodsRemain {
        /// `pod on node` items.
        pods: String,
        /// The limit.
        timeout: Duration,
    },
    /// Cleanup did not succeed on some nodes.
    #[error(
        "GPU state and driver files not cleaned on {count} node(s): {details}; the failed pods are kept: read their logs, fix the cause and run `helm uninstall` again (or clean the node with `gpu-kubelet-plugin cleanup`)"
    )]
    NodesNotCleaned {
        /// How many.
        count: usize,
        /// One item per node: node, pod, how it ended.
        details: String,
    },
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> UninstallError {
    let what = what.into();
    move |source| UninstallError::Api { what, source }
}

/// The cleanup pod for `node`, made from the DaemonSet's pod template (see the module doc).
pub fn cleanup_pod(ds: &DaemonSet, node: &str) -> Result<Pod, UninstallError> {
    let ds_name = ds.metadata.name.clone().unwrap_or_default();
    let template = ds.spec.as_ref().map(|s| &s.template);
    let mut spec: PodSpec =
        template
            .and_then(|t| t.spec.clone())
            .ok_or_else(|| UninstallError::Template {
                daemonset: ds_name.clone(),
                reason: "no pod template".into(),
            })?;
    let Some(container) = spec.containers.first_mut() else {
        return Err(UninstallError::Template {
            daemonset: ds_name,
            reason: "pod template has no container".into(),
        });
    };
    let binary = container
        .command
        .as_ref()
        .and_then(|c| c.first().cloned())
        .unwrap_or_else(|| DEFAULT_BINARY.to_string());
    container.name = "cleanup".into();
    container.command = Some(vec![binary, "cleanup".into()]);
    container.args = None;
    container.ports = None;
    container.liveness_probe = None;
    container.readiness_probe = None;
    container.startup_probe = None;
    container.termination_message_policy = Some("FallbackToLogsOnError".into());
    spec.containers.truncate(1);
    spec.init_containers = None;
    spec.node_name = Some(node.to_string());
    // Pinned to the node: no scheduling constraints, every taint tolerated.
    spec.node_selector = None;
    spec.affinity = None;
    spec.tolerations = Some(vec![Toleration {
        operator: Some("Exists".into()),
        ..Default::default()
    }]);
    spec.restart_policy = Some("Never".into());
    // No API access needed.
    spec.automount_service_account_token = Some(false);

    let labels = BTreeMap::from([
        ("app.kubernetes.io/instance".to_string(), instance(ds)),
        (
            "app.kubernetes.io/component".to_string(),
            CLEANUP_COMPONENT.to_string(),
        ),
    ]);
    Ok(Pod {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-cleanup-", truncate(&ds_name, 40))),
            namespace: ds.metadata.namespace.clone(),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                NODE_ANNOTATION.to_string(),
                node.to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// The release instance of the DaemonSet (its selector's `app.kubernetes.io/instance`, else
/// its name): cleanup pods carry it.
fn instance(ds: &DaemonSet) -> String {
    ds.spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .and_then(|l| l.get("app.kubernetes.io/instance").cloned())
        .or_else(|| ds.metadata.name.clone())
        .unwrap_or_default()
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => s[..i].trim_end_matches('-'),
        None => s,
    }
}

/// The label selector of the DaemonSet's pods.
fn selector(ds: &DaemonSet) -> String {
    ds.spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .map(|l| {
            l.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

/// The DaemonSet's pods (controlled by it), as `(pod, node)`.
async fn plugin_pods(
    pods: &Api<Pod>,
    ds: &DaemonSet,
) -> Result<Vec<(String, String)>, UninstallError> {
    let uid = ds.metadata.uid.clone().unwrap_or_default();
    let list = pods
        .list(&ListParams::default().labels(&selector(ds)))
        .await
        .map_err(api_err("list the node plugin's pods"))?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| {
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.controller == Some(true) && o.uid == uid)
        })
        .map(|p| {
            (
                p.metadata.name.unwrap_or_default(),
                p.spec.and_then(|s| s.node_name).unwrap_or_default(),
            )
        })
        .collect())
}

/// Runs the uninstall cleanup (see the module documentation).
pub async fn uninstall(client: kube::Client, args: &UninstallArgs) -> Result<(), UninstallError> {
    let timeout = Duration::from_secs(args.timeout_seconds);
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &args.namespace);
    let pods: Api<Pod> = Api::namespaced(client, &args.namespace);
    let what = format!("get DaemonSet {}/{}", args.namespace, args.daemonset);
    let Some(ds) = daemonsets
        .get_opt(&args.daemonset)
        .await
        .map_err(api_err(what))?
    else {
        info!(daemonset = %args.daemonset, "no node-plugin DaemonSet: nothing to clean");
        return Ok(());
    };

    // 1. Park the DaemonSet, recording its nodes.
    let mut nodes: BTreeSet<String> = ds
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODES_ANNOTATION))
        .map(|v| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    nodes.extend(
        plugin_pods(&pods, &ds)
            .await?
            .into_iter()
            .map(|(_, node)| node)
            .filter(|n| !n.is_empty()),
    );
    let patch = json!({
        "metadata": {"annotations": {NODES_ANNOTATION: nodes.iter().cloned().collect::<Vec<_>>().join(",")}},
        "spec": {"template": {"spec": {"nodeSelector": {PARK_LABEL: "true"}}}},
    });
    let ds = daemonsets
        .patch(
            &args.daemonset,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(api_err(format!(
            "park DaemonSet {}/{}",
            args.namespace, args.daemonset
        )))?;
    info!(daemonset = %args.daemonset, nodes = %nodes.iter().cloned().collect::<Vec<_>>().join(","), "node plugin parked; waiting for its pods to go");
    let deadline = Instant::now() + timeout;
    loop {
        let left = plugin_pods(&pods, &ds).await?;
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(UninstallError::PluginPodsRemain {
                pods: left
                    .iter()
                    .map(|(p, n)| format!("{p} on {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // 1b. MPS control daemon pods (crate::sharing::pods): no plugin deletes them any more,
    // and their kubelet would restart a daemon that cleanup only asked to quit. Their nodes
    // get a cleanup too (compute modes).
    let daemons = ListParams::default().labels(&format!(
        "app.kubernetes.io/component={}",
        crate::sharing::pods::COMPONENT
    ));
    let found = pods
        .list(&daemons)
        .await
        .map_err(api_err("list MPS daemon pods"))?
        .items;
    for p in &found {
        if let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            nodes.insert(node);
        }
        if let Some(name) = &p.metadata.name {
            info!(pod = %name, "deleting MPS control daemon pod");
            match pods.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(api_err(format!("delete MPS daemon pod {name}"))(e)),
            }
        }
    }
    while !found.is_empty() {
        let left = pods
            .list(&daemons)
            .await
            .map_err(api_err("list MPS daemon pods"))?
            .items;
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(UninstallError::PluginPodsRemain {
                pods: left
                    .iter()
                    .filter_map(|p| p.metadata.name.as_ref())
                    .map(|name| format!("MPS daemon pod {name}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // 2. A cleanup pod per node; leftovers of an earlier run go first.
    let leftovers = ListParams::default().labels(&format!(
        "app.kubernetes.io/component={CLEANUP_COMPONENT},app.kubernetes.io/instance={}",
        instance(&ds)
    ));
    for p in pods
        .list(&leftovers)
        .await
        .map_err(api_err("list earlier cleanup pods"))?
        .items
    {
        if let Some(name) = p.metadata.name {
            let _ = pods.delete(&name, &DeleteParams::default()).await;
        }
    }
    let mut running: Vec<(String, String)> = Vec::new();
    for node in &nodes {
        let pod = cleanup_pod(&ds, node)?;
        let created = pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(api_err(format!("create the cleanup pod for node {node}")))?;
        let name = created.metadata.name.unwrap_or_default();
        info!(node = %node, pod = %name, "cleanup pod created");
        running.push((node.clone(), name));
    }

    // 3. Wait for each to finish; keep the failed ones.
    let deadline = Instant::now() + timeout;
    let mut failed: Vec<String> = Vec::new();
    while !running.is_empty() {
        let mut still = Vec::new();
        for (node, name) in running {
            let pod = pods
                .get_opt(&name)
                .await
                .map_err(api_err(format!("get cleanup pod {name}")))?;
            let Some(pod) = pod else {
                failed.push(format!("{node} (pod {name} vanished before it finished)"));
                continue;
            };
            match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some("Succeeded") => {
                    info!(node = %node, pod = %name, "node cleaned");
                    let _ = pods.delete(&name, &DeleteParams::default()).await;
                }
                Some("Failed") => failed.push(format!("{node} (pod {name}: {})", ended(&pod))),
                _ if Instant::now() >= deadline => failed.push(format!(
                    "{node} (pod {name} not finished after {timeout:?}: {})",
                    ended(&pod)
                )),
                _ => still.push((node, name)),
            }
        }
        running = still;
        if !running.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    if failed.is_empty() {
        info!(nodes = nodes.len(), "every node cleaned");
        Ok(())
    } else {
        for f in &failed {
            warn!(node = %f, "node not cleaned");
        }
        Err(UninstallError::NodesNotCleaned {
            count: failed.len(),
            details: failed.join("; "),
        })
    }
}

/// How a cleanup pod's container ended (or where it stands), in words.
fn ended(pod: &Pod) -> String {
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first());
    match status.and_then(|s| s.state.as_ref()) {
        Some(state) => match (&state.terminated, &state.waiting) {
            (Some(t), _) => format!(
                "exit code {}{}{}",
                t.exit_code,
                t.reason
                    .as_deref()
                    .map(|r| format!(", {r}"))
                    .unwrap_or_default(),
                t.message
                    .as_deref()
                    .map(|m| format!(": {}", m.trim()))
                    .unwrap_or_default()
            ),
            (None, Some(w)) => format!(
                "waiting: {}",
                w.message
                    .as_deref()
                    .or(w.reason.as_deref())
                    .unwrap_or("no reason given")
            ),
            (None, None) => "running".into(),
        },
        None => format!(
            "phase {}",
            pod.status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .unwrap_or("unknown")
        ),
    }
}

/// The `uninstall` subcommand.
pub async fn run(args: UninstallArgs) -> anyhow::Result<()> {
    let client = args.kube.client("uninstall", None).await?;
    uninstall(client, &args).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemonset() -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "rel-gpu-dra-driver-kubelet-plugin", "namespace": "gpu-system", "uid": "u1"},
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": "kubelet-plugin"}},
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": "kubelet-plugin"}},
                    "spec": {
                        "serviceAccountName": "rel-gpu-dra-driver-kubelet-plugin",
                        "nodeSelector": {"gpu": "yes"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [{
                            "name": "plugin",
                            "image": "example/gpu-dra-driver:1.0",
                            "command": ["/usr/local/bin/gpu-kubelet-plugin", "run"],
                            "env": [{"name": "PLUGIN_DIR", "value": "/var/lib/kubelet/plugins/gpu.nvidia.com"}],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}},
                            "securityContext": {"privileged": true, "runAsUser": 0},
                            "volumeMounts": [{"name": "plugin-dir", "mountPath": "/var/lib/kubelet/plugins/gpu.nvidia.com"}]
                        }],
                        "volumes": [{"name": "plugin-dir", "hostPath": {"path": "/var/lib/kubelet/plugins/gpu.nvidia.com", "type": "DirectoryOrCreate"}}]
                    }
                }
            }
        }))
        .expect("DaemonSet")
    }

    #[test]
    fn the_cleanup_pod_is_the_plugin_pod_pinned_to_its_node_running_cleanup_once() {
        let ds = daemonset();
        let pod = cleanup_pod(&ds, "node-a").expect("pod");
        let spec = pod.spec.as_ref().expect("spec");
        let tspec = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("template");
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert!(spec.node_selector.is_none() && spec.affinity.is_none());
        let tol = spec.tolerations.as_ref().expect("tolerations");
        assert_eq!(tol.len(), 1);
        assert_eq!(tol[0].operator.as_deref(), Some("Exists"));
        assert!(
            tol[0].key.is_none() && tol[0].effect.is_none(),
            "every taint"
        );
        assert_eq!(spec.automount_service_account_token, Some(false));
        // Same host view and privileges as the plugin.
        assert_eq!(spec.volumes, tspec.volumes);
        let (c, t) = (&spec.containers[0], &tspec.containers[0]);
        assert_eq!(c.image, t.image);
        assert_eq!(c.env, t.env);
        assert_eq!(c.volume_mounts, t.volume_mounts);
        assert_eq!(c.security_context, t.security_context);
        assert_eq!(
            c.command.as_deref(),
            Some(
                &[
                    "/usr/local/bin/gpu-kubelet-plugin".to_string(),
                    "cleanup".into()
                ][..]
            )
        );
        assert!(c.ports.is_none() && c.liveness_probe.is_none());
        // Never adopted by the DaemonSet: its selector does not match.
        let labels = pod.metadata.labels.as_ref().expect("labels");
        let sel = ds
            .spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .expect("selector");
        assert!(
            sel.iter().any(|(k, v)| labels.get(k) != Some(v)),
            "{labels:?}"
        );
        assert_eq!(labels["app.kubernetes.io/instance"], "rel");
        assert_eq!(
            pod.metadata.annotations.as_ref().expect("annotations")[NODE_ANNOTATION],
            "node-a"
        );
        assert_eq!(
            pod.metadata.generate_name.as_deref(),
            Some("rel-gpu-dra-driver-kubelet-plugin-cleanup-")
        );
        assert_eq!(
            selector(&ds),
            "app.kubernetes.io/component=kubelet-plugin,app.kubernetes.io/instance=rel"
        );
    }

    /// A private registry: the cleanup pod pulls the image as the plugin pod does (its pull
    /// secrets and policy), else `helm uninstall` fails on `ImagePullBackOff`.
    #[test]
    fn the_cleanup_pod_pulls_its_image_as_the_plugin_pod_does() {
        let mut ds = daemonset();
        let spec = ds
            .spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .expect("template");
        spec.image_pull_secrets = Some(vec![k8s_openapi::api::core::v1::LocalObjectReference {
            name: "registry-a".into(),
        }]);
        spec.containers[0].image_pull_policy = Some("Always".into());
        let pod = cleanup_pod(&ds, "node-a").expect("pod");
        let spec = pod.spec.as_ref().expect("spec");
        let secrets: Vec<&str> = spec
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(secrets, ["registry-a"]);
        assert_eq!(
            spec.containers[0].image_pull_policy.as_deref(),
            Some("Always")
        );
        assert_eq!(
            spec.containers[0].image.as_deref(),
            Some("example/gpu-dra-driver:1.0")
        );
    }

    #[test]
    fn a_template_without_containers_is_a_clear_error() {
        let mut ds = daemonset();
        if let Some(s) = ds.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            s.containers.clear();
        }
        let err = cleanup_pod(&ds, "n").expect_err("refused").to_string();
        assert!(
            err.contains("rel-gpu-dra-driver-kubelet-plugin") && err.contains("no container"),
            "{err}"
        );
    }
}
