//! The simulated MPS server: as on a real host, the first CUDA client that reaches the daemon
//! starts it with the daemon's defaults at that moment (active thread percentage, pinned
//! memory limits), which it keeps; later clients of the same user join it.
//!
//! Users, as NVIDIA's MPS documentation (<https://docs.nvidia.com/deploy/mps/>, "Limitations")
//! states: "Only one user on a system may have an active MPS server", and the daemon "will
//! queue MPS server activation requests from separate users". So without `-M` a client of
//! another user than the running server's waits, its connection unanswered, until that
//! server's clients are gone; the server then exits and a new one starts for the waiting
//! user. With `-M` (multi-user, Volta and newer) every client is served as the daemon's own
//! user and all share one server. The daemon learns a client's user from the kernel
//! (`SO_PEERCRED` on its socket), never from what the client says.
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
    ///
    /// `peer_uid` is the user the kernel reports for the client's end of the socket
    /// (`SO_PEERCRED`), as the real daemon learns it; the client's own word for its user is
    /// not trusted.
    pub(super) fn attach(&self, hello: &str, peer_uid: u32) -> Result<(u32, String), ()> {
        let mut words = hello.split_whitespace();
        let (Some(pid), Some(_claimed_uid)) = (
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
        let settings = self.settings.lock().unwrap_or_else(|e| e.into_inner());
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
        drop(settings);
        // Without `-M` the daemon runs one user's server at a time: a client of another user
        // waits (its connection unanswered, as a CUDA context creation blocks) until that
        // server has no clients left, which then exits for it. With `-M` every client is
        // served as the daemon's own user, so all share one server.
        let uid = if self.multi_user {
            self.own_uid
        } else {
            peer_uid
        };
        let mut waiting = false;
        let (settings, mut server) = loop {
            let settings = self.settings.lock().unwrap_or_else(|e| e.into_inner());
            let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
            let Some(busy) = server.as_ref().filter(|s| s.uid != uid) else {
                break (settings, server);
            };
            if busy.clients.is_empty() {
                self.log.line(&format!(
                    "Server {} exited with status 0 (no clients left, user {uid} waiting)",
                    busy.pid
                ));
                self.server_line(busy.pid, "Server exiting");
                *server = None;
                break (settings, server);
            }
            if !waiting {
                waiting = true;
                self.log.line(&format!(
                    "NEW CLIENT {pid} from user {uid}: Server {} of user {} is busy, push client to pending list",
                    busy.pid, busy.uid
                ));
            }
            // The settings lock is taken before the server's everywhere: release it while
            // waiting so commands keep being answered.
            drop(settings);
            let guard = self
                .server_changed
                .wait(server)
                .unwrap_or_else(|e| e.into_inner());
            drop(guard);
        };
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
        // A client of another user may be waiting for this server to have no clients.
        self.server_changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    use super::super::daemon::{Logger, Settings};
    use super::*;

    fn daemon(multi_user: bool) -> Arc<Daemon> {
        Arc::new(Daemon {
            settings: Mutex::new(Settings {
                devices: None,
                active_thread_percentage: 100.0,
                pinned: BTreeMap::new(),
                client_priority: 0,
            }),
            log: Logger {
                file: None,
                echo: false,
            },
            pipe_dir: "unused".into(),
            server: Mutex::new(None),
            server_log: None,
            servers_started: Mutex::new(0),
            server_changed: Condvar::new(),
            multi_user,
            own_uid: 0,
        })
    }

    /// The server PID in a client's reply.
    fn server_of(reply: &str) -> u32 {
        reply
            .lines()
            .find_map(|l| l.strip_prefix("MPS server "))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no server in {reply:?}"))
    }

    /// Attaches client `pid` of user `uid` on a thread; the reply arrives on the channel.
    fn attach_async(d: &Arc<Daemon>, pid: u32, uid: u32) -> mpsc::Receiver<String> {
        let (tx, rx) = mpsc::channel();
        let d = d.clone();
        std::thread::spawn(move || {
            let (_, reply) = d.attach(&format!(" {pid} {uid}"), uid).expect("attach");
            let _ = tx.send(reply);
        });
        rx
    }

    #[test]
    fn another_users_client_waits_for_the_server_to_exit() {
        let d = daemon(false);
        let (_, first) = d.attach(" 10 1000", 1000).expect("attach");
        let first_server = server_of(&first);
        // Same user: joins at once.
        let (_, same) = d.attach(" 11 1000", 1000).expect("attach");
        assert_eq!(server_of(&same), first_server);

        let waiting = attach_async(&d, 20, 2000);
        assert!(
            waiting.recv_timeout(Duration::from_millis(300)).is_err(),
            "a client of another user must wait while user 1000's server has clients"
        );
        d.detach(10);
        assert!(
            waiting.recv_timeout(Duration::from_millis(300)).is_err(),
            "one client of user 1000 is still attached"
        );
        d.detach(11);
        let reply = waiting
            .recv_timeout(Duration::from_secs(5))
            .expect("the waiting client gets a server once the other user's clients are gone");
        let second_server = server_of(&reply);
        assert_ne!(second_server, first_server);
        let server = d.server.lock().unwrap();
        let srv = server.as_ref().expect("a server runs");
        assert_eq!(
            (srv.pid, srv.uid, srv.clients.clone()),
            (second_server, 2000, vec![20])
        );
    }

    #[test]
    fn an_idle_server_of_another_user_exits_at_once() {
        let d = daemon(false);
        let (_, first) = d.attach(" 10 1000", 1000).expect("attach");
        d.detach(10);
        let reply = attach_async(&d, 20, 2000)
            .recv_timeout(Duration::from_secs(5))
            .expect("no client holds user 1000's server");
        assert_ne!(server_of(&reply), server_of(&first));
    }

    #[test]
    fn multi_user_clients_share_one_server() {
        let d = daemon(true);
        let (_, first) = d.attach(" 10 1000", 1000).expect("attach");
        let reply = attach_async(&d, 20, 2000)
            .recv_timeout(Duration::from_secs(5))
            .expect("-M serves every user at once");
        assert_eq!(server_of(&reply), server_of(&first));
        let server = d.server.lock().unwrap();
        let srv = server.as_ref().expect("a server runs");
        // Served as the daemon's own user.
        assert_eq!((srv.uid, srv.clients.clone()), (0, vec![10, 20]));
    }

    #[test]
    fn shutting_the_server_down_lets_a_waiting_client_in() {
        let d = daemon(false);
        let (_, first) = d.attach(" 10 1000", 1000).expect("attach");
        let waiting = attach_async(&d, 20, 2000);
        assert!(waiting.recv_timeout(Duration::from_millis(300)).is_err());
        let (reply, _) =
            super::super::protocol::execute(&d, &format!("shutdown_server {}", server_of(&first)));
        assert_eq!(reply, "");
        let reply = waiting
            .recv_timeout(Duration::from_secs(5))
            .expect("the server is gone");
        assert_ne!(server_of(&reply), server_of(&first));
    }
}
