//! Admission latency and memory of the real `gpu-dra-webhook` binary under a steady load.
//!
//! Starts the release binary as a child process with a fresh self-signed certificate, then
//! sends AdmissionReviews over TLS on loopback from an open-loop generator (a request every
//! 1/rate seconds whatever the answers do, as the API server would), over one HTTP/2
//! connection like the API server's webhook client. Prints p50/p90/p99/p99.9/max latency
//! from each request's send and from its scheduled time (which also counts queueing behind a
//! stall, so the generator cannot hide one)
//! and the server's resident memory (VmRSS, VmHWM from /proc) and CPU time per request (which,
//! unlike latency, barely depends on what else the machine runs). Targets: p99 <= 1 ms, RSS <=
//! 15 MiB. Also times the review itself in-process, to show how much is HTTP and TLS.
//!
//! In the same run it measures a no-op server: this example re-executed as a child process
//! that serves, through the library's own transport (`server::serve_with`: same rustls
//! configuration, same HTTP stack and limits, same runtime size), a handler that reads the
//! body and answers a fixed allowed review. The two are measured in alternating rounds with
//! the same client, and the ratio of their percentiles is printed: on a loaded machine both
//! slow down together, so the ratio says what the webhook itself adds.
//!
//! `make bench` builds the binary and runs this. Flags: `--rate N` (default 1000),
//! `--seconds N` (default 10), `--http1 N` (N HTTP/1.1 connections instead of HTTP/2),
//! `--bin PATH` (default: `gpu-dra-webhook` next to this example's directory). With
//! `BENCH_QUICK` set (`make bench-check`, which CI runs to prove the benchmark still works)
//! the defaults are 50 requests per second for 1 second and fewer in-process reviews.

// A benchmark's output is its figures on stdout.
#![allow(clippy::print_stdout)]

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpu_dra_webhook::server::{Handler, Limits};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

struct Opts {
    rate: u32,
    seconds: u32,
    http1: Option<usize>,
    bin: PathBuf,
}

fn opts() -> anyhow::Result<Opts> {
    let exe = std::env::current_exe()?;
    let default_bin = exe
        .parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("gpu-dra-webhook"))
        .context("locating the target directory")?;
    let quick = std::env::var_os("BENCH_QUICK").is_some();
    let mut o = Opts {
        rate: if quick { 50 } else { 1000 },
        seconds: if quick { 1 } else { 10 },
        http1: None,
        bin: default_bin,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--rate" => o.rate = value()?.parse()?,
            "--seconds" => o.seconds = value()?.parse()?,
            "--http1" => o.http1 = Some(value()?.parse()?),
            "--bin" => o.bin = value()?.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    if !o.bin.is_file() {
        bail!(
            "{} not found: build it first (cargo build --release -p gpu-dra-webhook)",
            o.bin.display()
        );
    }
    Ok(o)
}

/// A ResourceClaim review the size the API server sends (metadata with managedFields).
fn review(i: u64, valid: bool) -> Vec<u8> {
    let percentage = if valid { 50 } else { 0 };
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": format!("claim-{i}"),
            "namespace": "team-a",
            "uid": format!("5d6c7a3e-0000-4000-8000-{i:012}"),
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "trainer", "team": "a"},
            "managedFields": [{
                "manager": "kubectl-client-side-apply",
                "operation": "Update",
                "apiVersion": "resource.k8s.io/v1",
                "time": "2026-01-01T00:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:devices": {".": {}, "f:config": {}, "f:requests": {}}}}
            }]
        },
        "spec": {"devices": {
            "requests": [
                {"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.nvidia.com",
                    "allocationMode": "ExactCount",
                    "count": 1,
                    "selectors": [{"cel": {"expression":
                        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"}}]
                }}
            ],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {
                    "defaultActiveThreadPercentage": percentage,
                    "defaultPinnedDeviceMemoryLimit": "5Gi",
                    "defaultPerDevicePinnedMemoryLimit": {"0": "4Gi"}
                }}
            }}}]
        }}
    });
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("req-{i}"),
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "namespace": "team-a",
            "name": format!("claim-{i}"),
            "operation": "CREATE",
            "userInfo": {"username": "alice", "uid": "u-1", "groups": ["system:authenticated"]},
            "object": claim,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions", "fieldManager": "kubectl"}
        }
    }))
    .unwrap_or_default()
}

