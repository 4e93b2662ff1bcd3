//! Allocation-time rules: a valid configuration meets the devices the scheduler allocated.
//!
//! Some rules cannot be checked before allocation because they depend on which devices a
//! claim got: a `GpuConfig` landing on a MIG device (or the reverse), and per-device memory
//! limits naming an index or UUID the claim does not have. The node plugin calls
//! [`validate_for_devices`] before applying anything, and reports the same [`Errors`] type
//! as decoding, with paths relative to the configuration.

use std::collections::BTreeMap;

use crate::config::{Config, ConfigKind, DeviceKey, Sharing};
use crate::error::{Errors, FieldError};

/// One device allocated to a claim (for a config's requests), in claim order: its position
/// in the slice is the index that `defaultPerDevicePinnedMemoryLimit` keys refer to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimDevice {
    /// `GPU-...` or `MIG-...` UUID.
    pub uuid: String,
    /// True for a MIG device, false for a full GPU.
    pub is_mig: bool,
}

impl ClaimDevice {
    /// A full GPU.
    pub fn gpu(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            is_mig: false,
        }
    }

    /// A MIG device.
    pub fn mig(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            is_mig: true,
        }
    }
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
    if let Some(Sharing::Mps(mps)) = config.sharing() {
        // Which device each key resolves to, to catch two keys naming the same device.
        let mut named: BTreeMap<usize, &DeviceKey> = BTreeMap::new();
        for key in mps.per_device_pinned_memory_limit_mib.keys() {
            let path = format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]");
            let index = match key {
                DeviceKey::Index(i) => {
                    let i = *i as usize;
                    if i >= devices.len() {
                        errs.push(
                            path,
                            format!(
                                "device index {i} is out of range: the claim has {} device(s){}",
                                devices.len(),
                                match devices.len() {
                                    0 => String::new(),
                                    n => format!(", valid indexes 0..={}", n - 1),
                                }
                            ),
                        );
                        continue;
                    }
                    i
                }
                DeviceKey::Uuid(u) => {
                    match devices.iter().position(|d| d.uuid.eq_ignore_ascii_case(u)) {
                        Some(i) => i,
                        None => {
                            let uuids: Vec<&str> =
                                devices.iter().map(|d| d.uuid.as_str()).collect();
                            errs.push(
                                path,
                                format!(
                                    "device {u} is not among the claim's devices ({})",
                                    if uuids.is_empty() {
                                        "none".to_owned()
                                    } else {
                                        uuids.join(", ")
                                    }
                                ),
                            );
                            continue;
                        }
                    }
                }
            };
            if let Some(other) = named.insert(index, key) {
                errs.push(
                    path,
                    format!(
                        "names device {index} ({}), which key {other} names too; give one \
                         limit per device",
                        devices[index].uuid
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
        let c = mps("GpuConfig", json!({"2": "1Gi", GPU1: "1Gi"}));
        let m = messages(validate_for_devices(
            &c,
            &[
                ClaimDevice::gpu(GPU0),
                ClaimDevice::gpu(GPU0.replace('1', "7")),
            ],
        ));
        assert_eq!(
            m,
            [
                "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[2]: device index 2 is out \
                 of range: the claim has 2 device(s), valid indexes 0..=1"
                    .to_owned(),
                format!(
                    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{GPU1}]: device {GPU1} \
                     is not among the claim's devices ({GPU0}, {})",
                    GPU0.replace('1', "7")
                ),
            ]
        );
        let m = messages(validate_for_devices(&c, &[]));
        assert!(m[0].ends_with("the claim has 0 device(s)"), "{m:?}");
        assert!(m[1].ends_with("(none)"), "{m:?}");
    }

    #[test]
    fn two_keys_for_one_device_are_rejected() {
        let c = mps("GpuConfig", json!({"0": "1Gi", GPU0: "2Gi"}));
        let m = messages(validate_for_devices(&c, &[ClaimDevice::gpu(GPU0)]));
        assert_eq!(m.len(), 1);
        assert!(m[0].contains("which key 0 names too"), "{m:?}");
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
    fn limit_lookup_prefers_uuid_then_index_then_default() {
        let c = mps("GpuConfig", json!({"0": "2Gi", GPU1: "3Gi"}));
        let Some(Sharing::Mps(m)) = c.sharing() else {
            panic!("not mps")
        };
        assert_eq!(m.pinned_memory_limit_mib_for(0, GPU0), Some(2048));
        assert_eq!(m.pinned_memory_limit_mib_for(1, GPU1), Some(3072));
        assert_eq!(m.pinned_memory_limit_mib_for(2, "GPU-x"), Some(1024));
    }
}
