//! The holder table: which prepared claims hold which device, and which claims may hold one
//! together.
//!
//! Invariants:
//! - a device is held by at most one regular claim; claims with admin access (monitoring
//!   access, as the scheduler grants it) may hold it beside any other claim, and never with
//!   sharing settings, which would change the compute mode under the owner (refused when the
//!   claim is planned, see [`super::prepare`]);
//! - a device that allows multiple allocations (the whole-GPU device of a memory-share GPU,
//!   [`gpu_dra_core::memory_shares`], or a GPU or MIG device under consumable shares,
//!   [`gpu_dra_core::consumable_shares`]: [`Partitioning::shareable_devices`]) may be held by
//!   several claims whose allocations are shares (carry a share ID); the scheduler keeps the
//!   sum of what they consume within the device's capacity. One allocated whole still
//!   excludes every other;
//!
//! [`Partitioning::shareable_devices`]: gpu_dra_core::partitioning::Partitioning::shareable_devices
//! - every device a checkpoint entry lists is in the table under that claim: the table is
//!   rebuilt from every entry at start, a claim is reserved before an entry listing its
//!   devices is written, and released once its entry is gone or lists no devices (or its
//!   first write failed). So a device the checkpoint names is never handed to a second claim.

use std::collections::{BTreeSet, HashMap};

use gpu_dra_core::checkpoint::Checkpoint;
use gpu_dra_core::plan::Plan;

use super::{ClaimRef, DriverError};

/// Device name -> the claims that hold it.
#[derive(Default)]
pub(super) struct Holders(HashMap<String, Vec<Holder>>);

struct Holder {
    uid: String,
    claim: String,
    admin: bool,
    /// Allocated as one share of the device (it has a share ID).
    share: bool,
}

impl Holders {
    /// The holders of every device of every claim in `doc` (half-prepared claims included:
    /// their devices may be in use).
    pub(super) fn from_checkpoint(doc: &Checkpoint) -> Self {
        let mut holders: HashMap<String, Vec<Holder>> = HashMap::new();
        for (uid, entry) in &doc.claims {
            for d in &entry.devices {
                holders.entry(d.device.clone()).or_default().push(Holder {
                    uid: uid.clone(),
                    claim: format!("{}/{}", entry.namespace, entry.name),
                    admin: d.admin_access,
                    share: d.share_id.is_some(),
                });
            }
        }
        Holders(holders)
    }

    /// Records `claim` as a holder of its devices, refusing a device another claim holds,
    /// unless one of the two has admin access or both are shares of a device in
    /// `shareable_devices` (the devices that allow multiple allocations). Nothing is recorded
    /// when a device is refused.
    pub(super) fn reserve(
        &mut self,
        claim: &ClaimRef,
        plan: &Plan,
        shareable_devices: &BTreeSet<String>,
    ) -> Result<(), DriverError> {
        for d in &plan.devices {
            let shareable = d.share_id.is_some() && shareable_devices.contains(&d.device);
            let compatible = |h: &&Holder| {
                h.uid == claim.uid || h.admin || d.admin_access || (shareable && h.share)
            };
            if let Some(h) = self
                .0
                .get(&d.device)
                .into_iter()
                .flatten()
                .find(|h| !compatible(h))
            {
                return Err(DriverError::DeviceBusy {
                    device: d.device.clone(),
                    holder: h.claim.clone(),
                    holder_uid: h.uid.clone(),
                });
            }
        }
        for d in &plan.devices {
            let list = self.0.entry(d.device.clone()).or_default();
            if !list.iter().any(|h| h.uid == claim.uid) {
                list.push(Holder {
                    uid: claim.uid.clone(),
                    claim: format!("{}/{}", claim.namespace, claim.name),
                    admin: d.admin_access,
                    share: d.share_id.is_some(),
                });
            }
        }
        Ok(())
    }

