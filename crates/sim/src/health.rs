//! GPU health as the driver reports it: XID errors, uncorrectable ECC errors, GPUs fallen off
//! the bus, and the recovery action NVML recommends for each GPU.
//!
//! The state lives in the state file like everything else ([`crate::state`]): each GPU has a
//! [`GpuHealth`] record and the node has one bounded [`EventLog`]. Faults are injected by
//! [`State::apply_fault`](crate::state::State::apply_fault) and the other fault methods of
//! the state (`gpu-sim xid|ecc|fall-off-bus|reset` and tests call them through
//! `StateFile::update`); NVML event sets ([`crate::ffi::events`]) poll the log and deliver
//! each event whose sequence number is at or past the set's cursor for that GPU.
//!
//! This module holds only the data types and their values and uses no other module of the
//! crate: the state and the fleet profiles build on it, not the other way round.
//!
//! Invariants:
//! - Sequence numbers grow by one per event and are never reused, so "events since
//!   registration" is a plain `seq >= cursor` comparison that survives the log's trimming.
//! - The log keeps the last [`EVENT_LOG_CAPACITY`] events: a consumer that falls that far
//!   behind loses the oldest ones, as the real driver's event queue overflows.
//! - Falling off the bus records the XID 79 event and marks the GPU lost in one update, so a
//!   waiter registered before the fall always sees the event.

use serde::{Deserialize, Serialize};

/// `nvmlEventType*` bits (`unsigned long long`).
pub mod event_type {
    /// `nvmlEventTypeSingleBitEccError`.
    pub const SINGLE_BIT_ECC_ERROR: u64 = 0x1;
    /// `nvmlEventTypeDoubleBitEccError`.
    pub const DOUBLE_BIT_ECC_ERROR: u64 = 0x2;
    /// `nvmlEventTypePState`.
    pub const PSTATE: u64 = 0x4;
    /// `nvmlEventTypeXidCriticalError`.
    pub const XID_CRITICAL_ERROR: u64 = 0x8;
    /// `nvmlEventTypeClock`.
    pub const CLOCK: u64 = 0x10;
    /// `nvmlEventTypePowerSourceChange`.
    pub const POWER_SOURCE_CHANGE: u64 = 0x80;
    /// `nvmlEventTypeMigConfigChange`.
    pub const MIG_CONFIG_CHANGE: u64 = 0x100;
    /// `nvmlEventTypeAll`: every bit an NVML header defines.
    pub const ALL: u64 = 0xFF9F;
}

/// What every GPU of the built-in profiles supports (`nvmlDeviceGetSupportedEventTypes`):
/// single- and double-bit ECC, P-state, XID, clock and power-source events.
pub const DEFAULT_SUPPORTED_EVENTS: u64 = event_type::SINGLE_BIT_ECC_ERROR
    | event_type::DOUBLE_BIT_ECC_ERROR
    | event_type::PSTATE
    | event_type::XID_CRITICAL_ERROR
    | event_type::CLOCK
    | event_type::POWER_SOURCE_CHANGE;

/// `gpuInstanceId`/`computeInstanceId` of an event that is not specific to a MIG instance.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// How many events the node's log keeps.
pub const EVENT_LOG_CAPACITY: usize = 256;

/// XID 79: "GPU has fallen off the bus".
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// XIDs NVIDIA's device plugin treats as application errors (the GPU itself is fine):
/// 13 graphics engine exception, 31 MMU fault, 43 GPU stopped processing, 45 preemptive
/// cleanup, 68 video processor exception, 109 context switch timeout.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// `nvmlDeviceGpuRecoveryAction_t`, the value of field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
/// Serialised, and parsed by `gpu-sim --recovery`, as the words of [`RecoveryAction::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
#[value(rename_all = "kebab-case")]
pub enum RecoveryAction {
    /// `NVML_GPU_RECOVERY_ACTION_NONE` (0).
    #[default]
    None,
    /// `NVML_GPU_RECOVERY_ACTION_GPU_RESET` (1).
    Reset,
    /// `NVML_GPU_RECOVERY_ACTION_NODE_REBOOT` (2).
    Reboot,
    /// `NVML_GPU_RECOVERY_ACTION_DRAIN_P2P` (3).
    DrainP2p,
    /// `NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET` (4).
    DrainAndReset,
}

impl RecoveryAction {
    /// Every action, in NVML value order.
    pub const ALL: [RecoveryAction; 5] = [
        RecoveryAction::None,
        RecoveryAction::Reset,
        RecoveryAction::Reboot,
        RecoveryAction::DrainP2p,
        RecoveryAction::DrainAndReset,
    ];

    /// The NVML enum value.
    pub fn value(self) -> u32 {
        match self {
            RecoveryAction::None => 0,
            RecoveryAction::Reset => 1,
            RecoveryAction::Reboot => 2,
            RecoveryAction::DrainP2p => 3,
            RecoveryAction::DrainAndReset => 4,
        }
    }

