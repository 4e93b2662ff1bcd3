//! The front-end UI (no arguments): reads commands from stdin (newline- or EOF-terminated),
//! sends each to the daemon and prints the answer.
//!
//! Invariant, as the man page states: the exit status is 0 while the daemon answers, even
//! when it rejects a command; 1 when there is no daemon or the connection breaks.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;

use super::MpsEnv;
use super::protocol::read_frame;

const NO_DAEMON: &str = "Cannot find MPS control daemon process";
const SEND_FAILED: &str = "Cannot send command to MPS control daemon process";

/// Runs the front-end; returns the exit status.
pub(super) fn client(env: &MpsEnv, stdin: &mut dyn BufRead, out: &mut dyn Write) -> i32 {
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
        let Ok(body) = read_frame(&mut reader) else {
            let _ = writeln!(out, "{SEND_FAILED}");
            return 1;
        };
        let _ = out.write_all(&body);
        let _ = out.flush();
        if cmd.split_whitespace().next() == Some("quit") {
            return 0;
        }
    }
}
