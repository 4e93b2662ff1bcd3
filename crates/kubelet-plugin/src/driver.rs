//! Prepare and unprepare: the plugin's state machine over claims, devices, CDI specs and the
//! checkpoint.
//!
//! Invariants:
//! - per claim UID one operation at a time (a per-UID async lock); different claims proceed
//!   concurrently, also within one kubelet call;
//! - a device is held by at most one claim, except when every holder has admin access; the
//!   holder set is rebuilt from the checkpoint at start;
//! - order of effects: checkpoint `PrepareStarted` (with the devices) -> sharing -> CDI spec
//!   -> checkpoint `PrepareCompleted`. Unprepare and rollback undo in reverse (sharing, spec,
//!   entry). So after a crash at any step the checkpoint names every side effect that may
//!   exist, and a retry or the startup reconcile cleans it up;
//! - prepare of a completed claim answers from the checkpoint (idempotent); a claim found
//!   `PrepareStarted` is rolled back first; unprepare of an unknown claim succeeds;
//! - checkpoint writes use group commit: concurrent claims share one atomic write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpu_dra_core::cdi::{SpecDevice, cdi_device_id};
use gpu_dra_core::checkpoint::{Checkpoint, ClaimEntry, PrepareState, PreparedDevice};
use gpu_dra_core::plan::{self, ConfigDecoder, Plan, PlanError};
use gpu_dra_device::Inventory;
use serde_json::Value;
use tracing::{info, warn};

use crate::cdi_io::{CdiError, CdiHost};
use crate::claims::{ClaimSource, ClaimSourceError};
use crate::failpoint::{Failpoints, Fired};
use crate::metrics::Metrics;
use crate::sharing::SharingExecutor;

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
        "device {device} is already prepared for claim {holder} (uid {holder_uid}); a device is prepared for one claim at a time unless all use adminAccess"
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
    #[error("{0}")]
    Sharing(String),
    /// A CDI step failed.
    #[error(transparent)]
    Cdi(#[from] CdiError),
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
    /// Checkpoint file.
    pub checkpoint_path: std::path::PathBuf,
}

struct Holder {
    uid: String,
    claim: String,
    admin: bool,
}

struct CheckpointState {
    doc: Checkpoint,
    /// Bumped on every in-memory change.
    changes: u64,
}

/// The prepare/unprepare engine behind the gRPC services.
pub struct Driver {
    settings: DriverSettings,
    inventory: Arc<Inventory>,
    claims: Arc<dyn ClaimSource>,
    sharing: Arc<dyn SharingExecutor>,
    decoder: Arc<dyn ConfigDecoder + Send + Sync>,
    cdi: Arc<CdiHost>,
    failpoints: Failpoints,
    metrics: Arc<Metrics>,
    state: Mutex<CheckpointState>,
    /// Serializes checkpoint file writes; holds the change count last written.
    writer: tokio::sync::Mutex<u64>,
    claim_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    holders: Mutex<HashMap<String, Vec<Holder>>>,
}

/// Everything the driver is built from.
pub struct DriverParts {
    /// Settings.
    pub settings: DriverSettings,
    /// Node inventory.
    pub inventory: Arc<Inventory>,
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, DriverError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| DriverError::Task(e.to_string()))
}

