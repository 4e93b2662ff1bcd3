//! The `data` object the node plugin writes into a ResourceClaim's `status.devices[]` entry
//! for each device it prepared (Kubernetes' `AllocatedDeviceStatus`, feature
//! `DRAResourceClaimDeviceStatus`), and that `gpu-dra usage` and `gpu-dra explain` read back.
//!
//! Why it exists: a ResourceSlice names a device (`gpu-0-mig-1g5gb-19-0`) but a dynamic MIG
//! device has no UUID until it is prepared, and a memory share's device is the whole GPU; the
//! claim's status is where users and tools (monitoring that maps GPU metrics to pods) learn
//! which physical device a claim got.
//!
//! Compatibility: readers ignore fields they do not know and every field but `uuid` is
//! optional, so a newer plugin may add fields and an older CLI still reads the rest. Field
//! names follow the attribute names of our ResourceSlices (`uuid`, `productName`, `profile`,
//! `parentUUID`), so one vocabulary serves selectors and status.

use serde::{Deserialize, Serialize};

/// The API server's limit on one entry's `data` (`AllocatedDeviceStatusDataMaxLength`, 10 KiB).
pub const DEVICE_STATUS_DATA_MAX_BYTES: usize = 10 * 1024;

/// The condition type a prepared device carries with status `True`.
pub const READY_CONDITION: &str = "Ready";

/// What a prepared device is, for the people and tools reading the claim.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatusData {
    /// UUID of the device: `GPU-...` for a whole GPU (also a memory share of one), `MIG-...`
    /// for a MIG device (static or created for the claim).
    pub uuid: String,
    /// `gpu` or `mig`, as the device's `type` attribute.
    #[serde(default, rename = "type", skip_serializing_if = "String::is_empty")]
    pub kind: String,
    /// Product name of the GPU (of the parent GPU for a MIG device).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub product_name: String,
    /// MIG profile (`1g.5gb`); MIG devices only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// UUID of the parent GPU; MIG devices only.
    #[serde(
        default,
        rename = "parentUUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub parent_uuid: Option<String>,
    /// Bytes of GPU memory the allocation consumed (`consumedCapacity.memory`), when the
    /// device was allocated as a memory share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_share_bytes: Option<u64>,
    /// Sharing strategy applied to the device for this claim (`TimeSlicing`, `MPS`); absent
    /// when the claim configured none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_strategy: Option<String>,
}

impl DeviceStatusData {
    /// Reads a `data` object written by the node plugin. `None` for anything else (another
    /// driver's data, or an object without a `uuid`): readers show what they have without it.
    pub fn from_value(data: &serde_json::Value) -> Option<Self> {
        let parsed: Self = serde_json::from_value(data.clone()).ok()?;
        (!parsed.uuid.is_empty()).then_some(parsed)
    }

    /// What a person reads for the device, e.g. `MIG-5d2c... (1g.5gb of GPU-9f1e...)`.
    pub fn summary(&self) -> String {
        let mut text = self.uuid.clone();
        let mut detail = Vec::new();
        if let Some(profile) = &self.profile {
            detail.push(match &self.parent_uuid {
                Some(parent) => format!("{profile} of {parent}"),
                None => profile.clone(),
            });
        }
        if let Some(bytes) = self.memory_share_bytes {
            detail.push(format!("{} memory share", bytes_text(bytes)));
        }
        if let Some(strategy) = &self.sharing_strategy {
            detail.push(strategy.clone());
        }
        if !detail.is_empty() {
            text.push_str(&format!(" ({})", detail.join(", ")));
        }
        text
    }
}

/// Bytes in the largest binary unit that divides them (`2Gi`, `1536Mi`, `100`).
fn bytes_text(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)];
    for (unit, shift) in UNITS {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_mig_device_round_trips_with_the_slice_attribute_names() {
        let data = DeviceStatusData {
            uuid: "MIG-1".into(),
            kind: "mig".into(),
            product_name: "NVIDIA A100-SXM4-40GB".into(),
            profile: Some("1g.5gb".into()),
            parent_uuid: Some("GPU-0".into()),
            memory_share_bytes: None,
            sharing_strategy: Some("TimeSlicing".into()),
        };
        let value = serde_json::to_value(&data).expect("serializes");
        assert_eq!(
            value,
            json!({"uuid": "MIG-1", "type": "mig", "productName": "NVIDIA A100-SXM4-40GB",
                   "profile": "1g.5gb", "parentUUID": "GPU-0", "sharingStrategy": "TimeSlicing"})
        );
        assert_eq!(DeviceStatusData::from_value(&value), Some(data.clone()));
        assert_eq!(data.summary(), "MIG-1 (1g.5gb of GPU-0, TimeSlicing)");
    }

    #[test]
    fn readers_ignore_unknown_fields_and_refuse_data_without_a_uuid() {
        let newer = json!({"uuid": "GPU-0", "memoryShareBytes": 2147483648_u64, "futureField": 1});
        let data = DeviceStatusData::from_value(&newer).expect("reads");
        assert_eq!(data.memory_share_bytes, Some(2 << 30));
        assert_eq!(data.summary(), "GPU-0 (2Gi memory share)");
        assert_eq!(
            DeviceStatusData::from_value(&json!({"ip": "10.0.0.1"})),
            None
        );
        assert_eq!(DeviceStatusData::from_value(&json!({"uuid": ""})), None);
        assert_eq!(DeviceStatusData::from_value(&json!("GPU-0")), None);
    }

    #[test]
    fn byte_amounts_read_in_the_largest_exact_unit() {
        assert_eq!(bytes_text(1536 << 20), "1536Mi");
        assert_eq!(bytes_text(3 << 40), "3Ti");
        assert_eq!(bytes_text(1000), "1000");
        assert_eq!(bytes_text(0), "0");
    }
}
