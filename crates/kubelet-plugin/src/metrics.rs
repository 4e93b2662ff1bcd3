//! Prometheus metrics of the node plugin.
//!
//! `gpu_dra_requests_total{op}`, `gpu_dra_request_errors_total{op}`,
//! `gpu_dra_request_duration_seconds{op}` (per claim), `gpu_dra_requests_in_flight`,
//! `gpu_dra_prepared_devices`; `op` is `prepare` or `unprepare`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
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
}

fn op(op: &str) -> Labels {
    vec![("op".to_owned(), op.to_owned())]
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("gpu_dra");
        let requests = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let duration = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
            ])
        });
        let in_flight = Gauge::default();
        let prepared_devices = Gauge::default();
        registry.register(
            "requests",
            "Claims prepared or unprepared",
            requests.clone(),
        );
        registry.register(
            "request_errors",
            "Claims whose prepare or unprepare failed",
            errors.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time to prepare or unprepare one claim",
            duration.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Claims being prepared or unprepared",
            in_flight.clone(),
        );
        registry.register(
            "prepared_devices",
            "Devices prepared on this node",
            prepared_devices.clone(),
        );
        let sharing = crate::sharing::SharingMetrics::default();
        sharing.register(&mut registry);
        Metrics {
            registry,
            sharing,
            requests,
            errors,
            duration,
            in_flight,
            prepared_devices,
        }
    }
}

impl Metrics {
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

#[cfg(test)]
mod tests {
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
}
