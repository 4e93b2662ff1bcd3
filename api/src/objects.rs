//! Finding and checking our opaque configs inside Kubernetes objects.
//!
//! Shared by the CLI and the admission webhook. Works on plain `serde_json::Value` so that
//! `resource.k8s.io/v1`, `v1beta1` and `v1beta2` shapes are handled alike: the parts we read
//! (`spec.devices.config`, `spec.devices.requests[*].name`, `firstAvailable[*].name`,
//! `spec.config` of a DeviceClass) have the same shape in all of them.
//!
//! Only configs whose `opaque.driver` equals the given driver name are judged; configs for
//! other drivers are none of our business. Every path in a [`Report`] is a full path from the
//! object root, e.g. `spec.devices.config[0].opaque.parameters.sharing.strategy`.
//!
//! Beyond each config on its own, claims and templates are checked for what their spec shows:
//! configs naming requests that do not exist, a config kind that does not fit the request's
//! DeviceClass (a warning), and sharing settings reaching a request with `adminAccess` (an
//! error, [`crate::admin_access_sharing`]; the node refuses the same when the config comes
//! from a DeviceClass).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::allocation::admin_access_sharing;
use crate::config::{ConfigKind, describe};
use crate::error::{FieldError, index, join};

/// The object kinds that can carry opaque device configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    /// `ResourceClaim`: configs at `spec.devices.config`.
    ResourceClaim,
    /// `ResourceClaimTemplate`: configs at `spec.spec.devices.config`.
    ResourceClaimTemplate,
    /// `DeviceClass` (cluster-scoped): configs at `spec.config`.
    DeviceClass,
}

impl ObjectKind {
    /// The kind spelled `kind`, if it is one of ours.
    pub fn from_kind(kind: &str) -> Option<Self> {
        match kind {
            "ResourceClaim" => Some(Self::ResourceClaim),
            "ResourceClaimTemplate" => Some(Self::ResourceClaimTemplate),
            "DeviceClass" => Some(Self::DeviceClass),
            _ => None,
        }
    }

    /// The `kind` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ResourceClaim => "ResourceClaim",
            Self::ResourceClaimTemplate => "ResourceClaimTemplate",
            Self::DeviceClass => "DeviceClass",
        }
    }
}

/// What [`check_object`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Invalid configs: the object must be rejected.
    pub errors: Vec<FieldError>,
    /// Likely mistakes that are not certain to fail (e.g. a `GpuConfig` for a request of a
    /// MIG device class).
    pub warnings: Vec<String>,
    /// `config[i].requests[j]` naming a request the object does not have. The CLI treats
    /// these as errors; the webhook may choose to only warn.
    pub unknown_requests: Vec<FieldError>,
}

impl Report {
    /// True when there is neither an error nor an unknown request.
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty() && self.unknown_requests.is_empty()
    }
}

/// The kind, when `obj` is a `resource.k8s.io` object that can carry configs. An object with
/// no `apiVersion` is accepted too, so hand-written files without it are still checked.
pub fn object_kind(obj: &Value) -> Option<ObjectKind> {
    if let Some(api_version) = obj.get("apiVersion") {
        let group = api_version.as_str()?.split('/').next()?;
        if group != "resource.k8s.io" {
            return None;
        }
    }
    ObjectKind::from_kind(obj.get("kind")?.as_str()?)
}

/// `ResourceClaim default/x`, `ResourceClaimTemplate ns/t`, `DeviceClass gpu.nvidia.com`:
/// namespaced objects without a namespace show `default`, as `kubectl apply` would use.
pub fn object_label(obj: &Value) -> String {
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("object");
    let meta = obj.get("metadata");
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str);
    let name = match (field("name"), field("generateName")) {
        (Some(n), _) if !n.is_empty() => n.to_owned(),
        (_, Some(g)) if !g.is_empty() => format!("{g}*"),
        _ => "<unnamed>".to_owned(),
    };
    const CLUSTER_SCOPED: [&str; 6] = [
        "DeviceClass",
        "ResourceSlice",
        "DeviceTaintRule",
        "Namespace",
        "Node",
        "ValidatingAdmissionPolicy",
    ];
    if CLUSTER_SCOPED.contains(&kind) {
        format!("{kind} {name}")
    } else {
        let ns = field("namespace")
            .filter(|n| !n.is_empty())
            .unwrap_or("default");
        format!("{kind} {ns}/{name}")
    }
}

