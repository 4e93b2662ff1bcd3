//! What sharing has done on this node, persisted so that it survives a plugin restart.
//!
//! Invariants:
//! - A time-slice entry exists for a GPU from before its interval is set until it has been
//!   reset to `Default`; an entry with no claims left means "reset still owed".
//! - An MPS record exists from before its directories are created or its daemon is started
//!   until the daemon is gone, the compute mode restored and the directories removed. So
//!   whatever crashes in between, recovery finds everything it has to clean up.
//!
//! The state is plain data; [`SharingStore`] persists it. The node plugin may keep it inside
//! its own checkpoint (implement the trait over it) or use [`FileStore`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use gpu_dra_api::Interval;
use gpu_dra_core::sharing::{MEMORY_SHARE_DAEMON_OWNER, MpsLimits};

use super::error::SharingError;

/// Current version of the serialized state.
pub const STATE_VERSION: u32 = 1;

/// Everything sharing has applied on the node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharingState {
    /// Format version ([`STATE_VERSION`]).
    #[serde(default)]
    pub version: u32,
    /// Time-slice settings by whole-GPU UUID.
    #[serde(default)]
    pub time_slicing: BTreeMap<String, TimeSliceRecord>,
    /// MPS control daemons by daemon id (`<claimUID>-<group>`).
    #[serde(default)]
    pub mps: BTreeMap<String, MpsRecord>,
    /// Boot ID of the node the state describes (`None`: unknown, saved by an older version).
    /// Nothing recorded here survives a reboot: no daemon runs, GPU settings are back to
    /// their defaults, and a recorded pid may belong to an unrelated process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
}

/// A GPU whose time-slice interval we set, and the claims relying on it (reference count).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeSliceRecord {
    /// The interval last set (persisted as its wire spelling, `"Long"`).
    pub interval: Interval,
    /// UIDs of the prepared claims using this GPU with time-slicing.
    pub claims: BTreeSet<String>,
}

/// Where an MPS daemon is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MpsPhase {
    /// Being started by a prepare that has not returned yet.
    Starting,
    /// Answered on its pipe with its limits applied; the claim is prepared.
    Ready,
    /// Being torn down by an unprepare.
    Stopping,
}

/// One MPS control daemon serving one device group of one claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsRecord {
    /// Claim UID.
    pub claim_uid: String,
    /// Device group within the claim.
    pub group: String,
    /// Lifecycle phase.
    pub phase: MpsPhase,
    /// Process id of `nvidia-cuda-mps-control -f`, once started.
    pub pid: Option<u32>,
    /// The daemon's directory (`<plugin-dir>/mps/<id>`), holding `pipe` and `log` (and an
    /// empty `shm` left by versions that mounted it at clients' `/dev/shm`).
    pub dir: PathBuf,
    /// GPU or MIG UUIDs it serves, sorted: the daemon's `CUDA_VISIBLE_DEVICES` order.
    pub devices: Vec<String>,
    /// The subset of `devices` that are whole GPUs (compute mode set on these).
    pub whole_gpus: Vec<String>,
    /// Limits applied after every (re)start.
    pub limits: MpsLimits,
    /// For the daemon of a memory-share GPU (`claim_uid` is then
    /// [`MEMORY_SHARE_DAEMON_OWNER`] and `group` the GPU's UUID): the claims holding a share
    /// of it, prepared or being prepared. The daemon is stopped when the last one goes.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub share_claims: BTreeSet<String>,
    /// For the daemon of a memory-share GPU: the one namespace whose claims it serves
    /// (`sharing::shared_mps` says why). `None` for a claim's own daemon, and for a shared
    /// daemon recorded by a version without the rule, which keeps serving any namespace until
    /// its last claim goes. Written only when set, so older plugins read the state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl MpsRecord {
    /// Whether this is the shared daemon of a memory-share GPU.
    pub fn is_memory_share(&self) -> bool {
        self.claim_uid == MEMORY_SHARE_DAEMON_OWNER
    }

    /// The claims relying on the daemon.
    pub fn claims(&self) -> Vec<String> {
        if self.is_memory_share() {
            self.share_claims.iter().cloned().collect()
        } else {
            vec![self.claim_uid.clone()]
        }
    }

    /// `<dir>/pipe`: the control socket directory (`CUDA_MPS_PIPE_DIRECTORY`).
    pub fn pipe_dir(&self) -> PathBuf {
        self.dir.join("pipe")
    }
    /// `<dir>/log`: `CUDA_MPS_LOG_DIRECTORY`.
    pub fn log_dir(&self) -> PathBuf {
        self.dir.join("log")
    }
}

/// Persists [`SharingState`]. `save` must be durable when it returns.
pub trait SharingStore: Send + Sync {
    /// The last saved state (empty when none was saved).
    fn load(&self) -> Result<SharingState, SharingError>;
    /// Saves `state` durably.
    fn save(&self, state: &SharingState) -> Result<(), SharingError>;
}

/// A JSON file, written crash-safely with `gpu_dra_fsutil::write_atomic` (temp file, fsync,
/// rename, fsync the directory).
#[derive(Debug, Clone)]
pub struct FileStore {
    path: PathBuf,
}

