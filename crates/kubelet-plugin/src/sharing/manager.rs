//! The sharing manager: applies and undoes time-slicing and MPS for claims, supervises the MPS
//! control daemons, and recovers both after a plugin restart.
//!
//! Ordering rules (why the state is saved where it is):
//! - Before any change on the node the state records it (a time-slice claim, an MPS record in
//!   phase `Starting`), so a crash leaves something recovery can find and undo.
//! - A daemon's pid is saved right after it is spawned; if the plugin dies before that, the
//!   daemon is still found through `/proc` by its pipe directory.
//! - Only after the daemon answered with its limits applied is the record `Ready`: that is the
//!   point at which prepare returns success.
//! - Unprepare marks the record `Stopping` and removes it only once the daemon is gone, the
//!   compute mode restored and the directories removed; repeating it is always safe.
//!
//! After a reboot (the node's boot ID differs from the one the state was saved with) nothing
//! recorded is real any more: daemons are gone, compute modes and time-slices are back to
//! their defaults, and a recorded pid may now be an unrelated process. Recovery then forgets
//! every record without signalling anything and removes the daemons' directories as strays;
//! the kubelet's next prepare of each claim applies sharing again (the driver notices the
//! reboot through the boot ID in its own checkpoint).
//!
//! The manager is split by concern: [`super::timeslice`] (time-slice settings and their
//! reference counts), [`super::supervise`] (MPS daemons: start, watch, restart, stop) and
//! [`super::recovery`] (what a restarted plugin finds). The pure parts are in
//! `gpu_dra_core::sharing`.
//!
//! Directories of MPS daemons that NVIDIA's driver started for claims imported from it live
//! in the same `<plugin-dir>/mps` folder; [`SharingManager::keep_foreign_dirs`] names them
//! so recovery leaves them alone.
//!
//! Time-slice changes are serialized by one lock (they are quick `nvidia-smi` calls, and the
//! "last claim out resets the GPU" decision must not race a new claim setting it). MPS daemons
//! of different claims start concurrently.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpu_dra_api::Sharing;
use gpu_dra_core::cdi::ContainerEdits;
use gpu_dra_core::sharing::SharedDevice;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::error::SharingError;
use super::pod_watch::PodWatch;
use super::pods::PodDaemons;
use super::state::{SharingState, SharingStore};
use super::supervise::Supervised;
use super::tools::DriverRoot;

/// Tunables of the manager; [`SharingOptions::new`] gives production defaults.
#[derive(Debug, Clone)]
pub struct SharingOptions {
    /// Where the driver tools come from.
    pub driver_root: DriverRoot,
    /// The plugin directory; MPS daemons live under `<plugin-dir>/mps/<claimUID>-<group>`.
    pub plugin_dir: PathBuf,
    /// Limit for one `nvidia-smi` or MPS client call.
    pub tool_timeout: Duration,
    /// How long a new daemon has to answer with its limits applied.
    pub mps_ready_timeout: Duration,
    /// How long `quit` may take before the daemon is killed.
    pub mps_quit_timeout: Duration,
    /// First delay before restarting a crashed daemon; doubled per consecutive crash.
    pub restart_backoff_initial: Duration,
    /// Largest restart delay.
    pub restart_backoff_max: Duration,
    /// How often an adopted daemon process (not our child) is checked for liveness; daemons in
    /// pods are watched, not polled ([`super::pod_watch`]).
    pub liveness_interval: Duration,
    /// The node's current boot ID (`None`: unknown; reboots are then not detected here).
    pub boot_id: Option<String>,
    /// MPS daemons run on GPUs left in the compute mode they are in, instead of being set to
    /// `EXCLUSIVE_PROCESS` (and back to `DEFAULT` after). NVIDIA's MPS documentation
    /// recommends exclusive mode but does not require it: clients of one daemon share the GPU
    /// in `DEFAULT` mode too, only processes outside MPS are not kept off it. For hosts whose
    /// settings must not change (`selftest --leave-settings`); the plugin itself never sets it.
    pub leave_compute_mode: bool,
}

