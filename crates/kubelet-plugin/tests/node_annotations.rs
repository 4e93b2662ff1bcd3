//! The Node's partitioning annotations, changed on a running node, against the fake API server
//! (through kube's real client): the publisher applies them within seconds with no other
//! trigger (no rediscovery, no slice change), and ignores every other change of the Node.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod fake_api;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_api::FakeApi;
use gpu_dra_core::health::HealthPolicy;
use gpu_dra_core::partitioning::{GpuSelection, MEMORY_SHARE_ANNOTATION};
use gpu_dra_device::fixture::FixtureInventory;
use gpu_dra_device::testing::h100_inventory;
use gpu_dra_kubelet_plugin::inventory::LiveInventory;
use gpu_dra_kubelet_plugin::publish::{self, PublisherConfig};
use serde_json::{Value, json};

const NODES: &str = "/api/v1/nodes";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

/// Whether every device of the published slices is a memory-share GPU (`shared`) or none is.
fn published_as_shares(api: &FakeApi, shared: bool) -> bool {
    let slices = api.list(SLICES);
    let devices: Vec<&Value> = slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect();
    !devices.is_empty()
        && devices
            .iter()
            .all(|d| (d["allowMultipleAllocations"] == json!(true)) == shared)
}

async fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while start.elapsed() < within {
        if f() {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not within {within:?}: {what}");
}

fn node_reads(api: &FakeApi) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/nodes/node-a?"))
        .count()
}

#[tokio::test]
async fn an_annotation_set_on_a_running_node_is_applied_within_seconds() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("gpu_dra_kubelet_plugin=debug")
        .try_init();
    let api = FakeApi::new();
    api.collection(NODES, "v1", "Node")
        .collection(SLICES, "resource.k8s.io/v1", "ResourceSlice");
    api.put(
        NODES,
        json!({"metadata": {"name": "node-a", "uid": "node-uid-1", "labels": {}}}),
    );
    let live = LiveInventory::discover(
        Arc::new(FixtureInventory::new(h100_inventory(2))),
        HealthPolicy::new("gpu.nvidia.com"),
    )
    .unwrap();
    let mut config = PublisherConfig::new("node-a", "gpu.nvidia.com");
    // Nothing else would make the publisher look again.
    config.rediscover_interval = Duration::from_secs(3600);
    config.backoff_initial = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(publish::run(api.client(), config, live.clone(), async {
        let _ = stop_rx.await;
    }));

    wait_until(
        "the first publication, static",
        Duration::from_secs(10),
        || published_as_shares(&api, false),
    )
    .await;
    assert_eq!(live.partitioning().memory_shares, GpuSelection::None);
    // Settled: the publisher's own writes and reads are done.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Another change of the Node (the kubelet's status, a label): nothing is read or written.
    let reads = node_reads(&api);
    let slices = api.list(SLICES);
    api.mutate(NODES, "node-a", |n| {
        n["metadata"]["labels"]["example.com/x"] = json!("1");
        n["status"] = json!({"conditions": [{"type": "Ready", "status": "True"}]});
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        node_reads(&api),
        reads,
        "a Node change of no interest was acted on"
    );
    assert_eq!(api.list(SLICES), slices);

    // The admin marks every GPU as memory shares: republished so, and the live inventory
    // (which prepare and the driver read) has it, with no other trigger.
    api.mutate(NODES, "node-a", |n| {
        n["metadata"]["annotations"] = json!({MEMORY_SHARE_ANNOTATION: "all"});
    });
    let took = wait_until(
        "the annotation applied: devices published as memory shares",
        Duration::from_secs(5),
        || published_as_shares(&api, true),
    )
    .await;
    eprintln!("annotation applied in {took:?}");
    assert_eq!(live.partitioning().memory_shares, GpuSelection::All);

    // And removed again: back to static.
    api.mutate(NODES, "node-a", |n| {
        n["metadata"]["annotations"] = json!({});
    });
    wait_until(
        "the annotation's removal applied",
        Duration::from_secs(5),
        || published_as_shares(&api, false),
    )
    .await;
    assert_eq!(live.partitioning().memory_shares, GpuSelection::None);

    stop_tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
}
