//! Fault injection on the state: XID errors, uncorrectable ECC errors, a GPU falling off
//! the bus, and the GPU reset that repairs them (`gpu-sim xid|ecc|fall-off-bus|reset`,
//! `nvidia-smi -r`, tests; all through `StateFile::update`).
//!
//! The records and the event log they write are the types of [`crate::health`]; this module
//! is the only code that changes them. Invariants (see [`crate::health`]): a failed
//! injection records nothing; falling off the bus records the XID 79 event and marks the GPU
//! lost in the same update; the log keeps its last [`EVENT_LOG_CAPACITY`] events.

use super::State;
use crate::health::{
    EVENT_LOG_CAPACITY, Fault, GpuHealth, HealthError, HealthEvent, NO_INSTANCE, RecoveryAction,
    XID_FALLEN_OFF_BUS, event_type,
};

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
}
