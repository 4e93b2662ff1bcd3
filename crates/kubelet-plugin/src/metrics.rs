//! Prometheus metrics of the node plugin, in two families.
//!
//! Ours: `gpu_dra_requests_total{op}`, `gpu_dra_request_errors_total{op}`,
//! `gpu_dra_request_duration_seconds{op}` (per claim, failed ones included),
//! `gpu_dra_requests_in_flight`, `gpu_dra_prepared_devices`; `op` is `prepare` or `unprepare`;
//! the per-claim usage series `gpu_dra_claim_*` and the sampler's `gpu_dra_usage_*` (see
//! [`crate::usage`]).
//!
//! NVIDIA's ([`NvidiaMetrics`]), under the names, labels and meaning NVIDIA's driver exports
//! them, so that dashboards and alerts written for it work unchanged:
//! `nvidia_dra_requests_total{driver,operation}` and
//! `nvidia_dra_request_duration_seconds{driver,operation}` (successful kubelet requests per
//! claim, timed from the call's arrival; buckets 0.05 s doubling to 12.8 s),
//! `nvidia_dra_requests_inflight{driver,operation}`,
//! `nvidia_dra_prepared_devices{node,driver,device_type}` (devices of completely prepared
//! claims in the checkpoint, by `device_type` `gpu`, `mig`, `vfio` or `unknown`),
//! `nvidia_dra_node_prepare_errors_total{driver,error_type}` and
//! `nvidia_dra_node_unprepare_errors_total{driver,error_type}` (`error_type`
//! `prepare_devices` / `unprepare_devices`: every failed request). The request series of both
//! operations exist at zero from the start, as NVIDIA's do.
//!
//! Invariant: NVIDIA's family counts the kubelet's requests only (recorded in [`crate::grpc`]);
//! a prepare or unprepare the plugin runs on its own (the rollback of a failed prepare, the
//! cleanup of half-prepared claims) is not a request. Its `prepared_devices` is recounted from
//! the checkpoint on every change, as NVIDIA's is.

use std::sync::OnceLock;
use std::time::Instant;

use gpu_dra_core::checkpoint::{Checkpoint, PrepareState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// The plugin's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    duration: Family<Labels, Histogram>,
    /// Claims being prepared or unprepared now.
    pub in_flight: Gauge,
    /// Devices prepared on this node now.
    pub prepared_devices: Gauge,
    /// Metrics of GPU sharing (MPS daemon restarts).
    pub sharing: crate::sharing::SharingMetrics,
    /// Per-claim usage (`gpu_dra_claim_*`) and the sampler's own series (`gpu_dra_usage_*`).
    pub usage: crate::usage::UsageMetrics,
    /// The series under NVIDIA's names.
    pub nvidia: NvidiaMetrics,
    /// DRA features the API server drops from our slices (`gpu_dra_api_feature_missing`, 1
    /// per feature gate found off; see [`crate::publish::features`]).
    pub api_feature_missing: Family<Labels, Gauge>,
    /// The HTTP path the metrics are served at (`--metrics-path`); `None`: not served.
    path: Option<String>,
}

