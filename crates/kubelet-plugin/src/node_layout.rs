//! Where the plugin keeps its files on a node: the three folders (plugin, registration, CDI)
//! with their flags, and every path the plugin creates in them.
//!
//! Invariant: this module is the one place that knows the node's files. Every other module
//! asks it for a path ([`NodeFolders::checkpoint`], [`NodeFolders::sockets`], or the
//! `*_in(plugin_dir)` functions where only the plugin folder is at hand) and never joins a
//! file name of its own; `cleanup` removes exactly [`NodeFolders::owned`]. So a file added
//! here is one that cleanup knows, and a renamed file cannot leave an orphan behind.
//!
//! Ours, in the plugin folder (`--plugin-dir`):
//! - `dra.sock` (or `dra-<pod UID>.sock` during rolling updates): the DRA service;
//! - `gpu-dra-checkpoint.json` ([`gpu_dra_core::checkpoint::FILE_NAME`]): prepared claims;
//! - `gpu-dra-checkpoint.journal` ([`gpu_dra_core::checkpoint::JOURNAL_FILE_NAME`]): the
//!   checkpoint's changes since it was last written (the driver's `journal`);
//! - `sharing.json`: time-slices and MPS daemons applied, so that they can be undone;
//! - `device-health.json`: device health conditions kept across restarts;
//! - `usage-history.json`: per prepared claim, what it used so far (the `usage` sampler);
//! - `instance.lock`: held by the plugin instance that serves the node;
//! - `failpoint.reached`: the step a test failpoint stopped at;
//! - `mps/<daemon>/`: pipe and log folders of MPS control daemons;
//! - `bin/nvidia-cdi-hook-<digest>`: copies of the hook our CDI specs name (`cdi_hook`);
//! - `device-metadata/<claim UID>_<request>.json`: the device metadata file of a prepared
//!   claim's request, which its CDI spec mounts into containers (`device_metadata`);
//! - `checkpoint.json` only when it is in our format (this plugin's former checkpoint name).
//!
//! Ours elsewhere: `<driver>-reg.sock` (or a per-pod name, [`rolling_registrar_socket`]) in the
//! registration folder; `k8s.gpu.nvidia.com-claim_<uid>.json` claim specs in the CDI root.
//! Each file written crash-safely may leave a temp file beside it (`gpu_dra_fsutil`), which
//! goes with it.
//!
//! Not ours, although they share the folders (NVIDIA's driver uses the same ones, and cleanup
//! must leave them): NVIDIA's `checkpoint.json` (no integer `version`), NVIDIA's claim specs
//! (`k8s.gpu.nvidia.com-claim_<uid>.yaml`) and any other vendor's specs, the MPS folders of
//! claims imported from NVIDIA's checkpoint (named there), other drivers' registration
//! sockets, and the third per-pod registration name (`dra-<digest>-reg.sock`), which cannot
//! be told apart from another driver's and is left to the kubelet.

use std::path::{Path, PathBuf};

use gpu_dra_core::{cdi, checkpoint};

/// The sharing state file (time-slices and MPS daemons applied).
const SHARING_STATE: &str = "sharing.json";
/// The device health conditions, kept across restarts.
const HEALTH_STATE: &str = "device-health.json";
/// Per prepared claim, what it used so far (`usage::history`).
const USAGE_HISTORY: &str = "usage-history.json";
/// The file whose exclusive lock makes one plugin instance the node's.
const INSTANCE_LOCK: &str = "instance.lock";
/// The step a test failpoint stopped at.
const FAILPOINT_MARKER: &str = "failpoint.reached";
/// The folder of MPS control daemons' pipe and log folders.
const MPS_DIR: &str = "mps";
/// The folder of installed `nvidia-cdi-hook` copies.
const HOOK_DIR: &str = "bin";
/// File name prefix of an installed `nvidia-cdi-hook` copy.
pub const HOOK_COPY_PREFIX: &str = "nvidia-cdi-hook-";
/// The folder of device metadata files.
const DEVICE_METADATA_DIR: &str = "device-metadata";
/// The DRA socket's name without rolling updates.
const DRA_SOCKET: &str = "dra.sock";

/// The node's folders the plugin writes to, as the kubelet and the container runtime see them;
/// flags shared by `run` and `cleanup`, so that both name the same files.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeFolders {
    /// Folder of dra.sock, the checkpoint and MPS folders.
    #[arg(
        long,
        env = "PLUGIN_DIR",
        default_value = "/var/lib/kubelet/plugins/gpu.nvidia.com"
    )]
    pub plugin_dir: PathBuf,
    /// Folder of the kubelet's plugin registration sockets.
    #[arg(
        long,
        env = "REGISTRAR_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub registrar_dir: PathBuf,
    /// Folder where CDI specs are written.
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    pub cdi_root: PathBuf,
}

