//! `gpu-dra-webhook`: the validating admission webhook for opaque GPU configs.
//!
//! It reviews ResourceClaims, ResourceClaimTemplates and DeviceClasses of `resource.k8s.io`
//! and denies those whose `GpuConfig` / `MigDeviceConfig` parameters addressed to our driver
//! are invalid, using the one validation of the `api` crate, so users see config errors at
//! `kubectl apply` instead of at pod start. Layout:
//! - [`admission`]: pure AdmissionReview decoding and answering;
//! - [`validation`]: the bridge to the `api` crate;
//! - [`tls`]: the serving certificate, reloaded when its files rotate;
//! - [`server`]: HTTPS (HTTP/1.1 and HTTP/2) routing, limits against slow and oversized
//!   requests, and graceful shutdown;
//! - [`daemon_pods`]: the bound on pods per node that a node plugin's credentials may create
//!   (`POST /daemon-pods`, on only with `--max-daemon-pods-per-node`);
//! - [`metrics`]: Prometheus metrics.

pub mod admission;
pub mod daemon_pods;
pub mod metrics;
pub mod server;
pub mod tls;
pub mod validation;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use gpu_dra_telemetry::LogArgs;
use tokio::net::TcpListener;

use crate::metrics::Metrics;
use crate::server::{App, Limits};
use crate::tls::ReloadingCert;

/// Command line of `gpu-dra-webhook`; every flag has an environment twin (the chart sets those).
#[derive(Debug, Clone, Parser)]
#[command(name = "gpu-dra-webhook", version, about)]
pub struct Args {
    /// Address of the HTTPS listener (POST /validate, GET /healthz /readyz /metrics).
    #[arg(long, env = "BIND_ADDRESS", default_value = "0.0.0.0:8443")]
    pub bind_address: SocketAddr,
    /// PEM certificate chain, leaf first; reloaded when the file changes.
    #[arg(long, env = "TLS_CERT_FILE")]
    pub tls_cert_file: PathBuf,
    /// PEM private key of the certificate; reloaded with it.
    #[arg(long, env = "TLS_KEY_FILE")]
    pub tls_key_file: PathBuf,
    /// Opaque configs addressed to this driver are validated; others are left alone.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Deadline of each phase of a request: TLS handshake, first request on a connection,
    /// HTTP/1.1 headers, body. Slower clients are disconnected.
    #[arg(long, env = "READ_TIMEOUT_SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=60))]
    pub read_timeout_seconds: u64,
    /// Open connections at most; more are closed when accepted.
    #[arg(long, env = "MAX_CONNECTIONS", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_connections: u64,
    /// Pods of `--daemon-pods-namespace` one node may hold when a node plugin creates another
    /// (reviews sent to `POST /daemon-pods`); 0 turns the review off. Needs list and watch on
    /// that namespace's pods.
    #[arg(long, env = "MAX_DAEMON_PODS_PER_NODE", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub max_daemon_pods_per_node: u64,
    /// The namespace whose pods count (the release namespace, where the plugin makes its MPS
    /// daemon pods).
    #[arg(long, env = "DAEMON_PODS_NAMESPACE", default_value = "")]
    pub daemon_pods_namespace: String,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// Runs the webhook until SIGTERM or SIGINT.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let cert = ReloadingCert::load(
        &args.tls_cert_file,
        &args.tls_key_file,
        metrics.cert_reloads.clone(),
        metrics.cert_reload_failures.clone(),
    )
    .context("loading the serving certificate")?;
    let tls = Arc::new(cert).server_config()?;
    let listener = TcpListener::bind(args.bind_address)
        .await
        .with_context(|| format!("binding {}", args.bind_address))?;
    let limits = Limits {
        read_timeout: std::time::Duration::from_secs(args.read_timeout_seconds),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        ..Limits::default()
    };
    let mut app = App::with_limits(args.driver_name, metrics, limits);
    if args.max_daemon_pods_per_node > 0 {
        anyhow::ensure!(
            !args.daemon_pods_namespace.is_empty(),
            "--max-daemon-pods-per-node needs --daemon-pods-namespace (DAEMON_PODS_NAMESPACE): the namespace whose pods count"
        );
        let client = kube::Client::try_default()
            .await
            .context("connecting to the API server to count the pods per node")?;
        let counts = Arc::new(daemon_pods::PodCounts::default());
        tokio::spawn(daemon_pods::watch(
            kube::Api::namespaced(client, &args.daemon_pods_namespace),
            Arc::clone(&counts),
        ));
        let limit = usize::try_from(args.max_daemon_pods_per_node).unwrap_or(usize::MAX);
        app = app.with_daemon_pod_limit(counts, limit);
    }
    let app = Arc::new(app);
    server::serve(listener, tls, app, shutdown_signal()).await;
    Ok(())
}

/// Completes on SIGTERM (pod deletion) or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(error) => {
            tracing::warn!(%error, "cannot watch SIGTERM; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Worker threads of the runtime: reviews take microseconds, so a few threads serve
/// thousands per second, and fewer threads keep the resident memory small.
pub fn worker_threads() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn every_flag_has_its_env_twin() {
        Args::command().debug_assert();
        let twins: Vec<(String, String)> = Args::command()
            .get_arguments()
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            .map(|a| {
                let env = a.get_env().map(|e| e.to_string_lossy().into_owned());
                (a.get_id().to_string(), env.unwrap_or_default())
            })
            .collect();
        assert_eq!(
            twins,
            [
                ("bind_address", "BIND_ADDRESS"),
                ("tls_cert_file", "TLS_CERT_FILE"),
                ("tls_key_file", "TLS_KEY_FILE"),
                ("driver_name", "DRIVER_NAME"),
                ("read_timeout_seconds", "READ_TIMEOUT_SECONDS"),
                ("max_connections", "MAX_CONNECTIONS"),
                ("max_daemon_pods_per_node", "MAX_DAEMON_PODS_PER_NODE"),
                ("daemon_pods_namespace", "DAEMON_PODS_NAMESPACE"),
                ("log_format", "LOG_FORMAT"),
                ("log_level", "LOG_LEVEL"),
            ]
            .map(|(a, e)| (a.to_owned(), e.to_owned()))
        );
    }

    #[test]
    fn defaults_match_the_contract() {
        let a = Args::try_parse_from([
            "gpu-dra-webhook",
            "--tls-cert-file",
            "c",
            "--tls-key-file",
            "k",
        ])
        .unwrap();
        // An env twin set in the test's environment legitimately overrides a default.
        let unset = |var: &str| std::env::var_os(var).is_none();
        if unset("BIND_ADDRESS") {
            assert_eq!(a.bind_address.to_string(), "0.0.0.0:8443");
        }
        if unset("DRIVER_NAME") {
            assert_eq!(a.driver_name, "gpu.nvidia.com");
        }
        let limits = Limits::default();
        if unset("READ_TIMEOUT_SECONDS") {
            assert_eq!(
                std::time::Duration::from_secs(a.read_timeout_seconds),
                limits.read_timeout
            );
        }
        if unset("MAX_CONNECTIONS") {
            assert_eq!(a.max_connections, limits.max_connections as u64);
        }
        if unset("LOG_FORMAT") {
            assert_eq!(a.log.log_format, gpu_dra_telemetry::LogFormat::Text);
        }
        if unset("LOG_LEVEL") {
            assert_eq!(a.log.log_level, "info");
        }
    }
}
