//! Specs that follow a driver upgraded in place.
//!
//! The problem: a claim's CDI spec names the driver's files by version
//! (`libcuda.so.<version>`), and an upgrade in place removes them. Containers running when the
//! driver is swapped keep what they mounted, but every container created afterwards from the
//! spec fails with `CreateContainerError`: a restarted container of a running pod, a new pod
//! of a shared claim, the kubelet preparing the claim again after its own restart (it is
//! answered from the checkpoint, with the same stale spec).
//!
//! The fix: each claim's entry records the driver version its spec names
//! (`ClaimEntry::driver_version`); a spec of another version is stale. Its shared edits (the
//! driver's files) are rewritten for the current driver, while its devices (nodes, sharing
//! edits) and so its CDI IDs stay: nothing else about the claim depends on the driver's
//! version. This happens
//! - in every cleanup pass ([`Driver::follow_driver_version`]), which the plugin also runs as
//!   soon as a discovery finds a new version, so containers restarted in running pods find a
//!   spec of the driver that is there;
//! - in a prepare answered from the checkpoint ([`Driver::rewrite_stale_spec`]), so the kubelet
//!   never gets CDI IDs whose spec names files that are gone.
//!
//! An entry written before the version was recorded (or by NVIDIA's driver's import, whose
//! specs are NVIDIA's and are left alone) has none: its spec's versioned library names tell
//! ([`gpu_dra_core::cdi::driver_version_named`]), once, and the entry records the result.
//!
//! Rejected: preparing such a claim again from scratch, as after a reboot. That undoes its
//! sharing (an MPS daemon stops under its running clients) and reads the claim again from the
//! API server, for an effect that is the spec's alone.

use gpu_dra_core::cdi::driver_version_named;
use gpu_dra_core::checkpoint::{ClaimEntry, PrepareState};
use tracing::{info, warn};

use super::{Driver, DriverError, blocking};

