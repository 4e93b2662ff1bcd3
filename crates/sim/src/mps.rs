//! `nvidia-cuda-mps-control` stand-in: the MPS control daemon and its front-end UI
//! (NVIDIA_FACTS §B.1).
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
//! Wire protocol between the two (private to the simulator): the client writes one command
//! line ending in `\n`; the daemon answers with a 4-byte little-endian length and that many
//! bytes of text to print.
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
//! [`CLIENT_HELLO`] with its PID and user, and gets the server's settings back. No GPU work
//! is simulated.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::state::State;

/// Default pipe directory.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// Default log directory.
pub const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";
/// Hidden flag with which `-d` re-executes itself as the detached daemon.
pub const DAEMON_CHILD_FLAG: &str = "--gpu-sim-daemon-child";

/// First bytes of a CUDA client's message on `control`, followed by ` <pid> <uid>`: it starts
/// with a NUL, which no command typed at the front-end contains (private to the simulator).
pub const CLIENT_HELLO: &str = "\u{0}cuda-client";

const NO_DAEMON: &str = "Cannot find MPS control daemon process";
const ALREADY_RUNNING: &str = "An instance of this daemon is already running";
const SEND_FAILED: &str = "Cannot send command to MPS control daemon process";

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

    fn pipe_dir(&self) -> PathBuf {
        self.pipe_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR))
    }

    fn log_dir(&self) -> PathBuf {
        self.log_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_LOG_DIR))
    }
}

const USAGE: &str = "Usage: nvidia-cuda-mps-control [-d | -f] [-M]
  -d   start the MPS control daemon in background mode
  -f   start the MPS control daemon in foreground mode
  -M   multi-user mode (accepted; the simulator has no users to separate)
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
    for a in args {
        match a.as_str() {
            "-d" => daemon = true,
            "-f" => foreground = true,
            "-M" => {}
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
        return serve(env, state, Mode::Child, out);
    }
    if foreground {
        return serve(env, state, Mode::Foreground, out);
    }
    if daemon {
        return spawn_background(args, out);
    }
    client(env, stdin, out)
}

/// `-d`: re-execute this binary detached (own process group, no inherited stdio, so a
/// caller waiting for our output is not held by the daemon) and return once it listens.
fn spawn_background(args: &[String], out: &mut dyn Write) -> i32 {
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Foreground,
    Child,
}

/// A device the daemon serves, in `CUDA_VISIBLE_DEVICES` order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Device {
    /// Full UUID when known.
    uuid: Option<String>,
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

struct Logger {
    file: Option<Mutex<File>>,
    echo: bool,
}

