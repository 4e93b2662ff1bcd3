//! The seam between the prepare pipeline and sharing: [`SharingExecutor`] applies and
//! releases the sharing action of one device group of a plan.
//!
//! [`SharingManager`] is the real executor (time-slicing and supervised MPS daemons), the only
//! one the plugin runs; tests use doubles such as `testing::ExclusiveOnly`, which refuses any
//! sharing and needs no driver tools. Apply returns container edits (the MPS pipe directory mount and its env) that the
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
use gpu_dra_api::Sharing;
use gpu_dra_core::cdi::ContainerEdits;
use gpu_dra_core::checkpoint::Imported;
use gpu_dra_core::plan::{Plan, SharingGroup};
use gpu_dra_core::sharing::shared_devices;
use serde_json::{Value, json};

use super::{Reshaped, SharingError, SharingManager};

/// What applying a group's sharing produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// State to keep in the checkpoint entry of the claim (`None`: nothing applied).
    pub state: Option<Value>,
    /// Container edits for every device of the group.
    pub edits: ContainerEdits,
}

/// Applies and releases the sharing action of a device group.
pub trait SharingExecutor: Send + Sync {
    /// Applies the sharing of `group`, one of `plan`'s groups.
    fn apply<'a>(
        &'a self,
        plan: &'a Plan,
        group: &'a SharingGroup,
    ) -> BoxFuture<'a, Result<Applied, SharingError>>;

    /// Undoes what `apply` did for the claim. Must succeed when called again, and with no
    /// state.
    fn release<'a>(
        &'a self,
        claim_uid: &'a str,
        state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), SharingError>>;

    /// Undoes the sharing NVIDIA's driver applied for an imported claim. Must succeed when
    /// called again.
    fn release_imported<'a>(
        &'a self,
        claim_uid: &'a str,
        imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), SharingError>>;

    /// The owners (claim UIDs, or the shared devices' owner) of MPS daemons running in pods
    /// of an older shape ([`super::reshape`]); none where daemons are not pods.
    fn outdated_daemon_owners(&self) -> Vec<String> {
        Vec::new()
    }

    /// Replaces those of `owner` whose daemons serve no client ([`SharingManager::reshape`]).
    /// The caller holds the claim's lock.
    fn reshape<'a>(&'a self, _owner: &'a str) -> BoxFuture<'a, Vec<Reshaped>> {
        Box::pin(async { Vec::new() })
    }
}

/// The wire name of a sharing strategy.
pub fn strategy_name(sharing: &Sharing) -> &'static str {
    match sharing {
        Sharing::TimeSlicing { .. } => "TimeSlicing",
        Sharing::Mps(_) => "MPS",
    }
}

impl SharingExecutor for SharingManager {
    fn apply<'a>(
        &'a self,
        plan: &'a Plan,
        group: &'a SharingGroup,
    ) -> BoxFuture<'a, Result<Applied, SharingError>> {
        Box::pin(async move {
            let Some(sharing) = &group.sharing else {
                return Ok(Applied::default());
            };
            let devices = shared_devices(plan, group);
            let edits = self
                .prepare(
                    &plan.namespace,
                    &plan.claim_uid,
                    &group.name,
                    &devices,
                    sharing,
                )
                .await?;
            Ok(Applied {
                state: Some(json!({"group": group.name, "strategy": strategy_name(sharing)})),
                edits,
            })
        })
    }

    fn release<'a>(
        &'a self,
        claim_uid: &'a str,
        _state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        Box::pin(async move { self.unprepare(claim_uid).await })
    }

    fn release_imported<'a>(
        &'a self,
        claim_uid: &'a str,
        imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        Box::pin(async move { self.release_imported(claim_uid, imported).await })
    }

    fn outdated_daemon_owners(&self) -> Vec<String> {
        SharingManager::outdated_daemon_owners(self)
    }

    fn reshape<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<Reshaped>> {
        Box::pin(SharingManager::reshape(self, owner))
    }
}
