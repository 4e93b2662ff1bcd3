//! What `gpu-dra check` knows about the cluster, as plain data ([`Facts`]), and [`gather`],
//! the one place that reads it from the API server: every check is a pure function of the
//! facts, so each is tested with fixtures and the cluster is read once per run.
//!
//! What is read: the server version and the versions of `resource.k8s.io` it serves; a
//! server-side dry-run create of two ResourceSlices carrying the fields of each DRA feature
//! (what the API server keeps of them says which gates are on: a disabled feature's fields are
//! dropped silently); the DeviceClasses; Nodes; our ResourceSlices; the node plugin's DaemonSet
//! and pods and the MPS daemon pods in the release namespace; the ValidatingWebhookConfiguration
//! whose Service is in that namespace, its caBundle, the serving certificate from the Secret
//! the webhook's Deployment mounts, the Service's ready endpoints and a GET of `/readyz`
//! through the API server's service proxy; the kubelets' `FailedPrepareDynamicResources`
//! Events and the state of the pods they name.
//!
//! A DRA plugin leaves no registration object in the API (unlike CSI's CSINode): the kubelet
//! keeps its registrations in memory. What says a plugin is registered is its pod's readiness
//! (the chart's readiness probe answers only once the kubelet registered the plugin and its
//! slices are published) and its node's slices.

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::Api;
use kube::api::ListParams;
use serde_json::{Value, json};

use crate::CliError;

/// Everything the checks judge.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Unix seconds when the facts were read.
    pub now: i64,
    /// The driver name (`spec.driver` of our slices).
    pub driver: String,
    /// The release namespace (the plugin's DaemonSet, the webhook, MPS daemons).
    pub namespace: String,
    /// The API server's version; `None` when it did not say.
    pub server: Option<ServerVersion>,
    /// Versions of `resource.k8s.io` the API server serves (`v1`, `v1beta2`, ...).
    pub resource_versions: Vec<String>,
    /// Per gate name, whether the API server kept that feature's fields in a dry-run write;
    /// only gates whose fields a slice can carry.
    pub probe: BTreeMap<String, bool>,
    /// Why the dry-run write could not be made, when it could not.
    pub probe_error: Option<String>,
    /// Gates the admin says are turned on although the version has them off by default.
    pub declared_gates: Vec<String>,
    /// DeviceClasses the chart installs: (name, device type its selector picks).
    pub expected_classes: Vec<(String, String)>,
    /// DeviceClasses of the cluster.
    pub classes: Vec<ClassFact>,
    /// The node plugin's DaemonSet; `None` when there is none in the namespace.
    pub plugin: Option<PluginSet>,
    /// Nodes of the cluster.
    pub nodes: Vec<NodeFact>,
    /// Our ResourceSlices.
    pub slices: Vec<SliceFact>,
    /// The webhook; `None` when no ValidatingWebhookConfiguration points to a Service in the
    /// namespace.
    pub webhook: Option<WebhookFacts>,
    /// MPS control daemon pods in the namespace.
    pub mps_daemons: Vec<PodFact>,
    /// The kubelets' `FailedPrepareDynamicResources` Events.
    pub prepare_failures: Vec<PrepareFailure>,
}

/// The API server's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerVersion {
    /// Minor version of Kubernetes 1.x.
    pub minor: u32,
    /// As the server reports it (`v1.37.1`).
    pub git_version: String,
}

/// A DeviceClass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassFact {
    /// Name.
    pub name: String,
    /// Its CEL selector expressions.
    pub selectors: Vec<String>,
}

/// The node plugin's DaemonSet and its pods.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginSet {
    /// `namespace/name` of the DaemonSet.
    pub daemonset: String,
    /// Image of the plugin container in its pod template.
    pub image: String,
    /// Environment values of that container (the chart's values reach the plugin this way).
    pub env: BTreeMap<String, String>,
    /// Its pods.
    pub pods: Vec<PodFact>,
}

