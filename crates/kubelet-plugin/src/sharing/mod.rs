//! GPU sharing on the node: time-slicing and MPS, chosen per claim and device group.
//!
//! - Time-slicing on whole GPUs sets compute mode `DEFAULT` and the time-slice interval with
//!   `nvidia-smi`; the GPU is reset to the default interval when the last claim using it is
//!   unprepared (reference counted in the persisted state, so it survives restarts). On MIG
//!   devices time-slicing is plain sharing and nothing is set.
//! - MPS runs one `nvidia-cuda-mps-control -f` per claim and device group, supervised by this
//!   process (restarted with backoff when it crashes, re-adopted after a plugin restart), with
//!   private pipe, log and shm directories under `<plugin-dir>/mps/<claimUID>-<group>`.
//!
//! The module's input is plain data ([`SharingGroup`]) built by the prepare plan; its output is
//! container edits ([`SharingEdits`]) merged into the claim's CDI spec. The tools are found
//! under the driver root by [`DriverRoot`], the same way on real and simulated hosts.
//!
//! Invariant: nothing sharing changes on the node exists without a record in
//! [`SharingState`] saved first; see [`manager`] for the ordering.

pub mod error;
pub mod executor;
pub mod manager;
pub mod mps;
pub mod smi;
pub mod state;
pub mod tools;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use error::SharingError;
pub use executor::{Applied, ExclusiveOnly, SharingExecutor};
pub use manager::{RecoveryReport, SharingManager, SharingMetrics, SharingOptions, daemon_id};
pub use smi::TimeSliceInterval;
pub use state::{FileStore, MemoryStore, SharingState, SharingStore};
pub use tools::DriverRoot;

/// One device of a sharing group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDevice {
    /// Position of the device among the claim's allocated devices (what an index key of
    /// `defaultPerDevicePinnedMemoryLimit` refers to).
    pub index: usize,
    /// GPU (`GPU-…`) or MIG (`MIG-…`) UUID.
    pub uuid: String,
    /// Whether it is a MIG device (no compute mode or time-slice settings apply).
    pub mig: bool,
}

/// Devices of one claim that share one sharing config.
#[derive(Debug, Clone, PartialEq)]
pub struct SharingGroup {
    /// Group name, unique within the claim (a path component: `[A-Za-z0-9._-]`).
    pub name: String,
    /// The devices, in claim order.
    pub devices: Vec<SharedDevice>,
    /// What sharing to apply.
    pub sharing: SharingRequest,
}

/// The sharing strategy of a group.
#[derive(Debug, Clone, PartialEq)]
pub enum SharingRequest {
    /// `strategy: TimeSlicing`.
    TimeSlicing {
        /// `timeSlicingConfig.interval`.
        interval: TimeSliceInterval,
    },
    /// `strategy: MPS`.
    Mps(MpsRequest),
}

/// `mpsConfig`, with memory limits already converted to MiB.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MpsRequest {
    /// `defaultActiveThreadPercentage` (1 to 100).
    pub active_thread_percentage: Option<u32>,
    /// `defaultPinnedDeviceMemoryLimit`, for every device of the group.
    pub default_pinned_memory_mib: Option<u64>,
    /// `defaultPerDevicePinnedMemoryLimit`, overriding the default per device. A UUID key
    /// wins over an index key naming the same device (the api crate's precedence).
    pub per_device_pinned_memory_mib: BTreeMap<DeviceKey, u64>,
}

/// A key of `defaultPerDevicePinnedMemoryLimit`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum DeviceKey {
    /// Position of the device among the claim's allocated devices ([`SharedDevice::index`]).
    Index(usize),
    /// A device UUID.
    Uuid(String),
}

impl std::fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceKey::Index(i) => write!(f, "{i}"),
            DeviceKey::Uuid(u) => f.write_str(u),
        }
    }
}

/// Container edits a group's sharing needs (merged into the claim's CDI devices).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharingEdits {
    /// `KEY=value` environment entries.
    pub env: Vec<String>,
    /// Bind mounts.
    pub mounts: Vec<SharingMount>,
}

/// A bind mount into the claim's containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingMount {
    /// Path on the node.
    pub host_path: PathBuf,
    /// Path in the container.
    pub container_path: String,
    /// Mount options (CDI `options`).
    pub options: Vec<String>,
}

impl From<gpu_dra_api::Interval> for TimeSliceInterval {
    fn from(i: gpu_dra_api::Interval) -> Self {
        match i {
            gpu_dra_api::Interval::Default => TimeSliceInterval::Default,
            gpu_dra_api::Interval::Short => TimeSliceInterval::Short,
            gpu_dra_api::Interval::Medium => TimeSliceInterval::Medium,
            gpu_dra_api::Interval::Long => TimeSliceInterval::Long,
        }
    }
}

