//! Prometheus metrics of the webhook, served on `/metrics` in OpenMetrics text.
//!
//! Label values are bounded enums (kind, operation, result), never object names, so the
//! series count stays fixed whatever the cluster sends.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::admission::{Operation, Outcome, ReviewedKind, kind_label};

/// Labels of the request counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Object kind (`ResourceClaim`, `ResourceClaimTemplate`, `DeviceClass`, `other`, `unknown`).
    pub kind: &'static str,
    /// `CREATE`, `UPDATE`, `other` or `unknown`.
    pub operation: &'static str,
    /// `allowed`, `denied`, `skipped` or `malformed` (answered 400).
    pub result: &'static str,
}

/// All metrics of the webhook and the registry that serves them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    duration: Histogram,
    /// Certificate reloads after a rotation (handed to [`crate::tls::ReloadingCert`]).
    pub cert_reloads: Counter,
    /// Rotations seen that could not be loaded (previous pair kept).
    pub cert_reload_failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpu_dra_webhook");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "admission_requests",
            "Admission reviews answered, by object kind, operation and result",
            requests.clone(),
        );
        // 25 us .. ~100 ms: a review takes tens of microseconds; the tail is what matters.
        let duration = Histogram::new([
            25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3,
        ]);
        registry.register(
            "admission_duration_seconds",
            "Time from the end of the request headers to the response, per review",
            duration.clone(),
        );
        let cert_reloads = Counter::default();
        registry.register(
            "certificate_reloads",
            "Serving certificate reloads after the files changed",
            cert_reloads.clone(),
        );
        let cert_reload_failures = Counter::default();
        registry.register(
            "certificate_reload_failures",
            "Serving certificate changes that could not be loaded (previous one kept)",
            cert_reload_failures.clone(),
        );
        Self {
            registry,
            requests,
            duration,
            cert_reloads,
            cert_reload_failures,
        }
    }

    /// Counts one answered review and its duration.
    pub fn observe(&self, kind: ReviewedKind, operation: Operation, outcome: Outcome, secs: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                kind: kind_label(kind),
                operation: operation.as_str(),
                result: outcome.as_str(),
            })
            .inc();
        self.duration.observe(secs);
    }

    /// Counts one body that was not an AdmissionReview (answered 400).
    pub fn observe_malformed(&self, secs: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                kind: "unknown",
                operation: "unknown",
                result: "malformed",
            })
            .inc();
        self.duration.observe(secs);
    }

    /// The metrics in OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_show_up_in_the_exposition() {
        let m = Metrics::new();
        m.observe(
            Some(gpu_dra_api::objects::ObjectKind::ResourceClaim),
            Operation::Create,
            Outcome::Denied,
            0.0001,
        );
        m.observe_malformed(0.00002);
        m.cert_reloads.inc();
        let text = m.encode();
        assert!(
            text.contains(
                r#"gpu_dra_webhook_admission_requests_total{kind="ResourceClaim",operation="CREATE",result="denied"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"result="malformed"} 1"#), "{text}");
        assert!(
            text.contains("gpu_dra_webhook_admission_duration_seconds_count 2"),
            "{text}"
        );
        assert!(
            text.contains("gpu_dra_webhook_certificate_reloads_total 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }
}
