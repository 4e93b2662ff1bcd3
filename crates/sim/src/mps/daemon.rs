//! The control daemon (`-d`, `-f`): owns the pipe directory, listens on its sockets, logs in
//! the real line format, and answers each connection: a front-end's commands
//! ([`super::protocol`]) or a CUDA client's hello ([`super::server`]).
//!
//! Invariants: one daemon per pipe directory, held by an exclusive `flock` on `control_lock`
//! for the daemon's lifetime; a socket appears under its final name only once it listens, so
//! whoever sees `control` can connect; the daemon's settings live in memory only (lost on
//! `quit`, as on real MPS).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use super::protocol::{execute, parse_percentage, parse_pinned_entry, write_frame};
use super::server::Server;
use super::{CLIENT_HELLO, DAEMON_CHILD_FLAG, MpsEnv};
use crate::state::State;

const ALREADY_RUNNING: &str = "An instance of this daemon is already running";

/// `-d`: re-execute this binary detached (own process group, no inherited stdio, so a
/// caller waiting for our output is not held by the daemon) and return once it listens.
pub(super) fn spawn_background(args: &[String], out: &mut dyn Write) -> i32 {
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else {
        let _ = writeln!(out, "cannot locate the nvidia-cuda-mps-control executable");
        return 1;
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args.iter().filter(|a| *a != "-d"))
        .arg(DAEMON_CHILD_FLAG)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(out, "cannot start the MPS control daemon: {e}");
            return 1;
        }
    };
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = BufReader::new(stdout).read_line(&mut line);
    }
    if line.trim_end() == "ready" {
        return 0;
    }
    let _ = child.wait();
    let _ = write!(out, "{line}");
    1
}

/// How the daemon runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// `-f`: in the caller's process, log lines echoed to stdout.
    Foreground,
    /// The detached child `-d` started: says `ready` on stdout once it listens.
    Child,
}

/// A device the daemon serves, in `CUDA_VISIBLE_DEVICES` order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Device {
    /// Full UUID when known.
    pub(super) uuid: Option<String>,
}

/// The devices named by `CUDA_VISIBLE_DEVICES` (or all GPUs), validated against the state.
/// Unknown entries are dropped, as CUDA ignores devices it cannot find.
fn visible_devices(env: &MpsEnv, state: Option<&State>, log: &Logger) -> Option<Vec<Device>> {
    let Some(state) = state else {
        // No simulated host: accept whatever the caller names.
        return env.visible_devices.as_ref().map(|v| {
            v.split(',')
                .map(|e| Device {
                    uuid: e
                        .trim()
                        .starts_with(['G', 'M'])
                        .then(|| e.trim().to_string()),
                })
                .collect()
        });
    };
    let all_uuids: Vec<String> = state
        .profile
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .chain((0..state.gpus.len()).flat_map(|i| {
            state
                .mig_devices(i)
                .into_iter()
                .map(|m| m.ci.uuid.clone())
                .collect::<Vec<_>>()
        }))
        .collect();
    let Some(cvd) = &env.visible_devices else {
        return Some(
            state
                .profile
                .gpus
                .iter()
                .map(|g| Device {
                    uuid: Some(g.uuid.clone()),
                })
                .collect(),
        );
    };
    let mut out = Vec::new();
    for entry in cvd.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let found = if let Ok(n) = entry.parse::<usize>() {
            state.profile.gpus.get(n).map(|g| g.uuid.clone())
        } else {
            // CUDA accepts unique UUID prefixes.
            let m: Vec<&String> = all_uuids.iter().filter(|u| u.starts_with(entry)).collect();
            (m.len() == 1).then(|| m[0].clone())
        };
        match found {
            Some(uuid) => out.push(Device { uuid: Some(uuid) }),
            None => log.line(&format!(
                "Ignoring CUDA_VISIBLE_DEVICES entry {entry}: no such device"
            )),
        }
    }
    Some(out)
}

/// `control.log` (when writable), echoed to stdout in the foreground.
pub(super) struct Logger {
    pub(super) file: Option<Mutex<File>>,
    pub(super) echo: bool,
}

