//! MPS daemons under supervision: started for a claim's group, watched, restarted with
//! exponential backoff when they exit unexpectedly, and stopped on unprepare.
//!
//! Ordering (see [`super::manager`]): the record is saved in phase `Starting` before any
//! directory or process exists, the pid right after the spawn, and phase `Ready` only once the
//! daemon answered with its limits applied; teardown marks it `Stopping` and forgets it only
//! when the daemon is gone, compute modes are restored and its directories removed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra_api::MpsConfig;
use gpu_dra_core::cdi::ContainerEdits;
use gpu_dra_core::sharing::{SharedDevice, daemon_id, mps_edits, mps_limits};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::error::SharingError;
use super::manager::{Inner, SharingManager, lock};
use super::mps;
use super::pods::{self, PodDaemons};
use super::smi::{self, ComputeMode};
use super::state::{MpsPhase, MpsRecord};

/// A supervisor task of one daemon.
pub(super) struct Supervised {
    pub(super) stop: watch::Sender<bool>,
    pub(super) task: JoinHandle<()>,
}

/// The daemon process a supervisor watches.
pub(super) enum Proc {
    /// Started by this plugin process: we get its exit status.
    Child(tokio::process::Child),
    /// Started by an earlier plugin process: polled through `/proc`.
    Adopted(u32),
    /// Running in its own pod (see [`super::pods`]): watched through the node's one watch on
    /// daemon pods ([`super::pod_watch`]). The UID tells it from an earlier pod of that name
    /// (unknown for a pod adopted at start: then any pod of that name).
    Pod {
        /// The pod's name.
        name: String,
        /// The pod's UID, when known.
        uid: Option<String>,
    },
    /// Not running (a restart failed); the supervisor retries.
    Dead,
}

impl SharingManager {
    pub(super) async fn prepare_mps(
        &self,
        claim_uid: &str,
        group: &str,
        devices: &[SharedDevice],
        config: &MpsConfig,
    ) -> Result<ContainerEdits, SharingError> {
        let inner = &self.inner;
        let id = daemon_id(claim_uid, group);
        let limits = mps_limits(config, devices);
        let shared = devices;
        let mut devices: Vec<String> = shared.iter().map(|d| d.uuid.clone()).collect();
        devices.sort();
        devices.dedup();
        if devices.is_empty() {
            return Err(SharingError::InvalidRequest {
                field: "devices".to_string(),
                message: format!("device group {group} of claim {claim_uid} is empty"),
            });
        }
        let mut whole_gpus: Vec<String> = shared
            .iter()
            .filter(|d| !d.mig)
            .map(|d| d.uuid.clone())
            .collect();
        whole_gpus.sort();
        whole_gpus.dedup();
        let record = MpsRecord {
            claim_uid: claim_uid.to_string(),
            group: group.to_owned(),
            phase: MpsPhase::Starting,
            pid: None,
            dir: inner.opts.daemon_dir(claim_uid, group),
            limits,
            devices,
            whole_gpus,
            share_claims: Default::default(),
            namespace: None,
        };
        mps::check_socket_path(&record)?;

        // Idempotent repeat of a finished prepare.
        let existing = lock(&inner.state).mps.get(&id).cloned();
        if let Some(old) = existing {
            let same = old.devices == record.devices && old.limits == record.limits;
            if same && old.phase == MpsPhase::Ready && lock(&inner.supervised).contains_key(&id) {
                return Ok(client_edits(&old));
            }
            inner.teardown_mps(&id).await?;
        }

        inner.record_mps(&id, &record, claim_uid)?;
        inner
            .start_recorded(&id, &record, claim_uid, "MPS control daemon ready")
            .await?;
        Ok(client_edits(&record))
    }
}

impl Inner {
    /// Records the daemon `id` of `record` as starting, unless a GPU of it is time-sliced or
    /// served by another MPS daemon (one daemon per GPU is all MPS allows).
    pub(super) fn record_mps(
        &self,
        id: &str,
        record: &MpsRecord,
        claim_uid: &str,
    ) -> Result<(), SharingError> {
        self.update(|s| {
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
            s.mps.insert(id.to_owned(), record.clone());
            Ok(())
        })?
    }

    /// Starts the recorded daemon `id`, marks it ready and watches it; on failure cleans up
    /// what the start left (recovery retries a failed cleanup).
    pub(super) async fn start_recorded(
        self: &Arc<Self>,
        id: &str,
        record: &MpsRecord,
        claim_uid: &str,
        ready: &str,
    ) -> Result<(), SharingError> {
        let started = Instant::now();
        match self.start_daemon(id, record, true).await {
            Ok(proc) => {
                self.update(|s| {
                    if let Some(r) = s.mps.get_mut(id) {
                        r.phase = MpsPhase::Ready;
                    }
                })?;
                self.supervise(id, proc);
                info!(
                    claim.uid = %claim_uid,
                    daemon = %id,
                    devices = %record.devices.join(","),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "{ready}"
                );
                Ok(())
            }
            Err(e) => {
                warn!(daemon = %id, error = %e, "MPS start failed; cleaning up");
                if let Err(cleanup) = self.teardown_mps(id).await {
                    error!(daemon = %id, error = %cleanup, "cleanup after a failed MPS start failed; recovery retries it");
                }
                Err(e)
            }
        }
    }
}

