//! The checkpoint journal: the checkpoint document in memory and its durable commits, with
//! group commit.
//!
//! The problem: a durable write of the whole checkpoint (temp file, fsync, rename, fsync of
//! the folder: [`crate::checkpoint_file::write_bytes`]) is the floor of what a file write
//! costs, and every prepare and unprepare made one, so an unprepare could not cost less than
//! the floor plus the call's transport. And each write created a new inode (the temp file),
//! most of the kernel CPU of a prepare in bursts.
//!
//! The fix: a commit appends one record ([`ChangeRecord`]: the new state of what changed) to
//! a preallocated journal beside the checkpoint
//! ([`gpu_dra_core::checkpoint::JOURNAL_FILE_NAME`],
//! [`gpu_dra_fsutil::record_log`]): one `fdatasync` of blocks the file already owns, no new
//! inode, no rename, no folder fsync (0.08 ms against 0.38-0.48 ms for the floor on the disk
//! this was measured on). The journal is folded into the checkpoint (compaction: the whole
//! document written as before, then the journal emptied) when it has been idle for
//! [`IDLE_COMPACTION`], when a record no longer fits, at start and at a graceful stop
//! ([`Journal::compact`]).
//!
//! Invariants:
//! - the durable state is the checkpoint file with the journal's records replayed over it;
//!   the journal names the checkpoint it extends (length and CRC-32 of the file's bytes,
//!   [`file_tag`]). A compaction writes the checkpoint before it empties the journal, so a
//!   crash between the two leaves a journal whose base no longer matches: it is dropped, as
//!   the checkpoint already holds all it said. A checkpoint rewritten by anyone else (an older
//!   plugin version after a downgrade) drops the journal the same way, so records never
//!   replay over a document they did not extend;
//! - when [`Journal::persist`] returns `Ok`, its change is durable (in a record or in the
//!   checkpoint); commits are serialized (the writer lock), and each carries every change
//!   made in memory before it: group commit, a caller whose change an earlier commit already
//!   carried returns without writing;
//! - a torn last record (a crash while it was written) fails its CRC and is dropped at start
//!   with what follows it: its commit never returned, so no caller was told it succeeded;
//! - the in-memory document is the truth for this process's readers even when a commit
//!   failed (the caller then fails its operation, and its rollback or retry commits again);
//! - [`Journal::stage`] changes the document in memory only: the next commit carries the
//!   change. For a step whose loss in a crash is harmless (prepare's `PrepareStarted` of a
//!   claim whose only effect is its CDI spec: a spec the checkpoint does not name is removed
//!   as stray), so that an operation makes one durable commit instead of two;
//! - the checkpoint file stays in its format and is the only thing an older version reads.
//!   After a graceful stop it is exact (compacted). After a crash it lacks the records since
//!   the last compaction (at most [`IDLE_COMPACTION`] of activity, or a burst): see
//!   `docs/STATUS.md` for what a downgrade right after a crash loses.
//!
//! Alternatives rejected: appending to a growing file (its size changes, so `fdatasync`
//! commits the inode too: 0.11 ms against 0.08 ms measured); keeping only the journal
//! (an older version reads the checkpoint only); a record per operation kind (prepare,
//! unprepare, MIG intent): a record of new states works for every change the engine makes,
//! its callers stay as they are, and replaying it twice is harmless.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use gpu_dra_core::checkpoint::{ChangeRecord, Checkpoint, ClaimEntry};
use gpu_dra_fsutil::record_log::{self, RecordLog};
use tracing::{info, warn};

use super::{DriverError, blocking, lock};
use crate::checkpoint_file::{self, CheckpointFileError};
use crate::metrics::Metrics;

/// How long the journal stays unchanged before it is folded into the checkpoint.
pub const IDLE_COMPACTION: Duration = Duration::from_millis(200);
/// Size of the journal file: a record is a claim's entry (some 0.5 KiB per device), so
/// thousands of operations fit between compactions.
pub const JOURNAL_CAPACITY: u64 = 1 << 20;

