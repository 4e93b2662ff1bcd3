//! The operations endpoint: `/metrics` (OpenMetrics text), `/healthz` (the process serves),
//! `/readyz` (the gRPC sockets are up). Plain HTTP/1 on `--http-address`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Serves the endpoints on `listener` forever.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, ready: Arc<AtomicBool>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (status, ctype, body) = match req.uri().path() {
                    "/metrics" => (
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        metrics.render(),
                    ),
                    "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
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
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
