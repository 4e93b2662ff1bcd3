//! One MPS control daemon as a process: start it, talk to it through its control pipe, stop
//! it, and recognise it in `/proc` after a plugin restart.
//!
//! The daemon runs as `nvidia-cuda-mps-control -f` (foreground, so it stays our child and we
//! see its exit) in its own process group (so a signal to the plugin's group does not reach
//! it, and a forced stop also reaches the MPS servers it spawned). Its output goes to a file
//! in its log directory, never to a pipe of ours: it must outlive the plugin process, and a
//! daemon writing into a dead pipe would die of SIGPIPE.
//!
//! With `limits.multi_user` it runs `-f -M` (multi-user: clients of every user share one MPS
//! server; without it the daemon serves one user's server at a time and a client of another
//! user waits until that server exits). [`daemon_args`] is the one place that builds the
//! arguments, for a child process and for a daemon pod alike.
//!
//! A daemon is "ours" only if its command line is the MPS control tool with `-f` and its
//! environment names our pipe directory; a recycled pid never passes that test.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::error::SharingError;
use super::state::MpsRecord;
use super::tools::{DriverRoot, MPS_CONTROL, ToolOutput, file_name_is};

pub use gpu_dra_core::sharing::{CONTAINER_PIPE_DIR, PIPE_DIR_ENV};
/// Environment variable naming the log directory.
pub const LOG_DIR_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// File in the log directory receiving the daemon's own stdout and stderr.
pub const DAEMON_OUTPUT: &str = "daemon.out";

/// Longest usable UNIX socket path (`sun_path` is 108 bytes with the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;
/// The longest socket name the daemon creates in its pipe directory.
const LONGEST_SOCKET: &str = "control_privileged";

/// The environment of the daemon and of every client talking to it.
pub fn daemon_env(record: &MpsRecord) -> Vec<(String, String)> {
    vec![
        ("CUDA_VISIBLE_DEVICES".to_string(), record.devices.join(",")),
        (
            PIPE_DIR_ENV.to_string(),
            record.pipe_dir().display().to_string(),
        ),
        (
            LOG_DIR_ENV.to_string(),
            record.log_dir().display().to_string(),
        ),
    ]
}

/// The daemon's arguments: `-f`, and `-M` when it runs multi-user.
pub fn daemon_args(record: &MpsRecord) -> Vec<&'static str> {
    let mut args = vec!["-f"];
    if record.limits.multi_user {
        args.push("-M");
    }
    args
}

/// Checks that the control sockets fit in a UNIX socket path.
pub fn check_socket_path(record: &MpsRecord) -> Result<(), SharingError> {
    let longest = record.pipe_dir().join(LONGEST_SOCKET);
    let len = longest.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(SharingError::InvalidRequest {
            field: "pluginDir".to_string(),
            message: format!(
                "MPS control socket path {} is {len} bytes, longer than the {MAX_SOCKET_PATH} a \
                 UNIX socket allows; use a shorter --plugin-dir or device group name",
                longest.display()
            ),
        });
    }
    Ok(())
}

/// Creates the pipe and log directories (no shm directory: clients keep their own `/dev/shm`). `fresh` removes any earlier tree first (a new
/// daemon). A restart keeps the directories themselves, because running containers have them
/// bind-mounted and a new inode would be invisible to them, and only empties the pipe
/// directory of the dead daemon's sockets and lock file.
pub fn create_dirs(record: &MpsRecord, fresh: bool) -> Result<(), SharingError> {
    use std::os::unix::fs::PermissionsExt;
    if fresh {
        remove_dirs(record)?;
    } else if let Ok(entries) = std::fs::read_dir(record.pipe_dir()) {
        for entry in entries.flatten() {
            let path = entry.path();
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
    }
    for (dir, mode) in [(record.pipe_dir(), 0o755), (record.log_dir(), 0o755)] {
        std::fs::create_dir_all(&dir).map_err(|e| SharingError::io("create directory", &dir, e))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
            .map_err(|e| SharingError::io("set permissions of", &dir, e))?;
    }
    Ok(())
}

/// Removes the daemon's directory tree; a missing tree is fine.
pub fn remove_dirs(record: &MpsRecord) -> Result<(), SharingError> {
    match std::fs::remove_dir_all(&record.dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SharingError::io("remove directory", &record.dir, e)),
    }
}

