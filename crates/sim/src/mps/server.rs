//! The simulated MPS server: as on a real host, the first CUDA client that reaches the daemon
//! starts it with the daemon's defaults at that moment (active thread percentage, pinned
//! memory limits), which it keeps; later clients of the same user join it.
//!
//! The server runs inside the daemon, not as a process: its PID is a number the daemon picks
//! above its own, and its log lines go to `server.log` next to `control.log`. A client's own
//! limits apply to it alone and can only lower the server's values. No GPU work is simulated.

use std::collections::BTreeMap;
use std::io::Write;

use super::daemon::{Daemon, timestamp};
use super::protocol::{device_label, format_limit, parse_percentage, parse_pinned_entry};

/// A simulated MPS server: the daemon's defaults when it started, and its clients.
pub(super) struct Server {
    /// The PID the daemon gave it.
    pub(super) pid: u32,
    /// The user it serves.
    pub(super) uid: u32,
    /// Active thread percentage for its clients.
    pub(super) active_thread_percentage: f64,
    /// Pinned memory limit in MiB by device key.
    pub(super) pinned: BTreeMap<String, u64>,
    /// PIDs of the attached clients.
    pub(super) clients: Vec<u32>,
}

impl Daemon {
    /// Appends a line to `server.log` in the real format.
    pub(super) fn server_line(&self, pid: u32, msg: &str) {
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
    pub(super) fn attach(&self, hello: &str) -> Result<(u32, String), ()> {
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
            match parse_pinned_entry(&settings, item) {
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
    pub(super) fn detach(&self, pid: u32) {
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
