//! Unprepare, and the one path that undoes a claim.
//!
//! [`Driver::unprepare_locked`] is used by the kubelet's unprepare, by a prepare that undoes an
//! earlier try or its own failure, and by the cleanup ([`super::reconcile`]): one order of
//! undoing, whatever the reason.
//!
//! Invariants:
//! - effects are undone in the reverse order of prepare: sharing, CDI spec (ours and, for a
//!   claim imported from NVIDIA's driver, theirs), device metadata files, MIG instances,
//!   checkpoint entry. The entry
//!   goes last, so after a crash at any step it still names every effect that may be left,
//!   and the next unprepare, prepare or reconcile finishes the job. Our own spec is the
//!   exception: a spec (or metadata file) no entry names is stray and the cleanup removes it, so
//!   for a claim with neither NVIDIA's spec nor MIG instances the spec, the files and the
//!   entry are removed at once;
//! - every step succeeds when what it undoes is already gone, so undoing is idempotent and an
//!   unknown claim unprepares successfully;
//! - the claim's devices are released from the holder table only once its entry is gone (or
//!   no longer lists them).

use std::time::Instant;

use gpu_dra_core::checkpoint::PrepareState;
use serde_json::Value;
use tracing::{info, warn};

use super::{ClaimRef, Driver, DriverError, blocking, lock};

/// What [`Driver::unprepare_locked`] keeps of the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Keep {
    /// Nothing: the claim is undone completely and its entry removed.
    Nothing,
    /// The claim's MIG instances, which stay recorded in its (half-prepared) entry for the
    /// prepare that follows and reuses them.
    MigInstances,
}

