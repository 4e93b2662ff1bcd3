//! What the API server keeps of our ResourceSlices, and what the node offers when it drops
//! something.
//!
//! The problem: an API server silently drops the fields of a disabled feature gate from the
//! objects it stores. On a cluster where `DRAConsumableCapacity` is off (every release before
//! 1.36 by default), a memory-share GPU published with `allowMultipleAllocations` is stored as
//! a single-allocation device; where `DRADeviceTaints` is off, an unhealthy GPU's taint
//! vanishes and the GPU keeps being allocated. No error anywhere.
//!
//! The rule: nothing is published that the API server would strip. Before a slice write that
//! carries a feature's fields for the first time (a feature neither seen kept nor seen dropped
//! by this server), the same write is made with `dryRun=All`; the answer shows what the server
//! keeps. A feature dropped is then missing: the slices are rendered again without it, using
//! its fallback, and the finding is said in a log line, the metric
//! `gpu_dra_api_feature_missing{feature_gate=...}` and a Warning Node event naming the gate,
//! the Kubernetes version that has it on by default and what the node offers instead. The real
//! writes are checked the same way (a server replaced between the dry run and the write).
//!
//! Fallbacks, each honest about what the node can do without the feature:
//! - consumable capacity off: memory-share and consumable-share GPUs are offered whole (one
//!   claim each), as the server would have stored them anyway;
//! - partitionable devices off: dynamic-MIG GPUs are offered as they are (whole, or their
//!   existing MIG devices), since the placements cannot share the GPU's counters;
//! - device taints off: devices with a health taint are withheld from the slices instead of
//!   published without the taint (the scheduler would otherwise keep allocating a broken GPU).
//!
//! What is learnt is forgotten every [`RECHECK`] (and at a plugin restart), so a gate turned on
//! later is found by the next dry run: one request, then the fallback is lifted.
//!
//! Rejected: deciding from the server's version alone (gates are per cluster, and a managed
//! cluster may turn a beta gate off or an alpha one on); a probe slice with every feature
//! (a dry run of the real write tests exactly what would be stored, and needs no fields we
//! would never send).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::Value;

use crate::node_events::NodeEvents;

/// How long what was learnt of the server holds before the next write checks again.
pub const RECHECK: Duration = Duration::from_secs(30 * 60);

/// A DRA feature whose fields our slices may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Feature {
    /// `allowMultipleAllocations`, capacity `requestPolicy`.
    ConsumableCapacity,
    /// `sharedCounters`, `consumesCounters`.
    PartitionableDevices,
    /// Device `taints`.
    DeviceTaints,
    /// `bindingConditions`, `bindingFailureConditions`, `bindsToNode`.
    BindingConditions,
}

impl Feature {
    /// Every feature.
    pub const ALL: [Feature; 4] = [
        Feature::ConsumableCapacity,
        Feature::PartitionableDevices,
        Feature::DeviceTaints,
        Feature::BindingConditions,
    ];

    /// The Kubernetes feature gate.
    pub fn gate(self) -> &'static str {
        match self {
            Feature::ConsumableCapacity => "DRAConsumableCapacity",
            Feature::PartitionableDevices => "DRAPartitionableDevices",
            Feature::DeviceTaints => "DRADeviceTaints",
            Feature::BindingConditions => "DRADeviceBindingConditions",
        }
    }

    /// From which release the gate is on by default, in words
    /// ([`gpu_dra_core::feature_gates`]).
    pub fn default_text(self) -> String {
        gpu_dra_core::feature_gates::gate(self.gate())
            .map(gpu_dra_core::feature_gates::default_text)
            .unwrap_or_else(|| "not known to this driver".into())
    }

    /// What of ours needs it, and what the node offers without it.
    pub fn fallback(self) -> &'static str {
        match self {
            Feature::ConsumableCapacity => {
                "memory shares and consumable shares are not offered: their GPUs are offered whole, one claim each"
            }
            Feature::PartitionableDevices => {
                "dynamic MIG is not offered: those GPUs are offered as they are (whole, or their existing MIG devices)"
            }
            Feature::DeviceTaints => {
                "unhealthy devices cannot be tainted: they are withheld from the ResourceSlices until healthy"
            }
            Feature::BindingConditions => "nothing this driver publishes needs it",
        }
    }

    /// The feature a slice field belongs to, by its name.
    fn of_field(key: &str) -> Option<Feature> {
        match key {
            "allowMultipleAllocations" | "requestPolicy" => Some(Feature::ConsumableCapacity),
            "sharedCounters" | "consumesCounters" => Some(Feature::PartitionableDevices),
            "taints" => Some(Feature::DeviceTaints),
            "bindingConditions" | "bindingFailureConditions" | "bindsToNode" => {
                Some(Feature::BindingConditions)
            }
            _ => None,
        }
    }
}

