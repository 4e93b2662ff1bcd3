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
pub mod manager;
pub mod mps;
pub mod smi;
pub mod state;
pub mod tools;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use error::SharingError;
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
