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
//! - at most [`Limits::max_connections`] connections are open; more are closed at accept;
//! - a failing `accept` (EMFILE when the process is out of descriptors, ENOBUFS) is retried
//!   after a pause that doubles from [`ACCEPT_BACKOFF_MIN`] to [`ACCEPT_BACKOFF_MAX`] and
//!   resets on the next success, instead of being retried at once forever.
//!
//! Connections come from a [`Listener`], a TCP listener in the plugin, a failing stand-in in
//! tests.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
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
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Probes and scrapers send a head at once; 10 s is far above any honest client.
            header_read_timeout: Duration::from_secs(10),
            // The kubelet's two probes and a scraper or two; the rest is headroom.
            max_connections: 32,
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
    /// The next connection, or why none could be accepted.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Conn>> + Send;
}

impl Listener for TcpListener {
    type Conn = tokio::net::TcpStream;

    async fn accept(&mut self) -> std::io::Result<Self::Conn> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
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
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => {
                backoff = ACCEPT_BACKOFF_MIN;
                stream
            }
            Err(error) => {
                warn!(%error, retry_in_ms = backoff.as_millis() as u64, "accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            debug!(
                max = limits.max_connections,
                "too many open connections; closing a new one"
            );
            continue;
        };
        let metrics = metrics.clone();
        let ready = ready.clone();
        let liveness = liveness.clone();
        let timeout = limits.header_read_timeout;
        tokio::spawn(async move {
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

    /// A listener whose every accept fails as with no descriptors left.
    struct OutOfDescriptors(Arc<AtomicUsize>);

    impl Listener for OutOfDescriptors {
        type Conn = TcpStream;

        async fn accept(&mut self) -> std::io::Result<TcpStream> {
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