    /// The `gpu-sim --recovery` word (`drain-p2p`).
    pub fn name(self) -> &'static str {
        match self {
            RecoveryAction::None => "none",
            RecoveryAction::Reset => "reset",
            RecoveryAction::Reboot => "reboot",
            RecoveryAction::DrainP2p => "drain-p2p",
            RecoveryAction::DrainAndReset => "drain-and-reset",
        }
    }

    /// The action named by a `gpu-sim --recovery` word.
    pub fn from_name(name: &str) -> Option<RecoveryAction> {
        RecoveryAction::ALL.into_iter().find(|a| a.name() == name)
    }

    /// What the driver recommends after XID `xid`: nothing for application errors, a GPU
    /// reset otherwise.
    pub fn for_xid(xid: u64) -> RecoveryAction {
        if APPLICATION_XIDS.contains(&xid) {
            RecoveryAction::None
        } else {
            RecoveryAction::Reset
        }
    }
}

/// Health of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealth {
    /// Fallen off the bus: NVML answers `NVML_ERROR_GPU_IS_LOST` for it until a reset.
    #[serde(default)]
    pub lost: bool,
    /// The recovery action NVML reports.
    #[serde(default)]
    pub recovery_action: RecoveryAction,
    /// Volatile (since the last reset) uncorrectable ECC error count.
    #[serde(default)]
    pub volatile_uncorrectable_ecc: u64,
}

/// One event as NVML delivers it (`nvmlEventData_t` less the device handle, which the
/// reading process derives from the UUID).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthEvent {
    /// Position in the node's event sequence.
    pub seq: u64,
    /// The GPU's UUID (`GPU-…`; the parent GPU for MIG-scoped events).
    pub gpu_uuid: String,
    /// One [`event_type`] bit.
    pub event_type: u64,
    /// The XID for XID events, 0 otherwise.
    pub data: u64,
    /// GPU-instance ID, or [`NO_INSTANCE`].
    pub gpu_instance_id: u32,
    /// Compute-instance ID, or [`NO_INSTANCE`].
    pub compute_instance_id: u32,
}

/// The node's recent events.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventLog {
    /// Sequence number the next event gets.
    #[serde(default)]
    pub next_seq: u64,
    /// The last [`EVENT_LOG_CAPACITY`] events, oldest first.
    #[serde(default)]
    pub events: Vec<HealthEvent>,
}

impl EventLog {
    /// Events with `seq >= from`, oldest first.
    pub fn since(&self, from: u64) -> impl Iterator<Item = &HealthEvent> {
        // The log is sorted by seq, so the tail is found by binary search.
        let start = self.events.partition_point(|e| e.seq < from);
        self.events[start..].iter()
    }
}

/// Why a fault could not be injected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HealthError {
    /// The GPU argument names no GPU of the node.
    #[error(
        "no GPU {id:?} on this host: use an index below {count}, a GPU UUID (GPU-…), a PCI bus ID or a serial, as `nvidia-smi -L` lists them"
    )]
    UnknownGpu {
        /// What was asked for.
        id: String,
        /// How many GPUs the node has.
        count: usize,
    },
    /// The GPU has no MIG device with these instance IDs.
    #[error(
        "GPU {gpu} has no MIG device with GPU instance {gi} and compute instance {ci} (existing: {existing})"
    )]
    NoSuchInstance {
        /// GPU index.
        gpu: usize,
        /// GPU-instance ID.
        gi: u32,
        /// Compute-instance ID.
        ci: u32,
        /// The (GI, CI) pairs that exist, for the message.
        existing: String,
    },
    /// The GPU has fallen off the bus; only a reset brings it back.
    #[error("GPU {gpu} is lost (fallen off the bus); run `gpu-sim reset --gpu {gpu}` first")]
    GpuLost {
        /// GPU index.
        gpu: usize,
    },
}

/// A fault, or the repair, that `gpu-sim` applies to one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// An XID error (`gpu-sim xid`).
    Xid {
        /// The XID number.
        xid: u64,
        /// `(GI, CI)` of the MIG device it hit, if any.
        instance: Option<(u32, u32)>,
        /// The recovery action to report; default [`RecoveryAction::for_xid`].
        recovery: Option<RecoveryAction>,
    },
    /// An uncorrectable ECC error (`gpu-sim ecc`).
    Ecc {
        /// `(GI, CI)` of the MIG device it hit, if any.
        instance: Option<(u32, u32)>,
    },
    /// The GPU falls off the bus (`gpu-sim fall-off-bus`).
    FallOffBus,
    /// A GPU reset (`gpu-sim reset`, `nvidia-smi -r`).
    Reset,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_action_words_and_values() {
        let values: Vec<u32> = RecoveryAction::ALL.iter().map(|a| a.value()).collect();
        assert_eq!(values, [0, 1, 2, 3, 4]);
        for a in RecoveryAction::ALL {
            assert_eq!(RecoveryAction::from_name(a.name()), Some(a));
            assert_eq!(
                serde_json::to_string(&a).expect("json"),
                format!("\"{}\"", a.name())
            );
        }
        assert_eq!(RecoveryAction::from_name("Reset"), None);
        for xid in APPLICATION_XIDS {
            assert_eq!(RecoveryAction::for_xid(xid), RecoveryAction::None);
        }
        assert_eq!(RecoveryAction::for_xid(48), RecoveryAction::Reset);
        assert_eq!(RecoveryAction::for_xid(79), RecoveryAction::Reset);
    }
}
