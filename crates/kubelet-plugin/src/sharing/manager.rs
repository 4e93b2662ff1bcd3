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
//! Directories of MPS daemons that NVIDIA's driver started for claims imported from it live
//! in the same `<plugin-dir>/mps` folder; [`SharingManager::keep_foreign_dirs`] names them
//! so recovery leaves them alone.
//!
//! Time-slice changes are serialized by one lock (they are quick `nvidia-smi` calls, and the
//! "last claim out resets the GPU" decision must not race a new claim setting it). MPS daemons
//! of different claims start concurrently.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use super::error::SharingError;
use super::mps::{self, CONTAINER_PIPE_DIR, PIPE_DIR_ENV};
use super::smi::{self, ComputeMode, TimeSliceInterval};
use super::state::{MpsLimitsApplied, MpsPhase, MpsRecord, SharingState, SharingStore};
use super::tools::DriverRoot;
use super::{
    DeviceKey, MpsRequest, SharedDevice, SharingEdits, SharingGroup, SharingMount, SharingRequest,
};

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
    /// How often an adopted daemon (not our child) is checked for liveness.
    pub liveness_interval: Duration,
    /// The node's current boot ID (`None`: unknown; reboots are then not detected here).
    pub boot_id: Option<String>,
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
        }
    }
}

/// Metrics of the sharing module.
#[derive(Debug, Clone, Default)]
pub struct SharingMetrics {
    /// Crashed MPS control daemons restarted (`gpu_dra_mps_daemon_restarts_total`).
    pub mps_daemon_restarts: Counter,
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
    }
}

/// What [`SharingManager::recover`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Daemons found alive, answering on their pipe, and supervised again.
    pub adopted: Vec<String>,
    /// Daemons of prepared claims that were dead or unresponsive and were started again.
    pub restarted: Vec<String>,
    /// Half-started or half-stopped daemons, and stray directories, cleaned up.
    pub cleaned: Vec<String>,
    /// GPUs whose owed time-slice reset was done.
    pub timeslice_reset: Vec<String>,
    /// Records of a previous boot, forgotten without touching any process.
    pub previous_boot: Vec<String>,
}

/// Applies, supervises and undoes GPU sharing. Cheap to clone.
#[derive(Clone)]
pub struct SharingManager {
    inner: Arc<Inner>,
}

struct Inner {
    opts: SharingOptions,
    store: Arc<dyn SharingStore>,
    state: Mutex<SharingState>,
    timeslice_lock: tokio::sync::Mutex<()>,
    supervised: Mutex<HashMap<String, Supervised>>,
    metrics: SharingMetrics,
    /// Directory names under `<plugin-dir>/mps` that belong to NVIDIA's driver.
    foreign_dirs: Mutex<Vec<String>>,
}

struct Supervised {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The daemon process a supervisor watches.
enum Proc {
    /// Started by this plugin process: we get its exit status.
    Child(tokio::process::Child),
    /// Started by an earlier plugin process: polled through `/proc`.
    Adopted(u32),
    /// Not running (a restart failed); the supervisor retries.
    Dead,
}

impl std::fmt::Debug for SharingManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharingManager")
            .field("plugin_dir", &self.inner.opts.plugin_dir)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
                timeslice_lock: tokio::sync::Mutex::new(()),
                supervised: Mutex::new(HashMap::new()),
                metrics,
                foreign_dirs: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Names directories under `<plugin-dir>/mps` (NVIDIA MPS daemon IDs of imported claims)
    /// that [`Self::recover`] must not remove. Call before it.
    pub fn keep_foreign_dirs(&self, ids: Vec<String>) {
        *lock(&self.inner.foreign_dirs) = ids;
    }

