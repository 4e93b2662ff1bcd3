//! The bridge to the one validation of the `api` crate.
//!
//! The webhook does not validate anything itself: it hands each object to
//! [`gpu_dra_api::objects::check_object`] and maps the report onto [`Findings`], so the
//! webhook, the node plugin and the CLI always agree. Policy choices made here:
//! - report errors deny the object;
//! - a config naming a request the object does not have is only a warning: legal to store
//!   (the config then applies to nothing), but almost certainly a typo.

use gpu_dra_api::objects::{check_object, object_label};
use serde_json::Value;

use crate::admission::{Findings, Problem};

/// Validates every opaque config of `object` addressed to `driver`.
pub fn check(object: &Value, driver: &str) -> Findings {
    let report = check_object(object, driver);
    let mut warnings = report.warnings;
    warnings.extend(report.unknown_requests.iter().map(ToString::to_string));
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