    /// Forgets claim `uid` as a holder of any device.
    pub(super) fn release(&mut self, uid: &str) {
        self.0.retain(|_, list| {
            list.retain(|h| h.uid != uid);
            !list.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use gpu_dra_core::consumable_shares::ConsumableShares;
    use gpu_dra_core::memory_shares;
    use gpu_dra_core::partitioning::Partitioning;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use crate::driver::fixtures::*;
    use crate::driver::{ClaimRef, DriverError};

    #[tokio::test]
    async fn a_held_device_is_refused_naming_the_holder_unless_both_use_admin_access() {
        let env = env();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        let b = add(&env, "b", "uid-b", &[("gpu", "gpu-1")]);
        env.driver.prepare(&a).await.expect("a prepares");
        let err = env
            .driver
            .prepare(&b)
            .await
            .expect_err("b conflicts")
            .to_string();
        assert!(
            err.contains("gpu-1") && err.contains("ns/a") && err.contains("uid-a"),
            "{err}"
        );
        assert!(!spec_path(&env, "uid-b").exists());
        env.driver.unprepare(&a).await.expect("a unprepares");
        env.driver
            .prepare(&b)
            .await
            .expect("b prepares once a is gone");

        for (name, uid) in [("c", "uid-c"), ("d", "uid-d")] {
            let r = add_admin(&env, name, uid, "gpu-2", &[]);
            env.driver.prepare(&r).await.expect("admin access overlaps");
        }
    }

    #[tokio::test]
    async fn admin_access_overlaps_a_regular_claim_in_either_order_and_regular_claims_still_conflict()
     {
        let env = env();
        // Regular first, then an admin claim on the same GPU.
        let owner = add(&env, "owner", "uid-owner", &[("gpu", "gpu-2")]);
        env.driver.prepare(&owner).await.expect("owner");
        let watcher = add_admin(&env, "watcher", "uid-watcher", "gpu-2", &[]);
        env.driver
            .prepare(&watcher)
            .await
            .expect("admin beside owner");
        // Admin first, then a regular claim: it gets the GPU; a second regular one does not.
        let early = add_admin(&env, "early", "uid-early", "gpu-3", &[]);
        env.driver.prepare(&early).await.expect("admin alone");
        let user = add(&env, "user", "uid-user", &[("gpu", "gpu-3")]);
        env.driver
            .prepare(&user)
            .await
            .expect("regular beside admin");
        let second = add(&env, "second", "uid-second", &[("gpu", "gpu-3")]);
        let err = env
            .driver
            .prepare(&second)
            .await
            .expect_err("two regular claims conflict")
            .to_string();
        assert!(err.contains("ns/user") && err.contains("gpu-3"), "{err}");
        assert!(
            !err.contains("ns/early"),
            "the admin claim is no obstacle: {err}"
        );
    }

    /// `name` holding a share of `gib` GiB of `device` (an allocation with a share ID).
    fn add_share(env: &Env, name: &str, uid: &str, device: &str, gib: u64) -> ClaimRef {
        add_allocated(env, name, uid, device, &[], |r| {
            r.share_id = Some(format!("share-{uid}"));
            r.consumed_capacity = Some(
                [(
                    "memory".to_string(),
                    k8s_openapi::apimachinery::pkg::api::resource::Quantity(format!("{gib}Gi")),
                )]
                .into(),
            );
        })
    }

    #[tokio::test]
    async fn shares_of_a_memory_share_gpu_overlap_and_a_whole_allocation_there_does_not() {
        let env = env();
        env.driver
            .inventory
            .set_partitioning(gpu_dra_core::partitioning::Partitioning {
                memory_shares: gpu_dra_core::partitioning::GpuSelection::parse("gpu-2")
                    .expect("selection"),
                ..Default::default()
            });
        let a = add_share(&env, "a", "uid-a", "gpu-2", 10);
        let b = add_share(&env, "b", "uid-b", "gpu-2", 20);
        env.driver.prepare(&a).await.expect("first share");
        env.driver
            .prepare(&b)
            .await
            .expect("second share beside it");
        let spec = std::fs::read_to_string(spec_path(&env, "uid-b")).expect("spec");
        assert!(
            spec.contains(&format!("{}={}", memory_shares::SHARE_ENV, 20u64 << 30)),
            "{spec}"
        );
        let cp = on_disk(&env);
        assert_eq!(
            cp.claims["uid-a"].devices[0].memory_share_bytes,
            Some(10 << 30)
        );
        // A claim allocated the whole device (no share ID) is refused while shares hold it.
        let whole = add(&env, "whole", "uid-whole", &[("gpu", "gpu-2")]);
        let err = env.driver.prepare(&whole).await.expect_err("busy");
        assert!(matches!(err, DriverError::DeviceBusy { .. }), "{err}");
        // On a GPU not in memory-share mode, shares exclude each other as any claims do.
        let c = add_share(&env, "c", "uid-c", "gpu-3", 10);
        let d = add_share(&env, "d", "uid-d", "gpu-3", 10);
        env.driver.prepare(&c).await.expect("first");
        let err = env
            .driver
            .prepare(&d)
            .await
            .expect_err("not a memory-share GPU");
        assert!(matches!(err, DriverError::DeviceBusy { .. }), "{err}");
        // After a restart the holders come back from the checkpoint: shares still overlap.
        env.driver.unprepare(&b).await.expect("unprepare");
        let restarted = driver_in(env.dir.path(), env.claims.clone());
        restarted
            .inventory
            .set_partitioning(gpu_dra_core::partitioning::Partitioning {
                memory_shares: gpu_dra_core::partitioning::GpuSelection::parse("gpu-2")
                    .expect("selection"),
                ..Default::default()
            });
        restarted.prepare(&b).await.expect("share after restart");
        restarted
            .prepare(&whole)
            .await
            .expect_err("whole still busy");
    }

    /// `name` holding one share of `device` under NVIDIA's `<N>` consumable shares: no
    /// memory, `shares` shares.
    fn add_counted_share(env: &Env, name: &str, uid: &str, device: &str, shares: u64) -> ClaimRef {
        add_allocated(env, name, uid, device, &[], |r| {
            r.share_id = Some(format!("share-{uid}"));
            r.consumed_capacity = Some(
                [
                    ("memory".to_string(), Quantity("0".into())),
                    ("shares".to_string(), Quantity(shares.to_string())),
                ]
                .into(),
            );
        })
    }

    #[tokio::test]
    async fn consumable_shares_let_claims_hold_a_mig_device_together() {
        const MIG: &str = "gpu-0-mig-1g5gb-19-0";
        let env = env();
        let consumable = |mode| Partitioning {
            consumable_shares: mode,
            ..Default::default()
        };
        env.driver
            .inventory
            .set_partitioning(consumable(ConsumableShares::Count(4)));
        let a = add_counted_share(&env, "a", "uid-a", MIG, 1);
        let b = add_counted_share(&env, "b", "uid-b", MIG, 2);
        env.driver
            .prepare(&a)
            .await
            .expect("first share of the MIG device");
        env.driver
            .prepare(&b)
            .await
            .expect("second share beside it");
        let spec = std::fs::read_to_string(spec_path(&env, "uid-b")).expect("spec");
        assert!(spec.contains("GPU_DRA_SHARES=2"), "{spec}");
        assert!(
            !spec.contains(memory_shares::SHARE_ENV),
            "no memory consumed, none told: {spec}"
        );
        // Whole GPUs are shareable too; a whole allocation still excludes shares.
        let c = add_counted_share(&env, "c", "uid-c", "gpu-1", 1);
        let d = add_counted_share(&env, "d", "uid-d", "gpu-1", 1);
        env.driver.prepare(&c).await.expect("share of gpu-1");
        env.driver.prepare(&d).await.expect("second share of gpu-1");
        let whole = add(&env, "whole", "uid-whole", &[("gpu", MIG)]);
        let err = env.driver.prepare(&whole).await.expect_err("busy");
        assert!(matches!(err, DriverError::DeviceBusy { .. }), "{err}");
        // With consumable shares off, a new share of a held device is refused.
        env.driver
            .inventory
            .set_partitioning(Partitioning::default());
        let e = add_counted_share(&env, "e", "uid-e", MIG, 1);
        let err = env.driver.prepare(&e).await.expect_err("not shareable now");
        assert!(matches!(err, DriverError::DeviceBusy { .. }), "{err}");
    }
}