/// The checkpoint in `plugin_dir`.
pub fn checkpoint_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(checkpoint::FILE_NAME)
}

/// The checkpoint's journal in `plugin_dir`.
pub fn checkpoint_journal_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(checkpoint::JOURNAL_FILE_NAME)
}

/// The sharing state file in `plugin_dir`.
pub fn sharing_state_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(SHARING_STATE)
}

/// The device health state file in `plugin_dir`.
pub fn health_state_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(HEALTH_STATE)
}

/// The instance lock in `plugin_dir`.
pub fn instance_lock_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(INSTANCE_LOCK)
}

/// The DRA socket of a plugin without a pod UID (`--pod-uid` unset) in `plugin_dir`.
pub fn dra_socket_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(DRA_SOCKET)
}

/// The failpoint marker in `plugin_dir`.
pub fn failpoint_marker_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(FAILPOINT_MARKER)
}

/// The folder under which every MPS daemon of `plugin_dir` keeps its pipe and log folders.
pub fn mps_root_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(MPS_DIR)
}

/// The folder of the installed `nvidia-cdi-hook` copies in `plugin_dir`; the chart mounts it
/// at its host path, so a copy's path is the same on the host and in the container.
pub fn hook_dir_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(HOOK_DIR)
}

/// The folder of the device metadata files in `plugin_dir`; the chart mounts the plugin folder
/// at its host path, so a file's path is the same on the host, where the container runtime
/// mounts it from, and in the plugin's container.
pub fn device_metadata_dir_in(plugin_dir: &Path) -> PathBuf {
    plugin_dir.join(DEVICE_METADATA_DIR)
}

/// The device metadata file of request `request` of claim `claim_uid` in `dir`
/// ([`device_metadata_dir_in`]): `<claim UID>_<request>.json`. Neither a UID nor a request
/// name (a DNS label) has a `_`, so the name tells both.
pub fn device_metadata_file(dir: &Path, claim_uid: &str, request: &str) -> PathBuf {
    dir.join(format!("{claim_uid}_{request}.json"))
}

/// The claim UID of a file name [`device_metadata_file`] gives, if it is one.
pub fn claim_uid_of_device_metadata_file(name: &str) -> Option<&str> {
    let (uid, request) = name.strip_suffix(".json")?.split_once('_')?;
    (!uid.is_empty() && !request.is_empty()).then_some(uid)
}

/// The two sockets of a plugin instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sockets {
    /// The registration socket the kubelet's plugin watcher finds.
    pub registration: PathBuf,
    /// The DRA service's socket, named in the registration.
    pub dra: PathBuf,
}

impl NodeFolders {
    /// The checkpoint.
    pub fn checkpoint(&self) -> PathBuf {
        checkpoint_in(&self.plugin_dir)
    }

    /// The checkpoint's journal.
    pub fn checkpoint_journal(&self) -> PathBuf {
        checkpoint_journal_in(&self.plugin_dir)
    }

    /// This plugin's former checkpoint name, which NVIDIA's driver uses too (see
    /// [`gpu_dra_core::checkpoint::is_own_format`]).
    pub fn legacy_checkpoint(&self) -> PathBuf {
        self.plugin_dir.join(checkpoint::LEGACY_FILE_NAME)
    }

    /// The sharing state file.
    pub fn sharing_state(&self) -> PathBuf {
        sharing_state_in(&self.plugin_dir)
    }

    /// The device health state file.
    pub fn health_state(&self) -> PathBuf {
        health_state_in(&self.plugin_dir)
    }

    /// The usage history of prepared claims.
    pub fn usage_history(&self) -> PathBuf {
        self.plugin_dir.join(USAGE_HISTORY)
    }

    /// The instance lock.
    pub fn instance_lock(&self) -> PathBuf {
        instance_lock_in(&self.plugin_dir)
    }

    /// The failpoint marker.
    pub fn failpoint_marker(&self) -> PathBuf {
        failpoint_marker_in(&self.plugin_dir)
    }

    /// The MPS daemons' folder.
    pub fn mps_root(&self) -> PathBuf {
        mps_root_in(&self.plugin_dir)
    }

