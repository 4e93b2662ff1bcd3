//! The publisher against an in-memory API server: initial publication, restoring deleted and
//! edited slices, republishing on inventory change, and retrying failed writes.
//!
//! The fake speaks just enough of the Kubernetes REST protocol (GET node; list, watch, create,
//! replace, delete ResourceSlices) for kube's client and watcher. Real API-server acceptance of
//! the objects is proven in e2e.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_dra_core::health::HealthPolicy;
use gpu_dra_device::fixture::FixtureInventory;
use gpu_dra_device::testing::h100_inventory as inventory;
use gpu_dra_kubelet_plugin::inventory::LiveInventory;
use gpu_dra_kubelet_plugin::publish::{self, PublishStatus, PublisherConfig};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use serde_json::{Value, json};
use tokio::sync::{Notify, broadcast, watch};

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

#[derive(Default)]
struct Store {
    slices: BTreeMap<String, Value>,
    rv: u64,
    writes: u64,
    fail_writes: u32,
}

#[derive(Clone)]
struct Fake {
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<String>,
}

type Body = BoxBody<Bytes, Infallible>;

fn reply(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("response")
}

fn status(code: u16, reason: &str) -> Response<Body> {
    reply(
        StatusCode::from_u16(code).expect("code"),
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": reason, "reason": reason, "code": code}),
    )
}

impl Fake {
    fn new() -> Self {
        Self {
            store: Arc::new(Mutex::new(Store::default())),
            events: broadcast::channel(1024).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().expect("store lock")
    }

    /// Mutates the store as a third party would, emitting the watch event.
    fn mutate(&self, name: &str, f: impl FnOnce(&mut Value)) {
        let mut s = self.lock();
        s.rv += 1;
        let rv = s.rv.to_string();
        let obj = s.slices.get_mut(name).expect("slice exists");
        f(obj);
        obj["metadata"]["resourceVersion"] = json!(rv);
        let event = json!({"type": "MODIFIED", "object": obj}).to_string();
        drop(s);
        let _ = self.events.send(event);
    }

    fn remove(&self, name: &str) {
        let obj = self.lock().slices.remove(name).expect("slice exists");
        let _ = self
            .events
            .send(json!({"type": "DELETED", "object": obj}).to_string());
    }

    fn snapshot(&self) -> Vec<Value> {
        self.lock().slices.values().cloned().collect()
    }

    async fn handle(self, req: Request<kube::client::Body>) -> Result<Response<Body>, Infallible> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or_default().to_string();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let input: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let name = path.strip_prefix(SLICES).and_then(|p| p.strip_prefix('/'));
        let resp = match (method.as_str(), path.as_str(), name) {
            ("GET", "/api/v1/nodes/node-a", _) => reply(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": "node-a", "uid": "node-uid-1", "resourceVersion": "1"}}),
            ),
            ("GET", SLICES, None) if query.contains("watch=true") => {
                let rx = self.events.subscribe();
                let stream = futures::stream::unfold(rx, |mut rx| async move {
                    loop {
                        match rx.recv().await {
                            Ok(line) => {
                                let frame = Frame::data(Bytes::from(line + "\n"));
                                return Some((Ok::<_, Infallible>(frame), rx));
                            }
                            Err(broadcast::error::RecvError::Lagged(_)) => continue,
                            Err(broadcast::error::RecvError::Closed) => return None,
                        }
                    }
                });
                Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(BodyExt::boxed(StreamBody::new(stream)))
                    .expect("response")
            }
            ("GET", SLICES, None) => {
                let s = self.lock();
                let items: Vec<&Value> = s.slices.values().collect();
                reply(
                    StatusCode::OK,
                    &json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                            "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
                )
            }
            ("POST", SLICES, None) => self.write(None, input),
            ("PUT", _, Some(n)) => self.write(Some(n), input),
            ("DELETE", _, Some(n)) => {
                let removed = self.lock().slices.remove(n);
                match removed {
                    Some(obj) => {
                        self.lock().writes += 1;
                        let _ = self
                            .events
                            .send(json!({"type": "DELETED", "object": obj}).to_string());
                        reply(StatusCode::OK, &obj)
                    }
                    None => status(404, "NotFound"),
                }
            }
            _ => status(404, "NotFound"),
        };
        Ok(resp)
    }