/// Checks every config for `driver` in `obj` (see the module documentation). Objects of other
/// kinds give an empty report.
pub fn check_object(obj: &Value, driver: &str) -> Report {
    let mut report = Report::default();
    let Some(kind) = object_kind(obj) else {
        return report;
    };
    let (config_path, requests) = match kind {
        ObjectKind::DeviceClass => ("spec.config", None),
        ObjectKind::ResourceClaim => ("spec.devices.config", Some("spec.devices")),
        ObjectKind::ResourceClaimTemplate => {
            ("spec.spec.devices.config", Some("spec.spec.devices"))
        }
    };
    let configs = match lookup(obj, config_path) {
        None | Some(Value::Null) => return report,
        Some(Value::Array(a)) => a,
        Some(other) => {
            report.errors.push(FieldError::new(
                config_path,
                format!("must be a list, got {}", describe(other)),
            ));
            return report;
        }
    };
    let admin = requests
        .map(|p| admin_requests(lookup(obj, p)))
        .unwrap_or_default();
    let requests = requests.map(|p| request_classes(lookup(obj, p)));
    // MPS configs of ours: (path, requests named explicitly; None = all requests).
    let mut mps_configs: Vec<(String, Option<Vec<String>>)> = Vec::new();
    for (i, cfg) in configs.iter().enumerate() {
        let path = index(config_path, i);
        let Some(opaque) = cfg.get("opaque").filter(|o| o.is_object()) else {
            continue;
        };
        if opaque.get("driver").and_then(Value::as_str) != Some(driver) {
            continue;
        }
        let params_path = join(&path, "opaque.parameters");
        let decoded = match opaque.get("parameters") {
            None | Some(Value::Null) => {
                report.errors.push(FieldError::new(
                    params_path.clone(),
                    format!(
                        "required: configs for driver {driver} carry a GpuConfig or \
                         MigDeviceConfig object here"
                    ),
                ));
                None
            }
            Some(params) => match crate::decode(params) {
                Ok(c) => Some(c),
                Err(errs) => {
                    report.errors.extend(errs.with_prefix(&params_path));
                    None
                }
            },
        };
        let Some(requests) = &requests else {
            continue;
        };
        let targets = check_request_refs(cfg, &path, requests, &mut report);
        if let Some(config) = decoded {
            warn_class_mismatch(config.kind(), &path, &targets, requests, &mut report);
            if config.sharing().is_some() {
                for name in targets.iter().filter(|t| admin.contains(*t)) {
                    report
                        .errors
                        .push(admin_access_sharing(name).with_prefix(&params_path));
                }
            }
            if matches!(config.sharing(), Some(crate::Sharing::Mps(_))) {
                let named = cfg
                    .get("requests")
                    .and_then(Value::as_array)
                    .filter(|a| !a.is_empty())
                    .map(|_| targets);
                mps_configs.push((path, named));
            }
        }
    }
    if let Some(requests) = &requests {
        check_one_mps_daemon(&mps_configs, requests, &mut report);
    }
    report
}