    /// Undoes what NVIDIA's driver applied for an imported claim: resets time-slicing on its
    /// GPUs unless a claim of ours uses them now. NVIDIA's MPS daemons are Deployments this
    /// plugin cannot delete: they are reported with what to do. Idempotent.
    pub async fn release_imported(
        &self,
        claim_uid: &str,
        imported: &gpu_dra_core::checkpoint::Imported,
    ) -> Result<(), SharingError> {
        for id in &imported.mps_control_daemons {
            warn!(
                claim.uid = %claim_uid,
                daemon = %id,
                gpus = %imported.mps_gpus.join(","),
                "claim imported from NVIDIA's driver used an MPS control daemon this plugin cannot stop: delete Deployment mps-control-daemon-{id} in NVIDIA driver's namespace, then reset the GPUs with `nvidia-smi -i <uuid> -c DEFAULT`"
            );
        }
        let inner = &self.inner;
        let _guard = inner.timeslice_lock.lock().await;
        let mut first_error = None;
        for gpu in &imported.time_sliced_gpus {
            let ours = {
                let s = lock(&inner.state);
                s.time_slicing
                    .get(gpu)
                    .is_some_and(|r| !r.claims.is_empty())
                    || s.mps.values().any(|r| r.whole_gpus.contains(gpu))
            };
            if ours {
                continue;
            }
            let r = async {
                smi::set_compute_mode(
                    &inner.opts.driver_root,
                    gpu,
                    ComputeMode::Default,
                    inner.opts.tool_timeout,
                )
                .await?;
                smi::set_timeslice(
                    &inner.opts.driver_root,
                    gpu,
                    TimeSliceInterval::Default,
                    inner.opts.tool_timeout,
                )
                .await
            }
            .await;
            match r {
                Ok(()) | Err(SharingError::TimeSliceNotSupported { .. }) => {
                    info!(claim.uid = %claim_uid, gpu = %gpu, "time-slicing set by NVIDIA's driver reset");
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A copy of the current state (what the checkpoint holds).
    pub fn state(&self) -> SharingState {
        lock(&self.inner.state).clone()
    }

    /// The pid of the daemon serving `claim_uid`'s `group`, if one is recorded.
    pub fn mps_pid(&self, claim_uid: &str, group: &str) -> Option<u32> {
        lock(&self.inner.state)
            .mps
            .get(&daemon_id(claim_uid, group))
            .and_then(|r| r.pid)
    }

    /// Applies `group`'s sharing for claim `claim_uid` and returns the container edits it
    /// needs. Idempotent: repeating it for a prepared group returns the same edits.
    pub async fn prepare(
        &self,
        claim_uid: &str,
        group: &SharingGroup,
    ) -> Result<SharingEdits, SharingError> {
        check_name("claim UID", claim_uid)?;
        check_name("device group", &group.name)?;
        match &group.sharing {
            SharingRequest::TimeSlicing { interval } => {
                self.prepare_timeslice(claim_uid, group, *interval).await?;
                Ok(SharingEdits::default())
            }
            SharingRequest::Mps(req) => self.prepare_mps(claim_uid, group, req).await,
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
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// After a plugin restart: re-adopts live daemons of prepared claims (pid alive, command
    /// line and pipe directory match, and it answers on its pipe), restarts the others, cleans
    /// up daemons whose prepare or unprepare was interrupted and directories nothing records,
    /// and does owed time-slice resets.
    pub async fn recover(&self) -> Result<RecoveryReport, SharingError> {
        let inner = &self.inner;
        let mut report = RecoveryReport::default();
        let mut first_error = None;

        // A reboot since the state was saved: none of it exists any more.
        if let Some(now) = &inner.opts.boot_id {
            let forgotten = inner.update(|s| {
                let mut forgotten = Vec::new();
                if s.boot_id.as_ref().is_some_and(|then| then != now) {
                    forgotten.extend(s.mps.keys().cloned());
                    forgotten.extend(s.time_slicing.keys().cloned());
                    s.mps.clear();
                    s.time_slicing.clear();
                }
                s.boot_id = Some(now.clone());
                forgotten
            })?;
            if !forgotten.is_empty() {
                info!(
                    records = %forgotten.join(","),
                    "node rebooted since the sharing state was saved; forgetting it (sharing is applied again by the next prepare of each claim)"
                );
            }
            report.previous_boot = forgotten;
        }

        // Time-slice resets owed by an unprepare that did not finish.
        {
            let _guard = inner.timeslice_lock.lock().await;
            let owed: Vec<String> = lock(&inner.state)
                .time_slicing
                .iter()
                .filter(|(_, r)| r.claims.is_empty())
                .map(|(gpu, _)| gpu.clone())
                .collect();
            for gpu in owed {
                match inner.reset_timeslice(&gpu).await {
                    Ok(()) => report.timeslice_reset.push(gpu),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }

        let records: Vec<(String, MpsRecord)> = lock(&inner.state)
            .mps
            .iter()
            .map(|(id, r)| (id.clone(), r.clone()))
            .collect();
        for (id, record) in records {
            if lock(&inner.supervised).contains_key(&id) {
                continue;
            }
            if record.phase != MpsPhase::Ready {
                // Its prepare never returned success (kubelet retries it) or its unprepare
                // was interrupted: finish the teardown.
                match inner.teardown_mps(&id).await {
                    Ok(()) => report.cleaned.push(id),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
                continue;
            }
            let timeout = inner.opts.tool_timeout;
            let alive = record
                .pid
                .filter(|pid| mps::is_daemon_for(*pid, &record.pipe_dir()));
            if let Some(pid) = alive
                && mps::answers(&inner.opts.driver_root, &record, timeout).await
            {
                info!(daemon = %id, pid, "re-adopted MPS control daemon");
                inner.supervise(&id, Proc::Adopted(pid));
                report.adopted.push(id);
                continue;
            }
            warn!(daemon = %id, pid = ?record.pid, "MPS control daemon not running or not answering; restarting it");
            let proc = match inner.start_daemon(&id, &record, false).await {
                Ok(child) => Proc::Child(child),
                Err(e) => {
                    error!(daemon = %id, error = %e, "restart failed; the supervisor keeps retrying");
                    Proc::Dead
                }
            };
            inner.supervise(&id, proc);
            report.restarted.push(id);
        }

        // Directories under <plugin-dir>/mps that no record owns (a crash between creating
        // them and saving, or state lost): stop any daemon there and remove them.
        let mps_root = inner.opts.plugin_dir.join("mps");
        if let Ok(entries) = std::fs::read_dir(&mps_root) {
            let known: Vec<PathBuf> = lock(&inner.state)
                .mps
                .values()
                .map(|r| r.dir.clone())
                .collect();
            let foreign = lock(&inner.foreign_dirs).clone();
            for entry in entries.flatten() {
                let dir = entry.path();
                if known.contains(&dir)
                    || foreign
                        .iter()
                        .any(|id| entry.file_name().to_string_lossy() == id.as_str())
                {
                    continue;
                }
                for pid in mps::find_daemons(&dir.join("pipe")) {
                    warn!(pid, dir = %dir.display(), "killing MPS control daemon nothing records");
                    mps::kill(pid);
                    mps::wait_gone(pid, inner.opts.mps_quit_timeout).await;
                }
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => report.cleaned.push(dir.display().to_string()),
                    Err(e) => {
                        first_error.get_or_insert(SharingError::io("remove directory", &dir, e));
                    }
                }
            }
        }
        info!(
            adopted = report.adopted.len(),
            restarted = report.restarted.len(),
            cleaned = report.cleaned.len(),
            "sharing state recovered"
        );
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Stops supervising without touching the daemons: they keep serving their claims while
    /// the plugin restarts (the next plugin process re-adopts them through [`Self::recover`]).
    pub fn detach(&self) {
        for (_, s) in lock(&self.inner.supervised).drain() {
            s.task.abort();
        }
    }

    async fn prepare_timeslice(
        &self,
        claim_uid: &str,
        group: &SharingGroup,
        interval: TimeSliceInterval,
    ) -> Result<(), SharingError> {
        let inner = &self.inner;
        // Time-slicing on a MIG device is plain sharing: nothing to set.
        let gpus: Vec<String> = group
            .devices
            .iter()
            .filter(|d| !d.mig)
            .map(|d| d.uuid.clone())
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        let _guard = inner.timeslice_lock.lock().await;
        inner.update(|s| {
            for gpu in &gpus {
                if let Some((id, _)) = s.mps.iter().find(|(_, r)| r.whole_gpus.contains(gpu)) {
                    return Err(SharingError::Conflict {
                        gpu: gpu.clone(),
                        holder: format!("MPS daemon {id}"),
                        wanted: format!("time-slicing for claim {claim_uid}"),
                    });
                }
            }
            for gpu in &gpus {
                let rec = s.time_slicing.entry(gpu.clone()).or_default();
                if !rec.claims.is_empty() && rec.interval != interval {
                    warn!(gpu = %gpu, was = ?rec.interval, now = ?interval, "time-slice interval of a shared GPU changed by a new claim");
                }
                rec.interval = interval;
                rec.claims.insert(claim_uid.to_string());
            }
            Ok(())
        })??;
        let timeout = inner.opts.tool_timeout;
        let root = &inner.opts.driver_root;
        let mut result = Ok(());
        for gpu in &gpus {
            let r = async {
                smi::set_compute_mode(root, gpu, ComputeMode::Default, timeout).await?;
                smi::set_timeslice(root, gpu, interval, timeout).await
            }
            .await;
            if let Err(e) = r {
                result = Err(e);
                break;
            }
            debug!(claim.uid = %claim_uid, gpu = %gpu, ?interval, "time-slice set");
        }
        if let Err(e) = result {
            // Back out: this claim is not prepared, so it holds no GPU.
            if let Err(undo) = inner.release_timeslice_claim(claim_uid, Some(&gpus)).await {
                warn!(claim.uid = %claim_uid, error = %undo, "backing out time-slicing failed; the reset is retried later");
            }
            return Err(e);
        }
        info!(claim.uid = %claim_uid, gpus = gpus.len(), ?interval, "time-slicing applied");
        Ok(())
    }

    async fn unprepare_timeslice(&self, claim_uid: &str) -> Result<(), SharingError> {
        let _guard = self.inner.timeslice_lock.lock().await;
        self.inner.release_timeslice_claim(claim_uid, None).await
    }

    async fn prepare_mps(
        &self,
        claim_uid: &str,
        group: &SharingGroup,
        req: &MpsRequest,
    ) -> Result<SharingEdits, SharingError> {
        let inner = &self.inner;
        let id = daemon_id(claim_uid, &group.name);
        let mut devices: Vec<String> = group.devices.iter().map(|d| d.uuid.clone()).collect();
        devices.sort();
        devices.dedup();
        if devices.is_empty() {
            return Err(SharingError::InvalidRequest {
                field: "devices".to_string(),
                message: format!("device group {} of claim {claim_uid} is empty", group.name),
            });
        }
        let mut whole_gpus: Vec<String> = group
            .devices
            .iter()
            .filter(|d| !d.mig)
            .map(|d| d.uuid.clone())
            .collect();
        whole_gpus.sort();
        whole_gpus.dedup();
        let record = MpsRecord {
            claim_uid: claim_uid.to_string(),
            group: group.name.clone(),
            phase: MpsPhase::Starting,
            pid: None,
            dir: inner.opts.plugin_dir.join("mps").join(&id),
            limits: resolve_limits(req, &group.devices)?,
            devices,
            whole_gpus,
        };
        mps::check_socket_path(&record)?;

        // Idempotent repeat of a finished prepare.
        let existing = lock(&inner.state).mps.get(&id).cloned();
        if let Some(old) = existing {
            let same = old.devices == record.devices && old.limits == record.limits;
            if same && old.phase == MpsPhase::Ready && lock(&inner.supervised).contains_key(&id) {
                return Ok(mps_edits(&old));
            }
            inner.teardown_mps(&id).await?;
        }

        inner.update(|s| {
            for gpu in &record.whole_gpus {
                if let Some(ts) = s.time_slicing.get(gpu).filter(|r| !r.claims.is_empty()) {
                    return Err(SharingError::Conflict {
                        gpu: gpu.clone(),
                        holder: format!(
                            "time-slicing for claim(s) {}",
                            ts.claims.iter().cloned().collect::<Vec<_>>().join(", ")
                        ),
                        wanted: format!("MPS for claim {claim_uid}"),
                    });
                }
                if let Some((other, _)) = s.mps.iter().find(|(_, r)| r.whole_gpus.contains(gpu)) {
                    return Err(SharingError::Conflict {
                        gpu: gpu.clone(),
                        holder: format!("MPS daemon {other}"),
                        wanted: format!("MPS for claim {claim_uid}"),
                    });
                }
            }
            s.mps.insert(id.clone(), record.clone());
            Ok(())
        })??;

        let started = Instant::now();
        match inner.start_daemon(&id, &record, true).await {
            Ok(child) => {
                inner.update(|s| {
                    if let Some(r) = s.mps.get_mut(&id) {
                        r.phase = MpsPhase::Ready;
                    }
                })?;
                inner.supervise(&id, Proc::Child(child));
                info!(
                    claim.uid = %claim_uid,
                    daemon = %id,
                    devices = %record.devices.join(","),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "MPS control daemon ready"
                );
                Ok(mps_edits(&record))
            }
            Err(e) => {
                warn!(daemon = %id, error = %e, "MPS start failed; cleaning up");
                if let Err(cleanup) = inner.teardown_mps(&id).await {
                    error!(daemon = %id, error = %cleanup, "cleanup after a failed MPS start failed; recovery retries it");
                }
                Err(e)
            }
        }
    }
}

impl Inner {
    /// Mutates the state and saves it; the closure's result is returned.
    fn update<R>(&self, f: impl FnOnce(&mut SharingState) -> R) -> Result<R, SharingError> {
        let mut state = lock(&self.state);
        let r = f(&mut state);
        self.store.save(&state)?;
        Ok(r)
    }

    /// Removes `claim_uid` from the time-slice users of `only` GPUs (all when `None`) and
    /// resets every GPU left without users. Caller holds the time-slice lock.
    async fn release_timeslice_claim(
        &self,
        claim_uid: &str,
        only: Option<&[String]>,
    ) -> Result<(), SharingError> {
        let owed = self.update(|s| {
            let mut owed = Vec::new();
            for (gpu, rec) in s.time_slicing.iter_mut() {
                if only.is_some_and(|o| !o.contains(gpu)) {
                    continue;
                }
                if rec.claims.remove(claim_uid) && rec.claims.is_empty() {
                    owed.push(gpu.clone());
                }
            }
            owed
        })?;
        let mut first_error = None;
        for gpu in owed {
            if let Err(e) = self.reset_timeslice(&gpu).await {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Resets `gpu` to the default interval and forgets it, unless a claim took it meanwhile.
    async fn reset_timeslice(&self, gpu: &str) -> Result<(), SharingError> {
        let r = smi::set_timeslice(
            &self.opts.driver_root,
            gpu,
            TimeSliceInterval::Default,
            self.opts.tool_timeout,
        )
        .await;
        match r {
            // A GPU that never supported the setting has nothing to reset.
            Ok(()) | Err(SharingError::TimeSliceNotSupported { .. }) => {
                self.update(|s| {
                    if s.time_slicing.get(gpu).is_some_and(|r| r.claims.is_empty()) {
                        s.time_slicing.remove(gpu);
                    }
                })?;
                debug!(gpu = %gpu, "time-slice reset to default");
                Ok(())
            }
            Err(e) => {
                warn!(gpu = %gpu, error = %e, "time-slice reset failed; retried on the next unprepare or restart");
                Err(e)
            }
        }
    }

    /// Starts the daemon of `record`: compute mode, directories, spawn, pid saved, limits
    /// applied and confirmed. On error the spawned process is killed (the caller cleans up
    /// the rest).
    async fn start_daemon(
        &self,
        id: &str,
        record: &MpsRecord,
        fresh: bool,
    ) -> Result<tokio::process::Child, SharingError> {
        let root = &self.opts.driver_root;
        for gpu in &record.whole_gpus {
            smi::set_compute_mode(
                root,
                gpu,
                ComputeMode::ExclusiveProcess,
                self.opts.tool_timeout,
            )
            .await?;
        }
        // Leftovers of a daemon that lost its pid (or a double start) would hold the pipe.
        for pid in mps::find_daemons(&record.pipe_dir()) {
            mps::kill(pid);
            mps::wait_gone(pid, self.opts.mps_quit_timeout).await;
        }
        mps::create_dirs(record, fresh)?;
        let mut child = mps::spawn(root, record)?;
        let pid = child.id();
        if let Err(e) = self.update(|s| {
            if let Some(r) = s.mps.get_mut(id) {
                r.pid = pid;
            }
        }) {
            mps::kill(pid.unwrap_or(0));
            let _ = child.wait().await;
            return Err(e);
        }
        let ready = mps::wait_ready(
            root,
            id,
            record,
            Some(&mut child),
            self.opts.mps_ready_timeout,
            self.opts.tool_timeout,
        )
        .await;
        if let Err(e) = ready {
            if let Some(pid) = pid {
                mps::kill(pid);
            }
            let _ = child.wait().await;
            return Err(e);
        }
        Ok(child)
    }

    /// Starts a supervisor task for daemon `id`.
    fn supervise(self: &Arc<Self>, id: &str, proc: Proc) {
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(supervise_loop(
            Arc::clone(self),
            id.to_string(),
            proc,
            stop_rx,
        ));
        if let Some(old) = lock(&self.supervised).insert(id.to_string(), Supervised { stop, task })
        {
            old.task.abort();
        }
    }

    /// Stops daemon `id` (through its supervisor when there is one), restores compute modes,
    /// removes directories and forgets the record.
    async fn teardown_mps(&self, id: &str) -> Result<(), SharingError> {
        let Some(record) = self.update(|s| {
            s.mps.get_mut(id).map(|r| {
                r.phase = MpsPhase::Stopping;
                r.clone()
            })
        })?
        else {
            return Ok(());
        };
        let supervised = lock(&self.supervised).remove(id);
        if let Some(s) = supervised {
            let _ = s.stop.send(true);
            // The supervisor only stops watching (so it will not restart the daemon); the
            // daemon itself is stopped below, on one path for supervised, adopted and
            // orphaned daemons alike.
            let _ = s.task.await;
        }
        self.stop_daemon(&record).await;
        let mut first_error = None;
        for gpu in &record.whole_gpus {
            if let Err(e) = smi::set_compute_mode(
                &self.opts.driver_root,
                gpu,
                ComputeMode::Default,
                self.opts.tool_timeout,
            )
            .await
            {
                first_error.get_or_insert(e);
            }
        }
        if let Err(e) = mps::remove_dirs(&record) {
            first_error.get_or_insert(e);
        }
        if let Some(e) = first_error {
            warn!(daemon = %id, error = %e, "MPS teardown incomplete; retried on the next unprepare or restart");
            return Err(e);
        }
        self.update(|s| {
            s.mps.remove(id);
        })?;
        info!(daemon = %id, "MPS control daemon stopped");
        Ok(())
    }

    /// `quit` through the pipe, wait, then kill whatever still runs for this pipe directory.
    async fn stop_daemon(&self, record: &MpsRecord) {
        let root = &self.opts.driver_root;
        let timeout = self.opts.mps_quit_timeout;
        let answered = mps::quit(root, record, timeout).await;
        let mut pids: Vec<u32> = record
            .pid
            .filter(|p| mps::is_daemon_for(*p, &record.pipe_dir()))
            .into_iter()
            .collect();
        for p in mps::find_daemons(&record.pipe_dir()) {
            if !pids.contains(&p) {
                pids.push(p);
            }
        }
        for pid in pids {
            if !mps::wait_gone(pid, if answered { timeout } else { Duration::ZERO }).await {
                warn!(pid, dir = %record.dir.display(), "MPS control daemon did not quit in time; killing it");
                mps::kill(pid);
                mps::wait_gone(pid, timeout).await;
            }
        }
    }
}

/// Watches one daemon: restarts it with exponential backoff when it exits without being
/// asked to; returns when told to stop (the caller then stops the daemon).
async fn supervise_loop(
    inner: Arc<Inner>,
    id: String,
    mut proc: Proc,
    mut stop: watch::Receiver<bool>,
) {
    let initial = inner.opts.restart_backoff_initial;
    let max = inner.opts.restart_backoff_max;
    let mut backoff = initial;
    loop {
        let up_since = Instant::now();
        let exit = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            exit = wait_exit(&mut proc, inner.opts.liveness_interval) => exit,
        };
        if up_since.elapsed() >= max {
            backoff = initial;
        }
        warn!(daemon = %id, exit = %exit, delay_ms = backoff.as_millis() as u64, "MPS control daemon exited unexpectedly; restarting");
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(max);
        let Some(record) = lock(&inner.state).mps.get(&id).cloned() else {
            return;
        };
        inner.metrics.mps_daemon_restarts.inc();
        proc = match inner.start_daemon(&id, &record, false).await {
            Ok(child) => {
                info!(daemon = %id, pid = ?child.id(), "MPS control daemon restarted");
                Proc::Child(child)
            }
            Err(e) => {
                error!(daemon = %id, error = %e, "MPS control daemon restart failed");
                Proc::Dead
            }
        };
    }
}

/// Waits until the daemon is gone; returns how it ended, in words.
async fn wait_exit(proc: &mut Proc, poll: Duration) -> String {
    match proc {
        Proc::Child(c) => match c.wait().await {
            Ok(status) => status.to_string(),
            Err(e) => format!("wait failed: {e}"),
        },
        Proc::Adopted(pid) => {
            while mps::pid_alive(*pid) {
                tokio::time::sleep(poll).await;
            }
            format!("pid {pid} gone")
        }
        Proc::Dead => "not running".to_string(),
    }
}

/// `<claimUID>-<group>`: the daemon's id and directory name.
pub fn daemon_id(claim_uid: &str, group: &str) -> String {
    format!("{claim_uid}-{group}")
}

/// Claim UIDs and group names become path components: keep them to a safe alphabet.
fn check_name(what: &str, name: &str) -> Result<(), SharingError> {
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

/// Resolves the request's limits to one value per device UUID: a UUID key, else an index key
/// (the device's position in the claim), else the default. Every key must name a device of
/// the group.
fn resolve_limits(
    req: &MpsRequest,
    devices: &[SharedDevice],
) -> Result<MpsLimitsApplied, SharingError> {
    const FIELD: &str = "sharing.mpsConfig";
    if let Some(p) = req.active_thread_percentage
        && !(1..=100).contains(&p)
    {
        return Err(SharingError::InvalidRequest {
            field: format!("{FIELD}.defaultActiveThreadPercentage"),
            message: format!("{p} is out of range; MPS accepts 1 to 100"),
        });
    }
    if let Some(mib) = req.default_pinned_memory_mib {
        check_mib(&format!("{FIELD}.defaultPinnedDeviceMemoryLimit"), mib)?;
    }
    for (key, mib) in &req.per_device_pinned_memory_mib {
        let field = format!("{FIELD}.defaultPerDevicePinnedMemoryLimit[{key}]");
        check_mib(&field, *mib)?;
        let known = devices.iter().any(|d| key_matches(key, d));
        if !known {
            let valid: Vec<String> = devices
                .iter()
                .map(|d| format!("{} ({})", d.index, d.uuid))
                .collect();
            return Err(SharingError::InvalidRequest {
                field,
                message: format!(
                    "{key} is not a device of this group; valid keys (claim index or UUID): {}",
                    valid.join(", ")
                ),
            });
        }
    }
    let mut pinned: BTreeMap<String, u64> = BTreeMap::new();
    for d in devices {
        let by = |want_uuid: bool| {
            req.per_device_pinned_memory_mib
                .iter()
                .find(|(k, _)| matches!(k, DeviceKey::Uuid(_)) == want_uuid && key_matches(k, d))
                .map(|(_, v)| *v)
        };
        if let Some(mib) = by(true)
            .or_else(|| by(false))
            .or(req.default_pinned_memory_mib)
        {
            pinned.insert(d.uuid.clone(), mib);
        }
    }
    Ok(MpsLimitsApplied {
        active_thread_percentage: req.active_thread_percentage,
        pinned_memory_mib: pinned,
    })
}

fn key_matches(key: &DeviceKey, device: &SharedDevice) -> bool {
    match key {
        DeviceKey::Index(i) => *i == device.index,
        DeviceKey::Uuid(u) => u.eq_ignore_ascii_case(&device.uuid),
    }
}

fn check_mib(field: &str, mib: u64) -> Result<(), SharingError> {
    if mib == 0 {
        return Err(SharingError::InvalidRequest {
            field: field.to_string(),
            message: "a pinned memory limit must be at least 1Mi".to_string(),
        });
    }
    Ok(())
}

/// What the claim's containers need to reach the daemon.
fn mps_edits(record: &MpsRecord) -> SharingEdits {
    let opts = ["rw", "nosuid", "nodev", "rbind", "rprivate"]
        .map(String::from)
        .to_vec();
    SharingEdits {
        env: vec![format!("{PIPE_DIR_ENV}={CONTAINER_PIPE_DIR}")],
        mounts: vec![
            SharingMount {
                host_path: record.pipe_dir(),
                container_path: CONTAINER_PIPE_DIR.to_string(),
                options: opts.clone(),
            },
            SharingMount {
                host_path: record.shm_dir(),
                container_path: "/dev/shm".to_string(),
                options: opts,
            },
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices(n: usize) -> Vec<SharedDevice> {
        // Claim order differs from UUID order on purpose.
        (0..n)
            .map(|i| SharedDevice {
                index: i,
                uuid: format!("GPU-{}", n - i),
                mig: false,
            })
            .collect()
    }

    #[test]
    fn limits_resolve_uuid_over_index_over_default() {
        let req = MpsRequest {
            active_thread_percentage: Some(50),
            default_pinned_memory_mib: Some(1024),
            per_device_pinned_memory_mib: [
                (DeviceKey::Index(0), 2048),
                (DeviceKey::Index(1), 4096),
                (DeviceKey::Uuid("gpu-2".into()), 512),
            ]
            .into(),
        };
        // Claim index 0 is GPU-3, index 1 is GPU-2, index 2 is GPU-1.
        let l = resolve_limits(&req, &devices(3)).unwrap();
        assert_eq!(l.active_thread_percentage, Some(50));
        assert_eq!(
            l.pinned_memory_mib,
            [
                ("GPU-1".to_string(), 1024),
                ("GPU-2".to_string(), 512),
                ("GPU-3".to_string(), 2048)
            ]
            .into()
        );
    }

    #[test]
    fn bad_limits_name_the_field_and_the_valid_choices() {
        let mut req = MpsRequest {
            per_device_pinned_memory_mib: [(DeviceKey::Index(2), 1)].into(),
            ..Default::default()
        };
        let err = resolve_limits(&req, &devices(2)).unwrap_err().to_string();
        assert!(
            err.contains("defaultPerDevicePinnedMemoryLimit[2]"),
            "{err}"
        );
        assert!(err.contains("0 (GPU-2), 1 (GPU-1)"), "{err}");
        req.per_device_pinned_memory_mib = [(DeviceKey::Uuid("GPU-9".into()), 1)].into();
        assert!(resolve_limits(&req, &devices(2)).is_err());
        let req = MpsRequest {
            active_thread_percentage: Some(0),
            ..Default::default()
        };
        assert!(resolve_limits(&req, &devices(1)).is_err());
        let req = MpsRequest {
            default_pinned_memory_mib: Some(0),
            ..Default::default()
        };
        assert!(resolve_limits(&req, &devices(1)).is_err());
    }

    #[test]
    fn names_that_would_escape_the_plugin_dir_are_refused() {
        assert!(check_name("device group", "0").is_ok());
        assert!(check_name("claim UID", "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b").is_ok());
        for bad in ["", "..", "a/b", ".hidden", "a b"] {
            assert!(check_name("device group", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn edits_mount_pipe_and_shm_and_set_the_pipe_env() {
        let r = MpsRecord {
            claim_uid: "c".into(),
            group: "0".into(),
            phase: MpsPhase::Ready,
            pid: None,
            dir: "/p/mps/c-0".into(),
            devices: vec![],
            whole_gpus: vec![],
            limits: MpsLimitsApplied::default(),
        };
        let e = mps_edits(&r);
        assert_eq!(e.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        assert_eq!(e.mounts[0].host_path, PathBuf::from("/p/mps/c-0/pipe"));
        assert_eq!(e.mounts[0].container_path, "/tmp/nvidia-mps");
        assert_eq!(e.mounts[1].host_path, PathBuf::from("/p/mps/c-0/shm"));
        assert_eq!(e.mounts[1].container_path, "/dev/shm");
    }
}
