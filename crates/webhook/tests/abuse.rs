//! The real `gpu-dra-webhook` binary under abuse while it serves normal reviews: slow senders
//! (headers byte by byte, bodies byte by byte, silent connections after the handshake) and
//! oversized bodies (declared and chunked). Asserts that every normal review is answered, that
//! slow connections are cut once the read timeout passes, that oversized bodies get 413, and
//! that the server's peak resident memory stays inside the chart's memory limit. The latency
//! of the normal reviews is printed, not asserted (a loaded machine would make it flaky; the
//! benchmark owns the figure).

// Helpers fail the test on any setup error, so unwrap is the point here.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustls::pki_types::CertificateDer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The server's read timeout in this test (the binary's flag; production default 10 s).
const READ_TIMEOUT: Duration = Duration::from_secs(1);
/// Slack for a cut to be seen on a loaded machine.
const SLACK: Duration = Duration::from_secs(4);

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `resources.limits.memory` of the webhook in the chart's values.yaml, in KiB.
fn chart_memory_limit_kib() -> u64 {
    let values =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/gpu-dra-driver/values.yaml");
    let text = std::fs::read_to_string(&values).unwrap();
    let webhook = text
        .split("\nwebhook:\n")
        .nth(1)
        .expect("values.yaml has a top-level webhook section");
    let limits = webhook
        .split("\n    limits:\n")
        .nth(1)
        .expect("webhook.resources.limits in values.yaml");
    let memory = limits
        .lines()
        .next()
        .and_then(|l| l.trim().strip_prefix("memory: "))
        .expect("webhook.resources.limits.memory in values.yaml");
    let mib: u64 = memory
        .strip_suffix("Mi")
        .expect("the memory limit is in Mi")
        .parse()
        .unwrap();
    mib * 1024
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

fn review(i: usize) -> Vec<u8> {
    common::claim_review(
        &format!("u-{i}"),
        &format!("c-{i}"),
        Some(
            json!([{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
            }}}]),
        ),
    )
}

/// Connects and writes `bytes` one at a time, 50 ms apart (see [`trickle_on`]).
async fn trickle(addr: SocketAddr, ca: &CertificateDer<'static>, bytes: &[u8]) -> Option<Duration> {
    let mut tls = common::tls(addr, &[ca], b"http/1.1").await.unwrap();
    trickle_on(&mut tls, bytes).await
}

/// Opens a TLS connection and sends nothing; returns when the server closed it.
async fn silent(addr: SocketAddr, ca: &CertificateDer<'static>) -> Duration {
    let mut tls = common::tls(addr, &[ca], b"h2").await.unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 256];
    loop {
        match tls.read(&mut buf).await {
            Ok(0) | Err(_) => return start.elapsed(),
            Ok(_) => {}
        }
    }
}