    /// The folder of installed `nvidia-cdi-hook` copies.
    pub fn hook_dir(&self) -> PathBuf {
        hook_dir_in(&self.plugin_dir)
    }

    /// The folder of device metadata files.
    pub fn device_metadata_dir(&self) -> PathBuf {
        device_metadata_dir_in(&self.plugin_dir)
    }

    /// The sockets of driver `driver`: `<driver>-reg.sock` and `dra.sock` when `pod_uid` is
    /// empty, else the per-pod names of the kubelet's DRA plugin helper, so that a new
    /// instance registers while the old one still serves (`<driver>-<uid>-reg.sock` or a
    /// shorter form, see [`rolling_registrar_socket`], and `dra-<uid>.sock`).
    pub fn sockets(&self, driver: &str, pod_uid: &str) -> Sockets {
        if pod_uid.is_empty() {
            return Sockets {
                registration: self.registrar_dir.join(format!("{driver}-reg.sock")),
                dra: dra_socket_in(&self.plugin_dir),
            };
        }
        Sockets {
            registration: self.registrar_dir.join(rolling_registrar_socket(
                &self.registrar_dir,
                driver,
                pod_uid,
            )),
            dra: self.plugin_dir.join(format!("dra-{pod_uid}.sock")),
        }
    }

    /// Everything of ours on the node, by the rule it is removed with (see the module
    /// documentation): what `cleanup`, and so `uninstall`, removes.
    pub fn owned(&self, driver: &str) -> OwnedFiles {
        let fixed = self.sockets(driver, "");
        OwnedFiles {
            files: vec![
                fixed.dra,
                fixed.registration,
                self.failpoint_marker(),
                self.instance_lock(),
                self.health_state(),
                self.usage_history(),
            ],
            records: vec![
                self.sharing_state(),
                self.checkpoint(),
                self.checkpoint_journal(),
            ],
            legacy_checkpoint: self.legacy_checkpoint(),
            families: vec![
                Family {
                    dir: self.cdi_root.clone(),
                    kind: EntryKind::File,
                    names: Names::ClaimSpecs,
                },
                Family {
                    dir: self.device_metadata_dir(),
                    kind: EntryKind::File,
                    names: Names::DeviceMetadata,
                },
                Family {
                    dir: self.hook_dir(),
                    kind: EntryKind::File,
                    names: Names::Affixes {
                        prefix: HOOK_COPY_PREFIX.into(),
                        suffix: String::new(),
                    },
                },
                Family {
                    dir: self.plugin_dir.clone(),
                    kind: EntryKind::IdleSocket,
                    names: Names::Affixes {
                        prefix: "dra-".into(),
                        suffix: ".sock".into(),
                    },
                },
                Family {
                    dir: self.registrar_dir.clone(),
                    kind: EntryKind::IdleSocket,
                    names: Names::Affixes {
                        prefix: format!("{driver}-"),
                        suffix: "-reg.sock".into(),
                    },
                },
            ],
            folders: vec![
                self.mps_root(),
                self.hook_dir(),
                self.device_metadata_dir(),
                self.plugin_dir.clone(),
            ],
        }
    }
}

/// Our files on a node, grouped by the rule that removes them ([`NodeFolders::owned`]).
#[derive(Debug, Clone)]
pub struct OwnedFiles {
    /// Ours whatever they hold: removed when present, with their temp files.
    pub files: Vec<PathBuf>,
    /// The records of what is applied on the node (sharing state, checkpoint): removed, with
    /// their temp files, only once everything they record was undone, so that a rerun of
    /// cleanup finds what is still owed.
    pub records: Vec<PathBuf>,
    /// Our former checkpoint name, shared with NVIDIA's driver: removed only when the file is
    /// in our format.
    pub legacy_checkpoint: PathBuf,
    /// Folder entries picked by name (claim specs, hook copies, per-pod sockets), with their
    /// temp files.
    pub families: Vec<Family>,
    /// Folders removed when empty (what is left in them is someone else's), innermost first.
    pub folders: Vec<PathBuf>,
}

/// Entries of one folder that are ours by their name.
#[derive(Debug, Clone)]
pub struct Family {
    /// The folder.
    pub dir: PathBuf,
    /// Which entries.
    pub kind: EntryKind,
    /// Their names.
    pub names: Names,
}

/// What kind of folder entry a [`Family`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// Regular files.
    File,
    /// Sockets nothing answers on (one that answers belongs to a running instance).
    IdleSocket,
}

