//! `nvidia-cuda-mps-control` stand-in: the MPS control daemon and its front-end UI, with the
//! behaviour, messages, files and environment variables the `nvidia-cuda-mps-control(1)`
//! manual page and NVIDIA's Multi-Process Service documentation
//! (<https://docs.nvidia.com/deploy/mps/>, "Tools and Interface Reference" and "Environment
//! Variables") describe.
//!
//! Daemon (`-d` background, `-f` foreground): owns `CUDA_MPS_PIPE_DIRECTORY` through an
//! exclusive `flock` on `control_lock` (a second daemon on the same directory is refused with
//! the real tool's message), listens on the Unix sockets `control` and `control_privileged`,
//! creates the `log` FIFO and `nvidia-cuda-mps-control.pid`, and logs to
//! `CUDA_MPS_LOG_DIRECTORY/control.log` in the real line format. It keeps the default active
//! thread percentage and per-device pinned memory limits in memory (lost on `quit`, as on
//! real MPS) and records every command in the log. `CUDA_VISIBLE_DEVICES` selects and
//! numbers the devices; the simulator state file is used only to validate UUIDs.
//!
//! Front-end (no arguments): reads commands from stdin (newline- or EOF-terminated), sends
//! each to the daemon and prints the answer. It exits 0 while the daemon answers (even when
//! it rejects a command), 1 when there is no daemon or the connection breaks.
//!
//! MPS servers: as on a real host, the first CUDA client that reaches the daemon starts a
//! server, which takes the daemon's defaults at that moment (active thread percentage,
//! pinned memory limits) and keeps them; later clients join it, and `get_server_list`,
//! `get_active_thread_percentage <pid>`, `get_device_pinned_mem_limit <pid> <dev>`,
//! `set_active_thread_percentage <pid> <p>`, `get_client_list <pid>` and `shutdown_server
//! <pid>` act on it. The server is simulated inside the daemon, not as a process: its PID is a
//! number the daemon picks above its own; its log goes to `server.log` next to
//! `control.log`. A client (the `cuda-app` stand-in for a CUDA program, see [`crate::cuda`])
//! reaches the daemon only through the pipe directory's `control` socket, sending
//! [`CLIENT_HELLO`] with its PID and user, and gets the server's settings back; the daemon
//! takes the user from the socket's peer credentials, as the real one does. One user's server
//! runs at a time, other users' clients waiting for it to exit, unless the daemon runs with
//! `-M` (see `server`). No GPU work is simulated.
//!
//! Split by role: `daemon` (the daemon process, its sockets, files and log), `server`
//! (the simulated MPS server that CUDA clients attach to), `protocol` (the wire format
//! between front-end and daemon, and the commands the daemon answers), `client` (the
//! front-end). This module parses the command line and picks one.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use crate::state::State;

mod client;
mod daemon;

/// A pinned memory limit as the daemon prints it (`10G`, `512M`), in MiB.
pub fn limit_mib(s: &str) -> Option<u64> {
    protocol::parse_limit(s)
}

mod protocol;
mod server;

/// Default pipe directory.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// Default log directory.
pub const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";
/// Hidden flag with which `-d` re-executes itself as the detached daemon.
pub const DAEMON_CHILD_FLAG: &str = "--gpu-sim-daemon-child";

/// First bytes of a CUDA client's message on `control`, followed by ` <pid> <uid>`: it starts
/// with a NUL, which no command typed at the front-end contains (private to the simulator).
pub const CLIENT_HELLO: &str = "\u{0}cuda-client";

/// The environment the tool reads (collected by the binary's `main`).
#[derive(Debug, Clone, Default)]
pub struct MpsEnv {
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: Option<PathBuf>,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: Option<PathBuf>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub visible_devices: Option<String>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    pub active_thread_percentage: Option<String>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`.
    pub pinned_mem_limit: Option<String>,
}

impl MpsEnv {
    /// Reads the variables from the process environment.
    pub fn from_process() -> MpsEnv {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        MpsEnv {
            pipe_dir: var("CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from),
            log_dir: var("CUDA_MPS_LOG_DIRECTORY").map(PathBuf::from),
            visible_devices: var("CUDA_VISIBLE_DEVICES"),
            active_thread_percentage: var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            pinned_mem_limit: var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        }
    }

    pub(super) fn pipe_dir(&self) -> PathBuf {
        self.pipe_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR))
    }

    pub(super) fn log_dir(&self) -> PathBuf {
        self.log_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_LOG_DIR))
    }
}

const USAGE: &str = "Usage: nvidia-cuda-mps-control [-d | -f] [-M]
  -d   start the MPS control daemon in background mode
  -f   start the MPS control daemon in foreground mode
  -M   multi-user mode: clients of every user share one MPS server
  -h   print this help
With no option, read commands from standard input and send them to the daemon.";

/// Runs the tool. `state` is the simulator state, used only to validate device UUIDs
/// (`None` when no simulated host can be found: then every device is accepted).
pub fn run(
    args: &[String],
    env: &MpsEnv,
    state: Option<&State>,
    stdin: &mut dyn BufRead,
    out: &mut dyn Write,
) -> i32 {
    let mut daemon = false;
    let mut foreground = false;
    let mut child = false;
    let mut multi_user = false;
    for a in args {
        match a.as_str() {
            "-d" => daemon = true,
            "-f" => foreground = true,
            "-M" => multi_user = true,
            DAEMON_CHILD_FLAG => child = true,
            "-h" | "--help" => {
                let _ = writeln!(out, "{USAGE}");
                return 0;
            }
            _ => {
                let _ = writeln!(out, "{USAGE}");
                return 1;
            }
        }
    }
    if child {
        return daemon::serve(env, state, daemon::Mode::Child, multi_user, out);
    }
    if foreground {
        return daemon::serve(env, state, daemon::Mode::Foreground, multi_user, out);
    }
    if daemon {
        return daemon::spawn_background(args, out);
    }
    client::client(env, stdin, out)
}
