//! Test helpers: self-signed certificates, an in-process TLS server, a TLS client.

// Helpers fail the test on any setup error, so unwrap is the point here.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use gpu_dra_webhook::metrics::Metrics;
use gpu_dra_webhook::server::{self, App};
use gpu_dra_webhook::tls::ReloadingCert;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

/// A self-signed certificate for `localhost` and its key, both PEM.
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

pub fn pair() -> Pair {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    Pair {
        cert_pem: c.cert.pem(),
        key_pem: c.signing_key.serialize_pem(),
        der: c.cert.der().clone(),
    }
}

/// Writes `p` as `tls.crt` / `tls.key` in `dir`, each replaced by rename like a Secret volume.
pub fn install(dir: &Path, p: &Pair) {
    for (name, text) in [("tls.crt", &p.cert_pem), ("tls.key", &p.key_pem)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

/// A running in-process server.
pub struct Running {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    /// Signals shutdown and waits for the server to drain.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(std::time::Duration::from_secs(15), self.task)
            .await
            .expect("server drains in time")
            .unwrap();
    }
}

/// Starts a server on loopback that serves the pair in `dir`.
pub async fn start(dir: &Path) -> Running {
    let metrics = Arc::new(Metrics::new());
    let cert = ReloadingCert::load(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        metrics.cert_reloads.clone(),
        metrics.cert_reload_failures.clone(),
    )
    .unwrap();
    let tls = Arc::new(cert).server_config().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Arc::new(App::new("gpu.nvidia.com".into(), metrics));
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(server::serve(listener, tls, Arc::clone(&app), async {
        let _ = rx.await;
    }));
    Running {
        addr,
        app,
        stop: Some(tx),
        task,
    }
}

/// An HTTP connection over TLS, HTTP/1.1 or HTTP/2 as negotiated.
pub enum Client {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

/// A TLS stream to `addr` trusting `trusted`, offering `alpn`.
pub async fn tls(
    addr: SocketAddr,
    trusted: &[&CertificateDer<'static>],
    alpn: &[u8],
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for c in trusted {
        roots.add((*c).clone()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// Connects to `addr` trusting `trusted`; returns the client and the served leaf certificate.
pub async fn connect(
    addr: SocketAddr,
    trusted: &[&CertificateDer<'static>],
    alpn: &[u8],
) -> (Client, CertificateDer<'static>) {
    let tls = tls(addr, trusted, alpn).await.unwrap();
    let (_, session) = tls.get_ref();
    let leaf = session.peer_certificates().unwrap()[0].clone();
    let negotiated = session.alpn_protocol().map(<[u8]>::to_vec);
    assert_eq!(negotiated.as_deref(), Some(alpn), "ALPN");
    let io = TokioIo::new(tls);
    let client = if alpn == b"h2" {
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        Client::H2(send)
    } else {
        let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        Client::H1(send)
    };
    (client, leaf)
}

impl Client {
    /// Sends one request and returns the status and body text.
    pub async fn send(&mut self, method: &str, path: &str, body: Vec<u8>) -> (u16, String) {
        self.try_send(method, path, body).await.unwrap()
    }

    /// Like [`Client::send`], with the connection's errors returned.
    pub async fn try_send(
        &mut self,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, String), hyper::Error> {
        let req = Request::builder()
            .method(method)
            .uri(format!("https://localhost{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp: Response<hyper::body::Incoming> = match self {
            Client::H1(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
            Client::H2(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
        };
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }
}

/// An AdmissionReview (CREATE) of ResourceClaim `name` asking one whole GPU, with `config` as
/// its `spec.devices.config` when given.
#[allow(dead_code, reason = "not every test file sends reviews")]
pub fn claim_review(uid: &str, name: &str, config: Option<serde_json::Value>) -> Vec<u8> {
    let mut devices = serde_json::json!({"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    ]});
    if let Some(config) = config {
        devices["config"] = config;
    }
    serde_json::to_vec(&serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "operation": "CREATE",
            "namespace": "default",
            "object": {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": devices}
            }
        }
    }))
    .expect("a JSON value serializes")
}