fn op(op: &str) -> Labels {
    vec![("op".to_owned(), op.to_owned())]
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Where the metrics are served unless told otherwise.
pub const DEFAULT_PATH: &str = "/metrics";

impl Default for Metrics {
    fn default() -> Self {
        Metrics::served_at(Some(DEFAULT_PATH.to_owned()))
    }
}

impl Metrics {
    /// The metrics, served at HTTP path `path` (`None`: not served; the health endpoints are).
    pub fn served_at(path: Option<String>) -> Self {
        let mut registry = Registry::default();
        let ours = registry.sub_registry_with_prefix("gpu_dra");
        let requests = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let duration = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
            ])
        });
        let in_flight = Gauge::default();
        let prepared_devices = Gauge::default();
        ours.register(
            "requests",
            "Claims prepared or unprepared",
            requests.clone(),
        );
        ours.register(
            "request_errors",
            "Claims whose prepare or unprepare failed",
            errors.clone(),
        );
        ours.register(
            "request_duration_seconds",
            "Time to prepare or unprepare one claim",
            duration.clone(),
        );
        ours.register(
            "requests_in_flight",
            "Claims being prepared or unprepared",
            in_flight.clone(),
        );
        ours.register(
            "prepared_devices",
            "Devices prepared on this node",
            prepared_devices.clone(),
        );
        let api_feature_missing = Family::<Labels, Gauge>::default();
        ours.register(
            "api_feature_missing",
            "1 for each DRA feature gate whose ResourceSlice fields the API server drops (the node then offers what it can without it)",
            api_feature_missing.clone(),
        );
        let sharing = crate::sharing::SharingMetrics::default();
        sharing.register(ours);
        let usage = crate::usage::UsageMetrics::default();
        usage.register(ours);
        let nvidia = NvidiaMetrics::default();
        nvidia.register(registry.sub_registry_with_prefix("nvidia_dra"));
        Metrics {
            registry,
            api_feature_missing,
            sharing,
            usage,
            requests,
            errors,
            duration,
            in_flight,
            prepared_devices,
            nvidia,
            path,
        }
    }

    /// The HTTP path the metrics are served at, if they are.
    pub fn path(&self) -> Option<&str> {
        self.path.as_deref()
    }

    /// Records one finished claim operation.
    pub fn observe(&self, operation: &str, seconds: f64, ok: bool) {
        let labels = op(operation);
        self.requests.get_or_create(&labels).inc();
        if !ok {
            self.errors.get_or_create(&labels).inc();
        }
        self.duration.get_or_create(&labels).observe(seconds);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A kubelet request, as NVIDIA's `operation` label names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `NodePrepareResources`, one claim.
    Prepare,
    /// `NodeUnprepareResources`, one claim.
    Unprepare,
}

impl Operation {
    /// The `operation` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Prepare => "prepare",
            Operation::Unprepare => "unprepare",
        }
    }

    /// The `error_type` of a failed request. NVIDIA's driver also has `lock_acquire` (its
    /// node-wide lock timed out) and `publish_resources` (VFIO passthrough): this plugin has
    /// neither a lock with a timeout nor passthrough, so every failure is of this type.
    fn error_type(self) -> &'static str {
        match self {
            Operation::Prepare => "prepare_devices",
            Operation::Unprepare => "unprepare_devices",
        }
    }
}

/// NVIDIA's `device_type` values, each exported (at zero when none is prepared) as NVIDIA's
/// driver does. `vfio` (passthrough) devices do not exist here, and every device name we or
/// NVIDIA's driver write is a GPU or a MIG device, so those two stay at zero.
const DEVICE_TYPES: [&str; 4] = ["gpu", "mig", "vfio", "unknown"];

/// The `device_type` of a prepared device by its name: MIG device names, ours and NVIDIA's
/// (`gpu-<minor>-mig-<profile>-...`), carry `-mig-`, whole GPUs are `gpu-<minor>`.
fn device_type(device: &str) -> &'static str {
    if device.contains("-mig-") {
        "mig"
    } else if device.starts_with("gpu-") {
        "gpu"
    } else {
        "unknown"
    }
}

/// The driver and node the series are labelled with, known once the driver is built.
struct Identity {
    driver: String,
    node: String,
}

/// The series NVIDIA's driver exports (`nvidia_dra_*`), with its names, labels and meaning.
pub struct NvidiaMetrics {
    identity: OnceLock<Identity>,
    requests: Family<Labels, Counter>,
    duration: Family<Labels, Histogram>,
    inflight: Family<Labels, Gauge>,
    prepared: Family<Labels, Gauge>,
    prepare_errors: Family<Labels, Counter>,
    unprepare_errors: Family<Labels, Counter>,
}

impl Default for NvidiaMetrics {
    fn default() -> Self {
        NvidiaMetrics {
            identity: OnceLock::new(),
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.05, 2.0, 9))
            }),
            inflight: Family::default(),
            prepared: Family::default(),
            prepare_errors: Family::default(),
            unprepare_errors: Family::default(),
        }
    }
}

