//! Dynamic MIG in prepare, unprepare and the startup reconcile: the MIG instance behind each
//! allocated placement of a dynamic MIG GPU.
//!
//! # The problem
//! A dynamic device (`gpu-0-mig-3g20gb-9-4`) names a placement, not an instance: prepare must
//! create the GPU instance at exactly that placement, and its full compute instance, before it
//! can plan the claim (the CDI spec needs the instance's capability nodes); unprepare must
//! destroy it. A crash can fall between any two of these steps, and NVML assigns the IDs only
//! at creation.
//!
//! # The fix
//! - **Intent first.** The claim's checkpoint entry lists every instance it needs (GPU,
//!   profile, placement) before the first is created; each instance's IDs and UUID are written
//!   right after its creation. So the checkpoint always names every instance that may exist,
//!   and one whose IDs were never written is found by its placement.
//! - **Reuse.** A retried prepare keeps the instances of its earlier try: one recorded (same
//!   UUID) or found at the placement and owned by no other claim is used as it is.
//! - **Refusal, not damage.** A placement that overlaps another claim's instance, or an
//!   instance that no claim of this node owns, is refused with the reason; nothing is
//!   destroyed for a prepare.
//! - **Destroy after the spec.** Unprepare and every rollback destroy the claim's instances
//!   once its CDI spec is gone (no new container can get them), then forget them. An instance
//!   is destroyed only when it is the recorded one (same UUID), or, for a record without IDs,
//!   the one at the placement that no other claim owns: IDs are reused after a reboot.
//! - **Sweep.** Every reconcile (at start, then periodically) destroys the instances on
//!   dynamic GPUs that no checkpoint entry owns, after the half-prepared claims were rolled
//!   back: leftovers of a crash, or instances made by hand on a GPU the plugin owns.
//! - One lock (`mig_lock`) covers recording an intent and creating its instance, destroying,
//!   and the sweep's list-then-compare, so the sweep never takes an instance being made for
//!   its owner.
//!
//! # Rejected alternatives
//! - *Creating after the plan*: the plan needs the instance's capability nodes.
//! - *Naming instances by GI ID alone*: IDs are reused; a record of another boot would destroy
//!   a new claim's instance.
//! - *Sweeping only at start*: Node annotations that make a GPU dynamic are applied after the
//!   start; a periodic sweep under the lock is as safe.

use gpu_dra_core::checkpoint::{ClaimEntry, DynamicMigInstance, PrepareState};
use gpu_dra_core::partitioning::GpuMode;
use tracing::{info, warn};

use super::{ClaimRef, Driver, DriverError, blocking};
use crate::inventory::Snapshot;
use crate::mig::{MigError, MigInstance};

/// The instances the claim's `devices` need: one per device that is a placement of a dynamic
/// MIG GPU of `snapshot`, starting from the claim's record in `kept` (with its IDs) when it has
/// one for the same device; and the records of `kept` that no device needs any more.
pub(super) fn intents(
    snapshot: &Snapshot,
    devices: &[&str],
    kept: Vec<DynamicMigInstance>,
) -> (Vec<DynamicMigInstance>, Vec<DynamicMigInstance>) {
    let mut out: Vec<DynamicMigInstance> = Vec::new();
    for &name in devices {
        if out.iter().any(|w| w.device == name) {
            continue;
        }
        let found = snapshot
            .inventory
            .gpus
            .iter()
            .filter(|g| snapshot.partitioning.mode(g) == GpuMode::DynamicMig)
            .find_map(|g| {
                gpu_dra_core::dynamic_mig::placement_of(g, name).map(|(p, pl)| (g, p, pl))
            });
        let Some((gpu, profile, placement)) = found else {
            continue;
        };
        let fresh = DynamicMigInstance {
            device: name.to_owned(),
            gpu_uuid: gpu.uuid.clone(),
            gi_profile_id: profile.gi_profile_id,
            placement_start: placement.start,
            placement_size: placement.size,
            ..DynamicMigInstance::default()
        };
        let record = kept
            .iter()
            .find(|k| {
                k.device == fresh.device
                    && k.gpu_uuid == fresh.gpu_uuid
                    && k.gi_profile_id == fresh.gi_profile_id
                    && k.placement_start == fresh.placement_start
            })
            .cloned()
            .unwrap_or(fresh);
        out.push(record);
    }
    let stale = kept.into_iter().filter(|k| !out.contains(k)).collect();
    (out, stale)
}

