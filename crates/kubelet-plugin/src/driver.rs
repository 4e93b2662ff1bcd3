//! Prepare and unprepare: the plugin's state machine over claims, devices, CDI specs and the
//! checkpoint.
//!
//! Invariants:
//! - per claim UID one operation at a time (a per-UID async lock, kept only while an
//!   operation holds or waits for it: [`crate::claim_locks`]); different claims proceed
//!   concurrently, also within one kubelet call;
//! - a device is held by at most one regular claim; claims with admin access (monitoring
//!   access, as the scheduler grants it) may hold it beside any other claim, and never with
//!   sharing settings, which would change the compute mode under the owner. The whole-GPU
//!   device of a memory-share GPU ([`gpu_dra_core::memory_shares`]) may be held by several
//!   claims whose allocations are shares (carry a share ID); one allocated whole still
//!   excludes every other. The holder set is rebuilt from the checkpoint at start;
//! - order of effects: checkpoint `PrepareStarted` (with the devices) -> sharing -> CDI spec
//!   -> checkpoint `PrepareCompleted`. Unprepare and rollback undo in reverse (sharing, spec,
//!   entry). So after a crash at any step the checkpoint names every side effect that may
//!   exist, and a retry or the startup reconcile cleans it up;
//! - prepare of a completed claim answers from the checkpoint (idempotent); a claim found
//!   `PrepareStarted` is rolled back first; unprepare of an unknown claim succeeds;
//! - except when the completed claim's side effects are gone: it was prepared in another
//!   boot of the node (its recorded boot ID differs), or its CDI spec file is missing (e.g.
//!   `/var/run/cdi` is a tmpfs a reboot emptied). Then the claim is rolled back and prepared
//!   again from the API server: spec rewritten, sharing reapplied, and the answer is the same
//!   because CDI IDs are a function of claim UID and device name. Both halves are the usual
//!   crash-safe steps, so a crash in between leaves a state the next prepare finishes;
//! - claims imported from NVIDIA's driver ([`crate::checkpoint_file`]) are answered and
//!   reserved like ours; undoing one removes NVIDIA's spec file for it and resets the
//!   time-slicing NVIDIA applied (through [`SharingExecutor::release_imported`]);
//! - checkpoint writes use group commit: concurrent claims share one atomic write;
//! - a claim's dynamic MIG devices get their MIG instances before anything else: the intent
//!   is in the checkpoint before an instance is created, and unprepare and every rollback
//!   destroy them after the CDI spec is gone (see [`dynamic`]).

mod dynamic;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::inventory::{LiveInventory, ResolveError};
use gpu_dra_core::cdi::{SpecDevice, cdi_device_id};
use gpu_dra_core::checkpoint::{
    Checkpoint, ClaimEntry, DynamicMigInstance, PrepareState, PreparedDevice,
};
use gpu_dra_core::memory_shares;
use gpu_dra_core::partitioning::GpuMode;
use gpu_dra_core::plan::{self, ConfigDecoder, Plan, PlanError};
use serde_json::Value;
use tracing::{info, warn};

use crate::cdi_io::{CdiError, CdiHost};
use crate::claim_locks::ClaimLocks;
use crate::claims::{ClaimSource, ClaimSourceError};
use crate::failpoint::{Failpoints, Fired};
use crate::metrics::Metrics;
use crate::mig::MigControl;
use crate::sharing::{SharingError, SharingExecutor};

