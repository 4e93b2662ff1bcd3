//! The prepare/unprepare engine behind the gRPC services: the plugin's state machine over
//! claims, devices, CDI specs and the checkpoint.
//!
//! By role:
//! - [`prepare`]: the kubelet's prepare call, from the claim to the answered CDI IDs;
//! - [`unprepare`]: the kubelet's unprepare call and `unprepare_locked`, the one path that
//!   undoes a claim (unprepare, a failed or stale prepare, the cleanup);
//! - [`holders`]: which prepared claims hold which device, and who may share one;
//! - [`journal`]: the checkpoint in memory and its group-committed writes: a record appended
//!   to the checkpoint's journal per commit, folded into the checkpoint when idle, at start
//!   and at a graceful stop ([`Driver::compact_checkpoint`]);
//! - [`reconcile`]: the cleanup at start and periodically ([`ClaimCleanup`]);
//! - [`dynamic`]: the MIG instances of dynamic MIG devices;
//! - [`respec`]: specs rewritten for a driver upgraded in place.
//!
//! Invariants that span them:
//! - per claim UID one operation at a time (a per-UID async lock, kept only while an
//!   operation holds or waits for it: [`crate::claim_locks`]); different claims proceed
//!   concurrently, also within one kubelet call;
//! - order of effects: checkpoint `PrepareStarted` (with the devices) -> sharing -> device
//!   metadata files -> CDI spec -> checkpoint `PrepareCompleted`. Unprepare and rollback undo
//!   in reverse (sharing, spec, metadata files, entry). So after a crash at any step the
//!   checkpoint names every side effect that may exist, besides a CDI spec and metadata files
//!   (files of a claim no entry names are stray: the reconcile removes them, and undoing a
//!   claim removes its files by UID alone), and a retry or the startup reconcile cleans it
//!   up; a spec never names a metadata file that is not there. Hence `PrepareStarted` is durable only
//!   when sharing follows it, and spec writes and removals skip the directory fsync
//!   ([`crate::cdi_io`]);
//! - the holder table and the checkpoint agree: it is rebuilt from the checkpoint at start, a
//!   claim is reserved before its entry is written and released once its entry is gone;
//! - claims imported from NVIDIA's driver ([`crate::checkpoint_file`]) are answered and
//!   reserved like ours; undoing one removes NVIDIA's spec file for it and resets the
//!   time-slicing NVIDIA applied (through [`SharingExecutor::release_imported`]);
//! - a claim's dynamic MIG devices get their MIG instances before anything else: the intent
//!   is in the checkpoint before an instance is created, and unprepare and every rollback
//!   destroy them after the CDI spec is gone (see [`dynamic`]).

mod dynamic;
#[cfg(test)]
mod fixtures;
mod holders;
mod journal;
#[cfg(test)]
mod metadata_tests;
mod prepare;
mod reconcile;
mod respec;
mod unprepare;

pub use self::reconcile::{ClaimCleanup, CleanupPass, CleanupPolicy};

use std::sync::{Arc, Mutex};

use gpu_dra_core::checkpoint::{Checkpoint, PrepareState};
use gpu_dra_core::plan::{ConfigDecoder, PlanError};

