//! Allocation-time rules: a valid configuration meets the devices the scheduler allocated.
//!
//! Some rules cannot be checked before allocation because they depend on which devices a
//! claim got: a `GpuConfig` landing on a MIG device (or the reverse), and per-device memory
//! limits naming an index or UUID the config's devices do not have, and `multiUser` MPS on a
//! GPU older than Volta (compute capability 7.0), whose daemon cannot run multi-user. Index keys count in the
//! sorted UUIDs of the config's devices, NVIDIA's rule (see [`DeviceKey`]). The node plugin calls
//! [`validate_for_devices`] before applying anything, and reports the same [`Errors`] type
//! as decoding, with paths relative to the configuration.

use std::collections::BTreeMap;

use crate::config::{Config, ConfigKind, DeviceKey, Sharing, sorted_uuids};
use crate::error::{Errors, FieldError};

/// The oldest compute capability whose MPS control daemon runs multi-user (`-M`): Volta.
pub const MULTI_USER_MIN_COMPUTE_CAPABILITY: (u32, u32) = (7, 0);

/// One device allocated to a claim that a config applies to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimDevice {
    /// `GPU-...` or `MIG-...` UUID.
    pub uuid: String,
    /// True for a MIG device, false for a full GPU.
    pub is_mig: bool,
    /// CUDA compute capability (major, minor) of the GPU, or of a MIG device's parent GPU;
    /// `None` where the caller does not know it (rules that need it are then skipped).
    pub compute_capability: Option<(u32, u32)>,
}

impl ClaimDevice {
    /// A full GPU.
    pub fn gpu(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            is_mig: false,
            compute_capability: None,
        }
    }

    /// A MIG device.
    pub fn mig(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            is_mig: true,
            compute_capability: None,
        }
    }

    /// The same device with its (parent) GPU's compute capability known.
    pub fn with_compute_capability(mut self, major: u32, minor: u32) -> Self {
        self.compute_capability = Some((major, minor));
        self
    }
}

/// `; index i names the i-th of their UUIDs sorted: 0 = GPU-..., 1 = ...` (empty for none).
fn index_legend(uuids: &[&str]) -> String {
    if uuids.is_empty() {
        return String::new();
    }
    let legend: Vec<String> = sorted_uuids(uuids)
        .iter()
        .enumerate()
        .map(|(i, u)| format!("{i} = {u}"))
        .collect();
    format!(
        "; index i names the i-th of their UUIDs sorted: {}",
        legend.join(", ")
    )
}

/// Why one claim cannot have two MPS configs that a container could get devices of both of:
/// each MPS daemon's pipe directory is mounted at the same path in the container, so the
/// second mount would hide the first. The webhook (from the claim spec) and the node (from
/// the allocation) give this same message; `first` and `second` are the request names each
/// config applies to.
pub fn two_mps_configs_message(first: &[String], second: &[String]) -> String {
    let names = |r: &[String]| {
        r.iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "two MPS configs in one claim (for request(s) {} and for request(s) {}): a container \
         that gets devices of both would see only one MPS daemon (their pipe directories mount \
         at the same path); put all of the claim's MPS devices under one config (one MPS \
         daemon), or move the requests into separate ResourceClaims",
        names(first),
        names(second)
    )
}

/// The one refusal of sharing settings for a request with `adminAccess`, at `sharing` inside
/// the config. Admin access is monitoring access to a device that other claims may be using:
/// time-slicing or MPS would change the device's compute mode under its owner. The object
/// checks ([`crate::objects`]) give it when the claim spec shows both; the node plugin gives
/// it when the sharing config reaches such a request some other way (a DeviceClass config).
pub fn admin_access_sharing(request: &str) -> FieldError {
    FieldError::new(
        "sharing",
        format!(
            "request {request:?} uses adminAccess (monitoring access to a device that other \
             claims may be using), and sharing would change the device's compute mode under \
             them; apply this config only to other requests (list them in its requests), use \
             a DeviceClass without a sharing config, or drop adminAccess"
        ),
    )
}

