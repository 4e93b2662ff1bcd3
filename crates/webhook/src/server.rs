//! The HTTPS server: TLS accept loop, HTTP/1.1 and HTTP/2, routing.
//!
//! Routes: `POST /validate` (AdmissionReview), `GET /healthz`, `GET /readyz`, `GET /metrics`.
//! Invariants:
//! - a request never panics the server and never hangs it: bodies are capped at
//!   [`MAX_BODY_BYTES`], TLS handshakes at [`HANDSHAKE_TIMEOUT`], HTTP/1.1 headers at
//!   [`HEADER_READ_TIMEOUT`];
//! - a body that is not an AdmissionReview gets 400 with the reason in plain text;
//! - on shutdown the listener closes, `/readyz` fails, and open connections finish their
//!   in-flight requests (HTTP graceful shutdown) within [`DRAIN_TIMEOUT`].

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::admission::{self, Outcome};
use crate::metrics::Metrics;
use crate::validation;

/// Largest AdmissionReview body accepted. An object is at most ~1.5 MiB in etcd and a review
/// of an UPDATE carries two of them.
pub const MAX_BODY_BYTES: usize = 8 << 20;
/// A client that does not finish its TLS handshake in this time is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// An HTTP/1.1 request's headers must arrive within this time.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long open connections may take to finish after shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// State shared by every connection.
#[derive(Debug)]
pub struct App {
    driver_name: String,
    metrics: Arc<Metrics>,
    ready: AtomicBool,
}

impl App {
    /// State for a webhook validating configs addressed to `driver_name`.
    pub fn new(driver_name: String, metrics: Arc<Metrics>) -> Self {
        Self {
            driver_name,
            metrics,
            ready: AtomicBool::new(false),
        }
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
            (&Method::POST, "/validate") => self.validate(req.into_body()).await,
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

    async fn validate<B>(&self, body: B) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let start = Instant::now();
        let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                self.metrics
                    .observe_malformed(start.elapsed().as_secs_f64());
                if error.is::<http_body_util::LengthLimitError>() {
                    return text(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!("request body larger than {MAX_BODY_BYTES} bytes"),
                    );
                }
                return text(
                    StatusCode::BAD_REQUEST,
                    &format!("reading request body: {error}"),
                );
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
    let acceptor = TlsAcceptor::from(tls);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    app.ready.store(true, Ordering::Relaxed);
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
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                let app = Arc::clone(&app);
                let mut stop = stop_rx.clone();
                connections.spawn(async move {
                    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
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
                    let service = service_fn(move |req: Request<Incoming>| {
                        let app = Arc::clone(&app);
                        async move { Ok::<_, Infallible>(app.handle(req).await) }
                    });
                    let mut builder = auto::Builder::new(TokioExecutor::new());
                    // An HTTP/1.1 client that never finishes its headers is dropped.
                    builder
                        .http1()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEADER_READ_TIMEOUT);
                    let conn = builder.serve_connection(TokioIo::new(tls), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        result = conn.as_mut() => {
                            if let Err(error) = result {
                                debug!(%peer, %error, "connection ended with an error");
                            }
                        }
                        () = stopped(&mut stop) => {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.await;
                        }
                    }
                });
                // Reap finished connections so the set does not grow with the uptime.
                while connections.try_join_next().is_some() {}
            }
        }
    }
    app.ready.store(false, Ordering::Relaxed);
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