impl FileStore {
    /// A store at `path` (conventionally `<plugin-dir>/sharing.json`).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl SharingStore for FileStore {
    /// Also removes temp files that a save interrupted by a crash left behind (only stale
    /// ones: see `gpu_dra_fsutil::remove_stale_temps`); the plugin loads once, at start.
    fn load(&self) -> Result<SharingState, SharingError> {
        if let (Some(dir), Some(name)) = (self.path.parent(), self.path.file_name()) {
            gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy());
        }
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(SharingState {
                    version: STATE_VERSION,
                    ..Default::default()
                });
            }
            Err(e) => return Err(SharingError::io("read", &self.path, e)),
        };
        let state: SharingState =
            serde_json::from_slice(&bytes).map_err(|e| SharingError::StateCorrupt {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
        if state.version > STATE_VERSION {
            return Err(SharingError::StateCorrupt {
                path: self.path.clone(),
                reason: format!(
                    "version {} is newer than this plugin understands ({STATE_VERSION})",
                    state.version
                ),
            });
        }
        Ok(state)
    }

    fn save(&self, state: &SharingState) -> Result<(), SharingError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| SharingError::io("create directory", dir, e))?;
        let mut state = state.clone();
        state.version = STATE_VERSION;
        let bytes = serde_json::to_vec_pretty(&state).map_err(|e| SharingError::StateCorrupt {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        // 0o644: what the file got before from `File::create` under the usual umask.
        gpu_dra_fsutil::write_atomic(&self.path, &bytes, 0o644)
            .map_err(|e| SharingError::io("write", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_store_round_trips_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path().join("sub/sharing.json"));
        assert_eq!(store.load().unwrap().mps.len(), 0);
        let mut s = SharingState::default();
        s.time_slicing.insert(
            "GPU-1".into(),
            TimeSliceRecord {
                interval: Interval::Long,
                claims: ["c1".to_string()].into(),
            },
        );
        s.mps.insert(
            "c1-0".into(),
            MpsRecord {
                claim_uid: "c1".into(),
                group: "0".into(),
                phase: MpsPhase::Ready,
                pid: Some(42),
                dir: "/x/mps/c1-0".into(),
                devices: vec!["GPU-1".into()],
                whole_gpus: vec!["GPU-1".into()],
                limits: MpsLimits {
                    active_thread_percentage: Some(50),
                    pinned_memory_mib: [("GPU-1".to_string(), 1024)].into(),
                    multi_user: false,
                },
                share_claims: Default::default(),
                namespace: None,
            },
        );
        store.save(&s).unwrap();
        let back = store.load().unwrap();
        assert_eq!(back.version, STATE_VERSION);
        assert_eq!(back.time_slicing, s.time_slicing);
        assert_eq!(back.mps, s.mps);
        let files: Vec<_> = std::fs::read_dir(dir.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(files, ["sharing.json"], "no temp file left");
    }

    /// `sharing.json` outlives plugin versions: a file written before the sharing values
    /// became the api crate's types (time-slice intervals by name, limits by UUID) still reads
    /// as the same state.
    #[test]
    fn a_state_file_of_an_earlier_version_still_reads() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/sharing-v1.json");
        let s = FileStore::new(path).load().unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(
            s.boot_id.as_deref(),
            Some("3f7c1a52-0d4e-4b8a-9e61-2c5d8f9a0b17")
        );
        let gpu = "GPU-00000005-1111-2222-3333-444444444444";
        assert_eq!(s.time_slicing[gpu].interval, Interval::Long);
        assert_eq!(
            s.time_slicing[gpu].claims,
            ["5f1c7d2a-8b3e-4f6a-9c0d-1e2f3a4b5c6d".to_string()].into()
        );
        let r = &s.mps["0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b-c0"];
        assert_eq!(r.phase, MpsPhase::Ready);
        assert_eq!(r.pid, Some(4242));
        assert_eq!(r.group, "c0");
        assert_eq!(r.limits.active_thread_percentage, Some(50));
        assert_eq!(
            r.limits.pinned_memory_mib["GPU-00000004-1111-2222-3333-444444444444"],
            1536
        );
        assert_eq!(
            r.pipe_dir(),
            PathBuf::from(
                "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b-c0/pipe"
            )
        );
        // Written back, it reads the same again.
        let dir = tempfile::tempdir().unwrap();
        let again = FileStore::new(dir.path().join("sharing.json"));
        again.save(&s).unwrap();
        assert_eq!(again.load().unwrap(), s);
    }

    #[test]
    fn corrupt_or_newer_state_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sharing.json");
        std::fs::write(&path, "{not json").unwrap();
        let err = FileStore::new(&path).load().unwrap_err().to_string();
        assert!(err.contains("sharing.json"), "{err}");
        std::fs::write(&path, r#"{"version": 99}"#).unwrap();
        let err = FileStore::new(&path).load().unwrap_err().to_string();
        assert!(err.contains("newer"), "{err}");
    }
}