    fn write(&self, replace: Option<&str>, mut obj: Value) -> Response<Body> {
        let mut s = self.lock();
        if s.fail_writes > 0 {
            s.fail_writes -= 1;
            return status(500, "InternalError");
        }
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let existing = s.slices.get(&name).cloned();
        match (replace, existing) {
            (None, Some(_)) => return status(409, "AlreadyExists"),
            (Some(_), None) => return status(404, "NotFound"),
            (Some(_), Some(old))
                if old["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"] =>
            {
                return status(409, "Conflict");
            }
            _ => {}
        }
        s.rv += 1;
        s.writes += 1;
        obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        obj["metadata"]["uid"] = json!(format!("uid-{name}"));
        obj["apiVersion"] = json!("resource.k8s.io/v1");
        obj["kind"] = json!("ResourceSlice");
        s.slices.insert(name, obj.clone());
        let kind = if replace.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        drop(s);
        let _ = self
            .events
            .send(json!({"type": kind, "object": obj}).to_string());
        reply(
            if replace.is_some() {
                StatusCode::OK
            } else {
                StatusCode::CREATED
            },
            &obj,
        )
    }
}

/// Waits until `cond` holds for the store's slices (up to 10 s).
async fn wait_for(fake: &Fake, what: &str, cond: impl Fn(&[Value]) -> bool) {
    for _ in 0..1000 {
        let snap = fake.snapshot();
        if cond(&snap) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "timed out waiting for {what}; slices: {:#?}",
        fake.snapshot()
    );
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
    let fake = Fake::new();
    let handler = fake.clone();
    let service = tower::service_fn(move |req| handler.clone().handle(req));
    let client = kube::Client::new(service, "default");

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
    wait_for(&fake, "first publication", |s| {
        s.len() == 1 && device_count(s) == 2
    })
    .await;
    let s = &fake.snapshot()[0];
    assert_eq!(s["metadata"]["name"], "node-a-gpu-nvidia-com-0");
    assert_eq!(s["metadata"]["ownerReferences"][0]["uid"], "node-uid-1");
    assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "Node");
    assert_eq!(s["spec"]["pool"]["generation"], 1);
    assert_eq!(s["spec"]["nodeName"], "node-a");

    // Converged: our own write events do not cause more writes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writes = fake.lock().writes;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fake.lock().writes, writes, "publisher keeps writing");

    // Someone deletes our only slice: restored (the pool was gone, so with a new generation).
    fake.remove("node-a-gpu-nvidia-com-0");
    wait_for(&fake, "restored slice", |s| s.len() == 1).await;
    assert_eq!(generations(&fake.snapshot()), [2]);

    // Someone edits it: rewritten, with a new generation.
    fake.mutate("node-a-gpu-nvidia-com-0", |o| {
        o["spec"]["devices"][0]["name"] = json!("gpu-99");
    });
    wait_for(&fake, "repaired slice", |s| {
        s.len() == 1 && s[0]["spec"]["devices"][0]["name"] == "gpu-0" && generations(s) == [3]
    })
    .await;

    // The inventory grows past one slice: two slices, one new generation.
    fixture.set(inventory(130));
    refresh.notify_one();
    wait_for(&fake, "two slices", |s| {
        s.len() == 2 && generations(s) == [4, 4]
    })
    .await;
    assert_eq!(device_count(&fake.snapshot()), 130);

    // One of two slices deleted: restored at the same generation, the other one untouched.
    let untouched = fake.snapshot()[0]["metadata"]["resourceVersion"].clone();
    fake.remove("node-a-gpu-nvidia-com-1");
    wait_for(&fake, "restored second slice", |s| s.len() == 2).await;
    assert_eq!(generations(&fake.snapshot()), [4, 4]);
    assert_eq!(fake.snapshot()[0]["metadata"]["resourceVersion"], untouched);

    // Writes fail for a while: retried with backoff until they succeed.
    fake.lock().fail_writes = 3;
    fixture.set(inventory(1));
    refresh.notify_one();
    wait_for(&fake, "shrunk pool", |s| {
        s.len() == 1 && generations(s) == [5]
    })
    .await;
    assert_eq!(fake.snapshot()[0]["spec"]["pool"]["resourceSliceCount"], 1);
    let st = status_rx.borrow().clone();
    assert!(st.in_sync, "{st:?}");
    assert_eq!(st.generation, 5);
    assert_eq!(st.devices, 1);

    // A failing discovery keeps what is published.
    fixture.fail("driver unloaded");
    refresh.notify_one();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(generations(&fake.snapshot()), [5]);
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
    assert_eq!(fake.snapshot().len(), 1);
}