/// A pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodFact {
    /// `namespace/name`.
    pub name: String,
    /// The node it is bound to.
    pub node: Option<String>,
    /// Image of its first container.
    pub image: String,
    /// `status.phase`.
    pub phase: String,
    /// Condition `Ready` is `True`.
    pub ready: bool,
    /// Restarts of all its containers.
    pub restarts: i32,
    /// Why a container waits or last ended (`CrashLoopBackOff`, `ImagePullBackOff`, `Error`).
    pub reason: Option<String>,
    /// Being deleted.
    pub deleting: bool,
}

/// A Node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFact {
    /// Name.
    pub name: String,
    /// Condition `Ready` is `True`.
    pub ready: bool,
    /// Labeled `nvidia.com/gpu.present=true` (NVIDIA's GPU feature discovery, GPU Operator).
    pub gpu_label: bool,
    /// Its `gpu.nvidia.com/dynamic-mig-gpus` annotation, when set and not empty.
    pub dynamic_mig_gpus: Option<String>,
    /// Its `gpu.nvidia.com/memory-share-gpus` annotation, when set and not empty.
    pub memory_share_gpus: Option<String>,
}

/// One of our ResourceSlices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SliceFact {
    /// Name.
    pub name: String,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `spec.pool.name`.
    pub pool: String,
    /// `spec.pool.generation`.
    pub generation: i64,
    /// `spec.pool.resourceSliceCount`.
    pub slice_count: i64,
    /// Devices with their taints.
    pub devices: Vec<DeviceFact>,
}

/// A device of a slice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFact {
    /// Name.
    pub name: String,
    /// Its taints.
    pub taints: Vec<TaintFact>,
}

/// A device taint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaintFact {
    /// Key (`gpu.nvidia.com/xid`).
    pub key: String,
    /// Value (what the condition says).
    pub value: Option<String>,
    /// `NoSchedule`, `NoExecute` or `None`.
    pub effect: String,
    /// `timeAdded`, Unix seconds.
    pub since: Option<i64>,
}

/// The webhook's registration, Service and certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookFacts {
    /// Name of the ValidatingWebhookConfiguration.
    pub config: String,
    /// The distinct caBundles of its entries (PEM); empty entries are `""`.
    pub ca_bundles: Vec<String>,
    /// Service name, namespace and port the entries call.
    pub service: (String, String, i32),
    /// Name of the Secret the webhook's Deployment mounts; `None` when the Deployment could
    /// not be read or mounts none.
    pub tls_secret: Option<String>,
    /// The serving certificate (PEM chain), or why it could not be read.
    pub serving_cert: Result<String, String>,
    /// Ready endpoints of the Service; `None` when they could not be listed.
    pub ready_endpoints: Option<usize>,
    /// The answer of `/readyz` through the API server's service proxy; `None` when not asked
    /// ([`GatherOptions::webhook_readyz`]).
    pub reach: Option<Result<(), String>>,
    /// What admission did with a dry-run claim carrying a config the webhook refuses (asked
    /// with `/readyz`); `Err` when the probe could not be made (no right to create claims).
    pub admission: Option<Result<Admission, String>>,
}

/// What the API server's admission did with a claim the webhook must refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Refused by the webhook: its message.
    Refused(String),
    /// Admitted: the API server did not get the webhook's answer (with the chart's
    /// `failurePolicy: Ignore` a failed call admits).
    Admitted,
}

/// A kubelet's `FailedPrepareDynamicResources` Event and the pod it names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrepareFailure {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The node whose kubelet reported it.
    pub node: Option<String>,
    /// The Event's message (the plugin's error).
    pub message: String,
    /// How often it was reported.
    pub count: i32,
    /// Last time seen, Unix seconds.
    pub last_seen: i64,
    /// The pod's phase now; `None` when the pod is gone.
    pub pod_phase: Option<String>,
    /// Names of the pod's ResourceClaims (in its namespace): those it names and those made
    /// for it from templates; empty when the pod is gone.
    pub claims: Vec<String>,
}