impl Logger {
    fn line(&self, msg: &str) {
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
fn timestamp() -> String {
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
struct Settings {
    devices: Option<Vec<Device>>,
    active_thread_percentage: f64,
    /// Pinned memory limit in MiB by device key.
    pinned: BTreeMap<String, u64>,
    client_priority: u32,
}

struct Daemon {
    settings: Mutex<Settings>,
    log: Logger,
    pipe_dir: PathBuf,
    /// The running MPS server, started by the first client.
    server: Mutex<Option<Server>>,
    /// `server.log`, when the log directory is writable.
    server_log: Option<Mutex<File>>,
    /// Servers started so far (each gets a new PID).
    servers_started: Mutex<u32>,
}

/// A simulated MPS server: the daemon's defaults when it started, and its clients.
struct Server {
    pid: u32,
    uid: u32,
    active_thread_percentage: f64,
    /// Pinned memory limit in MiB by device key.
    pinned: BTreeMap<String, u64>,
    clients: Vec<u32>,
}

impl Daemon {
    fn server_line(&self, pid: u32, msg: &str) {
        if let Some(f) = &self.server_log {
            let line = format!("[{} Server {pid:>5}] {msg}\n", timestamp());
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(line.as_bytes());
        }
    }

    /// A client attaches: the server is started if none runs (with the current defaults);
    /// returns the text the client prints. The client's own limits (its
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, sent as
    /// `pct=` and `pinned=` words) apply to it alone and, as on real MPS, can only lower the
    /// server's values; the reply shows what the client got.
    fn attach(&self, hello: &str) -> Result<(u32, String), ()> {
        let mut words = hello.split_whitespace();
        let (Some(pid), Some(uid)) = (
            words.next().and_then(|w| w.parse::<u32>().ok()),
            words.next().and_then(|w| w.parse::<u32>().ok()),
        ) else {
            self.log.line("User did not send valid credentials");
            return Err(());
        };
        let (mut client_pct, mut client_pinned) = (None, None);
        for word in words {
            match word.split_once('=') {
                Some(("pct", v)) => client_pct = Some(v.to_string()),
                Some(("pinned", v)) => client_pinned = Some(v.to_string()),
                _ => {
                    self.log.line("User did not send valid credentials");
                    return Err(());
                }
            }
        }
        let settings = self.settings.lock().unwrap_or_else(|e| e.into_inner());
        let client_pct = match client_pct.as_deref().map(parse_percentage) {
            None => None,
            Some(Some(p)) => Some(p),
            Some(None) => {
                return Ok((
                    pid,
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE should be between (0.0, 100.0]\n".into(),
                ));
            }
        };
        let mut client_limits: BTreeMap<String, u64> = BTreeMap::new();
        for item in client_pinned
            .iter()
            .flat_map(|v| v.split(','))
            .filter(|s| !s.is_empty())
        {
            let parsed = item.split_once('=').and_then(|(d, l)| {
                Some((device_key(&settings, d.trim())?, parse_limit(l.trim())?))
            });
            match parsed {
                Some((key, mib)) => {
                    client_limits.insert(key, mib);
                }
                None => {
                    return Ok((
                        pid,
                        format!("Invalid CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry {item:?}\n"),
                    ));
                }
            }
        }
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if server.as_ref().is_some_and(|s| s.uid != uid) {
            self.log.line(&format!(
                "NEW CLIENT {pid} from user {uid}: Server is busy with another user, client rejected"
            ));
            return Ok((
                pid,
                format!(
                    "MPS server busy with user {}: client rejected\n",
                    server.as_ref().map_or(0, |s| s.uid)
                ),
            ));
        }
        if server.is_none() {
            self.log.line(&format!(
                "NEW CLIENT {pid} from user {uid}: Server is not ready, push client to pending list"
            ));
            let mut started = self
                .servers_started
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *started += 1;
            let spid = std::process::id() + *started;
            self.log
                .line(&format!("Starting new server {spid} for user {uid}"));
            let new = Server {
                pid: spid,
                uid,
                active_thread_percentage: settings.active_thread_percentage,
                pinned: settings.pinned.clone(),
                clients: Vec::new(),
            };
            self.server_line(spid, "Server has started");
            self.server_line(
                spid,
                &format!(
                    "Active Threads Percentage set to {:.1}",
                    new.active_thread_percentage
                ),
            );
            for (key, mib) in &new.pinned {
                self.server_line(
                    spid,
                    &format!(
                        "Device pinned memory limit for device {} set to {:#x} bytes",
                        device_label(&settings, key),
                        mib * 1024 * 1024
                    ),
                );
            }
            *server = Some(new);
        } else {
            self.log.line(&format!(
                "NEW CLIENT {pid} from user {uid}: Server already exists"
            ));
        }
        let Some(srv) = server.as_mut() else {
            return Err(());
        };
        srv.clients.push(pid);
        self.server_line(
            srv.pid,
            &format!("Client {{PID: {pid}, Context ID: 0}} connected"),
        );
        let pct = client_pct.map_or(srv.active_thread_percentage, |p| {
            p.min(srv.active_thread_percentage)
        });
        let mut reply = format!(
            "MPS server {}\nactive thread percentage {pct:.1}\n",
            srv.pid
        );
        let keys: Vec<String> = match &settings.devices {
            Some(devices) => (0..devices.len()).map(|i| i.to_string()).collect(),
            None => {
                let mut keys: Vec<String> = srv.pinned.keys().cloned().collect();
                keys.extend(
                    client_limits
                        .keys()
                        .filter(|k| !srv.pinned.contains_key(*k))
                        .cloned(),
                );
                keys
            }
        };
        for key in keys {
            let limit = match (srv.pinned.get(&key), client_limits.get(&key)) {
                (Some(s), Some(c)) => Some(*s.min(c)),
                (s, c) => s.or(c).copied(),
            }
            .map_or_else(|| "none".to_string(), format_limit);
            reply.push_str(&format!(
                "device {key} {} pinned memory limit {limit}\n",
                device_label(&settings, &key)
            ));
        }
        Ok((pid, reply))
    }

    /// A client's connection closed: it left its server.
    fn detach(&self, pid: u32) {
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(srv) = server.as_mut() {
            srv.clients.retain(|c| *c != pid);
            self.server_line(
                srv.pid,
                &format!("Client {{PID: {pid}, Context ID: 0}} exit"),
            );
        }
    }
}

/// The UUID of a device key (an ordinal in the daemon's numbering), or the key itself.
fn device_label(settings: &Settings, key: &str) -> String {
    settings
        .devices
        .as_ref()
        .and_then(|d| d.get(key.parse::<usize>().ok()?)?.uuid.clone())
        .unwrap_or_else(|| key.to_string())
}

const PIPE_FILES: &[&str] = &[
    "control",
    "control_privileged",
    "log",
    "nvidia-cuda-mps-control.pid",
];

fn serve(env: &MpsEnv, state: Option<&State>, mode: Mode, out: &mut dyn Write) -> i32 {
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
            let parsed = item.split_once('=').and_then(|(d, l)| {
                Some((device_key(&settings, d.trim())?, parse_limit(l.trim())?))
            });
            match parsed {
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

fn accept_loop(listener: &UnixListener, daemon: &Arc<Daemon>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let d = daemon.clone();
        std::thread::spawn(move || handle_ui(conn, &d));
    }
}

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
        let Ok((pid, reply)) = daemon.attach(hello) else {
            return;
        };
        let frame = [&(reply.len() as u32).to_le_bytes()[..], reply.as_bytes()].concat();
        let _ = writer.write_all(&frame);
        let _ = writer.flush();
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
        let frame = [&(reply.len() as u32).to_le_bytes()[..], reply.as_bytes()].concat();
        let _ = writer.write_all(&frame);
        let _ = writer.flush();
        if quit {
            std::process::exit(0);
        }
    }
    daemon.log.line("UI closed");
}

fn parse_percentage(s: &str) -> Option<f64> {
    let v: f64 = s.trim().parse().ok()?;
    (v > 0.0 && v <= 100.0).then_some(v)
}

/// `<n>M` or `<n>G` (case-insensitive, optional trailing `B`) in MiB; at least 1 MiB.
fn parse_limit(s: &str) -> Option<u64> {
    let s = s.to_ascii_uppercase();
    let s = s.strip_suffix('B').unwrap_or(&s);
    let (num, mult) = if let Some(n) = s.strip_suffix('G') {
        (n, 1024)
    } else {
        (s.strip_suffix('M')?, 1)
    };
    let n: u64 = num.parse().ok()?;
    let mib = n.checked_mul(mult)?;
    (mib > 0).then_some(mib)
}

fn format_limit(mib: u64) -> String {
    if mib.is_multiple_of(1024) {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

/// Resolves a device argument (ordinal in the daemon's numbering, or a UUID / unique UUID
/// prefix) to the key limits are stored under (the ordinal).
fn device_key(settings: &Settings, dev: &str) -> Option<String> {
    let Some(devices) = &settings.devices else {
        // Unconstrained (no simulated host, no CUDA_VISIBLE_DEVICES): keep the name as given.
        return Some(dev.to_string());
    };
    if let Ok(n) = dev.parse::<usize>() {
        return (n < devices.len()).then(|| n.to_string());
    }
    let matches: Vec<usize> = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.uuid.as_deref().is_some_and(|u| u.starts_with(dev)))
        .map(|(i, _)| i)
        .collect();
    (matches.len() == 1).then(|| matches[0].to_string())
}

/// The running server if its PID is `pid`.
fn server_by_pid<'a>(server: &'a mut Option<Server>, pid: &str) -> Option<&'a mut Server> {
    let pid = pid.parse::<u32>().ok()?;
    server.as_mut().filter(|srv| srv.pid == pid)
}

/// Executes one command; returns the text to print and whether the daemon quits.
fn execute(daemon: &Daemon, cmd: &str) -> (String, bool) {
    let mut words = cmd.split_whitespace();
    let name = words.next().unwrap_or_default();
    let args: Vec<&str> = words.collect();
    let mut s = daemon.settings.lock().unwrap_or_else(|e| e.into_inner());
    let mut server = daemon.server.lock().unwrap_or_else(|e| e.into_inner());
    let reply = match (name, args.as_slice()) {
        ("get_server_list", []) => server
            .as_ref()
            .map_or_else(String::new, |srv| format!("{}\n", srv.pid)),
        ("quit", [] | ["-t", _]) => {
            if let Some(srv) = server.take() {
                daemon.server_line(srv.pid, "Server exiting");
            }
            return (String::new(), true);
        }
        ("get_active_thread_percentage", [pid]) => match server_by_pid(&mut server, pid) {
            Some(srv) => format!("{:.1}\n", srv.active_thread_percentage),
            None => format!("Server {pid} not found\n"),
        },
        ("set_active_thread_percentage", [pid, p]) => {
            match (server_by_pid(&mut server, pid), parse_percentage(p)) {
                (None, _) => format!("Server {pid} not found\n"),
                (Some(_), None) => {
                    "Invalid percentage, expected between (0.0, 100.0]\n".to_string()
                }
                (Some(srv), Some(v)) => {
                    srv.active_thread_percentage = v;
                    format!("{v:.1}\n")
                }
            }
        }
        ("get_device_pinned_mem_limit", [pid, dev]) => {
            let key = device_key(&s, dev);
            match (server_by_pid(&mut server, pid), key) {
                (None, _) => format!("Server {pid} not found\n"),
                (Some(_), None) => "Invalid device ordinal!\n".to_string(),
                (Some(srv), Some(key)) => match srv.pinned.get(&key) {
                    Some(mib) => format!("{}\n", format_limit(*mib)),
                    None => "No pinned memory limit set for the device!\n".to_string(),
                },
            }
        }
        ("get_client_list", [pid]) => match server_by_pid(&mut server, pid) {
            Some(srv) => srv.clients.iter().map(|c| format!("{c}\n")).collect(),
            None => format!("Server {pid} not found\n"),
        },
        ("shutdown_server", [pid] | [pid, "-f"]) => match server_by_pid(&mut server, pid) {
            Some(srv) => {
                daemon.server_line(srv.pid, "Server exiting");
                *server = None;
                String::new()
            }
            None => format!("Server {pid} not found\n"),
        },
        ("set_default_active_thread_percentage", [p]) => match parse_percentage(p) {
            Some(v) => {
                s.active_thread_percentage = v;
                String::new()
            }
            None => "Invalid percentage, expected between (0.0, 100.0]\n".to_string(),
        },
        ("get_default_active_thread_percentage", []) => {
            format!("{:.1}\n", s.active_thread_percentage)
        }
        ("set_default_device_pinned_mem_limit", [dev, value]) => {
            match (device_key(&s, dev), parse_limit(value)) {
                (None, _) => "Invalid device ordinal!\n".to_string(),
                (_, None) => format!(
                    "Invalid memory limit {value:?}: expected an integer followed by M or G\n"
                ),
                (Some(key), Some(mib)) => {
                    daemon.log.line(&format!(
                        "Set default pinned memory limit for device {key} ({dev}) to {}",
                        format_limit(mib)
                    ));
                    s.pinned.insert(key, mib);
                    String::new()
                }
            }
        }
        ("get_default_device_pinned_mem_limit", [dev]) => match device_key(&s, dev) {
            None => "Invalid device ordinal!\n".to_string(),
            Some(key) => match s.pinned.get(&key) {
                Some(mib) => format!("{}\n", format_limit(*mib)),
                None => "No default pinned memory limit set for the device!\n".to_string(),
            },
        },
        ("set_default_client_priority", [p]) => match *p {
            "0" | "1" => {
                s.client_priority = p.parse().unwrap_or(0);
                String::new()
            }
            _ => "Invalid priority value - must be 0 or 1!\n".to_string(),
        },
        ("get_default_client_priority", []) => format!("{}\n", s.client_priority),
        ("start_server", []) => "A user id (UID) is required to start a new server\n".to_string(),
        _ => format!("Unknown command \"{cmd}\"\n"),
    };
    (reply, false)
}

fn client(env: &MpsEnv, stdin: &mut dyn BufRead, out: &mut dyn Write) -> i32 {
    let control = env.pipe_dir().join("control");
    let conn = match UnixStream::connect(&control) {
        Ok(c) => c,
        Err(_) => {
            let _ = writeln!(out, "{NO_DAEMON}");
            return 1;
        }
    };
    let Ok(mut writer) = conn.try_clone() else {
        let _ = writeln!(out, "{NO_DAEMON}");
        return 1;
    };
    let mut reader = conn;
    let mut line = String::new();
    loop {
        line.clear();
        match stdin.read_line(&mut line) {
            Ok(0) | Err(_) => return 0,
            Ok(_) => {}
        }
        let cmd = line.trim();
        if cmd.is_empty() {
            continue;
        }
        if writer.write_all(format!("{cmd}\n").as_bytes()).is_err() {
            let _ = writeln!(out, "{SEND_FAILED}");
            return 1;
        }
        let mut len = [0u8; 4];
        if reader.read_exact(&mut len).is_err() {
            let _ = writeln!(out, "{SEND_FAILED}");
            return 1;
        }
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        if reader.read_exact(&mut body).is_err() {
            let _ = writeln!(out, "{SEND_FAILED}");
            return 1;
        }
        let _ = out.write_all(&body);
        let _ = out.flush();
        if cmd.split_whitespace().next() == Some("quit") {
            return 0;
        }
    }
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
    fn limits_parse_and_print() {
        assert_eq!(parse_limit("2G"), Some(2048));
        assert_eq!(parse_limit("500M"), Some(500));
        assert_eq!(parse_limit("512MB"), Some(512));
        assert_eq!(parse_limit("0M"), None);
        assert_eq!(parse_limit("12"), None);
        assert_eq!(parse_limit("xG"), None);
        assert_eq!(format_limit(2048), "2G");
        assert_eq!(format_limit(1500), "1500M");
    }

    #[test]
    fn percentage_range_is_half_open() {
        assert_eq!(parse_percentage("100"), Some(100.0));
        assert_eq!(parse_percentage("12.5"), Some(12.5));
        assert_eq!(parse_percentage("0"), None);
        assert_eq!(parse_percentage("100.1"), None);
        assert_eq!(parse_percentage("x"), None);
    }

    #[test]
    fn timestamp_has_the_log_shape() {
        let t = timestamp();
        assert_eq!(t.len(), 23, "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[10..11], " ");
        assert_eq!(&t[19..20], ".");
        assert!(t.starts_with("20"), "{t}");
    }

    #[test]
    fn devices_resolve_by_ordinal_and_uuid_prefix() {
        let s = Settings {
            devices: Some(vec![
                Device {
                    uuid: Some("GPU-aaaa1111".into()),
                },
                Device {
                    uuid: Some("MIG-bbbb2222".into()),
                },
            ]),
            active_thread_percentage: 100.0,
            pinned: BTreeMap::new(),
            client_priority: 0,
        };
        assert_eq!(device_key(&s, "0").as_deref(), Some("0"));
        assert_eq!(device_key(&s, "2"), None);
        assert_eq!(device_key(&s, "MIG-bbbb2222").as_deref(), Some("1"));
        assert_eq!(device_key(&s, "GPU-aaaa").as_deref(), Some("0"));
        assert_eq!(device_key(&s, "GPU-cccc"), None);
    }
}
