//! Undoing all sharing on the node, whatever claims still rely on it: the uninstall path
//! (`gpu-kubelet-plugin cleanup`, see [`crate::cmd::cleanup`]), run once no plugin serves the node.
//!
//! Every MPS control daemon recorded is stopped, the compute mode of its whole GPUs set back to
//! `DEFAULT` and its directories removed; every GPU with a recorded time-slice gets the default
//! interval (compute mode `DEFAULT` too: time-slicing set it). Each step goes through the same
//! code and the same state updates as an unprepare, so a failure leaves the state naming what
//! is still owed and running it again finishes the job. Directories under `<plugin-dir>/mps`
//! that no record owns are removed as strays, except NVIDIA's (named with
//! [`SharingManager::keep_foreign_dirs`]).

use tracing::info;

use super::error::SharingError;
use super::manager::{SharingManager, lock};

/// What [`SharingManager::restore_all`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// GPUs whose time-slice interval was reset to the default.
    pub timeslice_reset: Vec<String>,
    /// MPS daemons stopped (their GPUs back to compute mode `DEFAULT`, directories removed).
    pub mps_stopped: Vec<String>,
    /// Stray directories under `<plugin-dir>/mps` removed.
    pub strays_removed: Vec<String>,
}

impl SharingManager {
    /// Undoes every recorded sharing setting (see the module documentation). On error the
    /// state keeps what is still owed; calling it again finishes the job.
    pub async fn restore_all(&self) -> Result<RestoreReport, SharingError> {
        let inner = &self.inner;
        let mut report = RestoreReport::default();
        let mut first_error = None;

        let ids: Vec<String> = lock(&inner.state).mps.keys().cloned().collect();
        for id in ids {
            match inner.teardown_mps(&id).await {
                Ok(()) => report.mps_stopped.push(id),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }

        // Nothing recorded, nothing written: a rerun leaves no state file behind.
        if !lock(&inner.state).time_slicing.is_empty() {
            let _guard = inner.timeslice_lock.lock().await;
            // No claim counts any more: every recorded GPU owes its reset.
            let gpus = inner.update(|s| {
                for r in s.time_slicing.values_mut() {
                    r.claims.clear();
                }
                s.time_slicing.keys().cloned().collect::<Vec<_>>()
            })?;
            for gpu in gpus {
                let r = async {
                    super::smi::set_compute_mode(
                        &inner.opts.driver_root,
                        &gpu,
                        super::smi::ComputeMode::Default,
                        inner.opts.tool_timeout,
                    )
                    .await?;
                    inner.reset_timeslice(&gpu).await
                }
                .await;
                match r {
                    Ok(()) => report.timeslice_reset.push(gpu),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }

        let (strays, error) = inner.remove_stray_dirs().await;
        report.strays_removed = strays;
        if let Some(e) = error {
            first_error.get_or_insert(e);
        }
        info!(
            mps_stopped = report.mps_stopped.len(),
            timeslice_reset = report.timeslice_reset.len(),
            strays_removed = report.strays_removed.len(),
            "sharing undone on the node"
        );
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}