/// Settings of a gathering.
#[derive(Debug, Clone)]
pub struct GatherOptions {
    /// Driver name.
    pub driver: String,
    /// Release namespace.
    pub namespace: String,
    /// Gates the admin declares on.
    pub declared_gates: Vec<String>,
    /// DeviceClasses the chart installs: (name, device type).
    pub expected_classes: Vec<(String, String)>,
    /// Make the dry-run write of the feature probe.
    pub probe: bool,
    /// Read the webhook (registration, Secret, endpoints); without it [`Facts::webhook`] is
    /// `None`.
    pub webhook: bool,
    /// Also ask the webhook's `/readyz` through the API server, which can take
    /// [`PROXY_TIMEOUT`] where the API server cannot reach the Service.
    pub webhook_readyz: bool,
}

/// How long the webhook's `/readyz` may take through the service proxy.
const PROXY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the facts from the cluster. Fails (exit 2) only when the API server cannot be
/// reached or does not say its version; anything else missing becomes a fact the checks judge.
pub async fn gather(client: &kube::Client, opts: &GatherOptions) -> Result<Facts, CliError> {
    let cluster = |what: &str| {
        let what = what.to_owned();
        move |source| CliError::Cluster { what, source }
    };
    let info = client
        .apiserver_version()
        .await
        .map_err(cluster("cannot read the API server's version"))?;
    let ns = opts.namespace.as_str();
    let mut facts = Facts {
        now: now(),
        driver: opts.driver.clone(),
        namespace: opts.namespace.clone(),
        server: parse_minor(&info.minor).map(|minor| ServerVersion {
            minor,
            git_version: info.git_version.clone(),
        }),
        declared_gates: opts.declared_gates.clone(),
        expected_classes: opts.expected_classes.clone(),
        ..Facts::default()
    };
    let groups = client
        .list_api_groups()
        .await
        .map_err(cluster("cannot list the API groups"))?;
    facts.resource_versions = groups
        .groups
        .iter()
        .filter(|g| g.name == "resource.k8s.io")
        .flat_map(|g| g.versions.iter().map(|v| v.version.clone()))
        .collect();
    if !facts.resource_versions.iter().any(|v| v == "v1") {
        // Nothing below can be read without resource.k8s.io/v1.
        return Ok(facts);
    }
    if opts.probe {
        match probe(client, &opts.driver).await {
            Ok(kept) => facts.probe = kept,
            Err(e) => facts.probe_error = Some(e),
        }
    }
    facts.classes = Api::<DeviceClass>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(cluster("cannot list DeviceClasses"))?
        .items
        .iter()
        .map(class_fact)
        .collect();
    facts.nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(cluster("cannot list Nodes"))?
        .items
        .iter()
        .map(node_fact)
        .collect();
    facts.slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.driver={}", opts.driver)))
        .await
        .map_err(cluster("cannot list ResourceSlices"))?
        .items
        .iter()
        .map(slice_fact)
        .collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels("app.kubernetes.io/component=kubelet-plugin"))
        .await
        .map_err(cluster(&format!("cannot list DaemonSets in {ns}")))?;
    if let Some(ds) = daemonsets.items.first() {
        let selector = ds
            .spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .map(|l| {
                l.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_else(|| "app.kubernetes.io/component=kubelet-plugin".into());
        let plugin_pods = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(cluster(&format!("cannot list the plugin's pods in {ns}")))?;
        facts.plugin = Some(plugin_set(ds, &plugin_pods.items));
    }
    facts.mps_daemons = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=mps-control-daemon"))
        .await
        .map_err(cluster(&format!("cannot list MPS daemon pods in {ns}")))?
        .items
        .iter()
        .map(pod_fact)
        .collect();
    if opts.webhook {
        facts.webhook = webhook(client, ns, &opts.driver, opts.webhook_readyz).await?;
    }
    facts.prepare_failures = prepare_failures(client, facts.now).await?;
    Ok(facts)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// "37", "35+" (GKE, EKS) -> 37, 35.
pub fn parse_minor(minor: &str) -> Option<u32> {
    let digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn class_fact(c: &DeviceClass) -> ClassFact {
    ClassFact {
        name: c.metadata.name.clone().unwrap_or_default(),
        selectors: c
            .spec
            .selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
            .collect(),
    }
}

fn node_fact(n: &Node) -> NodeFact {
    let annotation = |key: &str| {
        n.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .filter(|v| !v.trim().is_empty())
            .cloned()
    };
    NodeFact {
        name: n.metadata.name.clone().unwrap_or_default(),
        ready: n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        gpu_label: n
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("nvidia.com/gpu.present"))
            .is_some_and(|v| v == "true"),
        dynamic_mig_gpus: annotation("gpu.nvidia.com/dynamic-mig-gpus"),
        memory_share_gpus: annotation("gpu.nvidia.com/memory-share-gpus"),
    }
}

fn slice_fact(s: &ResourceSlice) -> SliceFact {
    SliceFact {
        name: s.metadata.name.clone().unwrap_or_default(),
        node: s.spec.node_name.clone(),
        pool: s.spec.pool.name.clone(),
        generation: s.spec.pool.generation,
        slice_count: s.spec.pool.resource_slice_count,
        devices: s
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| DeviceFact {
                name: d.name.clone(),
                taints: d
                    .taints
                    .iter()
                    .flatten()
                    .map(|t| TaintFact {
                        key: t.key.clone(),
                        value: t.value.clone(),
                        effect: t.effect.clone(),
                        since: t.time_added.as_ref().map(|t| t.0.as_second()),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn pod_fact(p: &Pod) -> PodFact {
    let status = p.status.as_ref();
    let statuses = status
        .and_then(|s| s.container_statuses.as_ref())
        .cloned()
        .unwrap_or_default();
    let reason = statuses.iter().find_map(|c| {
        let state = c.state.as_ref()?;
        state
            .waiting
            .as_ref()
            .and_then(|w| w.reason.clone())
            .or_else(|| state.terminated.as_ref().and_then(|t| t.reason.clone()))
    });
    PodFact {
        name: format!(
            "{}/{}",
            p.metadata.namespace.as_deref().unwrap_or_default(),
            p.metadata.name.as_deref().unwrap_or_default()
        ),
        node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
        image: p
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
            .unwrap_or_default(),
        phase: status.and_then(|s| s.phase.clone()).unwrap_or_default(),
        ready: status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        restarts: statuses.iter().map(|c| c.restart_count).sum(),
        reason,
        deleting: p.metadata.deletion_timestamp.is_some(),
    }
}

fn plugin_set(ds: &DaemonSet, pods: &[Pod]) -> PluginSet {
    let container = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first());
    PluginSet {
        daemonset: format!(
            "{}/{}",
            ds.metadata.namespace.as_deref().unwrap_or_default(),
            ds.metadata.name.as_deref().unwrap_or_default()
        ),
        image: container.and_then(|c| c.image.clone()).unwrap_or_default(),
        env: container
            .and_then(|c| c.env.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|e| e.value.clone().map(|v| (e.name.clone(), v)))
            .collect(),
        pods: pods.iter().map(pod_fact).collect(),
    }
}

/// The dry-run write: one slice whose device carries `allowMultipleAllocations` and a taint,
/// one slice with shared counters. What comes back says which features the server keeps.
async fn probe(client: &kube::Client, driver: &str) -> Result<BTreeMap<String, bool>, String> {
    let slice = |suffix: &str, spec_extra: Value| {
        let mut spec = json!({
            "driver": driver,
            "pool": {"name": format!("gpu-dra-check-{suffix}"), "generation": 1, "resourceSliceCount": 1},
            "allNodes": true,
        });
        if let (Value::Object(spec), Value::Object(extra)) = (&mut spec, spec_extra) {
            spec.extend(extra);
        }
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": format!("gpu-dra-check-{suffix}")},
            "spec": spec,
        })
    };
    let devices = slice(
        "probe-devices",
        json!({"devices": [{
            "name": "probe",
            "allowMultipleAllocations": true,
            "taints": [{"key": format!("{driver}/check-probe"), "effect": "NoSchedule"}],
        }]}),
    );
    let counters = slice(
        "probe-counters",
        json!({"sharedCounters": [{"name": "probe", "counters": {"memory": {"value": "1Gi"}}}]}),
    );
    let kept_devices = dry_run_create(client, &devices).await?;
    let kept_counters = dry_run_create(client, &counters).await?;
    let device = &kept_devices["spec"]["devices"][0];
    Ok(BTreeMap::from([
        (
            "DRAConsumableCapacity".to_owned(),
            device["allowMultipleAllocations"] == json!(true),
        ),
        (
            "DRADeviceTaints".to_owned(),
            device["taints"].as_array().is_some_and(|t| !t.is_empty()),
        ),
        (
            "DRAPartitionableDevices".to_owned(),
            kept_counters["spec"]["sharedCounters"]
                .as_array()
                .is_some_and(|c| !c.is_empty()),
        ),
    ]))
}

async fn dry_run_create(client: &kube::Client, object: &Value) -> Result<Value, String> {
    let body = serde_json::to_vec(object).map_err(|e| e.to_string())?;
    let req = http::Request::post("/apis/resource.k8s.io/v1/resourceslices?dryRun=All")
        .header("content-type", "application/json")
        .body(body)
        .map_err(|e| e.to_string())?;
    client
        .request::<Value>(req)
        .await
        .map_err(|e| format!("dry-run create of a ResourceSlice: {e}"))
}

/// The ValidatingWebhookConfiguration calling a Service in `ns`, and what stands behind it.
async fn webhook(
    client: &kube::Client,
    ns: &str,
    driver: &str,
    ask_readyz: bool,
) -> Result<Option<WebhookFacts>, CliError> {
    let configs = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| CliError::Cluster {
            what: "cannot list ValidatingWebhookConfigurations".into(),
            source,
        })?;
    let ours = configs.items.iter().find(|c| {
        c.webhooks.iter().flatten().any(|w| {
            w.client_config
                .service
                .as_ref()
                .is_some_and(|s| s.namespace == ns)
                && w.name.contains(".opaque-config.")
        })
    });
    let Some(config) = ours else {
        return Ok(None);
    };
    let entries: Vec<_> = config.webhooks.iter().flatten().collect();
    let mut ca_bundles: Vec<String> = entries
        .iter()
        .map(|w| {
            w.client_config
                .ca_bundle
                .as_ref()
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .unwrap_or_default()
        })
        .collect();
    ca_bundles.sort();
    ca_bundles.dedup();
    let service = entries
        .iter()
        .find_map(|w| w.client_config.service.as_ref())
        .map(|s| (s.name.clone(), s.namespace.clone(), s.port.unwrap_or(443)))
        .unwrap_or_default();
    let (svc, svc_ns, port) = service.clone();
    let ready_endpoints = Api::<EndpointSlice>::namespaced(client.clone(), &svc_ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={svc}")))
        .await
        .ok()
        .map(|l| {
            l.items
                .iter()
                .flat_map(|s| s.endpoints.iter())
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
                .count()
        });
    let (tls_secret, serving_cert) = match tls_secret(client, &svc_ns, &svc).await {
        Ok(secret) => {
            let cert = serving_cert(client, &svc_ns, &secret).await;
            (Some(secret), cert)
        }
        Err(e) => (None, Err(e)),
    };
    let reach = if ask_readyz {
        let url = format!("/api/v1/namespaces/{svc_ns}/services/https:{svc}:{port}/proxy/readyz");
        Some(match http::Request::get(&url).body(Vec::new()) {
            Ok(req) => match tokio::time::timeout(PROXY_TIMEOUT, client.request_text(req)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!(
                    "no answer within {}s through the API server's service proxy",
                    PROXY_TIMEOUT.as_secs()
                )),
            },
            Err(e) => Err(e.to_string()),
        })
    } else {
        None
    };
    let admission = if ask_readyz {
        Some(admission_probe(client, ns, driver).await)
    } else {
        None
    };
    Ok(Some(WebhookFacts {
        config: config.metadata.name.clone().unwrap_or_default(),
        ca_bundles,
        service,
        tls_secret,
        serving_cert,
        ready_endpoints,
        reach,
        admission,
    }))
}

/// Asks admission about a ResourceClaim whose GPU config the webhook refuses (an unknown
/// sharing strategy), as a server-side dry run in `ns` (nothing is stored; the chart's entries
/// have `sideEffects: None`, so the API server calls the webhook for dry runs too). `/readyz`
/// through the service proxy can answer where admission calls cannot (the proxy dials a pod;
/// admission dials the Service's cluster IP unless the API server routes to endpoints).
async fn admission_probe(
    client: &kube::Client,
    ns: &str,
    driver: &str,
) -> Result<Admission, String> {
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "gpu-dra-check-admission", "namespace": ns},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "gpu-dra-check-not-a-strategy"},
            }}}],
        }},
    });
    let body = serde_json::to_vec(&claim).map_err(|e| e.to_string())?;
    let req = http::Request::post(format!(
        "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims?dryRun=All"
    ))
    .header("content-type", "application/json")
    .body(body)
    .map_err(|e| e.to_string())?;
    match client.request::<Value>(req).await {
        Ok(_) => Ok(Admission::Admitted),
        Err(kube::Error::Api(e)) if e.message.contains("admission webhook") => {
            Ok(Admission::Refused(e.message))
        }
        Err(e) => Err(format!("dry-run create of a ResourceClaim in {ns}: {e}")),
    }
}

