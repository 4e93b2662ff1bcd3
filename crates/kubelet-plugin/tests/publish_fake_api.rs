//! The publisher against an in-memory API server (`fake_api`): initial publication, restoring
//! deleted and edited slices, republishing on inventory change, and retrying failed writes.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod fake_api;

use std::sync::Arc;
use std::time::Duration;

use fake_api::FakeApi;
use gpu_dra_core::health::HealthPolicy;
use gpu_dra_device::fixture::FixtureInventory;
use gpu_dra_device::testing::h100_inventory as inventory;
use gpu_dra_kubelet_plugin::inventory::LiveInventory;
use gpu_dra_kubelet_plugin::publish::{self, PublishStatus, PublisherConfig};
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};

const NODES: &str = "/api/v1/nodes";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

/// A server with Node `node-a` and no slices.
fn fake() -> FakeApi {
    let api = FakeApi::new();
    api.collection(NODES, "v1", "Node")
        .collection(SLICES, "resource.k8s.io/v1", "ResourceSlice");
    api.put(
        NODES,
        json!({"metadata": {"name": "node-a", "uid": "node-uid-1"}}),
    );
    api
}

fn generations(slices: &[Value]) -> Vec<i64> {
    slices
        .iter()
        .map(|s| s["spec"]["pool"]["generation"].as_i64().unwrap_or(-1))
        .collect()
}

fn device_count(slices: &[Value]) -> usize {
    slices
        .iter()
        .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
        .sum()
}

#[tokio::test]
async fn publisher_publishes_restores_and_republishes() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("gpu_dra_kubelet_plugin=debug")
        .try_init();
    let fake = fake();
    let client = fake.client();

    let fixture = Arc::new(FixtureInventory::new(inventory(2)));
    let refresh = Arc::new(Notify::new());
    let (status_tx, status_rx) = watch::channel(PublishStatus::default());
    let mut config = PublisherConfig::new("node-a", "gpu.nvidia.com");
    config.rediscover_interval = Duration::from_secs(3600);
    config.backoff_initial = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    config.refresh = Some(Arc::clone(&refresh));
    config.status = Some(status_tx);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let live = LiveInventory::discover(fixture.clone(), HealthPolicy::new("gpu.nvidia.com"))
        .expect("first discovery");
    let task = tokio::spawn(publish::run(client, config, live, async {
        let _ = stop_rx.await;
    }));

    // Initial publication: one slice, generation 1, owned by the Node.
    fake.wait_for(SLICES, "first publication", |s| {
        s.len() == 1 && device_count(s) == 2
    })
    .await;
    let s = &fake.list(SLICES)[0];
    assert_eq!(s["metadata"]["name"], "node-a-gpu-nvidia-com-0");
    assert_eq!(s["metadata"]["ownerReferences"][0]["uid"], "node-uid-1");
    assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "Node");
    assert_eq!(s["spec"]["pool"]["generation"], 1);
    assert_eq!(s["spec"]["nodeName"], "node-a");

    // Converged: our own write events do not cause more writes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writes = fake.writes();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fake.writes(), writes, "publisher keeps writing");

    // Someone deletes our only slice: restored (the pool was gone, so with a new generation).
    fake.remove(SLICES, "node-a-gpu-nvidia-com-0");
    fake.wait_for(SLICES, "restored slice", |s| s.len() == 1)
        .await;
    assert_eq!(generations(&fake.list(SLICES)), [2]);

    // Someone edits it: rewritten, with a new generation.
    fake.mutate(SLICES, "node-a-gpu-nvidia-com-0", |o| {
        o["spec"]["devices"][0]["name"] = json!("gpu-99");
    });
    fake.wait_for(SLICES, "repaired slice", |s| {
        s.len() == 1 && s[0]["spec"]["devices"][0]["name"] == "gpu-0" && generations(s) == [3]
    })
    .await;

    // The inventory grows past one slice: two slices, one new generation.
    fixture.set(inventory(130));
    refresh.notify_one();
    fake.wait_for(SLICES, "two slices", |s| {
        s.len() == 2 && generations(s) == [4, 4]
    })
    .await;
    assert_eq!(device_count(&fake.list(SLICES)), 130);

    // One of two slices deleted: restored at the same generation, the other one untouched.
    let untouched = fake.list(SLICES)[0]["metadata"]["resourceVersion"].clone();
    fake.remove(SLICES, "node-a-gpu-nvidia-com-1");
    fake.wait_for(SLICES, "restored second slice", |s| s.len() == 2)
        .await;
    assert_eq!(generations(&fake.list(SLICES)), [4, 4]);
    assert_eq!(
        fake.list(SLICES)[0]["metadata"]["resourceVersion"],
        untouched
    );

    // Writes fail for a while: retried with backoff until they succeed.
    fake.fail_writes(3);
    fixture.set(inventory(1));
    refresh.notify_one();
    fake.wait_for(SLICES, "shrunk pool", |s| {
        s.len() == 1 && generations(s) == [5]
    })
    .await;
    assert_eq!(
        fake.list(SLICES)[0]["spec"]["pool"]["resourceSliceCount"],
        1
    );
    let st = status_rx.borrow().clone();
    assert!(st.in_sync, "{st:?}");
    assert_eq!(st.generation, 5);
    assert_eq!(st.devices, 1);

    // A failing discovery keeps what is published.
    fixture.fail("driver unloaded");
    refresh.notify_one();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(generations(&fake.list(SLICES)), [5]);
    assert!(
        status_rx
            .borrow()
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("driver unloaded"))
    );

    stop_tx.send(()).expect("publisher running");
    let result = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("publisher stops on shutdown")
        .expect("task joined");
    assert!(result.is_ok(), "{result:?}");
    // Slices stay on shutdown (a restarting plugin keeps its devices schedulable).
    assert_eq!(fake.list(SLICES).len(), 1);
}

