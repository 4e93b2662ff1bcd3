//! Errors of the sharing module. Every message names the GPU, daemon or path involved and,
//! where there is one, what to do about it; these strings reach users as prepare errors.

use std::path::PathBuf;
use std::time::Duration;

/// What went wrong while applying or undoing GPU sharing.
#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    /// A driver tool is not installed under the driver root.
    #[error(
        "{tool} not found under driver root {driver_root} (searched {searched}); \
         set --nvidia-driver-root (NVIDIA_DRIVER_ROOT) to where the NVIDIA driver is installed, \
         and --container-driver-root (CONTAINER_DRIVER_ROOT) to where this process sees it if \
         elsewhere"
    )]
    ToolNotFound {
        /// Tool name, e.g. `nvidia-smi`.
        tool: &'static str,
        /// The driver root that was searched.
        driver_root: PathBuf,
        /// Every candidate path that was tried, comma separated.
        searched: String,
    },
    /// A tool could not be started.
    #[error("cannot run {path}: {source}")]
    Spawn {
        /// Path of the executable.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A tool did not finish in time and was killed.
    #[error("`{command}` did not finish within {timeout:?} and was killed")]
    ToolTimeout {
        /// The command line.
        command: String,
        /// The limit it ran under.
        timeout: Duration,
    },
    /// A tool exited with a failure.
    #[error("`{command}` failed ({status}): {output}")]
    ToolFailed {
        /// The command line.
        command: String,
        /// Exit status in words.
        status: String,
        /// What it printed (stdout and stderr, trimmed).
        output: String,
    },
    /// The GPU does not support the time-slice setting.
    #[error(
        "GPU {gpu} does not support time-slicing intervals ({reason}); \
         use sharing strategy MPS or no sharing config for this GPU"
    )]
    TimeSliceNotSupported {
        /// GPU UUID.
        gpu: String,
        /// What nvidia-smi said.
        reason: String,
    },
    /// The GPU does not support the compute mode MPS or time-slicing needs.
    #[error("cannot set compute mode {mode} on GPU {gpu}: {reason}")]
    ComputeModeNotSupported {
        /// GPU UUID.
        gpu: String,
        /// The mode asked for.
        mode: &'static str,
        /// What nvidia-smi said.
        reason: String,
    },
    /// The API server refused or failed an operation on an MPS daemon pod.
    #[error("MPS daemon pod {pod}: {message}")]
    DaemonPod {
        /// Pod name.
        pod: String,
        /// What failed, with the API server's answer.
        message: String,
    },
    /// The MPS control daemon exited or could not start.
    #[error("MPS control daemon {daemon} failed to start: {reason}")]
    MpsStart {
        /// Daemon id (`<claimUID>-<group>`).
        daemon: String,
        /// Why, with the tail of its log where there is one.
        reason: String,
    },
    /// The MPS control daemon did not answer on its pipe in time.
    #[error(
        "MPS control daemon {daemon} did not answer on {pipe_dir} within {timeout:?}: {last_error}"
    )]
    MpsNotReady {
        /// Daemon id.
        daemon: String,
        /// Its pipe directory.
        pipe_dir: PathBuf,
        /// How long we waited.
        timeout: Duration,
        /// The last answer or error seen.
        last_error: String,
    },
    /// The MPS control daemon rejected a command (the client prints the reason and exits 0).
    #[error("MPS control daemon {daemon} rejected the limits: {message}")]
    MpsRejected {
        /// Daemon id.
        daemon: String,
        /// What the daemon answered.
        message: String,
    },
    /// The group cannot be applied on this node (a name unusable as a path component, a
    /// socket path too long, no devices). Config errors never get here: the api crate's
    /// validation refused them when the claim was planned.
    #[error("invalid sharing request at {field}: {message}")]
    InvalidRequest {
        /// What was wrong with, e.g. `pluginDir` or `device group`.
        field: String,
        /// What was wrong and what would be valid.
        message: String,
    },
    /// Two claims want incompatible sharing on the same GPU.
    #[error("GPU {gpu} is already shared with {holder}; it cannot also be used with {wanted}")]
    Conflict {
        /// GPU UUID.
        gpu: String,
        /// Who holds it and how.
        holder: String,
        /// What was asked.
        wanted: String,
    },
    /// A file or directory operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What we were doing, e.g. `create directory`.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The sharing state file is unreadable.
    #[error("sharing state {path} is not valid: {reason}")]
    StateCorrupt {
        /// The state file.
        path: PathBuf,
        /// Why it could not be decoded.
        reason: String,
    },
}

impl SharingError {
    /// Shorthand for [`SharingError::Io`].
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
