//! What a restarted plugin finds and puts right: live daemons of prepared claims re-adopted
//! (pid alive, command line and pipe directory match, and it answers on its pipe), dead ones
//! restarted, daemons whose prepare or unprepare was interrupted torn down, directories no
//! record owns removed, and owed time-slice resets done. Sharing recorded for claims the
//! driver's checkpoint does not know ([`SharingManager::keep_claims`]) is undone: compute mode
//! back to `DEFAULT`, time-slice back to default once no known claim uses the GPU.
//!
//! After a reboot (the node's boot ID differs from the one the state was saved with) nothing
//! recorded is real any more: recovery forgets every record without signalling anything and
//! removes the daemons' directories as strays; the kubelet's next prepare of each claim applies
//! sharing again.

use std::collections::BTreeSet;
use std::path::PathBuf;

use tracing::{error, info, warn};

use super::error::SharingError;
use super::manager::{Inner, SharingManager, lock};
use super::mps;
use super::state::{MpsPhase, MpsRecord};
use super::supervise::Proc;

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
    /// Claims the checkpoint does not know whose sharing was undone.
    pub released: Vec<String>,
}

impl SharingManager {
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

        // Sharing of claims the checkpoint does not know: nobody will unprepare them.
        let known = lock(&inner.known_claims).clone();
        if let Some(known) = known {
            let orphans: BTreeSet<String> = {
                let s = lock(&inner.state);
                s.time_slicing
                    .values()
                    .flat_map(|r| r.claims.iter().cloned())
                    .chain(s.mps.values().flat_map(MpsRecord::claims))
                    .filter(|uid| !known.contains(uid))
                    .collect()
            };
            for uid in orphans {
                warn!(claim.uid = %uid, "sharing recorded for a claim the checkpoint does not know; undoing it");
                match self.unprepare(&uid).await {
                    Ok(()) => report.released.push(uid),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
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
            if record.phase != MpsPhase::Ready
                || (record.is_memory_share() && record.share_claims.is_empty())
            {
                // Its prepare never returned success (kubelet retries it) or its unprepare
                // was interrupted (for a memory-share daemon: its last claim is gone): finish
                // the teardown.
                match inner.teardown_mps(&id).await {
                    Ok(()) => report.cleaned.push(id),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
                continue;
            }
            let timeout = inner.opts.tool_timeout;
            if let Some(pods) = inner.pods.get() {
                let name = super::pods::pod_name(&record);
                if pods.alive(&name).await == Some(true)
                    && mps::answers(&inner.opts.driver_root, &record, timeout).await
                {
                    info!(daemon = %id, pod = %name, "re-adopted MPS control daemon pod");
                    inner.supervise(&id, Proc::Pod { name, uid: None });
                    report.adopted.push(id);
                    continue;
                }
            }
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
                Ok(proc) => proc,
                Err(e) => {
                    error!(daemon = %id, error = %e, "restart failed; the supervisor keeps retrying");
                    Proc::Dead
                }
            };
            inner.supervise(&id, proc);
            report.restarted.push(id);
        }

        // Daemon pods on this node that no record owns: their claim was unprepared or is
        // gone (also while no plugin ran), or their start was interrupted before the record.
        if let Some(pods) = inner.pods.get() {
            match pods.list().await {
                Ok(found) => {
                    for (name, id, pod) in found {
                        let record = lock(&inner.state).mps.get(&id).cloned();
                        if let Some(record) = record {
                            // Made by an earlier version or with other settings: replaced
                            // once no client would lose its work (`reshape`).
                            inner.note_shape(pods, &id, &record, &pod);
                            continue;
                        }
                        warn!(pod = %name, daemon = %id, "deleting MPS daemon pod nothing records");
                        match pods.delete(&name, inner.opts.mps_quit_timeout * 2).await {
                            Ok(()) => report.cleaned.push(format!("pod {name}")),
                            Err(e) => {
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }

        // Directories under <plugin-dir>/mps that no record owns (a crash between creating
        // them and saving, or state lost): stop any daemon there and remove them.
        let (cleaned, error) = inner.remove_stray_dirs().await;
        report.cleaned.extend(cleaned);
        if let Some(e) = error {
            first_error.get_or_insert(e);
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
    /// The watch on daemon pods stops too; a detached manager supervises nothing more.
    pub fn detach(&self) {
        for (_, s) in lock(&self.inner.supervised).drain() {
            s.task.abort();
        }
        if let Some(watch) = self.inner.pod_watch.get() {
            watch.stop();
        }
    }
}

impl Inner {
    /// Removes the directories under `<plugin-dir>/mps` that no record owns and that are not
    /// NVIDIA's, after killing any MPS control daemon serving them. Returns what was removed
    /// and the first error.
    pub(super) async fn remove_stray_dirs(&self) -> (Vec<String>, Option<SharingError>) {
        let mut cleaned = Vec::new();
        let mut first_error = None;
        let mps_root = self.opts.mps_root();
        let Ok(entries) = std::fs::read_dir(&mps_root) else {
            return (cleaned, None);
        };
        let known: Vec<PathBuf> = lock(&self.state)
            .mps
            .values()
            .map(|r| r.dir.clone())
            .collect();
        let foreign = lock(&self.foreign_dirs).clone();
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
                mps::wait_gone(pid, self.opts.mps_quit_timeout).await;
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => cleaned.push(dir.display().to_string()),
                Err(e) => {
                    first_error.get_or_insert(SharingError::io("remove directory", &dir, e));
                }
            }
        }
        (cleaned, first_error)
    }
}