/// The Secret the webhook's Deployment (same name as its Service, as the chart names them)
/// mounts.
async fn tls_secret(client: &kube::Client, ns: &str, svc: &str) -> Result<String, String> {
    let deployment = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(svc)
        .await
        .map_err(|e| format!("cannot read Deployment {ns}/{svc}: {e}"))?;
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .find_map(|v| v.secret.as_ref().and_then(|s| s.secret_name.clone()))
        .ok_or_else(|| format!("Deployment {ns}/{svc} mounts no Secret"))
}

/// The PEM chain in key `tls.crt` of Secret `secret`.
async fn serving_cert(client: &kube::Client, ns: &str, secret: &str) -> Result<String, String> {
    let secret_obj = Api::<Secret>::namespaced(client.clone(), ns)
        .get(secret)
        .await
        .map_err(|e| format!("cannot read Secret {ns}/{secret}: {e}"))?;
    secret_obj
        .data
        .as_ref()
        .and_then(|d| d.get("tls.crt"))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .ok_or_else(|| format!("Secret {ns}/{secret} has no tls.crt"))
}

/// `FailedPrepareDynamicResources` Events of the last day, with the phase of the pod each
/// names now.
async fn prepare_failures(
    client: &kube::Client,
    now: i64,
) -> Result<Vec<PrepareFailure>, CliError> {
    let events = Api::<Event>::all(client.clone())
        .list(&ListParams::default().fields("reason=FailedPrepareDynamicResources"))
        .await
        .map_err(|source| CliError::Cluster {
            what: "cannot list Events".into(),
            source,
        })?;
    let mut out = Vec::new();
    // Per pod: its phase and claims now, `None` when it is gone (or another pod of its name).
    let mut pods: BTreeMap<String, Option<(String, Vec<String>)>> = BTreeMap::new();
    for e in &events.items {
        let last_seen = e
            .series
            .as_ref()
            .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
            .or_else(|| e.last_timestamp.as_ref().map(|t| t.0))
            .or_else(|| e.event_time.as_ref().map(|t| t.0))
            .map_or(0, |t| t.as_second());
        if now - last_seen > 86_400 || e.involved_object.kind.as_deref() != Some("Pod") {
            continue;
        }
        let ns = e.involved_object.namespace.clone().unwrap_or_default();
        let name = e.involved_object.name.clone().unwrap_or_default();
        let pod = format!("{ns}/{name}");
        if !pods.contains_key(&pod) {
            let now = match Api::<Pod>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await
            {
                Ok(Some(p)) if p.metadata.uid == e.involved_object.uid => Some((
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_default(),
                    pod_claims(&p),
                )),
                _ => None,
            };
            pods.insert(pod.clone(), now);
        }
        let (pod_phase, claims) = match pods.get(&pod).cloned().flatten() {
            Some((phase, claims)) => (Some(phase), claims),
            None => (None, Vec::new()),
        };
        out.push(PrepareFailure {
            pod: pod.clone(),
            node: e
                .source
                .as_ref()
                .and_then(|s| s.host.clone())
                .or_else(|| e.reporting_instance.clone()),
            message: e.message.clone().unwrap_or_default(),
            count: e
                .series
                .as_ref()
                .and_then(|s| s.count)
                .or(e.count)
                .unwrap_or(1),
            last_seen,
            pod_phase,
            claims,
        });
    }
    Ok(out)
}

