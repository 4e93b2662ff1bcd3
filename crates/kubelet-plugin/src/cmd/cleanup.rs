//! `gpu-kubelet-plugin cleanup`: puts a node back as it was before the driver, once no node
//! plugin serves it (uninstall). The chart runs it on every node that ran a plugin pod, from a
//! `pre-delete` hook ([`crate::cmd::uninstall`]), with the plugin's own host paths.
//!
//! What it does, from the plugin's own records (`sharing.json` and the checkpoint in the
//! plugin directory):
//! - every recorded MPS control daemon is stopped (`quit` through its pipe, then killed if it
//!   still runs), the compute mode of its GPUs set back to `DEFAULT`, its directories removed;
//!   every GPU with a recorded time-slice gets compute mode `DEFAULT` and the default interval
//!   (through the same `nvidia-smi` calls, found under `--driver-root`, as the plugin uses:
//!   [`crate::sharing::SharingManager::restore_all`]);
//! - file systems mounted under our MPS directories (a `/dev/shm` tmpfs of earlier versions)
//!   are unmounted first;
//! - the MIG instances of claims' dynamic MIG devices (the checkpoint's `dynamicMig` records)
//!   are destroyed, found as the driver finds them: by the UUID recorded at creation; in the
//!   boot they were made in (the entry's boot ID is the node's), also by the recorded GI and
//!   CI IDs (an instance half destroyed, its compute instance gone) or, for a record written
//!   before its instance's IDs, by profile and placement. The checkpoint is the only record of
//!   which instances are ours, so it goes only once none is left;
//! - our files go, exactly those [`NodeFolders::owned`] lists: claim specs from the CDI root,
//!   checkpoint, sharing state, sockets, hook copies and the MPS folder from the plugin
//!   directory, our registration sockets from the registrar directory; the plugin directory
//!   itself goes when nothing else is left in it (in a cleanup pod it is the hostPath
//!   volume's mount point and stays, empty).
//!
//! Invariants: only what this driver wrote is removed. NVIDIA's driver shares the plugin and
//! CDI folders (its `checkpoint.json`, its `.yaml` specs, the MPS directories of claims
//! imported from it): those stay, and so do MIG instances no record names (static ones, an
//! admin's). While anything of the sharing state or a recorded MIG instance could not be
//! undone (an instance in use is refused by NVML), `sharing.json` and the checkpoint stay too,
//! so running the command again (it is idempotent) finishes the job; the exit status says
//! whether everything was done, naming what is left. It refuses to run
//! while a plugin still answers on `dra.sock`, which would re-apply what it undoes.
//!
//! Why a subcommand of the plugin binary: it needs exactly the plugin's view of the host (its
//! flags and their env twins, the chart's hostPath volumes) and the plugin's own code for the
//! recorded state and the driver tools; a second tool would have to re-implement both.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_dra_core::checkpoint;
use gpu_dra_telemetry::LogArgs;
use tracing::{info, warn};

use crate::host::HostArgs;
use crate::mig::{MigControl, MigInstance};
use crate::node_layout::{EntryKind, NodeFolders};
use crate::sharing::{
    DriverRoot, FileStore, SharingError, SharingManager, SharingMetrics, SharingOptions,
};

