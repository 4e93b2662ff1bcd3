//! CDI on the host: finds driver files and device nodes, writes and removes claim specs.
//!
//! Invariants: a spec is written only when every device node it names exists (a missing
//! node fails the prepare, so no incomplete spec is ever cached by a runtime); specs are
//! written atomically (see `gpu_dra_fsutil`); only files named like our claim specs are ever
//! removed from the CDI root, and NVIDIA's spec of a claim when that claim is undone (it
//! defines the same CDI device names as ours).

use std::path::{Path, PathBuf};

use gpu_dra_core::cdi::{self, ContainerEdits, Mount, SpecDevice};
use gpu_dra_core::plan::DeviceNodesNeed;

/// Errors writing CDI specs.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// A device node the container needs does not exist on the host.
    #[error(
        "device node {path} is missing on the host; is the NVIDIA driver loaded (and --dev-root right)?"
    )]
    MissingNode {
        /// Host path.
        path: String,
    },
    /// A MIG capability file could not be read or parsed.
    #[error("cannot read MIG capability {path}: {reason}")]
    Capability {
        /// Host path of the `access` file.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// Writing or removing a spec failed.
    #[error("cannot write CDI spec {path}: {source}")]
    Io {
        /// Spec path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Library name prefixes of the user-space driver mounted into containers.
const LIBRARIES: &[&str] = &[
    "libcuda.so.",
    "libcudadebugger.so.",
    "libnvidia-ml.so.",
    "libnvidia-ptxjitcompiler.so.",
    "libnvidia-nvvm.so.",
    "libnvidia-opencl.so.",
    "libnvidia-gpucomp.so.",
    "libnvidia-allocator.so.",
    "libnvidia-cfg.so.",
    "libnvidia-pkcs11.so.",
    "libnvidia-pkcs11-openssl3.so.",
];
/// Binaries mounted into containers.
const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];
/// IPC sockets mounted when present.
const IPC_SOCKETS: &[&str] = &[
    "/run/nvidia-persistenced/socket",
    "/run/nvidia-fabricmanager/socket",
];

/// Host layout and the edits common to every claim spec, computed once at startup.
#[derive(Debug, Clone)]
pub struct CdiHost {
    cdi_root: PathBuf,
    dev_root: String,
    common: ContainerEdits,
}

fn root_str(root: &Path) -> String {
    root.to_string_lossy().trim_end_matches('/').to_owned()
}

impl CdiHost {
    /// Scans the driver root for libraries, binaries, firmware and IPC sockets.
    pub fn discover(
        cdi_root: PathBuf,
        driver_root: &Path,
        dev_root: &Path,
        driver_version: &str,
        hook_path: Option<&Path>,
    ) -> Self {
        let droot = root_str(driver_root);
        let dev_root = root_str(dev_root);
        let mut mounts = Vec::new();
        let mut lib_dirs = Vec::new();
        let mut symlinks = Vec::new();
        // The folders NVML itself is looked up in, as container paths.
        for dir in gpu_dra_nvml::LIBRARY_DIRS.map(|d| format!("/{d}")) {
            let Ok(entries) = std::fs::read_dir(format!("{droot}{dir}")) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    LIBRARIES.iter().any(|p| {
                        n.strip_prefix(p).is_some_and(|v| {
                            v == driver_version || (driver_version.is_empty() && !v.is_empty())
                        })
                    })
                })
                .collect();
            names.sort();
            for name in names {
                if mounts
                    .iter()
                    .any(|m: &Mount| m.container_path.ends_with(&format!("/{name}")))
                {
                    continue;
                }
                let path = format!("{dir}/{name}");
                if name.starts_with("libcuda.so.") {
                    symlinks.push((name.clone(), format!("{dir}/libcuda.so.1")));
                }
                mounts.push(Mount::read_only(format!("{droot}{path}"), path));
                if !lib_dirs.contains(&dir) {
                    lib_dirs.push(dir.clone());
                }
            }
        }
        for bin in BINARIES {
            for dir in ["/usr/bin", "/usr/sbin", "/bin"] {
                let path = format!("{dir}/{bin}");
                if Path::new(&format!("{droot}{path}")).exists() {
                    mounts.push(Mount::read_only(format!("{droot}{path}"), path));
                    break;
                }
            }
        }
        let fw = format!("/lib/firmware/nvidia/{driver_version}");
        if let Ok(entries) = std::fs::read_dir(format!("{droot}{fw}")) {
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            for name in names {
                let path = format!("{fw}/{name}");
                mounts.push(Mount::read_only(format!("{droot}{path}"), path));
            }
        }
        for sock in IPC_SOCKETS {
            if Path::new(&format!("{droot}{sock}")).exists() {
                mounts.push(Mount {
                    host_path: format!("{droot}{sock}"),
                    container_path: (*sock).to_owned(),
                    options: ["ro", "nosuid", "nodev", "bind", "noexec"]
                        .map(String::from)
                        .to_vec(),
                });
            }
        }
        let hooks = hook_path
            .map(|h| cdi::toolkit_hooks(&h.to_string_lossy(), &lib_dirs, &symlinks))
            .unwrap_or_default();
        let device_nodes = cdi::CONTROL_NODES
            .iter()
            .map(|p| cdi::DeviceNode {
                path: (*p).to_owned(),
                host_path: cdi::host_path(&dev_root, p),
            })
            .collect();
        CdiHost {
            cdi_root,
            dev_root,
            common: ContainerEdits {
                env: Vec::new(),
                device_nodes,
                mounts,
                hooks,
            },
        }
    }

    /// The CDI root folder.
    pub fn cdi_root(&self) -> &Path {
        &self.cdi_root
    }

    /// Path of a claim's spec file.
    pub fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.cdi_root.join(cdi::spec_file_name(claim_uid))
    }

    fn cap_minor(&self, file: &str) -> Result<u32, CdiError> {
        let path = cdi::host_path(&self.dev_root, file);
        let text = std::fs::read_to_string(&path).map_err(|e| CdiError::Capability {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        text.lines()
            .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| CdiError::Capability {
                path,
                reason: "no `DeviceFileMinor: <N>` line".to_owned(),
            })
    }

    /// Container paths of a device's nodes, all checked to exist on the host.
    pub fn device_nodes(&self, need: &DeviceNodesNeed) -> Result<Vec<String>, CdiError> {
        let mut caps = Vec::new();
        if let Some(m) = need.mig {
            let gi = format!(
                "/proc/driver/nvidia/capabilities/gpu{}/mig/gi{}",
                need.gpu_minor, m.gi
            );
            caps.push(self.cap_minor(&format!("{gi}/access"))?);
            caps.push(self.cap_minor(&format!("{gi}/ci{}/access", m.ci))?);
        }
        let paths = cdi::device_node_paths(need.gpu_minor, &caps);
        for p in paths
            .iter()
            .map(String::as_str)
            .chain(cdi::CONTROL_NODES.iter().copied())
        {
            let host = cdi::host_path(&self.dev_root, p);
            if !Path::new(&host).exists() {
                return Err(CdiError::MissingNode { path: host });
            }
        }
        Ok(paths)
    }

    /// Builds the claim's spec.
    pub fn spec(&self, claim_uid: &str, devices: &[SpecDevice]) -> cdi::Spec {
        cdi::claim_spec(claim_uid, devices, &self.dev_root, self.common.clone())
    }

    /// Writes a claim's spec atomically (blocking I/O).
    pub fn write(&self, claim_uid: &str, spec: &cdi::Spec) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid);
        let bytes = serde_json::to_vec_pretty(spec).unwrap_or_default();
        std::fs::create_dir_all(&self.cdi_root)
            .and_then(|()| gpu_dra_fsutil::write_atomic(&path, &bytes, 0o644))
            .map_err(|source| CdiError::Io { path, source })
    }

    /// Removes a claim's spec (blocking I/O); missing is fine.
    pub fn remove(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid);
        gpu_dra_fsutil::remove_durable(&path).map_err(|source| CdiError::Io { path, source })
    }

    /// Path of the spec NVIDIA's driver wrote for a claim (see
    /// [`cdi::nvidia_spec_file_name`]).
    pub fn nvidia_spec_path(&self, claim_uid: &str) -> PathBuf {
        self.cdi_root.join(cdi::nvidia_spec_file_name(claim_uid))
    }

    /// Removes the spec NVIDIA's driver wrote for a claim (blocking I/O); missing is fine.
    pub fn remove_nvidia(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.nvidia_spec_path(claim_uid);
        gpu_dra_fsutil::remove_durable(&path).map_err(|source| CdiError::Io { path, source })
    }

    /// Removes temp files of spec writes interrupted by a crash; returns how many.
    pub fn remove_stale_temps(&self) -> usize {
        gpu_dra_fsutil::remove_stale_temps(
            &self.cdi_root,
            &format!("{}-{}_", cdi::CDI_VENDOR, cdi::CDI_CLASS),
        )
    }

    /// Claim UIDs of the claim specs present in the CDI root.
    pub fn list(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.cdi_root) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                cdi::claim_uid_of_spec_file(&e.file_name().to_string_lossy()).map(str::to_owned)
            })
            .collect()
    }
}