/// The ResourceClaims a pod uses: those its spec names and those the resourceclaim
/// controller made for it from templates (its status names them), sorted.
pub fn pod_claims(p: &Pod) -> Vec<String> {
    let named = p
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    let generated = p
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    let mut claims: Vec<String> = named.chain(generated).collect();
    claims.sort();
    claims.dedup();
    claims
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API server that answers each path gather reads, with one plugin pod, one of our
    /// slices, a DaemonSet whose plugin uses memory shares, and a dry-run write that drops
    /// `allowMultipleAllocations` (consumable capacity off) but keeps taints and counters.
    fn fake_api_server(req: &http::Request<kube::client::Body>) -> Value {
        let path = req.uri().path();
        let list = |kind: &str, items: Value| json!({"kind": kind, "apiVersion": "v1", "metadata": {}, "items": items});
        match path {
            "/version" => json!({"major": "1", "minor": "35+", "gitVersion": "v1.35.2-gke.1",
                "gitCommit": "", "gitTreeState": "", "buildDate": "", "goVersion": "", "compiler": "", "platform": ""}),
            "/apis" => {
                json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [{"name": "resource.k8s.io",
                "versions": [{"groupVersion": "resource.k8s.io/v1", "version": "v1"}]}]})
            }
            "/apis/resource.k8s.io/v1/resourceslices" if req.method() == http::Method::POST => {
                if req.uri().query().is_some_and(|q| q.contains("dryRun=All")) {
                    json!({"spec": {"devices": [{"name": "probe", "taints": [{"key": "k", "effect": "NoSchedule"}]}],
                        "sharedCounters": [{"name": "probe"}]}})
                } else {
                    json!({"kind": "Status", "status": "Failure", "message": "not a dry run", "code": 400})
                }
            }
            "/apis/resource.k8s.io/v1/resourceslices" => list(
                "ResourceSliceList",
                json!([{
                "metadata": {"name": "node-a-gpu-nvidia-com-0"},
                "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                    "devices": [{"name": "gpu-0", "taints": [{"key": "gpu.nvidia.com/xid", "value": "79",
                        "effect": "NoSchedule", "timeAdded": "2026-06-01T00:00:00Z"}]}]}}]),
            ),
            "/apis/apps/v1/namespaces/gpu-dra/daemonsets" => list(
                "DaemonSetList",
                json!([{
                "metadata": {"name": "rel-plugin", "namespace": "gpu-dra"},
                "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "kubelet-plugin"}},
                    "template": {"spec": {"containers": [{"name": "plugin", "image": "img:1",
                        "env": [{"name": "MEMORY_SHARE_GPUS", "value": "all"}]}]}}}}]),
            ),
            "/api/v1/namespaces/gpu-dra/pods" => {
                let q = req.uri().query().unwrap_or_default();
                if q.contains("kubelet-plugin") {
                    list(
                        "PodList",
                        json!([{"metadata": {"name": "p", "namespace": "gpu-dra"},
                        "spec": {"nodeName": "node-a", "containers": [{"name": "plugin", "image": "img:1"}]},
                        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}]),
                    )
                } else {
                    list("PodList", json!([]))
                }
            }
            "/api/v1/nodes" => list(
                "NodeList",
                json!([{"metadata": {"name": "node-a"},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]),
            ),
            _ if path.ends_with("list") || path.contains("/apis/") || path.starts_with("/api/") => {
                list("List", json!([]))
            }
            _ => json!({}),
        }
    }

    #[tokio::test]
    async fn gather_reads_the_facts_the_checks_judge() {
        let service = tower::service_fn(|req: http::Request<kube::client::Body>| async move {
            let body = fake_api_server(&req);
            Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(
                serde_json::to_vec(&body).expect("json"),
            )))
        });
        let client = kube::Client::new(service, "default");
        let opts = GatherOptions {
            driver: "gpu.nvidia.com".into(),
            namespace: "gpu-dra".into(),
            declared_gates: Vec::new(),
            expected_classes: Vec::new(),
            probe: true,
            webhook: true,
            webhook_readyz: true,
        };
        let f = gather(&client, &opts).await.expect("facts");
        assert_eq!(f.server.as_ref().map(|s| s.minor), Some(35));
        assert_eq!(f.resource_versions, vec!["v1".to_owned()]);
        assert_eq!(f.probe_error, None);
        assert!(!f.probe["DRAConsumableCapacity"]);
        assert!(f.probe["DRADeviceTaints"]);
        assert!(f.probe["DRAPartitionableDevices"]);
        let plugin = f.plugin.as_ref().expect("the DaemonSet");
        assert_eq!(plugin.image, "img:1");
        assert_eq!(plugin.env["MEMORY_SHARE_GPUS"], "all");
        assert_eq!(plugin.pods.len(), 1);
        assert!(plugin.pods[0].ready);
        assert_eq!(f.slices.len(), 1);
        assert_eq!(
            f.slices[0].devices[0].taints[0].value.as_deref(),
            Some("79")
        );
        assert_eq!(f.nodes.len(), 1);
        assert!(f.nodes[0].ready);
        assert!(f.webhook.is_none());
        // The memory shares the plugin uses need the gate the server dropped.
        let r = super::super::checks::check_dra_features(&f);
        assert_eq!(r.status, super::super::checks::Status::Failed, "{r:?}");
    }

    #[test]
    fn a_pods_claims_are_those_it_names_and_those_made_from_its_templates() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "team"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "gpu", "resourceClaimName": "shared-gpu"},
                {"name": "mps", "resourceClaimTemplateName": "mps-template"}]},
            "status": {"resourceClaimStatuses": [{"name": "mps", "resourceClaimName": "p-mps-x7k2q"}]}
        }))
        .expect("a pod");
        assert_eq!(pod_claims(&pod), ["p-mps-x7k2q", "shared-gpu"]);
        assert!(pod_claims(&Pod::default()).is_empty());
    }

    #[test]
    fn minor_versions_with_a_plus_are_read() {
        assert_eq!(parse_minor("37"), Some(37));
        assert_eq!(parse_minor("35+"), Some(35));
        assert_eq!(parse_minor(""), None);
    }
}
