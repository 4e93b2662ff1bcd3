//! The seam between the prepare pipeline and sharing: [`SharingExecutor`] applies and
//! releases the sharing action of one device group of a plan.
//!
//! [`SharingManager`] is the real executor (time-slicing and supervised MPS daemons);
//! [`ExclusiveOnly`] refuses any sharing and serves builds and tests that have no driver
//! tools. Apply returns container edits (the MPS pipe and shm mounts, its env) that the
//! pipeline adds to the group's CDI devices, and a small state value that the pipeline keeps
//! in its checkpoint entry; the manager's own state (daemon pids, directories, limits,
//! time-slice reference counts) lives in its [`SharingStore`](super::SharingStore).
//!
//! Release must succeed when repeated, and also with no state at all (a crash between
//! applying and saving the state), which is why it works from the claim UID.
//!
//! Claims imported from NVIDIA's driver have sharing that NVIDIA applied:
//! [`SharingExecutor::release_imported`] resets the time-slicing it set. NVIDIA's MPS
//! control daemons run as Deployments in the cluster, which a node plugin cannot delete: they
//! are reported (what to delete, which GPUs to reset) and left running.

use futures::future::BoxFuture;
use gpu_dra_core::checkpoint::Imported;
use gpu_dra_core::plan::{DevicePlan, Sharing, SharingGroup as PlanGroup};
use serde_json::{Value, json};

use super::{SharedDevice, SharingEdits, SharingGroup, SharingManager, SharingRequest};

/// What applying a group's sharing produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// State to keep in the checkpoint entry of the claim (`None`: nothing applied).
    pub state: Option<Value>,
    /// Container edits for every device of the group.
    pub edits: SharingEdits,
}

/// Applies and releases the sharing action of a device group.
pub trait SharingExecutor: Send + Sync {
    /// Applies the group's sharing. `devices` are the group's members with their indexes in
    /// the plan (the claim's allocation order).
    fn apply<'a>(
        &'a self,
        claim_uid: &'a str,
        group: &'a PlanGroup,
        devices: &'a [(usize, &'a DevicePlan)],
    ) -> BoxFuture<'a, Result<Applied, String>>;

    /// Undoes what `apply` did for the claim. Must succeed when called again, and with no
    /// state.
    fn release<'a>(
        &'a self,
        claim_uid: &'a str,
        state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), String>>;

    /// Undoes the sharing NVIDIA's driver applied for an imported claim. Must succeed when
    /// called again. The default does nothing: an executor without driver tools cannot
    /// reset GPUs (and refuses sharing of its own, so nothing of ours conflicts).
    fn release_imported<'a>(
        &'a self,
        claim_uid: &'a str,
        imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), String>> {
        let _ = (claim_uid, imported);
        Box::pin(async { Ok(()) })
    }
}

/// The executor of builds without sharing: exclusive groups pass, sharing is refused.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExclusiveOnly;

impl SharingExecutor for ExclusiveOnly {
    fn apply<'a>(
        &'a self,
        _claim_uid: &'a str,
        group: &'a PlanGroup,
        _devices: &'a [(usize, &'a DevicePlan)],
    ) -> BoxFuture<'a, Result<Applied, String>> {
        let result = match &group.sharing {
            None => Ok(Applied::default()),
            Some(s) => {
                let strategy = match s {
                    Sharing::TimeSlicing { .. } => "TimeSlicing",
                    Sharing::Mps { .. } => "MPS",
                };
                Err(format!(
                    "sharing.strategy {strategy}: sharing not enabled in this build; remove `sharing` from the config"
                ))
            }
        };
        Box::pin(async move { result })
    }

    fn release<'a>(
        &'a self,
        _claim_uid: &'a str,
        _state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// The sharing group of a plan group, or `None` for exclusive devices. The group is named
/// after its config index (`c<N>`), unique within a claim.
pub fn group_from_plan(
    group: &PlanGroup,
    devices: &[(usize, &DevicePlan)],
) -> Result<Option<SharingGroup>, String> {
    let Some(sharing) = &group.sharing else {
        return Ok(None);
    };
    let sharing = match sharing {
        Sharing::TimeSlicing { interval } => SharingRequest::time_slicing(interval),
        Sharing::Mps { config } => SharingRequest::mps_from_json(config),
    }
    .map_err(|e| e.to_string())?;
    let name = match group.config_index {
        Some(i) => format!("c{i}"),
        None => "c".to_string(),
    };
    Ok(Some(SharingGroup {
        name,
        devices: devices
            .iter()
            .map(|(index, d)| SharedDevice {
                index: *index,
                uuid: d.uuid.clone(),
                mig: d.nodes.mig.is_some(),
            })
            .collect(),
        sharing,
    }))
}

impl SharingExecutor for SharingManager {
    fn apply<'a>(
        &'a self,
        claim_uid: &'a str,
        group: &'a PlanGroup,
        devices: &'a [(usize, &'a DevicePlan)],
    ) -> BoxFuture<'a, Result<Applied, String>> {
        Box::pin(async move {
            let Some(g) = group_from_plan(group, devices)? else {
                return Ok(Applied::default());
            };
            let edits = self
                .prepare(claim_uid, &g)
                .await
                .map_err(|e| e.to_string())?;
            let strategy = match g.sharing {
                SharingRequest::TimeSlicing { .. } => "TimeSlicing",
                SharingRequest::Mps(_) => "MPS",
            };
            Ok(Applied {
                state: Some(json!({"group": g.name, "strategy": strategy})),
                edits,
            })
        })
    }

    fn release<'a>(
        &'a self,
        claim_uid: &'a str,
        _state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { self.unprepare(claim_uid).await.map_err(|e| e.to_string()) })
    }

    fn release_imported<'a>(
        &'a self,
        claim_uid: &'a str,
        imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.release_imported(claim_uid, imported)
                .await
                .map_err(|e| e.to_string())
        })
    }
}
