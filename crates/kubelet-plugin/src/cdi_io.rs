//! CDI on the host: finds driver files and device nodes, writes and removes claim specs.
//!
//! Invariants: a spec is written only when every device node it names exists (a missing
//! node fails the prepare, so no incomplete spec is ever cached by a runtime); specs are
//! written and removed atomically but without the directory fsync (`gpu_dra_fsutil::
//! replace_atomic` and `remove`), and without an fsync of the content when the claim's
//! entry records the node's boot (`replace_volatile`): the checkpoint, written durably with
//! the spec, is what vouches for a spec (a spec of a claim it does not name is stray and
//! removed by the cleanup, and a completed claim whose spec went missing or that was
//! prepared in another boot is prepared again), so a write or unlink that a power loss
//! undoes is never acted on, and a prepare pays the checkpoint's syncs only; only files
//! named like our claim specs are ever
//! removed from the CDI root, and NVIDIA's spec of a claim when that claim is undone (it
//! defines the same CDI device names as ours).

use std::path::{Path, PathBuf};

use gpu_dra_core::cdi::{self, ContainerEdits, Mount, SpecDevice};
use gpu_dra_core::ldcache;
use gpu_dra_core::plan::DeviceNodesNeed;

use crate::host::DriverRoots;

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

/// Binaries mounted into containers (the toolkit's list, less the IMEX daemon and its
/// control tool, which belong to IMEX channels, not GPUs).
const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];
/// Folders binaries are looked up in (container paths), before the `bin` folder next to the
/// driver's library folder (`/usr/local/nvidia/bin` for `/usr/local/nvidia/lib64`).
const BINARY_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];
/// IPC sockets mounted when present.
const IPC_SOCKETS: &[&str] = &[
    "/run/nvidia-persistenced/socket",
    "/run/nvidia-fabricmanager/socket",
];

/// Host layout and the edits common to every claim spec: scanned at startup, and again for
/// each new driver version ([`CdiHost::refresh`]: a driver upgraded in place renames its
/// files, and a spec naming the old ones would fail the container's start).
#[derive(Debug)]
pub struct CdiHost {
    cdi_root: PathBuf,
    dev_root: String,
    roots: DriverRoots,
    hook_path: Option<PathBuf>,
    /// The driver version scanned last and the edits found for it.
    common: std::sync::RwLock<(String, ContainerEdits)>,
}

fn root_str(root: &Path) -> String {
    root.to_string_lossy().trim_end_matches('/').to_owned()
}

/// The driver's library folders (container paths): those of `libcuda.so.1` in the root's
/// loader cache, as the toolkit finds them; without a cache (or without `libcuda` in it),
/// the first usual library folder holding `libcuda.so.1` or `libnvidia-ml.so.1`.
fn library_dirs(droot: &str) -> Vec<String> {
    let cached = std::fs::read(format!("{droot}/etc/ld.so.cache"))
        .ok()
        .and_then(|b| ldcache::parse(&b).ok())
        .map(|e| ldcache::folders_of(&e, "libcuda.so.1"))
        .unwrap_or_default();
    if !cached.is_empty() {
        return cached;
    }
    gpu_dra_nvml::LIBRARY_DIRS
        .iter()
        .map(|d| format!("/{d}"))
        .find(|d| {
            ["libcuda.so.1", "libnvidia-ml.so.1"]
                .iter()
                .any(|n| Path::new(&format!("{droot}{d}/{n}")).exists())
        })
        .into_iter()
        .collect()
}

/// `<parent of dir>/<name>`: `/usr/local/nvidia/bin` for `/usr/local/nvidia/lib64`.
fn sibling(dir: &str, name: &str) -> Option<String> {
    let (parent, _) = dir.rsplit_once('/')?;
    (!parent.is_empty()).then(|| format!("{parent}/{name}"))
}

/// A folder's regular files and its symlinks `(name, target)`, each sorted by name; empty
/// when the folder cannot be read.
fn read_folder(dir: &str) -> (Vec<String>, Vec<(String, String)>) {
    let mut files = Vec::new();
    let mut links = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        match e.file_type() {
            Ok(t) if t.is_symlink() => {
                if let Ok(target) = std::fs::read_link(e.path()) {
                    links.push((name, target.to_string_lossy().into_owned()));
                }
            }
            Ok(t) if t.is_file() => files.push(name),
            _ => {}
        }
    }
    files.sort();
    links.sort();
    (files, links)
}