/// The checkpoint in memory and the one writer of its files.
pub(super) struct Journal {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    state: Mutex<State>,
    /// Serializes commits; taken in blocking threads only (held across file I/O).
    writer: Mutex<Writer>,
    /// Recounts NVIDIA's `prepared_devices` from the document on every change, as NVIDIA's
    /// driver recounts it from its checkpoint.
    metrics: Option<Arc<Metrics>>,
    idle: Duration,
    /// A task waits to compact the journal once it is idle.
    compaction_armed: AtomicBool,
}

struct State {
    doc: Checkpoint,
    /// Bumped on every in-memory change.
    changes: u64,
}

struct Writer {
    /// The change count the durable state carries.
    written: u64,
    /// The document as the checkpoint file and the journal's records hold it.
    durable: Checkpoint,
    log: RecordLog,
    /// The journal's base is the checkpoint file as it is now; false after a failed reset,
    /// when records would extend a file they do not name: every commit compacts until a
    /// reset succeeds.
    log_ok: bool,
    last_append: Instant,
    /// The journal was dropped: nothing is written any more.
    closed: bool,
}

/// The tag of the checkpoint's bytes a journal extends: length and CRC-32.
pub(super) fn file_tag(bytes: &[u8]) -> u64 {
    ((bytes.len() as u64) << 32) ^ u64::from(record_log::crc32(bytes))
}

fn journal_path(checkpoint: &Path) -> PathBuf {
    crate::node_layout::checkpoint_journal_in(checkpoint.parent().unwrap_or(Path::new(".")))
}

/// Our checkpoint at `path` (a missing file is an empty one) and the tag of its bytes.
fn read_own(path: &Path) -> Result<(Checkpoint, u64), CheckpointFileError> {
    match checkpoint_file::read(path)? {
        Some(bytes) => Ok((checkpoint_file::parse_ours(path, &bytes)?, file_tag(&bytes))),
        None => Ok((Checkpoint::new(), file_tag(&[]))),
    }
}

/// The tag of the file at `path` (a missing file has the tag of no bytes).
fn read_tag(path: &Path) -> Result<u64, CheckpointFileError> {
    Ok(checkpoint_file::read(path)?.map_or_else(|| file_tag(&[]), |bytes| file_tag(&bytes)))
}

/// The records of `replay` that extend the checkpoint whose tag is `tag`, replayed over
/// `doc`; how many were. A record that does not parse ends the replay, as a torn one does.
fn replay(journal: &Path, replay: record_log::Replay, tag: u64, doc: &mut Checkpoint) -> usize {
    if replay.base != Some(tag) {
        if !replay.records.is_empty() {
            info!(path = %journal.display(), records = replay.records.len(), "checkpoint journal extends an earlier version of the checkpoint, which holds its changes or was rewritten since (by an older plugin version): its records are dropped");
        }
        return 0;
    }
    let mut applied = 0;
    for bytes in replay.records {
        match ChangeRecord::from_json(&bytes) {
            Ok(record) => record.apply(doc),
            Err(e) => {
                warn!(path = %journal.display(), record = applied, error = %e, "checkpoint journal record cannot be read; it and the records after it are dropped");
                break;
            }
        }
        applied += 1;
    }
    applied
}

/// The prepared claims as they are durable at `checkpoint` (our format only): the file with
/// its journal's records replayed over it. What a restarted plugin starts from; for tools and
/// tests that read the node's state while no plugin runs or while one does.
pub fn durable_checkpoint(checkpoint: &Path) -> Result<Checkpoint, CheckpointFileError> {
    let (mut doc, tag) = read_own(checkpoint)?;
    let journal = journal_path(checkpoint);
    let found = record_log::read(&journal).map_err(|e| CheckpointFileError::Read {
        path: journal.display().to_string(),
        reason: e.to_string(),
    })?;
    replay(&journal, found, tag, &mut doc);
    Ok(doc)
}

impl Journal {
    /// Opens the checkpoint at `path` with its journal: replays the journal's records over
    /// the file and folds them into it, then opens the file as [`crate::checkpoint_file::open`]
    /// does (migration, NVIDIA's import), so those see every committed change. Compacts
    /// after [`IDLE_COMPACTION`] of quiet.
    pub(super) fn open(path: PathBuf) -> Result<Self, DriverError> {
        Self::open_with(path, IDLE_COMPACTION, JOURNAL_CAPACITY)
    }