impl Driver {
    /// Loads the checkpoint (a missing file is an empty checkpoint) and builds the driver.
    pub fn new(parts: DriverParts) -> Result<Self, DriverError> {
        let path = &parts.settings.checkpoint_path;
        let doc = match std::fs::read(path) {
            Ok(bytes) => Checkpoint::from_json(&bytes).map_err(|e| DriverError::Checkpoint {
                path: path.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Checkpoint::new(),
            Err(source) => {
                return Err(DriverError::Checkpoint {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        let mut holders: HashMap<String, Vec<Holder>> = HashMap::new();
        for (uid, entry) in &doc.claims {
            for d in &entry.devices {
                holders.entry(d.device.clone()).or_default().push(Holder {
                    uid: uid.clone(),
                    claim: format!("{}/{}", entry.namespace, entry.name),
                    admin: d.admin_access,
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
            state: Mutex::new(CheckpointState { doc, changes: 0 }),
            writer: tokio::sync::Mutex::new(0),
            claim_locks: Mutex::new(HashMap::new()),
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

    fn claim_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.claim_locks)
            .entry(uid.to_owned())
            .or_default()
            .clone()
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

    fn reserve(&self, claim: &ClaimRef, plan: &Plan) -> Result<(), DriverError> {
        let mut holders = lock(&self.holders);
        for d in &plan.devices {
            if let Some(h) = holders
                .get(&d.device)
                .into_iter()
                .flatten()
                .find(|h| h.uid != claim.uid && !(h.admin && d.admin_access))
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
        let lock = self.claim_lock(&claim.uid);
        let _guard = lock.lock().await;
        match self.entry(&claim.uid) {
            Some(e) if e.state == PrepareState::PrepareCompleted => return Ok(e.devices),
            Some(_) => self.rollback_locked(&claim.uid).await?,
            None => {}
        }
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
        let plan = plan::plan(&input, &self.inventory, self.decoder.as_ref())?;
        self.failpoints.hit("prepare.after_plan").await?;
        self.reserve(claim, &plan)?;
        let result = self.apply_plan(claim, &plan).await;
        if result.is_err() {
            // Undo whatever was done; the checkpoint says what that may be.
            if let Err(e) = self.rollback_locked(&claim.uid).await {
                warn!(claim.uid = %claim.uid, error = %e, "rollback after failed prepare failed");
            }
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
                extra: Default::default(),
            })
            .collect();
        let entry = ClaimEntry {
            state: PrepareState::PrepareStarted,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: devices.clone(),
            sharing: None,
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
        let mut sharing_edits: Vec<(usize, crate::sharing::SharingEdits)> = Vec::new();
        for group in &plan.groups {
            let members: Vec<_> = group
                .devices
                .iter()
                .map(|&i| (i, &plan.devices[i]))
                .collect();
            let applied = self
                .sharing
                .apply(&claim.uid, group, &members)
                .await
                .map_err(DriverError::Sharing)?;
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
        // Sharing edits (MPS pipe and shm mounts, env) go on the group's devices, so a
        // container gets them exactly when it gets one of those devices.
        for (i, edits) in sharing_edits {
            if let Some(dev) = spec.devices.get_mut(i) {
                let ce = &mut dev.container_edits;
                ce.env.extend(edits.env.iter().cloned());
                ce.mounts
                    .extend(edits.mounts.iter().map(|m| gpu_dra_core::cdi::Mount {
                        host_path: m.host_path.display().to_string(),
                        container_path: m.container_path.clone(),
                        options: m.options.clone(),
                    }));
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

    /// Undoes a claim's effects (sharing, spec, entry) with its lock held.
    async fn rollback_locked(&self, uid: &str) -> Result<(), DriverError> {
        let entry = self.entry(uid);
        if let Some(e) = &entry {
            self.release_sharing(uid, e.sharing.as_ref()).await?;
        }
        self.failpoints.hit("unprepare.after_sharing").await?;
        let cdi = self.cdi.clone();
        let owned = uid.to_owned();
        blocking(move || cdi.remove(&owned)).await??;
        self.failpoints.hit("unprepare.after_cdi_remove").await?;
        if let Some(e) = entry {
            self.persist(|cp| {
                cp.claims.remove(uid);
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
                    self.sharing
                        .release(uid, Some(s))
                        .await
                        .map_err(DriverError::Sharing)?;
                }
                Ok(())
            }
            other => self
                .sharing
                .release(uid, other)
                .await
                .map_err(DriverError::Sharing),
        }
    }

    /// Unprepares one claim; an unknown claim succeeds.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), DriverError> {
        let started = Instant::now();
        self.metrics.in_flight.inc();
        let result = async {
            self.failpoints.hit("unprepare.start").await?;
            let lock = self.claim_lock(&claim.uid);
            let _guard = lock.lock().await;
            self.rollback_locked(&claim.uid).await
        }
        .await;
        self.metrics.in_flight.dec();
        self.metrics
            .observe("unprepare", started.elapsed().as_secs_f64(), result.is_ok());
        match &result {
            Ok(()) => info!(claim.uid = %claim.uid, "unprepared"),
            Err(e) => warn!(claim.uid = %claim.uid, error = %e, "unprepare failed"),
        }
        if result.is_ok() {
            lock(&self.claim_locks).remove(&claim.uid);
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
                let lock = self.claim_lock(uid);
                // A prepare in flight holds the lock; it finishes or rolls back by itself.
                let Ok(_guard) = lock.try_lock() else {
                    continue;
                };
                if self
                    .entry(uid)
                    .is_some_and(|e| e.state == PrepareState::PrepareStarted)
                {
                    info!(claim.uid = %uid, "rolling back half-prepared claim");
                    if let Err(e) = self.rollback_locked(uid).await {
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
        for uid in self.cdi.list() {
            if self.entry(&uid).is_none() {
                let lock = self.claim_lock(&uid);
                let Ok(_guard) = lock.try_lock() else {
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
            .checkpoint_path(dir.join("checkpoint.json"))
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
        Checkpoint::from_json(&std::fs::read(env.dir.path().join("checkpoint.json")).expect("file"))
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
        std::fs::write(env.dir.path().join("checkpoint.json"), cp.to_json()).expect("write");
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
}
