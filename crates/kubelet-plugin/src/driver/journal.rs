//! The checkpoint journal: the checkpoint document in memory and its writes to disk, with
//! group commit.
//!
//! Every change goes through [`Journal::persist`], which applies it in memory and returns once
//! a write that contains it is durable (temp file, fsync, rename, fsync of the folder:
//! [`crate::checkpoint_file::write_bytes`]).
//!
//! Invariants:
//! - the file on disk is always one whole document as it was in memory at some moment: writes
//!   are serialized and each serializes the document under the state lock;
//! - when `persist` returns `Ok`, its change is on disk;
//! - group commit: changes made while a write is in flight are written together by the next
//!   writer, and a caller whose change an earlier write already carried returns without
//!   writing, so concurrent claims share one write instead of queueing one each;
//! - the in-memory document is the truth for this process's readers even when a write failed
//!   (the caller then fails its operation, and its rollback or retry writes again);
//! - [`Journal::stage`] changes the document in memory only: the next write carries the
//!   change. For a step whose loss in a crash is harmless (prepare's `PrepareStarted` of a
//!   claim whose only effect is its CDI spec: a spec the checkpoint does not name is removed
//!   as stray), so that an operation makes one durable commit instead of two.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpu_dra_core::checkpoint::{Checkpoint, ClaimEntry};

use super::{DriverError, blocking, lock};
use crate::metrics::Metrics;

/// The checkpoint in memory and the one writer of its file.
pub(super) struct Journal {
    path: PathBuf,
    state: Mutex<State>,
    /// Serializes file writes; holds the change count last written.
    writer: tokio::sync::Mutex<u64>,
    /// Recounts NVIDIA's `prepared_devices` from the document on every change, as NVIDIA's
    /// driver recounts it from its checkpoint.
    metrics: Option<Arc<Metrics>>,
}

struct State {
    doc: Checkpoint,
    /// Bumped on every in-memory change.
    changes: u64,
}

impl Journal {
    /// A journal of `doc`, as loaded from `path`, where it is written.
    pub(super) fn new(path: PathBuf, doc: Checkpoint) -> Self {
        Journal {
            path,
            state: Mutex::new(State { doc, changes: 0 }),
            writer: tokio::sync::Mutex::new(0),
            metrics: None,
        }
    }

    /// Keeps `metrics`' count of prepared devices by type in step with the document (counted
    /// now and after every change).
    pub(super) fn counted_in(mut self, metrics: Arc<Metrics>) -> Self {
        self.read(|doc| metrics.nvidia.count_prepared(doc));
        self.metrics = Some(metrics);
        self
    }

    /// Reads the document in memory (under its lock: keep `f` short).
    pub(super) fn read<R>(&self, f: impl FnOnce(&Checkpoint) -> R) -> R {
        f(&lock(&self.state).doc)
    }

    /// A copy of claim `uid`'s entry.
    pub(super) fn entry(&self, uid: &str) -> Option<ClaimEntry> {
        self.read(|doc| doc.claims.get(uid).cloned())
    }

    /// Applies `change` to the checkpoint in memory only; the next [`Journal::persist`] (of
    /// any claim) writes it.
    pub(super) fn stage(&self, change: impl FnOnce(&mut Checkpoint)) {
        self.apply(change);
    }

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

    /// Applies `change` to the checkpoint and returns once a write containing it is durable.
    pub(super) async fn persist(
        &self,
        change: impl FnOnce(&mut Checkpoint),
    ) -> Result<(), DriverError> {
        let mine = self.apply(change);
        let mut written = self.writer.lock().await;
        if *written >= mine {
            // A write that started after our change already made it durable.
            return Ok(());
        }
        let (bytes, upto) = {
            let st = lock(&self.state);
            (st.doc.to_json(), st.changes)
        };
        let path = self.path.clone();
        blocking(move || crate::checkpoint_file::write_bytes(&path, &bytes)).await??;
        *written = upto;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn on_disk(path: &std::path::Path) -> Checkpoint {
        Checkpoint::from_json(&std::fs::read(path).expect("file")).expect("valid")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_change_is_on_disk_when_its_persist_returns_also_among_concurrent_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(gpu_dra_core::checkpoint::FILE_NAME);
        let journal = Arc::new(Journal::new(path.clone(), Checkpoint::new()));
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let (journal, path) = (journal.clone(), path.clone());
                tokio::spawn(async move {
                    let uid = format!("uid-{i}");
                    let added = uid.clone();
                    journal
                        .persist(move |cp| {
                            cp.imported_from_nvidia.insert(added);
                        })
                        .await
                        .expect("persists");
                    assert!(
                        on_disk(&path).imported_from_nvidia.contains(&uid),
                        "{uid} is durable once persist returns"
                    );
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("joins");
        }
        let cp = on_disk(&path);
        assert_eq!(cp.imported_from_nvidia.len(), 32);
        assert_eq!(cp, journal.read(Checkpoint::clone), "disk and memory agree");
    }

    #[tokio::test]
    async fn a_staged_change_stays_in_memory_until_the_next_write_carries_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(gpu_dra_core::checkpoint::FILE_NAME);
        let journal = Journal::new(path.clone(), Checkpoint::new());
        journal.stage(|cp| {
            cp.imported_from_nvidia.insert("staged".into());
        });
        assert!(!path.exists(), "nothing written by a staged change");
        assert!(journal.read(|cp| cp.imported_from_nvidia.contains("staged")));
        journal
            .persist(|cp| {
                cp.imported_from_nvidia.insert("durable".into());
            })
            .await
            .expect("persists");
        let cp = on_disk(&path);
        assert!(cp.imported_from_nvidia.contains("staged"));
        assert!(cp.imported_from_nvidia.contains("durable"));
    }

    #[tokio::test]
    async fn a_failed_write_names_the_file_and_the_change_stays_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A regular file where the folder should be: the write cannot succeed.
        std::fs::write(dir.path().join("plugin"), "").expect("file");
        let path = dir.path().join("plugin").join("checkpoint");
        let journal = Journal::new(path.clone(), Checkpoint::new());
        let err = journal
            .persist(|cp| {
                cp.imported_from_nvidia.insert("uid-a".into());
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
        assert!(journal.read(|cp| cp.imported_from_nvidia.contains("uid-a")));
    }
}
