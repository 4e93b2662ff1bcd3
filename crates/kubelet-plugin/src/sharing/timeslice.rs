//! Time-slicing: the interval of whole GPUs, set for claims and reset when the last claim
//! using a GPU is gone.
//!
//! The persisted state counts the claims per GPU; a GPU whose count dropped to zero but whose
//! reset failed stays recorded with no claims ("reset owed"), and recovery finishes it. All
//! changes run under one lock, so "last claim out resets the GPU" never races a new claim
//! setting it. A GPU that MPS holds cannot be time-sliced, and the reverse.

use gpu_dra_api::Interval;
use gpu_dra_core::sharing::SharedDevice;
use tracing::{debug, info, warn};

use super::error::SharingError;
use super::manager::{Inner, SharingManager, lock};
use super::smi::{self, ComputeMode};

impl SharingManager {
    /// Undoes what NVIDIA's driver applied for an imported claim: resets time-slicing on its
    /// GPUs unless a claim of ours uses them now. NVIDIA's MPS daemons are Deployments this
    /// plugin cannot delete: they are reported with what to do. Idempotent.
    pub async fn release_imported(
        &self,
        claim_uid: &str,
        imported: &gpu_dra_core::checkpoint::Imported,
    ) -> Result<(), SharingError> {
        for id in &imported.mps_control_daemons {
            warn!(
                claim.uid = %claim_uid,
                daemon = %id,
                gpus = %imported.mps_gpus.join(","),
                "claim imported from NVIDIA's driver used an MPS control daemon this plugin cannot stop: delete Deployment mps-control-daemon-{id} in NVIDIA driver's namespace, then reset the GPUs with `nvidia-smi -i <uuid> -c DEFAULT`"
            );
        }
        let inner = &self.inner;
        let _guard = inner.timeslice_lock.lock().await;
        let mut first_error = None;
        for gpu in &imported.time_sliced_gpus {
            let ours = {
                let s = lock(&inner.state);
                s.time_slicing
                    .get(gpu)
                    .is_some_and(|r| !r.claims.is_empty())
                    || s.mps.values().any(|r| r.whole_gpus.contains(gpu))
            };
            if ours {
                continue;
            }
            let r = async {
                smi::set_compute_mode(
                    &inner.opts.driver_root,
                    gpu,
                    ComputeMode::Default,
                    inner.opts.tool_timeout,
                )
                .await?;
                smi::set_timeslice(
                    &inner.opts.driver_root,
                    gpu,
                    Interval::Default,
                    inner.opts.tool_timeout,
                )
                .await
            }
            .await;
            match r {
                Ok(()) | Err(SharingError::TimeSliceNotSupported { .. }) => {
                    info!(claim.uid = %claim_uid, gpu = %gpu, "time-slicing set by NVIDIA's driver reset");
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(super) async fn prepare_timeslice(
        &self,
        claim_uid: &str,
        devices: &[SharedDevice],
        interval: Interval,
    ) -> Result<(), SharingError> {
        let inner = &self.inner;
        // Time-slicing on a MIG device is plain sharing: nothing to set.
        let gpus: Vec<String> = devices
            .iter()
            .filter(|d| !d.mig)
            .map(|d| d.uuid.clone())
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        let _guard = inner.timeslice_lock.lock().await;
        inner.update(|s| {
            for gpu in &gpus {
                if let Some((id, _)) = s.mps.iter().find(|(_, r)| r.whole_gpus.contains(gpu)) {
                    return Err(SharingError::Conflict {
                        gpu: gpu.clone(),
                        holder: format!("MPS daemon {id}"),
                        wanted: format!("time-slicing for claim {claim_uid}"),
                    });
                }
            }
            for gpu in &gpus {
                let rec = s.time_slicing.entry(gpu.clone()).or_default();
                if !rec.claims.is_empty() && rec.interval != interval {
                    warn!(gpu = %gpu, was = ?rec.interval, now = ?interval, "time-slice interval of a shared GPU changed by a new claim");
                }
                rec.interval = interval;
                rec.claims.insert(claim_uid.to_string());
            }
            Ok(())
        })??;
        let timeout = inner.opts.tool_timeout;
        let root = &inner.opts.driver_root;
        let mut result = Ok(());
        for gpu in &gpus {
            let r = async {
                smi::set_compute_mode(root, gpu, ComputeMode::Default, timeout).await?;
                smi::set_timeslice(root, gpu, interval, timeout).await
            }
            .await;
            if let Err(e) = r {
                result = Err(e);
                break;
            }
            debug!(claim.uid = %claim_uid, gpu = %gpu, ?interval, "time-slice set");
        }
        if let Err(e) = result {
            // Back out: this claim is not prepared, so it holds no GPU.
            if let Err(undo) = inner.release_timeslice_claim(claim_uid, Some(&gpus)).await {
                warn!(claim.uid = %claim_uid, error = %undo, "backing out time-slicing failed; the reset is retried later");
            }
            return Err(e);
        }
        info!(claim.uid = %claim_uid, gpus = gpus.len(), ?interval, "time-slicing applied");
        Ok(())
    }

    pub(super) async fn unprepare_timeslice(&self, claim_uid: &str) -> Result<(), SharingError> {
        let _guard = self.inner.timeslice_lock.lock().await;
        self.inner.release_timeslice_claim(claim_uid, None).await
    }
}

impl Inner {
    /// Removes `claim_uid` from the time-slice users of `only` GPUs (all when `None`) and
    /// resets every GPU left without users. Caller holds the time-slice lock.
    pub(super) async fn release_timeslice_claim(
        &self,
        claim_uid: &str,
        only: Option<&[String]>,
    ) -> Result<(), SharingError> {
        let owed = self.update(|s| {
            let mut owed = Vec::new();
            for (gpu, rec) in s.time_slicing.iter_mut() {
                if only.is_some_and(|o| !o.contains(gpu)) {
                    continue;
                }
                if rec.claims.remove(claim_uid) && rec.claims.is_empty() {
                    owed.push(gpu.clone());
                }
            }
            owed
        })?;
        let mut first_error = None;
        for gpu in owed {
            if let Err(e) = self.reset_timeslice(&gpu).await {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Resets `gpu` to the default interval and forgets it, unless a claim took it meanwhile.
    pub(super) async fn reset_timeslice(&self, gpu: &str) -> Result<(), SharingError> {
        let r = smi::set_timeslice(
            &self.opts.driver_root,
            gpu,
            Interval::Default,
            self.opts.tool_timeout,
        )
        .await;
        match r {
            // A GPU that never supported the setting has nothing to reset.
            Ok(()) | Err(SharingError::TimeSliceNotSupported { .. }) => {
                self.update(|s| {
                    if s.time_slicing.get(gpu).is_some_and(|r| r.claims.is_empty()) {
                        s.time_slicing.remove(gpu);
                    }
                })?;
                debug!(gpu = %gpu, "time-slice reset to default");
                Ok(())
            }
            Err(e) => {
                warn!(gpu = %gpu, error = %e, "time-slice reset failed; retried on the next unprepare or restart");
                Err(e)
            }
        }
    }
}
