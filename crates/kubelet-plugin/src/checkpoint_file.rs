//! Opening the checkpoint at start: our own file, the migration from the name this plugin
//! used before, and the import of NVIDIA's driver's checkpoint.
//!
//! The problem: this plugin and NVIDIA's both kept `<plugin-dir>/checkpoint.json`, and the
//! plugin directory is the same (`/var/lib/kubelet/plugins/gpu.nvidia.com`), so a node moving
//! from NVIDIA's driver to this one found a file without an integer `version` and crash-looped.
//!
//! The fix, in this order:
//! 1. Our file is [`checkpoint::FILE_NAME`]; it is authoritative once it exists.
//! 2. A `checkpoint.json` in our format (integer `version`) is ours from before the rename: it
//!    is read, written under the new name atomically, then removed. If both exist, the old
//!    name was written last (by a crash between the write and the removal, which leaves two
//!    equal files, or by an older plugin version run after this one), so it wins.
//! 3. A `checkpoint.json` in NVIDIA's format is read ([`gpu_dra_core::nvidia_checkpoint`]) and
//!    left untouched, so rolling back to NVIDIA's driver still works. Claims it lists that we
//!    have not seen are imported as entries marked `imported`, which reserves their devices,
//!    answers their repeat prepare and lets their unprepare clean up. Every UID seen is
//!    remembered in `importedFromNvidia`, so a claim is imported once: unpreparing it does not
//!    bring it back from NVIDIA's file at the next start.
//!
//! A file of ours that does not parse fails the start with the path and what to do: guessing
//! would risk preparing a device twice. NVIDIA's file that does not parse (or the classic-DRA
//! layout, which has nothing importable) is logged and kept, and the plugin starts without
//! its claims: refusing to start would only turn a node that can no longer run NVIDIA's
//! driver into one that runs no driver. The log says that those claims' devices are not
//! reserved.
//!
//! Alternatives rejected: rewriting NVIDIA's file (breaks rollback and would need their
//! checksum); importing on every start without memory (resurrects unprepared claims).
//!
//! The file's errors ([`CheckpointFileError`]) and its crash-safe write ([`write_bytes`]) live
//! here too: the driver's journal writes through it, so this module depends on nothing of the
//! driver.

use std::collections::BTreeSet;
use std::path::Path;

use gpu_dra_core::checkpoint::{self, Checkpoint};
use gpu_dra_core::nvidia_checkpoint;
use tracing::{info, warn};

/// Why the checkpoint file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointFileError {
    /// Reading the checkpoint at start failed, or it is not a checkpoint of ours.
    #[error(
        "cannot read checkpoint {path}: {reason}; fix the file, or move it away to start with no prepared claims (their devices are then not reserved and running pods keep them)"
    )]
    Read {
        /// Checkpoint path.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// Writing (or removing) a checkpoint file failed.
    #[error("cannot write checkpoint {path}: {source}")]
    Write {
        /// Checkpoint path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl CheckpointFileError {
    /// A [`CheckpointFileError::Write`] of `path`.
    pub fn write(path: &Path, source: std::io::Error) -> Self {
        CheckpointFileError::Write {
            path: path.display().to_string(),
            source,
        }
    }
}

/// The bytes of the file at `path`; `None` when there is none.
pub(crate) fn read(path: &Path) -> Result<Option<Vec<u8>>, CheckpointFileError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointFileError::Read {
            path: path.display().to_string(),
            reason: e.to_string(),
        }),
    }
}

