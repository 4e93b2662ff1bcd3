//! The operations endpoint: the metrics (OpenMetrics text, at [`Metrics::path`]: `/metrics`
//! unless `--metrics-path` says otherwise, or not at all), `/healthz` (the process serves and
//! its [`Liveness`] check passes; 503 with the reason otherwise, so that the kubelet's liveness
//! probe restarts the container), `/readyz` (the gRPC sockets are up). Plain HTTP/1 on `--http-address`, which is loopback
//! unless set: the chart binds the pod's own address so that the kubelet's probes reach it.
//!
//! Invariants, so that a client can neither hold the endpoint nor make it burn CPU:
//! - every request head must arrive within [`Limits::header_read_timeout`], counted from when
//!   the server starts waiting for it (also before the first byte and between keep-alive
//!   requests); a connection that sends nothing, or a head byte by byte, is closed then;
//! - at most [`Limits::max_connections`] connections are open, and at most
//!   [`Limits::max_connections_per_peer`] from one source address; a connection over the
//!   per-peer cap is closed at accept; one over the total cap takes the place of the oldest
//!   connection of the peer holding the most, when that peer holds more than the newcomer's
//!   peer, and is closed otherwise. So whoever fills the slots with idle keep-alive
//!   connections (from one pod or from many) cannot starve another peer: the kubelet's
//!   probes, which come from the node's address, still get a slot, and `/healthz` answers
//!   (before, 32 idle connections from any pod made the liveness probe fail until the
//!   kubelet restarted the plugin, again and again);
//! - a failing `accept` (EMFILE when the process is out of descriptors, ENOBUFS) is retried
//!   after a pause that doubles from [`ACCEPT_BACKOFF_MIN`] to [`ACCEPT_BACKOFF_MAX`] and
//!   resets on the next success, instead of being retried at once forever.
//!
//! Connections come from a [`Listener`], a TCP listener in the plugin, a failing stand-in in
//! tests.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::AbortHandle;
use tracing::{debug, warn};

use crate::metrics::Metrics;

/// First pause after a failed `accept`.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between failed `accept`s.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What a client may cost the endpoint.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Deadline for each request head.
    pub header_read_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections from one source address at most.
    pub max_connections_per_peer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Probes and scrapers send a head at once; 10 s is far above any honest client.
            header_read_timeout: Duration::from_secs(10),
            // The kubelet's two probes and a scraper or two; the rest is headroom.
            max_connections: 32,
            // The kubelet's startup, liveness and readiness probes share the node's address.
            max_connections_per_peer: 4,
        }
    }
}

/// What `/healthz` checks besides the process serving: `Err` with the reason when the
/// process should be restarted.
pub trait Liveness: Send + Sync + 'static {
    /// Whether the process is alive in the sense that matters; `Err` says why not.
    fn check(&self) -> Result<(), String>;
}

/// A process alive while it serves (the endpoint's tests, tools without hardware).
#[derive(Debug, Clone, Copy, Default)]
pub struct Serving;

impl Liveness for Serving {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Where connections come from.
pub trait Listener: Send + 'static {
    /// One accepted connection.
    type Conn: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection and its peer's address (`None`: unknown, counted as one peer), or
    /// why none could be accepted.
    fn accept(
        &mut self,
    ) -> impl Future<Output = std::io::Result<(Self::Conn, Option<IpAddr>)>> + Send;
}

impl Listener for TcpListener {
    type Conn = tokio::net::TcpStream;

    async fn accept(&mut self) -> std::io::Result<(Self::Conn, Option<IpAddr>)> {
        TcpListener::accept(self)
            .await
            .map(|(stream, peer)| (stream, Some(peer.ip())))
    }
}

/// The open connections by peer, oldest first, with what closes each.
#[derive(Default)]
struct Open {
    by_peer: HashMap<Option<IpAddr>, VecDeque<(u64, AbortHandle)>>,
    total: usize,
    next_id: u64,
}

/// What to do with a new connection.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    /// A free slot.
    Yes,
    /// The slot of the oldest connection of this peer, which is closed.
    InPlaceOf(Option<IpAddr>),
    /// None: the connection is closed.
    No,
}

impl Open {
    fn count(&self, peer: &Option<IpAddr>) -> usize {
        self.by_peer.get(peer).map_or(0, VecDeque::len)
    }