/// Names of a [`Family`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Names {
    /// Starting with `prefix` and ending with `suffix`.
    Affixes {
        /// Start of the name.
        prefix: String,
        /// End of the name.
        suffix: String,
    },
    /// Our CDI claim specs ([`gpu_dra_core::cdi::spec_file_name`]).
    ClaimSpecs,
    /// Device metadata files ([`device_metadata_file`]).
    DeviceMetadata,
}

impl Names {
    /// Whether `name` is one of these.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            Names::Affixes { prefix, suffix } => name.starts_with(prefix) && name.ends_with(suffix),
            Names::ClaimSpecs => cdi::claim_uid_of_spec_file(name).is_some(),
            Names::DeviceMetadata => claim_uid_of_device_metadata_file(name).is_some(),
        }
    }

    /// The prefix every temp file of these names starts with (after its leading dot).
    pub fn temp_prefix(&self) -> String {
        match self {
            Names::Affixes { prefix, .. } => prefix.clone(),
            Names::ClaimSpecs => format!("{}-{}_", cdi::CDI_VENDOR, cdi::CDI_CLASS),
            // The folder holds nothing else: every temp file in it is one of ours.
            Names::DeviceMetadata => String::new(),
        }
    }
}

/// The registration socket basename for rolling updates, as the kubelet's DRA plugin helper
/// chooses it: `<driver>-<uid>-reg.sock`, else `<driver>-<b64(sha256(uid)[..8])>-reg.sock`,
/// else `dra-<b64(sha256(driver NUL uid)[..16])>-reg.sock` (unpadded URL-safe base64): the
/// first whose full path in `dir` fits a UNIX socket address.
pub fn rolling_registrar_socket(dir: &Path, driver: &str, uid: &str) -> String {
    let digest = |data: &str, n: usize| {
        let d = ring::digest::digest(&ring::digest::SHA256, data.as_bytes());
        base64_url(&d.as_ref()[..n])
    };
    let candidates = [
        format!("{driver}-{uid}-reg.sock"),
        format!("{driver}-{}-reg.sock", digest(uid, 8)),
        format!("dra-{}-reg.sock", digest(&format!("{driver}\0{uid}"), 16)),
    ];
    let fits = |name: &String| dir.join(name).as_os_str().len() <= 108;
    candidates
        .iter()
        .find(|c| fits(c))
        .unwrap_or(&candidates[2])
        .clone()
}