/// What a write sent and the server kept: the features whose fields `sent` carries, and the
/// fields the server dropped (JSON paths under `spec`), by feature (`None`: a field of no
/// feature we know).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kept {
    /// Features whose fields the slice carries.
    pub used: BTreeSet<Feature>,
    /// Dropped fields by feature.
    pub dropped: BTreeMap<Option<Feature>, Vec<String>>,
}

/// Compares the slice `sent` with what the server answered (`got`), both as JSON.
pub fn compare(sent: &Value, got: &Value) -> Kept {
    let mut kept = Kept::default();
    walk("spec", &sent["spec"], Some(&got["spec"]), None, &mut kept);
    kept
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn walk(path: &str, sent: &Value, got: Option<&Value>, feature: Option<Feature>, k: &mut Kept) {
    if is_empty(sent) {
        return;
    }
    if let Some(f) = feature {
        k.used.insert(f);
    }
    let Some(got) = got.filter(|g| !g.is_null()) else {
        k.dropped.entry(feature).or_default().push(path.to_string());
        return;
    };
    match sent {
        Value::Object(m) => {
            for (key, v) in m {
                // A field inside a feature's field belongs to that feature.
                let f = feature.or_else(|| Feature::of_field(key));
                walk(&format!("{path}.{key}"), v, got.get(key), f, k);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let name = v.get("name").and_then(Value::as_str);
                // Devices and counter sets by name (the server keeps order, but a name is
                // what a reader can find).
                let other = match name {
                    Some(n) => got
                        .as_array()
                        .and_then(|a| a.iter().find(|g| g["name"].as_str() == Some(n))),
                    None => got.get(i),
                };
                let at = match name {
                    Some(n) => format!("{path}[{n}]"),
                    None => format!("{path}[{i}]"),
                };
                walk(&at, v, other, feature, k);
            }
        }
        // Scalars: the server may spell a value otherwise (quantities); only absence counts.
        _ => {}
    }
}

/// What this process learnt of the API server's DRA features.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServedFeatures {
    /// Seen kept by the server.
    pub kept: BTreeSet<Feature>,
    /// Seen dropped, with one dropped field as evidence.
    pub missing: BTreeMap<Feature, String>,
}

impl ServedFeatures {
    /// Whether a write using `used` must be tried as a dry run first: it carries a feature
    /// this server has not been seen to keep or drop.
    pub fn needs_dry_run(&self, used: &BTreeSet<Feature>) -> bool {
        used.iter()
            .any(|f| !self.kept.contains(f) && !self.missing.contains_key(f))
    }

    /// Takes in what a write showed; returns the features newly found missing.
    pub fn learn(&mut self, kept: &Kept) -> Vec<Feature> {
        let mut newly = Vec::new();
        for f in &kept.used {
            match kept.dropped.get(&Some(*f)).and_then(|p| p.first()) {
                Some(path) => {
                    if self.missing.insert(*f, path.clone()).is_none() {
                        newly.push(*f);
                    }
                    self.kept.remove(f);
                }
                None => {
                    self.missing.remove(f);
                    self.kept.insert(*f);
                }
            }
        }
        newly
    }

    /// Whether `feature` is known to be missing.
    pub fn is_missing(&self, feature: Feature) -> bool {
        self.missing.contains_key(&feature)
    }

    /// Forgets what was learnt, so the next write that carries a feature's fields is tried
    /// as a dry run again ([`RECHECK`]). Returns whether a feature was missing (the slices
    /// are then rendered with it again, and tried).
    pub fn forget(&mut self) -> bool {
        self.kept.clear();
        let had = !self.missing.is_empty();
        self.missing.clear();
        had
    }
}