impl Driver {
    /// Rewrites the spec of every prepared claim whose spec names another driver version than
    /// the current one. Claims an operation holds are left to it (a prepare checks by itself).
    pub async fn follow_driver_version(&self) {
        let current = self.cdi.driver_version();
        let entries: Vec<(String, ClaimEntry)> = self.journal.read(|doc| {
            doc.claims
                .iter()
                .filter(|(_, e)| {
                    e.state == PrepareState::PrepareCompleted
                        && e.imported.is_none()
                        && e.driver_version.as_deref() != Some(current.as_str())
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        });
        for (uid, _) in entries {
            let user = self.claim_locks.join(&uid);
            let Some(_guard) = user.try_lock() else {
                continue;
            };
            let Some(entry) = self.journal.entry(&uid) else {
                continue;
            };
            if let Err(e) = self.rewrite_stale_spec(&uid, &entry).await {
                warn!(claim.uid = %uid, error = %e, "cannot rewrite the CDI spec for the current driver; retried by the next cleanup");
            }
        }
    }

    /// With the claim's lock held: rewrites a completed claim's spec when it names another
    /// driver version than the current one, and records the version it names now.
    pub(super) async fn rewrite_stale_spec(
        &self,
        uid: &str,
        entry: &ClaimEntry,
    ) -> Result<(), DriverError> {
        let current = self.cdi.driver_version();
        if entry.state != PrepareState::PrepareCompleted
            || entry.imported.is_some()
            || entry.driver_version.as_deref() == Some(current.as_str())
        {
            return Ok(());
        }
        let cdi = self.cdi.clone();
        let recorded = entry.driver_version.clone();
        let sync_content = self.settings.boot_id.is_none();
        let owned = uid.to_owned();
        let named = blocking(move || -> Result<Option<String>, DriverError> {
            // An entry without a version: its spec tells which driver it names.
            let then = match recorded {
                Some(v) => Some(v),
                None => cdi.read(&owned).and_then(|s| driver_version_named(&s)),
            };
            if then.as_deref().is_none_or(|v| v == current) {
                return Ok(Some(current));
            }
            let now = cdi.rewrite_for_current_driver(&owned, sync_content)?;
            if now.is_some() {
                info!(claim.uid = %owned, from = ?then, to = %current, "rewrote the CDI spec for the driver upgraded in place");
            }
            Ok(now)
        })
        .await??;
        // A missing spec is the next prepare's to restore (`stale_reason`); nothing to record.
        if let Some(version) = named {
            self.journal
                .persist(|cp| {
                    if let Some(e) = cp.claims.get_mut(uid) {
                        e.driver_version = Some(version);
                    }
                })
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use gpu_dra_device::testing::a100_inventory;

    use crate::driver::fixtures::*;
    use crate::testing::simulate_host;

    const NEW: &str = "590.44.01";

    /// The driver of `env`'s host upgraded in place to `version`: its files, and the CDI scan
    /// the plugin makes when a discovery finds the version.
    fn upgrade(env: &Env, version: &str) {
        let host = env.dir.path().join("host");
        let lib = host.join("usr/lib/x86_64-linux-gnu");
        let old = env.driver.cdi.driver_version();
        for entry in std::fs::read_dir(&lib).expect("lib") {
            let path = entry.expect("entry").path();
            if path.to_string_lossy().ends_with(&old) {
                std::fs::remove_file(path).expect("remove");
            }
        }
        let mut inventory = a100_inventory(4, 1);
        inventory.driver_version = version.to_owned();
        simulate_host(&host, &inventory).expect("host");
        env.driver.cdi.refresh(version);
    }

    fn spec(env: &Env, uid: &str) -> gpu_dra_core::cdi::Spec {
        serde_json::from_slice(&std::fs::read(spec_path(env, uid)).expect("spec")).expect("json")
    }

    fn libraries(spec: &gpu_dra_core::cdi::Spec) -> Vec<String> {
        spec.container_edits
            .mounts
            .iter()
            .map(|m| m.host_path.clone())
            .filter(|p| p.contains("libcuda.so.") || p.contains("libnvidia-ml.so."))
            .collect()
    }

    #[tokio::test]
    async fn a_prepared_claims_spec_follows_a_driver_upgraded_in_place() {
        let env = env();
        let old = env.driver.cdi.driver_version();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        let b = add(&env, "b", "uid-b", &[("gpu", "gpu-2")]);
        let devices = env.driver.prepare(&a).await.expect("prepares");
        env.driver.prepare(&b).await.expect("prepares");
        let before = spec(&env, "uid-a");
        assert!(libraries(&before).iter().all(|l| l.ends_with(&old)));
        assert_eq!(
            on_disk(&env).claims["uid-a"].driver_version.as_deref(),
            Some(old.as_str())
        );

        upgrade(&env, NEW);
        // The kubelet prepares the claim again (its own restart, a new pod of the claim): the
        // same answer, with a spec naming files that exist.
        assert_eq!(env.driver.prepare(&a).await.expect("prepares"), devices);
        let after = spec(&env, "uid-a");
        let libs = libraries(&after);
        assert_eq!(libs.len(), 2, "{libs:?}");
        for l in &libs {
            assert!(l.ends_with(NEW), "{l}");
            assert!(std::path::Path::new(l).exists(), "{l} is not on the host");
        }
        assert_eq!(after.devices, before.devices, "devices and CDI names kept");
        assert_eq!(
            on_disk(&env).claims["uid-a"].driver_version.as_deref(),
            Some(NEW)
        );

        // Without a call: the cleanup rewrites the other claim's spec.
        assert!(
            libraries(&spec(&env, "uid-b"))
                .iter()
                .all(|l| l.ends_with(&old))
        );
        env.driver.follow_driver_version().await;
        assert!(
            libraries(&spec(&env, "uid-b"))
                .iter()
                .all(|l| l.ends_with(NEW))
        );
        assert_eq!(
            on_disk(&env).claims["uid-b"].driver_version.as_deref(),
            Some(NEW)
        );
    }

    #[tokio::test]
    async fn an_entry_without_a_version_is_judged_by_the_libraries_its_spec_names() {
        let env = env();
        let old = env.driver.cdi.driver_version();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        env.driver.prepare(&a).await.expect("prepares");
        // As an older version wrote it.
        env.driver
            .journal
            .persist(|cp| {
                if let Some(e) = cp.claims.get_mut("uid-a") {
                    e.driver_version = None;
                }
            })
            .await
            .expect("persist");
        env.driver.follow_driver_version().await;
        assert_eq!(
            on_disk(&env).claims["uid-a"].driver_version.as_deref(),
            Some(old.as_str()),
            "same driver: recorded, spec kept"
        );
        env.driver
            .journal
            .persist(|cp| {
                if let Some(e) = cp.claims.get_mut("uid-a") {
                    e.driver_version = None;
                }
            })
            .await
            .expect("persist");
        upgrade(&env, NEW);
        env.driver.follow_driver_version().await;
        assert!(
            libraries(&spec(&env, "uid-a"))
                .iter()
                .all(|l| l.ends_with(NEW))
        );
        assert_eq!(
            on_disk(&env).claims["uid-a"].driver_version.as_deref(),
            Some(NEW)
        );
    }
}