/// Flags of `cleanup`: the host paths of `run`, with the same env twins, so the cleanup pod
/// takes the plugin's environment as is.
#[derive(Debug, Clone, clap::Args)]
pub struct CleanupArgs {
    /// DRA driver name (names the registration socket).
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// The node's folders: plugin, registration, CDI.
    #[command(flatten)]
    pub folders: NodeFolders,
    /// The host's driver (its `nvidia-smi` and MPS control tool restore the GPUs).
    #[command(flatten)]
    pub host: HostArgs,
    /// The kernel's boot ID, as `run` reads it: recorded MIG instance IDs name an instance
    /// only in the boot they were recorded in.
    #[command(flatten)]
    pub boot_id: crate::host::BootId,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// One thing cleanup could not do. Each names the path or step and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    /// A node plugin still serves the node.
    #[error(
        "a node plugin still answers on {socket}; stop it first (delete the DaemonSet's pod on this node), otherwise it re-applies what cleanup undoes"
    )]
    PluginRunning {
        /// The DRA socket that answered.
        socket: PathBuf,
    },
    /// The sharing state could not be read or undone.
    #[error(
        "GPU sharing not fully undone: {source}; {state} is kept, run cleanup again once the cause is fixed"
    )]
    Sharing {
        /// The sharing state file.
        state: PathBuf,
        /// What failed.
        #[source]
        source: SharingError,
    },
    /// The checkpoint could not be read, so NVIDIA's MPS directories cannot be told apart
    /// from ours; stray MPS directories are left.
    #[error(
        "cannot read checkpoint {path}: {reason}; stray MPS directories are left in place (they may be NVIDIA's)"
    )]
    Checkpoint {
        /// The checkpoint path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A claim's dynamic MIG instance could not be destroyed (or its GPU's instances not
    /// listed); the checkpoint, which names it, is kept.
    #[error(
        "MIG instance of dynamic device {device} on GPU {gpu} ({instance}) not destroyed: {reason}; the checkpoint is kept: stop what uses the instance, then run cleanup again"
    )]
    MigInstance {
        /// The dynamic device the instance was made for.
        device: String,
        /// The parent GPU's UUID.
        gpu: String,
        /// GI and CI IDs and UUID, as far as known.
        instance: String,
        /// What NVML said.
        reason: String,
    },
    /// A file, folder or mount could not be removed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// What cleanup did, and what it could not do.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// MPS daemons stopped.
    pub mps_stopped: Vec<String>,
    /// GPUs whose time-slice and compute mode were reset.
    pub timeslice_reset: Vec<String>,
    /// Mount points unmounted.
    pub unmounted: Vec<PathBuf>,
    /// Dynamic MIG instances destroyed, as `GPU/GI/CI`.
    pub mig_destroyed: Vec<String>,
    /// Files and folders removed.
    pub removed: Vec<PathBuf>,
    /// What failed; empty when the node is clean.
    pub failures: Vec<CleanupError>,
}

/// Cleans the node described by `args` (see the module documentation), destroying recorded
/// dynamic MIG instances through `mig`; `boot_id` is the node's (`None`: unknown, instances
/// are then found by UUID only).
pub async fn cleanup(
    args: &CleanupArgs,
    mig: &dyn MigControl,
    boot_id: Option<&str>,
) -> CleanupReport {
    let mut report = CleanupReport::default();
    let folders = &args.folders;
    let dra_sock = folders.sockets(&args.driver_name, "").dra;
    if std::os::unix::net::UnixStream::connect(&dra_sock).is_ok() {
        report
            .failures
            .push(CleanupError::PluginRunning { socket: dra_sock });
        return report;
    }
    // A plugin instance holds the node (also one with per-pod socket names).
    let lock_path = folders.instance_lock();
    if let Ok(lock) = std::fs::File::open(&lock_path)
        && matches!(lock.try_lock(), Err(std::fs::TryLockError::WouldBlock))
    {
        report
            .failures
            .push(CleanupError::PluginRunning { socket: lock_path });
        return report;
    }

    // NVIDIA's MPS directories (claims imported from its checkpoint) are not ours to remove.
    let checkpoint_path = folders.checkpoint();
    let doc = match read_checkpoint(&checkpoint_path) {
        Ok(doc) => Some(doc),
        Err(reason) => {
            report.failures.push(CleanupError::Checkpoint {
                path: checkpoint_path.clone(),
                reason,
            });
            None
        }
    };
    let foreign = doc.as_ref().map(imported_mps_daemons);

    unmount_ours(
        &folders.mps_root(),
        foreign.as_ref().map_or(&BTreeSet::new(), |f| f),
        &mut report,
    );

    let state_path = folders.sharing_state();
    let sharing_done = restore_sharing(args, &state_path, foreign.as_ref(), &mut report).await;
    let mig_done = doc
        .as_ref()
        .is_none_or(|doc| destroy_dynamic_instances(doc, mig, boot_id, &mut report));

    let owned = folders.owned(&args.driver_name);
    // Claim specs (NVIDIA's `.yaml` stay), the nvidia-cdi-hook copies (our specs, which name
    // them, are gone; running containers do not need them any more), per-pod sockets of
    // rolling updates that an instance left.
    for family in &owned.families {
        remove_entries(&family.dir, &mut report, |e, name| {
            family.names.matches(name)
                && match family.kind {
                    EntryKind::File => e.file_type().is_ok_and(|t| t.is_file()),
                    EntryKind::IdleSocket => is_idle_socket(e),
                }
        });
        gpu_dra_fsutil::remove_stale_temps(&family.dir, &family.names.temp_prefix());
    }
    let mut ours = owned.files;
    if std::fs::read(&owned.legacy_checkpoint).is_ok_and(|b| checkpoint::is_own_format(&b)) {
        remove_file(&owned.legacy_checkpoint, &mut report);
    }
    // The records go last, and only when nothing they record is still owed.
    if sharing_done && mig_done && foreign.is_some() {
        ours.extend(owned.records);
    }
    for path in ours {
        remove_file(&path, &mut report);
        if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
            gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy());
        }
    }
    // Folders go only when empty: what is left is someone else's (or owed).
    for dir in &owned.folders {
        match std::fs::remove_dir(dir) {
            Ok(()) => report.removed.push(dir.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => info!(dir = %dir.display(), reason = %e, "folder kept"),
        }
    }
    report
}