/// The edits common to every claim spec for driver version `driver_version` (see
/// [`CdiHost::discover`]).
fn scan(
    roots: &DriverRoots,
    dev_root: &str,
    driver_version: &str,
    hook_path: Option<&Path>,
) -> ContainerEdits {
    let droot = root_str(&roots.here);
    let hroot = root_str(&roots.host);
    let mut mounts = Vec::new();
    let mut symlinks = Vec::new();
    let lib_dirs = library_dirs(&droot);
    let suffix = format!(".so.{driver_version}");
    for dir in &lib_dirs {
        for sub in [dir.clone(), format!("{dir}/vdpau")] {
            let (files, links) = read_folder(&format!("{droot}{sub}"));
            for name in files.iter().filter(|n| {
                n.ends_with(&suffix) || (driver_version.is_empty() && n.contains(".so."))
            }) {
                let path = format!("{sub}/{name}");
                mounts.push(Mount::read_only(format!("{hroot}{path}"), path));
                symlinks.extend(cdi::library_links(&sub, name, &links));
            }
        }
    }
    let bin_dirs = BINARY_DIRS
        .iter()
        .map(|d| (*d).to_owned())
        .chain(lib_dirs.iter().filter_map(|d| sibling(d, "bin")));
    let bin_dirs: Vec<String> = bin_dirs.collect();
    for bin in BINARIES {
        if let Some(path) = bin_dirs
            .iter()
            .map(|d| format!("{d}/{bin}"))
            .find(|p| Path::new(&format!("{droot}{p}")).is_file())
        {
            mounts.push(Mount::read_only(format!("{hroot}{path}"), path));
        }
    }
    let fw_dirs = std::iter::once("/lib/firmware".to_owned())
        .chain(lib_dirs.iter().filter_map(|d| sibling(d, "firmware")));
    for fw in fw_dirs.map(|d| format!("{d}/nvidia/{driver_version}")) {
        let (files, _) = read_folder(&format!("{droot}{fw}"));
        for name in files {
            let path = format!("{fw}/{name}");
            mounts.push(Mount::read_only(format!("{hroot}{path}"), path));
        }
    }
    for sock in IPC_SOCKETS {
        if Path::new(&format!("{droot}{sock}")).exists() {
            mounts.push(Mount {
                host_path: format!("{hroot}{sock}"),
                container_path: (*sock).to_owned(),
                options: ["ro", "nosuid", "nodev", "bind", "noexec"]
                    .map(String::from)
                    .to_vec(),
            });
        }
    }
    let hook_dirs: Vec<String> = lib_dirs
        .iter()
        .filter(|d| {
            mounts
                .iter()
                .any(|m| m.container_path.starts_with(&format!("{d}/")))
        })
        .cloned()
        .collect();
    let hooks = hook_path
        .map(|h| cdi::toolkit_hooks(&h.to_string_lossy(), driver_version, &hook_dirs, &symlinks))
        .unwrap_or_default();
    let device_nodes = cdi::CONTROL_NODES
        .iter()
        .chain(
            cdi::OPTIONAL_CONTROL_NODES
                .iter()
                .filter(|p| Path::new(&cdi::host_path(dev_root, p)).exists()),
        )
        .map(|p| cdi::DeviceNode {
            path: (*p).to_owned(),
            host_path: cdi::host_path(dev_root, p),
        })
        .collect();
    ContainerEdits {
        env: Vec::new(),
        device_nodes,
        mounts,
        hooks,
    }
}

impl CdiHost {
    /// Scans the driver root as the NVIDIA container toolkit does: the driver's library
    /// folders are those of `libcuda.so.1` in the root's `etc/ld.so.cache` (else the first of
    /// the usual folders holding it, or NVML), and every `*.so.<driver version>` in them (and
    /// their `vdpau/`) is mounted; then binaries, firmware for that version, IPC sockets and
    /// the optional control nodes, and the toolkit's hooks when `hook_path` is given.
    ///
    /// Files are read under `roots.here` and named in specs under `roots.host`, so a driver
    /// installed on the host that the plugin sees at `/driver-root` is still mounted from its
    /// host paths.
    pub fn discover(
        cdi_root: PathBuf,
        roots: &DriverRoots,
        dev_root: &Path,
        driver_version: &str,
        hook_path: Option<&Path>,
    ) -> Self {
        let dev_root = root_str(dev_root);
        let common = scan(roots, &dev_root, driver_version, hook_path);
        CdiHost {
            cdi_root,
            dev_root,
            roots: roots.clone(),
            hook_path: hook_path.map(Path::to_path_buf),
            common: std::sync::RwLock::new((driver_version.to_owned(), common)),
        }
    }