/// Whether `record` stands for instance `m` of GPU `gpu`: the same UUID once recorded, else the
/// same profile and placement.
fn owns(record: &DynamicMigInstance, gpu: &str, m: &MigInstance) -> bool {
    record.gpu_uuid == gpu
        && match &record.uuid {
            Some(uuid) => *uuid == m.uuid,
            None => {
                record.gi_profile_id == m.gi_profile_id
                    && record.placement_start == m.placement.start
            }
        }
}

fn overlaps(m: &MigInstance, start: u32, size: u32) -> bool {
    m.placement.start < start.saturating_add(size)
        && start < m.placement.start.saturating_add(m.placement.size)
}

/// `(claim UID, namespace/name, record)` of every claim's instances but `except`'s.
fn records(
    doc: &gpu_dra_core::checkpoint::Checkpoint,
    except: Option<&str>,
) -> Vec<(String, String, DynamicMigInstance)> {
    doc.claims
        .iter()
        .filter(|(u, _)| Some(u.as_str()) != except)
        .flat_map(|(u, e)| {
            e.dynamic_mig
                .iter()
                .map(move |r| (u.clone(), format!("{}/{}", e.namespace, e.name), r.clone()))
        })
        .collect()
}

fn mig_error(device: &str, e: MigError) -> DriverError {
    DriverError::DynamicMig {
        device: device.to_owned(),
        reason: e.reason,
    }
}

impl Driver {
    /// Destroys the instances in `stale` that claim `uid` kept from an earlier try and no
    /// longer needs (its GPU is not dynamic any more), and forgets them.
    pub(super) async fn drop_stale_instances(
        &self,
        uid: &str,
        stale: Vec<DynamicMigInstance>,
    ) -> Result<(), DriverError> {
        if stale.is_empty() {
            return Ok(());
        }
        self.destroy_instances(uid, &stale).await?;
        self.journal
            .persist(|cp| {
                if let Some(e) = cp.claims.get_mut(uid) {
                    e.dynamic_mig.retain(|r| !stale.contains(r));
                }
            })
            .await
    }

    async fn list_instances(
        &self,
        device: &str,
        gpu: &str,
    ) -> Result<Vec<MigInstance>, DriverError> {
        let mig = self.mig.clone();
        let gpu = gpu.to_owned();
        blocking(move || mig.list(&gpu))
            .await?
            .map_err(|e| mig_error(device, e))
    }

