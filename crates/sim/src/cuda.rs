//! `cuda-app`: the stand-in for a CUDA program, for checks inside containers.
//!
//! It does what matters to the driver of a CUDA program's start: it sees the GPUs whose
//! device nodes its `/dev` has (as the real driver does, through [`StateFile::load_visible`](crate::state::StateFile::load_visible)),
//! and it joins MPS the way the CUDA runtime does, only through the pipe directory
//! (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`): it connects to the control
//! daemon's `control` socket and sends [`mps::CLIENT_HELLO`] with its PID and user; the
//! daemon starts a server if none runs and answers with the server's settings, which it
//! prints. Nothing else is shared with the daemon: no `/dev/shm`, no IPC or PID namespace
//! (measured on an H100 with driver 580: a client needs only the pipe directory).
//!
//! Without a reachable daemon the CUDA runtime runs without MPS; on a GPU in
//! `EXCLUSIVE_PROCESS` compute mode (what an MPS claim's GPU is set to, owned by its MPS
//! server) it then fails with `cudaErrorDevicesUnavailable`, which is what this prints
//! (exit 1). On a GPU in `DEFAULT` mode it runs without MPS and says so.
//!
//! `--hold-seconds <n>` keeps the client attached that long after it has printed (a program
//! still running on its MPS server).
//!
//! Output, one fact per line: `GPU <i>: <uuid> (compute mode <mode>)` for each visible GPU,
//! then either the daemon's reply (`MPS server <pid>`, `active thread percentage <p>`,
//! `device <n> <uuid> pinned memory limit <limit|none>`: what this client got, its own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` applied over the
//! server's values, which they can only lower) or `MPS: not in use`.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use crate::mps;
use crate::state::{ComputeMode, State};

/// What CUDA prints for `cudaErrorDevicesUnavailable`.
pub const DEVICES_UNAVAILABLE: &str =
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable (cudaErrorDevicesUnavailable)";

/// The MPS client variables a CUDA program reads (from its environment, by the binary).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientEnv {
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: Option<PathBuf>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`: this client's share of the threads (can only
    /// lower the server's).
    pub active_thread_percentage: Option<String>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`<dev>=<limit>[,...]`): this client's pinned
    /// memory limits (can only lower the server's).
    pub pinned_mem_limit: Option<String>,
}

impl ClientEnv {
    /// Reads the variables from the process environment (empty values count as unset).
    pub fn from_process() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            pipe_dir: var("CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from),
            active_thread_percentage: var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            pinned_mem_limit: var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        }
    }
}

/// Runs the program: `state` is the simulator state as this process sees it (`None`: no
/// simulated host, no GPUs), `env` its MPS client variables. With `hold`, a client that
/// joined MPS stays attached that long after printing, as a program still computing does
/// (`cuda-app --hold-seconds <n>`).
pub fn run(
    state: Option<&State>,
    env: &ClientEnv,
    hold: Option<std::time::Duration>,
    out: &mut dyn Write,
) -> i32 {
    let gpus: Vec<(String, ComputeMode)> = state
        .map(|s| {
            s.profile
                .gpus
                .iter()
                .zip(&s.gpus)
                .map(|(spec, st)| (spec.uuid.clone(), st.compute_mode))
                .collect()
        })
        .unwrap_or_default();
    if gpus.is_empty() {
        let _ = writeln!(
            out,
            "CUDA error: no CUDA-capable device is detected (cudaErrorNoDevice)"
        );
        return 1;
    }
    for (i, (uuid, mode)) in gpus.iter().enumerate() {
        let _ = writeln!(out, "GPU {i}: {uuid} (compute mode {})", mode.smi_name());
    }
    match attach(env) {
        Some((reply, conn)) => {
            let _ = out.write_all(reply.as_bytes());
            let _ = out.flush();
            if let Some(hold) = hold {
                std::thread::sleep(hold);
            }
            drop(conn);
            0
        }
        None if gpus
            .iter()
            .any(|(_, m)| *m == ComputeMode::ExclusiveProcess) =>
        {
            let _ = writeln!(out, "{DEVICES_UNAVAILABLE}");
            1
        }
        None => {
            let _ = writeln!(out, "MPS: not in use");
            0
        }
    }
}

/// Joins the daemon's server through `<pipe dir>/control`, sending the client's own limits;
/// `None` when no daemon answers.
/// The connection is returned with the reply: the client stays attached while it is open.
fn attach(env: &ClientEnv) -> Option<(String, UnixStream)> {
    let pipe_dir = env
        .pipe_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(mps::DEFAULT_PIPE_DIR));
    let mut conn = UnixStream::connect(pipe_dir.join("control")).ok()?;
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    let mut hello = format!("{} {} {uid}", mps::CLIENT_HELLO, std::process::id());
    // Values with blanks cannot be sent as words; MPS would refuse them too.
    for (key, value) in [
        ("pct", &env.active_thread_percentage),
        ("pinned", &env.pinned_mem_limit),
    ] {
        if let Some(v) = value {
            hello.push_str(&format!(" {key}={}", v.replace(char::is_whitespace, "")));
        }
    }
    hello.push('\n');
    conn.write_all(hello.as_bytes()).ok()?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    conn.read_exact(&mut body).ok()?;
    Some((String::from_utf8(body).ok()?, conn))
}
