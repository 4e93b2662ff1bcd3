//! The Kubernetes feature gates the driver's features need, and from which release each is on
//! by default: the one table `gpu-dra check` judges a cluster by and the node plugin names in
//! its messages when the API server drops a feature's fields.
//!
//! Source: the versioned defaults in `pkg/features/kube_features.go` of Kubernetes 1.37.1
//! (each gate lists the release of each stage), confirmed against the feature gate reference
//! (<https://kubernetes.io/docs/reference/command-line-tools-reference/feature-gates/>); the
//! table per release, with links, is in `docs/kubernetes-versions.md`. The chart keeps the same
//! table for its install-time refusal (`gpu-dra.clusterGates` in `_helpers.tpl`); a repository
//! test keeps the two equal.

/// A Kubernetes feature gate one of the driver's features needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// The gate's name, as `--feature-gates` takes it.
    pub name: &'static str,
    /// What the driver uses it for.
    pub feature: &'static str,
    /// Minor release (of 1.x) from which the gate is on by default; `None`: off by default in
    /// every release up to 1.37.
    pub default_on_from: Option<u32>,
    /// Minor release in which the gate first exists (alpha, off).
    pub alpha_from: u32,
}

/// Whole-GPU, static MIG, time-slicing and MPS claims need none of these: only
/// `resource.k8s.io/v1` (1.34+).
pub const GATES: &[Gate] = &[
    Gate {
        name: "DRAConsumableCapacity",
        feature: "memory shares and consumable shares (allowMultipleAllocations, capacity requests)",
        default_on_from: Some(36),
        alpha_from: 34,
    },
    Gate {
        name: "DRAPartitionableDevices",
        feature: "dynamic MIG (shared counters, devices consuming them)",
        default_on_from: Some(36),
        alpha_from: 33,
    },
    Gate {
        name: "DRADeviceTaints",
        feature: "device health as device taints (unhealthy GPUs avoided by the scheduler)",
        default_on_from: Some(36),
        alpha_from: 33,
    },
    Gate {
        name: "ResourceHealthStatus",
        feature: "device health in pod status (kubelet health stream)",
        default_on_from: Some(36),
        alpha_from: 31,
    },
    Gate {
        name: "DRADeviceBindingConditions",
        feature: "binding conditions (not used by this driver; listed for completeness)",
        default_on_from: Some(36),
        alpha_from: 34,
    },
    Gate {
        name: "DRAListTypeAttributes",
        feature: "list-type attributes (kubeletPlugin.listTypeAttributes)",
        default_on_from: None,
        alpha_from: 36,
    },
];

/// The gate of that name.
pub fn gate(name: &str) -> Option<&'static Gate> {
    GATES.iter().find(|g| g.name == name)
}

/// Whether `gate` is on by default in Kubernetes 1.`minor`.
pub fn on_by_default(gate: &Gate, minor: u32) -> bool {
    gate.default_on_from.is_some_and(|from| minor >= from)
}

/// "on by default from Kubernetes 1.36", or "off by default in every release up to 1.37".
pub fn default_text(gate: &Gate) -> String {
    match gate.default_on_from {
        Some(m) => format!("on by default from Kubernetes 1.{m}"),
        None => "off by default in every release up to 1.37 (alpha)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_per_release() {
        let cc = gate("DRAConsumableCapacity").unwrap();
        assert!(!on_by_default(cc, 34));
        assert!(!on_by_default(cc, 35));
        assert!(on_by_default(cc, 36));
        assert!(on_by_default(cc, 37));
        let lt = gate("DRAListTypeAttributes").unwrap();
        assert!(!on_by_default(lt, 37));
        assert_eq!(
            default_text(gate("DRAPartitionableDevices").unwrap()),
            "on by default from Kubernetes 1.36"
        );
        assert!(gate("NoSuchGate").is_none());
    }
}