/// Streams a chunked body larger than the limit over HTTP/1.1; returns the response's status
/// line, or what went wrong.
async fn chunked_oversized(addr: SocketAddr, ca: &CertificateDer<'static>) -> String {
    let mut tls = common::tls(addr, &[ca], b"http/1.1").await.unwrap();
    let head = "POST /validate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\n\r\n";
    if tls.write_all(head.as_bytes()).await.is_err() {
        return "head write failed".into();
    }
    let chunk = vec![b' '; 64 << 10];
    let frame = [
        format!("{:x}\r\n", chunk.len()).into_bytes(),
        chunk,
        b"\r\n".to_vec(),
    ]
    .concat();
    let mut sent = 0;
    while sent < 5 * gpu_dra_webhook::server::MAX_BODY_BYTES {
        if tls.write_all(&frame).await.is_err() {
            break;
        }
        sent += frame.len();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("no response")
        .to_owned()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_clients_do_not_starve_reviews() {
    let limit_kib = chart_memory_limit_kib();
    let dir = tempfile::tempdir().unwrap();
    let pair = common::pair();
    common::install(dir.path(), &pair);
    let port = StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpu-dra-webhook"))
            .arg(format!("--bind-address={addr}"))
            .arg(format!(
                "--tls-cert-file={}",
                dir.path().join("tls.crt").display()
            ))
            .arg(format!(
                "--tls-key-file={}",
                dir.path().join("tls.key").display()
            ))
            .arg(format!("--read-timeout-seconds={}", READ_TIMEOUT.as_secs()))
            .args(["--max-connections=256", "--log-level=warn"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let ca = pair.der.clone();
    let ca_normal = pair.der.clone();

    let deadline = Instant::now() + Duration::from_secs(20);
    let mut client = loop {
        if common::tls(addr, &[&ca], b"h2").await.is_ok() {
            break common::connect(addr, &[&ca], b"h2").await.0;
        }
        assert!(Instant::now() < deadline, "server never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(client.send("GET", "/readyz", vec![]).await.0, 200);

    // Abusers, all started before the normal reviews and running alongside them.
    let done = Arc::new(AtomicBool::new(false));
    let mut slow = tokio::task::JoinSet::new();
    let head = b"POST /validate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                 x-padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    for _ in 0..24 {
        let ca = ca.clone();
        slow.spawn(async move { ("headers", trickle(addr, &ca, head).await) });
    }
    for _ in 0..8 {
        let ca = ca.clone();
        let body = review(0);
        let mut msg = format!(
            "POST /validate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        let start_of_body = msg.len();
        msg.extend_from_slice(&body);
        slow.spawn(async move {
            // The head at once, then the body byte by byte.
            let mut tls = common::tls(addr, &[&ca], b"http/1.1").await.unwrap();
            tls.write_all(&msg[..start_of_body]).await.unwrap();
            let lived = trickle_on(&mut tls, &msg[start_of_body..]).await;
            ("body", lived)
        });
    }
    for _ in 0..8 {
        let ca = ca.clone();
        slow.spawn(async move { ("silent", Some(silent(addr, &ca).await)) });
    }
    let mut big = tokio::task::JoinSet::new();
    for i in 0..4 {
        let ca = ca.clone();
        let done = Arc::clone(&done);
        big.spawn(async move {
            let mut refused = Vec::new();
            while !done.load(Ordering::Relaxed) {
                if i % 2 == 0 {
                    refused.push(chunked_oversized(addr, &ca).await);
                } else {
                    let (mut c, _) = common::connect(addr, &[&ca], b"h2").await;
                    let body = vec![b' '; gpu_dra_webhook::server::MAX_BODY_BYTES + 1];
                    refused.push(match c.try_send("POST", "/validate", body).await {
                        Ok((status, _)) => format!("HTTP/2 {status}"),
                        Err(e) => format!("error {e}"),
                    });
                }
                // A steady stream, not a flood that would only measure a saturated machine.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            refused
        });
    }

    // Normal reviews at 200/s on one HTTP/2 connection, as the API server sends them, from
    // a thread of their own so that the abusers' client work does not delay them here.
    let normal = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (mut client, _) = common::connect(addr, &[&ca_normal], b"h2").await;
            let mut latencies = Vec::new();
            let mut peak_rss = 0;
            let start = Instant::now();
            for i in 0..600 {
                let due = start + Duration::from_millis(5 * i as u64);
                tokio::time::sleep_until(due.into()).await;
                let sent = Instant::now();
                let (status, body) = client.send("POST", "/validate", review(i)).await;
                latencies.push(sent.elapsed());
                assert_eq!(status, 200, "review {i}: {body}");
                let v: Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["response"]["uid"], format!("u-{i}"));
                assert_eq!(v["response"]["allowed"], true, "{body}");
                if i % 50 == 0 {
                    peak_rss = peak_rss.max(proc_status_kib(pid, "VmRSS:"));
                }
            }
            (latencies, peak_rss)
        })
    });
    let (mut latencies, peak_rss) = tokio::task::spawn_blocking(move || normal.join())
        .await
        .unwrap()
        .expect("every normal review is answered");
    done.store(true, Ordering::Relaxed);

    while let Some(r) = slow.join_next().await {
        let (what, lived) = r.unwrap();
        let lived = lived.unwrap_or_else(|| panic!("a slow {what} sender was never cut"));
        assert!(
            lived + Duration::from_millis(200) >= READ_TIMEOUT && lived <= READ_TIMEOUT + SLACK,
            "slow {what} sender cut after {lived:?}, read timeout {READ_TIMEOUT:?}"
        );
    }
    let mut outcomes = Vec::new();
    while let Some(r) = big.join_next().await {
        outcomes.extend(r.unwrap());
    }
    assert!(
        outcomes.iter().any(|o| o.contains("413")),
        "no oversized body got 413: {outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|o| o.contains("413") || o.starts_with("error")),
        "an oversized body was not refused: {outcomes:?}"
    );

    let hwm = proc_status_kib(pid, "VmHWM:");
    latencies.sort();
    drop(client);
    eprintln!(
        "normal reviews under abuse: {} answered, p50 {:?} p99 {:?} max {:?}; {} oversized \
         refused; server VmRSS peak seen {} KiB, VmHWM {} KiB, chart limit {} KiB",
        latencies.len(),
        pct(&latencies, 0.5),
        pct(&latencies, 0.99),
        pct(&latencies, 1.0),
        outcomes.len(),
        peak_rss,
        hwm,
        limit_kib
    );
    assert!(
        hwm <= limit_kib,
        "server peak RSS {hwm} KiB above the chart's limit {limit_kib} KiB"
    );
    drop(child);
}

/// Writes `bytes` one at a time, 50 ms apart, until the server closes (or answers, which it
/// does only to refuse); returns how long that took, or `None` if nothing cut the sender.
async fn trickle_on(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    bytes: &[u8],
) -> Option<Duration> {
    let start = Instant::now();
    for b in bytes {
        if tls.write_all(&[*b]).await.is_err() || tls.flush().await.is_err() {
            return Some(start.elapsed());
        }
        let mut buf = [0u8; 256];
        if tokio::time::timeout(Duration::from_millis(50), tls.read(&mut buf))
            .await
            .is_ok()
        {
            return Some(start.elapsed());
        }
    }
    None
}