/// With `list_attributes`, what reaches the server carries the list values (not the typed
/// client's empty placeholders), and the publisher converges on them.
#[tokio::test]
async fn list_type_attributes_reach_the_server_and_converge() {
    use gpu_dra_device::testing::h100;
    let fake = fake();
    let (u0, u1) = (h100(0).build().uuid, h100(1).build().uuid);
    let inv = gpu_dra_device::testing::inventory([
        h100(0).nvlink_peers(&[&u1]).build(),
        h100(1).nvlink_peers(&[&u0]).build(),
        h100(2).build(),
    ]);
    let fixture = Arc::new(FixtureInventory::new(inv));
    let mut config = PublisherConfig::new("node-a", "gpu.nvidia.com");
    config.rediscover_interval = Duration::from_secs(3600);
    config.backoff_initial = Duration::from_millis(20);
    config.list_attributes = true;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let live = LiveInventory::discover(fixture, HealthPolicy::new("gpu.nvidia.com"))
        .expect("first discovery");
    let task = tokio::spawn(publish::run(fake.client(), config, live, async {
        let _ = stop_rx.await;
    }));
    fake.wait_for(SLICES, "first publication", |s| {
        s.len() == 1 && device_count(s) == 3
    })
    .await;
    let devices = fake.list(SLICES)[0]["spec"]["devices"].clone();
    let attr = |d: usize, key: &str| devices[d]["attributes"][key].clone();
    let domain = attr(0, "nvlinkDomain");
    assert_eq!(
        domain["strings"].as_array().map(Vec::len),
        Some(1),
        "{domain}"
    );
    assert_eq!(attr(1, "nvlinkDomain"), domain);
    assert!(attr(2, "nvlinkDomain").is_null());
    assert_eq!(
        attr(2, "resource.kubernetes.io/numaNode"),
        json!({"ints": [0]})
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writes = fake.writes();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fake.writes(), writes, "publisher keeps writing");
    stop_tx.send(()).expect("publisher running");
    let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
}