/// Refuses a claim in which two MPS configs would each apply to some request: a container
/// referencing the claim without naming a request gets every request's devices, and so two
/// MPS daemons whose pipe directories mount at the same path. Within a claim's own configs the
/// later of two naming a request wins, and one naming it beats one for all requests, as on the
/// node. A config for all requests counts only for requests whose DeviceClass is evidently
/// this driver's (`gpu.*`, `mig.*`), since it applies to our devices only; the node plugin
/// checks the allocated devices exactly (and DeviceClass configs, which the claim does not
/// show) with the same message.
fn check_one_mps_daemon(
    mps_configs: &[(String, Option<Vec<String>>)],
    requests: &Requests,
    report: &mut Report,
) {
    if mps_configs.len() < 2 {
        return;
    }
    // Request -> the MPS config (position in `mps_configs`) that applies to it. Only top-level
    // request names: a config naming a subrequest applies like one naming its request.
    let mut applied: Vec<Vec<String>> = vec![Vec::new(); mps_configs.len()];
    for (name, classes) in requests.iter().filter(|(n, _)| !n.contains('/')) {
        let named = mps_configs.iter().rposition(|(_, named)| {
            named.as_ref().is_some_and(|n| {
                n.iter()
                    .any(|r| r == name || r.split_once('/').is_some_and(|(b, _)| b == name))
            })
        });
        let ours = classes
            .iter()
            .any(|c| c.starts_with("gpu.") || c.starts_with("mig."));
        let catch_all = || {
            mps_configs
                .iter()
                .rposition(|(_, named)| named.is_none())
                .filter(|_| ours)
        };
        if let Some(at) = named.or_else(catch_all) {
            applied[at].push(name.clone());
        }
    }
    let used: Vec<usize> = (0..mps_configs.len())
        .filter(|&i| !applied[i].is_empty())
        .collect();
    if let [first, second, ..] = used[..] {
        report.errors.push(FieldError::new(
            mps_configs[second].0.clone(),
            crate::two_mps_configs_message(&applied[first], &applied[second]),
        ));
    }
}

fn lookup<'a>(obj: &'a Value, dotted: &str) -> Option<&'a Value> {
    dotted.split('.').try_fold(obj, |v, f| v.get(f))
}

/// Request name (`req` or `req/sub`) -> device class names it may use.
type Requests = BTreeMap<String, Vec<String>>;

fn request_classes(devices: Option<&Value>) -> Requests {
    let mut out = Requests::new();
    let list = devices
        .and_then(|d| d.get("requests"))
        .and_then(Value::as_array);
    for req in list.into_iter().flatten() {
        let Some(name) = req.get("name").and_then(Value::as_str) else {
            continue;
        };
        // v1 nests the class under `exactly`; v1beta1 has it on the request itself.
        let class = req
            .get("exactly")
            .unwrap_or(req)
            .get("deviceClassName")
            .and_then(Value::as_str);
        let mut classes: Vec<String> = class.map(str::to_owned).into_iter().collect();
        for sub in req
            .get("firstAvailable")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let Some(sub_name) = sub.get("name").and_then(Value::as_str) else {
                continue;
            };
            let sub_class: Vec<String> = sub
                .get("deviceClassName")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .into_iter()
                .collect();
            classes.extend(sub_class.iter().cloned());
            out.insert(format!("{name}/{sub_name}"), sub_class);
        }
        out.insert(name.to_owned(), classes);
    }
    out
}