    fn open_with(path: PathBuf, idle: Duration, capacity: u64) -> Result<Self, DriverError> {
        let journal = journal_path(&path);
        // The plugin folder may be new (the journal is the first file the driver keeps there).
        if let Some(dir) = journal.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| CheckpointFileError::write(dir, e))?;
        }
        let (mut log, found) = RecordLog::open(&journal, capacity, 0o600)
            .map_err(|e| CheckpointFileError::write(&journal, e))?;
        let (mut doc, mut tag) = read_own(&path)?;
        let base = found.base;
        let applied = replay(&journal, found, tag, &mut doc);
        if applied > 0 {
            let bytes = doc.to_json();
            crate::checkpoint_file::write_bytes(&path, &bytes)?;
            tag = file_tag(&bytes);
            info!(path = %path.display(), records = applied, "checkpoint journal folded into the checkpoint");
        }
        let doc = crate::checkpoint_file::open(&path)?;
        // The migration of our old file or NVIDIA's import may have rewritten it.
        let now = read_tag(&path)?;
        if base != Some(now) || now != tag || log.used() > 0 {
            log.reset(now)
                .map_err(|e| CheckpointFileError::write(&journal, e))?;
        }
        Ok(Journal {
            inner: Arc::new(Inner {
                path,
                state: Mutex::new(State {
                    doc: doc.clone(),
                    changes: 0,
                }),
                writer: Mutex::new(Writer {
                    written: 0,
                    durable: doc,
                    log,
                    log_ok: true,
                    last_append: Instant::now(),
                    closed: false,
                }),
                metrics: None,
                idle,
                compaction_armed: AtomicBool::new(false),
            }),
        })
    }

    /// Keeps `metrics`' count of prepared devices by type in step with the document (counted
    /// now and after every change).
    pub(super) fn counted_in(mut self, metrics: Arc<Metrics>) -> Self {
        self.read(|doc| metrics.nvidia.count_prepared(doc));
        // Not shared before the first commit.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.metrics = Some(metrics);
        }
        self
    }

    /// Reads the document in memory (under its lock: keep `f` short).
    pub(super) fn read<R>(&self, f: impl FnOnce(&Checkpoint) -> R) -> R {
        f(&lock(&self.inner.state).doc)
    }

    /// A copy of claim `uid`'s entry.
    pub(super) fn entry(&self, uid: &str) -> Option<ClaimEntry> {
        self.read(|doc| doc.claims.get(uid).cloned())
    }

    /// Applies `change` to the checkpoint in memory only; the next [`Journal::persist`] (of
    /// any claim) makes it durable.
    pub(super) fn stage(&self, change: impl FnOnce(&mut Checkpoint)) {
        self.inner.apply(change);
    }

    /// Applies `change` to the checkpoint and returns once a commit containing it is durable.
    pub(super) async fn persist(
        &self,
        change: impl FnOnce(&mut Checkpoint),
    ) -> Result<(), DriverError> {
        let mine = self.inner.apply(change);
        let inner = self.inner.clone();
        let appended = blocking(move || inner.commit(mine)).await??;
        if appended && !self.inner.compaction_armed.swap(true, Ordering::AcqRel) {
            tokio::spawn(compact_when_idle(Arc::downgrade(&self.inner)));
        }
        Ok(())
    }

    /// Folds the journal into the checkpoint now (a graceful stop: the checkpoint alone is
    /// then exact, also for an older version).
    pub(super) async fn compact(&self) -> Result<(), DriverError> {
        let inner = self.inner.clone();
        blocking(move || {
            let mut w = lock(&inner.writer);
            inner.compact_locked(&mut w)
        })
        .await??;
        Ok(())
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        // An idle compaction that wakes later must not write over a successor's files.
        lock(&self.inner.writer).closed = true;
    }
}

/// Waits until the journal has been idle for its interval, then compacts it; ends with the
/// journal.
async fn compact_when_idle(inner: Weak<Inner>) {
    let mut wait = inner.upgrade().map_or(Duration::ZERO, |i| i.idle);
    loop {
        tokio::time::sleep(wait).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        match blocking(move || inner.compact_if_idle()).await {
            Ok(Some(left)) => wait = left,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %e, "checkpoint compaction task failed; the next commit retries");
                return;
            }
        }
    }
}

