//! The HTTPS server: TLS accept loop, HTTP/1.1 and HTTP/2, routing, and the limits that keep
//! a slow or abusive client from starving the API server's reviews.
//!
//! Routes: `POST /validate` (AdmissionReview), `GET /healthz`, `GET /readyz`, `GET /metrics`.
//! Invariants:
//! - a request never panics the server and never hangs it. Every phase has a deadline of
//!   [`Limits::read_timeout`]: the TLS handshake, the first request on a new connection (any
//!   protocol), each HTTP/1.1 request's headers (also the idle time between keep-alive
//!   requests), and each request body. A client sending headers or a body byte by byte is cut
//!   when the deadline passes, however busy it keeps the socket;
//! - memory is bounded whatever clients send: a body over [`Limits::max_body_bytes`] (the API
//!   server's own 3 MiB request limit) is refused with 413, from its `Content-Length` before
//!   reading when it has one; request bodies being read or reviewed share a budget of
//!   [`Limits::body_budget_bytes`] (a concurrency limit counted in bytes, so a thousand slow
//!   senders hold almost nothing while four huge bodies cannot take the pod's memory) and a
//!   request that does not fit gets 503 at once instead of queueing; at most
//!   [`Limits::max_connections`] connections are open (more are closed at accept) and each
//!   HTTP/2 connection carries at most [`Limits::max_streams`] concurrent requests;
//! - a body that is not an AdmissionReview gets 400 with the reason in plain text;
//! - `/readyz` answers 200 only while the listener serves with a loaded certificate: the
//!   server cannot start without one ([`crate::tls::ReloadingCert::load`] fails) and a rotation
//!   that cannot be loaded keeps the previous pair; it answers 503 before [`serve`] starts and
//!   from the moment shutdown begins;
//! - on shutdown the listener closes, `/readyz` fails, and open connections finish their
//!   in-flight requests (HTTP graceful shutdown) within [`DRAIN_TIMEOUT`].
//!
//! The transport ([`serve_with`]) is generic over a [`Handler`] so that the benchmark can put
//! a no-op handler behind exactly the same TLS, HTTP and limits to measure their share.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::admission::{self, Outcome};
use crate::metrics::Metrics;
use crate::validation;

/// Largest AdmissionReview body accepted: the API server refuses request bodies over 3 MiB
/// (`MaxRequestBodyBytes`), so no object it admits for review is larger, and a review of a
/// DeviceClass UPDATE carries two objects of a few KiB.
pub const MAX_BODY_BYTES: usize = 3 << 20;
/// How long open connections may take to finish after shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest HTTP/1.1 head or HTTP/2 header list: the API server sends a few hundred bytes.
const MAX_HEADER_BYTES: usize = 64 << 10;

/// What a client may cost the server. [`Limits::default`] is what the binary serves with;
/// `--read-timeout-seconds` and `--max-connections` override two of them.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once by all requests together; a request that would
    /// exceed it gets 503. Sized, with the connections' buffers, to stay well inside the
    /// chart's memory limit.
    pub body_budget_bytes: usize,
    /// Deadline of each phase: TLS handshake, first request, HTTP/1.1 headers, body.
    pub read_timeout: Duration,
    /// Open connections at most; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Concurrent requests per HTTP/2 connection.
    pub max_streams: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: MAX_BODY_BYTES,
            body_budget_bytes: 16 << 20,
            // The API server gives a review at most 30 s (timeoutSeconds) and sends it at
            // once; 10 s is far above any honest client on a cluster network.
            read_timeout: Duration::from_secs(10),
            // The API server opens one HTTP/2 connection per replica and server (a few per
            // webhook pod); 128 leaves room for probes and scrapes.
            max_connections: 128,
            max_streams: 64,
        }
    }
}

/// Answers requests; implemented by [`App`], and by the benchmark's no-op server.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request.
    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> impl Future<Output = Response<Full<Bytes>>> + Send;

    /// Told `true` when the listener starts serving and `false` when shutdown begins.
    fn serving(&self, _serving: bool) {}

    /// The limits the transport applies.
    fn limits(&self) -> &Limits;
}

/// State shared by every connection.
#[derive(Debug)]
pub struct App {
    driver_name: String,
    metrics: Arc<Metrics>,
    ready: AtomicBool,
    limits: Limits,
    /// [`Limits::body_budget_bytes`] in KiB permits.
    body_budget: Arc<Semaphore>,
    /// Pods per node and the most one node may hold, when `POST /daemon-pods` is served.
    daemon_pods: Option<(Arc<crate::daemon_pods::PodCounts>, usize)>,
}