impl Logger {
    pub(super) fn line(&self, msg: &str) {
        let line = format!(
            "[{} Control {:>5}] {msg}\n",
            timestamp(),
            std::process::id()
        );
        if let Some(f) = &self.file {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(line.as_bytes());
        }
        if self.echo {
            let _ = std::io::stdout().write_all(line.as_bytes());
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS.mmm` in UTC.
pub(super) fn timestamp() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Daemon settings changed by commands.
pub(super) struct Settings {
    pub(super) devices: Option<Vec<Device>>,
    pub(super) active_thread_percentage: f64,
    /// Pinned memory limit in MiB by device key.
    pub(super) pinned: BTreeMap<String, u64>,
    pub(super) client_priority: u32,
}

/// The daemon: its settings, logs and the MPS server it runs.
pub(super) struct Daemon {
    pub(super) settings: Mutex<Settings>,
    pub(super) log: Logger,
    pub(super) pipe_dir: PathBuf,
    /// The running MPS server, started by the first client.
    pub(super) server: Mutex<Option<Server>>,
    /// `server.log`, when the log directory is writable.
    pub(super) server_log: Option<Mutex<File>>,
    /// Servers started so far (each gets a new PID).
    pub(super) servers_started: Mutex<u32>,
    /// Signalled (with `server` locked) when the server loses a client or goes away, which a
    /// client of another user waits for.
    pub(super) server_changed: Condvar,
    /// `-M`: every client is served as [`Daemon::own_uid`], all by one server.
    pub(super) multi_user: bool,
    /// The daemon's own user.
    pub(super) own_uid: u32,
}

/// The files the daemon creates in the pipe directory (and removes on start and `quit`).
const PIPE_FILES: &[&str] = &[
    "control",
    "control_privileged",
    "log",
    "nvidia-cuda-mps-control.pid",
];

/// Runs the daemon in this process (`-f`, or the detached child of `-d`) until `quit`.
/// `multi_user` is `-M`.
pub(super) fn serve(
    env: &MpsEnv,
    state: Option<&State>,
    mode: Mode,
    multi_user: bool,
    out: &mut dyn Write,
) -> i32 {
    let fail = |out: &mut dyn Write, msg: &str| {
        let _ = writeln!(out, "{msg}");
        let _ = out.flush();
        1
    };
    let pipe_dir = env.pipe_dir();
    if fs::create_dir_all(&pipe_dir).is_err() {
        return fail(
            out,
            &format!(
                "Cannot access CUDA_MPS_PIPE_DIRECTORY={}",
                pipe_dir.display()
            ),
        );
    }
    // The lock is held for the daemon's lifetime (the file stays open until exit).
    let lock = match OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(pipe_dir.join("control_lock"))
    {
        Ok(f) => f,
        Err(_) => {
            return fail(
                out,
                &format!(
                    "Cannot access CUDA_MPS_PIPE_DIRECTORY={}",
                    pipe_dir.display()
                ),
            );
        }
    };
    if lock.try_lock().is_err() {
        return fail(out, ALREADY_RUNNING);
    }

    let log_dir = env.log_dir();
    let log_file = fs::create_dir_all(&log_dir)
        .and_then(|()| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(log_dir.join("control.log"))
        })
        .ok();
    if log_file.is_none() {
        let _ = writeln!(
            out,
            "Warning: Failed writing log files to directory [{}]. No logs will be available.",
            log_dir.display()
        );
    }
    let log = Logger {
        file: log_file.map(Mutex::new),
        echo: mode == Mode::Foreground,
    };
    let server_log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join("server.log"))
        .ok()
        .map(Mutex::new);

    let mut pct = 100.0;
    if let Some(v) = &env.active_thread_percentage {
        match parse_percentage(v) {
            Some(p) => pct = p,
            None => {
                return fail(
                    out,
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE should be between (0.0, 100.0]",
                );
            }
        }
    }
    let devices = visible_devices(env, state, &log);
    let mut settings = Settings {
        devices,
        active_thread_percentage: pct,
        pinned: BTreeMap::new(),
        client_priority: 0,
    };
    if let Some(v) = &env.pinned_mem_limit {
        for item in v.split(',').filter(|s| !s.is_empty()) {
            match parse_pinned_entry(&settings, item) {
                Some((key, mib)) => {
                    settings.pinned.insert(key, mib);
                }
                None => {
                    return fail(
                        out,
                        &format!("Invalid CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry {item:?}"),
                    );
                }
            }
        }
    }

    for f in PIPE_FILES {
        let _ = fs::remove_file(pipe_dir.join(f));
    }
    let control = pipe_dir.join("control");
    // Privileged socket first and `control` last, each bound and listening under a staging
    // name before it is renamed into place: whoever sees `control` can connect at once.
    let listeners = [
        bind_in_place(&pipe_dir.join("control_privileged"), 0o600),
        bind_in_place(&control, 0o666),
    ];
    let mut bound = Vec::new();
    for l in listeners {
        match l {
            Ok(l) => bound.push(l),
            Err(e) => {
                return fail(
                    out,
                    &format!(
                        "Cannot create the control socket in {}: {e}",
                        pipe_dir.display()
                    ),
                );
            }
        }
    }
    let _ = make_fifo(&pipe_dir.join("log"));
    let _ = fs::write(
        pipe_dir.join("nvidia-cuda-mps-control.pid"),
        format!("{}\n", std::process::id()),
    );

    log.line(&format!(
        "Starting control daemon using socket {}",
        control.display()
    ));
    log.line(&format!(
        "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={}",
        pipe_dir.display()
    ));
    log.line("CUDA MPS Control binary version: 13000");

    let daemon = Arc::new(Daemon {
        settings: Mutex::new(settings),
        log,
        pipe_dir,
        server: Mutex::new(None),
        server_log,
        servers_started: Mutex::new(0),
        server_changed: Condvar::new(),
        multi_user,
        own_uid: std::fs::metadata("/proc/self").map_or(0, |m| m.uid()),
    });
    if mode == Mode::Child {
        // Tell the `-d` parent we listen; nothing else is ever written to this pipe.
        let _ = writeln!(out, "ready");
    }
    let _ = out.flush();

    let mut bound = bound.into_iter();
    let privileged = bound.next_back();
    if let Some(l) = privileged {
        let d = daemon.clone();
        std::thread::spawn(move || accept_loop(&l, &d));
    }
    if let Some(l) = bound.next() {
        accept_loop(&l, &daemon);
    }
    drop(lock);
    0
}

/// Serves each connection of `listener` on its own thread.
fn accept_loop(listener: &UnixListener, daemon: &Arc<Daemon>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let d = daemon.clone();
        std::thread::spawn(move || handle_ui(conn, &d));
    }
}

/// One connection: a CUDA client's hello, or a front-end's commands until it closes.
fn handle_ui(conn: UnixStream, daemon: &Daemon) {
    daemon.log.line("Accepting connection...");
    let Ok(mut writer) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    if let Some(hello) = line.strip_prefix(CLIENT_HELLO) {
        let Some(peer_uid) = peer_uid(&writer) else {
            daemon.log.line("User did not send valid credentials");
            return;
        };
        let Ok((pid, reply)) = daemon.attach(hello, peer_uid) else {
            return;
        };
        let _ = write_frame(&mut writer, &reply);
        // The client stays attached while its connection is open, as a CUDA context does.
        let mut rest = Vec::new();
        let _ = reader.read_to_end(&mut rest);
        daemon.detach(pid);
        return;
    }
    daemon.log.line("NEW UI");
    let mut first = Some(std::mem::take(&mut line));
    loop {
        if let Some(l) = first.take() {
            line = l;
        } else {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let cmd = line.trim();
        if cmd.is_empty() {
            continue;
        }
        daemon.log.line(&format!("Cmd:{cmd}"));
        let (reply, quit) = execute(daemon, cmd);
        if quit {
            daemon.log.line("Exit");
            for f in PIPE_FILES.iter().chain(&["control_lock"]) {
                let _ = fs::remove_file(daemon.pipe_dir.join(f));
            }
        }
        let _ = write_frame(&mut writer, &reply);
        if quit {
            std::process::exit(0);
        }
    }
    daemon.log.line("UI closed");
}

/// The user of the process at the other end of `conn`, as the kernel recorded it when it
/// connected (`SO_PEERCRED`, in this daemon's user namespace): how the real daemon tells
/// users apart, so a client cannot pass itself off as another user.
#[allow(unsafe_code)]
fn peer_uid(conn: &UnixStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow of `conn`; `cred` and `len` are valid,
    // writable and `len` holds the size of `cred`, so the kernel writes within it.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

/// Binds a listening socket at a staging name, sets its mode, then renames it to `path`.
fn bind_in_place(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    // A name no longer than the final one: socket paths are limited to 108 bytes.
    let staging = path.with_file_name(".s");
    let _ = fs::remove_file(&staging);
    let listener = UnixListener::bind(&staging)?;
    let placed = fs::set_permissions(&staging, fs::Permissions::from_mode(mode))
        .and_then(|()| fs::rename(&staging, path));
    if let Err(e) = placed {
        let _ = fs::remove_file(&staging);
        return Err(e);
    }
    Ok(listener)
}

/// Creates the FIFO the real daemon uses to collect server logs.
#[allow(unsafe_code)]
fn make_fifo(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; mkfifo only reads it.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_has_the_log_shape() {
        let t = timestamp();
        assert_eq!(t.len(), 23, "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[10..11], " ");
        assert_eq!(&t[19..20], ".");
        assert!(t.starts_with("20"), "{t}");
    }
}
