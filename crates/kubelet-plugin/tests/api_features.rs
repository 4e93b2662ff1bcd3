//! The publisher against API servers with DRA feature gates off (`fake_api` dropping the
//! fields of the disabled feature, as a real server does): nothing is written that the
//! server would strip, the node offers what it can without the feature, and says so (log,
//! metric, Node event).

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod fake_api;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fake_api::FakeApi;
use gpu_dra_core::health::HealthPolicy;
use gpu_dra_core::partitioning::{GpuSelection, Partitioning};
use gpu_dra_device::fixture::FixtureInventory;
use gpu_dra_device::testing::h100_inventory as inventory;
use gpu_dra_device::{HealthEvent, HealthObservation};
use gpu_dra_kubelet_plugin::inventory::LiveInventory;
use gpu_dra_kubelet_plugin::node_events::RecordedEvents;
use gpu_dra_kubelet_plugin::publish::{self, PublisherConfig, features};
use serde_json::{Value, json};

const NODES: &str = "/api/v1/nodes";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

/// A node's publisher against `api`, with memory shares on every GPU when `shares`.
struct Publisher {
    live: Arc<LiveInventory>,
    events: Arc<RecordedEvents>,
    reporter: features::Reporter,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), publish::PublishError>>,
}

impl Publisher {
    fn start(api: &FakeApi, shares: bool) -> Publisher {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("gpu_dra_kubelet_plugin=debug")
            .try_init();
        let fixture = Arc::new(FixtureInventory::new(inventory(2)));
        let mut config = PublisherConfig::new("node-a", "gpu.nvidia.com");
        config.rediscover_interval = Duration::from_secs(3600);
        config.backoff_initial = Duration::from_millis(20);
        config.backoff_max = Duration::from_millis(200);
        if shares {
            config.partitioning = Partitioning {
                memory_shares: GpuSelection::All,
                ..Partitioning::default()
            };
        }
        let events = Arc::new(RecordedEvents::default());
        let reporter = features::Reporter::new(Some(events.clone()), Default::default());
        config.features = reporter.clone();
        let live = LiveInventory::discover(fixture, HealthPolicy::new("gpu.nvidia.com")).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(publish::run(api.client(), config, live.clone(), async {
            let _ = stopped.await;
        }));
        Publisher {
            live,
            events,
            reporter,
            stop: Some(stop),
            task,
        }
    }

