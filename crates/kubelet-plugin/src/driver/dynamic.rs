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
//! - **What the plugin never destroys.** A GPU can become dynamic at run time (the Node
//!   annotation, or the flag at a restart) while its MIG instances are in use: a pod runs on a
//!   static MIG device its claim was prepared with, a process an admin started runs on an
//!   instance made by hand. NVML cannot tell here whether an instance has processes (the
//!   simulator does not answer `nvmlDeviceGetComputeRunningProcesses`, and a claim's pod may
//!   be between processes), so the rule is by origin: the instances on the GPU when the
//!   plugin first sees it dynamic (that no dynamic record owns) are *kept*, recorded in the
//!   checkpoint (`dynamicMigGpus`) before anything is destroyed, logged once each, and never
//!   destroyed by the plugin; an instance any prepared claim was prepared with (by MIG UUID,
//!   or the GI ID of its device in the live inventory) is never destroyed either. The
//!   publisher keeps all of them as static devices and offers no placement over them
//!   ([`gpu_dra_core::dynamic_mig`]); a claim allocated one of those devices gets the
//!   instance as it is, with no record (see [`intents`]). To give a kept instance's memory
//!   slices to dynamic placements, an admin destroys it by hand once unused; going back to
//!   static forgets the GPU, so a later switch keeps what is there then.
//! - **Sweep.** Every reconcile (at start, then periodically), after the half-prepared claims
//!   were rolled back, destroys the strays on dynamic GPUs: instances no dynamic record owns,
//!   no claim uses and that were not kept, i.e. made by hand on a GPU the plugin already
//!   offered dynamically (they break the scheduler's view), or leftovers of a lost checkpoint
//!   found after the switch.
//! - **The publisher knows the records.** The device names the dynamic records hold are
//!   handed to the live inventory right after an intent is written (before its instance is
//!   created) and after an instance is destroyed and its record removed, so the rendering
//!   never takes a claim's new instance for a stranger's.
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
//! - *Keeping a GPU static until the claims on it are gone*: the switch would not take effect
//!   while any pod runs there, and an admin's instances would still be destroyed after.
//! - *Destroying instances that have no running process*: not observable here (above), and a
//!   pod between two processes would lose its device.
//! - *Never destroying any instance but our own*: a stray made on a GPU the scheduler already
//!   partitions would block the placements allocated over it for good.

use std::collections::BTreeMap;

use gpu_dra_core::checkpoint::{ClaimEntry, DynamicMigGpu, DynamicMigInstance, PrepareState};
use gpu_dra_core::partitioning::GpuMode;
use gpu_dra_device::Gpu;
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
        if is_static_instance(snapshot, gpu, name) {
            // An instance no claim's dynamic device stands for sits exactly there (one kept
            // from before the switch, published as the static device it is): the claim gets
            // it as a static MIG device, created by nobody and destroyed by nobody.
            continue;
        }
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

/// Whether device `name` of dynamic GPU `gpu` is, in `snapshot`, an instance that no claim's
/// dynamic device stands for.
fn is_static_instance(snapshot: &Snapshot, gpu: &Gpu, name: &str) -> bool {
    gpu.mig_devices.iter().any(|m| m.device_name(gpu) == name)
        && !snapshot.dynamic_mig_devices.contains(name)
}

/// Whether [`intents`] would take one of `devices` for a static instance on a dynamic GPU:
/// then the caller discovers first, since the snapshot may still list an instance a rollback
/// has just destroyed.
pub(super) fn names_static_instances(snapshot: &Snapshot, devices: &[&str]) -> bool {
    snapshot
        .inventory
        .gpus
        .iter()
        .filter(|g| snapshot.partitioning.mode(g) == GpuMode::DynamicMig)
        .any(|g| devices.iter().any(|d| is_static_instance(snapshot, g, d)))
}

/// Whether `record` stands for instance `m` of GPU `gpu`: the same UUID once recorded, else the
/// same profile and placement.
/// The note of the Node event for MIG instances kept on `gpu` when it turned dynamic.
fn kept_note(gpu: &str, kept: &[&MigInstance]) -> String {
    let list: Vec<String> = kept
        .iter()
        .map(|m| {
            format!(
                "GI {} CI {} (profile ID {}, memory slices {}..{}, {})",
                m.gi_id,
                m.ci_id,
                m.gi_profile_id,
                m.placement.start,
                m.placement.start + m.placement.size,
                m.uuid
            )
        })
        .collect();
    format!(
        "GPU {gpu} turned dynamic MIG with {} MIG instance(s) the driver did not create: {}. They are kept and published as static MIG devices, and no placement over their memory slices is offered: destroy them (nvidia-smi mig -dci / -dgi) once no workload uses them to free those slices",
        kept.len(),
        list.join(", ")
    )
}

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