/// Checks `config` against the devices it is about to be applied to, reporting all problems.
///
/// `devices` are all the devices the config applies to within the claim (its device group),
/// in allocation order; index keys of `defaultPerDevicePinnedMemoryLimit` count in their
/// UUIDs sorted ([`DeviceKey`]).
pub fn validate_for_devices(config: &Config, devices: &[ClaimDevice]) -> Result<(), Errors> {
    let mut errs = Errors::new();
    for (i, d) in devices.iter().enumerate() {
        match (config.kind(), d.is_mig) {
            (ConfigKind::Gpu, true) => errs.push(
                "kind",
                format!(
                    "GpuConfig applies to full GPUs, but device {i} ({}) is a MIG device; \
                     use MigDeviceConfig for MIG devices",
                    d.uuid
                ),
            ),
            (ConfigKind::Mig, false) => errs.push(
                "kind",
                format!(
                    "MigDeviceConfig applies to MIG devices, but device {i} ({}) is a full \
                     GPU; use GpuConfig for full GPUs",
                    d.uuid
                ),
            ),
            _ => {}
        }
    }
    if let Some(Sharing::Mps(mps)) = config.sharing()
        && mps.multi_user
    {
        for (i, d) in devices.iter().enumerate() {
            if let Some((major, minor)) = d.compute_capability
                && (major, minor) < MULTI_USER_MIN_COMPUTE_CAPABILITY
            {
                errs.push(
                    "sharing.mpsConfig.multiUser",
                    format!(
                        "a multi-user MPS daemon needs compute capability {}.{} (Volta) or newer, \
                         but device {i} ({}) has {major}.{minor}; remove multiUser (pods of \
                         different users then take turns on the MPS server) or request a newer GPU",
                        MULTI_USER_MIN_COMPUTE_CAPABILITY.0,
                        MULTI_USER_MIN_COMPUTE_CAPABILITY.1,
                        d.uuid
                    ),
                );
            }
        }
    }
    if let Some(Sharing::Mps(mps)) = config.sharing() {
        let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
        // Which device each key resolves to, to catch two keys naming the same device.
        let mut named: BTreeMap<usize, &DeviceKey> = BTreeMap::new();
        for key in mps.per_device_pinned_memory_limit_mib.keys() {
            let path = format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]");
            let Some(at) = key.resolve(&uuids) else {
                let message = match key {
                    DeviceKey::Index(i) => format!(
                        "device index {i} is out of range: the config applies to {} device(s){}",
                        uuids.len(),
                        index_legend(&uuids)
                    ),
                    DeviceKey::Uuid(u) => format!(
                        "device {u} is not among the config's devices ({})",
                        if uuids.is_empty() {
                            "none".to_owned()
                        } else {
                            uuids.join(", ")
                        }
                    ),
                };
                errs.push(path, message);
                continue;
            };
            if let Some(other) = named.insert(at, key) {
                errs.push(
                    path,
                    format!(
                        "names device {}, which key {other} names too; give one limit per device",
                        uuids[at]
                    ),
                );
            }
        }
    }
    errs.into_result(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode;
    use serde_json::json;

    const GPU0: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const GPU1: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
    const MIG0: &str = "MIG-99999999-8888-7777-6666-555555555555";

    fn mps(kind: &str, per_device: serde_json::Value) -> Config {
        decode(&json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": kind,
            "sharing": {"strategy": "MPS", "mpsConfig": {
                "defaultPinnedDeviceMemoryLimit": "1Gi",
                "defaultPerDevicePinnedMemoryLimit": per_device}}
        }))
        .unwrap()
    }

    fn messages(r: Result<(), Errors>) -> Vec<String> {
        r.unwrap_err().iter().map(ToString::to_string).collect()
    }

    fn multi_user(kind: &str) -> Config {
        crate::decode(&json!({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": kind,
            "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": true}}
        }))
        .unwrap()
    }

    #[test]
    fn multi_user_needs_volta_or_newer() {
        let c = multi_user("GpuConfig");
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU0).with_compute_capability(7, 0)]).unwrap();
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU0).with_compute_capability(9, 0)]).unwrap();
        // Unknown capability (the webhook): nothing to hold against the config.
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU0)]).unwrap();
        let m = messages(validate_for_devices(
            &c,
            &[
                ClaimDevice::gpu(GPU0).with_compute_capability(8, 0),
                ClaimDevice::gpu(GPU1).with_compute_capability(6, 1),
            ],
        ));
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(
            m[0].starts_with(
                "sharing.mpsConfig.multiUser: a multi-user MPS daemon needs compute capability 7.0"
            ),
            "{m:?}"
        );
        assert!(
            m[0].contains(&format!("device 1 ({GPU1}) has 6.1")),
            "{m:?}"
        );
        assert!(m[0].contains("remove multiUser"), "{m:?}");
        // A MIG device is judged by its parent's capability, which the caller passes.
        let c = multi_user("MigDeviceConfig");
        let m = messages(validate_for_devices(
            &c,
            &[ClaimDevice::mig(MIG0).with_compute_capability(6, 0)],
        ));
        assert_eq!(m.len(), 1, "{m:?}");
        // Without multiUser an old GPU is fine.
        let c = mps("GpuConfig", json!({}));
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU0).with_compute_capability(6, 0)]).unwrap();
    }

    #[test]
    fn matching_devices_pass() {
        let c = mps("GpuConfig", json!({"0": "2Gi", GPU1: "3Gi"}));
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU0), ClaimDevice::gpu(GPU1)]).unwrap();
        let c = mps("MigDeviceConfig", json!({MIG0: "2Gi"}));
        validate_for_devices(&c, &[ClaimDevice::mig(MIG0)]).unwrap();
        // UUIDs match whatever the case.
        let c = mps("GpuConfig", json!({GPU1.to_uppercase(): "1Gi"}));
        validate_for_devices(&c, &[ClaimDevice::gpu(GPU1)]).unwrap();
    }

    #[test]
    fn gpu_config_on_mig_device_is_rejected() {
        let c = mps("GpuConfig", json!({}));
        let m = messages(validate_for_devices(
            &c,
            &[ClaimDevice::gpu(GPU0), ClaimDevice::mig(MIG0)],
        ));
        assert_eq!(
            m,
            [format!(
                "kind: GpuConfig applies to full GPUs, but device 1 ({MIG0}) is a MIG device; \
                 use MigDeviceConfig for MIG devices"
            )]
        );
    }

    #[test]
    fn mig_config_on_full_gpu_is_rejected() {
        let c = mps("MigDeviceConfig", json!({}));
        let m = messages(validate_for_devices(&c, &[ClaimDevice::gpu(GPU0)]));
        assert_eq!(m.len(), 1);
        assert!(m[0].starts_with("kind: MigDeviceConfig applies to MIG devices, but device 0"));
    }

    #[test]
    fn index_out_of_range_and_unknown_uuid_are_rejected() {
        let other = GPU0.replace('1', "7");
        let c = mps("GpuConfig", json!({"2": "1Gi", GPU1: "1Gi"}));
        let m = messages(validate_for_devices(
            &c,
            &[ClaimDevice::gpu(&other), ClaimDevice::gpu(GPU0)],
        ));
        assert_eq!(
            m,
            [
                format!(
                    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[2]: device index 2 is \
                     out of range: the config applies to 2 device(s); index i names the i-th of \
                     their UUIDs sorted: 0 = {GPU0}, 1 = {other}"
                ),
                format!(
                    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{GPU1}]: device {GPU1} \
                     is not among the config's devices ({other}, {GPU0})"
                ),
            ]
        );
        let m = messages(validate_for_devices(&c, &[]));
        assert!(m[0].ends_with("the config applies to 0 device(s)"), "{m:?}");
        assert!(m[1].ends_with("(none)"), "{m:?}");
    }

    #[test]
    fn two_keys_for_one_device_are_rejected() {
        let c = mps("GpuConfig", json!({"0": "1Gi", GPU0: "2Gi"}));
        let m = messages(validate_for_devices(&c, &[ClaimDevice::gpu(GPU0)]));
        assert_eq!(m.len(), 1);
        assert!(m[0].contains("which key 0 names too"), "{m:?}");
    }

    /// NVIDIA's rule: an index counts in the sorted UUIDs, not in allocation order. Here the
    /// allocation order (GPU1, GPU0) is the reverse of the sorted order (GPU0, GPU1).
    #[test]
    fn index_keys_count_in_sorted_uuids_not_allocation_order() {
        let devices = [ClaimDevice::gpu(GPU1), ClaimDevice::gpu(GPU0)];
        let uuids = [GPU1, GPU0];
        assert_eq!(
            DeviceKey::Index(0).resolve(&uuids),
            Some(1),
            "index 0 is GPU0"
        );
        assert_eq!(
            DeviceKey::Index(1).resolve(&uuids),
            Some(0),
            "index 1 is GPU1"
        );
        assert_eq!(DeviceKey::Index(2).resolve(&uuids), None);
        assert_eq!(
            DeviceKey::Uuid(GPU0.to_lowercase()).resolve(&uuids),
            Some(1)
        );
        // Index 1 is GPU1 here, so a UUID key for GPU1 next to it names one device twice.
        let c = mps("GpuConfig", json!({"1": "1Gi", GPU1: "2Gi"}));
        let m = messages(validate_for_devices(&c, &devices));
        assert_eq!(
            m,
            [format!(
                "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{GPU1}]: names device \
                 {GPU1}, which key 1 names too; give one limit per device"
            )]
        );
        let c = mps("GpuConfig", json!({"0": "1Gi", GPU1: "2Gi"}));
        validate_for_devices(&c, &devices).unwrap();
    }

    #[test]
    fn time_slicing_and_exclusive_only_check_the_kind() {
        let ts = decode(
            &json!({"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing"}}),
        )
        .unwrap();
        validate_for_devices(&ts, &[ClaimDevice::gpu(GPU0)]).unwrap();
        assert!(validate_for_devices(&ts, &[ClaimDevice::mig(MIG0)]).is_err());
        let excl = decode(&json!({"apiVersion": "gpu.nvidia.com/v1alpha1",
            "kind": "MigDeviceConfig"}))
        .unwrap();
        validate_for_devices(&excl, &[ClaimDevice::mig(MIG0)]).unwrap();
    }

    #[test]
    fn two_mps_configs_message_names_both_request_sets_and_the_fix() {
        let m = two_mps_configs_message(&["a".into()], &["b".into(), "c".into()]);
        assert!(
            m.starts_with(
                "two MPS configs in one claim (for request(s) \"a\" and for request(s) \"b\", \"c\")"
            ),
            "{m}"
        );
        assert!(
            m.contains("put all of the claim's MPS devices under one config"),
            "{m}"
        );
    }
}