use self::holders::Holders;
use self::journal::Journal;
pub use self::journal::durable_checkpoint;
use crate::cdi_io::{CdiError, CdiHost};
use crate::checkpoint_file::CheckpointFileError;
use crate::claim_locks::ClaimLocks;
use crate::claim_status::ClaimStatusSink;
use crate::claims::{ClaimSource, ClaimSourceError};
pub use crate::device_metadata::DeviceMetadataSettings;
use crate::device_metadata::{MetadataFiles, MetadataIoError};
use crate::failpoint::{Failpoints, Fired};
use crate::inventory::{LiveInventory, ResolveError};
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
    /// The claim's device metadata cannot be made (its pod claim name annotation).
    #[error(transparent)]
    Metadata(#[from] gpu_dra_core::device_metadata::MetadataError),
    /// Writing or removing a device metadata file failed.
    #[error(transparent)]
    MetadataIo(#[from] MetadataIoError),
    /// Reading the checkpoint at start failed (or it is not a checkpoint of ours), or writing
    /// it failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointFileError),
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
    /// Device metadata files ([`crate::device_metadata`]).
    pub device_metadata: DeviceMetadataSettings,
}

/// The prepare/unprepare engine behind the gRPC services.
pub struct Driver {
    settings: DriverSettings,
    inventory: Arc<LiveInventory>,
    claims: Arc<dyn ClaimSource>,
    sharing: Arc<dyn SharingExecutor>,
    decoder: Arc<dyn ConfigDecoder + Send + Sync>,
    cdi: Arc<CdiHost>,
    /// The device metadata files (in `settings.device_metadata.dir`).
    metadata: Arc<MetadataFiles>,
    failpoints: Failpoints,
    metrics: Arc<Metrics>,
    mig: Arc<dyn MigControl>,
    claim_status: Option<Arc<dyn ClaimStatusSink>>,
    node_events: Option<Arc<dyn crate::node_events::NodeEvents>>,
    /// Held while MIG instances are recorded and created, destroyed, or swept, so that a
    /// sweep never sees an instance without the checkpoint record that owns it.
    mig_lock: tokio::sync::Mutex<()>,
    journal: Journal,
    claim_locks: ClaimLocks,
    holders: Mutex<Holders>,
    /// MPS daemon pods of an older shape already reported as kept for their clients.
    reshape_reported: Mutex<std::collections::BTreeSet<String>>,
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
    /// Told of every prepared and unprepared claim, for the claims' `status.devices`
    /// ([`crate::claim_status`]); `None`: no status is written.
    pub claim_status: Option<Arc<dyn ClaimStatusSink>>,
    /// Where findings about the node that need a person go ([`crate::node_events`]); `None`:
    /// the log only.
    pub node_events: Option<Arc<dyn crate::node_events::NodeEvents>>,
}

/// Counts an operation in `gpu_dra_requests_in_flight` until dropped: also when the kubelet
/// cancels its call and the operation's future is dropped where it waits.
struct InFlight<'a>(&'a Metrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

impl Driver {
    fn in_flight(&self) -> InFlight<'_> {
        self.metrics.in_flight.inc();
        InFlight(&self.metrics)
    }
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
    /// Loads the checkpoint (a missing file is an empty checkpoint; its journal's records are
    /// replayed over it and folded into it; see [`crate::checkpoint_file`] for the migration
    /// and the import of NVIDIA's) and builds the driver.
    pub fn new(parts: DriverParts) -> Result<Self, DriverError> {
        let journal = Journal::open(parts.settings.checkpoint_path.clone())?;
        let doc = journal.read(Checkpoint::clone);
        let holders = Holders::from_checkpoint(&doc);
        let prepared: usize = doc
            .claims
            .values()
            .filter(|e| e.state == PrepareState::PrepareCompleted)
            .map(|e| e.devices.len())
            .sum();
        parts.metrics.prepared_devices.set(prepared as i64);
        parts
            .metrics
            .nvidia
            .identify(&parts.settings.driver_name, &parts.settings.node_name);
        let driver = Driver {
            metadata: Arc::new(MetadataFiles::new(
                parts.settings.device_metadata.dir.clone(),
            )),
            journal: journal.counted_in(parts.metrics.clone()),
            settings: parts.settings,
            inventory: parts.inventory,
            claims: parts.claims,
            sharing: parts.sharing,
            decoder: parts.decoder,
            cdi: parts.cdi,
            failpoints: parts.failpoints,
            metrics: parts.metrics,
            mig: parts.mig,
            claim_status: parts.claim_status,
            node_events: parts.node_events,
            mig_lock: tokio::sync::Mutex::new(()),
            claim_locks: ClaimLocks::default(),
            holders: Mutex::new(holders),
            reshape_reported: Mutex::default(),
        };
        // Before anything is published: the instances of prepared claims' dynamic devices
        // are left to their placements.
        driver.share_dynamic_devices();
        Ok(driver)
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The driver name.
    pub fn driver_name(&self) -> &str {
        &self.settings.driver_name
    }

    /// Folds the checkpoint's journal into the checkpoint file, so that the file alone is
    /// exact (for an older version after a downgrade): at a graceful stop, once no call is
    /// served any more.
    pub async fn compact_checkpoint(&self) -> Result<(), DriverError> {
        self.journal.compact().await
    }

    /// A copy of the checkpoint as it is in memory.
    pub fn checkpoint(&self) -> Checkpoint {
        self.journal.read(Checkpoint::clone)
    }

    /// IDs of the MPS control daemons of claims imported from NVIDIA's driver: their
    /// directories under `<plugin-dir>/mps` are NVIDIA's, not strays of ours.
    pub fn imported_mps_daemons(&self) -> Vec<String> {
        self.journal.read(|doc| {
            doc.claims
                .values()
                .filter_map(|e| e.imported.as_ref())
                .flat_map(|i| i.mps_control_daemons.iter().cloned())
                .collect()
        })
    }
}