impl SharingOptions {
    /// Production defaults for a driver root and plugin directory.
    pub fn new(driver_root: DriverRoot, plugin_dir: impl Into<PathBuf>) -> Self {
        Self {
            driver_root,
            plugin_dir: plugin_dir.into(),
            tool_timeout: Duration::from_secs(10),
            mps_ready_timeout: Duration::from_secs(10),
            mps_quit_timeout: Duration::from_secs(5),
            restart_backoff_initial: Duration::from_millis(200),
            restart_backoff_max: Duration::from_secs(30),
            liveness_interval: Duration::from_millis(250),
            boot_id: None,
            leave_compute_mode: false,
        }
    }

    /// The folder under which every MPS daemon keeps its pipe and log directories.
    pub(super) fn mps_root(&self) -> PathBuf {
        crate::node_layout::mps_root_in(&self.plugin_dir)
    }

    /// The folder of the daemon of `owner` (a claim UID) and `group`.
    pub(super) fn daemon_dir(&self, owner: &str, group: &str) -> PathBuf {
        self.mps_root()
            .join(gpu_dra_core::sharing::daemon_dir_name(owner, group))
    }
}

/// Metrics of the sharing module.
#[derive(Debug, Clone, Default)]
pub struct SharingMetrics {
    /// Crashed MPS control daemons restarted (`gpu_dra_mps_daemon_restarts_total`).
    pub mps_daemon_restarts: Counter,
    /// Daemon pods of an older shape still running (`gpu_dra_mps_daemon_pods_outdated`): made
    /// by an earlier version or with other settings, kept while they have clients.
    pub mps_daemon_pods_outdated: Gauge,
}

impl SharingMetrics {
    /// Registers the metrics in `registry`, which carries the plugin's `gpu_dra` prefix
    /// (so the counter is exposed as `gpu_dra_mps_daemon_restarts_total`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "mps_daemon_restarts",
            "MPS control daemons restarted after they exited unexpectedly",
            self.mps_daemon_restarts.clone(),
        );
        registry.register(
            "mps_daemon_pods_outdated",
            "MPS daemon pods of an older shape (earlier version or other settings) kept running because they have clients; replaced once they have none",
            self.mps_daemon_pods_outdated.clone(),
        );
    }
}

/// Applies, supervises and undoes GPU sharing. Cheap to clone.
#[derive(Clone)]
pub struct SharingManager {
    pub(super) inner: Arc<Inner>,
}

/// The manager's shared state; its methods live in the module of their concern.
pub(super) struct Inner {
    pub(super) opts: SharingOptions,
    pub(super) store: Arc<dyn SharingStore>,
    pub(super) state: Mutex<SharingState>,
    /// A save failed: the state in memory may differ from the file, so the next update saves
    /// even when it changes nothing.
    pub(super) unsaved: std::sync::atomic::AtomicBool,
    /// Serializes time-slice changes (see the module documentation).
    pub(super) timeslice_lock: tokio::sync::Mutex<()>,
    /// Serializes changes to memory-share daemons (start with the first claim, stop after
    /// the last: see [`super::shared_mps`]).
    pub(super) share_lock: tokio::sync::Mutex<()>,
    /// Supervisor tasks by daemon id.
    pub(super) supervised: Mutex<HashMap<String, Supervised>>,
    pub(super) metrics: SharingMetrics,
    /// Directory names under `<plugin-dir>/mps` that belong to NVIDIA's driver.
    pub(super) foreign_dirs: Mutex<Vec<String>>,
    /// When set, MPS daemons run in pods of their own ([`super::pods`]).
    pub(super) pods: std::sync::OnceLock<Arc<PodDaemons>>,
    /// The node's one watch on daemon pods, set with `pods`.
    pub(super) pod_watch: std::sync::OnceLock<PodWatch>,
    /// The claims the driver's checkpoint knows (`None`: not told); recovery releases the
    /// sharing of every other claim.
    pub(super) known_claims: Mutex<Option<BTreeSet<String>>>,
    /// Daemon pods of another shape than this version makes, by daemon id, with how they
    /// differ ([`super::reshape`]).
    pub(super) outdated: Mutex<BTreeMap<String, Vec<String>>>,
}

impl std::fmt::Debug for SharingManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharingManager")
            .field("plugin_dir", &self.inner.opts.plugin_dir)
            .finish_non_exhaustive()
    }
}