/// Bodies for the run: one in ten is invalid, so denials (the longer path) are measured too.
fn bodies() -> Vec<Bytes> {
    (0..100)
        .map(|i| Bytes::from(review(i, i % 10 != 0)))
        .collect()
}

#[derive(Clone)]
enum Sender {
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
    H1(Arc<Vec<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Full<Bytes>>>>>),
}

async fn tls_stream(
    addr: SocketAddr,
    ca: &rustls::pki_types::CertificateDer<'static>,
    alpn: &[u8],
) -> anyhow::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone())?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    Ok(TokioIo::new(tls))
}

async fn connect(
    addr: SocketAddr,
    ca: &rustls::pki_types::CertificateDer<'static>,
    http1: Option<usize>,
) -> anyhow::Result<Sender> {
    match http1 {
        None => {
            let io = tls_stream(addr, ca, b"h2").await?;
            let (send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(Sender::H2(send))
        }
        Some(n) => {
            let mut senders = Vec::new();
            for _ in 0..n {
                let io = tls_stream(addr, ca, b"http/1.1").await?;
                let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
                tokio::spawn(conn);
                senders.push(tokio::sync::Mutex::new(send));
            }
            Ok(Sender::H1(Arc::new(senders)))
        }
    }
}

async fn send(
    sender: &Sender,
    i: usize,
    method: &str,
    path: &str,
    body: Bytes,
) -> anyhow::Result<(u16, Bytes)> {
    let req = Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body))?;
    let resp = match sender {
        Sender::H2(s) => {
            let mut s = s.clone();
            s.ready().await?;
            s.send_request(req).await?
        }
        Sender::H1(pool) => {
            let mut s = pool[i % pool.len()].lock().await;
            s.ready().await?;
            s.send_request(req).await?
        }
    };
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

/// Sends at `rate` per second for `secs`.
async fn load(
    sender: &Sender,
    bodies: &[Bytes],
    rate: u32,
    secs: u32,
) -> anyhow::Result<Latencies> {
    let total = (rate * secs) as usize;
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let due = start + period * i as u32;
        tokio::time::sleep_until(due).await;
        let sender = sender.clone();
        let body = bodies[i % bodies.len()].clone();
        tasks.spawn(async move {
            let sent = tokio::time::Instant::now();
            let (status, body) = send(&sender, i, "POST", "/validate", body).await?;
            let done = tokio::time::Instant::now();
            if status != 200 {
                bail!("status {status}: {}", String::from_utf8_lossy(&body));
            }
            Ok((done - sent, done - due))
        });
    }
    let mut service = Vec::with_capacity(total);
    let mut scheduled = Vec::with_capacity(total);
    while let Some(r) = tasks.join_next().await {
        let (s, d) = r??;
        service.push(s);
        scheduled.push(d);
    }
    service.sort();
    scheduled.sort();
    Ok(Latencies { service, scheduled })
}

/// Latencies of one run, sorted.
#[derive(Default)]
struct Latencies {
    /// From the request leaving the generator to the full response.
    service: Vec<Duration>,
    /// From the request's scheduled time: adds the generator's own lateness (tokio timers
    /// have 1 ms resolution) and any queueing behind a stall.
    scheduled: Vec<Duration>,
}

impl Latencies {
    fn extend(&mut self, other: Latencies) {
        self.service.extend(other.service);
        self.scheduled.extend(other.scheduled);
    }

    fn sort(&mut self) {
        self.service.sort();
        self.scheduled.sort();
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{:.0} us", d.as_secs_f64() * 1e6)
}

fn proc_status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("{field} not in /proc/{pid}/status"))?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("malformed status line")?
        .parse()?)
}