impl NvidiaMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Kubelet prepare and unprepare requests that succeeded, per claim",
            self.requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a kubelet request's arrival to its successful answer, per claim",
            self.duration.clone(),
        );
        registry.register(
            "requests_inflight",
            "Kubelet prepare and unprepare requests being served, per claim",
            self.inflight.clone(),
        );
        registry.register(
            "prepared_devices",
            "Devices of completely prepared claims on this node, by device type",
            self.prepared.clone(),
        );
        registry.register(
            "node_prepare_errors",
            "Kubelet prepare requests that failed, per claim",
            self.prepare_errors.clone(),
        );
        registry.register(
            "node_unprepare_errors",
            "Kubelet unprepare requests that failed, per claim",
            self.unprepare_errors.clone(),
        );
    }

    /// Labels the series with `driver` and `node` (the first call wins: one driver per
    /// process) and creates the request series of both operations at zero, so they exist from
    /// the first scrape.
    pub fn identify(&self, driver: &str, node: &str) {
        let id = self.identity.get_or_init(|| Identity {
            driver: driver.to_owned(),
            node: node.to_owned(),
        });
        for op in [Operation::Prepare, Operation::Unprepare] {
            let l = labels(&[("driver", &id.driver), ("operation", op.as_str())]);
            // Creating a series is all; the returned guards are dropped at once.
            drop(self.requests.get_or_create(&l));
            drop(self.duration.get_or_create(&l));
            drop(self.inflight.get_or_create(&l));
        }
    }

    fn driver(&self) -> &str {
        self.identity.get().map_or("", |id| id.driver.as_str())
    }

    /// Starts recording one kubelet request for one claim; [`Request::finish`] records its
    /// outcome. Dropped unfinished (the call was cancelled), it only leaves the in-flight count.
    pub fn begin(&self, operation: Operation) -> Request<'_> {
        let labels = labels(&[("driver", self.driver()), ("operation", operation.as_str())]);
        self.inflight.get_or_create(&labels).inc();
        Request {
            metrics: self,
            operation,
            labels,
            started: Instant::now(),
        }
    }

    /// Sets `prepared_devices` from the checkpoint: the devices of claims in
    /// `PrepareCompleted`, by device type.
    pub fn count_prepared(&self, checkpoint: &Checkpoint) {
        let mut counts = [0i64; DEVICE_TYPES.len()];
        let devices = checkpoint
            .claims
            .values()
            .filter(|e| e.state == PrepareState::PrepareCompleted)
            .flat_map(|e| &e.devices);
        for d in devices {
            let ty = device_type(&d.device);
            if let Some(i) = DEVICE_TYPES.iter().position(|t| *t == ty) {
                counts[i] += 1;
            }
        }
        let node = self.identity.get().map_or("", |id| id.node.as_str());
        for (ty, count) in DEVICE_TYPES.iter().zip(counts) {
            let l = labels(&[
                ("node", node),
                ("driver", self.driver()),
                ("device_type", ty),
            ]);
            self.prepared.get_or_create(&l).set(count);
        }
    }
}

/// One kubelet request being served ([`NvidiaMetrics::begin`]).
pub struct Request<'a> {
    metrics: &'a NvidiaMetrics,
    operation: Operation,
    labels: Labels,
    started: Instant,
}

impl Request<'_> {
    /// Records the request's outcome: a success counts in `requests_total` and
    /// `request_duration_seconds`, a failure in `node_<operation>_errors_total` only (as
    /// NVIDIA's driver counts them).
    pub fn finish(self, ok: bool) {
        let m = self.metrics;
        if ok {
            m.requests.get_or_create(&self.labels).inc();
            m.duration
                .get_or_create(&self.labels)
                .observe(self.started.elapsed().as_secs_f64());
        } else {
            let errors = match self.operation {
                Operation::Prepare => &m.prepare_errors,
                Operation::Unprepare => &m.unprepare_errors,
            };
            let l = labels(&[
                ("driver", m.driver()),
                ("error_type", self.operation.error_type()),
            ]);
            errors.get_or_create(&l).inc();
        }
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        self.metrics.inflight.get_or_create(&self.labels).dec();
    }
}

#[cfg(test)]
mod tests {
    use gpu_dra_core::checkpoint::{ClaimEntry, PreparedDevice};

    use super::*;