/// Undoes the recorded sharing; true when all of it is undone (or none was recorded).
async fn restore_sharing(
    args: &CleanupArgs,
    state_path: &Path,
    foreign: Option<&BTreeSet<String>>,
    report: &mut CleanupReport,
) -> bool {
    let opts = SharingOptions::new(
        DriverRoot::new(args.host.driver_root_here(), args.host.nvml_lib.clone()),
        &args.folders.plugin_dir,
    );
    let store = Arc::new(FileStore::new(state_path));
    let manager = match SharingManager::new(opts, store, SharingMetrics::default()) {
        Ok(m) => m,
        Err(source) => {
            report.failures.push(CleanupError::Sharing {
                state: state_path.to_path_buf(),
                source,
            });
            return false;
        }
    };
    match foreign {
        Some(ids) => manager.keep_foreign_dirs(ids.iter().cloned().collect()),
        // Unknown: keep every directory no record owns.
        None => manager.keep_foreign_dirs(
            std::fs::read_dir(args.folders.mps_root())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| {
                    !manager
                        .state()
                        .mps
                        .keys()
                        .any(|id| id.as_str() == name.as_str())
                })
                .collect(),
        ),
    }
    match manager.restore_all().await {
        Ok(r) => {
            report.mps_stopped = r.mps_stopped;
            report.timeslice_reset = r.timeslice_reset;
            report
                .removed
                .extend(r.strays_removed.into_iter().map(PathBuf::from));
            true
        }
        Err(source) => {
            report.failures.push(CleanupError::Sharing {
                state: state_path.to_path_buf(),
                source,
            });
            false
        }
    }
}

/// Our checkpoint, read only (no migration or import is written here). A missing checkpoint
/// is an empty one.
/// The checkpoint as a plugin would start from it: the file with its journal's records (a
/// plugin that crashed left its last changes there).
fn read_checkpoint(path: &Path) -> Result<checkpoint::Checkpoint, String> {
    use crate::checkpoint_file::CheckpointFileError;
    crate::driver::durable_checkpoint(path).map_err(|e| match e {
        // The path is in the caller's message; the journal's is named.
        CheckpointFileError::Read { path: at, reason } if Path::new(&at) == path => reason,
        CheckpointFileError::Read { path: at, reason } => format!("{at}: {reason}"),
        other => other.to_string(),
    })
}

/// MPS daemon IDs of claims imported from NVIDIA's driver.
fn imported_mps_daemons(doc: &checkpoint::Checkpoint) -> BTreeSet<String> {
    doc.claims
        .values()
        .filter_map(|e| e.imported.as_ref())
        .flat_map(|i| i.mps_control_daemons.iter().cloned())
        .collect()
}

