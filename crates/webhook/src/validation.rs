//! The bridge to the one validation of the `api` crate.
//!
//! The webhook does not validate anything itself: it hands each object to
//! [`gpu_dra_api::objects::check_object`] and maps the report onto [`Findings`], so the
//! webhook, the node plugin and the CLI always agree. Policy choices made here:
//! - report errors deny the object;
//! - a config naming a request the object does not have is only a warning: legal to store
//!   (the config then applies to nothing), but almost certainly a typo;
//! - CEL selector findings of [`gpu_dra_selectors::lint_object`] are only warnings, never a
//!   refusal: a selector may legitimately read another driver's attributes, and the lint
//!   infers types without a checker. Info-level findings carry an `info: ` prefix.

use gpu_dra_api::objects::{check_object, object_label};
use gpu_dra_selectors::Severity;
use serde_json::Value;

use crate::admission::{Findings, Problem};

/// Validates every opaque config of `object` addressed to `driver`.
pub fn check(object: &Value, driver: &str) -> Findings {
    let report = check_object(object, driver);
    let mut warnings = report.warnings;
    warnings.extend(report.unknown_requests.iter().map(ToString::to_string));
    warnings.extend(
        gpu_dra_selectors::lint_object(object, driver)
            .into_iter()
            .map(|f| match f.severity {
                Severity::Warning => f.to_string(),
                Severity::Info => format!("info: {f}"),
            }),
    );
    let label = if report.errors.is_empty() {
        String::new()
    } else {
        object_label(object)
    };
    Findings {
        problems: report
            .errors
            .into_iter()
            .map(|e| Problem {
                path: e.path,
                message: e.message,
            })
            .collect(),
        warnings,
        label,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(config: Value) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                "config": [config],
            }},
        })
    }

    #[test]
    fn errors_become_problems_with_full_paths_and_a_label() {
        let f = check(
            &claim(
                json!({"opaque": {"driver": "gpu.nvidia.com", "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}},
                }}}),
            ),
            "gpu.nvidia.com",
        );
        assert_eq!(f.label, "ResourceClaim ns/c");
        assert_eq!(f.problems.len(), 1, "{f:?}");
        assert_eq!(
            f.problems[0].path,
            "spec.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage"
        );
    }

    #[test]
    fn selectors_our_devices_cannot_match_only_warn_with_a_hint() {
        let mut obj = claim(json!({"opaque": {"driver": "example.com", "parameters": {}}}));
        obj["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = json!([{"cel": {"expression": "device.attributes['gpu.nvidia.com'].index == 0"}},
                   {"cel": {"expression": "device.attributes['example.com'].model == 'x'"}}]);
        let f = check(&obj, "gpu.nvidia.com");
        assert!(f.problems.is_empty(), "{f:?}");
        assert_eq!(f.warnings.len(), 2, "{f:?}");
        assert!(
            f.warnings[0].starts_with(
                "spec.devices.requests[0].exactly.selectors[0].cel.expression: \
                 `device.attributes['gpu.nvidia.com'].index`: attribute \"index\" is not published"
            ),
            "{:?}",
            f.warnings
        );
        assert!(
            f.warnings[0].contains("set `count` on the request"),
            "{:?}",
            f.warnings
        );
        assert!(
            f.warnings[1].starts_with("info: spec.devices.requests[0].exactly.selectors[1]"),
            "{:?}",
            f.warnings
        );
    }

    #[test]
    fn other_drivers_are_ignored_and_unknown_requests_only_warn() {
        let other = check(
            &claim(json!({"opaque": {"driver": "example.com", "parameters": {"x": 1}}})),
            "gpu.nvidia.com",
        );
        assert_eq!(other, Findings::default());

        let f = check(
            &claim(
                json!({"requests": ["gpus"], "opaque": {"driver": "gpu.nvidia.com",
                "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}),
            ),
            "gpu.nvidia.com",
        );
        assert!(f.problems.is_empty(), "{f:?}");
        assert_eq!(f.warnings.len(), 1);
        assert!(
            f.warnings[0]
                .starts_with("spec.devices.config[0].requests[0]: request \"gpus\" does not exist"),
            "{:?}",
            f.warnings
        );
    }
}