/// What the claim's containers need to reach the daemon of `record`.
pub(super) fn client_edits(record: &MpsRecord) -> ContainerEdits {
    mps_edits(&record.pipe_dir().display().to_string())
}

impl Inner {
    /// Starts the daemon of `record`: compute mode, directories, spawn, pid saved, limits
    /// applied and confirmed. On error the spawned process is killed (the caller cleans up
    /// the rest).
    pub(super) async fn start_daemon(
        &self,
        id: &str,
        record: &MpsRecord,
        fresh: bool,
    ) -> Result<Proc, SharingError> {
        let root = &self.opts.driver_root;
        let gpus: &[String] = if self.opts.leave_compute_mode {
            &[]
        } else {
            &record.whole_gpus
        };
        for gpu in gpus {
            smi::set_compute_mode(
                root,
                gpu,
                ComputeMode::ExclusiveProcess,
                self.opts.tool_timeout,
            )
            .await?;
        }
        if let Some(pods) = self.pods.get() {
            return self.start_daemon_pod(pods, id, record, fresh).await;
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
        Ok(Proc::Child(child))
    }

    /// [`Self::start_daemon`] with the daemon in its own pod: a pod for this record that
    /// already runs is kept (its directories too: clients have them mounted); otherwise the
    /// directories are made and the pod created. Then, as for a child, the limits are applied
    /// through the pipe and read back. On error a pod this call created is deleted.
    async fn start_daemon_pod(
        &self,
        pods: &PodDaemons,
        id: &str,
        record: &MpsRecord,
        fresh: bool,
    ) -> Result<Proc, SharingError> {
        let root = &self.opts.driver_root;
        let name = pods::pod_name(record);
        let running = pods.alive(&name).await == Some(true)
            && mps::answers(root, record, self.opts.tool_timeout).await;
        if !running {
            pods.delete(&name, self.opts.mps_quit_timeout * 2).await?;
            mps::create_dirs(record, fresh)?;
        }
        let ensured = pods
            .ensure(root, id, record, self.opts.mps_quit_timeout * 2)
            .await?;
        let kept = ensured.kept;
        let ready = mps::wait_ready(
            root,
            id,
            record,
            None,
            self.opts.mps_ready_timeout,
            self.opts.tool_timeout,
        )
        .await;
        if let Err(e) = ready {
            let status = pods.status_message(&name).await;
            if !kept && let Err(d) = pods.delete(&name, self.opts.mps_quit_timeout * 2).await {
                warn!(daemon = %id, error = %d, "deleting the daemon pod of a failed start failed; recovery retries it");
            }
            return Err(match e {
                SharingError::MpsNotReady {
                    daemon,
                    pipe_dir,
                    timeout,
                    last_error,
                } => SharingError::MpsNotReady {
                    daemon,
                    pipe_dir,
                    timeout,
                    last_error: format!("{last_error}; {status}"),
                },
                other => other,
            });
        }
        info!(daemon = %id, pod = %name, adopted = kept, "MPS control daemon pod ready");
        Ok(Proc::Pod {
            name,
            uid: ensured.uid,
        })
    }

    /// Starts a supervisor task for daemon `id`.
    pub(super) fn supervise(self: &Arc<Self>, id: &str, proc: Proc) {
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
    pub(super) async fn teardown_mps(&self, id: &str) -> Result<(), SharingError> {
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
        let gpus: &[String] = if self.opts.leave_compute_mode {
            &[]
        } else {
            &record.whole_gpus
        };
        for gpu in gpus {
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
    pub(super) async fn stop_daemon(&self, record: &MpsRecord) {
        let root = &self.opts.driver_root;
        let timeout = self.opts.mps_quit_timeout;
        let answered = mps::quit(root, record, timeout).await;
        if let Some(pods) = self.pods.get() {
            // `quit` ended the servers; the pod goes, whatever its daemon did.
            let name = pods::pod_name(record);
            if let Err(e) = pods.delete(&name, timeout * 2).await {
                warn!(pod = %name, error = %e, "deleting the MPS daemon pod failed; the next unprepare, cleanup or restart retries it");
            }
        }
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
            exit = wait_exit(&inner, &mut proc, inner.opts.liveness_interval) => exit,
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
            Ok(proc) => {
                info!(daemon = %id, "MPS control daemon restarted");
                proc
            }
            Err(e) => {
                error!(daemon = %id, error = %e, "MPS control daemon restart failed");
                Proc::Dead
            }
        };
    }
}

/// Waits until the daemon is gone; returns how it ended, in words.
async fn wait_exit(inner: &Inner, proc: &mut Proc, poll: Duration) -> String {
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
        Proc::Pod { name, uid } => {
            // The kubelet restarts a crashed daemon container in place, with the claim's
            // limits in its environment; only a pod that is gone (deleted, evicted, ended)
            // needs us. An API server that cannot answer is not a reason to act: the watch
            // keeps what it last knew (see `pod_watch`).
            match inner.pod_watch.get() {
                Some(watch) => watch.wait_gone(name, uid.as_deref()).await,
                None => std::future::pending().await,
            }
        }
        Proc::Dead => "not running".to_string(),
    }
}