    /// The rule of the module doc.
    fn admit(&self, peer: &Option<IpAddr>, limits: &Limits) -> Admit {
        let mine = self.count(peer);
        if mine >= limits.max_connections_per_peer {
            return Admit::No;
        }
        if self.total < limits.max_connections {
            return Admit::Yes;
        }
        match self.by_peer.iter().max_by_key(|(_, c)| c.len()) {
            // The newcomer's own peer is never busier than itself.
            Some((busiest, conns)) if conns.len() > mine => Admit::InPlaceOf(*busiest),
            _ => Admit::No,
        }
    }

    fn evict_oldest(&mut self, peer: &Option<IpAddr>) {
        if let Some(conns) = self.by_peer.get_mut(peer)
            && let Some((_, handle)) = conns.pop_front()
        {
            handle.abort();
            self.total -= 1;
            if conns.is_empty() {
                self.by_peer.remove(peer);
            }
        }
    }

    fn remove(&mut self, peer: &Option<IpAddr>, id: u64) {
        if let Some(conns) = self.by_peer.get_mut(peer)
            && let Some(i) = conns.iter().position(|(c, _)| *c == id)
        {
            conns.remove(i);
            self.total -= 1;
            if conns.is_empty() {
                self.by_peer.remove(peer);
            }
        }
    }
}

/// Takes a connection out of [`Open`] when its task ends (or is aborted).
struct Slot {
    open: Arc<Mutex<Open>>,
    peer: Option<IpAddr>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.open).remove(&self.peer, self.id);
    }
}

fn lock(m: &Mutex<Open>) -> std::sync::MutexGuard<'_, Open> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves the endpoints on `listener` forever with the default [`Limits`].
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    liveness: Arc<dyn Liveness>,
) {
    serve_with(listener, metrics, ready, liveness, Limits::default()).await;
}