/// Names of the requests with `adminAccess: true` (under `exactly` in v1, on the request
/// itself in v1beta1; subrequests cannot ask for it).
fn admin_requests(devices: Option<&Value>) -> BTreeSet<String> {
    devices
        .and_then(|d| d.get("requests"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|req| {
            req.get("exactly")
                .unwrap_or(req)
                .get("adminAccess")
                .and_then(Value::as_bool)
                == Some(true)
        })
        .filter_map(|req| req.get("name").and_then(Value::as_str).map(str::to_owned))
        .collect()
}

/// Checks `config[i].requests` and returns the request names the config applies to.
fn check_request_refs(
    cfg: &Value,
    path: &str,
    requests: &Requests,
    report: &mut Report,
) -> Vec<String> {
    let refs = match cfg.get("requests") {
        None | Some(Value::Null) => return requests.keys().cloned().collect(),
        Some(Value::Array(a)) if a.is_empty() => return requests.keys().cloned().collect(),
        Some(Value::Array(a)) => a,
        Some(other) => {
            report.errors.push(FieldError::new(
                join(path, "requests"),
                format!("must be a list of request names, got {}", describe(other)),
            ));
            return Vec::new();
        }
    };
    let mut targets = Vec::new();
    for (j, r) in refs.iter().enumerate() {
        let rpath = index(&join(path, "requests"), j);
        match r.as_str() {
            Some(name) if requests.contains_key(name) => targets.push(name.to_owned()),
            Some(name) => {
                let known: Vec<&str> = requests.keys().map(String::as_str).collect();
                report.unknown_requests.push(FieldError::new(
                    rpath,
                    format!(
                        "request {name:?} does not exist; requests here: {}",
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            }
            None => report.errors.push(FieldError::new(
                rpath,
                format!("must be a request name, got {}", describe(r)),
            )),
        }
    }
    targets
}

/// Warns when a config kind meets a request whose device class evidently gives the other kind
/// of device (classes named like the driver's `gpu.*` / `mig.*` DeviceClasses).
fn warn_class_mismatch(
    kind: ConfigKind,
    path: &str,
    targets: &[String],
    requests: &Requests,
    report: &mut Report,
) {
    for name in targets {
        for class in requests.get(name).into_iter().flatten() {
            let mismatch = match kind {
                ConfigKind::Gpu => class.starts_with("mig."),
                ConfigKind::Mig => class.starts_with("gpu."),
            };
            if mismatch {
                let (gives, wanted) = match kind {
                    ConfigKind::Gpu => ("MIG devices", "MigDeviceConfig"),
                    ConfigKind::Mig => ("full GPUs", "GpuConfig"),
                };
                report.warnings.push(format!(
                    "{path}: {kind} applies to request {name:?}, whose DeviceClass {class:?} \
                     gives {gives}; it will fail when the device is prepared (use {wanted})"
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "gpu.nvidia.com";

    fn params(strategy: &str) -> Value {
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
               "sharing": {"strategy": strategy}})
    }

    fn opaque(parameters: Value) -> Value {
        json!({"opaque": {"driver": DRIVER, "parameters": parameters}})
    }

    fn claim(api_version: &str, devices: Value) -> Value {
        json!({"apiVersion": api_version, "kind": "ResourceClaim",
               "metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": devices}})
    }

    fn paths(errs: &[FieldError]) -> Vec<&str> {
        errs.iter().map(|e| e.path.as_str()).collect()
    }

    #[test]
    fn full_paths_for_each_kind() {
        let bad = opaque(params("mps"));
        let c = claim(
            "resource.k8s.io/v1",
            json!({"config": [opaque(params("MPS")), bad]}),
        );
        let r = check_object(&c, DRIVER);
        assert_eq!(
            paths(&r.errors),
            ["spec.devices.config[1].opaque.parameters.sharing.strategy"]
        );
        let t = json!({"apiVersion": "resource.k8s.io/v1beta2", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t"}, "spec": {"spec": {"devices": {"config": [bad]}}}});
        assert_eq!(
            paths(&check_object(&t, DRIVER).errors),
            ["spec.spec.devices.config[0].opaque.parameters.sharing.strategy"]
        );
        let d = json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "d"}, "spec": {"config": [bad]}});
        assert_eq!(
            paths(&check_object(&d, DRIVER).errors),
            ["spec.config[0].opaque.parameters.sharing.strategy"]
        );
    }

    #[test]
    fn two_mps_configs_for_requests_of_one_claim_are_refused() {
        let with_requests = |names: &[&str]| {
            let mut c = opaque(params("MPS"));
            if !names.is_empty() {
                c["requests"] = json!(names);
            }
            c
        };
        let reqs = json!([
            {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
            {"name": "b", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
            {"name": "x", "exactly": {"deviceClassName": "nic.example.com"}}
        ]);
        let check = |configs: Value| {
            let c = claim(
                "resource.k8s.io/v1",
                json!({"requests": reqs.clone(), "config": configs}),
            );
            check_object(&c, DRIVER).errors
        };
        // One MPS config for a, another for b: refused at the second, naming both.
        let e = check(json!([with_requests(&["a"]), with_requests(&["b"])]));
        assert_eq!(paths(&e), ["spec.devices.config[1]"]);
        assert_eq!(
            e[0].message,
            crate::two_mps_configs_message(&["a".into()], &["b".into()])
        );
        // A catch-all MPS config plus one naming a: b still gets the catch-all one.
        let e = check(json!([with_requests(&[]), with_requests(&["a"])]));
        assert_eq!(paths(&e), ["spec.devices.config[1]"], "{e:?}");
        // Fine: the later of two configs naming a wins, so one daemon.
        assert!(check(json!([with_requests(&["a"]), with_requests(&["a", "b"])])).is_empty());
        // Fine: time-slicing next to MPS; one MPS config for all requests.
        let mut ts = opaque(params("TimeSlicing"));
        ts["requests"] = json!(["a"]);
        assert!(check(json!([ts, with_requests(&["b"])])).is_empty());
        assert!(check(json!([with_requests(&[])])).is_empty());
        // A catch-all config whose only other request is another driver's: not certain to
        // meet our devices, left to the node.
        let c = claim(
            "resource.k8s.io/v1",
            json!({"requests": [
                    {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                    {"name": "x", "exactly": {"deviceClassName": "nic.example.com"}}],
                   "config": [with_requests(&[]), with_requests(&["a"])]}),
        );
        assert!(check_object(&c, DRIVER).errors.is_empty());
    }

    #[test]
    fn only_our_driver_is_judged() {
        let foreign = json!({"opaque": {"driver": "other.example.com", "parameters": 42}});
        let c = claim(
            "resource.k8s.io/v1",
            json!({"config": [foreign, {"other": {}}]}),
        );
        assert_eq!(check_object(&c, DRIVER), Report::default());
        // The same config is ours under another driver name.
        let r = check_object(&c, "other.example.com");
        assert_eq!(
            paths(&r.errors),
            ["spec.devices.config[0].opaque.parameters"]
        );
        assert!(
            r.errors[0].message.starts_with("must be an object"),
            "{r:?}"
        );
    }

    #[test]
    fn missing_or_non_object_parameters_are_clear_errors() {
        let c = claim(
            "resource.k8s.io/v1",
            json!({"config": [{"opaque": {"driver": DRIVER}}, opaque(json!("GpuConfig"))]}),
        );
        let r = check_object(&c, DRIVER);
        assert_eq!(r.errors.len(), 2, "{r:?}");
        assert_eq!(
            r.errors[0].to_string(),
            "spec.devices.config[0].opaque.parameters: required: configs for driver \
             gpu.nvidia.com carry a GpuConfig or MigDeviceConfig object here"
        );
        assert_eq!(
            r.errors[1].to_string(),
            "spec.devices.config[1].opaque.parameters: must be an object with apiVersion, \
             kind and sharing, got string \"GpuConfig\""
        );
        let c = claim("resource.k8s.io/v1", json!({"config": {"a": 1}}));
        assert_eq!(
            check_object(&c, DRIVER).errors[0].to_string(),
            "spec.devices.config: must be a list, got an object"
        );
    }

    #[test]
    fn request_references_are_checked_in_all_shapes() {
        let mut cfg = opaque(params("TimeSlicing"));
        cfg["requests"] = json!(["a", "b", "b/x", "b/y", "nope", "b/nope", 7]);
        let devices = json!({
            "requests": [
                // v1 shape
                {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                {"name": "b", "firstAvailable": [
                    {"name": "x", "deviceClassName": "gpu.nvidia.com"},
                    {"name": "y", "deviceClassName": "gpu.nvidia.com"}]}
            ],
            "config": [cfg]
        });
        let r = check_object(&claim("resource.k8s.io/v1", devices), DRIVER);
        assert_eq!(
            paths(&r.unknown_requests),
            [
                "spec.devices.config[0].requests[4]",
                "spec.devices.config[0].requests[5]"
            ]
        );
        assert_eq!(
            r.unknown_requests[0].message,
            "request \"nope\" does not exist; requests here: a, b, b/x, b/y"
        );
        assert_eq!(
            r.errors[0].to_string(),
            "spec.devices.config[0].requests[6]: must be a request name, got number 7"
        );
        assert!(!r.is_ok());
        // v1beta1 shape: deviceClassName on the request itself.
        let mut cfg = opaque(params("TimeSlicing"));
        cfg["requests"] = json!(["gpu"]);
        let devices = json!({"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}],
                             "config": [cfg]});
        let r = check_object(&claim("resource.k8s.io/v1beta1", devices), DRIVER);
        assert!(r.is_ok() && r.warnings.is_empty(), "{r:?}");
    }

    #[test]
    fn class_mismatch_is_a_warning() {
        let mut cfg = opaque(params("TimeSlicing"));
        cfg["requests"] = json!(["m"]);
        let devices = json!({
            "requests": [{"name": "m", "firstAvailable": [
                {"name": "small", "deviceClassName": "mig.nvidia.com"}]}],
            "config": [cfg]
        });
        let r = check_object(&claim("resource.k8s.io/v1", devices), DRIVER);
        assert!(r.is_ok());
        assert_eq!(r.warnings.len(), 1);
        assert!(
            r.warnings[0].starts_with(
                "spec.devices.config[0]: GpuConfig applies to request \"m\", whose DeviceClass \
                 \"mig.nvidia.com\" gives MIG devices"
            ),
            "{r:?}"
        );
    }

    #[test]
    fn sharing_for_an_admin_access_request_is_an_error_in_both_shapes() {
        let message = |request: &str| {
            admin_access_sharing(request)
                .with_prefix("spec.devices.config[0].opaque.parameters")
                .to_string()
        };
        // v1: adminAccess under `exactly`; a config for all requests reaches it too.
        let requests = json!([
            {"name": "watch", "exactly": {"deviceClassName": "gpu.nvidia.com", "adminAccess": true}},
            {"name": "work", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
        ]);
        for refs in [json!(["watch"]), json!(null), json!(["work", "watch"])] {
            let mut cfg = opaque(params("TimeSlicing"));
            cfg["requests"] = refs.clone();
            let c = claim(
                "resource.k8s.io/v1",
                json!({"requests": requests, "config": [cfg]}),
            );
            let r = check_object(&c, DRIVER);
            let got: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
            assert_eq!(got, [message("watch")], "{refs}");
            assert_eq!(
                r.errors[0].path,
                "spec.devices.config[0].opaque.parameters.sharing"
            );
            assert!(got[0].contains("\"watch\" uses adminAccess"), "{got:?}");
        }
        // Sharing only for the other request, or no sharing at all: fine.
        for cfg in [
            {
                let mut c = opaque(params("MPS"));
                c["requests"] = json!(["work"]);
                c
            },
            opaque(json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"})),
        ] {
            let c = claim(
                "resource.k8s.io/v1",
                json!({"requests": requests, "config": [cfg]}),
            );
            assert_eq!(check_object(&c, DRIVER), Report::default());
        }
        // v1beta1: adminAccess on the request; a template too.
        let t = json!({"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t"}, "spec": {"spec": {"devices": {
                "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "adminAccess": true}],
                "config": [opaque(params("MPS"))]}}}});
        let r = check_object(&t, DRIVER);
        assert_eq!(
            paths(&r.errors),
            ["spec.spec.devices.config[0].opaque.parameters.sharing"]
        );
    }

    #[test]
    fn kinds_and_groups_recognized() {
        assert_eq!(
            object_kind(&json!({"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceClass"})),
            Some(ObjectKind::DeviceClass)
        );
        assert_eq!(
            object_kind(&json!({"kind": "ResourceClaimTemplate"})),
            Some(ObjectKind::ResourceClaimTemplate)
        );
        assert_eq!(
            object_kind(&json!({"apiVersion": "example.com/v1", "kind": "ResourceClaim"})),
            None
        );
        assert_eq!(
            object_kind(&json!({"apiVersion": "v1", "kind": "Pod"})),
            None
        );
        assert_eq!(object_kind(&json!([1])), None);
        assert_eq!(ObjectKind::ResourceClaim.as_str(), "ResourceClaim");
    }

    #[test]
    fn labels() {
        assert_eq!(
            object_label(&json!({"kind": "ResourceClaim", "metadata": {"name": "x"}})),
            "ResourceClaim default/x"
        );
        assert_eq!(
            object_label(&json!({"kind": "ResourceClaimTemplate",
                "metadata": {"name": "t", "namespace": "ml"}})),
            "ResourceClaimTemplate ml/t"
        );
        assert_eq!(
            object_label(&json!({"kind": "DeviceClass", "metadata": {"name": "gpu.nvidia.com"}})),
            "DeviceClass gpu.nvidia.com"
        );
        assert_eq!(
            object_label(&json!({"kind": "ResourceClaim", "metadata": {"generateName": "p-"}})),
            "ResourceClaim default/p-*"
        );
        assert_eq!(object_label(&json!(null)), "object default/<unnamed>");
    }
}
