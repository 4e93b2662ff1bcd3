//! The Grafana dashboards in `deploy/grafana/`: every PromQL query (a panel's `expr`, a
//! variable's `query`) names only series the node plugin exports, as its registry renders
//! them, so a renamed or removed series breaks this test instead of a dashboard.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The plugin's metrics with a series in every family the dashboards may use (a family
/// without series is not rendered): the request series and one claim with every usage figure.
fn populated() -> gpu_dra_kubelet_plugin::metrics::Metrics {
    use gpu_dra_kubelet_plugin::metrics::{Metrics, Operation};
    use gpu_dra_kubelet_plugin::usage::{ClaimDevice, ClaimDeviceUsage, PodUsage};
    let m = Metrics::default();
    m.observe("prepare", 0.01, false);
    m.nvidia.identify("gpu.nvidia.com", "n");
    m.nvidia.begin(Operation::Prepare).finish(false);
    m.nvidia.begin(Operation::Unprepare).finish(false);
    let device = ClaimDevice {
        claim_uid: "u".into(),
        namespace: "ns".into(),
        name: "c".into(),
        device: "gpu-0".into(),
        pool: "n".into(),
        uuid: "GPU-0".into(),
        strategy: "MPS".into(),
        share_bytes: Some(1),
        mig_profile: String::new(),
        admin_access: false,
    };
    let usage = ClaimDeviceUsage {
        device,
        allocated_bytes: Some(2),
        device_utilization_percent: Some(3),
        pods: vec![PodUsage {
            pod: "p".into(),
            container: "c".into(),
            used_bytes: Some(1),
            sm_percent: Some(4),
            processes: 1,
        }],
        active: true,
    };
    let last = std::collections::HashMap::from([(("u".to_string(), "GPU-0".to_string()), 5)]);
    let mut history = gpu_dra_kubelet_plugin::usage::history::History::default();
    history.record(std::slice::from_ref(&usage), 5);
    m.usage.publish(&[usage], &last, &history);
    m
}

/// Every series name the plugin exports: the families its registry declares (`# TYPE`), with
/// the sample suffixes of counters and histograms.
fn exported() -> BTreeSet<String> {
    let text = populated().render();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        out.insert(name.to_owned());
        match kind {
            "counter" => {
                out.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            _ => {}
        }
    }
    out
}

/// The PromQL strings of a dashboard: string values of `expr` and `query` keys.
fn queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query", Value::String(s)) => out.push(s.clone()),
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

/// The metric names a PromQL expression uses: identifiers of our families' prefixes outside
/// quoted strings.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut quoted = false;
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            quoted = !quoted;
            word.clear();
            continue;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
            continue;
        }
        if word.starts_with("gpu_dra_") || word.starts_with("nvidia_dra_") {
            out.push(word.clone());
        }
        word.clear();
    }
    out
}

#[test]
fn metric_names_are_found_outside_strings() {
    assert_eq!(
        metric_names(r#"sum by (ns) (gpu_dra_a{x="gpu_dra_b"}) / nvidia_dra_c[5m]"#),
        ["gpu_dra_a", "nvidia_dra_c"]
    );
}

#[test]
fn every_dashboard_query_names_only_exported_series() {
    let exported = exported();
    assert!(
        exported.contains("gpu_dra_claim_memory_used_bytes"),
        "{exported:?}"
    );
    let dir = repo().join("deploy/grafana");
    let mut dashboards = 0;
    for entry in std::fs::read_dir(&dir).expect("deploy/grafana") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        dashboards += 1;
        let text = std::fs::read_to_string(&path).expect("read");
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
        let mut exprs = Vec::new();
        queries(&json, &mut exprs);
        let named: Vec<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
        assert!(
            named.len() >= exprs.len() / 2,
            "{}: most queries name none of our series: {exprs:?}",
            path.display()
        );
        for expr in &exprs {
            for name in metric_names(expr) {
                assert!(
                    exported.contains(&name),
                    "{}: query {expr:?} names {name}, which the plugin does not export",
                    path.display()
                );
            }
        }
    }
    assert!(dashboards > 0, "no dashboard in {}", dir.display());
}
