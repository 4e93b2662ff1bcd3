//! The checks: each a pure function of [`Facts`] returning one [`CheckResult`] with what was
//! found and, when it is not passed, the fix. [`all`] runs them in the order they are printed.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::cert::{self, CertFault};
use super::facts::{Admission, Facts, NodeFact, PodFact};
use super::gates::{self, GATES, Gate};

/// Oldest and newest Kubernetes minor releases the driver is tested with or built for.
pub const OLDEST_MINOR: u32 = 34;
/// See [`OLDEST_MINOR`].
pub const NEWEST_TESTED_MINOR: u32 = 37;

/// A webhook certificate with less than this left gets a warning (cert-manager renews 15 days
/// before expiry by the chart's default).
const CERT_WARN_SECONDS: i64 = 30 * 86_400;

/// A prepare failure older than this no longer counts as stuck (unless its pod still waits).
const RECENT_SECONDS: i64 = 3600;

/// The verdict of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// All is well.
    Passed,
    /// Works, but something needs attention.
    Warning,
    /// Broken: the fix says what to do.
    Failed,
}

/// One named check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// Stable name, for scripts (`plugin-pods`).
    pub name: &'static str,
    /// What is checked, for people.
    pub title: &'static str,
    /// The verdict.
    pub status: Status,
    /// What was found, one line each.
    pub detail: Vec<String>,
    /// What to do, when not passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl CheckResult {
    fn new(name: &'static str, title: &'static str) -> Self {
        Self {
            name,
            title,
            status: Status::Passed,
            detail: Vec::new(),
            fix: None,
        }
    }

    fn line(mut self, text: impl Into<String>) -> Self {
        self.detail.push(text.into());
        self
    }

    fn fail(mut self, fix: impl Into<String>) -> Self {
        self.status = Status::Failed;
        self.fix = Some(fix.into());
        self
    }

    fn warn(mut self, fix: impl Into<String>) -> Self {
        self.status = Status::Warning;
        self.fix = Some(fix.into());
        self
    }
}

/// The names of the checks [`all`] runs, in print order (what `--only` takes).
pub const NAMES: [&str; 11] = [
    "api-server",
    "resource-api",
    "dra-features",
    "device-classes",
    "webhook-reachable",
    "webhook-certificate",
    "plugin-pods",
    "resource-slices",
    "device-taints",
    "mps-daemons",
    "stuck-claims",
];

/// Every check, in print order.
pub fn all(f: &Facts) -> Vec<CheckResult> {
    let mut out = vec![check_api_server(f), check_resource_api(f)];
    if !f.resource_versions.iter().any(|v| v == "v1") {
        // Without resource.k8s.io/v1 nothing else was read.
        return out;
    }
    out.extend([
        check_dra_features(f),
        check_device_classes(f),
        check_webhook_reachable(f),
        check_webhook_certificate(f),
        check_plugins(f),
        check_slices(f),
        check_device_taints(f),
        check_mps_daemons(f),
        check_stuck_claims(f),
    ]);
    out
}

/// The API server's version is one the driver supports.
pub fn check_api_server(f: &Facts) -> CheckResult {
    let r = CheckResult::new("api-server", "Kubernetes version supported");
    let Some(v) = &f.server else {
        return r
            .line("the API server did not report a minor version")
            .warn("check `kubectl version`; the driver needs Kubernetes 1.34 or newer");
    };
    let r = r.line(format!("API server {}", v.git_version));
    if v.minor < OLDEST_MINOR {
        r.fail(format!(
            "upgrade the control plane to Kubernetes 1.{OLDEST_MINOR} or newer: the driver needs \
             resource.k8s.io/v1, served from 1.{OLDEST_MINOR}"
        ))
    } else if v.minor > NEWEST_TESTED_MINOR {
        r.line(format!(
            "newer than the newest release tested (1.{NEWEST_TESTED_MINOR})"
        ))
        .warn("run a one-GPU claim of your own on it before relying on the driver there")
    } else {
        r
    }
}

/// `resource.k8s.io/v1` is served.
pub fn check_resource_api(f: &Facts) -> CheckResult {
    let r = CheckResult::new("resource-api", "resource.k8s.io/v1 served").line(
        if f.resource_versions.is_empty() {
            "resource.k8s.io is not served".to_owned()
        } else {
            format!(
                "resource.k8s.io versions served: {}",
                f.resource_versions.join(", ")
            )
        },
    );
    if f.resource_versions.iter().any(|v| v == "v1") {
        r
    } else {
        r.fail(
            "serve resource.k8s.io/v1: Kubernetes 1.34 or newer, with the API group not \
             disabled in the API server's --runtime-config (resource.k8s.io/v1=true)",
        )
    }
}

/// Which gate each of the driver's settings needs, with the setting that needs it.
pub fn needed_gates(f: &Facts) -> BTreeMap<&'static str, Vec<String>> {
    let mut need: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
    let mut add = |gate: &'static str, why: String| need.entry(gate).or_default().push(why);
    if let Some(p) = &f.plugin {
        let env = |k: &str| p.env.get(k).map(String::as_str).unwrap_or_default().trim();
        if !env("DYNAMIC_MIG_GPUS").is_empty() {
            add(
                "DRAPartitionableDevices",
                format!(
                    "kubeletPlugin.partitioning.dynamicMigGpus={:?}",
                    env("DYNAMIC_MIG_GPUS")
                ),
            );
        }
        if !env("MEMORY_SHARE_GPUS").is_empty() {
            add(
                "DRAConsumableCapacity",
                format!(
                    "kubeletPlugin.partitioning.memoryShareGpus={:?}",
                    env("MEMORY_SHARE_GPUS")
                ),
            );
        }
        if !matches!(env("CONSUMABLE_SHARES"), "" | "disabled") {
            add(
                "DRAConsumableCapacity",
                format!("consumableShares={:?}", env("CONSUMABLE_SHARES")),
            );
        }
        if env("DEVICE_HEALTH") == "true" {
            add("DRADeviceTaints", DEVICE_HEALTH.into());
            add("ResourceHealthStatus", DEVICE_HEALTH.into());
        }
        if env("LIST_TYPE_ATTRIBUTES") == "true" {
            add(
                "DRAListTypeAttributes",
                "kubeletPlugin.listTypeAttributes=true".into(),
            );
        }
    }
    for n in &f.nodes {
        if let Some(v) = &n.dynamic_mig_gpus {
            add(
                "DRAPartitionableDevices",
                format!(
                    "node {} annotation gpu.nvidia.com/dynamic-mig-gpus={v:?}",
                    n.name
                ),
            );
        }
        if let Some(v) = &n.memory_share_gpus {
            add(
                "DRAConsumableCapacity",
                format!(
                    "node {} annotation gpu.nvidia.com/memory-share-gpus={v:?}",
                    n.name
                ),
            );
        }
    }
    need
}

