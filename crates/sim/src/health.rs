//! GPU health as the driver reports it: XID errors, uncorrectable ECC errors, GPUs fallen off
//! the bus, and the recovery action NVML recommends for each GPU.
//!
//! The state lives in the state file like everything else ([`crate::state`]): each GPU has a
//! [`GpuHealth`] record and the node has one bounded [`EventLog`]. Faults are injected with
//! the `State` methods here (`gpu-sim xid|ecc|fall-off-bus|reset` and tests call them through
//! `StateFile::update`); NVML event sets ([`crate::ffi::events`]) poll the log and deliver
//! each event whose sequence number is at or past the set's cursor for that GPU.
//!
//! Invariants:
//! - Sequence numbers grow by one per event and are never reused, so "events since
//!   registration" is a plain `seq >= cursor` comparison that survives the log's trimming.
//! - The log keeps the last [`EVENT_LOG_CAPACITY`] events: a consumer that falls that far
//!   behind loses the oldest ones, as the real driver's event queue overflows.
//! - Falling off the bus records the XID 79 event and marks the GPU lost in one update, so a
//!   waiter registered before the fall always sees the event.

use serde::{Deserialize, Serialize};

use crate::state::State;

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

fn scope(instance: Option<(u32, u32)>) -> String {
    instance
        .map(|(gi, ci)| format!(" (GPU instance {gi}, compute instance {ci})"))
        .unwrap_or_default()
}

impl State {
    /// Applies `fault` to the GPU named by `gpu` (index or UUID) and returns the one line
    /// `gpu-sim` prints about it.
    pub fn apply_fault(&mut self, gpu: &str, fault: &Fault) -> Result<String, HealthError> {
        let i = self.resolve_gpu(gpu)?;
        let name = format!("GPU {i} ({})", self.profile.gpus[i].uuid);
        Ok(match *fault {
            Fault::Xid {
                xid,
                instance,
                recovery,
            } => {
                let seq = self.inject_xid(i, xid, instance, recovery)?;
                format!(
                    "XID {xid} on {name}{}: event {seq}, recovery action {}",
                    scope(instance),
                    self.gpus[i].health.recovery_action.name()
                )
            }
            Fault::Ecc { instance } => {
                let seq = self.inject_ecc(i, instance)?;
                let h = &self.gpus[i].health;
                format!(
                    "uncorrectable ECC error on {name}{}: event {seq}, volatile uncorrectable count {}, recovery action {}",
                    scope(instance),
                    h.volatile_uncorrectable_ecc,
                    h.recovery_action.name()
                )
            }
            Fault::FallOffBus => {
                let seq = self.fall_off_bus(i)?;
                format!(
                    "{name} fell off the bus: XID {XID_FALLEN_OFF_BUS} event {seq}; NVML answers GPU_IS_LOST for it until a reset"
                )
            }
            Fault::Reset => {
                self.reset_gpu(i)?;
                format!("{name} reset: not lost, recovery action none, volatile ECC counts cleared")
            }
        })
    }

    /// Resolves a GPU argument as `nvidia-smi -i` does ([`State::gpu_by_id`]).
    pub fn resolve_gpu(&self, id: &str) -> Result<usize, HealthError> {
        self.gpu_by_id(id).ok_or_else(|| HealthError::UnknownGpu {
            id: id.to_string(),
            count: self.gpus.len(),
        })
    }

    /// Records an XID error on GPU `gpu` (optionally scoped to MIG instance `(gi, ci)`) and
    /// sets its recovery action (`recovery`, default [`RecoveryAction::for_xid`]). Returns
    /// the event's sequence number.
    pub fn inject_xid(
        &mut self,
        gpu: usize,
        xid: u64,
        instance: Option<(u32, u32)>,
        recovery: Option<RecoveryAction>,
    ) -> Result<u64, HealthError> {
        self.check_alive(gpu)?;
        self.check_instance(gpu, instance)?;
        let seq = self.push_event(gpu, event_type::XID_CRITICAL_ERROR, xid, instance);
        self.gpus[gpu].health.recovery_action =
            recovery.unwrap_or_else(|| RecoveryAction::for_xid(xid));
        Ok(seq)
    }

    /// Records an uncorrectable (double-bit) ECC error: the event, one more volatile
    /// uncorrectable error, recovery action reset. Returns the event's sequence number.
    pub fn inject_ecc(
        &mut self,
        gpu: usize,
        instance: Option<(u32, u32)>,
    ) -> Result<u64, HealthError> {
        self.check_alive(gpu)?;
        self.check_instance(gpu, instance)?;
        let seq = self.push_event(gpu, event_type::DOUBLE_BIT_ECC_ERROR, 0, instance);
        let h = &mut self.gpus[gpu].health;
        h.volatile_uncorrectable_ecc += 1;
        h.recovery_action = RecoveryAction::Reset;
        Ok(seq)
    }

