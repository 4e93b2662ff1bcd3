//! The health seam: what a hardware backend observes about GPU health, as plain data.
//!
//! A [`HealthSource`] (NVML in the node binary) reports raw observations: an event NVML
//! delivered (an XID error, an uncorrectable ECC error), or the result of a periodic probe of
//! one GPU (still reachable, and the recovery action the driver asks for). Deciding what an
//! observation means for scheduling (which XIDs to ignore, which devices are affected, when a
//! condition is over) is pure logic in `gpu-dra-core::health`, so it is tested without
//! hardware.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::DeviceError;

/// An event NVML delivered for a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HealthEvent {
    /// A critical XID error (`nvmlEventTypeXidCriticalError`) with its number.
    Xid(u64),
    /// An uncorrectable (double-bit) ECC error (`nvmlEventTypeDoubleBitEccError`).
    UncorrectableEcc,
}

/// A MIG instance an event is scoped to (NVML reports its GPU- and compute-instance IDs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceId {
    /// GPU instance ID.
    pub gi: u32,
    /// Compute instance ID.
    pub ci: u32,
}

/// One thing a [`HealthSource`] observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthObservation {
    /// NVML delivered an event.
    Event {
        /// The GPU it happened on (`GPU-...`).
        gpu_uuid: String,
        /// What happened.
        event: HealthEvent,
        /// The MIG instance it is limited to; `None` for the whole GPU.
        instance: Option<InstanceId>,
    },
    /// A periodic (or event-triggered) probe of one GPU.
    Probe {
        /// The GPU probed.
        gpu_uuid: String,
        /// False when NVML answers `NVML_ERROR_GPU_IS_LOST` (fallen off the bus) or cannot
        /// reach it at all.
        reachable: bool,
        /// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (0 none, 1 GPU reset, 2 node reboot,
        /// 3 drain peer-to-peer, 4 drain and reset); `None` when the driver does not report
        /// it (drivers before R550) or the GPU is unreachable.
        recovery_action: Option<u32>,
    },
}

/// The seam in front of the hardware's health reporting.
pub trait HealthSource: Send + Sync {
    /// Watches `gpus` (UUIDs) until `stop` turns true: every event NVML delivers and a probe of
    /// each GPU every `probe_interval` (and right after an event on it) go to `sink`.
    /// Returns an error only when watching cannot start (NVML cannot be loaded or no event set
    /// can be made); GPUs whose events cannot be registered are still probed.
    fn watch(
        &self,
        gpus: &[String],
        probe_interval: Duration,
        stop: &AtomicBool,
        sink: &mut dyn FnMut(HealthObservation),
    ) -> Result<(), DeviceError>;
}