/// Whether `gate` is on in the cluster, and how that is known.
pub fn gate_state(f: &Facts, gate: &Gate) -> (bool, String) {
    if let Some(&kept) = f.probe.get(gate.name) {
        let default = f
            .server
            .as_ref()
            .map(|v| gates::on_by_default(gate, v.minor));
        let how = match (kept, default) {
            (false, Some(true)) => "fields dropped by a dry-run write: turned off on this cluster",
            (true, Some(false)) => "fields kept by a dry-run write: turned on on this cluster",
            (true, _) => "fields kept by a dry-run write",
            (false, _) => "fields dropped by a dry-run write",
        };
        return (kept, how.into());
    }
    if f.declared_gates.iter().any(|g| g == gate.name) {
        return (true, "declared on with --cluster-feature-gates".into());
    }
    match &f.server {
        // Assumed, not seen: a cluster can turn any gate that is not locked either way, and
        // the fields of some (ResourceHealthStatus: pod status) no dry-run write can show.
        Some(v) => {
            let on = gates::on_by_default(gate, v.minor);
            (
                on,
                format!(
                    "not observed: {} by default in 1.{} ({}), unless the cluster turned it {}",
                    if on { "on" } else { "off" },
                    v.minor,
                    gates::default_text(gate),
                    if on {
                        "off"
                    } else {
                        "on (say so with --cluster-feature-gates)"
                    }
                ),
            )
        }
        None => (false, "unknown: no server version".into()),
    }
}

/// The DRA features the driver's settings use are on in the cluster.
pub fn check_dra_features(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new("dra-features", "DRA features the driver's settings need");
    let need = needed_gates(f);
    let mut fixes = Vec::new();
    let mut degraded = Vec::new();
    for gate in GATES {
        let (on, how) = gate_state(f, gate);
        let users = need.get(gate.name);
        let used = users.map_or(String::new(), |u| format!("; needed by {}", u.join(", ")));
        let mark = if on { "on" } else { "off" };
        r = r.line(format!("{}: {mark} ({how}){used}", gate.name));
        let Some(users) = users.filter(|_| !on) else {
            continue;
        };
        let turn_on = format!(
            "turn the feature gate {} on in the API server, scheduler, controller manager and \
             kubelets ({})",
            gate.name,
            gates::default_text(gate)
        );
        // A setting whose feature the plugin replaces by an honest fallback (as the chart
        // installs it on such a release) works with less: a warning that says what is lost.
        match users
            .iter()
            .all(|u| u == DEVICE_HEALTH)
            .then(|| fallback(gate.name))
            .flatten()
        {
            Some(instead) => degraded.push(format!(
                "{} ({}) is off, so {instead}: {turn_on} for the full behaviour",
                gate.feature, gate.name
            )),
            None => fixes.push(format!(
                "{} ({}) is off: {turn_on}, or turn off {}",
                gate.feature,
                gate.name,
                users.join(" and ")
            )),
        }
    }
    if let Some(e) = &f.probe_error {
        r = r.line(format!(
            "no dry-run write ({e}): judged by the server version and --cluster-feature-gates"
        ));
    }
    if f.plugin.is_none() {
        r = r.line("no node plugin DaemonSet found: no setting read");
    }
    if !fixes.is_empty() {
        fixes.extend(degraded);
        r.fail(fixes.join("; "))
    } else if !degraded.is_empty() {
        r.warn(degraded.join("; "))
    } else {
        r
    }
}

/// The chart value that turns device health reporting on, as [`needed_gates`] names it.
const DEVICE_HEALTH: &str = "kubeletPlugin.deviceHealth.enabled=true";

/// What the plugin does for device health where `gate` is off (the plugin's fallbacks,
/// `publish/features.rs`); `None`: no fallback, the setting does not work without it.
fn fallback(gate: &str) -> Option<&'static str> {
    match gate {
        "DRADeviceTaints" => Some(
            "unhealthy GPUs are withheld from the ResourceSlices instead of tainted (new \
             claims avoid them; pods already running on them are not evicted)",
        ),
        "ResourceHealthStatus" => Some("pods' status shows no health of their devices"),
        _ => None,
    }
}

/// The chart's DeviceClasses exist and select this driver's devices of their type.
pub fn check_device_classes(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new(
        "device-classes",
        "DeviceClasses present and as the chart installs them",
    );
    let mut problems = Vec::new();
    for (name, device_type) in &f.expected_classes {
        let Some(class) = f.classes.iter().find(|c| &c.name == name) else {
            problems.push(format!("DeviceClass {name} is missing"));
            continue;
        };
        let driver_ok = class.selectors.iter().any(|s| {
            s.contains(&format!("device.driver == '{}'", f.driver))
                || s.contains(&format!("device.driver == \"{}\"", f.driver))
        });
        let type_ok = class.selectors.iter().any(|s| {
            s.contains(&format!(".type == '{device_type}'"))
                || s.contains(&format!(".type == \"{device_type}\""))
        });
        if driver_ok && type_ok {
            r = r.line(format!(
                "{name}: selects {} devices of type {device_type}",
                f.driver
            ));
        } else {
            problems.push(format!(
                "DeviceClass {name} does not select {} devices of type {device_type} (selectors: {})",
                f.driver,
                if class.selectors.is_empty() {
                    "none".to_owned()
                } else {
                    class.selectors.join(" | ")
                }
            ));
        }
    }
    if problems.is_empty() {
        return r;
    }
    for p in &problems {
        r = r.line(p.clone());
    }
    r.fail(
        "install the chart's DeviceClasses (deviceClasses.enabled=true; `helm upgrade` restores \
         them), or pass the names your classes have with --gpu-class/--mig-class",
    )
}