impl From<&gpu_dra_api::MpsConfig> for MpsRequest {
    fn from(c: &gpu_dra_api::MpsConfig) -> Self {
        MpsRequest {
            active_thread_percentage: c.active_thread_percentage.map(u32::from),
            default_pinned_memory_mib: c.pinned_memory_limit_mib,
            per_device_pinned_memory_mib: c
                .per_device_pinned_memory_limit_mib
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        gpu_dra_api::DeviceKey::Index(i) => DeviceKey::Index(*i as usize),
                        gpu_dra_api::DeviceKey::Uuid(u) => DeviceKey::Uuid(u.clone()),
                    };
                    (key, *v)
                })
                .collect(),
        }
    }
}

impl From<&gpu_dra_api::Sharing> for SharingRequest {
    fn from(s: &gpu_dra_api::Sharing) -> Self {
        match s {
            gpu_dra_api::Sharing::TimeSlicing { interval } => SharingRequest::TimeSlicing {
                interval: (*interval).into(),
            },
            gpu_dra_api::Sharing::Mps(c) => SharingRequest::Mps(c.into()),
        }
    }
}

impl SharingRequest {
    /// Time-slicing with an interval given by its API name (`Default`, `Short`, `Medium`,
    /// `Long`), as the prepare plan carries it.
    pub fn time_slicing(interval: &str) -> Result<Self, SharingError> {
        let interval = match interval {
            "Default" => TimeSliceInterval::Default,
            "Short" => TimeSliceInterval::Short,
            "Medium" => TimeSliceInterval::Medium,
            "Long" => TimeSliceInterval::Long,
            other => {
                return Err(SharingError::InvalidRequest {
                    field: "sharing.timeSlicingConfig.interval".to_string(),
                    message: format!(
                        "{other:?} is not an interval; use Default, Short, Medium or Long"
                    ),
                });
            }
        };
        Ok(SharingRequest::TimeSlicing { interval })
    }

    /// MPS from a raw `mpsConfig` object (as the prepare plan carries it), decoded and
    /// validated by the api crate so that quantities and device keys mean what the webhook
    /// checked.
    pub fn mps_from_json(mps_config: &serde_json::Value) -> Result<Self, SharingError> {
        let doc = serde_json::json!({
            "apiVersion": gpu_dra_api::API_VERSIONS[0],
            "kind": "GpuConfig",
            "sharing": { "strategy": "MPS", "mpsConfig": mps_config },
        });
        let config = gpu_dra_api::decode(&doc).map_err(|e| SharingError::InvalidRequest {
            field: "sharing.mpsConfig".to_string(),
            message: e.to_string(),
        })?;
        match config.sharing() {
            Some(s @ gpu_dra_api::Sharing::Mps(_)) => Ok(s.into()),
            _ => Err(SharingError::InvalidRequest {
                field: "sharing.mpsConfig".to_string(),
                message: "did not decode as an MPS configuration".to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn mps_config_json_decodes_through_the_api_crate() {
        let r = SharingRequest::mps_from_json(&json!({
            "defaultActiveThreadPercentage": 40,
            "defaultPinnedDeviceMemoryLimit": "1536Mi",
            "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi", "GPU-8614e54a-4d5b-70ec-4cf8-cfd33eb7be95": "1Gi"},
        }))
        .unwrap();
        let SharingRequest::Mps(m) = r else {
            panic!("not MPS: {r:?}")
        };
        assert_eq!(m.active_thread_percentage, Some(40));
        assert_eq!(m.default_pinned_memory_mib, Some(1536));
        assert_eq!(m.per_device_pinned_memory_mib[&DeviceKey::Index(1)], 2048);
        assert_eq!(
            m.per_device_pinned_memory_mib
                [&DeviceKey::Uuid("GPU-8614e54a-4d5b-70ec-4cf8-cfd33eb7be95".into())],
            1024
        );
        let err = SharingRequest::mps_from_json(&json!({"defaultActiveThreadPercentage": 0}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("defaultActiveThreadPercentage"), "{err}");
    }

    #[test]
    fn interval_names_map_to_nvidia_smi_values() {
        for (name, v) in [
            ("Default", "0"),
            ("Short", "1"),
            ("Medium", "2"),
            ("Long", "3"),
        ] {
            let SharingRequest::TimeSlicing { interval } =
                SharingRequest::time_slicing(name).unwrap()
            else {
                panic!("not time-slicing")
            };
            assert_eq!(interval.as_arg(), v);
            let api: gpu_dra_api::Interval = match name {
                "Default" => gpu_dra_api::Interval::Default,
                "Short" => gpu_dra_api::Interval::Short,
                "Medium" => gpu_dra_api::Interval::Medium,
                _ => gpu_dra_api::Interval::Long,
            };
            assert_eq!(
                TimeSliceInterval::from(api).as_arg(),
                api.as_nvidia_smi_value().to_string()
            );
        }
        assert!(SharingRequest::time_slicing("Forever").is_err());
    }
}