impl Driver {
    /// Unprepares one claim; an unknown claim succeeds.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), DriverError> {
        let started = Instant::now();
        let in_flight = self.in_flight();
        let result = async {
            self.failpoints.hit("unprepare.start").await?;
            let user = self.claim_locks.join(&claim.uid);
            let _guard = user.lock().await;
            self.unprepare_locked(&claim.uid, Keep::Nothing).await
        }
        .await;
        drop(in_flight);
        self.metrics
            .observe("unprepare", started.elapsed().as_secs_f64(), result.is_ok());
        match &result {
            Ok(()) => {
                self.inventory.forget(&claim.uid);
                info!(claim.uid = %claim.uid, "unprepared");
                if let Some(status) = &self.claim_status {
                    status.unprepared(claim);
                }
            }
            Err(e) => warn!(claim.uid = %claim.uid, error = %e, "unprepare failed"),
        }
        result
    }

    /// Undoes claim `uid`'s effects (sharing, CDI spec, MIG instances, checkpoint entry) and
    /// releases its devices; the caller holds the claim's lock. The one unprepare path: the
    /// kubelet's unprepare, the rollback of a failed or stale prepare and the cleanup of
    /// half-prepared claims all come here. With [`Keep::MigInstances`] the entry stays, half
    /// prepared, with its MIG instances only.
    pub(super) async fn unprepare_locked(&self, uid: &str, keep: Keep) -> Result<(), DriverError> {
        let entry = self.journal.entry(uid);
        if let Some(e) = &entry {
            self.release_sharing(uid, e.sharing.as_ref()).await?;
            if let Some(imported) = &e.imported {
                self.sharing.release_imported(uid, imported).await?;
            }
        }
        self.failpoints.hit("unprepare.after_sharing").await?;
        if let Some(e) = entry
            .as_ref()
            .filter(|e| e.imported.is_none() && e.dynamic_mig.is_empty())
        {
            // Only a spec of ours to remove: removed while the entry's removal is written
            // (their costs overlap). A spec that outlives its entry in a crash is stray: the
            // cleanup at start removes it, and so does the kubelet's retry.
            let undo = self.spec_and_metadata_removal(uid);
            let (removed, persisted) = tokio::join!(
                blocking(undo),
                self.journal.persist(|cp| {
                    cp.claims.remove(uid);
                })
            );
            removed??;
            self.failpoints.hit("unprepare.after_cdi_remove").await?;
            persisted?;
            if e.state == PrepareState::PrepareCompleted {
                self.metrics.prepared_devices.dec_by(e.devices.len() as i64);
            }
            lock(&self.holders).release(uid);
            self.failpoints.hit("unprepare.after_checkpoint").await?;
            return Ok(());
        }
        // NVIDIA's spec of an imported claim too (also without an entry: a crash may have
        // removed the entry's sharing but not yet the file).
        blocking(self.spec_and_metadata_removal(uid)).await??;
        self.failpoints.hit("unprepare.after_cdi_remove").await?;
        if let Some(e) = entry {
            let keep_mig = keep == Keep::MigInstances && !e.dynamic_mig.is_empty();
            if !keep_mig && !e.dynamic_mig.is_empty() {
                self.destroy_instances(uid, &e.dynamic_mig).await?;
            }
            self.journal
                .persist(|cp| {
                    if keep_mig {
                        if let Some(kept) = cp.claims.get_mut(uid) {
                            kept.state = PrepareState::PrepareStarted;
                            kept.devices.clear();
                            kept.sharing = None;
                        }
                    } else {
                        cp.claims.remove(uid);
                    }
                })
                .await?;
            if !keep_mig && !e.dynamic_mig.is_empty() {
                self.share_dynamic_devices();
            }
            if e.state == PrepareState::PrepareCompleted {
                self.metrics.prepared_devices.dec_by(e.devices.len() as i64);
            }
        }
        lock(&self.holders).release(uid);
        self.failpoints.hit("unprepare.after_checkpoint").await?;
        Ok(())
    }

    /// Removes claim `uid`'s CDI spec, NVIDIA's spec of it, then its device metadata files
    /// (after the spec that mounts them; found by UID alone, so also those of a claim whose
    /// entry is gone or that the plugin no longer writes files for).
    fn spec_and_metadata_removal(
        &self,
        uid: &str,
    ) -> impl FnOnce() -> Result<(), DriverError> + Send + 'static {
        let (cdi, metadata, owned) = (self.cdi.clone(), self.metadata.clone(), uid.to_owned());
        move || {
            cdi.remove(&owned)?;
            cdi.remove_nvidia(&owned)?;
            metadata.remove(&owned)?;
            Ok(())
        }
    }

    async fn release_sharing(&self, uid: &str, state: Option<&Value>) -> Result<(), DriverError> {
        match state {
            Some(Value::Array(states)) => {
                for s in states {
                    self.sharing.release(uid, Some(s)).await?;
                }
                Ok(())
            }
            other => Ok(self.sharing.release(uid, other).await?),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::ClaimRef;
    use crate::driver::fixtures::*;

    #[tokio::test]
    async fn unpreparing_an_imported_claim_cleans_up_what_nvidia_left_and_it_stays_gone() {
        let (env, sharing, driver) = nvidia_node();
        let legacy = env
            .dir
            .path()
            .join(gpu_dra_core::checkpoint::LEGACY_FILE_NAME);
        for (ns, name, uid) in [
            ("team-a", "train", NV_TIME_SLICED),
            ("team-c", "mps-shared", NV_MPS),
        ] {
            let c = ClaimRef {
                namespace: ns.into(),
                name: name.into(),
                uid: uid.into(),
            };
            driver.unprepare(&c).await.expect("unprepares");
            assert!(!nvidia_spec(&env, uid).exists());
        }
        assert_eq!(
            sharing.calls(),
            [
                format!("release {NV_TIME_SLICED}"),
                format!(
                    "release_imported {NV_TIME_SLICED} timesliced=GPU-00000001-1111-2222-3333-444444444444 mps="
                ),
                format!("release {NV_MPS}"),
                format!("release_imported {NV_MPS} timesliced= mps={NV_MPS}-4e1a9"),
            ]
        );
        assert_eq!(std::fs::read_to_string(&legacy).expect("kept"), NVIDIA_V2);
        // gpu-1 is free for our claims now.
        let ours = add(&env, "ours", "uid-ours", &[("gpu", "gpu-1")]);
        driver.prepare(&ours).await.expect("gpu-1 free");

        // A restart reads NVIDIA's untouched file again: nothing comes back.
        let restarted =
            recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), NV_BOOT);
        let cp = restarted.checkpoint();
        assert!(!cp.claims.contains_key(NV_TIME_SLICED) && !cp.claims.contains_key(NV_MPS));
        assert!(cp.claims.contains_key("uid-ours"));
    }

    #[tokio::test]
    async fn an_unprepare_interrupted_after_the_spec_was_removed_finishes_on_retry() {
        let env = env();
        let sharing = std::sync::Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), "boot");
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        driver.prepare(&a).await.expect("prepares");
        // As after a crash at unprepare.after_cdi_remove: the spec is gone, the entry is not.
        std::fs::remove_file(spec_path(&env, "uid-a")).expect("rm");
        driver.unprepare(&a).await.expect("finishes");
        assert!(on_disk(&env).claims.is_empty());
        assert_eq!(sharing.calls(), ["apply uid-a", "release uid-a"]);
        // The device is free again.
        let b = add(&env, "b", "uid-b", &[("gpu", "gpu-1")]);
        driver.prepare(&b).await.expect("gpu-1 is free");
    }
}
