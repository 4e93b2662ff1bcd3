//! `cuda-app`: the stand-in for a CUDA program, for checks inside containers.
//!
//! It does what matters to the driver of a CUDA program's start: it sees the GPUs whose
//! device nodes its `/dev` has (as the real driver does, through [`StateFile::load_visible`]),
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
//! Output, one fact per line: `GPU <i>: <uuid> (compute mode <mode>)` for each visible GPU,
//! then either the daemon's reply (`MPS server <pid>`, `active thread percentage <p>`,
//! `device <n> <uuid> pinned memory limit <limit|none>`) or `MPS: not in use`.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use crate::mps;
use crate::state::{ComputeMode, State};

/// What CUDA prints for `cudaErrorDevicesUnavailable`.
pub const DEVICES_UNAVAILABLE: &str =
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable (cudaErrorDevicesUnavailable)";

/// Runs the program: `state` is the simulator state as this process sees it (`None`: no
/// simulated host, no GPUs), `pipe_dir` the value of `CUDA_MPS_PIPE_DIRECTORY`.
pub fn run(state: Option<&State>, pipe_dir: Option<PathBuf>, out: &mut dyn Write) -> i32 {
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
    let pipe_dir = pipe_dir.unwrap_or_else(|| PathBuf::from(mps::DEFAULT_PIPE_DIR));
    match attach(&pipe_dir) {
        Some(reply) => {
            let _ = out.write_all(reply.as_bytes());
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

/// Joins the daemon's server through `pipe_dir/control`; `None` when no daemon answers.
fn attach(pipe_dir: &std::path::Path) -> Option<String> {
    let mut conn = UnixStream::connect(pipe_dir.join("control")).ok()?;
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    let hello = format!("{} {} {uid}\n", mps::CLIENT_HELLO, std::process::id());
    conn.write_all(hello.as_bytes()).ok()?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    conn.read_exact(&mut body).ok()?;
    String::from_utf8(body).ok()
}