/// CPU time the process has used (all threads, user + system), from /proc/<pid>/stat.
/// The kernel reports it in USER_HZ ticks, which is 100 per second on Linux.
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) start at state (field 3).
    let rest = stat
        .rsplit_once(')')
        .context("malformed /proc/<pid>/stat")?
        .1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).context("no utime")?.parse::<u64>()?
        + fields.get(12).context("no stime")?.parse::<u64>()?;
    Ok(Duration::from_millis(ticks * 10))
}

/// The no-op handler: reads the body, answers a fixed allowed review.
struct Noop {
    limits: Limits,
}

const NOOP_BODY: &[u8] =
    br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"req","allowed":true}}"#;

impl Handler for Noop {
    async fn call(
        self: Arc<Self>,
        req: Request<hyper::body::Incoming>,
    ) -> http::Response<Full<Bytes>> {
        let _ = req.into_body().collect().await;
        let mut resp = http::Response::new(Full::new(Bytes::from_static(NOOP_BODY)));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        resp
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }
}

/// `--noop-server ADDR CERT KEY`: the no-op server, run as a child of the benchmark.
fn noop_server(addr: &str, cert: &str, key: &str) -> anyhow::Result<()> {
    let metrics = gpu_dra_webhook::metrics::Metrics::new();
    let cert = gpu_dra_webhook::tls::ReloadingCert::load(
        cert.as_ref(),
        key.as_ref(),
        metrics.cert_reloads.clone(),
        metrics.cert_reload_failures.clone(),
    )?;
    let tls = Arc::new(cert).server_config()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(gpu_dra_webhook::worker_threads())
        .enable_all()
        .build()?
        .block_on(async {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            let noop = Arc::new(Noop {
                limits: Limits::default(),
            });
            gpu_dra_webhook::server::serve_with(listener, tls, noop, std::future::pending()).await;
            Ok(())
        })
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The review alone (decode, validate, encode), in-process: the floor under the HTTP figures.
fn in_process(bodies: &[Bytes]) -> (Duration, Duration) {
    let n = if std::env::var_os("BENCH_QUICK").is_some() {
        20
    } else {
        20_000
    };
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let d = gpu_dra_webhook::admission::review(&bodies[i % bodies.len()], |o| {
            gpu_dra_webhook::validation::check(o, "gpu.nvidia.com")
        });
        times.push(t.elapsed());
        std::hint::black_box(d.ok());
    }
    times.sort();
    (pct(&times, 0.5), pct(&times, 0.99))
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    let port = StdListener::bind("127.0.0.1:0")?.local_addr()?.port();
    Ok(([127, 0, 0, 1], port).into())
}