/// `bytes`, read from `path`, as a checkpoint of our format.
pub(crate) fn parse_ours(path: &Path, bytes: &[u8]) -> Result<Checkpoint, CheckpointFileError> {
    Checkpoint::from_json(bytes).map_err(|e| CheckpointFileError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Writes `bytes` (a checkpoint's JSON) to `path` crash-safely, readable by its owner only.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<(), CheckpointFileError> {
    gpu_dra_fsutil::write_atomic(path, bytes, 0o600)
        .map_err(|source| CheckpointFileError::write(path, source))
}

fn write(path: &Path, doc: &Checkpoint) -> Result<(), CheckpointFileError> {
    write_bytes(path, &doc.to_json())
}

/// Opens the checkpoint at `path` (conventionally `<plugin-dir>/gpu-dra-checkpoint.json`),
/// migrating our `checkpoint.json` next to it or importing NVIDIA's, as the module explains.
/// A missing file is an empty checkpoint.
pub fn open(path: &Path) -> Result<Checkpoint, CheckpointFileError> {
    let legacy = path.with_file_name(checkpoint::LEGACY_FILE_NAME);
    let mut doc = match read(path)? {
        Some(bytes) => parse_ours(path, &bytes)?,
        None => Checkpoint::new(),
    };
    if legacy == path {
        return Ok(doc);
    }
    let Some(old) = read(&legacy)? else {
        return Ok(doc);
    };
    if checkpoint::is_own_format(&old) {
        doc = parse_ours(&legacy, &old)?;
        write(path, &doc)?;
        gpu_dra_fsutil::remove_durable(&legacy)
            .map_err(|source| CheckpointFileError::write(&legacy, source))?;
        info!(from = %legacy.display(), to = %path.display(), claims = doc.claims.len(), "checkpoint moved to its new name");
        return Ok(doc);
    }
    if import_nvidia(&legacy, &old, &mut doc) {
        write(path, &doc)?;
    }
    Ok(doc)
}

/// Adds the claims of NVIDIA's checkpoint not seen before to `doc`; true when `doc` changed.
fn import_nvidia(legacy: &Path, bytes: &[u8], doc: &mut Checkpoint) -> bool {
    let import = match nvidia_checkpoint::parse(bytes) {
        Ok(import) => import,
        Err(e) => {
            warn!(
                path = %legacy.display(),
                error = %e,
                "NVIDIA driver checkpoint cannot be imported; it is left in place and the plugin starts without its claims, whose devices are not reserved: drain GPU pods on this node if any still run"
            );
            return false;
        }
    };
    for s in &import.skipped {
        warn!(path = %legacy.display(), claim.uid = %s.uid, reason = %s.reason, "claim in NVIDIA driver checkpoint not imported; its devices are not reserved");
    }
    let listed: BTreeSet<&String> = import
        .claims
        .keys()
        .chain(import.skipped.iter().map(|s| &s.uid))
        .collect();
    let before = doc.imported_from_nvidia.len();
    // Forget UIDs NVIDIA no longer lists, so the set stays as small as their file.
    doc.imported_from_nvidia.retain(|uid| listed.contains(uid));
    let mut changed = doc.imported_from_nvidia.len() != before;
    for (uid, entry) in import.claims {
        if !doc.imported_from_nvidia.insert(uid.clone()) {
            continue;
        }
        changed = true;
        if doc.claims.contains_key(&uid) {
            continue;
        }
        info!(
            claim.uid = %uid,
            claim = %format!("{}/{}", entry.namespace, entry.name),
            state = ?entry.state,
            devices = entry.devices.len(),
            format = import.format.as_str(),
            "imported claim prepared by NVIDIA's driver"
        );
        doc.claims.insert(uid, entry);
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_core::checkpoint::PrepareState;

    const NVIDIA_V2: &str = include_str!("../../core/testdata/nvidia-checkpoint-v2.json");
    const OURS_V1: &str = include_str!("../../core/testdata/checkpoint-v1.json");

    fn paths(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        (
            dir.join(checkpoint::FILE_NAME),
            dir.join(checkpoint::LEGACY_FILE_NAME),
        )
    }

    #[test]
    fn our_old_file_moves_to_the_new_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (new, old) = paths(dir.path());
        std::fs::write(&old, OURS_V1).expect("write");
        let doc = open(&new).expect("opens");
        assert_eq!(doc.claims.len(), 2);
        assert!(!old.exists(), "the old name is removed");
        assert_eq!(
            Checkpoint::from_json(&std::fs::read(&new).expect("new")).expect("parses"),
            doc
        );
        // Opening again reads the new file only.
        assert_eq!(open(&new).expect("again"), doc);
    }

    #[test]
    fn our_old_file_next_to_the_new_one_wins() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (new, old) = paths(dir.path());
        std::fs::write(&new, Checkpoint::new().to_json()).expect("write");
        std::fs::write(&old, OURS_V1).expect("write");
        assert_eq!(open(&new).expect("opens").claims.len(), 2);
        assert!(!old.exists());
    }

    #[test]
    fn a_corrupt_file_of_ours_fails_naming_the_file_and_what_to_do() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (new, old) = paths(dir.path());
        std::fs::write(&new, "{").expect("write");
        let err = open(&new).expect_err("corrupt").to_string();
        assert!(
            err.contains(checkpoint::FILE_NAME) && err.contains("move"),
            "{err}"
        );
        std::fs::remove_file(&new).expect("rm");
        std::fs::write(&old, r#"{"version": 1, "claims": 7}"#).expect("write");
        let err = open(&new).expect_err("corrupt old").to_string();
        assert!(err.contains(checkpoint::LEGACY_FILE_NAME), "{err}");
    }

    #[test]
    fn nvidias_file_is_imported_once_and_left_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (new, old) = paths(dir.path());
        std::fs::write(&old, NVIDIA_V2).expect("write");
        let doc = open(&new).expect("opens");
        assert_eq!(doc.claims.len(), 4);
        assert_eq!(doc.imported_from_nvidia.len(), 4);
        assert!(doc.claims.values().all(|e| e.imported.is_some()));
        assert_eq!(std::fs::read_to_string(&old).expect("kept"), NVIDIA_V2);
        assert!(
            new.exists(),
            "our file is written and authoritative from now on"
        );

        // Unprepared meanwhile: the next start does not bring it back.
        let mut doc = doc;
        doc.claims
            .remove("3f0c1b7e-8a55-4d2a-9b61-0c3e5f7a9d11")
            .expect("there");
        write(&new, &doc).expect("write");
        let again = open(&new).expect("opens again");
        assert_eq!(again.claims.len(), 3);
        assert_eq!(std::fs::read_to_string(&old).expect("kept"), NVIDIA_V2);
    }

    #[test]
    fn a_new_nvidia_claim_after_a_rollback_is_imported_and_gone_ones_are_forgotten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (new, old) = paths(dir.path());
        let mut doc = Checkpoint::new();
        doc.imported_from_nvidia.extend([
            "3f0c1b7e-8a55-4d2a-9b61-0c3e5f7a9d11".to_owned(),
            "gone".to_owned(),
        ]);
        write(&new, &doc).expect("write");
        std::fs::write(&old, NVIDIA_V2).expect("write");
        let doc = open(&new).expect("opens");
        assert_eq!(doc.claims.len(), 3, "the one seen before is not imported");
        assert!(!doc.imported_from_nvidia.contains("gone"));
        assert_eq!(
            doc.claims["9e6f3a77-4c8d-4b1a-8e2f-9d0b5a7c1d44"].state,
            PrepareState::PrepareStarted
        );
    }

    #[test]
    fn garbage_or_classic_nvidia_files_are_kept_and_the_start_goes_on() {
        for content in [
            "garbage".to_owned(),
            include_str!("../../core/testdata/nvidia-checkpoint-classic-dra.json").to_owned(),
        ] {
            let dir = tempfile::tempdir().expect("tempdir");
            let (new, old) = paths(dir.path());
            std::fs::write(&old, &content).expect("write");
            let doc = open(&new).expect("starts");
            assert!(doc.claims.is_empty());
            assert_eq!(std::fs::read_to_string(&old).expect("kept"), content);
        }
    }
}