    /// Records `wanted` in the claim's entry, then makes sure each instance exists: the one
    /// recorded, one found at its placement that no other claim owns, or a new one.
    pub(super) async fn ensure_instances(
        &self,
        claim: &ClaimRef,
        wanted: Vec<DynamicMigInstance>,
    ) -> Result<(), DriverError> {
        let _mig = self.mig_lock.lock().await;
        let others = self.journal.read(|doc| records(doc, Some(&claim.uid)));
        for w in &wanted {
            if let Some((uid, name, r)) = others.iter().find(|(_, _, r)| {
                r.gpu_uuid == w.gpu_uuid && r.overlaps(w.placement_start, w.placement_size)
            }) {
                return Err(DriverError::DynamicMig {
                    device: w.device.clone(),
                    reason: format!(
                        "its memory slices {}..{} of GPU {} overlap device {} of claim {name} (uid {uid}), prepared on this node; two allocations of overlapping placements mean the scheduler did not count the GPU's shared counters (is the DRAPartitionableDevices feature gate off?): delete this claim's pod so that it is allocated again",
                        w.placement_start,
                        w.placement_start + w.placement_size,
                        w.gpu_uuid,
                        r.device
                    ),
                });
            }
        }
        let entry = ClaimEntry {
            state: PrepareState::PrepareStarted,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: Vec::new(),
            sharing: None,
            boot_id: self.settings.boot_id.clone(),
            imported: None,
            dynamic_mig: Vec::new(),
            extra: Default::default(),
        };
        let records = wanted.clone();
        self.journal
            .persist(|cp| {
                cp.claims
                    .entry(claim.uid.clone())
                    .or_insert(entry)
                    .dynamic_mig = records;
            })
            .await?;

        for (i, w) in wanted.iter().enumerate() {
            let list = self.list_instances(&w.device, &w.gpu_uuid).await?;
            let mine = list.iter().find(|m| owns(w, &w.gpu_uuid, m)).or_else(|| {
                list.iter().find(|m| {
                    m.gi_profile_id == w.gi_profile_id
                        && m.placement.start == w.placement_start
                        && !others.iter().any(|(_, _, r)| owns(r, &w.gpu_uuid, m))
                })
            });
            let instance = match mine {
                Some(m) => {
                    info!(claim.uid = %claim.uid, device = %w.device, gi = m.gi_id, ci = m.ci_id, uuid = %m.uuid, "reusing MIG instance");
                    m.clone()
                }
                None => {
                    if let Some(m) = list
                        .iter()
                        .find(|m| overlaps(m, w.placement_start, w.placement_size))
                    {
                        return Err(DriverError::DynamicMig {
                            device: w.device.clone(),
                            reason: format!(
                                "MIG instance GI {} CI {} (profile ID {}, memory slices {}..{}, {}) exists on GPU {} and overlaps the placement; no claim prepared on this node owns it: the plugin destroys it at its next cleanup (or destroy it with nvidia-smi mig -dci/-dgi), then the kubelet's retry succeeds",
                                m.gi_id,
                                m.ci_id,
                                m.gi_profile_id,
                                m.placement.start,
                                m.placement.start + m.placement.size,
                                m.uuid,
                                w.gpu_uuid
                            ),
                        });
                    }
                    let mig = self.mig.clone();
                    let (gpu, profile, start) =
                        (w.gpu_uuid.clone(), w.gi_profile_id, w.placement_start);
                    let m = blocking(move || mig.create(&gpu, profile, start))
                        .await?
                        .map_err(|e| mig_error(&w.device, e))?;
                    info!(claim.uid = %claim.uid, device = %w.device, gi = m.gi_id, ci = m.ci_id, uuid = %m.uuid, "created MIG instance");
                    self.failpoints.hit("prepare.after_mig_create").await?;
                    m
                }
            };
            self.journal
                .persist(|cp| {
                    if let Some(r) = cp
                        .claims
                        .get_mut(&claim.uid)
                        .and_then(|e| e.dynamic_mig.get_mut(i))
                    {
                        r.gi_id = Some(instance.gi_id);
                        r.ci_id = Some(instance.ci_id);
                        r.uuid = Some(instance.uuid.clone());
                    }
                })
                .await?;
        }
        Ok(())
    }

    /// Destroys the instances of claim `uid` listed in `mine` (those that exist).
    pub(super) async fn destroy_instances(
        &self,
        uid: &str,
        mine: &[DynamicMigInstance],
    ) -> Result<(), DriverError> {
        let _mig = self.mig_lock.lock().await;
        let others = self.journal.read(|doc| records(doc, Some(uid)));
        for r in mine {
            let list = self.list_instances(&r.device, &r.gpu_uuid).await?;
            let found = list.iter().find(|m| {
                owns(r, &r.gpu_uuid, m)
                    && (r.uuid.is_some() || !others.iter().any(|(_, _, o)| owns(o, &r.gpu_uuid, m)))
            });
            let Some(m) = found else {
                continue;
            };
            let mig = self.mig.clone();
            let (gpu, gi, ci) = (r.gpu_uuid.clone(), m.gi_id, m.ci_id);
            blocking(move || mig.destroy(&gpu, gi, ci))
                .await?
                .map_err(|e| mig_error(&r.device, e))?;
            info!(claim.uid = %uid, device = %r.device, gi = m.gi_id, ci = m.ci_id, uuid = %m.uuid, "destroyed MIG instance");
        }
        Ok(())
    }