async fn connect_when_up(
    addr: SocketAddr,
    ca: &rustls::pki_types::CertificateDer<'static>,
    http1: Option<usize>,
) -> anyhow::Result<Sender> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match connect(addr, ca, http1).await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => return Err(e.context("server never came up")),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, addr, cert, key] = args.as_slice()
        && flag == "--noop-server"
    {
        return noop_server(addr, cert, key);
    }
    let o = opts()?;
    let bodies = bodies();
    let check: Value = serde_json::from_slice(&bodies[0])?;
    assert_eq!(check["request"]["kind"]["kind"], "ResourceClaim");

    let (p50, p99) = in_process(&bodies);
    println!(
        "review in-process ({} B body): p50 {} p99 {}",
        bodies[1].len(),
        us(p50),
        us(p99)
    );

    let dir = tempfile::tempdir()?;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    std::fs::write(dir.path().join("tls.crt"), cert.cert.pem())?;
    std::fs::write(dir.path().join("tls.key"), cert.signing_key.serialize_pem())?;
    let addr = free_addr()?;
    let noop_addr = free_addr()?;
    let _noop = KillOnDrop(
        Command::new(std::env::current_exe()?)
            .arg("--noop-server")
            .arg(noop_addr.to_string())
            .arg(dir.path().join("tls.crt"))
            .arg(dir.path().join("tls.key"))
            .stdout(Stdio::null())
            .spawn()
            .context("starting the no-op server")?,
    );
    let child = KillOnDrop(
        Command::new(&o.bin)
            .arg("--bind-address")
            .arg(addr.to_string())
            .arg("--tls-cert-file")
            .arg(dir.path().join("tls.crt"))
            .arg("--tls-key-file")
            .arg(dir.path().join("tls.key"))
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", o.bin.display()))?,
    );
    let pid = child.0.id();

    // One client thread: the generator must not take the server's cores.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ca = cert.cert.der().clone();
        let sender = connect_when_up(addr, &ca, o.http1).await?;
        let noop = connect_when_up(noop_addr, &ca, o.http1).await?;
        let (status, _) = send(&sender, 0, "GET", "/readyz", Bytes::new()).await?;
        anyhow::ensure!(status == 200, "readyz answered {status}");
        let idle_rss = proc_status_kib(pid, "VmRSS:")?;

        // Warm up (connection windows, allocator arenas), then measure in alternating rounds
        // so that a change in machine load hits both servers alike.
        load(&sender, &bodies, o.rate, 1).await?;
        load(&noop, &bodies, o.rate, 1).await?;
        let rounds = 4;
        let secs = o.seconds.div_ceil(rounds).max(1);
        let mut lat = Latencies::default();
        let mut base = Latencies::default();
        let mut cpu = Duration::ZERO;
        for _ in 0..rounds {
            let cpu_before = cpu_time(pid)?;
            lat.extend(load(&sender, &bodies, o.rate, secs).await?);
            cpu += cpu_time(pid)?.saturating_sub(cpu_before);
            base.extend(load(&noop, &bodies, o.rate, secs).await?);
        }
        lat.sort();
        base.sort();
        let rss = proc_status_kib(pid, "VmRSS:")?;
        let hwm = proc_status_kib(pid, "VmHWM:")?;
        let transport = match o.http1 {
            None => "HTTP/2, 1 connection".to_owned(),
            Some(n) => format!("HTTP/1.1, {n} connections"),
        };
        println!(
            "admission over TLS ({transport}), {} req/s, {rounds} rounds of {secs} s alternating with the no-op server: {} requests, 10% denied",
            o.rate,
            lat.service.len()
        );
        for (what, l) in [
            ("latency from send     ", &lat.service),
            ("latency from schedule ", &lat.scheduled),
        ] {
            println!(
                "  {what} p50 {} p90 {} p99 {} p99.9 {} max {}",
                us(pct(l, 0.5)),
                us(pct(l, 0.9)),
                us(pct(l, 0.99)),
                us(pct(l, 0.999)),
                us(pct(l, 1.0))
            );
        }
        let (p50, p99) = (pct(&lat.service, 0.5), pct(&lat.service, 0.99));
        let (n50, n99) = (pct(&base.service, 0.5), pct(&base.service, 0.99));
        println!(
            "  no-op server (same TLS, HTTP and client) latency from send p50 {} p99 {}",
            us(n50),
            us(n99)
        );
        println!(
            "  webhook / no-op: p50 {:.2}x (+{}), p99 {:.2}x (+{})",
            p50.as_secs_f64() / n50.as_secs_f64(),
            us(p50.saturating_sub(n50)),
            p99.as_secs_f64() / n99.as_secs_f64(),
            us(p99.saturating_sub(n99))
        );
        println!(
            "  server CPU: {:.1} us per request ({:.1}% of one core), less sensitive to machine load than latency",
            cpu.as_secs_f64() * 1e6 / lat.service.len() as f64,
            cpu.as_secs_f64() * 100.0 / f64::from(rounds * secs)
        );
        println!(
            "  server memory: VmRSS {:.1} MiB (idle {:.1} MiB), VmHWM {:.1} MiB",
            rss as f64 / 1024.0,
            idle_rss as f64 / 1024.0,
            hwm as f64 / 1024.0
        );
        println!(
            "  targets (latency from send): p99 <= 1 ms {}; RSS <= 15 MiB {}",
            if p99 <= Duration::from_millis(1) {
                "met"
            } else {
                "MISSED"
            },
            if hwm <= 15 * 1024 { "met" } else { "MISSED" }
        );
        Ok(())
    })
}