impl Inner {
    /// Applies `change` in memory and returns the change count that carries it.
    fn apply(&self, change: impl FnOnce(&mut Checkpoint)) -> u64 {
        let mut st = lock(&self.state);
        change(&mut st.doc);
        st.changes += 1;
        if let Some(m) = &self.metrics {
            m.nvidia.count_prepared(&st.doc);
        }
        st.changes
    }

    /// Makes change `mine` durable: true when that took a journal record.
    fn commit(&self, mine: u64) -> Result<bool, CheckpointFileError> {
        let mut w = lock(&self.writer);
        if w.closed {
            return Err(self.closed_error());
        }
        if w.written >= mine {
            // A commit that started after our change already made it durable.
            return Ok(false);
        }
        let (record, upto) = {
            let st = lock(&self.state);
            (ChangeRecord::between(&w.durable, &st.doc), st.changes)
        };
        if record.is_empty() {
            w.written = upto;
            return Ok(false);
        }
        let payload = record.to_json();
        if !w.log_ok || !w.log.fits(payload.len()) {
            self.compact_locked(&mut w)?;
            return Ok(false);
        }
        let journal = w.log.path().to_owned();
        w.log
            .append(&payload)
            .map_err(|e| CheckpointFileError::write(&journal, e))?;
        record.apply(&mut w.durable);
        w.written = upto;
        w.last_append = Instant::now();
        Ok(true)
    }

    /// Writes the whole document to the checkpoint and empties the journal.
    fn compact_locked(&self, w: &mut Writer) -> Result<(), CheckpointFileError> {
        if w.closed {
            return Err(self.closed_error());
        }
        let (doc, upto) = {
            let st = lock(&self.state);
            (st.doc.clone(), st.changes)
        };
        if w.log_ok && w.log.used() == 0 && doc == w.durable {
            return Ok(());
        }
        let bytes = doc.to_json();
        crate::checkpoint_file::write_bytes(&self.path, &bytes)?;
        // The file holds everything now: whatever happens to the journal, nothing is lost.
        w.durable = doc;
        w.written = upto;
        let journal = w.log.path().to_owned();
        w.log_ok = false;
        w.log
            .reset(file_tag(&bytes))
            .map_err(|e| CheckpointFileError::write(&journal, e))?;
        w.log_ok = true;
        Ok(())
    }

    /// Compacts once the journal has been idle long enough; `Some(wait)` when it has not.
    fn compact_if_idle(&self) -> Option<Duration> {
        let mut w = lock(&self.writer);
        if !w.closed {
            let quiet = w.last_append.elapsed();
            if quiet < self.idle {
                return Some(self.idle - quiet);
            }
            if let Err(e) = self.compact_locked(&mut w) {
                warn!(error = %e, "cannot fold the checkpoint journal into the checkpoint; commits go on in the journal and the next one retries");
            }
        }
        self.compaction_armed.store(false, Ordering::Release);
        None
    }