/// Locks a mutex, also after a panic of another holder (the state stays usable).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SharingManager {
    /// A manager over the state last saved in `store`. Call [`SharingManager::recover`] next.
    pub fn new(
        opts: SharingOptions,
        store: Arc<dyn SharingStore>,
        metrics: SharingMetrics,
    ) -> Result<Self, SharingError> {
        let state = store.load()?;
        Ok(Self {
            inner: Arc::new(Inner {
                opts,
                store,
                state: Mutex::new(state),
                unsaved: std::sync::atomic::AtomicBool::new(false),
                timeslice_lock: tokio::sync::Mutex::new(()),
                share_lock: tokio::sync::Mutex::new(()),
                supervised: Mutex::new(HashMap::new()),
                metrics,
                foreign_dirs: Mutex::new(Vec::new()),
                pods: std::sync::OnceLock::new(),
                pod_watch: std::sync::OnceLock::new(),
                known_claims: Mutex::new(None),
                outdated: Mutex::new(BTreeMap::new()),
            }),
        })
    }

    /// Runs MPS daemons in pods of their own from now on (see [`super::pods`]), and starts the
    /// node's one watch on them that their supervisors share ([`super::pod_watch`]). Call
    /// before [`Self::recover`], within a Tokio runtime; a second call is ignored.
    pub fn use_pod_daemons(&self, pods: PodDaemons) {
        let api = pods.api();
        let node = pods.settings().node.clone();
        if self.inner.pods.set(Arc::new(pods)).is_ok() {
            let _ = self.inner.pod_watch.set(PodWatch::start(api, &node));
        }
    }

    /// Names directories under `<plugin-dir>/mps` (NVIDIA MPS daemon IDs of imported claims)
    /// that [`Self::recover`] must not remove. Call before it.
    pub fn keep_foreign_dirs(&self, ids: Vec<String>) {
        *lock(&self.inner.foreign_dirs) = ids;
    }

    /// Names the claims the driver's checkpoint knows (prepared or half prepared). Call
    /// before [`Self::recover`]: sharing recorded for any other claim belongs to a claim whose
    /// unprepare was lost (the checkpoint entry is removed only after sharing was undone, so
    /// this takes a lost or replaced checkpoint), and recovery undoes it instead of keeping a
    /// GPU in `EXCLUSIVE_PROCESS` or time-sliced for nobody.
    pub fn keep_claims(&self, uids: BTreeSet<String>) {
        *lock(&self.inner.known_claims) = Some(uids);
    }

    /// A copy of the current state (what the checkpoint holds).
    pub fn state(&self) -> SharingState {
        lock(&self.inner.state).clone()
    }

    /// The pid of the daemon serving `claim_uid`'s `group`, if one is recorded (for tests).
    #[cfg(any(test, feature = "testing"))]
    pub fn mps_pid(&self, claim_uid: &str, group: &str) -> Option<u32> {
        lock(&self.inner.state)
            .mps
            .get(&gpu_dra_core::sharing::daemon_id(claim_uid, group))
            .and_then(|r| r.pid)
    }

    /// Applies the sharing of group `group` of claim `claim_uid` (of namespace `namespace`) to
    /// `devices` and returns the container edits it needs. Idempotent: repeating it for a
    /// prepared group returns the same edits.
    pub async fn prepare(
        &self,
        namespace: &str,
        claim_uid: &str,
        group: &str,
        devices: &[SharedDevice],
        sharing: &Sharing,
    ) -> Result<ContainerEdits, SharingError> {
        check_name("claim UID", claim_uid)?;
        check_name("device group", group)?;
        match sharing {
            Sharing::TimeSlicing { interval } => {
                self.prepare_timeslice(claim_uid, devices, *interval)
                    .await?;
                Ok(ContainerEdits::default())
            }
            Sharing::Mps(config) => match devices {
                [device] if device.share.is_some() => {
                    self.prepare_mps_share(namespace, claim_uid, device, config)
                        .await
                }
                _ => self.prepare_mps(claim_uid, group, devices, config).await,
            },
        }
    }

    /// Undoes everything sharing did for `claim_uid`: resets time-slicing on GPUs no other
    /// claim uses, stops its MPS daemons, restores compute modes and removes directories.
    /// Idempotent; on error, repeating it finishes the job.
    pub async fn unprepare(&self, claim_uid: &str) -> Result<(), SharingError> {
        let mut first_error = None;
        if let Err(e) = self.unprepare_timeslice(claim_uid).await {
            first_error.get_or_insert(e);
        }
        let ids: Vec<String> = lock(&self.inner.state)
            .mps
            .iter()
            .filter(|(_, r)| r.claim_uid == claim_uid)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if let Err(e) = self.inner.teardown_mps(&id).await {
                first_error.get_or_insert(e);
            }
        }
        if let Err(e) = self.unprepare_mps_shares(claim_uid).await {
            first_error.get_or_insert(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Inner {
    /// Mutates the state and saves it when it changed; the closure's result is returned.
    /// Most unprepares change nothing here (a claim without sharing, or one whose sharing a
    /// crash already undid): they write nothing.
    pub(super) fn update<R>(
        &self,
        f: impl FnOnce(&mut SharingState) -> R,
    ) -> Result<R, SharingError> {
        use std::sync::atomic::Ordering::SeqCst;
        let mut state = lock(&self.state);
        let before = state.clone();
        let r = f(&mut state);
        if *state != before || self.unsaved.load(SeqCst) {
            let saved = self.store.save(&state);
            self.unsaved.store(saved.is_err(), SeqCst);
            saved?;
        }
        Ok(r)
    }
}

/// Claim UIDs and group names become path components: keep them to a safe alphabet.
pub(super) fn check_name(what: &str, name: &str) -> Result<(), SharingError> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SharingError::InvalidRequest {
            field: what.to_string(),
            message: format!(
                "{name:?} is not usable as a directory name; use 1-64 of [A-Za-z0-9._-], not starting with a dot"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharing::state::TimeSliceRecord;
    use crate::sharing::tools::DriverRoot;

    /// A store in memory that counts its saves and fails them while told to.
    #[derive(Default)]
    struct CountingStore {
        saves: std::sync::atomic::AtomicUsize,
        fail: std::sync::atomic::AtomicBool,
    }

    impl SharingStore for CountingStore {
        fn load(&self) -> Result<SharingState, SharingError> {
            Ok(SharingState::default())
        }
        fn save(&self, _state: &SharingState) -> Result<(), SharingError> {
            use std::sync::atomic::Ordering::SeqCst;
            if self.fail.load(SeqCst) {
                return Err(SharingError::StateCorrupt {
                    path: "sharing.json".into(),
                    reason: "disk full".into(),
                });
            }
            self.saves.fetch_add(1, SeqCst);
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_claim_without_sharing_is_unprepared_without_writing_the_state() {
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(CountingStore::default());
        let manager = SharingManager::new(
            SharingOptions::new(DriverRoot::new(dir.path(), None), dir.path()),
            store.clone(),
            SharingMetrics::default(),
        )
        .expect("manager");
        manager.unprepare("uid-plain").await.expect("unprepares");
        manager.unprepare("uid-plain").await.expect("again");
        assert_eq!(
            store.saves.load(SeqCst),
            0,
            "nothing changed, nothing written"
        );

        // A change is saved; after a failed save the next update saves even without a change.
        store.fail.store(true, SeqCst);
        manager
            .inner
            .update(|s| {
                s.time_slicing
                    .insert("GPU-1".into(), TimeSliceRecord::default());
            })
            .expect_err("the save fails");
        store.fail.store(false, SeqCst);
        manager.inner.update(|_| ()).expect("saves");
        assert_eq!(store.saves.load(SeqCst), 1, "the unsaved change is written");
        manager.inner.update(|_| ()).expect("nothing to save");
        assert_eq!(store.saves.load(SeqCst), 1);
    }

    #[test]
    fn names_that_would_escape_the_plugin_dir_are_refused() {
        assert!(check_name("device group", "0").is_ok());
        assert!(check_name("claim UID", "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b").is_ok());
        for bad in ["", "..", "a/b", ".hidden", "a b"] {
            assert!(check_name("device group", bad).is_err(), "{bad:?}");
        }
    }
}