    /// GPU `gpu` falls off the bus: an XID 79 event, then the GPU is lost and needs a node
    /// reboot. Returns the event's sequence number.
    pub fn fall_off_bus(&mut self, gpu: usize) -> Result<u64, HealthError> {
        self.check_alive(gpu)?;
        let seq = self.push_event(
            gpu,
            event_type::XID_CRITICAL_ERROR,
            XID_FALLEN_OFF_BUS,
            None,
        );
        let h = &mut self.gpus[gpu].health;
        h.lost = true;
        h.recovery_action = RecoveryAction::Reboot;
        Ok(seq)
    }

    /// What a GPU reset (`nvidia-smi -r`) does to health: the GPU is back, no recovery action
    /// is pending and the volatile ECC counters restart. MIG instances are kept.
    pub fn reset_gpu(&mut self, gpu: usize) -> Result<(), HealthError> {
        let count = self.gpus.len();
        let st = self.gpus.get_mut(gpu).ok_or(HealthError::UnknownGpu {
            id: gpu.to_string(),
            count,
        })?;
        st.health = GpuHealth::default();
        Ok(())
    }

    fn check_alive(&self, gpu: usize) -> Result<(), HealthError> {
        match self.gpus.get(gpu) {
            None => Err(HealthError::UnknownGpu {
                id: gpu.to_string(),
                count: self.gpus.len(),
            }),
            Some(st) if st.health.lost => Err(HealthError::GpuLost { gpu }),
            Some(_) => Ok(()),
        }
    }

    fn check_instance(&self, gpu: usize, instance: Option<(u32, u32)>) -> Result<(), HealthError> {
        let Some((gi, ci)) = instance else {
            return Ok(());
        };
        let devices = self.mig_devices(gpu);
        if devices.iter().any(|m| m.gi.id == gi && m.ci.id == ci) {
            return Ok(());
        }
        let existing: Vec<String> = devices
            .iter()
            .map(|m| format!("gi {} ci {}", m.gi.id, m.ci.id))
            .collect();
        Err(HealthError::NoSuchInstance {
            gpu,
            gi,
            ci,
            existing: if existing.is_empty() {
                "none".to_string()
            } else {
                existing.join(", ")
            },
        })
    }