    fn missing(&self, gate: &str) -> i64 {
        self.reporter
            .missing
            .get_or_create(&vec![("feature_gate".to_string(), gate.to_string())])
            .get()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// A server with Node `node-a`, answering its version, that drops `fields` from every device
/// of a slice written (dry runs too) and records, per write, whether it had any.
fn server(fields: &'static [&'static str]) -> (FakeApi, Arc<Mutex<Vec<bool>>>) {
    let api = FakeApi::new();
    api.collection(NODES, "v1", "Node")
        .collection(SLICES, "resource.k8s.io/v1", "ResourceSlice");
    api.put(
        NODES,
        json!({"metadata": {"name": "node-a", "uid": "node-uid-1"}}),
    );
    api.set_version("v1.35.2");
    let had = Arc::new(Mutex::new(Vec::new()));
    let seen = had.clone();
    api.on_write(move |obj: &mut Value| {
        let mut found = false;
        for d in obj["spec"]["devices"].as_array_mut().into_iter().flatten() {
            let d = d.as_object_mut().unwrap();
            for f in fields {
                found |= d.remove(*f).is_some();
            }
            for c in d
                .get_mut("capacity")
                .and_then(Value::as_object_mut)
                .into_iter()
                .flat_map(|c| c.values_mut())
            {
                for f in fields {
                    found |= c.as_object_mut().unwrap().remove(*f).is_some();
                }
            }
        }
        seen.lock().unwrap().push(found);
    });
    (api, had)
}

/// Whether each write to the slices (create or replace) was a dry run, in order.
fn slice_writes(api: &FakeApi) -> Vec<bool> {
    api.requests()
        .iter()
        .filter(|r| (r.starts_with("POST ") || r.starts_with("PUT ")) && r.contains(SLICES))
        .map(|r| r.contains("dryRun=All"))
        .collect()
}

fn devices(slices: &[Value]) -> Vec<Value> {
    slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn without_consumable_capacity_memory_share_gpus_are_offered_whole_and_nothing_is_stripped() {
    let (api, had) = server(&["allowMultipleAllocations", "requestPolicy"]);
    let publisher = Publisher::start(&api, true);
    api.wait_for(SLICES, "the slice", |s| devices(s).len() == 2)
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // One dry run showed the drop; the real write carried nothing the server strips.
    let writes = slice_writes(&api);
    assert_eq!(writes, vec![true, false], "dry run, then the write");
    assert_eq!(*had.lock().unwrap(), vec![true, false]);
    for d in devices(&api.list(SLICES)) {
        assert!(d.get("allowMultipleAllocations").is_none(), "{d}");
    }
    // Prepare agrees with what is offered: no memory shares.
    assert_eq!(
        publisher.live.partitioning().memory_shares,
        GpuSelection::None
    );

    assert_eq!(publisher.missing("DRAConsumableCapacity"), 1);
    assert_eq!(publisher.missing("DRADeviceTaints"), 0);
    let events = publisher.events.taken();
    assert_eq!(events.len(), 1, "{events:?}");
    let (reason, note) = &events[0];
    assert_eq!(reason, "DRAFeatureMissing");
    for part in [
        "allowMultipleAllocations",
        "DRAConsumableCapacity is off (the API server is v1.35.2)",
        "on by default from Kubernetes 1.36",
        "offered whole",
    ] {
        assert!(note.contains(part), "{part:?} not in {note}");
    }

    // A slice deleted by someone: restored without another dry run, still without shares.
    api.remove(SLICES, "node-a-gpu-nvidia-com-0");
    api.wait_for(SLICES, "the restored slice", |s| devices(s).len() == 2)
        .await;
    assert_eq!(slice_writes(&api), vec![true, false, false]);
    assert_eq!(publisher.events.taken().len(), 1, "said once");
    publisher.stop().await;
}

#[tokio::test]
async fn without_device_taints_an_unhealthy_gpu_is_withheld() {
    let (api, had) = server(&["taints"]);
    let publisher = Publisher::start(&api, false);
    api.wait_for(SLICES, "the slice", |s| devices(s).len() == 2)
        .await;
    // Nothing of a feature written yet: no dry run.
    assert_eq!(slice_writes(&api), vec![false]);

    let uuid = publisher.live.current().gpus[0].uuid.clone();
    publisher.live.observe(&HealthObservation::Event {
        gpu_uuid: uuid,
        event: HealthEvent::Xid(79),
        instance: None,
    });
    api.wait_for(SLICES, "gpu-0 withheld", |s| {
        let d = devices(s);
        d.len() == 1 && d[0]["name"] == "gpu-1"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(slice_writes(&api), vec![false, true, false]);
    assert_eq!(*had.lock().unwrap(), vec![false, true, false]);
    assert_eq!(publisher.missing("DRADeviceTaints"), 1);
    let events = publisher.events.taken();
    assert!(
        events.len() == 1
            && events[0].1.contains("DRADeviceTaints")
            && events[0].1.contains("withheld"),
        "{events:?}"
    );
    publisher.stop().await;
}

#[tokio::test]
async fn a_server_that_keeps_the_fields_is_dry_run_once_and_gets_them() {
    let (api, had) = server(&[]);
    let publisher = Publisher::start(&api, true);
    api.wait_for(SLICES, "the slice", |s| devices(s).len() == 2)
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(slice_writes(&api), vec![true, false]);
    assert!(had.lock().unwrap().iter().all(|h| !h));
    assert!(
        devices(&api.list(SLICES))
            .iter()
            .all(|d| d["allowMultipleAllocations"] == json!(true))
    );
    assert_eq!(publisher.missing("DRAConsumableCapacity"), 0);
    assert!(publisher.events.taken().is_empty());
    api.remove(SLICES, "node-a-gpu-nvidia-com-0");
    api.wait_for(SLICES, "the restored slice", |s| devices(s).len() == 2)
        .await;
    assert_eq!(slice_writes(&api), vec![true, false, false], "learnt once");
    publisher.stop().await;
}
