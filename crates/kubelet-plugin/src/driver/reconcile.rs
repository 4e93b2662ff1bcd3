//! The cleanup that brings the checkpoint, the CDI folder, the MIG instances and the API server
//! in line: run once at start, before the kubelet's calls are served, and then periodically.
//!
//! Invariants:
//! - it never races an operation: each claim is touched only with its lock, taken with
//!   `try_lock` (a claim the kubelet is working on is left to that call, which finishes or
//!   rolls back by itself);
//! - half-prepared claims are undone through the one unprepare path
//!   ([`Driver::unprepare_locked`]), before the MIG sweep, so the sweep sees only the
//!   instances of claims that stay;
//! - a spec file is removed only when no checkpoint entry names its claim;
//! - a completed claim is unprepared only when the API server answers that no claim of that
//!   UID exists any more; an error reading it keeps the claim.

use gpu_dra_core::checkpoint::{ClaimEntry, PrepareState};
use tracing::{info, warn};

use super::unprepare::Keep;
use super::{ClaimRef, Driver};

impl Driver {
    /// Brings checkpoint, CDI files and the API server in line: rolls back half-prepared
    /// claims, removes spec files of claims the checkpoint does not know, and unprepares
    /// claims that no longer exist (by UID) in the API server. Run at start and periodically.
    pub async fn reconcile(&self) {
        let entries: Vec<(String, ClaimEntry)> = self.journal.read(|doc| {
            doc.claims
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        });
        for (uid, entry) in &entries {
            if entry.state == PrepareState::PrepareStarted {
                let user = self.claim_locks.join(uid);
                // A prepare in flight holds the lock; it finishes or rolls back by itself.
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self
                    .journal
                    .entry(uid)
                    .is_some_and(|e| e.state == PrepareState::PrepareStarted)
                {
                    info!(claim.uid = %uid, "rolling back half-prepared claim");
                    if let Err(e) = self.unprepare_locked(uid, Keep::Nothing).await {
                        warn!(claim.uid = %uid, error = %e, "rollback failed");
                    }
                }
            }
        }
        let temps = self.cdi.remove_stale_temps()
            + self
                .settings
                .checkpoint_path
                .parent()
                .zip(self.settings.checkpoint_path.file_name())
                .map_or(0, |(dir, name)| {
                    gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy())
                });
        if temps > 0 {
            info!(files = temps, "removed temp files of interrupted writes");
        }
        self.sweep_instances().await;
        for uid in self.cdi.list() {
            if self.journal.entry(&uid).is_none() {
                let user = self.claim_locks.join(&uid);
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self.journal.entry(&uid).is_none() {
                    info!(claim.uid = %uid, "removing CDI spec of unknown claim");
                    if let Err(e) = self.cdi.remove(&uid) {
                        warn!(claim.uid = %uid, error = %e, "cannot remove stale CDI spec");
                    }
                }
            }
        }
        for (uid, entry) in entries {
            if entry.state != PrepareState::PrepareCompleted {
                continue;
            }
            if entry.name.is_empty() {
                // Imported from NVIDIA's v1 layout, which records no name to look up: kept
                // until the kubelet unprepares it.
                continue;
            }
            match self.claims.get(&entry.namespace, &entry.name).await {
                Ok(Some(c)) if c.metadata.uid.as_deref() == Some(uid.as_str()) => {}
                Ok(_) => {
                    info!(claim.uid = %uid, "claim is gone from the API server; unpreparing");
                    let r = ClaimRef {
                        namespace: entry.namespace.clone(),
                        name: entry.name.clone(),
                        uid: uid.clone(),
                    };
                    if let Err(e) = self.unprepare(&r).await {
                        warn!(claim.uid = %uid, error = %e, "cleanup unprepare failed");
                    }
                }
                Err(e) => warn!(claim.uid = %uid, error = %e, "cannot check claim; keeping it"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use gpu_dra_core::checkpoint::PrepareState;

    use crate::driver::ClaimRef;
    use crate::driver::fixtures::*;
    use crate::testing::allocated_claim;

    #[tokio::test]
    async fn restart_rolls_back_half_prepared_claims_and_drops_stale_specs_and_gone_claims() {
        let env = env();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        let b = add(&env, "b", "uid-b", &[("gpu", "gpu-2")]);
        env.driver.prepare(&a).await.expect("a");
        env.driver.prepare(&b).await.expect("b");
        // Fake a crash between CDI write and completion for b, a stale spec, and a deleted a.
        let mut cp = on_disk(&env);
        cp.claims.get_mut("uid-b").expect("b").state = PrepareState::PrepareStarted;
        std::fs::write(
            env.dir.path().join(gpu_dra_core::checkpoint::FILE_NAME),
            cp.to_json(),
        )
        .expect("write");
        std::fs::write(spec_path(&env, "uid-stale"), "{}").expect("stale");
        env.claims.remove("ns", "a");

        let restarted = driver_in(env.dir.path(), env.claims.clone());
        restarted.reconcile().await;
        assert!(!spec_path(&env, "uid-b").exists());
        assert!(!spec_path(&env, "uid-stale").exists());
        assert!(!spec_path(&env, "uid-a").exists());
        assert!(on_disk(&env).claims.is_empty());
        // b prepares again on retry.
        restarted.prepare(&b).await.expect("b again");
        assert!(spec_path(&env, "uid-b").exists());
    }

    #[tokio::test]
    async fn an_imported_half_prepared_claim_is_rolled_back_and_prepared_by_us() {
        let (env, sharing, driver) = nvidia_node();
        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "starting".into(),
            uid: NV_STARTED.into(),
        };
        env.claims.insert(allocated_claim(
            "team-a",
            "starting",
            NV_STARTED,
            DRIVER,
            NODE,
            &[("gpu", "gpu-3")],
            &[],
        ));
        driver.reconcile().await;
        assert!(!nvidia_spec(&env, NV_STARTED).exists());
        assert!(!driver.checkpoint().claims.contains_key(NV_STARTED));
        let devices = driver.prepare(&c).await.expect("prepared by us");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_STARTED}-gpu-3")]
        );
        assert!(spec_path(&env, NV_STARTED).exists());
        assert!(sharing.calls().contains(&format!("apply {NV_STARTED}")));
    }
}