/// Whether a claim of `doc` was prepared with MIG instance `m` of `gpu` as a device of its
/// own (a static MIG device prepared before the GPU became dynamic): by the MIG UUID its entry
/// recorded, or, for an entry without one, by the GI ID of the device of that name in the
/// live inventory.
fn held(doc: &gpu_dra_core::checkpoint::Checkpoint, gpu: Option<&Gpu>, m: &MigInstance) -> bool {
    doc.claims.values().flat_map(|e| &e.devices).any(|d| {
        if !d.uuid.is_empty() {
            return d.uuid == m.uuid;
        }
        gpu.and_then(|g| {
            g.mig_devices
                .iter()
                .find(|live| live.device_name(g) == d.device)
        })
        .is_some_and(|live| live.gi_id == m.gi_id)
    })
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
            .await?;
        self.share_dynamic_devices();
        Ok(())
    }

    /// Tells the live inventory which dynamic MIG devices the checkpoint's records hold (see
    /// [`crate::inventory::Snapshot::dynamic_mig_devices`]). Called after every change of the
    /// records: after an intent is written and before its instance is created, and after an
    /// instance is destroyed and its record removed.
    pub(super) fn share_dynamic_devices(&self) {
        let names = self.journal.read(|doc| {
            doc.claims
                .values()
                .flat_map(|e| e.dynamic_mig.iter().map(|r| r.device.clone()))
                .collect()
        });
        self.inventory.set_dynamic_mig_devices(names);
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
            driver_version: None,
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
        // Before the instances exist, so that the publisher never takes one for a stranger.
        self.share_dynamic_devices();

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
                                "MIG instance GI {} CI {} (profile ID {}, memory slices {}..{}, {}) exists on GPU {} and overlaps the placement; no dynamic MIG device of a claim on this node owns it: if it was there when the GPU became dynamic, or a claim uses it, it is kept and this node no longer offers placements over it (delete this claim's pod so that it is allocated again); otherwise the plugin destroys it at its next cleanup (or destroy it with nvidia-smi mig -dci/-dgi) and the kubelet's retry succeeds",
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

    /// Destroys the strays on dynamic MIG GPUs: instances that no dynamic record owns, no
    /// prepared claim was prepared with, and that were not there when the plugin first saw the
    /// GPU dynamic (those are recorded then, and kept: see the module doc).
    pub(super) async fn sweep_instances(&self) {
        let snapshot = self.inventory.snapshot();
        let gpus = snapshot
            .partitioning
            .uuids(&snapshot.inventory, GpuMode::DynamicMig);
        let known = self.journal.read(|doc| doc.dynamic_mig_gpus.clone());
        if gpus.is_empty() && known.is_empty() {
            return;
        }
        let _mig = self.mig_lock.lock().await;
        let mut seen = BTreeMap::new();
        let mut listed = Vec::new();
        for gpu in gpus {
            let list = match self.list_instances(&gpu, &gpu).await {
                Ok(list) => list,
                Err(e) => {
                    warn!(gpu = %gpu, error = %e, "cannot list MIG instances of a dynamic MIG GPU");
                    // Known stays as it was; an unknown GPU is looked at again next time.
                    if let Some(k) = known.get(&gpu) {
                        seen.insert(gpu, k.clone());
                    }
                    continue;
                }
            };
            // Read after the listing, under the lock: every instance listed has its record.
            let owners = self.journal.read(|doc| records(doc, None));
            let entry = match known.get(&gpu) {
                Some(k) => DynamicMigGpu {
                    kept_instances: k
                        .kept_instances
                        .iter()
                        .filter(|u| list.iter().any(|m| m.uuid == **u))
                        .cloned()
                        .collect(),
                    extra: k.extra.clone(),
                },
                None => {
                    let kept: Vec<&MigInstance> = list
                        .iter()
                        .filter(|m| !owners.iter().any(|(_, _, r)| owns(r, &gpu, m)))
                        .inspect(|m| {
                            warn!(gpu = %gpu, gi = m.gi_id, ci = m.ci_id, profile_id = m.gi_profile_id, start = m.placement.start, uuid = %m.uuid, "MIG instance found on a GPU that became dynamic MIG: kept, published as a static MIG device, no placement over it offered; destroy it by hand once unused to free its memory slices");
                        })
                        .collect();
                    if let (Some(events), false) = (&self.node_events, kept.is_empty()) {
                        events.warning("MIGInstancesKept", kept_note(&gpu, &kept));
                    }
                    let kept: Vec<String> = kept.iter().map(|m| m.uuid.clone()).collect();
                    DynamicMigGpu {
                        kept_instances: kept,
                        ..DynamicMigGpu::default()
                    }
                }
            };
            seen.insert(gpu.clone(), entry);
            listed.push((gpu, list));
        }
        if seen != known {
            // Durable before anything is destroyed: a crash must not make a kept one a stray.
            let record = seen.clone();
            if let Err(e) = self
                .journal
                .persist(|cp| cp.dynamic_mig_gpus = record)
                .await
            {
                warn!(error = %e, "cannot record the dynamic MIG GPUs; destroying nothing");
                return;
            }
        }
        for (gpu, list) in listed {
            let kept = &seen[&gpu].kept_instances;
            let live = snapshot.inventory.gpus.iter().find(|g| g.uuid == gpu);
            let (owners, taken): (Vec<_>, Vec<bool>) = self.journal.read(|doc| {
                (
                    records(doc, None),
                    list.iter().map(|m| held(doc, live, m)).collect(),
                )
            });
            for (m, taken) in list.into_iter().zip(taken) {
                if taken
                    || kept.contains(&m.uuid)
                    || owners.iter().any(|(_, _, r)| owns(r, &gpu, &m))
                {
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
    /// Beside `3g.20gb` at 4 and `1g.5gb` at 0.
    const D2G_AT_2: &str = "gpu-0-mig-2g10gb-14-2";

    struct Env {
        dir: tempfile::TempDir,
        claims: Arc<MemoryClaims>,
        fake: FakeMig,
        driver: Driver,
        events: Arc<crate::node_events::RecordedEvents>,
    }

    /// GI profile ID and memory slices of the A100-40GB profiles the tests use.
    const SIZES: [(u32, u32); 5] = [(19, 1), (14, 2), (9, 4), (5, 4), (0, 8)];

    fn dynamic() -> Partitioning {
        Partitioning {
            dynamic_mig: GpuSelection::All,
            ..Partitioning::default()
        }
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
            Env::build(dir, fake, failpoints, dynamic())
        }

        /// The plugin restarted: a new driver (and claim source) over the same folder and
        /// MIG hardware, the old driver dropped first.
        fn restart(self) -> Env {
            let Env {
                dir, fake, driver, ..
            } = self;
            drop(driver);
            Env::with_failpoints(dir, fake, "")
        }

        fn build(
            dir: tempfile::TempDir,
            fake: FakeMig,
            failpoints: &str,
            partitioning: Partitioning,
        ) -> Env {
            let fake = if fake.instances().is_empty() {
                FakeMig::new(&SIZES)
            } else {
                fake
            };
            let base = inventory([a100_dynamic(0).build()]);
            let host = dir.path().join("host");
            std::fs::create_dir_all(dir.path().join("plugin")).expect("plugin dir");
            let backend = fake.inventory(base.clone(), &host);
            let first = backend.discover().expect("discover");
            let claims = Arc::new(MemoryClaims::default());
            let events = Arc::new(crate::node_events::RecordedEvents::default());
            let driver = DriverBuilder::new(dir.path(), first)
                .claims(claims.clone())
                .node_events(events.clone())
                .dynamic_mig(Arc::new(fake.clone()), backend, partitioning)
                .failpoints(Failpoints::parse(failpoints, None).expect("failpoints"))
                .build()
                .expect("driver");
            Env {
                dir,
                claims,
                fake,
                driver,
                events,
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
            super::super::durable_checkpoint(&path).expect("valid")
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
        // The startup reconcile: the plugin has seen the GPU dynamic (and empty).
        env.driver.reconcile().await;
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
            err.contains("no dynamic MIG device of a claim on this node owns it"),
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
        env.driver.reconcile().await;
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
                driver_version: None,
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
        let env = env.restart();
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

    /// A GPU partitioned statically, with a pod's claim prepared on its `3g.20gb` and a
    /// `1g.5gb` an admin made and nothing uses, is switched to dynamic MIG at run time (the
    /// Node annotation): the sweep destroys neither, the publisher is told that neither is a
    /// dynamic device, a placement beside them is prepared, one overlapping them is refused.
    /// An instance made by hand after the switch is a stray, destroyed. The claim's static
    /// device survives its own unprepare too: it was never the plugin's.
    #[tokio::test]
    async fn a_switch_to_dynamic_destroys_no_instance_that_was_there() {
        let fake = FakeMig::new(&SIZES);
        let gpu = inventory([a100_dynamic(0).build()]).gpus[0].uuid.clone();
        let in_use = fake.create(&gpu, 9, 4).expect("static 3g.20gb");
        let admin = fake.create(&gpu, 19, 0).expect("admin's 1g.5gb");
        let env = Env::build(
            tempfile::tempdir().expect("tempdir"),
            fake,
            "",
            Partitioning::default(),
        );
        env.driver.reconcile().await;
        let s = env.add("s", &[D3G]);
        let devices = env.driver.prepare(&s).await.expect("static prepare");
        assert_eq!(devices[0].uuid, in_use.uuid);
        assert!(env.on_disk().claims["uid-s"].dynamic_mig.is_empty());

        env.driver.inventory.set_partitioning(dynamic());
        env.driver.reconcile().await;
        assert_eq!(
            env.placements(),
            [(9, 4), (19, 0)],
            "the claim's instance and the admin's survive the switch"
        );
        let kept = &env.on_disk().dynamic_mig_gpus[&gpu].kept_instances;
        assert!(
            kept.contains(&in_use.uuid) && kept.contains(&admin.uuid),
            "{kept:?}"
        );
        // The admin hears of it on the Node, once, not only in the plugin's log.
        let events = env.events.taken();
        assert_eq!(events.len(), 1, "{events:?}");
        let (reason, note) = &events[0];
        assert_eq!(reason, "MIGInstancesKept");
        assert!(
            note.contains(&gpu)
                && note.contains(&in_use.uuid)
                && note.contains(&admin.uuid)
                && note.contains("2 MIG instance(s)")
                && note.contains("nvidia-smi mig -dci"),
            "{note}"
        );
        env.driver.reconcile().await;
        assert_eq!(env.events.taken().len(), 1, "a later sweep says it again");
        assert!(
            env.driver
                .inventory
                .snapshot()
                .dynamic_mig_devices
                .is_empty()
        );

        // A placement beside them is created; one over the admin's instance is refused.
        let d = env.add("d", &[D2G_AT_2]);
        env.driver.prepare(&d).await.expect("beside them");
        assert_eq!(env.placements(), [(9, 4), (14, 2), (19, 0)]);
        assert_eq!(
            *env.driver.inventory.snapshot().dynamic_mig_devices,
            std::collections::BTreeSet::from([D2G_AT_2.to_string()])
        );
        let o = env.add("o", &[D2G]);
        let err = env
            .driver
            .prepare(&o)
            .await
            .expect_err("overlap")
            .to_string();
        assert!(
            err.contains(&admin.uuid) && err.contains("it is kept"),
            "{err}"
        );

        // Made by hand after the switch, used by no claim: destroyed.
        env.fake.create(&gpu, 19, 1).expect("stray");
        env.driver.reconcile().await;
        assert_eq!(env.placements(), [(9, 4), (14, 2), (19, 0)]);

        // The static claim goes; its instance stays (kept), and a restart keeps it too.
        env.driver.unprepare(&s).await.expect("unprepares");
        env.driver.reconcile().await;
        assert_eq!(env.placements(), [(9, 4), (14, 2), (19, 0)]);
        let env = env.restart();
        env.claims.insert(allocated_claim(
            "ns",
            "d",
            "uid-d",
            DRIVER_NAME,
            NODE_NAME,
            &[("mig", D2G_AT_2)],
            &[],
        ));
        env.driver.reconcile().await;
        assert_eq!(env.placements(), [(9, 4), (14, 2), (19, 0)]);

        // Back to static: forgotten, so a later switch looks again.
        env.driver
            .inventory
            .set_partitioning(Partitioning::default());
        env.driver.reconcile().await;
        assert!(env.on_disk().dynamic_mig_gpus.is_empty());
    }

    /// A claim allocated the static device of a kept instance on a dynamic GPU (the publisher
    /// offers it under its own name) gets that instance: nothing is created or destroyed.
    #[tokio::test]
    async fn a_kept_instance_is_prepared_as_the_static_device_it_is() {
        let fake = FakeMig::new(&SIZES);
        let gpu = inventory([a100_dynamic(0).build()]).gpus[0].uuid.clone();
        let kept = fake.create(&gpu, 9, 4).expect("kept 3g.20gb");
        let env = Env::with_failpoints(tempfile::tempdir().expect("tempdir"), fake, "");
        env.driver.reconcile().await;
        let a = env.add("a", &[D3G]);
        let devices = env.driver.prepare(&a).await.expect("prepares");
        assert_eq!(devices[0].uuid, kept.uuid);
        assert!(env.on_disk().claims["uid-a"].dynamic_mig.is_empty());
        env.driver.unprepare(&a).await.expect("unprepares");
        env.driver.reconcile().await;
        assert_eq!(env.placements(), [(9, 4)]);
    }
}