    #[test]
    fn renders_counters_by_op() {
        let m = Metrics::default();
        m.observe("prepare", 0.001, true);
        m.observe("prepare", 0.002, false);
        m.prepared_devices.set(3);
        let text = m.render();
        assert!(
            text.contains(r#"gpu_dra_requests_total{op="prepare"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"gpu_dra_request_errors_total{op="prepare"} 1"#),
            "{text}"
        );
        assert!(text.contains("gpu_dra_prepared_devices 3"), "{text}");
    }

    #[test]
    fn nvidia_request_series_exist_at_zero_once_identified() {
        let m = Metrics::default();
        assert!(!m.render().contains("nvidia_dra_requests_total"));
        m.nvidia.identify("gpu.nvidia.com", "n1");
        let text = m.render();
        for op in ["prepare", "unprepare"] {
            let l = format!(r#"{{driver="gpu.nvidia.com",operation="{op}"}}"#);
            for series in [
                format!("nvidia_dra_requests_total{l} 0"),
                format!("nvidia_dra_request_duration_seconds_count{l} 0"),
                format!("nvidia_dra_requests_inflight{l} 0"),
            ] {
                assert!(text.contains(&series), "{series} missing:\n{text}");
            }
        }
        // NVIDIA's buckets: 0.05 s doubling, nine of them.
        assert!(
            text.contains(r#"nvidia_dra_request_duration_seconds_bucket{le="12.8",driver="gpu.nvidia.com",operation="prepare"} 0"#),
            "{text}"
        );
    }

    #[test]
    fn a_request_is_in_flight_until_finished_and_counts_by_outcome() {
        let m = Metrics::default();
        m.nvidia.identify("gpu.nvidia.com", "n1");
        let r = m.nvidia.begin(Operation::Unprepare);
        assert!(
            m.render().contains(
                r#"nvidia_dra_requests_inflight{driver="gpu.nvidia.com",operation="unprepare"} 1"#
            ),
            "{}",
            m.render()
        );
        r.finish(false);
        m.nvidia.begin(Operation::Unprepare).finish(true);
        let text = m.render();
        for series in [
            r#"nvidia_dra_requests_inflight{driver="gpu.nvidia.com",operation="unprepare"} 0"#,
            r#"nvidia_dra_requests_total{driver="gpu.nvidia.com",operation="unprepare"} 1"#,
            r#"nvidia_dra_node_unprepare_errors_total{driver="gpu.nvidia.com",error_type="unprepare_devices"} 1"#,
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        assert!(
            !text.contains("nvidia_dra_node_prepare_errors_total{"),
            "{text}"
        );
    }

    #[test]
    fn prepared_devices_count_completed_claims_by_device_type() {
        let m = Metrics::default();
        m.nvidia.identify("gpu.nvidia.com", "n1");
        let device = |name: &str| PreparedDevice {
            device: name.into(),
            pool: "n1".into(),
            request_names: Vec::new(),
            cdi_device_ids: Vec::new(),
            uuid: String::new(),
            admin_access: false,
            share_id: None,
            memory_share_bytes: None,
            sharing_strategy: None,
            extra: Default::default(),
        };
        let entry = |state, devices: Vec<PreparedDevice>| ClaimEntry {
            state,
            namespace: "ns".into(),
            name: "c".into(),
            devices,
            sharing: None,
            boot_id: None,
            driver_version: None,
            imported: None,
            dynamic_mig: Vec::new(),
            extra: Default::default(),
        };
        let mut cp = Checkpoint::default();
        cp.claims.insert(
            "a".into(),
            entry(
                PrepareState::PrepareCompleted,
                vec![device("gpu-0"), device("gpu-1-mig-1g5gb-19-0")],
            ),
        );
        cp.claims.insert(
            "b".into(),
            entry(PrepareState::PrepareCompleted, vec![device("gpu-2")]),
        );
        // Half prepared: not counted.
        cp.claims.insert(
            "c".into(),
            entry(PrepareState::PrepareStarted, vec![device("gpu-3")]),
        );
        m.nvidia.count_prepared(&cp);
        let text = m.render();
        for (ty, n) in [("gpu", 2), ("mig", 1), ("vfio", 0), ("unknown", 0)] {
            let series = format!(
                r#"nvidia_dra_prepared_devices{{node="n1",driver="gpu.nvidia.com",device_type="{ty}"}} {n}"#
            );
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        cp.claims.clear();
        m.nvidia.count_prepared(&cp);
        assert!(
            m.render().contains(
                r#"nvidia_dra_prepared_devices{node="n1",driver="gpu.nvidia.com",device_type="gpu"} 0"#
            ),
            "a type that had devices goes back to zero"
        );
    }

    #[test]
    fn metrics_can_be_left_unserved() {
        assert_eq!(Metrics::default().path(), Some("/metrics"));
        assert_eq!(Metrics::served_at(None).path(), None);
    }
}
