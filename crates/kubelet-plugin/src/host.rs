//! The host as the plugin reads it: where the NVIDIA driver, the device nodes and sysfs are
//! (flags shared by `run`, `discover`, `cleanup` and `health`, so that every subcommand reads
//! one host the same way), and the NVML library found there: looked up again for every NVML
//! session, because a driver upgraded in place renames its files.
//!
//! Invariant: the driver root has two names, the host's (which CDI specs name, because the
//! container runtime resolves them) and the one this process reads the same files under
//! ([`DriverRoots`]); code that writes a path into a spec uses the first, code that opens a
//! file the second.

use std::path::{Path, PathBuf};

use anyhow::Context;
use gpu_dra_nvml::{self as nvml, NvmlInventory, NvmlLibrary, NvmlOptions};

/// The kernel's boot ID, read by `run` (claims and sharing state record the boot they were
/// prepared in: another ID means the node rebooted) and `cleanup` (recorded MIG instance IDs name
/// an instance only in the boot they were recorded in).
#[derive(Debug, Clone, clap::Args)]
pub struct BootId {
    /// The kernel's boot ID file (the same inside a container); changed only by tests.
    #[arg(
        long = "boot-id-file",
        env = "BOOT_ID_FILE",
        hide = true,
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    pub file: PathBuf,
}

impl BootId {
    /// The boot ID, or `None` (with a warning) when the file is missing or empty: reboots are
    /// then detected only by missing CDI specs.
    pub fn read(&self) -> Option<String> {
        let path = &self.file;
        match std::fs::read_to_string(path) {
            Ok(text) if !text.trim().is_empty() => Some(text.trim().to_owned()),
            Ok(_) => {
                tracing::warn!(path = %path.display(), "boot ID file is empty; reboots are detected only by missing CDI specs");
                None
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the boot ID; reboots are detected only by missing CDI specs");
                None
            }
        }
    }
}

/// Where the driver, device nodes and sysfs of the host are: flags shared by the subcommands
/// that read the host, so all read one host the same way.
#[derive(Debug, Clone, clap::Args)]
pub struct HostArgs {
    /// Root of the NVIDIA driver installation (libraries, binaries, firmware) on the host,
    /// as the container runtime sees it (NVIDIA's chart value `nvidiaDriverRoot`): `/` for a
    /// driver installed on the host, `/run/nvidia/driver` for the GPU Operator's. CDI specs
    /// name paths under it.
    #[arg(
        long = "nvidia-driver-root",
        visible_alias = "driver-root",
        env = "NVIDIA_DRIVER_ROOT",
        default_value = "/"
    )]
    pub driver_root: PathBuf,
    /// Where that root is found by this process, when it differs: the chart mounts a driver
    /// installed on the host at `/driver-root` in the plugin's container. Default: the
    /// `--nvidia-driver-root` path itself.
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    pub container_driver_root: Option<PathBuf>,
    /// Root under which dev/nvidia* and proc/driver/nvidia/capabilities live.
    #[arg(long, env = "NVIDIA_DEV_ROOT", default_value = "/")]
    pub dev_root: PathBuf,
    /// Root of sysfs (PCIe root and NUMA node).
    #[arg(long, env = "SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// Explicit NVML library; default: first libnvidia-ml.so.1 under the driver root's lib dirs.
    #[arg(long, env = "NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
}

impl HostArgs {
    /// The driver root as this process reads it (see `container_driver_root`).
    pub fn driver_root_here(&self) -> &Path {
        self.container_driver_root
            .as_deref()
            .unwrap_or(&self.driver_root)
    }

    /// The driver root on the host and where this process reads it.
    pub fn driver_roots(&self) -> DriverRoots {
        DriverRoots {
            host: self.driver_root.clone(),
            here: self.driver_root_here().to_path_buf(),
        }
    }

    /// The NVML library as the backends look it up at each session: `--nvml-lib` as given,
    /// else the search under the driver root (see [`gpu_dra_nvml::NvmlLibrary`]).
    pub fn nvml_library(&self) -> NvmlLibrary {
        match &self.nvml_lib {
            Some(path) => NvmlLibrary::Path(path.clone()),
            None => NvmlLibrary::Under(self.driver_root_here().to_path_buf()),
        }
    }

    /// The NVML backend for this host and the library it finds now (checked to exist). The
    /// backend looks the library up again for every session, so it follows a driver
    /// upgraded in place.
    pub fn nvml_inventory(&self) -> anyhow::Result<(PathBuf, NvmlInventory)> {
        let lib_path = nvml_library(self.driver_root_here(), self.nvml_lib.as_deref())?;
        let backend = NvmlInventory::new(NvmlOptions {
            library: self.nvml_library(),
            sysfs_root: self.sysfs_root.clone(),
        });
        Ok((lib_path, backend))
    }
}

/// The driver root by its two names: the host's path, which CDI specs name, and the path
/// under which this process reads the same files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRoots {
    /// On the host, as the container runtime resolves spec paths.
    pub host: PathBuf,
    /// In this process's filesystem.
    pub here: PathBuf,
}

impl DriverRoots {
    /// One root seen at the same path by the host and this process.
    pub fn same(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        DriverRoots {
            host: root.clone(),
            here: root,
        }
    }
}

/// The NVML library to load: `explicit` if given (it must exist), else the first
/// `libnvidia-ml.so.1` under the driver root's library directories.
pub fn nvml_library(driver_root: &Path, explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        anyhow::ensure!(
            path.exists(),
            "NVML library {} (--nvml-lib / NVML_LIB) does not exist",
            path.display()
        );
        return Ok(path.to_path_buf());
    }
    nvml::find_library(driver_root).with_context(|| {
        format!(
            "no {} under {} in any of {}; set --nvidia-driver-root (NVIDIA_DRIVER_ROOT) to where the driver is installed (and --container-driver-root to where this process sees it, if elsewhere), or --nvml-lib (NVML_LIB)",
            nvml::LIBRARY_NAME,
            driver_root.display(),
            nvml::LIBRARY_DIRS.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_lookup_errors_say_what_to_set() {
        let dir = tempfile::tempdir().unwrap();
        let err = nvml_library(dir.path(), None).unwrap_err().to_string();
        assert!(
            err.contains("NVIDIA_DRIVER_ROOT") && err.contains("usr/lib64"),
            "{err}"
        );
        let missing = dir.path().join("nope.so");
        let err = nvml_library(dir.path(), Some(&missing))
            .unwrap_err()
            .to_string();
        assert!(err.contains("NVML_LIB"), "{err}");
        std::fs::create_dir_all(dir.path().join("usr/lib")).unwrap();
        std::fs::write(dir.path().join("usr/lib/libnvidia-ml.so.1"), "").unwrap();
        assert_eq!(
            nvml_library(dir.path(), None).unwrap(),
            dir.path().join("usr/lib/libnvidia-ml.so.1")
        );
    }
}
