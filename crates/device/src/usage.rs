//! What the devices of a node are used for now: the processes on each device, the memory they
//! hold and the share of the SMs they keep busy, and the device's own utilisation. Plain data
//! and the [`UsageSource`] seam; the NVML backend (`gpu-dra-nvml`) implements it, the node
//! plugin's usage sampler attributes the figures to claims.
//!
//! Invariant: a figure the driver does not expose for a device is `None`, never 0 (NVML has
//! no per-process or device utilisation on MIG devices, and no per-process memory without
//! the privilege to read it), so that consumers can tell "idle" from "unknown".

use std::time::Duration;

use crate::DeviceError;

/// One process on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    /// PID in the namespace of the caller.
    pub pid: u32,
    /// Device memory it holds, in bytes, when the driver says.
    pub used_bytes: Option<u64>,
    /// Its SM utilisation over the window, in percent, where the driver samples it.
    pub sm_percent: Option<u32>,
}

/// One device (a GPU or a MIG device) and what runs on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceUsage {
    /// The device's UUID (`GPU-...` or `MIG-...`).
    pub uuid: String,
    /// The processes on it.
    pub processes: Vec<ProcessUsage>,
    /// Its memory in bytes.
    pub memory_total: Option<u64>,
    /// Its memory in use, in bytes.
    pub memory_used: Option<u64>,
    /// Its utilisation (percent of time a kernel ran) where the driver gives it.
    pub utilization_percent: Option<u32>,
}

/// The seam in front of the hardware for usage figures.
pub trait UsageSource: Send + Sync {
    /// The devices with these UUIDs now; per-process utilisation covers the last `window`.
    /// A device that cannot be found or read is left out (its claims then report nothing);
    /// `Err` only when the driver is out of reach as a whole.
    fn sample(&self, uuids: &[String], window: Duration) -> Result<Vec<DeviceUsage>, DeviceError>;
}