/// Starts `nvidia-cuda-mps-control -f` for `record` (directories must exist).
pub fn spawn(root: &DriverRoot, record: &MpsRecord) -> Result<tokio::process::Child, SharingError> {
    let out_path = record.log_dir().join(DAEMON_OUTPUT);
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&out_path)
        .map_err(|e| SharingError::io("open", &out_path, e))?;
    let err = out
        .try_clone()
        .map_err(|e| SharingError::io("open", &out_path, e))?;
    let mut cmd = root.command(MPS_CONTROL, &daemon_args(record), &daemon_env(record))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0)
        // The daemon must survive the plugin: never killed because a handle was dropped.
        .kill_on_drop(false);
    cmd.spawn().map_err(|source| SharingError::Spawn {
        path: root
            .find_tool(MPS_CONTROL)
            .unwrap_or_else(|_| PathBuf::from(MPS_CONTROL)),
        source,
    })
}

/// Runs the client (`nvidia-cuda-mps-control` with commands on stdin) against the daemon.
pub async fn client(
    root: &DriverRoot,
    record: &MpsRecord,
    commands: &str,
    timeout: Duration,
) -> Result<ToolOutput, SharingError> {
    root.run(
        MPS_CONTROL,
        &[],
        &daemon_env(record),
        Some(commands),
        timeout,
    )
    .await
}

/// The commands applying `record`'s limits, ending with the query whose answer proves the
/// daemon is up and listening.
pub fn limits_script(record: &MpsRecord) -> String {
    let mut s = String::new();
    if let Some(p) = record.limits.active_thread_percentage {
        s.push_str(&format!("set_default_active_thread_percentage {p}\n"));
    }
    for (uuid, mib) in &record.limits.pinned_memory_mib {
        s.push_str(&format!(
            "set_default_device_pinned_mem_limit {uuid} {mib}M\n"
        ));
    }
    s.push_str("get_default_active_thread_percentage\n");
    s
}

/// Checks the answer to [`limits_script`]: `set_*` print nothing on success, so every line
/// but the final percentage is a rejection. Returns the percentage the daemon reports.
pub fn check_limits_answer(record: &MpsRecord, stdout: &str) -> Result<f64, String> {
    let lines: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let Some((last, rejected)) = lines.split_last() else {
        return Err("no answer to get_default_active_thread_percentage".to_string());
    };
    if !rejected.is_empty() {
        return Err(rejected.join("; "));
    }
    let pct: f64 = last.parse().map_err(|_| {
        format!("unexpected answer {last:?} to get_default_active_thread_percentage")
    })?;
    if let Some(want) = record.limits.active_thread_percentage
        && (pct - f64::from(want)).abs() > 0.05
    {
        return Err(format!(
            "active thread percentage is {pct} after setting {want}"
        ));
    }
    Ok(pct)
}