    /// Destroys every instance on a dynamic MIG GPU that no checkpoint entry owns.
    pub(super) async fn sweep_instances(&self) {
        let snapshot = self.inventory.snapshot();
        let gpus = snapshot
            .partitioning
            .uuids(&snapshot.inventory, GpuMode::DynamicMig);
        if gpus.is_empty() {
            return;
        }
        let _mig = self.mig_lock.lock().await;
        for gpu in gpus {
            let list = match self.list_instances(&gpu, &gpu).await {
                Ok(list) => list,
                Err(e) => {
                    warn!(gpu = %gpu, error = %e, "cannot list MIG instances of a dynamic MIG GPU");
                    continue;
                }
            };
            // Read after the listing, under the lock: every instance listed has its record.
            let owners = self.journal.read(|doc| records(doc, None));
            for m in list {
                if owners.iter().any(|(_, _, r)| owns(r, &gpu, &m)) {
                    continue;
                }
                warn!(gpu = %gpu, gi = m.gi_id, ci = m.ci_id, profile_id = m.gi_profile_id, start = m.placement.start, uuid = %m.uuid, "destroying MIG instance that no claim owns on a dynamic MIG GPU");
                let mig = self.mig.clone();
                let (g, gi, ci) = (gpu.clone(), m.gi_id, m.ci_id);
                match blocking(move || mig.destroy(&g, gi, ci)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(gpu = %gpu, error = %e, "cannot destroy MIG instance"),
                    Err(e) => warn!(gpu = %gpu, error = %e, "cannot destroy MIG instance"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpu_dra_core::checkpoint::Checkpoint;
    use gpu_dra_core::partitioning::{GpuSelection, Partitioning};
    use gpu_dra_device::testing::{a100_dynamic, inventory};

    use super::*;
    use crate::failpoint::Failpoints;
    use crate::mig::MigControl;
    use crate::testing::{
        DRIVER_NAME, DriverBuilder, FakeMig, MemoryClaims, NODE_NAME, allocated_claim,
    };

    /// `3g.20gb` at 4, `2g.10gb` at 0, `1g.5gb` at 2 on an A100-40GB: they fit together.
    const D3G: &str = "gpu-0-mig-3g20gb-9-4";
    const D2G: &str = "gpu-0-mig-2g10gb-14-0";
    const D1G: &str = "gpu-0-mig-1g5gb-19-2";
    /// Overlaps `3g.20gb` at 4.
    const D1G_AT_5: &str = "gpu-0-mig-1g5gb-19-5";

    struct Env {
        dir: tempfile::TempDir,
        claims: Arc<MemoryClaims>,
        fake: FakeMig,
        driver: Driver,
    }

    impl Env {
        fn new() -> Env {
            Env::with_failpoints(
                tempfile::tempdir().expect("tempdir"),
                FakeMig::default(),
                "",
            )
        }

        fn with_failpoints(dir: tempfile::TempDir, fake: FakeMig, failpoints: &str) -> Env {
            let fake = if fake.instances().is_empty() {
                FakeMig::new(&[(19, 1), (14, 2), (9, 4), (5, 4), (0, 8)])
            } else {
                fake
            };
            let base = inventory([a100_dynamic(0).build()]);
            let host = dir.path().join("host");
            std::fs::create_dir_all(dir.path().join("plugin")).expect("plugin dir");
            let backend = fake.inventory(base.clone(), &host);
            let first = backend.discover().expect("discover");
            let claims = Arc::new(MemoryClaims::default());
            let driver = DriverBuilder::new(dir.path(), first)
                .claims(claims.clone())
                .dynamic_mig(
                    Arc::new(fake.clone()),
                    backend,
                    Partitioning {
                        dynamic_mig: GpuSelection::All,
                        memory_shares: GpuSelection::None,
                    },
                )
                .failpoints(Failpoints::parse(failpoints, None).expect("failpoints"))
                .build()
                .expect("driver");
            Env {
                dir,
                claims,
                fake,
                driver,
            }
        }

        fn add(&self, name: &str, devices: &[&str]) -> ClaimRef {
            let uid = format!("uid-{name}");
            let results: Vec<(&str, &str)> = devices.iter().map(|d| ("mig", *d)).collect();
            self.claims.insert(allocated_claim(
                "ns",
                name,
                &uid,
                DRIVER_NAME,
                NODE_NAME,
                &results,
                &[],
            ));
            ClaimRef {
                namespace: "ns".into(),
                name: name.into(),
                uid,
            }
        }

        fn on_disk(&self) -> Checkpoint {
            let path = self
                .dir
                .path()
                .join("plugin")
                .join(gpu_dra_core::checkpoint::FILE_NAME);
            std::fs::read(path)
                .map(|b| Checkpoint::from_json(&b).expect("valid"))
                .unwrap_or_default()
        }

        fn placements(&self) -> Vec<(u32, u32)> {
            let mut v: Vec<(u32, u32)> = self
                .fake
                .instances()
                .iter()
                .map(|(_, m)| (m.gi_profile_id, m.placement.start))
                .collect();
            v.sort_unstable();
            v
        }

        fn spec(&self, uid: &str) -> std::path::PathBuf {
            self.dir
                .path()
                .join("cdi")
                .join(gpu_dra_core::cdi::spec_file_name(uid))
        }
    }

    #[tokio::test]
    async fn prepare_creates_at_the_placement_and_unprepare_destroys() {
        let env = Env::new();
        let a = env.add("a", &[D3G, D1G]);
        let devices = env.driver.prepare(&a).await.expect("prepares");
        assert_eq!(devices.len(), 2);
        assert_eq!(env.placements(), [(9, 4), (19, 2)]);
        let cp = env.on_disk();
        let entry = &cp.claims["uid-a"];
        assert_eq!(entry.state, PrepareState::PrepareCompleted);
        assert_eq!(entry.dynamic_mig.len(), 2);
        let by_device = |d: &str| {
            entry
                .dynamic_mig
                .iter()
                .find(|r| r.device == d)
                .expect("recorded")
                .clone()
        };
        let r = by_device(D3G);
        assert_eq!(
            (r.gi_profile_id, r.placement_start, r.placement_size),
            (9, 4, 4)
        );
        let made = env
            .fake
            .instances()
            .into_iter()
            .find(|(_, m)| m.gi_profile_id == 9)
            .expect("3g")
            .1;
        assert_eq!(r.uuid.as_deref(), Some(made.uuid.as_str()));
        assert_eq!((r.gi_id, r.ci_id), (Some(made.gi_id), Some(made.ci_id)));
        // The device's UUID is the instance's, and its spec has the instance's cap nodes.
        let d3 = devices.iter().find(|d| d.device == D3G).expect("3g device");
        assert_eq!(d3.uuid, made.uuid);
        let spec = std::fs::read_to_string(env.spec(&a.uid)).expect("spec");
        assert!(spec.contains("nvidia-cap"), "{spec}");

        // Idempotent: the same answer, no new instance.
        assert_eq!(env.driver.prepare(&a).await.expect("again"), devices);
        assert_eq!(env.placements().len(), 2);

        env.driver.unprepare(&a).await.expect("unprepares");
        assert!(env.placements().is_empty());
        assert!(env.on_disk().claims.is_empty());
        assert!(!env.spec(&a.uid).exists());
        env.driver.unprepare(&a).await.expect("again");
    }

    #[tokio::test]
    async fn an_overlapping_placement_is_refused_and_leaves_nothing() {
        let env = Env::new();
        let a = env.add("a", &[D3G]);
        env.driver.prepare(&a).await.expect("a prepares");
        let b = env.add("b", &[D2G, D1G_AT_5]);
        let err = env
            .driver
            .prepare(&b)
            .await
            .expect_err("overlap")
            .to_string();
        assert!(
            err.contains(D1G_AT_5)
                && err.contains("ns/a")
                && err.contains("DRAPartitionableDevices"),
            "{err}"
        );
        assert_eq!(env.placements(), [(9, 4)], "b created nothing");
        assert!(!env.on_disk().claims.contains_key("uid-b"));

        // An instance no claim owns is refused too, and not destroyed by prepare.
        env.fake
            .create(&env.driver.inventory.current().gpus[0].uuid, 19, 0)
            .expect("by hand");
        let c = env.add("c", &[D2G]);
        let err = env
            .driver
            .prepare(&c)
            .await
            .expect_err("unowned")
            .to_string();
        assert!(
            err.contains("no claim prepared on this node owns it"),
            "{err}"
        );
        assert_eq!(env.placements(), [(9, 4), (19, 0)]);
        // The cleanup sweep destroys it; then c prepares.
        env.driver.reconcile().await;
        assert_eq!(env.placements(), [(9, 4)]);
        env.driver.prepare(&c).await.expect("c prepares");
        assert_eq!(env.placements(), [(9, 4), (14, 0)]);
    }

    #[tokio::test]
    async fn a_failure_after_creation_destroys_the_instance() {
        let env = Env::with_failpoints(
            tempfile::tempdir().expect("tempdir"),
            FakeMig::default(),
            "prepare.after_mig_create=error",
        );
        let a = env.add("a", &[D1G]);
        let err = env.driver.prepare(&a).await.expect_err("fails").to_string();
        assert!(err.contains("prepare.after_mig_create"), "{err}");
        assert!(env.placements().is_empty());
        assert!(env.on_disk().claims.is_empty());

        env.fake
            .fail_create(Some("Insufficient Resources (NVML return code 23)"));
        let err = env.driver.prepare(&a).await.expect_err("fails").to_string();
        assert!(err.contains(D1G) && err.contains("code 23"), "{err}");
        assert!(env.on_disk().claims.is_empty());
    }

    #[tokio::test]
    async fn a_restart_keeps_prepared_instances_and_destroys_the_rest() {
        let env = Env::new();
        let a = env.add("a", &[D3G]);
        env.driver.prepare(&a).await.expect("a prepares");
        let gpu = env.driver.inventory.current().gpus[0].uuid.clone();
        // A half-prepared claim whose instance was created but whose IDs were never written
        // (a kill at prepare.after_mig_create), and an instance nobody owns.
        let b = env.add("b", &[D2G]);
        env.fake.create(&gpu, 14, 0).expect("b's instance");
        env.fake.create(&gpu, 19, 3).expect("orphan");
        let mut cp = env.on_disk();
        cp.claims.insert(
            b.uid.clone(),
            ClaimEntry {
                state: PrepareState::PrepareStarted,
                namespace: "ns".into(),
                name: "b".into(),
                devices: Vec::new(),
                sharing: None,
                boot_id: None,
                imported: None,
                dynamic_mig: vec![DynamicMigInstance {
                    device: D2G.into(),
                    gpu_uuid: gpu.clone(),
                    gi_profile_id: 14,
                    placement_start: 0,
                    placement_size: 2,
                    ..DynamicMigInstance::default()
                }],
                extra: Default::default(),
            },
        );
        let path = env
            .dir
            .path()
            .join("plugin")
            .join(gpu_dra_core::checkpoint::FILE_NAME);
        std::fs::write(&path, cp.to_json()).expect("write");
        let Env {
            dir, fake, driver, ..
        } = env;
        drop(driver);

        let env = Env::with_failpoints(dir, fake, "");
        env.claims.insert(allocated_claim(
            "ns",
            "a",
            "uid-a",
            DRIVER_NAME,
            NODE_NAME,
            &[("mig", D3G)],
            &[],
        ));
        env.driver.reconcile().await;
        assert_eq!(
            env.placements(),
            [(9, 4)],
            "a's kept, b's and the orphan destroyed"
        );
        assert!(!env.on_disk().claims.contains_key("uid-b"));
        // The kubelet's retry prepares b.
        let b = env.add("b", &[D2G]);
        env.driver.prepare(&b).await.expect("b prepares");
        assert_eq!(env.placements(), [(9, 4), (14, 0)]);
    }

    #[test]
    fn intents_start_from_kept_records_and_name_the_stale_ones() {
        let env = Env::new();
        let snapshot = env.driver.inventory.snapshot();
        let gpu = snapshot.inventory.gpus[0].uuid.clone();
        let recorded = DynamicMigInstance {
            device: D3G.into(),
            gpu_uuid: gpu.clone(),
            gi_profile_id: 9,
            placement_start: 4,
            placement_size: 4,
            gi_id: Some(2),
            ci_id: Some(0),
            uuid: Some("MIG-x".into()),
            ..DynamicMigInstance::default()
        };
        let stale = DynamicMigInstance {
            device: D2G.into(),
            gi_profile_id: 14,
            placement_start: 0,
            placement_size: 2,
            ..recorded.clone()
        };
        let (wanted, left) = intents(
            &snapshot,
            &[D3G, D1G, D1G, "gpu-0"],
            vec![recorded.clone(), stale.clone()],
        );
        assert_eq!(wanted.len(), 2, "one per dynamic placement: {wanted:?}");
        assert_eq!(wanted[0], recorded);
        assert_eq!(
            (
                wanted[1].gi_profile_id,
                wanted[1].placement_start,
                wanted[1].gi_id
            ),
            (19, 2, None)
        );
        assert_eq!(left, [stale]);
    }

    #[tokio::test]
    async fn a_retry_reuses_the_instance_of_its_earlier_try() {
        let env = Env::new();
        let a = env.add("a", &[D1G]);
        env.driver.prepare(&a).await.expect("prepares");
        let first = env.fake.instances();
        // The spec vanished (e.g. a tmpfs emptied): prepared again, same instance.
        std::fs::remove_file(env.spec(&a.uid)).expect("rm");
        env.driver.prepare(&a).await.expect("prepares again");
        assert_eq!(env.fake.instances(), first);
        assert!(env.spec(&a.uid).exists());
    }
}