    fn closed_error(&self) -> CheckpointFileError {
        CheckpointFileError::write(
            &self.path,
            std::io::Error::other("the driver that wrote it was stopped"),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpu_dra_core::checkpoint::FILE_NAME;

    use super::*;

    /// The durable state: the file with the journal replayed over it.
    fn durable(path: &Path) -> Checkpoint {
        durable_checkpoint(path).expect("reads")
    }

    /// The checkpoint file alone, as an older version reads it.
    fn file_alone(path: &Path) -> Checkpoint {
        Checkpoint::from_json(&std::fs::read(path).expect("file")).expect("valid")
    }

    fn journal_records(path: &Path) -> usize {
        record_log::read(&journal_path(path))
            .expect("reads")
            .records
            .len()
    }

    /// A journal that never compacts by itself within a test.
    fn open(path: &Path) -> Journal {
        Journal::open_with(path.to_owned(), Duration::from_secs(3600), JOURNAL_CAPACITY)
            .expect("opens")
    }

    fn claim_entry() -> ClaimEntry {
        ClaimEntry {
            state: gpu_dra_core::checkpoint::PrepareState::PrepareCompleted,
            namespace: "ns".into(),
            name: "claim".into(),
            devices: Vec::new(),
            sharing: None,
            boot_id: None,
            driver_version: None,
            imported: None,
            dynamic_mig: Vec::new(),
            extra: Default::default(),
        }
    }

    async fn add(journal: &Journal, uid: &str) {
        let uid = uid.to_owned();
        journal
            .persist(move |cp| {
                cp.imported_from_nvidia.insert(uid);
            })
            .await
            .expect("persists");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_change_is_durable_when_its_persist_returns_also_among_concurrent_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = Arc::new(open(&path));
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let (journal, path) = (journal.clone(), path.clone());
                tokio::spawn(async move {
                    let uid = format!("uid-{i}");
                    add(&journal, &uid).await;
                    assert!(
                        durable(&path).imported_from_nvidia.contains(&uid),
                        "{uid} is durable once persist returns"
                    );
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("joins");
        }
        let cp = durable(&path);
        assert_eq!(cp.imported_from_nvidia.len(), 32);
        assert_eq!(cp, journal.read(Checkpoint::clone), "disk and memory agree");
        let records = journal_records(&path);
        assert!(
            (1..=32).contains(&records),
            "group commit: at most one record per change, {records}"
        );
    }

    #[tokio::test]
    async fn a_commit_is_a_journal_record_and_a_restart_folds_it_into_the_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = open(&path);
        add(&journal, "uid-a").await;
        assert!(!path.exists(), "no checkpoint write for a commit");
        assert_eq!(journal_records(&path), 1);
        // A crash: nothing is compacted on the way out.
        drop(journal);
        let journal = open(&path);
        assert!(journal.read(|cp| cp.imported_from_nvidia.contains("uid-a")));
        assert!(
            file_alone(&path).imported_from_nvidia.contains("uid-a"),
            "the restart folded the record into the file an older version reads"
        );
        assert_eq!(journal_records(&path), 0, "and emptied the journal");
        // A restart with nothing to replay writes nothing.
        let before = std::fs::metadata(&path).expect("file").modified().ok();
        drop(journal);
        let _journal = open(&path);
        assert_eq!(
            std::fs::metadata(&path).expect("file").modified().ok(),
            before
        );
    }

    #[tokio::test]
    async fn a_staged_change_stays_in_memory_until_the_next_commit_carries_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = open(&path);
        journal.stage(|cp| {
            cp.imported_from_nvidia.insert("staged".into());
        });
        assert_eq!(
            journal_records(&path),
            0,
            "nothing written by a staged change"
        );
        assert!(journal.read(|cp| cp.imported_from_nvidia.contains("staged")));
        add(&journal, "durable").await;
        let cp = durable(&path);
        assert!(cp.imported_from_nvidia.contains("staged"));
        assert!(cp.imported_from_nvidia.contains("durable"));
        assert_eq!(journal_records(&path), 1, "one commit carries both");
    }

    #[tokio::test]
    async fn a_torn_last_record_is_dropped_at_start_with_its_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = open(&path);
        add(&journal, "uid-a").await;
        add(&journal, "uid-b").await;
        drop(journal);
        // The crash hit while the second record was written: its last bytes never made it.
        let log = journal_path(&path);
        let mut bytes = std::fs::read(&log).expect("journal");
        let end = bytes.iter().rposition(|&b| b != 0).expect("records");
        bytes[end - 2..=end].fill(0);
        std::fs::write(&log, bytes).expect("tear");
        let journal = open(&path);
        let cp = journal.read(Checkpoint::clone);
        assert!(cp.imported_from_nvidia.contains("uid-a"));
        assert!(
            !cp.imported_from_nvidia.contains("uid-b"),
            "the torn record's change (its persist never returned) is gone"
        );
        assert_eq!(file_alone(&path), cp);
        // Commits go on after it.
        add(&journal, "uid-c").await;
        assert_eq!(durable(&path).imported_from_nvidia.len(), 2);
    }