/// Serves the endpoints on `listener` forever with `limits`.
pub async fn serve_with<L: Listener>(
    mut listener: L,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    liveness: Arc<dyn Liveness>,
    limits: Limits,
) {
    let open = Arc::new(Mutex::new(Open::default()));
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = ACCEPT_BACKOFF_MIN;
                accepted
            }
            Err(error) => {
                warn!(%error, retry_in_ms = backoff.as_millis() as u64, "accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        // Held while the task is spawned and registered, so that its `Slot` cannot remove it
        // before it is there.
        let mut state = lock(&open);
        match state.admit(&peer, &limits) {
            Admit::Yes => {}
            Admit::InPlaceOf(busiest) => {
                debug!(peer = ?peer, busiest = ?busiest, "all connections open; closing the oldest of the peer holding the most");
                state.evict_oldest(&busiest);
            }
            Admit::No => {
                debug!(
                    peer = ?peer,
                    max = limits.max_connections,
                    per_peer = limits.max_connections_per_peer,
                    "too many open connections; closing a new one"
                );
                continue;
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        let slot = Slot {
            open: open.clone(),
            peer,
            id,
        };
        let metrics = metrics.clone();
        let ready = ready.clone();
        let liveness = liveness.clone();
        let timeout = limits.header_read_timeout;
        let task = tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let resp = answer(req.uri().path(), &metrics, &ready, liveness.as_ref());
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
        state
            .by_peer
            .entry(peer)
            .or_default()
            .push_back((id, task.abort_handle()));
        state.total += 1;
    }
}

fn answer(
    path: &str,
    metrics: &Metrics,
    ready: &AtomicBool,
    liveness: &dyn Liveness,
) -> Response<Full<Bytes>> {
    let (status, ctype, body) = match path {
        p if metrics.path() == Some(p) => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        "/healthz" => match liveness.check() {
            Ok(()) => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("unhealthy: {why}\n"),
            ),
        },
        "/readyz" if ready.load(Ordering::Relaxed) => {
            (StatusCode::OK, "text/plain", "ready\n".to_owned())
        }
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready\n".to_owned(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_owned(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(ctype) {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Starts the endpoint on a free loopback port.
    async fn start(limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let ready = Arc::new(AtomicBool::new(true));
        tokio::spawn(serve_with(
            listener,
            Arc::new(Metrics::default()),
            ready,
            Arc::new(Serving),
            limits,
        ));
        addr
    }

    /// What the server sends on `conn` until it closes it, or `None` if it is still open
    /// after `wait`.
    async fn until_closed(conn: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        let read = tokio::time::timeout(wait, async {
            let mut buf = [0u8; 1024];
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        read.ok().map(|()| got)
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        conn.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
        let got = until_closed(&mut conn, Duration::from_secs(10))
            .await
            .expect("answered and closed");
        String::from_utf8_lossy(&got).into_owned()
    }

    #[tokio::test]
    async fn a_client_that_never_finishes_its_head_is_cut_off() {
        let addr = start(Limits {
            header_read_timeout: Duration::from_millis(200),
            ..Limits::default()
        })
        .await;
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        for conn in [&mut silent, &mut slow] {
            assert!(
                until_closed(conn, Duration::from_secs(5)).await.is_some(),
                "a connection without a complete head stays open"
            );
        }
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once_and_slots_come_back() {
        let addr = start(Limits {
            header_read_timeout: Duration::from_secs(60),
            max_connections: 2,
            ..Limits::default()
        })
        .await;
        let first = TcpStream::connect(addr).await.expect("connect");
        let _second = TcpStream::connect(addr).await.expect("connect");
        let mut third = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(
            until_closed(&mut third, Duration::from_secs(5)).await,
            Some(Vec::new()),
            "the connection over the cap is closed without an answer"
        );
        drop(first);
        // Once the server sees the first one closed, its slot serves a new client.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            conn.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .ok();
            let got = until_closed(&mut conn, Duration::from_secs(5))
                .await
                .unwrap_or_default();
            if got.starts_with(b"HTTP/1.1 200") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the slot never came back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A keep-alive client from `source` that made one request and keeps its connection open.
    async fn idle_client(source: &str, addr: std::net::SocketAddr) -> Option<TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4().ok()?;
        socket.bind(format!("{source}:0").parse().ok()?).ok()?;
        let mut conn = socket.connect(addr).await.ok()?;
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ok()?;
        let mut buf = [0u8; 256];
        // Its answer, if it got a slot; the connection stays open either way.
        let _ = tokio::time::timeout(Duration::from_millis(200), conn.read(&mut buf)).await;
        Some(conn)
    }

    /// `/healthz` from `source`. A starved probe is closed unanswered (what the code before
    /// the per-peer limit did), not slow: the wait only bounds a hang, and is far above the
    /// kubelet's 1 s so that a loaded test machine does not fail the test.
    async fn probe_from(source: &str, addr: std::net::SocketAddr) -> Result<String, String> {
        let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket
            .bind(format!("{source}:0").parse().map_err(|e| format!("{e}"))?)
            .map_err(|e| e.to_string())?;
        let mut conn = socket.connect(addr).await.map_err(|e| e.to_string())?;
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let got = until_closed(&mut conn, Duration::from_secs(10))
            .await
            .ok_or("no answer within 10 s")?;
        let text = String::from_utf8_lossy(&got).into_owned();
        if text.starts_with("HTTP/1.1 200") {
            Ok(text)
        } else {
            Err(format!("answered {text:?}"))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_keep_alive_clients_cannot_starve_the_probes() {
        let addr = start(Limits {
            header_read_timeout: Duration::from_secs(60),
            ..Limits::default()
        })
        .await;
        // 40 idle keep-alive connections from one pod, then 40 from 40 pods (each address of
        // 127.0.0.0/8 is a peer of its own on loopback).
        let mut held = Vec::new();
        for _ in 0..40 {
            held.extend(idle_client("127.0.0.2", addr).await);
        }
        for _ in 0..3 {
            probe_from("127.0.0.1", addr)
                .await
                .expect("the kubelet's probe answered next to one pod's idle connections");
        }
        for i in 0..40 {
            held.extend(idle_client(&format!("127.0.1.{}", i + 1), addr).await);
        }
        for _ in 0..3 {
            // The kubelet probes every few seconds (periodSeconds), so its previous probe's
            // connection has ended on the server by then; back to back, that connection may
            // still count for the probe's address, which then holds as many as any peer and is
            // refused by the rule (rightly: it is not a starved newcomer).
            tokio::time::sleep(Duration::from_secs(1)).await;
            probe_from("127.0.0.1", addr)
                .await
                .expect("the kubelet's probe answered next to many pods' idle connections");
        }
        assert!(held.len() >= 40, "clients connected: {}", held.len());
    }

    #[test]
    fn a_new_connection_takes_the_place_of_the_busiest_peers_oldest() {
        let limits = Limits {
            max_connections: 3,
            max_connections_per_peer: 2,
            ..Limits::default()
        };
        let a: Option<IpAddr> = Some([10, 0, 0, 1].into());
        let b: Option<IpAddr> = Some([10, 0, 0, 2].into());
        let c: Option<IpAddr> = Some([10, 0, 0, 3].into());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let handle = || rt.spawn(async {}).abort_handle();
        let mut open = Open::default();
        let add = |open: &mut Open, peer: Option<IpAddr>| {
            open.by_peer
                .entry(peer)
                .or_default()
                .push_back((open.next_id, handle()));
            open.next_id += 1;
            open.total += 1;
        };
        assert_eq!(open.admit(&a, &limits), Admit::Yes);
        add(&mut open, a);
        add(&mut open, a);
        assert_eq!(open.admit(&a, &limits), Admit::No, "per-peer cap");
        add(&mut open, b);
        assert_eq!(
            open.admit(&c, &limits),
            Admit::InPlaceOf(a),
            "full: the busiest gives way"
        );
        assert_eq!(open.admit(&b, &limits), Admit::InPlaceOf(a));
        open.evict_oldest(&a);
        assert_eq!(open.total, 2);
        add(&mut open, c);
        assert_eq!(
            open.admit(&b, &limits),
            Admit::No,
            "no peer holds more than b"
        );
        open.remove(&c, 3);
        assert_eq!(open.total, 2);
        assert_eq!(open.admit(&c, &limits), Admit::Yes);
    }

    /// A listener whose every accept fails as with no descriptors left.
    struct OutOfDescriptors(Arc<AtomicUsize>);

    impl Listener for OutOfDescriptors {
        type Conn = TcpStream;

        async fn accept(&mut self) -> std::io::Result<(TcpStream, Option<IpAddr>)> {
            self.0.fetch_add(1, Ordering::SeqCst);
            // Give the runtime a turn, as a real accept would: without it a loop that retries
            // at once would hang this test instead of failing it.
            tokio::task::yield_now().await;
            Err(std::io::Error::from_raw_os_error(libc::EMFILE))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn accept_errors_back_off_instead_of_spinning() {
        let calls = Arc::new(AtomicUsize::new(0));
        let server = tokio::spawn(serve_with(
            OutOfDescriptors(calls.clone()),
            Arc::new(Metrics::default()),
            Arc::new(AtomicBool::new(true)),
            Arc::new(Serving),
            Limits::default(),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.abort();
        let n = calls.load(Ordering::SeqCst);
        // 10 + 20 + 40 + 80 + 160 ms of pauses fit in 300 ms: about six tries; a loop that
        // retries at once makes hundreds of thousands.
        assert!((1..=10).contains(&n), "{n} accept calls in 300 ms");
    }

    #[test]
    fn metrics_are_served_at_their_path_only_and_health_always() {
        let ready = AtomicBool::new(true);
        let custom = Metrics::served_at(Some("/custom".into()));
        assert_eq!(
            answer("/custom", &custom, &ready, &Serving).status(),
            StatusCode::OK
        );
        assert_eq!(
            answer("/metrics", &custom, &ready, &Serving).status(),
            StatusCode::NOT_FOUND
        );
        let off = Metrics::served_at(None);
        assert_eq!(
            answer("/metrics", &off, &ready, &Serving).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            answer("/healthz", &off, &ready, &Serving).status(),
            StatusCode::OK
        );
        assert_eq!(
            answer("/readyz", &off, &ready, &Serving).status(),
            StatusCode::OK
        );
    }

    /// A liveness check that fails while `failing` holds a reason.
    struct Switch(std::sync::Mutex<Option<String>>);

    impl Liveness for Switch {
        fn check(&self) -> Result<(), String> {
            self.0.lock().expect("lock").clone().map_or(Ok(()), Err)
        }
    }

    #[tokio::test]
    async fn healthz_fails_with_the_reason_while_the_liveness_check_fails() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let switch = Arc::new(Switch(std::sync::Mutex::new(None)));
        tokio::spawn(serve_with(
            listener,
            Arc::new(Metrics::default()),
            Arc::new(AtomicBool::new(true)),
            switch.clone(),
            Limits::default(),
        ));
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        *switch.0.lock().expect("lock") = Some("NVML cannot be reached".into());
        let resp = get(addr, "/healthz").await;
        assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
        assert!(
            resp.ends_with("unhealthy: NVML cannot be reached\n"),
            "{resp}"
        );
        *switch.0.lock().expect("lock") = None;
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }
}