/// Waits until the daemon answers on its pipe, applies the limits and checks them. `child` is
/// polled so that a daemon that dies while starting fails fast with its log.
pub async fn wait_ready(
    root: &DriverRoot,
    id: &str,
    record: &MpsRecord,
    mut child: Option<&mut tokio::process::Child>,
    timeout: Duration,
    tool_timeout: Duration,
) -> Result<(), SharingError> {
    let deadline = Instant::now() + timeout;
    let control = record.pipe_dir().join("control");
    let script = limits_script(record);
    let mut pause = Duration::from_millis(1);
    let mut last_error = "control socket not created yet".to_string();
    loop {
        if let Some(c) = child.as_deref_mut()
            && let Ok(Some(status)) = c.try_wait()
        {
            return Err(SharingError::MpsStart {
                daemon: id.to_string(),
                reason: format!("exited with {status}; {}", log_tail(record)),
            });
        }
        if control.exists() {
            let out = client(root, record, &script, tool_timeout).await?;
            if out.success() {
                match check_limits_answer(record, &out.stdout) {
                    Ok(_) => return Ok(()),
                    // A daemon that answers but refuses our limits will not change its mind.
                    Err(message) => {
                        return Err(SharingError::MpsRejected {
                            daemon: id.to_string(),
                            message,
                        });
                    }
                }
            }
            last_error = out.combined();
        }
        if Instant::now() >= deadline {
            return Err(SharingError::MpsNotReady {
                daemon: id.to_string(),
                pipe_dir: record.pipe_dir(),
                timeout,
                last_error,
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Whether the daemon answers on its pipe (`get_server_list`, exit status 0).
pub async fn answers(root: &DriverRoot, record: &MpsRecord, timeout: Duration) -> bool {
    if !record.pipe_dir().join("control").exists() {
        return false;
    }
    client(root, record, "get_server_list\n", timeout)
        .await
        .map(|o| o.success())
        .unwrap_or(false)
}

/// Sends `quit` through the pipe. Returns whether a daemon answered.
pub async fn quit(root: &DriverRoot, record: &MpsRecord, timeout: Duration) -> bool {
    if !record.pipe_dir().join("control").exists() {
        return false;
    }
    match client(root, record, "quit\n", timeout).await {
        Ok(out) => {
            if !out.success() {
                tracing::debug!(output = %out.combined(), "MPS quit answered with a failure");
            }
            !out.combined().contains("Cannot find MPS control daemon")
        }
        Err(e) => {
            tracing::debug!(error = %e, "MPS quit could not be sent");
            false
        }
    }
}

/// Whether `pid` is a live (not zombie) process.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// The pipe folder `pid` serves, when it is a live MPS control daemon (see the module doc).
fn daemon_pipe_dir(pid: u32) -> Option<PathBuf> {
    if !pid_alive(pid) {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
    let arg0 = Path::new(std::ffi::OsStr::from_bytes(args.next()?));
    if !file_name_is(arg0, MPS_CONTROL) || !args.any(|a| a == b"-f") {
        return None;
    }
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{PIPE_DIR_ENV}=");
    environ
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .map(|dir| PathBuf::from(std::ffi::OsStr::from_bytes(dir)))
}

/// Whether `pid` is the MPS control daemon serving `pipe_dir` (see the module doc).
pub fn is_daemon_for(pid: u32, pipe_dir: &Path) -> bool {
    daemon_pipe_dir(pid).is_some_and(|dir| dir == pipe_dir)
}

/// The live MPS control daemons whose pipe folder passes `serves`.
fn daemons_where(serves: impl Fn(&Path) -> bool) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| daemon_pipe_dir(*pid).is_some_and(|dir| serves(&dir)))
        .collect();
    pids.sort_unstable();
    pids
}

/// Every live MPS control daemon serving `pipe_dir` (for a daemon whose pid was never
/// recorded because the plugin crashed right after starting it).
pub fn find_daemons(pipe_dir: &Path) -> Vec<u32> {
    daemons_where(|dir| dir == pipe_dir)
}

/// Every live MPS control daemon whose pipe folder lies under `root` (a plugin folder's).
pub fn find_daemons_under(root: &Path) -> Vec<u32> {
    daemons_where(|dir| dir.starts_with(root))
}

/// SIGKILLs the daemon and its process group (its MPS servers).
pub fn kill(pid: u32) {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    // The daemon leads its own group (spawned with process_group(0)); an adopted daemon
    // started by another tool may not, so the process itself is killed too.
    let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
}

/// Waits up to `timeout` for `pid` to be gone.
pub async fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while pid_alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// The last lines of the daemon's output and control log, for error messages.
pub fn log_tail(record: &MpsRecord) -> String {
    let mut parts = Vec::new();
    for name in [DAEMON_OUTPUT, "control.log"] {
        let path = record.log_dir().join(name);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
            if !tail.is_empty() {
                parts.push(format!("{name}: {tail}"));
            }
        }
    }
    if parts.is_empty() {
        "no log output".to_string()
    } else {
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharing::state::MpsPhase;
    use gpu_dra_core::sharing::MpsLimits;

    fn record(dir: &str) -> MpsRecord {
        MpsRecord {
            claim_uid: "c".into(),
            group: "0".into(),
            phase: MpsPhase::Starting,
            pid: None,
            dir: dir.into(),
            devices: vec!["GPU-a".into(), "MIG-b".into()],
            whole_gpus: vec!["GPU-a".into()],
            limits: MpsLimits {
                active_thread_percentage: Some(40),
                pinned_memory_mib: [("GPU-a".to_string(), 1024), ("MIG-b".to_string(), 512)].into(),
                multi_user: false,
            },
            share_claims: Default::default(),
            namespace: None,
        }
    }

    #[test]
    fn the_daemon_runs_multi_user_only_when_asked() {
        let mut r = record("/p/mps/c-0");
        assert_eq!(daemon_args(&r), ["-f"]);
        r.limits.multi_user = true;
        assert_eq!(daemon_args(&r), ["-f", "-M"]);
    }

    #[test]
    fn script_sets_limits_then_queries() {
        assert_eq!(
            limits_script(&record("/p/mps/c-0")),
            "set_default_active_thread_percentage 40\n\
             set_default_device_pinned_mem_limit GPU-a 1024M\n\
             set_default_device_pinned_mem_limit MIG-b 512M\n\
             get_default_active_thread_percentage\n"
        );
    }

    #[test]
    fn answer_check_reports_rejections_and_mismatches() {
        let r = record("/p/mps/c-0");
        assert_eq!(check_limits_answer(&r, "40.0\n").unwrap(), 40.0);
        let err = check_limits_answer(&r, "Invalid device ordinal!\n40.0\n").unwrap_err();
        assert!(err.contains("Invalid device ordinal!"), "{err}");
        assert!(check_limits_answer(&r, "100.0\n").is_err());
        assert!(check_limits_answer(&r, "").is_err());
    }

    #[test]
    fn env_lists_devices_in_record_order() {
        let env = daemon_env(&record("/p/mps/c-0"));
        assert_eq!(
            env[0],
            ("CUDA_VISIBLE_DEVICES".into(), "GPU-a,MIG-b".into())
        );
        assert_eq!(env[1], (PIPE_DIR_ENV.into(), "/p/mps/c-0/pipe".into()));
        assert_eq!(env[2], (LOG_DIR_ENV.into(), "/p/mps/c-0/log".into()));
    }

    #[test]
    fn socket_path_limit_is_checked() {
        assert!(
            check_socket_path(&record(
                "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b-0"
            ))
            .is_ok()
        );
        // The plugin's own naming: a two-digit config index and a kubelet root 20 bytes longer
        // than the default still fit.
        let root = format!(
            "/var/lib/{}/kubelet/plugins/gpu.nvidia.com/mps",
            "k".repeat(19)
        );
        let dir = format!(
            "{root}/{}",
            gpu_dra_core::sharing::daemon_dir_name("0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b", "c10")
        );
        check_socket_path(&record(&dir)).unwrap();
        // Named by the id, the same daemon did not fit even the default root.
        assert!(
            check_socket_path(&record(
                "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b-c10"
            ))
            .is_err()
        );
        let long = format!("/{}", "x".repeat(100));
        let err = check_socket_path(&record(&long)).unwrap_err().to_string();
        assert!(err.contains("--plugin-dir"), "{err}");
    }

    #[test]
    fn a_new_daemon_gets_pipe_and_log_directories_only() {
        let dir = tempfile::tempdir().unwrap();
        let r = record(&dir.path().join("c-0").display().to_string());
        create_dirs(&r, true).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&r.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["log", "pipe"]);
    }

    #[test]
    fn our_own_process_is_not_a_daemon() {
        let me = std::process::id();
        assert!(pid_alive(me));
        assert!(!is_daemon_for(me, Path::new("/p/mps/c-0/pipe")));
        assert!(!pid_alive(u32::MAX - 1));
    }
}
