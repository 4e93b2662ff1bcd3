//! What the front-end and CUDA clients say to the daemon, and what it answers.
//!
//! Wire protocol (private to the simulator): the front-end writes one command line ending in
//! `\n`; the daemon answers with a 4-byte little-endian length and that many bytes of text to
//! print ([`write_frame`], [`read_frame`]). A CUDA client's first line starts with
//! [`CLIENT_HELLO`](super::CLIENT_HELLO) instead, and gets one such answer.
//!
//! The commands ([`execute`]) are those of the real `nvidia-cuda-mps-control`, with its
//! messages; values use its formats (`<n>M`/`<n>G` memory limits, percentages in
//! `(0.0, 100.0]`).

use std::io::{Read, Write};

use super::daemon::{Daemon, Settings};
use super::server::Server;

/// Writes one answer: its length as 4 little-endian bytes, then the text.
pub(super) fn write_frame(w: &mut impl Write, text: &str) -> std::io::Result<()> {
    let frame = [&(text.len() as u32).to_le_bytes()[..], text.as_bytes()].concat();
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one answer written by [`write_frame`].
pub(super) fn read_frame(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// A percentage in `(0.0, 100.0]`.
pub(super) fn parse_percentage(s: &str) -> Option<f64> {
    let v: f64 = s.trim().parse().ok()?;
    (v > 0.0 && v <= 100.0).then_some(v)
}

/// `<n>M` or `<n>G` (case-insensitive, optional trailing `B`) in MiB; at least 1 MiB.
pub(super) fn parse_limit(s: &str) -> Option<u64> {
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

/// A limit in MiB as the real tool prints it: `<n>G` when whole gibibytes, else `<n>M`.
pub(super) fn format_limit(mib: u64) -> String {
    if mib.is_multiple_of(1024) {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

/// One `<device>=<limit>` entry of `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: the device key and
/// the limit in MiB.
pub(super) fn parse_pinned_entry(settings: &Settings, item: &str) -> Option<(String, u64)> {
    let (dev, limit) = item.split_once('=')?;
    Some((
        device_key(settings, dev.trim())?,
        parse_limit(limit.trim())?,
    ))
}

/// Resolves a device argument (ordinal in the daemon's numbering, or a UUID / unique UUID
/// prefix) to the key limits are stored under (the ordinal).
pub(super) fn device_key(settings: &Settings, dev: &str) -> Option<String> {
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

/// The UUID of a device key (an ordinal in the daemon's numbering), or the key itself.
pub(super) fn device_label(settings: &Settings, key: &str) -> String {
    settings
        .devices
        .as_ref()
        .and_then(|d| d.get(key.parse::<usize>().ok()?)?.uuid.clone())
        .unwrap_or_else(|| key.to_string())
}

/// The running server if its PID is `pid`.
fn server_by_pid<'a>(server: &'a mut Option<Server>, pid: &str) -> Option<&'a mut Server> {
    let pid = pid.parse::<u32>().ok()?;
    server.as_mut().filter(|srv| srv.pid == pid)
}

/// Executes one command; returns the text to print and whether the daemon quits.
pub(super) fn execute(daemon: &Daemon, cmd: &str) -> (String, bool) {
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
                // Clients of another user may be waiting for this server to go.
                daemon.server_changed.notify_all();
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::daemon::Device;
    use super::*;

    #[test]
    fn frames_carry_the_text_and_its_length() {
        let mut wire = Vec::new();
        write_frame(&mut wire, "100.0\n").expect("write");
        write_frame(&mut wire, "").expect("write");
        assert_eq!(&wire[..4], &[6, 0, 0, 0]);
        let mut r = wire.as_slice();
        assert_eq!(read_frame(&mut r).expect("first"), b"100.0\n");
        assert_eq!(read_frame(&mut r).expect("second"), b"");
        assert!(
            read_frame(&mut r).is_err(),
            "a closed connection is an error"
        );
    }

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
