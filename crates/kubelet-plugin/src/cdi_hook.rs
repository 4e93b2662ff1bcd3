//! The `nvidia-cdi-hook` binary that our CDI specs name, installed on the host.
//!
//! The problem: a CDI hook is run by the node's container runtime, so the spec must name the
//! binary by a host path; the image ships `nvidia-cdi-hook`, but at a path inside the plugin's
//! container, which the runtime cannot see. NVIDIA's chart asks users for a host path
//! (`nvidiaCDIHookPath`) or relies on the toolkit being installed on the node.
//!
//! The fix: at start the plugin copies the image's binary into `<plugin dir>/bin/`
//! ([`crate::node_layout::hook_dir_in`]), a folder the chart mounts at its host path, so the copy's path is the same on the host and in the
//! container and no user setting is needed. The copy is named by its content
//! (`nvidia-cdi-hook-<first 16 hex digits of its SHA-256>`) and written with the crash-safe
//! writer (temp file, fsync, rename): a half-written file never carries the final name, a
//! restart finds the finished copy and does not write it again, and during a rolling upgrade
//! the old and the new plugin each keep the binary their specs name. Copies of other
//! versions stay until the plugin folder is cleaned up, because specs written by an older
//! version may still name them while their pods run.
//!
//! Alternatives rejected: a fixed name replaced in place (a container starting during the
//! replacement runs a different hook than its spec was written for); an init container
//! copying the binary (one more container per node, and the same naming problem).

use std::io;
use std::path::{Path, PathBuf};

use crate::node_layout::HOOK_COPY_PREFIX;

/// Why the hook binary could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The binary to install cannot be read.
    #[error(
        "cannot read the nvidia-cdi-hook binary {path}: {source}; set --nvidia-cdi-hook-path \
         (NVIDIA_CDI_HOOK_PATH) to the hook's path on the host, or --cdi-hook-source to the \
         binary to install"
    )]
    Read {
        /// The source path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The copy cannot be written.
    #[error("cannot install nvidia-cdi-hook at {path}: {source}")]
    Write {
        /// The target path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// The name of the copy of a binary with this content.
pub fn copy_name(content: &[u8]) -> String {
    format!(
        "{HOOK_COPY_PREFIX}{}",
        &crate::digest::sha256_hex(content)[..16]
    )
}

/// Installs `source` in `dir`, the plugin folder's hook folder (see the module doc), and
/// returns the copy's path, which is its host path as well. Idempotent: an existing copy is
/// left as it is.
pub fn install(source: &Path, dir: &Path) -> Result<PathBuf, HookError> {
    let content = std::fs::read(source).map_err(|e| HookError::Read {
        path: source.to_path_buf(),
        source: e,
    })?;
    let target = dir.join(copy_name(&content));
    let write_err = |e| HookError::Write {
        path: target.clone(),
        source: e,
    };
    if target.is_file() {
        return Ok(target);
    }
    std::fs::create_dir_all(dir).map_err(write_err)?;
    gpu_dra_fsutil::remove_stale_temps(dir, HOOK_COPY_PREFIX);
    gpu_dra_fsutil::write_atomic(&target, &content, 0o755).map_err(write_err)?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn binary(dir: &Path, content: &[u8]) -> PathBuf {
        let path = dir.join("nvidia-cdi-hook");
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn installs_an_executable_copy_named_by_content() {
        let tmp = tempfile::tempdir().unwrap();
        let src = binary(tmp.path(), b"\x7fELF hook v1");
        let plugin = crate::node_layout::hook_dir_in(&tmp.path().join("plugin"));
        let copy = install(&src, &plugin).unwrap();
        assert_eq!(copy.parent().unwrap(), plugin);
        assert_eq!(std::fs::read(&copy).unwrap(), b"\x7fELF hook v1");
        let mode = std::fs::metadata(&copy).unwrap().permissions().mode();
        assert_eq!(mode & 0o111, 0o111, "not executable: {mode:o}");
        assert_eq!(
            copy.file_name().unwrap().to_str().unwrap(),
            copy_name(b"\x7fELF hook v1")
        );
        // Idempotent: the same content gives the same copy, written once.
        let before = std::fs::metadata(&copy).unwrap().modified().unwrap();
        assert_eq!(install(&src, &plugin).unwrap(), copy);
        assert_eq!(
            std::fs::metadata(&copy).unwrap().modified().unwrap(),
            before
        );
    }

    #[test]
    fn a_new_version_gets_its_own_copy_and_the_old_one_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let plugin = crate::node_layout::hook_dir_in(&tmp.path().join("plugin"));
        let old = install(&binary(tmp.path(), b"hook v1"), &plugin).unwrap();
        let new = install(&binary(tmp.path(), b"hook v2"), &plugin).unwrap();
        assert_ne!(old, new);
        assert_eq!(std::fs::read(&old).unwrap(), b"hook v1");
        assert_eq!(std::fs::read(&new).unwrap(), b"hook v2");
    }

    #[test]
    fn a_missing_source_says_which_settings_fix_it() {
        let tmp = tempfile::tempdir().unwrap();
        let err = install(&tmp.path().join("absent"), tmp.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent"), "{err}");
        assert!(err.contains("--nvidia-cdi-hook-path"), "{err}");
    }

    #[test]
    fn names_differ_by_content() {
        assert_ne!(copy_name(b"a"), copy_name(b"b"));
        assert_eq!(copy_name(b"a"), copy_name(b"a"));
        assert_eq!(copy_name(b"a").len(), HOOK_COPY_PREFIX.len() + 16);
    }
}