/// Why a request body was not read to its end.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    /// Larger than [`Limits::max_body_bytes`].
    #[error("request body larger than {0} bytes")]
    TooLarge(usize),
    /// Not complete within [`Limits::read_timeout`].
    #[error("request body not received within {0:?}")]
    Timeout(Duration),
    /// The body budget is spent by other requests.
    #[error("too many request bytes in flight; retry")]
    Busy,
    /// The connection failed while reading.
    #[error("reading request body: {0}")]
    Read(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl BodyError {
    fn status(&self) -> StatusCode {
        match self {
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Self::Read(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Budget permits for `bytes` (KiB, rounded up; at least one so every request counts).
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024).max(1)).unwrap_or(u32::MAX)
}

impl App {
    /// State for a webhook validating configs addressed to `driver_name`, with the default
    /// [`Limits`].
    pub fn new(driver_name: String, metrics: Arc<Metrics>) -> Self {
        Self::with_limits(driver_name, metrics, Limits::default())
    }

    /// Like [`App::new`] with explicit limits.
    pub fn with_limits(driver_name: String, metrics: Arc<Metrics>, limits: Limits) -> Self {
        let budget = usize::try_from(kib(limits.body_budget_bytes)).unwrap_or(usize::MAX);
        Self {
            driver_name,
            metrics,
            ready: AtomicBool::new(false),
            body_budget: Arc::new(Semaphore::new(budget.min(Semaphore::MAX_PERMITS))),
            limits,
            daemon_pods: None,
        }
    }

    /// Also serves `POST /daemon-pods`: pod creations denied for a node that holds `limit`
    /// pods of `counts` already ([`crate::daemon_pods`]).
    pub fn with_daemon_pod_limit(
        mut self,
        counts: Arc<crate::daemon_pods::PodCounts>,
        limit: usize,
    ) -> Self {
        self.daemon_pods = Some((counts, limit));
        self
    }

    /// The metrics this app counts into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Answers one HTTP request. Public so that tests and benchmarks can drive the handler
    /// without a socket.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        match (req.method(), req.uri().path()) {
            (&Method::POST, "/validate") => self.validate(req).await,
            (&Method::POST, "/daemon-pods") if self.daemon_pods.is_some() => {
                self.daemon_pods(req).await
            }
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok"),
            (&Method::GET, "/readyz") => {
                if self.ready.load(Ordering::Relaxed) {
                    text(StatusCode::OK, "ok")
                } else {
                    text(StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }
            (&Method::GET, "/metrics") => Response::builder()
                .header(
                    header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
                .body(Full::new(Bytes::from(self.metrics.encode())))
                .unwrap_or_default(),
            (_, "/validate" | "/healthz" | "/readyz" | "/metrics") => {
                text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
            }
            _ => text(StatusCode::NOT_FOUND, "not found"),
        }
    }

    async fn validate<B>(&self, req: Request<B>) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let start = Instant::now();
        let (bytes, _permit) = match self.read_body(req).await {
            Ok(read) => read,
            Err(error) => {
                self.metrics
                    .observe_malformed(start.elapsed().as_secs_f64());
                debug!(%error, "request body refused");
                return text(error.status(), &error.to_string());
            }
        };
        let driver = self.driver_name.as_str();
        match admission::review(&bytes, |object| validation::check(object, driver)) {
            Ok(decision) => {
                self.metrics.observe(
                    decision.kind,
                    decision.operation,
                    decision.outcome,
                    start.elapsed().as_secs_f64(),
                );
                if decision.outcome != Outcome::Skipped {
                    debug!(
                        kind = admission::kind_label(decision.kind),
                        operation = decision.operation.as_str(),
                        result = decision.outcome.as_str(),
                        problems = decision.problems,
                        warnings = decision.warnings,
                        "reviewed"
                    );
                }
                Response::builder()
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(decision.body)))
                    .unwrap_or_default()
            }
            Err(error) => {
                self.metrics
                    .observe_malformed(start.elapsed().as_secs_f64());
                warn!(%error, "malformed admission review");
                text(StatusCode::BAD_REQUEST, &error.to_string())
            }
        }
    }

    async fn daemon_pods<B>(&self, req: Request<B>) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let Some((counts, limit)) = &self.daemon_pods else {
            return text(StatusCode::NOT_FOUND, "not found");
        };
        let (bytes, _permit) = match self.read_body(req).await {
            Ok(read) => read,
            Err(error) => return text(error.status(), &error.to_string()),
        };
        match crate::daemon_pods::review(&bytes, counts, *limit) {
            Ok((body, verdict)) => {
                if verdict != crate::daemon_pods::Verdict::Allowed {
                    warn!(?verdict, limit, "pod creation of a node plugin denied");
                }
                Response::builder()
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap_or_default()
            }
            Err(error) => {
                warn!(%error, "malformed admission review");
                text(StatusCode::BAD_REQUEST, &error.to_string())
            }
        }
    }

    /// Reads the whole body within the limits; the permit holds its bytes in the budget until
    /// the review is answered.
    async fn read_body<B>(
        &self,
        req: Request<B>,
    ) -> Result<(Bytes, OwnedSemaphorePermit), BodyError>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let max = self.limits.max_body_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > max) {
            return Err(BodyError::TooLarge(max));
        }
        let budget = &self.body_budget;
        let mut permit = Arc::clone(budget)
            .try_acquire_many_owned(kib(declared.unwrap_or(0)))
            .map_err(|_| BodyError::Busy)?;
        let timeout = self.limits.read_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let body = req.into_body();
        tokio::pin!(body);
        // The API server sends a review in one frame: keep that frame as it is, copy only
        // when a second one arrives.
        let mut first: Option<Bytes> = None;
        let mut joined: Vec<u8> = Vec::new();
        let mut len = 0usize;
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
                Err(_) => return Err(BodyError::Timeout(timeout)),
                Ok(None) => break,
                Ok(Some(Err(error))) => return Err(BodyError::Read(Box::new(error))),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            len += data.len();
            if len > max {
                return Err(BodyError::TooLarge(max));
            }
            let held = permit.num_permits();
            let needed = usize::try_from(kib(len)).unwrap_or(usize::MAX);
            if needed > held {
                let more = u32::try_from(needed - held).unwrap_or(u32::MAX);
                let extra = Arc::clone(budget)
                    .try_acquire_many_owned(more)
                    .map_err(|_| BodyError::Busy)?;
                permit.merge(extra);
            }
            match first.take() {
                None if joined.is_empty() => first = Some(data),
                None => joined.extend_from_slice(&data),
                Some(previous) => {
                    joined.reserve(declared.unwrap_or(len).min(max));
                    joined.extend_from_slice(&previous);
                    joined.extend_from_slice(&data);
                }
            }
        }
        let bytes = match first {
            Some(only) => only,
            None => Bytes::from(joined),
        };
        Ok((bytes, permit))
    }
}