/// Destroys the MIG instances the checkpoint's dynamic MIG records name (see the module
/// documentation for how each is found); true when none of them is left.
fn destroy_dynamic_instances(
    doc: &checkpoint::Checkpoint,
    mig: &dyn MigControl,
    boot_id: Option<&str>,
    report: &mut CleanupReport,
) -> bool {
    let mut done = true;
    let mut lists: std::collections::BTreeMap<String, Vec<MigInstance>> = Default::default();
    for entry in doc.claims.values() {
        // IDs are reused after a reboot (which destroys every instance): only a UUID, new on
        // every creation, names an instance of another boot.
        let this_boot = boot_id.is_some() && entry.boot_id.as_deref() == boot_id;
        for r in &entry.dynamic_mig {
            let failed = |instance: String, reason: String| CleanupError::MigInstance {
                device: r.device.clone(),
                gpu: r.gpu_uuid.clone(),
                instance,
                reason,
            };
            let list = match lists.get(&r.gpu_uuid) {
                Some(list) => list,
                None => match mig.list(&r.gpu_uuid) {
                    Ok(list) => lists.entry(r.gpu_uuid.clone()).or_insert(list),
                    Err(e) => {
                        report
                            .failures
                            .push(failed("instances not listed".into(), e.reason));
                        done = false;
                        continue;
                    }
                },
            };
            let by_uuid = r
                .uuid
                .as_ref()
                .and_then(|u| list.iter().find(|m| m.uuid == *u));
            let target = match (by_uuid, r.gi_id, r.ci_id) {
                (Some(m), _, _) => Some((m.gi_id, m.ci_id)),
                // Its compute instance gone, the GPU instance may be left; what is gone
                // already is success. Not when someone else's instance has both IDs now.
                (None, Some(gi), Some(ci)) if this_boot => {
                    (!list.iter().any(|m| m.gi_id == gi && m.ci_id == ci)).then_some((gi, ci))
                }
                // Recorded before its IDs: at its placement.
                (None, None, _) if this_boot && r.uuid.is_none() => list
                    .iter()
                    .find(|m| {
                        m.gi_profile_id == r.gi_profile_id && m.placement.start == r.placement_start
                    })
                    .map(|m| (m.gi_id, m.ci_id)),
                _ => None,
            };
            let Some((gi, ci)) = target else {
                continue;
            };
            let name = format!("GPU instance {gi}, compute instance {ci}");
            match mig.destroy(&r.gpu_uuid, gi, ci) {
                Ok(()) => {
                    info!(device = %r.device, gpu = %r.gpu_uuid, gi, ci, "destroyed MIG instance");
                    report
                        .mig_destroyed
                        .push(format!("{}/{gi}/{ci}", r.gpu_uuid));
                }
                Err(e) => {
                    let instance = match &r.uuid {
                        Some(u) => format!("{name}, {u}"),
                        None => name,
                    };
                    report.failures.push(failed(instance, e.reason));
                    done = false;
                }
            }
        }
    }
    done
}

/// Unmounts what is mounted under `mps_root`, deepest first, except under NVIDIA's `foreign`
/// daemon directories.
fn unmount_ours(mps_root: &Path, foreign: &BTreeSet<String>, report: &mut CleanupReport) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = mount_points(&info)
        .into_iter()
        .filter(|p| {
            p.strip_prefix(mps_root).is_ok_and(|rel| {
                rel.components().next().is_some_and(|first| {
                    !foreign.contains(first.as_os_str().to_string_lossy().as_ref())
                })
            })
        })
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for p in points {
        match rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => {
                info!(path = %p.display(), "unmounted");
                report.unmounted.push(p);
            }
            Err(e) => report.failures.push(CleanupError::Io {
                what: "unmount",
                path: p,
                source: e.into(),
            }),
        }
    }
}

/// Mount points of a `/proc/<pid>/mountinfo` text (field 5, with the kernel's octal escapes
/// of space, tab, newline and backslash decoded).
pub fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|escaped| {
            let mut out = Vec::with_capacity(escaped.len());
            let b = escaped.as_bytes();
            let mut i = 0;
            while i < b.len() {
                if b[i] == b'\\'
                    && let Some(v) = b
                        .get(i + 1..i + 4)
                        .and_then(|d| std::str::from_utf8(d).ok())
                        .and_then(|d| u8::from_str_radix(d, 8).ok())
                {
                    out.push(v);
                    i += 4;
                    continue;
                }
                out.push(b[i]);
                i += 1;
            }
            PathBuf::from(std::ffi::OsString::from(
                <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&out),
            ))
        })
        .collect()
}