/// The webhook answers through the API server, as admission calls reach it.
pub fn check_webhook_reachable(f: &Facts) -> CheckResult {
    let r = CheckResult::new(
        "webhook-reachable",
        "admission webhook reachable from the API server",
    );
    let Some(w) = &f.webhook else {
        return r
            .line(format!(
                "no ValidatingWebhookConfiguration calls a Service in {}",
                f.namespace
            ))
            .warn(
                "claims' GPU configs are then checked only when the node prepares them; install \
                 it with webhook.enabled=true (the chart's default)",
            );
    };
    let (svc, ns, port) = &w.service;
    let r = r.line(format!("{} -> Service {ns}/{svc}:{port}", w.config));
    match (w.ready_endpoints, &w.reach) {
        (Some(0), _) => r
            .line("the Service has no ready endpoint")
            .fail(format!(
                "no webhook pod is ready: `kubectl -n {ns} get pods -l app.kubernetes.io/component=webhook` and \
                 `kubectl -n {ns} logs deploy/{svc}`"
            )),
        (_, Some(Err(e))) => r.line(format!("GET /readyz through the API server failed: {e}")).fail(
            format!(
                "let the API server reach the webhook's pods on its port (a firewall rule for \
                 private control planes, webhook.networkPolicy.apiServerCIDRs); check \
                 `kubectl -n {ns} get endpointslices -l kubernetes.io/service-name={svc}`"
            ),
        ),
        (n, Some(Ok(()))) => {
            let r = r.line(format!(
                "/readyz answered{}",
                n.map_or(String::new(), |n| format!(" ({n} ready endpoints)"))
            ));
            match &w.admission {
                Some(Ok(Admission::Refused(_))) => r.line(
                    "a dry-run claim with a GPU config the webhook refuses was refused by it: \
                     admission reaches the webhook",
                ),
                Some(Ok(Admission::Admitted)) => r
                    .line(
                        "a dry-run claim with a GPU config the webhook refuses was admitted: \
                         the API server's admission call did not reach the webhook (the \
                         service proxy dials a pod, admission the Service's cluster IP)",
                    )
                    .fail(format!(
                        "let the API server reach Service {ns}/{svc}'s cluster IP (kube-proxy or \
                         its equivalent on the control-plane nodes), or run it with \
                         --enable-aggregator-routing=true so that it calls the webhook's pods; \
                         until then bad GPU configs are admitted and refused only when a node \
                         prepares them"
                    )),
                Some(Err(e)) => r.line(format!("admission not probed: {e}")),
                None => r,
            }
        }
        (_, None) => r
            .line("/readyz not asked")
            .warn("run the check without --only, or with webhook-reachable in it"),
    }
}

/// The webhook's serving certificate is what its registration trusts, for its name, and not
/// about to expire.
pub fn check_webhook_certificate(f: &Facts) -> CheckResult {
    let r = CheckResult::new("webhook-certificate", "webhook certificate valid");
    let Some(w) = &f.webhook else {
        return r.line("no webhook installed");
    };
    let (svc, ns, _) = &w.service;
    let dns = format!("{svc}.{ns}.svc");
    // The chart's name for the Secret where the Deployment could not be read.
    let secret = w.tls_secret.clone().unwrap_or_else(|| format!("{svc}-tls"));
    if w.ca_bundles.len() != 1 || w.ca_bundles[0].trim().is_empty() {
        return r
            .line(format!(
                "{}: {} distinct caBundles among its entries (or one empty)",
                w.config,
                w.ca_bundles.len()
            ))
            .fail(cert_fix(CertFault::Untrusted, ns, svc, &secret, &dns));
    }
    let pem =
        match &w.serving_cert {
            Ok(p) => p,
            Err(e) => return r.line(e.clone()).fail(format!(
                "grant this user `get` on Secrets and Deployments in {ns}, or check the webhook's \
             Deployment mounts its TLS Secret"
            )),
        };
    let verdict = cert::judge(pem.as_bytes(), w.ca_bundles[0].as_bytes(), &dns, f.now);
    let left = verdict.not_after.map(|t| t - f.now);
    let r = match left {
        Some(s) if s >= 0 => r.line(format!(
            "certificate for {dns} expires in {} days",
            s / 86_400
        )),
        Some(s) => r.line(format!(
            "certificate for {dns} expired {} days ago",
            -s / 86_400
        )),
        None => r.line("certificate validity unreadable"),
    };
    if let Some(p) = verdict.problem {
        return r
            .line(p.text)
            .fail(cert_fix(p.kind, ns, svc, &secret, &dns));
    }
    match left {
        Some(s) if s < CERT_WARN_SECONDS => r.warn(format!(
            "renew it before it expires: certManager mode renews by itself (check the \
             Certificate's status); helm mode: delete Secret {ns}/{secret} and `helm upgrade`"
        )),
        _ => r,
    }
}

/// What to do about a webhook certificate the API server refuses, in each of the chart's TLS
/// modes (`webhook.tls.mode`): the Secret `secret` in `ns` is the one the webhook's Deployment
/// mounts, `svc` its Service (and the chart's Certificate), `dns` the name it must carry.
fn cert_fix(fault: CertFault, ns: &str, svc: &str, secret: &str, dns: &str) -> String {
    let helm = format!(
        "helm mode: `helm upgrade` keeps the Secret; delete Secret {ns}/{secret} and run `helm \
         upgrade` to issue a new CA and certificate"
    );
    match fault {
        CertFault::Expired => format!(
            "issue a new certificate: {helm}; certManager mode: `kubectl -n {ns} describe \
             certificate {svc}` says why cert-manager did not renew it; secret mode: put a \
             renewed certificate for {dns} in Secret {ns}/{secret}"
        ),
        CertFault::WrongName => format!(
            "issue a certificate for {dns}: {helm}; certManager mode: the Certificate {ns}/{svc} \
             must list {dns} in its dnsNames; secret mode: put a certificate whose \
             subjectAltName names {dns} in Secret {ns}/{secret}"
        ),
        CertFault::Untrusted => format!(
            "make the registration's caBundle the CA that signed the certificate: {helm}; \
             certManager mode: check the Certificate {ns}/{svc} and cert-manager's CA injector; \
             secret mode: set webhook.tls.secret.caBundle to the CA that signed Secret \
             {ns}/{secret}"
        ),
    }
}

