//! Device metadata files on the node (Kubernetes KEP-5304; the format and the paths in
//! containers are [`gpu_dra_core::device_metadata`]'s): written at prepare when the plugin runs
//! with `--device-metadata`, mounted read-only through the claim's CDI spec, removed when the
//! claim is undone.
//!
//! One file per request of a prepared claim, `<plugin-dir>/device-metadata/<claim UID>_<request>.json`
//! ([`crate::node_layout::device_metadata_file`]): flat and named by claim UID, so that undoing
//! a claim, and the cleanup of files no checkpoint entry names, need nothing but the UID
//! (Kubernetes' Go helper keys its host folders by namespace and name instead; only the path
//! in containers is part of the format).
//!
//! Crash safety, as for the claim's CDI spec ([`crate::cdi_io`]): a file is replaced
//! atomically (temp file, rename), with its content fsynced only when the node's boot ID is
//! unknown, since a completed claim prepared in another boot is prepared again. The driver
//! writes the files before the spec that mounts them and removes them after it
//! ([`crate::driver`]), so no spec ever names a file that is not there; files no checkpoint
//! entry names are stray and the cleanup removes them ([`MetadataFiles::claims`]).
//!
//! A bind mount holds the file it was made from: a container keeps the content it started
//! with even when a later prepare of the claim (after a reboot) replaces the file.

use std::collections::BTreeSet;
use std::path::PathBuf;

use gpu_dra_core::device_metadata::RequestFile;

use crate::node_layout::{claim_uid_of_device_metadata_file, device_metadata_file};

/// Writing or removing a device metadata file failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write or remove device metadata file {path}: {source}")]
pub struct MetadataIoError {
    /// The file (or its folder).
    pub path: PathBuf,
    /// The I/O error.
    #[source]
    pub source: std::io::Error,
}

/// What the driver does about device metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMetadataSettings {
    /// The folder of the files ([`crate::node_layout::device_metadata_dir_in`]): files found
    /// there are undone with their claims, also when `enabled` is off.
    pub dir: PathBuf,
    /// Whether prepare writes the files and mounts them (`--device-metadata`).
    pub enabled: bool,
    /// Whether the node publishes list forms of attributes (`--list-type-attributes`): the
    /// files tell what the slices publish.
    pub list_forms: bool,
}

/// The folder of the device metadata files ([`crate::node_layout::device_metadata_dir_in`]).
#[derive(Debug, Clone)]
pub struct MetadataFiles {
    dir: PathBuf,
}

impl MetadataFiles {
    /// The files in `dir`.
    pub fn new(dir: PathBuf) -> Self {
        MetadataFiles { dir }
    }

    /// The host path of request `request`'s file of claim `claim_uid`.
    pub fn path(&self, claim_uid: &str, request: &str) -> PathBuf {
        device_metadata_file(&self.dir, claim_uid, request)
    }

    /// Writes the files of claim `claim_uid`, each atomically; with `sync_content` each is
    /// on disk before it replaces the old one.
    pub fn write(
        &self,
        claim_uid: &str,
        files: &[RequestFile],
        sync_content: bool,
    ) -> Result<(), MetadataIoError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| MetadataIoError {
            path: self.dir.clone(),
            source,
        })?;
        for file in files {
            let path = self.path(claim_uid, &file.request);
            let content = file.content();
            let written = if sync_content {
                gpu_dra_fsutil::replace_atomic(&path, &content, 0o644)
            } else {
                gpu_dra_fsutil::replace_volatile(&path, &content, 0o644)
            };
            written.map_err(|source| MetadataIoError { path, source })?;
        }
        Ok(())
    }

    /// Removes every file of claim `claim_uid`; none is not an error.
    pub fn remove(&self, claim_uid: &str) -> Result<(), MetadataIoError> {
        for path in self.files_of(|uid| uid == claim_uid) {
            gpu_dra_fsutil::remove(&path).map_err(|source| MetadataIoError { path, source })?;
        }
        Ok(())
    }

    /// Whether the file of `request` of claim `claim_uid` is missing.
    pub fn missing(&self, claim_uid: &str, request: &str) -> Option<PathBuf> {
        let path = self.path(claim_uid, request);
        (!path.exists()).then_some(path)
    }

    /// The UIDs of the claims that have files.
    pub fn claims(&self) -> BTreeSet<String> {
        self.files_of(|_| true)
            .iter()
            .filter_map(|p| p.file_name())
            .filter_map(|n| {
                claim_uid_of_device_metadata_file(&n.to_string_lossy()).map(str::to_owned)
            })
            .collect()
    }

    /// Removes the temp files interrupted writes left; returns how many.
    pub fn remove_stale_temps(&self) -> usize {
        gpu_dra_fsutil::remove_stale_temps(&self.dir, "")
    }

    fn files_of(&self, claim: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter(|e| {
                claim_uid_of_device_metadata_file(&e.file_name().to_string_lossy())
                    .is_some_and(&claim)
            })
            .map(|e| e.path())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use gpu_dra_core::device_metadata::{self, Rendering};
    use gpu_dra_core::plan::claim_input;
    use gpu_dra_device::testing::a100_inventory;

    use super::*;
    use crate::testing::allocated_claim;

    fn files(uid: &str, requests: &[&str]) -> Vec<RequestFile> {
        let devices: Vec<String> = (0..requests.len()).map(|i| format!("gpu-{i}")).collect();
        let results: Vec<(&str, &str)> = requests
            .iter()
            .zip(&devices)
            .map(|(r, d)| (*r, d.as_str()))
            .collect();
        let rc = allocated_claim("ns", "c", uid, "gpu.nvidia.com", "node", &results, &[]);
        let claim = claim_input(&rc, uid, "gpu.nvidia.com", "node").expect("claim input");
        device_metadata::request_files(
            &claim,
            None,
            &a100_inventory(4, 0),
            Rendering {
                driver: "gpu.nvidia.com",
                pool: "node",
                list_forms: false,
            },
        )
    }

    #[test]
    fn files_are_written_replaced_and_removed_per_claim() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = MetadataFiles::new(dir.path().join("device-metadata"));
        let a = files("uid-a", &["gpu", "other"]);
        store.write("uid-a", &a, true).expect("write a");
        store
            .write("uid-b", &files("uid-b", &["gpu"]), false)
            .expect("write b");
        let read = std::fs::read(store.path("uid-a", "gpu")).expect("file");
        assert_eq!(read, a[0].content());
        assert_eq!(
            device_metadata::decode(&read).expect("decodes")[0]
                .metadata
                .uid,
            "uid-a"
        );
        assert_eq!(
            store.claims().into_iter().collect::<Vec<_>>(),
            ["uid-a", "uid-b"]
        );
        assert_eq!(store.missing("uid-a", "other"), None);
        // A repeat replaces, never appends.
        store.write("uid-a", &a, true).expect("again");
        assert_eq!(
            std::fs::read(store.path("uid-a", "gpu")).expect("file"),
            read
        );

        store.remove("uid-a").expect("remove");
        assert_eq!(
            store.missing("uid-a", "gpu"),
            Some(store.path("uid-a", "gpu"))
        );
        assert!(store.path("uid-b", "gpu").exists(), "other claims stay");
        store.remove("uid-a").expect("removing again succeeds");
        assert_eq!(store.claims().into_iter().collect::<Vec<_>>(), ["uid-b"]);
        // Without the folder there is nothing to remove or list.
        let none = MetadataFiles::new(dir.path().join("absent"));
        none.remove("uid-a").expect("no folder");
        assert!(none.claims().is_empty());
    }
}