/// A socket nothing answers on (one that answers belongs to a running plugin instance).
fn is_idle_socket(entry: &std::fs::DirEntry) -> bool {
    use std::os::unix::fs::FileTypeExt;
    entry.file_type().is_ok_and(|t| t.is_socket())
        && std::os::unix::net::UnixStream::connect(entry.path()).is_err()
}

/// Removes the entries of `dir` that `ours` picks (a missing folder has none).
fn remove_entries(
    dir: &Path,
    report: &mut CleanupReport,
    ours: impl Fn(&std::fs::DirEntry, &str) -> bool,
) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if ours(&e, &e.file_name().to_string_lossy()) {
            remove_file(&e.path(), report);
        }
    }
}

fn remove_file(path: &Path, report: &mut CleanupReport) {
    match std::fs::remove_file(path) {
        Ok(()) => report.removed.push(path.to_path_buf()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => report.failures.push(CleanupError::Io {
            what: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The `cleanup` subcommand: cleans the node, logs what it did and every failure; an error
/// when anything is left to do.
pub async fn run(args: CleanupArgs) -> anyhow::Result<()> {
    // NVML is needed only for recorded dynamic MIG instances; without it those fail, named.
    let mig: Box<dyn MigControl> = match crate::host::nvml_library(
        args.host.driver_root_here(),
        args.host.nvml_lib.as_deref(),
    )
    .map_err(|e| e.to_string())
    .and_then(|lib| crate::mig::NvmlMig::open(&lib).map_err(|e| e.reason))
    {
        Ok(mig) => Box::new(mig),
        Err(reason) => Box::new(crate::mig::NoMig(reason)),
    };
    let boot_id = args.boot_id.read();
    let report = cleanup(&args, mig.as_ref(), boot_id.as_deref()).await;
    info!(
        mps_stopped = %report.mps_stopped.join(","),
        timeslice_reset = %report.timeslice_reset.join(","),
        mig_destroyed = %report.mig_destroyed.join(","),
        unmounted = report.unmounted.len(),
        removed = report.removed.len(),
        "node cleanup done"
    );
    for f in &report.failures {
        warn!(error = %f, "cleanup incomplete");
    }
    match report.failures.len() {
        0 => Ok(()),
        n => anyhow::bail!(
            "node cleanup incomplete ({n} problem(s)): {}",
            report
                .failures
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_api::{Interval, MpsConfig, Sharing};
    use gpu_dra_core::cdi;
    use gpu_dra_core::sharing::SharedDevice;
    use gpu_dra_sim::state::ComputeMode;
    use gpu_dra_sim::testing::SimHost;

    const CLAIM_A: &str = "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b";
    const CLAIM_B: &str = "5f1c7d2a-8b3e-4f6a-9c0d-1e2f3a4b5c6d";
    const POD_UID: &str = "3c2b1a09-8f7e-4d6c-b5a4-392817160504";
    const BOOT: &str = "9d1f6a2e-boot";

    struct Node {
        host: SimHost,
        dir: tempfile::TempDir,
    }

    impl Node {
        fn new() -> Node {
            // dgx-a100-40gb: GPUs 4-7 are whole GPUs.
            Node {
                host: SimHost::new("dgx-a100-40gb"),
                dir: tempfile::tempdir().expect("temp dir"),
            }
        }
        fn args(&self) -> CleanupArgs {
            let d = self.dir.path();
            CleanupArgs {
                driver_name: "gpu.nvidia.com".into(),
                folders: NodeFolders {
                    plugin_dir: d.join("plugins/gpu.nvidia.com"),
                    registrar_dir: d.join("plugins_registry"),
                    cdi_root: d.join("cdi"),
                },
                host: HostArgs {
                    driver_root: self.host.root().to_path_buf(),
                    container_driver_root: None,
                    dev_root: self.host.root().to_path_buf(),
                    sysfs_root: self.host.sysfs_root(),
                    nvml_lib: None,
                },
                boot_id: crate::host::BootId {
                    file: d.join("boot_id"),
                },
                log: LogArgs {
                    log_format: gpu_dra_telemetry::LogFormat::Text,
                    log_level: "info".into(),
                },
            }
        }
        fn manager(&self) -> SharingManager {
            let a = self.args();
            SharingManager::new(
                SharingOptions::new(
                    DriverRoot::new(self.host.root(), None),
                    &a.folders.plugin_dir,
                ),
                Arc::new(FileStore::new(a.folders.sharing_state())),
                SharingMetrics::default(),
            )
            .expect("manager")
        }
        /// Cleanup with the simulator's NVML, in boot [`BOOT`].
        async fn clean(&self, a: &CleanupArgs) -> CleanupReport {
            cleanup(a, &self.mig(), Some(BOOT)).await
        }
        fn mig(&self) -> crate::mig::NvmlMig {
            crate::mig::NvmlMig::open(&self.host.lib_path()).expect("NVML")
        }
        fn gpu(&self, i: usize) -> String {
            self.host.profile().gpus[i].uuid.clone()
        }
        fn write(&self, path: &Path, text: &str) {
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
    }

    /// A node as an uninstalled plugin leaves it: an MPS daemon still running with its GPU in
    /// EXCLUSIVE_PROCESS, a time-sliced GPU, our specs and files beside NVIDIA's.
    async fn node_after_the_plugin_went() -> (Node, u32) {
        let node = Node::new();
        let m = node.manager();
        let mps = Sharing::Mps(MpsConfig {
            active_thread_percentage: Some(50),
            ..Default::default()
        });
        m.prepare("ns", CLAIM_A, "0", &[SharedDevice::gpu(node.gpu(4))], &mps)
            .await
            .expect("MPS prepared");
        let ts = Sharing::TimeSlicing {
            interval: Interval::Long,
        };
        m.prepare("ns", CLAIM_B, "0", &[SharedDevice::gpu(node.gpu(5))], &ts)
            .await
            .expect("time-slicing prepared");
        let pid = m.mps_pid(CLAIM_A, "0").expect("daemon pid");
        // The plugin goes without unpreparing (its pod deleted by the uninstall).
        m.detach();
        drop(m);
        let a = node.args();
        node.write(
            &a.folders.checkpoint(),
            &String::from_utf8(checkpoint::Checkpoint::new().to_json()).expect("utf-8"),
        );
        // NVIDIA's checkpoint (no integer version) and spec stay; so does another vendor's.
        node.write(
            &a.folders.plugin_dir.join("checkpoint.json"),
            r#"{"checksum": 1}"#,
        );
        node.write(&a.folders.cdi_root.join(cdi::spec_file_name(CLAIM_A)), "{}");
        node.write(&a.folders.cdi_root.join(cdi::spec_file_name(CLAIM_B)), "{}");
        node.write(
            &a.folders.cdi_root.join(cdi::nvidia_spec_file_name("nv")),
            "{}",
        );
        node.write(&a.folders.cdi_root.join("vendor.com-device.json"), "{}");
        node.write(&a.folders.registrar_dir.join("gpu.nvidia.com-reg.sock"), "");
        node.write(&a.folders.registrar_dir.join("other-reg.sock"), "");
        // The sockets of an instance of a rolling update, which nothing answers on any more.
        let per_pod = a.folders.sockets("gpu.nvidia.com", POD_UID);
        for socket in [per_pod.dra, per_pod.registration] {
            drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
            assert!(socket.exists());
        }
        // The hook copy the plugin installed (crate::cdi_hook).
        node.write(
            &a.folders
                .hook_dir()
                .join(crate::cdi_hook::copy_name(b"hook")),
            "hook",
        );
        (node, pid)
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    #[tokio::test]
    async fn cleanup_restores_the_gpus_and_removes_only_our_files_and_can_run_again() {
        let (node, pid) = node_after_the_plugin_went().await;
        assert_eq!(
            node.host.state().gpus[4].compute_mode,
            ComputeMode::ExclusiveProcess
        );
        assert_eq!(node.host.state().gpus[5].timeslice, 3);
        let a = node.args();

        let report = node.clean(&a).await;
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert_eq!(report.mps_stopped, [format!("{CLAIM_A}-0")]);
        assert_eq!(report.timeslice_reset, [node.gpu(5)]);
        let state = node.host.state();
        assert_eq!(state.gpus[4].compute_mode, ComputeMode::Default);
        assert_eq!(state.gpus[5].compute_mode, ComputeMode::Default);
        assert_eq!(state.gpus[5].timeslice, 0);
        assert!(!crate::sharing::mps::pid_alive(pid), "MPS daemon stopped");
        assert_eq!(
            names(&a.folders.cdi_root),
            [
                cdi::nvidia_spec_file_name("nv"),
                "vendor.com-device.json".into()
            ]
        );
        assert_eq!(
            names(&a.folders.plugin_dir),
            ["checkpoint.json"],
            "NVIDIA's stays"
        );
        assert_eq!(names(&a.folders.registrar_dir), ["other-reg.sock"]);

        // Idempotent: a second run finds nothing to do and fails on nothing.
        let again = node.clean(&a).await;
        assert!(again.failures.is_empty(), "{:?}", again.failures);
        assert!(again.removed.is_empty(), "{:?}", again.removed);
        assert!(again.mps_stopped.is_empty() && again.timeslice_reset.is_empty());

        // Without NVIDIA's file the plugin directory itself goes.
        std::fs::remove_file(a.folders.plugin_dir.join("checkpoint.json")).expect("remove");
        assert!(node.clean(&a).await.failures.is_empty());
        assert!(!a.folders.plugin_dir.exists());
    }

    #[tokio::test]
    async fn a_failed_restore_keeps_the_state_so_a_rerun_finishes() {
        let (node, _) = node_after_the_plugin_went().await;
        let mut a = node.args();
        // No driver tools: nothing can be reset.
        let empty = tempfile::tempdir().expect("temp dir");
        a.host.driver_root = empty.path().to_path_buf();
        let report = node.clean(&a).await;
        assert!(
            report
                .failures
                .iter()
                .any(|f| matches!(f, CleanupError::Sharing { .. })),
            "{:?}",
            report.failures
        );
        assert!(a.folders.sharing_state().exists());
        assert!(a.folders.checkpoint().exists());
        assert_eq!(
            node.host.state().gpus[5].timeslice,
            3,
            "still owed, still recorded"
        );

        let a = node.args();
        let report = node.clean(&a).await;
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert_eq!(node.host.state().gpus[5].timeslice, 0);
        assert_eq!(node.host.state().gpus[4].compute_mode, ComputeMode::Default);
        assert!(!a.folders.sharing_state().exists());
    }

    #[tokio::test]
    async fn a_plugin_still_serving_the_node_refuses_cleanup() {
        let (node, pid) = node_after_the_plugin_went().await;
        let a = node.args();
        let _listener =
            std::os::unix::net::UnixListener::bind(a.folders.sockets("gpu.nvidia.com", "").dra)
                .expect("bind dra.sock");
        let report = node.clean(&a).await;
        assert!(
            matches!(
                report.failures.as_slice(),
                [CleanupError::PluginRunning { .. }]
            ),
            "{:?}",
            report.failures
        );
        assert!(report.removed.is_empty());
        assert!(crate::sharing::mps::pid_alive(pid));
        assert_eq!(
            node.host.state().gpus[4].compute_mode,
            ComputeMode::ExclusiveProcess
        );
        crate::sharing::mps::kill(pid);
    }

    #[test]
    fn mount_points_are_field_five_with_octal_escapes_decoded() {
        let info = "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw\n\
                    37 36 0:5 / /var/lib/kubelet/plugins/x/mps/a/shm rw - tmpfs tmpfs rw\n";
        assert_eq!(
            mount_points(info),
            [
                PathBuf::from("/mnt/with space"),
                PathBuf::from("/var/lib/kubelet/plugins/x/mps/a/shm")
            ]
        );
    }

    /// A checkpoint entry of this boot with dynamic MIG records for `instances`.
    fn dynamic_entry(gpu: &str, instances: &[(&str, MigInstance)]) -> checkpoint::ClaimEntry {
        checkpoint::ClaimEntry {
            state: checkpoint::PrepareState::PrepareCompleted,
            namespace: "ns".into(),
            name: "dyn".into(),
            devices: Vec::new(),
            sharing: None,
            boot_id: Some(BOOT.into()),
            driver_version: None,
            imported: None,
            dynamic_mig: instances
                .iter()
                .map(|(device, m)| checkpoint::DynamicMigInstance {
                    device: (*device).into(),
                    gpu_uuid: gpu.into(),
                    gi_profile_id: m.gi_profile_id,
                    placement_start: m.placement.start,
                    placement_size: m.placement.size,
                    gi_id: Some(m.gi_id),
                    ci_id: Some(m.ci_id),
                    uuid: Some(m.uuid.clone()),
                    ..Default::default()
                })
                .collect(),
            extra: Default::default(),
        }
    }

    /// Uninstall with dynamic MIG claims still prepared: their instances (found by UUID, and
    /// one recorded before its IDs, at its placement) are destroyed before the checkpoint
    /// goes; an instance no record names (an admin's) stays.
    #[tokio::test]
    async fn dynamic_mig_instances_of_prepared_claims_are_destroyed_before_the_checkpoint_goes() {
        let node = Node::new();
        let a = node.args();
        // GPUs 0-3 are partitioned statically; GPU 6 has MIG off at boot.
        node.host
            .update_state(|s| s.set_mig_mode(6, true))
            .expect("MIG on");
        let gpu = node.gpu(6);
        let mig = node.mig();
        let big = mig.create(&gpu, 9, 4).expect("3g.20gb");
        let small = mig.create(&gpu, 19, 0).expect("1g.5gb");
        let admin = mig.create(&gpu, 14, 2).expect("admin's 2g.10gb");
        let mut cp = checkpoint::Checkpoint::new();
        cp.claims.insert(
            CLAIM_A.into(),
            dynamic_entry(&gpu, &[("gpu-6-mig-3g20gb-9-4", big.clone())]),
        );
        let mut intent = dynamic_entry(&gpu, &[("gpu-6-mig-1g5gb-19-0", small)]);
        intent.state = checkpoint::PrepareState::PrepareStarted;
        let r = &mut intent.dynamic_mig[0];
        (r.gi_id, r.ci_id, r.uuid) = (None, None, None);
        cp.claims.insert(CLAIM_B.into(), intent);
        node.write(
            &a.folders.checkpoint(),
            &String::from_utf8(cp.to_json()).expect("utf-8"),
        );

        let report = node.clean(&a).await;
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert_eq!(report.mig_destroyed.len(), 2, "{:?}", report.mig_destroyed);
        let left: Vec<String> = mig
            .list(&gpu)
            .expect("list")
            .into_iter()
            .map(|m| m.uuid)
            .collect();
        assert_eq!(left, [admin.uuid], "only the admin's instance is left");
        assert!(!a.folders.checkpoint().exists());
        assert!(node.clean(&a).await.failures.is_empty(), "idempotent");
    }

    /// An instance NVML refuses to destroy (in use) keeps the checkpoint, and the error names
    /// it; once it is free, a rerun finishes.
    #[tokio::test]
    async fn an_instance_in_use_keeps_the_checkpoint_so_a_rerun_finishes() {
        let node = Node::new();
        let a = node.args();
        let fake = crate::testing::FakeMig::new(&[(9, 4)]);
        let m = fake.create("GPU-x", 9, 4).expect("create");
        let mut cp = checkpoint::Checkpoint::new();
        cp.claims.insert(
            CLAIM_A.into(),
            dynamic_entry("GPU-x", &[("gpu-0-mig-3g20gb-9-4", m.clone())]),
        );
        node.write(
            &a.folders.checkpoint(),
            &String::from_utf8(cp.to_json()).expect("utf-8"),
        );
        fake.fail_destroy(Some("In use by another client (NVML return code 19)"));
        let report = cleanup(&a, &fake, Some(BOOT)).await;
        let err = report
            .failures
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        assert!(
            err.contains("gpu-0-mig-3g20gb-9-4")
                && err.contains(&m.uuid)
                && err.contains("code 19")
                && err.contains("run cleanup again"),
            "{err}"
        );
        assert!(a.folders.checkpoint().exists(), "kept while owed");
        assert_eq!(fake.instances().len(), 1);

        fake.fail_destroy(None);
        let report = cleanup(&a, &fake, Some(BOOT)).await;
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert!(fake.instances().is_empty());
        assert!(!a.folders.checkpoint().exists());
    }
}