/// The message for a missing feature: what was dropped, the gate, when it is on by default,
/// and what the node offers instead.
pub fn missing_message(feature: Feature, evidence: &str, server_version: Option<&str>) -> String {
    let server = server_version
        .map(|v| format!(" (the API server is {v})"))
        .unwrap_or_default();
    format!(
        "the API server drops {evidence} from ResourceSlices: feature gate {} is off{server}; it is {}. Until it is on: {}. Turn {} on in the API server, scheduler and kubelets, or configure the driver without what needs it.",
        feature.gate(),
        feature.default_text(),
        feature.fallback(),
        feature.gate(),
    )
}

/// Where findings about the server's features go: the log, the gauge
/// `gpu_dra_api_feature_missing{feature_gate}` and a Warning Node event, each said once until
/// the feature is seen kept again.
#[derive(Clone, Default)]
pub struct Reporter {
    /// Node events (`None`: log and metric only).
    pub events: Option<Arc<dyn NodeEvents>>,
    /// The gauge family, registered by [`crate::metrics::Metrics`].
    pub missing: Family<Vec<(String, String)>, Gauge>,
    /// The features said missing.
    said: Arc<std::sync::Mutex<BTreeSet<Feature>>>,
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("events", &self.events.is_some())
            .finish_non_exhaustive()
    }
}

impl Reporter {
    /// A reporter publishing to `events` and `missing`.
    pub fn new(
        events: Option<Arc<dyn NodeEvents>>,
        missing: Family<Vec<(String, String)>, Gauge>,
    ) -> Self {
        Self {
            events,
            missing,
            said: Arc::default(),
        }
    }

    /// Says what `now` shows that was not said yet: a feature newly missing, or one said
    /// missing that the server keeps again.
    pub fn changed(&self, now: &ServedFeatures, server_version: Option<&str>) {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        for (f, evidence) in &now.missing {
            if !said.insert(*f) {
                continue;
            }
            let message = missing_message(*f, evidence, server_version);
            tracing::warn!(feature_gate = f.gate(), "{message}");
            self.gauge(*f).set(1);
            if let Some(events) = &self.events {
                events.warning("DRAFeatureMissing", message);
            }
        }
        let back: Vec<Feature> = said
            .iter()
            .filter(|f| now.kept.contains(f))
            .copied()
            .collect();
        for f in back {
            said.remove(&f);
            tracing::info!(
                feature_gate = f.gate(),
                "the API server now keeps the fields of {}: offered again",
                f.gate()
            );
            self.gauge(f).set(0);
        }
    }