    /// Scans the driver root again when `driver_version` is not the version scanned last
    /// (blocking I/O): specs written afterwards name that version's files. Specs written
    /// before are rewritten by the driver ([`Self::rewrite_for_current_driver`]); their
    /// running containers keep the files they mounted.
    pub fn refresh(&self, driver_version: &str) {
        if self.driver_version() == driver_version {
            return;
        }
        let common = scan(
            &self.roots,
            &self.dev_root,
            driver_version,
            self.hook_path.as_deref(),
        );
        tracing::info!(
            driver_version,
            mounts = common.mounts.len(),
            "scanned the driver's host files again for CDI specs"
        );
        *self
            .common
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            (driver_version.to_owned(), common);
    }

    /// The driver version whose files the specs name.
    pub fn driver_version(&self) -> String {
        self.common
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .clone()
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
        self.versioned_spec(claim_uid, devices).0
    }

    /// Builds the claim's spec, with the driver version whose files it names.
    pub fn versioned_spec(&self, claim_uid: &str, devices: &[SpecDevice]) -> (cdi::Spec, String) {
        let (version, common) = self.versioned_common();
        (
            cdi::claim_spec(claim_uid, devices, &self.dev_root, common),
            version,
        )
    }

    fn versioned_common(&self) -> (String, ContainerEdits) {
        self.common
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Reads a claim's spec back (blocking I/O); `None` when it is missing or not a spec.
    pub fn read(&self, claim_uid: &str) -> Option<cdi::Spec> {
        let bytes = std::fs::read(self.spec_path(claim_uid)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Rewrites a claim's spec so that its shared edits name the current driver's files
    /// (blocking I/O): its devices, their nodes and sharing edits, and so its CDI IDs, stay as
    /// they are. Returns the version it names now, or `None` when the claim has no spec.
    pub fn rewrite_for_current_driver(
        &self,
        claim_uid: &str,
        sync_content: bool,
    ) -> Result<Option<String>, CdiError> {
        let Some(mut spec) = self.read(claim_uid) else {
            return Ok(None);
        };
        let (version, common) = self.versioned_common();
        spec.container_edits = cdi::claim_common_edits(common);
        let spec = gpu_dra_core::sharing::without_control_tool(spec);
        self.write(claim_uid, &spec, sync_content)?;
        Ok(Some(version))
    }

    /// Writes a claim's spec atomically (blocking I/O); its content is fsynced only with
    /// `sync_content`. Without it a power loss may leave the spec empty: pass it unless the
    /// claim's checkpoint entry records the boot, so that the next boot prepares the claim
    /// again instead of trusting the spec (`Driver::stale_reason`).
    pub fn write(
        &self,
        claim_uid: &str,
        spec: &cdi::Spec,
        sync_content: bool,
    ) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid);
        let bytes = serde_json::to_vec_pretty(spec).unwrap_or_default();
        std::fs::create_dir_all(&self.cdi_root)
            .and_then(|()| {
                if sync_content {
                    gpu_dra_fsutil::replace_atomic(&path, &bytes, 0o644)
                } else {
                    gpu_dra_fsutil::replace_volatile(&path, &bytes, 0o644)
                }
            })
            .map_err(|source| CdiError::Io { path, source })
    }

    /// Removes a claim's spec (blocking I/O); missing is fine.
    pub fn remove(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid);
        gpu_dra_fsutil::remove(&path).map_err(|source| CdiError::Io { path, source })
    }

    /// Path of the spec NVIDIA's driver wrote for a claim (see
    /// [`cdi::nvidia_spec_file_name`]).
    pub fn nvidia_spec_path(&self, claim_uid: &str) -> PathBuf {
        self.cdi_root.join(cdi::nvidia_spec_file_name(claim_uid))
    }

    /// Removes the spec NVIDIA's driver wrote for a claim (blocking I/O); missing is fine.
    pub fn remove_nvidia(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.nvidia_spec_path(claim_uid);
        // Durable, unlike ours: the cleanup does not sweep NVIDIA's spec names, so one that a
        // power loss brought back would stay.
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