    #[tokio::test]
    async fn a_crash_between_compactions_two_writes_loses_nothing_and_replays_nothing_twice() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = open(&path);
        add(&journal, "uid-a").await;
        journal
            .persist(|cp| {
                cp.imported_from_nvidia.remove("uid-a");
                cp.imported_from_nvidia.insert("uid-b".into());
            })
            .await
            .expect("persists");
        let expected = journal.read(Checkpoint::clone);
        drop(journal);
        // Compaction's first write is done, the journal not yet emptied.
        crate::checkpoint_file::write_bytes(&path, &expected.to_json()).expect("write");
        assert_eq!(journal_records(&path), 2);
        assert_eq!(durable(&path), expected);
        let journal = open(&path);
        assert_eq!(journal.read(Checkpoint::clone), expected);
        assert_eq!(journal_records(&path), 0);
    }

    #[tokio::test]
    async fn a_checkpoint_rewritten_by_an_older_version_drops_the_journal_that_extended_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal = open(&path);
        add(&journal, "uid-a").await;
        drop(journal);
        // Downgraded after the crash: the older version knew nothing of uid-a and wrote its
        // own state.
        let mut older = Checkpoint::new();
        older.imported_from_nvidia.insert("uid-old".into());
        crate::checkpoint_file::write_bytes(&path, &older.to_json()).expect("write");
        assert_eq!(durable(&path), older);
        let journal = open(&path);
        assert_eq!(
            journal.read(Checkpoint::clone),
            older,
            "records do not replay over a document they did not extend"
        );
    }

    #[tokio::test]
    async fn the_journal_is_compacted_when_idle_when_full_and_on_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal =
            Journal::open_with(path.clone(), Duration::from_millis(20), 4096).expect("opens");
        add(&journal, "uid-a").await;
        assert_eq!(journal_records(&path), 1);
        let deadline = Instant::now() + Duration::from_secs(10);
        while journal_records(&path) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(journal_records(&path), 0, "compacted once idle");
        assert!(file_alone(&path).imported_from_nvidia.contains("uid-a"));

        // Full: a record that does not fit is a compaction instead (no idle one here).
        drop(journal);
        let journal =
            Journal::open_with(path.clone(), Duration::from_secs(3600), 4096).expect("opens");
        for i in 0..200 {
            let uid = format!("uid-{i}");
            journal
                .persist(move |cp| {
                    cp.claims.insert(uid, claim_entry());
                })
                .await
                .expect("persists");
        }
        assert_eq!(durable(&path).claims.len(), 200);
        let alone = file_alone(&path).claims.len();
        assert!(alone > 0, "compacted on the way: {alone}");

        // On request (a graceful stop): the file alone is exact.
        journal.compact().await.expect("compacts");
        assert_eq!(file_alone(&path), journal.read(Checkpoint::clone));
        assert_eq!(journal_records(&path), 0);
    }

    #[tokio::test]
    async fn a_failed_write_names_the_file_and_the_change_stays_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal =
            Journal::open_with(path.clone(), Duration::from_secs(3600), 256).expect("opens");
        // A folder where the checkpoint should be: the compaction a big change needs fails.
        std::fs::create_dir(&path).expect("folder");
        let err = journal
            .persist(|cp| {
                cp.imported_from_nvidia
                    .extend((0..20).map(|i| format!("uid-{i:040}")));
            })
            .await
            .expect_err("cannot write");
        assert!(
            matches!(err, DriverError::Checkpoint(_))
                && err
                    .to_string()
                    .starts_with(&format!("cannot write checkpoint {}", path.display())),
            "{err}"
        );
        assert!(journal.read(|cp| cp.imported_from_nvidia.contains(&format!("uid-{:040}", 0))));
        // Once the file can be written, the next commit carries the change.
        std::fs::remove_dir(&path).expect("rm");
        add(&journal, "uid-next").await;
        assert_eq!(durable(&path).imported_from_nvidia.len(), 21);
    }

    #[tokio::test]
    async fn a_stopped_journal_writes_nothing_more() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let journal =
            Journal::open_with(path.clone(), Duration::from_millis(1), 4096).expect("opens");
        let inner = journal.inner.clone();
        add(&journal, "uid-a").await;
        drop(journal);
        // A successor owns the files now; a late compaction of the old one must not write.
        let _successor = open(&path);
        assert_eq!(inner.compact_if_idle(), None);
        assert!(inner.commit(u64::MAX).is_err());
        assert!(file_alone(&path).imported_from_nvidia.contains("uid-a"));
    }
}