impl Handler for App {
    async fn call(self: Arc<Self>, req: Request<Incoming>) -> Response<Full<Bytes>> {
        self.handle(req).await
    }

    fn serving(&self, serving: bool) {
        self.ready.store(serving, Ordering::Relaxed);
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }
}

/// Completes once shutdown has been signalled (or the sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(format!("{body}\n"))))
        .unwrap_or_default()
}

/// Serves `app` over TLS on `listener` until `shutdown` completes, then drains.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, tls, app, shutdown).await;
}

/// Serves any [`Handler`] over TLS with its [`Limits`] until `shutdown` completes, then
/// drains.
pub async fn serve_with<H: Handler>(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    handler: Arc<H>,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let limits = handler.limits().clone();
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    handler.serving(true);
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving admission reviews");
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        // Out of file descriptors and the like: back off, do not spin.
                        warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Reap finished connections so the set does not grow with the uptime.
                while connections.try_join_next().is_some() {}
                let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
                    debug!(%peer, max = limits.max_connections, "connection limit reached; closing");
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let conn = connection(
                    acceptor.clone(),
                    tcp,
                    peer,
                    Arc::clone(&handler),
                    limits.clone(),
                    stop_rx.clone(),
                );
                connections.spawn(async move {
                    conn.await;
                    drop(slot);
                });
            }
        }
    }
    handler.serving(false);
    drop(listener);
    info!(
        connections = connections.len(),
        "shutting down, draining connections"
    );
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!("connections still open after the drain timeout; closing them");
    }
}

/// One connection, from the TLS handshake to its close.
async fn connection<H: Handler>(
    acceptor: TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    handler: Arc<H>,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let tls = match tokio::time::timeout(limits.read_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(error)) => {
            debug!(%peer, %error, "TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    // Set by the first request; until then the connection is on the first-request deadline,
    // which covers what neither protocol times out itself (HTTP/2's preface and first
    // headers, the protocol sniffing of `auto`).
    let requested = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&requested);
    let service = service_fn(move |req: Request<Incoming>| {
        seen.store(true, Ordering::Relaxed);
        let handler = Arc::clone(&handler);
        async move { Ok::<_, Infallible>(handler.call(req).await) }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .max_buf_size(MAX_HEADER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(u32::try_from(MAX_HEADER_BYTES).unwrap_or(u32::MAX))
        // A peer that vanished without a FIN is found and dropped.
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    let conn = builder.serve_connection(TokioIo::new(tls), service);
    tokio::pin!(conn);
    let first_request = tokio::time::sleep(limits.read_timeout);
    tokio::pin!(first_request);
    let mut waiting_first = true;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    debug!(%peer, %error, "connection ended with an error");
                }
                return;
            }
            () = &mut first_request, if waiting_first => {
                if !requested.load(Ordering::Relaxed) {
                    debug!(%peer, "no request within the read timeout; closing");
                    return;
                }
                waiting_first = false;
            }
            () = stopped(&mut stop) => {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
                return;
            }
        }
    }
}