/// The nodes that should run a plugin: those with one, those with our slices, those labeled as
/// GPU nodes.
fn gpu_nodes(f: &Facts) -> BTreeSet<String> {
    let mut nodes: BTreeSet<String> = f
        .nodes
        .iter()
        .filter(|n| n.gpu_label)
        .map(|n| n.name.clone())
        .collect();
    nodes.extend(f.slices.iter().filter_map(|s| s.node.clone()));
    if let Some(p) = &f.plugin {
        nodes.extend(p.pods.iter().filter_map(|p| p.node.clone()));
    }
    nodes
}

/// A ready plugin pod on `node` running the DaemonSet's image.
fn healthy_plugin<'a>(f: &'a Facts, node: &str) -> Option<&'a PodFact> {
    let p = f.plugin.as_ref()?;
    p.pods.iter().find(|pod| {
        pod.node.as_deref() == Some(node)
            && pod.phase == "Running"
            && pod.ready
            && !pod.deleting
            && pod.image == p.image
    })
}

/// Every GPU node runs a ready plugin of the DaemonSet's version (registered with its kubelet:
/// the chart's readiness probe says so).
pub fn check_plugins(f: &Facts) -> CheckResult {
    let r = CheckResult::new(
        "plugin-pods",
        "a registered node plugin of the same version on every GPU node",
    );
    let ns = &f.namespace;
    let Some(p) = &f.plugin else {
        return r
            .line(format!(
                "no DaemonSet labeled app.kubernetes.io/component=kubelet-plugin in {ns}"
            ))
            .fail(format!(
                "install the chart in {ns} (`helm install ... --namespace {ns}`), or pass the \
                 release's namespace with --namespace"
            ));
    };
    let mut r = r.line(format!("{} runs {}", p.daemonset, p.image));
    let mut bad = Vec::new();
    let nodes = gpu_nodes(f);
    for node in &nodes {
        if healthy_plugin(f, node).is_some() {
            continue;
        }
        let pods: Vec<&PodFact> = p
            .pods
            .iter()
            .filter(|pod| pod.node.as_deref() == Some(node.as_str()))
            .collect();
        let why = if pods.is_empty() {
            "no plugin pod".to_owned()
        } else {
            pods.iter()
                .map(|pod| {
                    let mut s = format!("{} {}", pod.name, pod.phase);
                    if !pod.ready {
                        s.push_str(", not ready");
                    }
                    if let Some(reason) = &pod.reason {
                        s.push_str(&format!(" ({reason})"));
                    }
                    if pod.restarts > 0 {
                        s.push_str(&format!(", {} restarts", pod.restarts));
                    }
                    if pod.image != p.image {
                        s.push_str(&format!(", runs {} (an older or newer version)", pod.image));
                    }
                    s
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        bad.push(format!("node {node}: {why}"));
    }
    if bad.is_empty() {
        return r.line(format!(
            "{} GPU nodes, each with a ready plugin",
            nodes.len()
        ));
    }
    for b in &bad {
        r = r.line(b.clone());
    }
    let (_, ds) = p.daemonset.split_once('/').unwrap_or(("", &p.daemonset));
    r.fail(format!(
        "`kubectl -n {ns} describe daemonset {ds}` (nodeSelector, tolerations), `kubectl -n {ns} \
         get pods -o wide -l app.kubernetes.io/component=kubelet-plugin`, and the pod's log \
         (`kubectl -n {ns} logs <pod>`): a plugin that is not ready has not registered with its \
         kubelet or not published its slices; `kubectl -n {ns} rollout status daemonset/{ds}` \
         for a rollout that has not finished"
    ))
}

/// Every node with a plugin has a complete pool of slices, and no slices stay behind for a
/// node without a running plugin.
///
/// Age is not a sign of staleness here: the plugin rewrites its slices only when the node's
/// devices change (rediscovery every 60 s finds the same inventory and writes nothing), so
/// an old slice of a running plugin is current. Stale is what no running plugin stands for.
pub fn check_slices(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new("resource-slices", "ResourceSlices published and not stale");
    let mut pools: BTreeMap<&str, Vec<&super::facts::SliceFact>> = BTreeMap::new();
    for s in &f.slices {
        pools.entry(s.pool.as_str()).or_default().push(s);
    }
    let node = |name: &str| -> Option<&NodeFact> { f.nodes.iter().find(|n| n.name == name) };
    let mut bad = Vec::new();
    for (pool, slices) in &pools {
        let generation = slices.iter().map(|s| s.generation).max().unwrap_or(0);
        let current: Vec<_> = slices
            .iter()
            .filter(|s| s.generation == generation)
            .collect();
        let want = current.first().map_or(0, |s| s.slice_count);
        let devices: usize = current.iter().map(|s| s.devices.len()).sum();
        let Some(node_name) = slices.iter().find_map(|s| s.node.clone()) else {
            continue; // not a node-local pool; not ours to judge
        };
        if i64::try_from(current.len()).unwrap_or(i64::MAX) != want {
            bad.push(format!(
                "pool {pool}: {} of {want} slices of generation {generation} (incomplete: the \
                 scheduler does not allocate from it)",
                current.len()
            ));
        }
        match node(&node_name) {
            None => bad.push(format!(
                "pool {pool}: node {node_name} no longer exists (stale slices)"
            )),
            Some(n) if !n.ready => bad.push(format!(
                "pool {pool}: node {node_name} is not Ready: its kubelet cannot remove slices \
                 of a plugin that is gone"
            )),
            Some(_) if healthy_plugin(f, &node_name).is_none() => bad.push(format!(
                "pool {pool}: no ready plugin on {node_name}: {devices} devices stay \
                 allocatable until the kubelet removes the slices (30 s after its plugin's \
                 last connection)"
            )),
            Some(_) => {
                r = r.line(format!(
                    "{node_name}: {} slices, {devices} devices, generation {generation}",
                    current.len()
                ));
            }
        }
    }
    if let Some(p) = &f.plugin {
        let published: BTreeSet<&str> = f.slices.iter().filter_map(|s| s.node.as_deref()).collect();
        for pod in &p.pods {
            if let Some(n) = pod.node.as_deref()
                && !published.contains(n)
                && healthy_plugin(f, n).is_some_and(|h| h.name == pod.name)
            {
                bad.push(format!(
                    "node {n}: a ready plugin but no slices of {}",
                    f.driver
                ));
            }
        }
    }
    if pools.is_empty() && bad.is_empty() {
        return r
            .line(format!("no ResourceSlices of {}", f.driver))
            .fail("no node publishes GPUs: see plugin-pods and the plugins' logs");
    }
    if bad.is_empty() {
        return r;
    }
    for b in &bad {
        r = r.line(b.clone());
    }
    r.fail(
        "start the node's plugin (see plugin-pods) or, for a node gone for good, delete its \
         slices: `kubectl delete resourceslices --field-selector spec.nodeName=<node>`",
    )
}

/// Tainted devices, with the reason the plugin gave.
pub fn check_device_taints(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new("device-taints", "devices without health taints");
    let mut tainted = 0;
    for s in &f.slices {
        for d in &s.devices {
            for t in &d.taints {
                tainted += 1;
                let since = t
                    .since
                    .map_or(String::new(), |s| format!(", for {}", age(f.now - s)));
                r = r.line(format!(
                    "{}/{}: {}={} {}{since}",
                    s.node.as_deref().unwrap_or(&s.pool),
                    d.name,
                    t.key,
                    t.value.as_deref().unwrap_or(""),
                    t.effect
                ));
            }
        }
    }
    if tainted == 0 {
        return r.line("no device is tainted");
    }
    r.warn(
        "new claims avoid these devices (NoExecute also evicts pods using them): read the \
         plugin's log on the node and `nvidia-smi -q` there; XID and ECC taints go when the \
         condition clears (kubeletPlugin.deviceHealth.holdSeconds) or after the recovery the \
         driver asks for (a GPU reset or a node reboot)",
    )
}

/// The MPS control daemon pods run and are ready.
pub fn check_mps_daemons(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new("mps-daemons", "MPS control daemon pods healthy");
    if f.mps_daemons.is_empty() {
        return r.line("no MPS daemon pod (no claim prepared with MPS)");
    }
    let mut bad = 0;
    for p in &f.mps_daemons {
        if p.phase == "Running" && p.ready {
            let restarts = if p.restarts > 0 {
                format!(", {} restarts", p.restarts)
            } else {
                String::new()
            };
            r = r.line(format!(
                "{} on {}: ready{restarts}",
                p.name,
                p.node.as_deref().unwrap_or("?")
            ));
        } else {
            bad += 1;
            r = r.line(format!(
                "{} on {}: {}, not ready{}",
                p.name,
                p.node.as_deref().unwrap_or("?"),
                p.phase,
                p.reason
                    .as_deref()
                    .map_or(String::new(), |s| format!(" ({s})"))
            ));
        }
    }
    if bad == 0 {
        return r;
    }
    r.fail(format!(
        "the MPS clients of those claims cannot start: `kubectl -n {ns} logs <pod>` (the \
         daemon's log) and `kubectl -n {ns} describe pod <pod>`; the plugin recreates a daemon \
         pod that is deleted at the claim's next prepare",
        ns = f.namespace
    ))
}

/// Pods whose claims the kubelet could not prepare and that still wait.
pub fn check_stuck_claims(f: &Facts) -> CheckResult {
    let mut r = CheckResult::new("stuck-claims", "no claim stuck in prepare");
    let mut stuck = 0;
    let mut per_pod: BTreeMap<&str, &super::facts::PrepareFailure> = BTreeMap::new();
    for e in &f.prepare_failures {
        let entry = per_pod.entry(e.pod.as_str()).or_insert(e);
        if e.last_seen > entry.last_seen {
            *entry = e;
        }
    }
    for e in per_pod.values() {
        let waiting = matches!(e.pod_phase.as_deref(), Some("Pending"));
        if !waiting {
            continue;
        }
        if f.now - e.last_seen > RECENT_SECONDS {
            continue;
        }
        stuck += 1;
        let claims = match e.claims.as_slice() {
            [] => String::new(),
            [one] => format!(" (claim {one})"),
            many => format!(" (claims {})", many.join(", ")),
        };
        r = r.line(format!(
            "pod {} on {}{claims}: {} ({} times, last {} ago)",
            e.pod,
            e.node.as_deref().unwrap_or("?"),
            e.message,
            e.count,
            age(f.now - e.last_seen)
        ));
    }
    if stuck == 0 {
        return r.line("no pending pod with a recent FailedPrepareDynamicResources event");
    }
    r.fail(
        "the message is the node plugin's: `gpu-dra explain <namespace>/<claim>` for the \
         claim's devices, the plugin's log on the node, `kubectl describe pod`; the kubelet \
         retries the prepare by itself once the cause is gone",
    )
}

fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::super::facts::*;
    use super::*;

    const IMAGE: &str = "registry.example/gpu-dra@sha256:1";

    fn plugin_pod(node: &str) -> PodFact {
        PodFact {
            name: format!("gpu-dra/plugin-{node}"),
            node: Some(node.into()),
            image: IMAGE.into(),
            phase: "Running".into(),
            ready: true,
            ..PodFact::default()
        }
    }

    fn slice(node: &str) -> SliceFact {
        SliceFact {
            name: format!("{node}-gpu-nvidia-com-0"),
            node: Some(node.into()),
            pool: node.into(),
            generation: 1,
            slice_count: 1,
            devices: vec![DeviceFact {
                name: "gpu-0".into(),
                taints: Vec::new(),
            }],
        }
    }

    /// A healthy 1.37 cluster with two GPU nodes, the chart's classes, a webhook with a valid
    /// certificate, one ready MPS daemon.
    fn healthy() -> Facts {
        let (ca, serving) = cert::tests::ca_and_serving(
            "gpu-dra-gpu-dra-driver-webhook.gpu-dra.svc",
            (2026, 1, 1),
            (2027, 1, 1),
        );
        let class = |name: &str, t: &str| ClassFact {
            name: name.into(),
            selectors: vec![format!(
                "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '{t}'"
            )],
        };
        let node = |name: &str| NodeFact {
            name: name.into(),
            ready: true,
            ..NodeFact::default()
        };
        Facts {
            now: cert::tests::JUNE_2026,
            driver: "gpu.nvidia.com".into(),
            namespace: "gpu-dra".into(),
            server: Some(ServerVersion {
                minor: 37,
                git_version: "v1.37.1".into(),
            }),
            resource_versions: vec!["v1".into()],
            probe: BTreeMap::from([
                ("DRAConsumableCapacity".into(), true),
                ("DRADeviceTaints".into(), true),
                ("DRAPartitionableDevices".into(), true),
            ]),
            probe_error: None,
            declared_gates: Vec::new(),
            expected_classes: vec![
                ("gpu.nvidia.com".into(), "gpu".into()),
                ("mig.nvidia.com".into(), "mig".into()),
            ],
            classes: vec![
                class("gpu.nvidia.com", "gpu"),
                class("mig.nvidia.com", "mig"),
            ],
            plugin: Some(PluginSet {
                daemonset: "gpu-dra/gpu-dra-gpu-dra-driver-kubelet-plugin".into(),
                image: IMAGE.into(),
                env: BTreeMap::from([
                    ("DEVICE_HEALTH".into(), "true".into()),
                    ("MEMORY_SHARE_GPUS".into(), "all".into()),
                    ("CONSUMABLE_SHARES".into(), "disabled".into()),
                ]),
                pods: vec![plugin_pod("node-a"), plugin_pod("node-b")],
            }),
            nodes: vec![node("node-a"), node("node-b"), node("control-plane")],
            slices: vec![slice("node-a"), slice("node-b")],
            webhook: Some(WebhookFacts {
                config: "gpu-dra-gpu-dra-driver-webhook".into(),
                ca_bundles: vec![ca],
                service: (
                    "gpu-dra-gpu-dra-driver-webhook".into(),
                    "gpu-dra".into(),
                    443,
                ),
                tls_secret: Some("gpu-dra-gpu-dra-driver-webhook-tls".into()),
                serving_cert: Ok(serving),
                ready_endpoints: Some(2),
                reach: Some(Ok(())),
                admission: Some(Ok(Admission::Refused(
                    "admission webhook \"resourceclaims.opaque-config.gpu.nvidia.com\" denied the request".into(),
                ))),
            }),
            mps_daemons: vec![PodFact {
                name: "gpu-dra/mps-1".into(),
                node: Some("node-a".into()),
                phase: "Running".into(),
                ready: true,
                ..PodFact::default()
            }],
            prepare_failures: vec![PrepareFailure {
                pod: "team/recovered".into(),
                node: Some("node-a".into()),
                message: "transient".into(),
                count: 1,
                last_seen: cert::tests::JUNE_2026 - 60,
                pod_phase: Some("Running".into()),
                claims: vec!["gpu".into()],
            }],
        }
    }

    #[test]
    fn a_healthy_cluster_passes_every_check() {
        let results = all(&healthy());
        assert_eq!(results.iter().map(|r| r.name).collect::<Vec<_>>(), NAMES);
        for r in &results {
            assert_eq!(r.status, Status::Passed, "{r:?}");
            assert!(r.fix.is_none());
        }
    }

    #[test]
    fn api_server_older_than_1_34_fails_newer_than_tested_warns() {
        let mut f = healthy();
        f.server.as_mut().unwrap().minor = 33;
        let r = check_api_server(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(r.fix.unwrap().contains("1.34"));
        f.server.as_mut().unwrap().minor = 38;
        assert_eq!(check_api_server(&f).status, Status::Warning);
    }

    #[test]
    fn resource_api_without_v1_fails_and_stops_the_other_checks() {
        let mut f = healthy();
        f.resource_versions = vec!["v1beta1".into()];
        let r = check_resource_api(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(r.detail[0].contains("v1beta1"));
        assert_eq!(all(&f).len(), 2);
    }

    #[test]
    fn a_feature_a_setting_needs_that_the_server_drops_fails_naming_gate_and_setting() {
        let mut f = healthy();
        f.probe.insert("DRAConsumableCapacity".into(), false);
        let r = check_dra_features(&f);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        let fix = r.fix.unwrap();
        assert!(fix.contains("feature gate DRAConsumableCapacity"), "{fix}");
        assert!(fix.contains("on by default from Kubernetes 1.36"), "{fix}");
        assert!(fix.contains("memoryShareGpus=\"all\""), "{fix}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("turned off on this cluster")),
            "{:?}",
            r.detail
        );
        // Not needed: off is fine.
        f.plugin.as_mut().unwrap().env.remove("MEMORY_SHARE_GPUS");
        assert_eq!(check_dra_features(&f).status, Status::Passed);
    }

    #[test]
    fn without_a_probe_the_version_defaults_and_declared_gates_decide() {
        let mut f = healthy();
        f.probe.clear();
        f.probe_error = Some("forbidden".into());
        f.server.as_mut().unwrap().minor = 35;
        let r = check_dra_features(&f);
        assert_eq!(r.status, Status::Failed);
        // Health needs DRADeviceTaints and ResourceHealthStatus, memory shares consumable capacity.
        let fix = r.fix.unwrap();
        for gate in [
            "DRAConsumableCapacity",
            "DRADeviceTaints",
            "ResourceHealthStatus",
        ] {
            assert!(fix.contains(gate), "{fix}");
        }
        f.declared_gates = vec![
            "DRAConsumableCapacity".into(),
            "DRADeviceTaints".into(),
            "ResourceHealthStatus".into(),
        ];
        assert_eq!(check_dra_features(&f).status, Status::Passed);
    }

    #[test]
    fn device_health_without_its_gates_warns_with_the_fallback_and_does_not_fail() {
        // A default install on 1.34: device health on, its gates off, nothing else needed.
        let mut f = healthy();
        f.plugin.as_mut().unwrap().env.remove("MEMORY_SHARE_GPUS");
        f.server.as_mut().unwrap().minor = 34;
        f.probe.insert("DRAConsumableCapacity".into(), false);
        f.probe.insert("DRADeviceTaints".into(), false);
        let r = check_dra_features(&f);
        assert_eq!(r.status, Status::Warning, "{r:?}");
        let fix = r.fix.unwrap();
        assert!(fix.contains("withheld from the ResourceSlices"), "{fix}");
        assert!(fix.contains("feature gate DRADeviceTaints"), "{fix}");
        assert!(fix.contains("ResourceHealthStatus"), "{fix}");
        // Memory shares have no such fallback: failed, the health warnings said with it.
        f.plugin
            .as_mut()
            .unwrap()
            .env
            .insert("MEMORY_SHARE_GPUS".into(), "all".into());
        let r = check_dra_features(&f);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        let fix = r.fix.unwrap();
        assert!(
            fix.contains("or turn off kubeletPlugin.partitioning.memoryShareGpus"),
            "{fix}"
        );
        assert!(fix.contains("withheld from the ResourceSlices"), "{fix}");
    }

    #[test]
    fn a_gate_judged_by_the_release_default_is_said_to_be_assumed() {
        // The healthy fixture's probe shows no ResourceHealthStatus (pod status fields): its
        // state is the release's default, which a cluster can have turned off.
        let r = check_dra_features(&healthy());
        assert_eq!(r.status, Status::Passed);
        let line = |gate: &str| {
            r.detail
                .iter()
                .find(|l| l.starts_with(&format!("{gate}: ")))
                .unwrap_or_else(|| panic!("no {gate} line: {r:?}"))
        };
        let health = line("ResourceHealthStatus");
        assert!(
            health.contains("not observed: on by default in 1.37")
                && health.contains("unless the cluster turned it off"),
            "{health}"
        );
        let lists = line("DRAListTypeAttributes");
        assert!(
            lists.contains("turned it on (say so with --cluster-feature-gates)"),
            "{lists}"
        );
        // Seen by the probe: not assumed.
        let capacity = line("DRAConsumableCapacity");
        assert!(!capacity.contains("not observed"), "{capacity}");
    }

    #[test]
    fn node_annotations_need_their_gates_too() {
        let mut f = healthy();
        f.plugin.as_mut().unwrap().env.clear();
        f.nodes[0].dynamic_mig_gpus = Some("0".into());
        f.probe.insert("DRAPartitionableDevices".into(), false);
        let r = check_dra_features(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(r.fix.unwrap().contains("node node-a annotation"));
    }

    #[test]
    fn a_missing_or_wrong_device_class_fails() {
        let mut f = healthy();
        f.classes.remove(1);
        let r = check_device_classes(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail
                .iter()
                .any(|l| l == "DeviceClass mig.nvidia.com is missing")
        );
        let mut f = healthy();
        f.classes[0].selectors = vec!["device.driver == 'other.example.com'".into()];
        assert_eq!(check_device_classes(&f).status, Status::Failed);
    }

    #[test]
    fn a_webhook_without_endpoints_or_unreachable_fails_absent_warns() {
        let mut f = healthy();
        f.webhook.as_mut().unwrap().ready_endpoints = Some(0);
        assert_eq!(check_webhook_reachable(&f).status, Status::Failed);
        let mut f = healthy();
        f.webhook.as_mut().unwrap().reach = Some(Err("dial tcp: i/o timeout".into()));
        let r = check_webhook_reachable(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(r.fix.unwrap().contains("firewall"));
        let mut f = healthy();
        f.webhook = None;
        assert_eq!(check_webhook_reachable(&f).status, Status::Warning);
        assert_eq!(check_webhook_certificate(&f).status, Status::Passed);
        // Not asked (`--only` without this check): not a pass.
        let mut f = healthy();
        f.webhook.as_mut().unwrap().reach = None;
        assert_eq!(check_webhook_reachable(&f).status, Status::Warning);
    }

    #[test]
    fn readyz_through_the_proxy_is_not_enough_when_admission_does_not_reach_the_webhook() {
        let f = healthy();
        let r = check_webhook_reachable(&f);
        assert_eq!(r.status, Status::Passed, "{r:?}");
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("admission reaches the webhook"))
        );
        // /readyz answered through the service proxy, but a claim the webhook must refuse
        // was admitted: the API server's admission calls do not reach it.
        let mut f = healthy();
        f.webhook.as_mut().unwrap().admission = Some(Ok(Admission::Admitted));
        let r = check_webhook_reachable(&f);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(r.fix.unwrap().contains("--enable-aggregator-routing=true"));
        // No right to create claims: said, judged by /readyz alone.
        let mut f = healthy();
        f.webhook.as_mut().unwrap().admission = Some(Err("forbidden".into()));
        let r = check_webhook_reachable(&f);
        assert_eq!(r.status, Status::Passed);
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("admission not probed: forbidden"))
        );
    }

    #[test]
    fn an_expired_wrong_or_expiring_webhook_certificate_is_reported() {
        let svc = "gpu-dra-gpu-dra-driver-webhook.gpu-dra.svc";
        let secret = "Secret gpu-dra/gpu-dra-gpu-dra-driver-webhook-tls";
        let mut f = healthy();
        let (ca, serving) = cert::tests::ca_and_serving(svc, (2025, 1, 1), (2026, 1, 1));
        let w = f.webhook.as_mut().unwrap();
        w.ca_bundles = vec![ca];
        w.serving_cert = Ok(serving);
        let r = check_webhook_certificate(&f);
        assert_eq!(r.status, Status::Failed, "{r:?}");
        assert!(
            r.detail.iter().any(|l| l.contains("expired 151 days ago")),
            "{r:?}"
        );
        // An expired certificate needs a new one, not another caBundle.
        let fix = r.fix.unwrap();
        assert!(fix.starts_with("issue a new certificate"), "{fix}");
        assert!(fix.contains(&format!("delete {secret}")), "{fix}");
        assert!(
            fix.contains(&format!("renewed certificate for {svc} in {secret}")),
            "{fix}"
        );
        assert!(!fix.contains("caBundle"), "{fix}");

        let mut f = healthy();
        let (other_ca, _) = cert::tests::ca_and_serving(svc, (2026, 1, 1), (2027, 1, 1));
        f.webhook.as_mut().unwrap().ca_bundles = vec![other_ca];
        let r = check_webhook_certificate(&f);
        assert_eq!(r.status, Status::Failed);
        let fix = r.fix.unwrap();
        assert!(fix.contains(&format!("delete {secret}")), "{fix}");
        assert!(
            fix.contains(&format!(
                "set webhook.tls.secret.caBundle to the CA that signed {secret}"
            )),
            "{fix}"
        );

        // Valid and trusted, but for another name.
        let mut f = healthy();
        let (ca, serving) =
            cert::tests::ca_and_serving("other.gpu-dra.svc", (2026, 1, 1), (2027, 1, 1));
        let w = f.webhook.as_mut().unwrap();
        w.ca_bundles = vec![ca];
        w.serving_cert = Ok(serving);
        // The Secret a secret-mode release mounts is named in the fix.
        w.tls_secret = Some("own-tls".into());
        let r = check_webhook_certificate(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains(&format!("does not name {svc}"))),
            "{r:?}"
        );
        let fix = r.fix.unwrap();
        assert!(
            fix.starts_with(&format!("issue a certificate for {svc}")),
            "{fix}"
        );
        assert!(
            fix.contains(
                "names gpu-dra-gpu-dra-driver-webhook.gpu-dra.svc in Secret gpu-dra/own-tls"
            ),
            "{fix}"
        );

        let mut f = healthy();
        let (ca, serving) = cert::tests::ca_and_serving(svc, (2026, 1, 1), (2026, 6, 11));
        let w = f.webhook.as_mut().unwrap();
        w.ca_bundles = vec![ca];
        w.serving_cert = Ok(serving);
        let r = check_webhook_certificate(&f);
        assert_eq!(r.status, Status::Warning);
        assert!(
            r.detail.iter().any(|l| l.contains("expires in 10 days")),
            "{r:?}"
        );
    }

    #[test]
    fn a_gpu_node_without_a_ready_plugin_of_the_current_version_fails() {
        // Plugin gone from a node that still has slices.
        let mut f = healthy();
        f.plugin.as_mut().unwrap().pods.remove(1);
        let r = check_plugins(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail.contains(&"node node-b: no plugin pod".to_owned()),
            "{r:?}"
        );
        assert!(r.fix.unwrap().contains("describe daemonset"));
        // A labeled GPU node with neither a plugin nor slices.
        let mut f = healthy();
        f.nodes[2].gpu_label = true;
        assert_eq!(check_plugins(&f).status, Status::Failed);
        // An old version.
        let mut f = healthy();
        f.plugin.as_mut().unwrap().pods[0].image = "old".into();
        let r = check_plugins(&f);
        assert!(r.detail.iter().any(|l| l.contains("runs old")), "{r:?}");
        // Not ready, crash looping.
        let mut f = healthy();
        let pod = &mut f.plugin.as_mut().unwrap().pods[0];
        pod.ready = false;
        pod.reason = Some("CrashLoopBackOff".into());
        pod.restarts = 4;
        let r = check_plugins(&f);
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("not ready (CrashLoopBackOff), 4 restarts")),
            "{r:?}"
        );
        // No DaemonSet at all.
        let mut f = healthy();
        f.plugin = None;
        assert!(check_plugins(&f).fix.unwrap().contains("--namespace"));
    }

    #[test]
    fn slices_without_a_plugin_incomplete_pools_and_missing_slices_fail() {
        let mut f = healthy();
        f.plugin.as_mut().unwrap().pods.remove(1);
        let r = check_slices(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail
                .iter()
                .any(|l| l.contains("no ready plugin on node-b")),
            "{r:?}"
        );

        let mut f = healthy();
        f.slices[0].slice_count = 2;
        assert!(
            check_slices(&f)
                .detail
                .iter()
                .any(|l| l.contains("1 of 2 slices"))
        );

        let mut f = healthy();
        f.nodes[1].ready = false;
        assert_eq!(check_slices(&f).status, Status::Failed);

        let mut f = healthy();
        f.slices.remove(1);
        let r = check_slices(&f);
        assert!(
            r.detail.contains(
                &"node node-b: a ready plugin but no slices of gpu.nvidia.com".to_owned()
            ),
            "{r:?}"
        );

        let mut f = healthy();
        f.slices.clear();
        assert_eq!(check_slices(&f).status, Status::Failed);
    }

    #[test]
    fn tainted_devices_are_listed_with_their_reason() {
        let mut f = healthy();
        f.slices[0].devices[0].taints.push(TaintFact {
            key: "gpu.nvidia.com/xid".into(),
            value: Some("79".into()),
            effect: "NoSchedule".into(),
            since: Some(f.now - 7200),
        });
        let r = check_device_taints(&f);
        assert_eq!(r.status, Status::Warning);
        assert_eq!(
            r.detail,
            vec!["node-a/gpu-0: gpu.nvidia.com/xid=79 NoSchedule, for 2h".to_owned()]
        );
    }

    #[test]
    fn an_mps_daemon_not_ready_fails() {
        let mut f = healthy();
        f.mps_daemons[0].ready = false;
        f.mps_daemons[0].phase = "Pending".into();
        f.mps_daemons[0].reason = Some("ImagePullBackOff".into());
        let r = check_mps_daemons(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail[0].contains("Pending, not ready (ImagePullBackOff)"),
            "{r:?}"
        );
    }

    #[test]
    fn a_pending_pod_with_a_recent_prepare_failure_is_stuck() {
        let mut f = healthy();
        f.prepare_failures[0].pod_phase = Some("Pending".into());
        f.prepare_failures[0].message = "prepare: GPU-1 is gone".into();
        let r = check_stuck_claims(&f);
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.detail[0]
                .contains("pod team/recovered on node-a (claim gpu): prepare: GPU-1 is gone"),
            "{r:?}"
        );
        f.prepare_failures[0].claims.push("gpu-2".into());
        assert!(
            check_stuck_claims(&f).detail[0].contains("(claims gpu, gpu-2)"),
            "{r:?}"
        );
        // Old failures of a pod that still waits are history, not a stuck prepare.
        f.prepare_failures[0].last_seen = f.now - 2 * RECENT_SECONDS;
        assert_eq!(check_stuck_claims(&f).status, Status::Passed);
    }
}
