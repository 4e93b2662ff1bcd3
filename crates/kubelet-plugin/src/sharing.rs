//! The seam where sharing actions of a plan are executed (time-slicing, MPS daemons).
//!
//! The sharing implementation comes later and plugs in here; this build ships
//! [`ExclusiveOnly`], which accepts exclusive device groups (nothing to do) and refuses
//! TimeSlicing/MPS with a clear error, so such claims fail at prepare instead of silently
//! running unshared.

use gpu_dra_core::plan::{DevicePlan, SharingGroup};
use serde_json::Value;

/// Applies and releases the sharing action of a device group.
pub trait SharingExecutor: Send + Sync {
    /// Applies the group's sharing; returns state to keep in the checkpoint (e.g. an MPS
    /// daemon's pid and directories), or `None`.
    fn apply(
        &self,
        claim_uid: &str,
        group: &SharingGroup,
        devices: &[&DevicePlan],
    ) -> Result<Option<Value>, String>;

    /// Undoes what `apply` did, given the state it returned. Must succeed when called again.
    fn release(&self, claim_uid: &str, state: Option<&Value>) -> Result<(), String>;
}

/// The executor of builds without sharing.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExclusiveOnly;

impl SharingExecutor for ExclusiveOnly {
    fn apply(
        &self,
        _claim_uid: &str,
        group: &SharingGroup,
        _devices: &[&DevicePlan],
    ) -> Result<Option<Value>, String> {
        match &group.sharing {
            None => Ok(None),
            Some(s) => {
                let strategy = match s {
                    gpu_dra_core::plan::Sharing::TimeSlicing { .. } => "TimeSlicing",
                    gpu_dra_core::plan::Sharing::Mps { .. } => "MPS",
                };
                Err(format!(
                    "sharing.strategy {strategy}: sharing not enabled in this build; remove `sharing` from the config"
                ))
            }
        }
    }

    fn release(&self, _claim_uid: &str, _state: Option<&Value>) -> Result<(), String> {
        Ok(())
    }
}