/// Unpadded URL-safe base64 (RFC 4648 section 5).
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b";

    fn folders() -> NodeFolders {
        NodeFolders {
            plugin_dir: "/var/lib/kubelet/plugins/gpu.nvidia.com".into(),
            registrar_dir: "/var/lib/kubelet/plugins_registry".into(),
            cdi_root: "/var/run/cdi".into(),
        }
    }

    #[test]
    fn the_file_names_on_disk_stay_what_earlier_versions_wrote() {
        let f = folders();
        let p = Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com");
        assert_eq!(f.checkpoint(), p.join("gpu-dra-checkpoint.json"));
        assert_eq!(f.legacy_checkpoint(), p.join("checkpoint.json"));
        assert_eq!(f.sharing_state(), p.join("sharing.json"));
        assert_eq!(f.health_state(), p.join("device-health.json"));
        assert_eq!(f.usage_history(), p.join("usage-history.json"));
        assert_eq!(f.instance_lock(), p.join("instance.lock"));
        assert_eq!(f.failpoint_marker(), p.join("failpoint.reached"));
        assert_eq!(f.mps_root(), p.join("mps"));
        assert_eq!(f.hook_dir(), p.join("bin"));
        assert_eq!(
            f.sockets("gpu.nvidia.com", ""),
            Sockets {
                registration: "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock".into(),
                dra: p.join("dra.sock"),
            }
        );
        assert_eq!(
            f.sockets("gpu.nvidia.com", UID),
            Sockets {
                registration: format!(
                    "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-{UID}-reg.sock"
                )
                .into(),
                dra: p.join(format!("dra-{UID}.sock")),
            }
        );
    }

    #[test]
    fn every_socket_and_hook_copy_the_plugin_makes_is_in_the_cleanup_list() {
        let f = folders();
        let owned = f.owned("gpu.nvidia.com");
        let covered = |path: &Path| {
            owned.files.contains(&path.to_path_buf())
                || owned.families.iter().any(|fam| {
                    path.parent() == Some(fam.dir.as_path())
                        && fam
                            .names
                            .matches(&path.file_name().expect("name").to_string_lossy())
                })
        };
        for uid in ["", UID] {
            let s = f.sockets("gpu.nvidia.com", uid);
            assert!(covered(&s.dra), "{}", s.dra.display());
            assert!(covered(&s.registration), "{}", s.registration.display());
        }
        // A per-pod socket shortened by a digest still starts with the driver's name.
        let long = NodeFolders {
            registrar_dir: PathBuf::from(format!("/{}", "d".repeat(50))),
            ..folders()
        };
        let s = long.sockets("gpu.nvidia.com", UID);
        assert!(
            long.owned("gpu.nvidia.com").families.iter().any(|fam| fam
                .names
                .matches(&s.registration.file_name().expect("name").to_string_lossy())),
            "{}",
            s.registration.display()
        );
        let hook = f
            .hook_dir()
            .join(format!("{HOOK_COPY_PREFIX}0123456789abcdef"));
        assert!(covered(&hook));
        let spec = f.cdi_root.join(cdi::spec_file_name(UID));
        assert!(covered(&spec));
        let metadata = device_metadata_file(&f.device_metadata_dir(), UID, "gpus");
        assert_eq!(
            metadata,
            f.plugin_dir
                .join(format!("device-metadata/{UID}_gpus.json"))
        );
        assert!(covered(&metadata));
        assert_eq!(
            claim_uid_of_device_metadata_file(
                &metadata.file_name().expect("name").to_string_lossy()
            ),
            Some(UID)
        );
        assert_eq!(claim_uid_of_device_metadata_file("notes.json"), None);
        assert_eq!(
            claim_uid_of_device_metadata_file(&format!("{UID}_.json")),
            None
        );
        for record in [f.sharing_state(), f.checkpoint(), f.checkpoint_journal()] {
            assert!(owned.records.contains(&record) && !covered(&record));
        }
    }

    #[test]
    fn nvidias_files_in_the_shared_folders_are_not_ours() {
        let f = folders();
        let owned = f.owned("gpu.nvidia.com");
        let names_ours = |dir: &Path, name: &str| {
            owned.files.contains(&dir.join(name))
                || owned.records.contains(&dir.join(name))
                || owned
                    .families
                    .iter()
                    .any(|fam| fam.dir == dir && fam.names.matches(name))
        };
        assert!(!names_ours(&f.cdi_root, &cdi::nvidia_spec_file_name(UID)));
        assert!(!names_ours(&f.cdi_root, "vendor.com-device.json"));
        assert!(!names_ours(&f.registrar_dir, "other.example.com-reg.sock"));
        // NVIDIA's checkpoint name is ours only by content.
        assert!(!names_ours(&f.plugin_dir, "checkpoint.json"));
        assert_eq!(
            owned.legacy_checkpoint,
            f.plugin_dir.join("checkpoint.json")
        );
    }

    #[test]
    fn temp_prefixes_are_those_the_writers_use() {
        assert_eq!(
            Names::ClaimSpecs.temp_prefix(),
            format!("{}-{}_", cdi::CDI_VENDOR, cdi::CDI_CLASS)
        );
        assert!(
            cdi::spec_file_name(UID).starts_with(&Names::ClaimSpecs.temp_prefix()),
            "a spec's temp file starts with the spec's name"
        );
    }

    #[test]
    fn rolling_update_sockets_are_named_as_the_kubelets_helper_names_them() {
        let short = Path::new("/var/lib/kubelet/plugins_registry");
        assert_eq!(
            rolling_registrar_socket(short, "gpu.nvidia.com", UID),
            format!("gpu.nvidia.com-{UID}-reg.sock")
        );
        // Too long for a socket address with the UID: a digest of it, then of both.
        let long = PathBuf::from(format!("/{}", "d".repeat(50)));
        assert_eq!(
            rolling_registrar_socket(&long, "gpu.nvidia.com", UID),
            "gpu.nvidia.com-huEHRTQaikg-reg.sock"
        );
        let longer = PathBuf::from(format!("/{}", "d".repeat(80)));
        assert_eq!(
            rolling_registrar_socket(&longer, "gpu.nvidia.com", UID),
            "dra-1FJochElk4UM5n2RSJ6Z_g-reg.sock"
        );
    }

    #[test]
    fn base64_is_unpadded_and_url_safe() {
        assert_eq!(base64_url(b""), "");
        assert_eq!(base64_url(b"\xfb\xff"), "-_8");
        assert_eq!(base64_url(b"foob"), "Zm9vYg");
        assert_eq!(base64_url(b"foobar"), "Zm9vYmFy");
    }
}