    fn push_event(
        &mut self,
        gpu: usize,
        event_type: u64,
        data: u64,
        instance: Option<(u32, u32)>,
    ) -> u64 {
        let (gi, ci) = instance.unwrap_or((NO_INSTANCE, NO_INSTANCE));
        let log = &mut self.events;
        let seq = log.next_seq;
        log.next_seq += 1;
        log.events.push(HealthEvent {
            seq,
            gpu_uuid: self.profile.gpus[gpu].uuid.clone(),
            event_type,
            data,
            gpu_instance_id: gi,
            compute_instance_id: ci,
        });
        if log.events.len() > EVENT_LOG_CAPACITY {
            let excess = log.events.len() - EVENT_LOG_CAPACITY;
            log.events.drain(..excess);
        }
        seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;

    fn a100() -> State {
        State::from_profile(Profile::load("dgx-a100-40gb").expect("profile"))
    }

    #[test]
    fn xid_records_an_event_and_the_recovery_action() {
        let mut s = a100();
        let uuid = s.profile.gpus[2].uuid.clone();
        assert_eq!(s.inject_xid(2, 48, None, None), Ok(0));
        assert_eq!(s.gpus[2].health.recovery_action, RecoveryAction::Reset);
        assert_eq!(s.inject_xid(2, 13, None, None), Ok(1));
        assert_eq!(s.gpus[2].health.recovery_action, RecoveryAction::None);
        let seq = s
            .inject_xid(2, 13, None, Some(RecoveryAction::DrainP2p))
            .expect("xid");
        assert_eq!(seq, 2);
        assert_eq!(s.gpus[2].health.recovery_action, RecoveryAction::DrainP2p);
        let e = &s.events.events[0];
        assert_eq!(
            (e.gpu_uuid.as_str(), e.event_type, e.data),
            (uuid.as_str(), event_type::XID_CRITICAL_ERROR, 48)
        );
        assert_eq!(
            (e.gpu_instance_id, e.compute_instance_id),
            (NO_INSTANCE, NO_INSTANCE)
        );
        assert_eq!(s.events.next_seq, 3);
        assert!(
            s.gpus
                .iter()
                .enumerate()
                .all(|(i, g)| i == 2 || g.health == GpuHealth::default())
        );
    }

    #[test]
    fn mig_scoped_faults_need_an_existing_instance() {
        let mut s = a100();
        // GPU 0 boots with GIs 1, 6, 11, 12, each with CI 0.
        let seq = s.inject_xid(0, 31, Some((6, 0)), None).expect("xid");
        let e = s.events.since(seq).next().expect("event");
        assert_eq!((e.gpu_instance_id, e.compute_instance_id), (6, 0));
        let err = s.inject_ecc(0, Some((2, 0))).expect_err("no GI 2");
        assert!(
            matches!(err, HealthError::NoSuchInstance { gi: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("gi 1 ci 0"), "{err}");
        let err = s
            .inject_xid(5, 31, Some((1, 0)), None)
            .expect_err("MIG off");
        assert!(err.to_string().contains("existing: none"), "{err}");
        assert_eq!(s.events.next_seq, 1, "failed injections record nothing");
    }

    #[test]
    fn ecc_counts_and_asks_for_a_reset() {
        let mut s = a100();
        s.inject_ecc(4, None).expect("ecc");
        s.inject_ecc(4, None).expect("ecc");
        let h = &s.gpus[4].health;
        assert_eq!(h.volatile_uncorrectable_ecc, 2);
        assert_eq!(h.recovery_action, RecoveryAction::Reset);
        assert!(
            s.events
                .since(0)
                .all(|e| e.event_type == event_type::DOUBLE_BIT_ECC_ERROR && e.data == 0)
        );
    }

    #[test]
    fn a_fallen_gpu_refuses_faults_until_reset() {
        let mut s = a100();
        let seq = s.fall_off_bus(7).expect("fall");
        let e = s.events.since(seq).next().expect("event");
        assert_eq!((e.event_type, e.data), (event_type::XID_CRITICAL_ERROR, 79));
        assert!(s.gpus[7].health.lost);
        assert_eq!(s.gpus[7].health.recovery_action, RecoveryAction::Reboot);
        assert_eq!(
            s.inject_xid(7, 48, None, None),
            Err(HealthError::GpuLost { gpu: 7 })
        );
        assert_eq!(s.inject_ecc(7, None), Err(HealthError::GpuLost { gpu: 7 }));
        assert_eq!(s.fall_off_bus(7), Err(HealthError::GpuLost { gpu: 7 }));
        s.inject_ecc(0, None).expect("other GPUs are fine");
        let migs = s.gpus[0].gpu_instances.clone();
        s.reset_gpu(0).expect("reset");
        s.reset_gpu(7).expect("reset");
        assert_eq!(s.gpus[7].health, GpuHealth::default());
        assert_eq!(s.gpus[0].health, GpuHealth::default());
        assert_eq!(s.gpus[0].gpu_instances, migs, "MIG instances stay");
        s.inject_xid(7, 48, None, None).expect("back");
    }

    #[test]
    fn the_log_is_bounded_and_sequence_numbers_keep_growing() {
        let mut s = a100();
        for _ in 0..EVENT_LOG_CAPACITY + 10 {
            s.inject_xid(1, 13, None, None).expect("xid");
        }
        assert_eq!(s.events.events.len(), EVENT_LOG_CAPACITY);
        assert_eq!(s.events.events[0].seq, 10);
        assert_eq!(s.events.next_seq, EVENT_LOG_CAPACITY as u64 + 10);
        assert_eq!(s.events.since(0).count(), EVENT_LOG_CAPACITY);
        assert_eq!(
            s.events.since(260).map(|e| e.seq).collect::<Vec<_>>(),
            [260, 261, 262, 263, 264, 265]
        );
        assert_eq!(s.events.since(266).count(), 0);
    }

    #[test]
    fn apply_fault_names_what_it_did() {
        let mut s = a100();
        let uuid = s.profile.gpus[1].uuid.clone();
        let line = s
            .apply_fault(
                "1",
                &Fault::Xid {
                    xid: 48,
                    instance: Some((1, 0)),
                    recovery: Some(RecoveryAction::DrainAndReset),
                },
            )
            .expect("xid");
        assert_eq!(
            line,
            format!(
                "XID 48 on GPU 1 ({uuid}) (GPU instance 1, compute instance 0): event 0, recovery action drain-and-reset"
            )
        );
        assert_eq!(s.gpus[1].health.recovery_action.value(), 4);
        let line = s
            .apply_fault(&uuid, &Fault::Ecc { instance: None })
            .expect("ecc");
        assert!(line.contains("volatile uncorrectable count 1"), "{line}");
        let line = s.apply_fault(&uuid, &Fault::FallOffBus).expect("fall");
        assert!(line.contains("XID 79 event 2"), "{line}");
        let err = s
            .apply_fault("1", &Fault::Ecc { instance: None })
            .expect_err("lost");
        assert!(err.to_string().contains("GPU 1 is lost"), "{err}");
        let line = s.apply_fault("1", &Fault::Reset).expect("reset");
        assert!(line.ends_with("volatile ECC counts cleared"), "{line}");
        assert!(!s.gpus[1].health.lost);
        assert!(matches!(
            s.apply_fault("9", &Fault::Reset),
            Err(HealthError::UnknownGpu { .. })
        ));
    }

    #[test]
    fn gpu_arguments_are_indices_or_uuids() {
        let s = a100();
        let uuid = format!("GPU-{}", s.profile.gpus[3].uuid[4..].to_ascii_uppercase());
        assert_eq!(s.resolve_gpu("3"), Ok(3));
        assert_eq!(s.resolve_gpu(&uuid), Ok(3));
        assert_eq!(s.resolve_gpu("0000:4e:00.0"), Ok(3));
        let err = s.resolve_gpu("8").expect_err("8 GPUs");
        assert!(err.to_string().contains("below 8"), "{err}");
        assert!(s.resolve_gpu("GPU-nope").is_err());
    }

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