/// Why a claim could not be prepared or unprepared.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The claim does not exist in the API server.
    #[error("ResourceClaim {claim} not found")]
    ClaimNotFound {
        /// `namespace/name`.
        claim: String,
    },
    /// Reading the claim failed.
    #[error(transparent)]
    Source(#[from] ClaimSourceError),
    /// The claim cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A device is held by another prepared claim.
    #[error(
        "device {device} is already prepared for claim {holder} (uid {holder_uid}); a device is prepared for one claim at a time, besides claims with adminAccess and shares of a memory-share GPU (when that claim's pod has just ended, the kubelet unprepares it shortly and its retry of this prepare succeeds)"
    )]
    DeviceBusy {
        /// Device name.
        device: String,
        /// `namespace/name` of the holder.
        holder: String,
        /// UID of the holder.
        holder_uid: String,
    },
    /// Applying or releasing sharing failed.
    #[error(transparent)]
    Sharing(#[from] SharingError),
    /// A CDI step failed.
    #[error(transparent)]
    Cdi(#[from] CdiError),
    /// Reading the checkpoint at start failed, or it is not a checkpoint of ours.
    #[error(
        "cannot read checkpoint {path}: {reason}; fix the file, or move it away to start with no prepared claims (their devices are then not reserved and running pods keep them)"
    )]
    CheckpointRead {
        /// Checkpoint path.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// Writing the checkpoint failed.
    #[error("cannot write checkpoint {path}: {source}")]
    Checkpoint {
        /// Checkpoint path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A failpoint fired.
    #[error(transparent)]
    Failpoint(#[from] Fired),
    /// A blocking task panicked or was cancelled.
    #[error("internal task failed: {0}")]
    Task(String),
    /// The allocated device is not the one published under its name, or discovery failed.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// A dynamic MIG device's instance could not be created, found or destroyed.
    #[error("dynamic MIG device {device}: {reason}")]
    DynamicMig {
        /// Device name.
        device: String,
        /// What went wrong and what to do.
        reason: String,
    },
}

/// What a rollback undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rollback {
    /// Everything, the entry included.
    All,
    /// Everything but the claim's MIG instances, which stay recorded in its (half-prepared)
    /// entry for the prepare that follows.
    KeepMig,
}

/// Identity of a claim as the kubelet sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// Static settings of the driver.
pub struct DriverSettings {
    /// DRA driver name (`gpu.nvidia.com`).
    pub driver_name: String,
    /// Node name = pool name.
    pub node_name: String,
    /// Checkpoint file (`<plugin-dir>/gpu-dra-checkpoint.json`; our or NVIDIA's
    /// `checkpoint.json` next to it is migrated or imported at start).
    pub checkpoint_path: std::path::PathBuf,
    /// The node's current boot ID (`None`: unknown, reboots are then detected only through
    /// missing CDI specs).
    pub boot_id: Option<String>,
}

struct Holder {
    uid: String,
    claim: String,
    admin: bool,
    /// Allocated as one share of the device (it has a share ID).
    share: bool,
}

struct CheckpointState {
    doc: Checkpoint,
    /// Bumped on every in-memory change.
    changes: u64,
}

/// The prepare/unprepare engine behind the gRPC services.
pub struct Driver {
    settings: DriverSettings,
    inventory: Arc<LiveInventory>,
    claims: Arc<dyn ClaimSource>,
    sharing: Arc<dyn SharingExecutor>,
    decoder: Arc<dyn ConfigDecoder + Send + Sync>,
    cdi: Arc<CdiHost>,
    failpoints: Failpoints,
    metrics: Arc<Metrics>,
    mig: Arc<dyn MigControl>,
    /// Held while MIG instances are recorded and created, destroyed, or swept, so that a
    /// sweep never sees an instance without the checkpoint record that owns it.
    mig_lock: tokio::sync::Mutex<()>,
    state: Mutex<CheckpointState>,
    /// Serializes checkpoint file writes; holds the change count last written.
    writer: tokio::sync::Mutex<u64>,
    claim_locks: ClaimLocks,
    holders: Mutex<HashMap<String, Vec<Holder>>>,
}

/// Everything the driver is built from.
pub struct DriverParts {
    /// Settings.
    pub settings: DriverSettings,
    /// The node's live inventory (prepare resolves devices in it).
    pub inventory: Arc<LiveInventory>,
    /// Claim source.
    pub claims: Arc<dyn ClaimSource>,
    /// Sharing executor.
    pub sharing: Arc<dyn SharingExecutor>,
    /// Opaque config decoder.
    pub decoder: Arc<dyn ConfigDecoder + Send + Sync>,
    /// CDI host layout.
    pub cdi: Arc<CdiHost>,
    /// Failpoints.
    pub failpoints: Failpoints,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Creates and destroys the MIG instances of dynamic MIG devices.
    pub mig: Arc<dyn MigControl>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Refuses a sharing config that reaches a device allocated with admin access (from the
/// claim or its DeviceClass), with the api crate's message.
fn refuse_sharing_with_admin_access(plan: &Plan) -> Result<(), PlanError> {
    for group in plan.groups.iter().filter(|g| g.sharing.is_some()) {
        let admin = group
            .devices
            .iter()
            .filter_map(|&i| plan.devices.get(i))
            .find(|d| d.admin_access);
        if let (Some(device), Some(index)) = (admin, group.config_index) {
            let request = device.request_names.first().map_or("", String::as_str);
            return Err(PlanError::Config {
                index,
                errors: gpu_dra_api::admin_access_sharing(request).into(),
            });
        }
    }
    Ok(())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, DriverError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| DriverError::Task(e.to_string()))
}

impl Driver {
    /// Loads the checkpoint (a missing file is an empty checkpoint; see
    /// [`crate::checkpoint_file`] for the migration and the import of NVIDIA's) and builds the
    /// driver.
    pub fn new(parts: DriverParts) -> Result<Self, DriverError> {
        let doc = crate::checkpoint_file::open(&parts.settings.checkpoint_path)?;
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
        let prepared: usize = doc
            .claims
            .values()
            .filter(|e| e.state == PrepareState::PrepareCompleted)
            .map(|e| e.devices.len())
            .sum();
        parts.metrics.prepared_devices.set(prepared as i64);
        Ok(Driver {
            settings: parts.settings,
            inventory: parts.inventory,
            claims: parts.claims,
            sharing: parts.sharing,
            decoder: parts.decoder,
            cdi: parts.cdi,
            failpoints: parts.failpoints,
            metrics: parts.metrics,
            mig: parts.mig,
            mig_lock: tokio::sync::Mutex::new(()),
            state: Mutex::new(CheckpointState { doc, changes: 0 }),
            writer: tokio::sync::Mutex::new(0),
            claim_locks: ClaimLocks::default(),
            holders: Mutex::new(holders),
        })
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The driver name.
    pub fn driver_name(&self) -> &str {
        &self.settings.driver_name
    }

    /// A copy of the checkpoint as it is in memory.
    pub fn checkpoint(&self) -> Checkpoint {
        lock(&self.state).doc.clone()
    }

    /// IDs of the MPS control daemons of claims imported from NVIDIA's driver: their
    /// directories under `<plugin-dir>/mps` are NVIDIA's, not strays of ours.
    pub fn imported_mps_daemons(&self) -> Vec<String> {
        lock(&self.state)
            .doc
            .claims
            .values()
            .filter_map(|e| e.imported.as_ref())
            .flat_map(|i| i.mps_control_daemons.iter().cloned())
            .collect()
    }

    /// Why a completed claim's recorded answer cannot be trusted any more, if it cannot.
    fn stale_reason(&self, uid: &str, entry: &ClaimEntry) -> Option<String> {
        if let (Some(now), Some(then)) = (&self.settings.boot_id, &entry.boot_id)
            && now != then
        {
            return Some(format!(
                "the node rebooted since it was prepared (boot ID {then}, now {now})"
            ));
        }
        let ours = self.cdi.spec_path(uid);
        let theirs = entry
            .imported
            .is_some()
            .then(|| self.cdi.nvidia_spec_path(uid));
        if ours.exists() || theirs.is_some_and(|p| p.exists()) {
            return None;
        }
        Some(format!("its CDI spec {} is missing", ours.display()))
    }

    fn entry(&self, uid: &str) -> Option<ClaimEntry> {
        lock(&self.state).doc.claims.get(uid).cloned()
    }

    /// Applies `change` to the checkpoint and returns once a write containing it is durable.
    async fn persist(&self, change: impl FnOnce(&mut Checkpoint)) -> Result<(), DriverError> {
        let mine = {
            let mut st = lock(&self.state);
            change(&mut st.doc);
            st.changes += 1;
            st.changes
        };
        let mut written = self.writer.lock().await;
        if *written >= mine {
            // A write that started after our change already made it durable.
            return Ok(());
        }
        let (bytes, upto) = {
            let st = lock(&self.state);
            (st.doc.to_json(), st.changes)
        };
        let path = self.settings.checkpoint_path.clone();
        blocking(move || gpu_dra_fsutil::write_atomic(&path, &bytes, 0o600))
            .await?
            .map_err(|source| DriverError::Checkpoint {
                path: self.settings.checkpoint_path.display().to_string(),
                source,
            })?;
        *written = upto;
        Ok(())
    }

    /// Records `claim` as a holder of its devices, refusing a device another claim holds,
    /// unless one of the two has admin access or both are shares of a device in
    /// `memory_share_devices` (the whole-GPU devices of memory-share GPUs; the scheduler keeps
    /// the sum of the shares within the GPU's memory, and a whole-device allocation there
    /// still excludes every other).
    fn reserve(
        &self,
        claim: &ClaimRef,
        plan: &Plan,
        memory_share_devices: &BTreeSet<String>,
    ) -> Result<(), DriverError> {
        let mut holders = lock(&self.holders);
        for d in &plan.devices {
            let shareable = d.share_id.is_some() && memory_share_devices.contains(&d.device);
            let compatible = |h: &&Holder| {
                h.uid == claim.uid || h.admin || d.admin_access || (shareable && h.share)
            };
            if let Some(h) = holders
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
            let list = holders.entry(d.device.clone()).or_default();
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

    fn release_devices(&self, uid: &str) {
        let mut holders = lock(&self.holders);
        holders.retain(|_, list| {
            list.retain(|h| h.uid != uid);
            !list.is_empty()
        });
    }

    /// Prepares one claim; returns its devices with CDI IDs.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, DriverError> {
        let started = Instant::now();
        self.metrics.in_flight.inc();
        let result = self.prepare_inner(claim).await;
        self.metrics.in_flight.dec();
        self.metrics
            .observe("prepare", started.elapsed().as_secs_f64(), result.is_ok());
        match &result {
            Ok(devices) => {
                info!(claim.uid = %claim.uid, claim = %format!("{}/{}", claim.namespace, claim.name), devices = devices.len(), "prepared")
            }
            Err(e) => warn!(claim.uid = %claim.uid, error = %e, "prepare failed"),
        }
        result
    }

    async fn prepare_inner(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, DriverError> {
        self.failpoints.hit("prepare.start").await?;
        let user = self.claim_locks.join(&claim.uid);
        let _guard = user.lock().await;
        // A claim prepared before (or half prepared) is undone first, except for its MIG
        // instances, which the new try reuses when it needs them again.
        let kept = match self.entry(&claim.uid) {
            Some(e) if e.state == PrepareState::PrepareCompleted => {
                let Some(reason) = self.stale_reason(&claim.uid, &e) else {
                    return Ok(e.devices);
                };
                info!(claim.uid = %claim.uid, %reason, "preparing the claim again");
                self.rollback_locked(&claim.uid, Rollback::KeepMig).await?;
                e.dynamic_mig
            }
            Some(e) => {
                self.rollback_locked(&claim.uid, Rollback::KeepMig).await?;
                e.dynamic_mig
            }
            None => Vec::new(),
        };
        let result = self.prepare_fresh(claim, kept).await;
        if result.is_err() && self.entry(&claim.uid).is_some() {
            // Undo whatever was done; the checkpoint says what that may be.
            if let Err(e) = self.rollback_locked(&claim.uid, Rollback::All).await {
                warn!(claim.uid = %claim.uid, error = %e, "rollback after failed prepare failed");
            }
            self.release_devices(&claim.uid);
        }
        result
    }

    /// Prepares a claim that has no entry (or only the MIG instances in `kept`).
    async fn prepare_fresh(
        &self,
        claim: &ClaimRef,
        kept: Vec<DynamicMigInstance>,
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        let rc = self
            .claims
            .get(&claim.namespace, &claim.name)
            .await?
            .ok_or_else(|| DriverError::ClaimNotFound {
                claim: format!("{}/{}", claim.namespace, claim.name),
            })?;
        let input = plan::claim_input(
            &rc,
            &claim.uid,
            &self.settings.driver_name,
            &self.settings.node_name,
        )?;
        // Planned against the hardware of now, and refused for a device that is not the one
        // this node published under its name (see crate::inventory).
        let names: Vec<&str> = input.devices.iter().map(|d| d.device.as_str()).collect();
        // Dynamic MIG devices exist once their instances do: created (or found) first, so the
        // live inventory below has them with their IDs and capability nodes.
        let (wanted, stale) = dynamic::intents(&self.inventory.snapshot(), &names, kept);
        self.drop_stale_instances(&claim.uid, stale).await?;
        if !wanted.is_empty() {
            self.ensure_instances(claim, wanted).await?;
        }
        let inventory = self.inventory.resolve(&claim.uid, &names).await?;
        let plan = plan::plan(&input, &inventory, self.decoder.as_ref())?;
        refuse_sharing_with_admin_access(&plan)?;
        self.failpoints.hit("prepare.after_plan").await?;
        // On refusal nothing else is done yet: only MIG instances (if any), which the caller
        // undoes.
        let partitioning = self.inventory.partitioning();
        let memory_share_devices: BTreeSet<String> = inventory
            .gpus
            .iter()
            .filter(|g| partitioning.mode(g) == GpuMode::MemoryShares)
            .map(|g| g.device_name())
            .collect();
        self.reserve(claim, &plan, &memory_share_devices)?;
        let result = self.apply_plan(claim, &plan).await;
        if result.is_err() && self.entry(&claim.uid).is_none() {
            // The entry's first write failed: the reservation is all there is to undo.
            self.release_devices(&claim.uid);
        }
        result
    }

    async fn apply_plan(
        &self,
        claim: &ClaimRef,
        plan: &Plan,
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        let devices: Vec<PreparedDevice> = plan
            .devices
            .iter()
            .map(|d| PreparedDevice {
                device: d.device.clone(),
                pool: self.settings.node_name.clone(),
                request_names: d.request_names.clone(),
                cdi_device_ids: vec![cdi_device_id(&claim.uid, &d.device)],
                uuid: d.uuid.clone(),
                admin_access: d.admin_access,
                share_id: d.share_id.clone(),
                memory_share_bytes: d.memory_share.map(|s| s.bytes),
                extra: Default::default(),
            })
            .collect();
        let entry = ClaimEntry {
            state: PrepareState::PrepareStarted,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: devices.clone(),
            sharing: None,
            boot_id: self.settings.boot_id.clone(),
            imported: None,
            dynamic_mig: self
                .entry(&claim.uid)
                .map(|e| e.dynamic_mig)
                .unwrap_or_default(),
            extra: Default::default(),
        };
        self.persist(|cp| {
            cp.claims.insert(claim.uid.clone(), entry);
        })
        .await?;
        self.failpoints
            .hit("prepare.after_checkpoint_started")
            .await?;

        let mut sharing_states = Vec::new();
        let mut sharing_edits: Vec<(usize, gpu_dra_core::cdi::ContainerEdits)> = Vec::new();
        for group in &plan.groups {
            let applied = self.sharing.apply(plan, group).await?;
            if let Some(state) = applied.state {
                sharing_states.push(state);
            }
            for &i in &group.devices {
                sharing_edits.push((i, applied.edits.clone()));
            }
        }
        let sharing = (!sharing_states.is_empty()).then(|| Value::Array(sharing_states));
        if sharing.is_some() {
            let s = sharing.clone();
            self.persist(|cp| {
                if let Some(e) = cp.claims.get_mut(&claim.uid) {
                    e.sharing = s;
                }
            })
            .await?;
        }
        self.failpoints.hit("prepare.after_sharing").await?;

        let mut spec_devices = Vec::with_capacity(plan.devices.len());
        for d in &plan.devices {
            spec_devices.push(SpecDevice {
                device: d.device.clone(),
                node_paths: self.cdi.device_nodes(&d.nodes)?,
            });
        }
        let mut spec = self.cdi.spec(&claim.uid, &spec_devices);
        // A memory share is told to the containers that get its device, whatever the sharing
        // strategy (only MPS enforces it).
        for (d, dev) in plan.devices.iter().zip(spec.devices.iter_mut()) {
            if let Some(share) = &d.memory_share {
                dev.container_edits
                    .env
                    .push(memory_shares::share_env(share));
            }
        }
        // Sharing edits (the MPS pipe directory mount and env) go on the group's devices, so a
        // container gets them exactly when it gets one of those devices.
        for (i, edits) in sharing_edits {
            if let Some(dev) = spec.devices.get_mut(i) {
                let ce = &mut dev.container_edits;
                ce.env.extend(edits.env);
                ce.device_nodes.extend(edits.device_nodes);
                ce.mounts.extend(edits.mounts);
                ce.hooks.extend(edits.hooks);
            }
        }
        let cdi = self.cdi.clone();
        let uid = claim.uid.clone();
        blocking(move || cdi.write(&uid, &spec)).await??;
        self.failpoints.hit("prepare.after_cdi_write").await?;

        self.persist(|cp| {
            if let Some(e) = cp.claims.get_mut(&claim.uid) {
                e.state = PrepareState::PrepareCompleted;
            }
        })
        .await?;
        self.metrics.prepared_devices.inc_by(devices.len() as i64);
        self.failpoints
            .hit("prepare.after_checkpoint_completed")
            .await?;
        Ok(devices)
    }

    /// Undoes a claim's effects (sharing, spec, MIG instances, entry) with its lock held; with
    /// [`Rollback::KeepMig`] the entry stays, half prepared, with its MIG instances only.
    async fn rollback_locked(&self, uid: &str, how: Rollback) -> Result<(), DriverError> {
        let entry = self.entry(uid);
        if let Some(e) = &entry {
            self.release_sharing(uid, e.sharing.as_ref()).await?;
            if let Some(imported) = &e.imported {
                self.sharing.release_imported(uid, imported).await?;
            }
        }
        self.failpoints.hit("unprepare.after_sharing").await?;
        let cdi = self.cdi.clone();
        let owned = uid.to_owned();
        // NVIDIA's spec of an imported claim too (also without an entry: a crash may have
        // removed the entry's sharing but not yet the file).
        blocking(move || cdi.remove(&owned).and_then(|()| cdi.remove_nvidia(&owned))).await??;
        self.failpoints.hit("unprepare.after_cdi_remove").await?;
        if let Some(e) = entry {
            let keep_mig = how == Rollback::KeepMig && !e.dynamic_mig.is_empty();
            if !keep_mig && !e.dynamic_mig.is_empty() {
                self.destroy_instances(uid, &e.dynamic_mig).await?;
            }
            self.persist(|cp| {
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
            if e.state == PrepareState::PrepareCompleted {
                self.metrics.prepared_devices.dec_by(e.devices.len() as i64);
            }
        }
        self.release_devices(uid);
        self.failpoints.hit("unprepare.after_checkpoint").await?;
        Ok(())
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

    /// Unprepares one claim; an unknown claim succeeds.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), DriverError> {
        let started = Instant::now();
        self.metrics.in_flight.inc();
        let result = async {
            self.failpoints.hit("unprepare.start").await?;
            let user = self.claim_locks.join(&claim.uid);
            let _guard = user.lock().await;
            self.rollback_locked(&claim.uid, Rollback::All).await
        }
        .await;
        self.metrics.in_flight.dec();
        self.metrics
            .observe("unprepare", started.elapsed().as_secs_f64(), result.is_ok());
        match &result {
            Ok(()) => {
                self.inventory.forget(&claim.uid);
                info!(claim.uid = %claim.uid, "unprepared");
            }
            Err(e) => warn!(claim.uid = %claim.uid, error = %e, "unprepare failed"),
        }
        result
    }

    /// Brings checkpoint, CDI files and the API server in line: rolls back half-prepared
    /// claims, removes spec files of claims the checkpoint does not know, and unprepares
    /// claims that no longer exist (by UID) in the API server. Run at start and periodically.
    pub async fn reconcile(&self) {
        let entries: Vec<(String, ClaimEntry)> = lock(&self.state)
            .doc
            .claims
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (uid, entry) in &entries {
            if entry.state == PrepareState::PrepareStarted {
                let user = self.claim_locks.join(uid);
                // A prepare in flight holds the lock; it finishes or rolls back by itself.
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self
                    .entry(uid)
                    .is_some_and(|e| e.state == PrepareState::PrepareStarted)
                {
                    info!(claim.uid = %uid, "rolling back half-prepared claim");
                    if let Err(e) = self.rollback_locked(uid, Rollback::All).await {
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
            if self.entry(&uid).is_none() {
                let user = self.claim_locks.join(&uid);
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self.entry(&uid).is_none() {
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
    use super::*;
    use crate::claims::MemoryClaims;
    use crate::testing::{DriverBuilder, allocated_claim, simulate_host};
    use gpu_dra_device::testing::a100_inventory;
    use serde_json::json;

    const DRIVER: &str = "gpu.nvidia.com";
    const NODE: &str = "node-a";

    struct Env {
        dir: tempfile::TempDir,
        claims: Arc<MemoryClaims>,
        driver: Arc<Driver>,
    }

    fn driver_in(dir: &Path, claims: Arc<MemoryClaims>) -> Driver {
        DriverBuilder::new(dir, a100_inventory(4, 1))
            .node_name(NODE)
            .claims(claims)
            .checkpoint_path(dir.join(gpu_dra_core::checkpoint::FILE_NAME))
            .build()
            .expect("driver")
    }

    use std::path::Path;

    fn env() -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
        let claims = Arc::new(MemoryClaims::default());
        let driver = Arc::new(driver_in(dir.path(), claims.clone()));
        Env {
            dir,
            claims,
            driver,
        }
    }

    fn add(env: &Env, name: &str, uid: &str, devices: &[(&str, &str)]) -> ClaimRef {
        env.claims
            .insert(allocated_claim("ns", name, uid, DRIVER, NODE, devices, &[]));
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    fn spec_path(env: &Env, uid: &str) -> std::path::PathBuf {
        env.dir
            .path()
            .join("cdi")
            .join(gpu_dra_core::cdi::spec_file_name(uid))
    }

    fn on_disk(env: &Env) -> Checkpoint {
        Checkpoint::from_json(
            &std::fs::read(env.dir.path().join(gpu_dra_core::checkpoint::FILE_NAME)).expect("file"),
        )
        .expect("valid")
    }

    #[tokio::test]
    async fn prepare_writes_a_valid_spec_is_idempotent_and_unprepare_cleans_up() {
        let env = env();
        let c = add(
            &env,
            "a",
            "uid-a",
            &[
                ("gpu", "gpu-1"),
                ("mig", "gpu-0-mig-1g5gb-19-0"),
                ("mig", "gpu-0-mig-1g5gb-19-1"),
            ],
        );
        let devices = env.driver.prepare(&c).await.expect("prepares");
        assert_eq!(devices.len(), 3);
        assert_eq!(
            devices[0].cdi_device_ids,
            ["k8s.gpu.nvidia.com/claim=uid-a-gpu-1"]
        );
        assert_eq!(devices[0].pool, NODE);

        let path = spec_path(&env, "uid-a");
        let mut spec =
            container_device_interface::spec::read_spec(&path, 0).expect("CDI crate reads it");
        let cdi_devices = spec.validate().expect("CDI crate validates it");
        assert_eq!(cdi_devices.len(), 3);
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("spec")).expect("json");
        // Two MIG devices of GPU 0: each has the parent node and its own capability nodes.
        let nodes = |i: usize| -> Vec<String> {
            raw["devices"][i]["containerEdits"]["deviceNodes"]
                .as_array()
                .expect("nodes")
                .iter()
                .map(|n| n["path"].as_str().expect("path").to_owned())
                .collect()
        };
        assert_eq!(nodes(1)[0], "/dev/nvidia0");
        assert_eq!(nodes(2)[0], "/dev/nvidia0");
        assert_eq!(nodes(1).len(), 3);
        assert_ne!(nodes(1)[1..], nodes(2)[1..]);
        assert!(
            raw["containerEdits"]["mounts"]
                .as_array()
                .expect("mounts")
                .iter()
                .any(|m| m["containerPath"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
        );

        let cp = on_disk(&env);
        assert_eq!(cp.claims["uid-a"].state, PrepareState::PrepareCompleted);
        // Repeat: same answer, no new work even if the claim vanished from the API server.
        env.claims.remove("ns", "a");
        assert_eq!(env.driver.prepare(&c).await.expect("repeat"), devices);

        env.driver.unprepare(&c).await.expect("unprepares");
        assert!(!path.exists());
        assert!(on_disk(&env).claims.is_empty());
        env.driver
            .unprepare(&c)
            .await
            .expect("unknown claim unprepare succeeds");
    }

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

        let mut admin = allocated_claim("ns", "c", "uid-c", DRIVER, NODE, &[("gpu", "gpu-2")], &[]);
        let mut admin2 =
            allocated_claim("ns", "d", "uid-d", DRIVER, NODE, &[("gpu", "gpu-2")], &[]);
        for c in [&mut admin, &mut admin2] {
            if let Some(r) = c
                .status
                .as_mut()
                .and_then(|s| s.allocation.as_mut())
                .and_then(|a| a.devices.as_mut())
                .and_then(|d| d.results.as_mut())
            {
                r[0].admin_access = Some(true);
            }
            env.claims.insert(c.clone());
        }
        for (name, uid) in [("c", "uid-c"), ("d", "uid-d")] {
            let r = ClaimRef {
                namespace: "ns".into(),
                name: name.into(),
                uid: uid.into(),
            };
            env.driver.prepare(&r).await.expect("admin access overlaps");
        }
    }

    #[tokio::test]
    async fn concurrent_prepares_of_one_claim_prepare_it_once() {
        let env = env();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-3")]);
        let (x, y) = tokio::join!(env.driver.prepare(&a), env.driver.prepare(&a));
        assert_eq!(x.expect("x"), y.expect("y"));
        assert_eq!(on_disk(&env).claims.len(), 1);
    }

    #[tokio::test]
    async fn missing_device_node_fails_without_leaving_a_spec_or_a_reservation() {
        let env = env();
        std::fs::remove_file(env.dir.path().join("host/dev/nvidia2")).expect("rm");
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-2")]);
        let err = env
            .driver
            .prepare(&a)
            .await
            .expect_err("missing node")
            .to_string();
        assert!(
            err.contains("dev/nvidia2") && err.contains("missing"),
            "{err}"
        );
        assert!(!spec_path(&env, "uid-a").exists());
        assert!(on_disk(&env).claims.is_empty());
        std::fs::write(env.dir.path().join("host/dev/nvidia2"), "").expect("restore");
        env.driver.prepare(&a).await.expect("retry works");
    }

    #[tokio::test]
    async fn errors_are_clear_for_unallocated_replaced_and_sharing_claims() {
        let env = env();
        let mut c = allocated_claim("ns", "u", "uid-u", DRIVER, NODE, &[], &[]);
        c.status = None;
        env.claims.insert(c);
        let r = ClaimRef {
            namespace: "ns".into(),
            name: "u".into(),
            uid: "uid-u".into(),
        };
        assert!(
            env.driver
                .prepare(&r)
                .await
                .expect_err("unallocated")
                .to_string()
                .contains("not allocated")
        );
        let r2 = ClaimRef {
            uid: "uid-old".into(),
            ..r.clone()
        };
        assert!(
            env.driver
                .prepare(&r2)
                .await
                .expect_err("replaced")
                .to_string()
                .contains("replaced")
        );
        let missing = ClaimRef {
            name: "nope".into(),
            ..r
        };
        assert!(
            env.driver
                .prepare(&missing)
                .await
                .expect_err("missing")
                .to_string()
                .contains("not found")
        );

        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing"}});
        env.claims.insert(allocated_claim(
            "ns",
            "t",
            "uid-t",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[("FromClaim", &[], ts)],
        ));
        let t = ClaimRef {
            namespace: "ns".into(),
            name: "t".into(),
            uid: "uid-t".into(),
        };
        let err = env
            .driver
            .prepare(&t)
            .await
            .expect_err("sharing")
            .to_string();
        assert!(err.contains("sharing not enabled in this build"), "{err}");
        assert!(
            on_disk(&env).claims.is_empty(),
            "failed prepare leaves no entry"
        );
    }

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

    /// A sharing executor that applies nothing and records every call.
    #[derive(Default)]
    struct Recording(Mutex<Vec<String>>);

    impl Recording {
        fn calls(&self) -> Vec<String> {
            lock(&self.0).clone()
        }
    }

    impl SharingExecutor for Recording {
        fn apply<'a>(
            &'a self,
            plan: &'a Plan,
            group: &'a gpu_dra_core::plan::SharingGroup,
        ) -> futures::future::BoxFuture<'a, Result<crate::sharing::Applied, SharingError>> {
            lock(&self.0).push(format!("apply {}", plan.claim_uid));
            let state = group.sharing.as_ref().map(|_| json!({"group": "c0"}));
            Box::pin(async move {
                Ok(crate::sharing::Applied {
                    state,
                    edits: Default::default(),
                })
            })
        }

        fn release<'a>(
            &'a self,
            claim_uid: &'a str,
            _state: Option<&'a Value>,
        ) -> futures::future::BoxFuture<'a, Result<(), SharingError>> {
            lock(&self.0).push(format!("release {claim_uid}"));
            Box::pin(async { Ok(()) })
        }

        fn release_imported<'a>(
            &'a self,
            claim_uid: &'a str,
            imported: &'a gpu_dra_core::checkpoint::Imported,
        ) -> futures::future::BoxFuture<'a, Result<(), SharingError>> {
            lock(&self.0).push(format!(
                "release_imported {claim_uid} timesliced={} mps={}",
                imported.time_sliced_gpus.join(","),
                imported.mps_control_daemons.join(",")
            ));
            Box::pin(async { Ok(()) })
        }
    }

    const BOOT_1: &str = "1b7a3c2e-5d4f-4a6b-9c8d-0e1f2a3b4c5d";
    const BOOT_2: &str = "2c8b4d3f-6e5a-4b7c-8d9e-1f2a3b4c5d6e";

    fn recording_driver(
        dir: &Path,
        claims: Arc<MemoryClaims>,
        sharing: Arc<Recording>,
        boot: &str,
    ) -> Driver {
        DriverBuilder::new(dir, a100_inventory(4, 1))
            .node_name(NODE)
            .claims(claims)
            .checkpoint_path(dir.join(gpu_dra_core::checkpoint::FILE_NAME))
            .sharing(sharing)
            .boot_id(boot)
            .build()
            .expect("driver")
    }

    fn time_sliced_claim(env: &Env, name: &str, uid: &str, device: &str) -> ClaimRef {
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}});
        env.claims.insert(allocated_claim(
            "ns",
            name,
            uid,
            DRIVER,
            NODE,
            &[("gpu", device)],
            &[("FromClaim", &["gpu"], ts)],
        ));
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[tokio::test]
    async fn same_boot_and_spec_present_answers_from_the_checkpoint_without_side_effects() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        assert_eq!(
            on_disk(&env).claims["uid-a"].boot_id.as_deref(),
            Some(BOOT_1)
        );
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        std::fs::write(spec_path(&env, "uid-a"), b"marker").expect("mark");
        env.claims.remove("ns", "a");

        let restarted =
            recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        assert_eq!(restarted.prepare(&c).await.expect("repeat"), first);
        assert_eq!(sharing.calls(), ["apply uid-a"], "sharing applied once");
        assert_eq!(
            std::fs::read(spec_path(&env, "uid-a")).expect("spec"),
            b"marker",
            "the spec is not rewritten"
        );
        assert_ne!(spec, b"marker");
    }

    #[tokio::test]
    async fn a_missing_spec_is_regenerated_by_the_repeat_prepare_with_the_same_answer() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        // The CDI root is a tmpfs that was emptied.
        std::fs::remove_dir_all(env.dir.path().join("cdi")).expect("wipe");

        assert_eq!(driver.prepare(&c).await.expect("repeat"), first);
        assert_eq!(
            std::fs::read(spec_path(&env, "uid-a")).expect("spec back"),
            spec
        );
        assert_eq!(
            sharing.calls(),
            ["apply uid-a", "release uid-a", "apply uid-a"],
            "sharing undone and applied again"
        );
        let cp = on_disk(&env);
        assert_eq!(cp.claims["uid-a"].state, PrepareState::PrepareCompleted);
        assert_eq!(cp.claims["uid-a"].devices, first);
    }

    #[tokio::test]
    async fn after_a_reboot_sharing_is_reapplied_and_the_spec_rewritten() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        std::fs::write(spec_path(&env, "uid-a"), b"old boot").expect("mark");

        let rebooted =
            recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_2);
        assert_eq!(rebooted.prepare(&c).await.expect("repeat"), first);
        assert_eq!(
            sharing.calls(),
            ["apply uid-a", "release uid-a", "apply uid-a"]
        );
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        assert_ne!(spec, b"old boot", "spec rewritten");
        assert_eq!(
            on_disk(&env).claims["uid-a"].boot_id.as_deref(),
            Some(BOOT_2)
        );
        // Now current: the next repeat is answered from the checkpoint.
        assert_eq!(rebooted.prepare(&c).await.expect("again"), first);
        assert_eq!(sharing.calls().len(), 3);
    }

    const NVIDIA_V2: &str = include_str!("../../core/testdata/nvidia-checkpoint-v2.json");
    const NV_TIME_SLICED: &str = "3f0c1b7e-8a55-4d2a-9b61-0c3e5f7a9d11";
    const NV_MPS: &str = "7c4d1e55-2a6b-4f9e-b8d1-7cae3f5b9b33";
    const NV_STARTED: &str = "9e6f3a77-4c8d-4b1a-8e2f-9d0b5a7c1d44";
    /// The boot NVIDIA's fixture was written in (`v2.nodeBootID`).
    const NV_BOOT: &str = "c8a1f4de-6b2e-4f0a-9d37-5e81b2c4a6f0";

    fn nvidia_node() -> (Env, Arc<Recording>, Driver) {
        let env = env();
        let legacy = env
            .dir
            .path()
            .join(gpu_dra_core::checkpoint::LEGACY_FILE_NAME);
        std::fs::write(&legacy, NVIDIA_V2).expect("nvidia checkpoint");
        let cdi = env.dir.path().join("cdi");
        std::fs::create_dir_all(&cdi).expect("cdi");
        for uid in [NV_TIME_SLICED, NV_MPS, NV_STARTED] {
            std::fs::write(
                cdi.join(gpu_dra_core::cdi::nvidia_spec_file_name(uid)),
                "cdiVersion: 0.5.0\n",
            )
            .expect("nvidia spec");
        }
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), NV_BOOT);
        (env, sharing, driver)
    }

    fn nvidia_spec(env: &Env, uid: &str) -> std::path::PathBuf {
        env.dir
            .path()
            .join("cdi")
            .join(gpu_dra_core::cdi::nvidia_spec_file_name(uid))
    }

    #[tokio::test]
    async fn claims_nvidia_prepared_are_reserved_and_answered_with_their_devices() {
        let (env, sharing, driver) = nvidia_node();
        assert_eq!(driver.imported_mps_daemons(), [format!("{NV_MPS}-4e1a9")]);
        // gpu-1 is held by NVIDIA's time-sliced claim.
        let other = add(&env, "other", "uid-other", &[("gpu", "gpu-1")]);
        let err = driver.prepare(&other).await.expect_err("held").to_string();
        assert!(
            err.contains(NV_TIME_SLICED) && err.contains("team-a/train"),
            "{err}"
        );

        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: NV_TIME_SLICED.into(),
        };
        let devices = driver.prepare(&c).await.expect("answered");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_TIME_SLICED}-gpu-1")]
        );
        assert_eq!(devices[0].device, "gpu-1");
        assert!(sharing.calls().is_empty(), "answered without side effects");
        assert!(
            !spec_path(&env, NV_TIME_SLICED).exists(),
            "NVIDIA's spec serves it"
        );
    }

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

    #[tokio::test]
    async fn an_imported_claim_whose_spec_is_gone_is_prepared_again_by_us() {
        let (env, _sharing, driver) = nvidia_node();
        std::fs::remove_file(nvidia_spec(&env, NV_TIME_SLICED)).expect("wipe");
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}});
        env.claims.insert(allocated_claim(
            "team-a",
            "train",
            NV_TIME_SLICED,
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[("FromClaim", &["gpu"], ts)],
        ));
        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: NV_TIME_SLICED.into(),
        };
        let devices = driver.prepare(&c).await.expect("prepared again");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_TIME_SLICED}-gpu-1")]
        );
        assert!(spec_path(&env, NV_TIME_SLICED).exists());
        let entry = &driver.checkpoint().claims[NV_TIME_SLICED];
        assert!(entry.imported.is_none(), "ours from now on");
        assert_eq!(entry.boot_id.as_deref(), Some(NV_BOOT));
    }

    /// A claim source that holds every `get` until the test lets it through, and records how
    /// many run at once: a prepare calls `get` with its claim's lock held, so two at once for
    /// one claim mean two operations on it at once.
    struct GatedClaims {
        inner: Arc<MemoryClaims>,
        permits: tokio::sync::Semaphore,
        entered: tokio::sync::mpsc::UnboundedSender<()>,
        now: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    impl ClaimSource for GatedClaims {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> futures::future::BoxFuture<
            'a,
            Result<Option<k8s_openapi::api::resource::v1::ResourceClaim>, ClaimSourceError>,
        > {
            use std::sync::atomic::Ordering::SeqCst;
            Box::pin(async move {
                let now = self.now.fetch_add(1, SeqCst) + 1;
                self.most.fetch_max(now, SeqCst);
                let _ = self.entered.send(());
                let permit = self.permits.acquire().await;
                permit.map(|p| p.forget()).ok();
                self.now.fetch_sub(1, SeqCst);
                self.inner.get(namespace, name).await
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_claim_never_has_two_operations_at_once_while_others_wait_for_its_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
        let memory = Arc::new(MemoryClaims::default());
        memory.insert(allocated_claim(
            "ns",
            "a",
            "uid-a",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[],
        ));
        let (entered, mut entries) = tokio::sync::mpsc::unbounded_channel();
        let gated = Arc::new(GatedClaims {
            inner: memory,
            permits: tokio::sync::Semaphore::new(0),
            entered,
            now: Default::default(),
            most: Default::default(),
        });
        let driver = Arc::new(
            DriverBuilder::new(dir.path(), a100_inventory(4, 1))
                .node_name(NODE)
                .claims(gated.clone())
                .checkpoint_path(dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
                .build()
                .expect("driver"),
        );
        let a = ClaimRef {
            namespace: "ns".into(),
            name: "a".into(),
            uid: "uid-a".into(),
        };
        let spawn = |op: &'static str| {
            let (driver, a) = (driver.clone(), a.clone());
            tokio::spawn(async move {
                match op {
                    "prepare" => driver.prepare(&a).await.map(drop),
                    _ => driver.unprepare(&a).await,
                }
            })
        };
        // An operation counts itself in flight and waits for the claim's lock in one step:
        // once the gauge shows it, it is queued.
        let queued = |n: i64| {
            let driver = driver.clone();
            async move {
                while driver.metrics().in_flight.get() < n {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            }
        };
        // A prepare holds the claim's lock inside `get`; an unprepare and then a second
        // prepare queue behind it, in that order.
        let first = spawn("prepare");
        entries.recv().await.expect("first prepare reads the claim");
        let unprepare = spawn("unprepare");
        queued(2).await;
        let second = spawn("prepare");
        queued(3).await;
        gated.permits.add_permits(1);
        first.await.expect("joins").expect("first prepare");
        // The unprepare runs and finishes; the second prepare now holds the lock in `get`.
        unprepare.await.expect("joins").expect("unprepare");
        entries
            .recv()
            .await
            .expect("second prepare reads the claim");
        // A third operation must wait for the second instead of running beside it.
        let third = spawn("prepare");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        gated.permits.add_permits(2);
        second.await.expect("joins").expect("second prepare");
        third.await.expect("joins").expect("third prepare");
        assert_eq!(
            gated.most.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "two operations ran on one claim at once"
        );
        assert!(
            driver.claim_locks.is_empty(),
            "no lock is kept once no one uses it"
        );
    }

    #[tokio::test]
    async fn a_failed_prepare_that_is_never_unprepared_leaves_no_lock_behind() {
        let env = env();
        let missing = ClaimRef {
            namespace: "ns".into(),
            name: "nope".into(),
            uid: "uid-nope".into(),
        };
        env.driver.prepare(&missing).await.expect_err("not found");
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        env.driver.prepare(&a).await.expect("prepares");
        env.driver.reconcile().await;
        assert!(
            env.driver.claim_locks.is_empty(),
            "locks of claims no operation uses are dropped"
        );
    }

    /// `name` with `device` allocated under request `gpu` and `configs`, its one allocation
    /// result changed by `edit`.
    fn add_allocated(
        env: &Env,
        name: &str,
        uid: &str,
        device: &str,
        configs: &[(&str, &[&str], Value)],
        edit: impl FnOnce(&mut k8s_openapi::api::resource::v1::DeviceRequestAllocationResult),
    ) -> ClaimRef {
        let mut c = allocated_claim("ns", name, uid, DRIVER, NODE, &[("gpu", device)], configs);
        if let Some(results) = c
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
        {
            edit(&mut results[0]);
        }
        env.claims.insert(c);
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    /// `name` with `device` allocated under request `gpu` with admin access, and `configs`.
    fn add_admin(
        env: &Env,
        name: &str,
        uid: &str,
        device: &str,
        configs: &[(&str, &[&str], Value)],
    ) -> ClaimRef {
        add_allocated(env, name, uid, device, configs, |r| {
            r.admin_access = Some(true);
        })
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

    #[tokio::test]
    async fn sharing_on_an_admin_access_request_is_refused_naming_the_request() {
        let env = env();
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing"}});
        let c = add_admin(
            &env,
            "watch",
            "uid-watch",
            "gpu-1",
            &[("FromClaim", &["gpu"], ts)],
        );
        let err = env
            .driver
            .prepare(&c)
            .await
            .expect_err("refused")
            .to_string();
        assert_eq!(
            err,
            format!(
                "status.allocation.devices.config[0].opaque.parameters.{}",
                gpu_dra_api::admin_access_sharing("gpu")
            )
        );
        assert!(
            err.contains("\"gpu\"") && err.contains("adminAccess"),
            "{err}"
        );
        assert!(!spec_path(&env, "uid-watch").exists());
        assert!(env.driver.checkpoint().claims.is_empty());
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
}