    fn gauge(&self, f: Feature) -> Gauge {
        self.missing
            .get_or_create(&vec![("feature_gate".to_string(), f.gate().to_string())])
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice() -> Value {
        json!({"spec": {
        "driver": "gpu.nvidia.com",
        "sharedCounters": [{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
        "devices": [
            {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-a"}},
             "allowMultipleAllocations": true,
             "capacity": {"memory": {"value": "80Gi",
                "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Mi"}}}},
             "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}]},
            {"name": "gpu-1-mig-1g", "consumesCounters": [{"counterSet": "gpu-0-counters",
                "counters": {"memory": {"value": "10Gi"}}}]},
        ]}})
    }

    #[test]
    fn a_server_that_keeps_everything_drops_nothing() {
        let kept = compare(&slice(), &slice());
        assert!(kept.dropped.is_empty(), "{kept:?}");
        assert_eq!(
            kept.used,
            BTreeSet::from([
                Feature::ConsumableCapacity,
                Feature::PartitionableDevices,
                Feature::DeviceTaints
            ])
        );
    }

    #[test]
    fn each_dropped_field_is_put_on_its_feature() {
        let mut got = slice();
        let spec = got["spec"].as_object_mut().unwrap();
        spec.remove("sharedCounters");
        let d0 = spec["devices"][0].as_object_mut().unwrap();
        d0.remove("allowMultipleAllocations");
        d0.remove("taints");
        d0["capacity"]["memory"]
            .as_object_mut()
            .unwrap()
            .remove("requestPolicy");
        spec["devices"][1]
            .as_object_mut()
            .unwrap()
            .remove("consumesCounters");
        // The server spells a quantity otherwise: not a drop.
        spec["devices"][0]["capacity"]["memory"]["value"] = json!("85899345920");
        let kept = compare(&slice(), &got);
        assert_eq!(
            kept.dropped,
            BTreeMap::from([
                (
                    Some(Feature::ConsumableCapacity),
                    vec![
                        "spec.devices[gpu-0].allowMultipleAllocations".to_string(),
                        "spec.devices[gpu-0].capacity.memory.requestPolicy".to_string()
                    ]
                ),
                (
                    Some(Feature::PartitionableDevices),
                    vec![
                        "spec.sharedCounters".to_string(),
                        "spec.devices[gpu-1-mig-1g].consumesCounters".to_string()
                    ]
                ),
                (
                    Some(Feature::DeviceTaints),
                    vec!["spec.devices[gpu-0].taints".to_string()]
                ),
            ])
        );
    }

    #[test]
    fn a_dropped_field_of_no_known_feature_is_reported_apart() {
        let mut got = slice();
        got["spec"]["devices"][0]
            .as_object_mut()
            .unwrap()
            .remove("attributes");
        let kept = compare(&slice(), &got);
        assert_eq!(
            kept.dropped.get(&None),
            Some(&vec!["spec.devices[gpu-0].attributes".to_string()])
        );
    }

    #[test]
    fn a_feature_is_dry_run_until_the_server_was_seen_to_keep_or_drop_it() {
        let mut served = ServedFeatures::default();
        let used = BTreeSet::from([Feature::DeviceTaints]);
        assert!(served.needs_dry_run(&used));
        let mut got = slice();
        got["spec"]["devices"][0]
            .as_object_mut()
            .unwrap()
            .remove("taints");
        assert_eq!(
            served.learn(&compare(&slice(), &got)),
            vec![Feature::DeviceTaints]
        );
        assert!(served.is_missing(Feature::DeviceTaints));
        assert!(!served.needs_dry_run(&used));
        assert!(
            served.learn(&compare(&slice(), &got)).is_empty(),
            "said once"
        );
        // Kept later (the gate turned on): no longer missing.
        served.learn(&compare(&slice(), &slice()));
        assert!(!served.is_missing(Feature::DeviceTaints));
        assert!(served.kept.contains(&Feature::DeviceTaints));
    }

    #[test]
    fn every_feature_has_its_gate_in_the_drivers_table() {
        for f in Feature::ALL {
            assert!(
                gpu_dra_core::feature_gates::gate(f.gate()).is_some(),
                "{}",
                f.gate()
            );
        }
    }

    #[test]
    fn the_message_names_the_gate_the_release_and_the_fallback() {
        let m = missing_message(
            Feature::ConsumableCapacity,
            "spec.devices[gpu-0].allowMultipleAllocations",
            Some("v1.35.2"),
        );
        assert!(m.contains("DRAConsumableCapacity is off (the API server is v1.35.2)"));
        assert!(m.contains("on by default from Kubernetes 1.36"));
        assert!(m.contains("offered whole"));
    }

    #[test]
    fn a_recheck_tries_again_without_saying_it_again_and_a_gate_turned_on_is_said() {
        let events = Arc::new(crate::node_events::RecordedEvents::default());
        let reporter = Reporter::new(Some(events.clone()), Family::default());
        let gauge = |r: &Reporter| r.gauge(Feature::DeviceTaints).get();
        let mut got = slice();
        got["spec"]["devices"][0]
            .as_object_mut()
            .unwrap()
            .remove("taints");
        let mut served = ServedFeatures::default();
        served.learn(&compare(&slice(), &got));
        reporter.changed(&served, None);
        assert_eq!((events.taken().len(), gauge(&reporter)), (1, 1));

        // The recheck: tried again (a dry run), still dropped, not said again.
        assert!(served.forget());
        assert!(served.needs_dry_run(&BTreeSet::from([Feature::DeviceTaints])));
        served.learn(&compare(&slice(), &got));
        reporter.changed(&served, None);
        assert_eq!((events.taken().len(), gauge(&reporter)), (1, 1));

        // Turned on: kept, the gauge back to 0; dropped again later is said again.
        served.forget();
        served.learn(&compare(&slice(), &slice()));
        reporter.changed(&served, None);
        assert_eq!(gauge(&reporter), 0);
        served.learn(&compare(&slice(), &got));
        reporter.changed(&served, None);
        assert_eq!((events.taken().len(), gauge(&reporter)), (2, 1));
    }
}
