//! An in-memory Kubernetes API server for tests, reached through kube's real client (so every
//! HTTP request the plugin makes is seen and counted here).
//!
//! It speaks just enough of the REST protocol for kube's client and watcher on the collections
//! a test registers: get, list, watch (replaying the events after the `resourceVersion` asked
//! for, then live ones), create, replace and delete; label and field selectors of the form
//! `key=value,...`. A test changes objects as a third party would ([`FakeApi::mutate`],
//! [`FakeApi::remove`]), stands in for the kubelet with hooks on create and delete, takes the
//! server down ([`FakeApi::set_down`]: every request fails with 503 and open watches end) and
//! forgets its event history ([`FakeApi::compact`]: a watch from before then is told 410
//! Expired, as etcd's compaction makes a real one, and the client must list again).
//! Real API-server acceptance of the objects is proven in e2e.

// Helpers of tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};

use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use serde_json::{Value, json};
use tokio::sync::broadcast;

type Body = BoxBody<Bytes, Infallible>;
type Hook = Arc<dyn Fn(&mut Value) + Send + Sync>;

/// A collection of objects: its path and what its objects are.
struct Collection {
    api_version: String,
    kind: String,
    objects: BTreeMap<String, Value>,
}

#[derive(Default)]
struct State {
    collections: BTreeMap<String, Collection>,
    rv: u64,
    /// Every event since the last compaction: resource version, collection path, event.
    log: Vec<(u64, String, Value)>,
    /// The resource version of the last compaction.
    compacted: u64,
    /// Every request: `METHOD path?query`.
    requests: Vec<String>,
    down: bool,
    /// Writes (create, replace, delete through the API) still to fail with 500.
    fail_writes: u32,
    /// Writes through the API that succeeded.
    writes: u64,
    on_create: Option<Hook>,
    on_delete: Option<Hook>,
    /// Run on every object written through the API (create and replace, dry runs too), as a
    /// server drops the fields of a disabled feature gate.
    on_write: Option<Hook>,
    /// What `GET /version` answers (`None`: 404).
    version: Option<String>,
}

#[derive(Clone)]
enum Msg {
    Event(u64, String, Value),
    /// Ends every open watch (the server went down).
    Close,
}

/// The fake API server. Cheap to clone.
#[derive(Clone)]
pub struct FakeApi {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<Msg>,
}

fn reply(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

fn status(code: u16, reason: &str) -> Response<Body> {
    reply(
        StatusCode::from_u16(code).unwrap(),
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": reason, "reason": reason, "code": code}),
    )
}

/// `%XX` and `+` decoded (query parameters).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_params(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// Whether `obj` matches the `labelSelector` and `fieldSelector` of `params` (`k=v,...` only).
fn matches(obj: &Value, params: &BTreeMap<String, String>) -> bool {
    let pairs = |key: &str| -> Vec<(String, String)> {
        params
            .get(key)
            .map(|s| {
                s.split(',')
                    .filter(|p| !p.is_empty())
                    .filter_map(|p| p.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let labels_ok = pairs("labelSelector")
        .iter()
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v.as_str()));
    let fields_ok = pairs("fieldSelector").iter().all(|(path, v)| {
        let mut at = obj;
        for part in path.split('.') {
            at = &at[part];
        }
        at.as_str() == Some(v.as_str())
    });
    labels_ok && fields_ok
}

impl FakeApi {
    /// An empty server.
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(State::default())),
            events: broadcast::channel(4096).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves the collection at `path` (e.g. `/api/v1/namespaces/ns/pods`) of `kind` objects.
    pub fn collection(&self, path: &str, api_version: &str, kind: &str) -> &Self {
        self.lock().collections.insert(
            path.to_owned(),
            Collection {
                api_version: api_version.to_owned(),
                kind: kind.to_owned(),
                objects: BTreeMap::new(),
            },
        );
        self
    }

    /// A kube client whose every request this server answers.
    pub fn client(&self) -> kube::Client {
        let handler = self.clone();
        let service = tower::service_fn(move |req| handler.clone().handle(req));
        kube::Client::new(service, "default")
    }

    /// Runs `hook` on every object created through the API before it is stored (the kubelet
    /// starting a pod, say).
    pub fn on_create(&self, hook: impl Fn(&mut Value) + Send + Sync + 'static) {
        self.lock().on_create = Some(Arc::new(hook));
    }

    /// Runs `hook` on every object written through the API, before it is stored or (for a dry
    /// run, `dryRun=All`) answered: as an API server drops the fields of a disabled feature.
    #[allow(dead_code)]
    pub fn on_write(&self, hook: impl Fn(&mut Value) + Send + Sync + 'static) {
        self.lock().on_write = Some(Arc::new(hook));
    }

    /// Waits until `cond` holds for the objects of collection `path` (up to 10 s); panics
    /// naming `what` and showing them when it does not.
    #[allow(dead_code)]
    pub async fn wait_for(&self, path: &str, what: &str, cond: impl Fn(&[Value]) -> bool) {
        for _ in 0..1000 {
            if cond(&self.list(path)) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!(
            "timed out waiting for {what}; {path}: {:#?}",
            self.list(path)
        );
    }

    /// Answers `GET /version` with `git_version`.
    #[allow(dead_code)]
    pub fn set_version(&self, git_version: &str) {
        self.lock().version = Some(git_version.to_string());
    }

    /// Runs `hook` on every object deleted, through the API or by [`Self::remove`].
    pub fn on_delete(&self, hook: impl Fn(&mut Value) + Send + Sync + 'static) {
        self.lock().on_delete = Some(Arc::new(hook));
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// How many requests were made so far.
    pub fn request_count(&self) -> usize {
        self.lock().requests.len()
    }

    /// Answers the next `n` writes through the API (create, replace, delete) with 500.
    pub fn fail_writes(&self, n: u32) {
        self.lock().fail_writes = n;
    }

    /// How many writes through the API succeeded so far.
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }

    /// Takes the server down (every request answered 503, open watches ended) or up.
    pub fn set_down(&self, down: bool) {
        self.lock().down = down;
        if down {
            let _ = self.events.send(Msg::Close);
        }
    }

    /// Forgets the event history: watches from an earlier resource version are refused.
    pub fn compact(&self) {
        let mut s = self.lock();
        s.log.clear();
        s.compacted = s.rv;
    }

    /// The object `name` of the collection at `path`.
    pub fn get(&self, path: &str, name: &str) -> Option<Value> {
        self.lock().collections[path].objects.get(name).cloned()
    }

    /// The objects of the collection at `path`.
    pub fn list(&self, path: &str) -> Vec<Value> {
        self.lock().collections[path]
            .objects
            .values()
            .cloned()
            .collect()
    }

    /// Stores `obj` in the collection at `path` (added or replaced) as a third party would.
    pub fn put(&self, path: &str, mut obj: Value) {
        let mut s = self.lock();
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        let existed = s.collections[path].objects.contains_key(&name);
        self.store(&mut s, path, &mut obj);
        self.emit(
            &mut s,
            path,
            if existed { "MODIFIED" } else { "ADDED" },
            obj,
        );
    }

    /// Changes object `name` of the collection at `path` as a third party would.
    pub fn mutate(&self, path: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut s = self.lock();
        let mut obj = s.collections[path].objects[name].clone();
        f(&mut obj);
        self.store(&mut s, path, &mut obj);
        self.emit(&mut s, path, "MODIFIED", obj);
    }

    /// Removes object `name` of the collection at `path` as a third party would.
    pub fn remove(&self, path: &str, name: &str) -> Option<Value> {
        let mut s = self.lock();
        let mut obj = s.collections.get_mut(path)?.objects.remove(name)?;
        let hook = s.on_delete.clone();
        s.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        self.emit(&mut s, path, "DELETED", obj.clone());
        drop(s);
        if let Some(hook) = hook {
            hook(&mut obj);
        }
        Some(obj)
    }

    /// Gives `obj` the next resource version, its kind, and a UID when it has none; stores it.
    fn store(&self, s: &mut State, path: &str, obj: &mut Value) {
        s.rv += 1;
        let rv = s.rv;
        let c = s.collections.get_mut(path).unwrap();
        obj["apiVersion"] = json!(c.api_version);
        obj["kind"] = json!(c.kind);
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        if obj["metadata"]["uid"].is_null() {
            obj["metadata"]["uid"] = json!(format!("uid-{rv}"));
        }
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        c.objects.insert(name, obj.clone());
    }

    fn emit(&self, s: &mut State, path: &str, kind: &str, obj: Value) {
        let event = json!({"type": kind, "object": obj});
        s.log.push((s.rv, path.to_owned(), event.clone()));
        let _ = self.events.send(Msg::Event(s.rv, path.to_owned(), event));
    }

    async fn handle(self, req: Request<kube::client::Body>) -> Result<Response<Body>, Infallible> {
        let method = req.method().as_str().to_owned();
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or_default().to_owned();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let input: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let params = query_params(&query);
        let mut s = self.lock();
        s.requests.push(format!("{method} {path}?{query}"));
        if s.down {
            return Ok(status(503, "ServiceUnavailable"));
        }
        if path == "/version" && method == "GET" {
            return Ok(match &s.version {
                Some(v) => reply(
                    StatusCode::OK,
                    &json!({"major": "1", "minor": "", "gitVersion": v, "gitCommit": "",
                            "gitTreeState": "clean", "buildDate": "", "goVersion": "",
                            "compiler": "gc", "platform": "linux/amd64"}),
                ),
                None => status(404, "NotFound"),
            });
        }
        let dry_run = params.get("dryRun").is_some_and(|d| d == "All");
        let found = s.collections.keys().find_map(|c| {
            if path == *c {
                Some((c.clone(), None))
            } else {
                path.strip_prefix(c.as_str())
                    .and_then(|rest| rest.strip_prefix('/'))
                    .filter(|n| !n.contains('/'))
                    .map(|n| (c.clone(), Some(n.to_owned())))
            }
        });
        let Some((collection, name)) = found else {
            return Ok(status(404, "NotFound"));
        };
        if method != "GET" && s.fail_writes > 0 {
            s.fail_writes -= 1;
            return Ok(status(500, "InternalError"));
        }
        let resp = match (method.as_str(), name) {
            ("GET", None) if params.get("watch").is_some_and(|w| w == "true" || w == "1") => {
                let since: u64 = params
                    .get("resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if since < s.compacted {
                    drop(s);
                    let expired = json!({"type": "ERROR", "object": {"kind": "Status",
                        "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                        "message": "too old resource version", "code": 410}});
                    return Ok(watch_response(
                        self.events.subscribe(),
                        vec![expired],
                        String::new(),
                        params,
                        true,
                    ));
                }
                // Subscribed under the lock: no event falls between the backlog and the stream.
                let rx = self.events.subscribe();
                let backlog: Vec<Value> = s
                    .log
                    .iter()
                    .filter(|(rv, c, e)| {
                        *rv > since && *c == collection && matches(&e["object"], &params)
                    })
                    .map(|(_, _, e)| e.clone())
                    .collect();
                drop(s);
                return Ok(watch_response(rx, backlog, collection, params, false));
            }
            ("GET", None) => {
                let c = &s.collections[&collection];
                let items: Vec<&Value> =
                    c.objects.values().filter(|o| matches(o, &params)).collect();
                reply(
                    StatusCode::OK,
                    &json!({"apiVersion": c.api_version, "kind": format!("{}List", c.kind),
                            "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
                )
            }
            ("GET", Some(n)) => match s.collections[&collection].objects.get(&n) {
                Some(o) => reply(StatusCode::OK, o),
                None => status(404, "NotFound"),
            },
            ("POST", None) => {
                let mut obj = input;
                let n = obj["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                if s.collections[&collection].objects.contains_key(&n) {
                    return Ok(status(409, "AlreadyExists"));
                }
                obj["metadata"]["uid"] = Value::Null;
                if let Some(hook) = s.on_write.clone() {
                    hook(&mut obj);
                }
                if dry_run {
                    return Ok(reply(StatusCode::CREATED, &obj));
                }
                if let Some(hook) = s.on_create.clone() {
                    drop(s);
                    hook(&mut obj);
                    s = self.lock();
                }
                self.store(&mut s, &collection, &mut obj);
                self.emit(&mut s, &collection, "ADDED", obj.clone());
                s.writes += 1;
                reply(StatusCode::CREATED, &obj)
            }
            ("PUT", Some(n)) => {
                let mut obj = input;
                let Some(old) = s.collections[&collection].objects.get(&n) else {
                    return Ok(status(404, "NotFound"));
                };
                let wanted = &obj["metadata"]["resourceVersion"];
                if !wanted.is_null() && *wanted != old["metadata"]["resourceVersion"] {
                    return Ok(status(409, "Conflict"));
                }
                obj["metadata"]["uid"] = old["metadata"]["uid"].clone();
                if let Some(hook) = s.on_write.clone() {
                    hook(&mut obj);
                }
                if dry_run {
                    return Ok(reply(StatusCode::OK, &obj));
                }
                self.store(&mut s, &collection, &mut obj);
                self.emit(&mut s, &collection, "MODIFIED", obj.clone());
                s.writes += 1;
                reply(StatusCode::OK, &obj)
            }
            ("DELETE", Some(n)) => {
                if !s.collections[&collection].objects.contains_key(&n) {
                    return Ok(status(404, "NotFound"));
                }
                s.writes += 1;
                drop(s);
                let obj = self.remove(&collection, &n).unwrap();
                reply(StatusCode::OK, &obj)
            }
            _ => status(405, "MethodNotAllowed"),
        };
        Ok(resp)
    }
}

impl Default for FakeApi {
    fn default() -> Self {
        Self::new()
    }
}

/// A watch: the backlog, then (unless `only_backlog`) the live events of `collection` that
/// match, until the server goes down.
fn watch_response(
    rx: broadcast::Receiver<Msg>,
    backlog: Vec<Value>,
    collection: String,
    params: BTreeMap<String, String>,
    only_backlog: bool,
) -> Response<Body> {
    let frame = |e: &Value| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{e}\n"))));
    let backlog = futures::stream::iter(backlog.iter().map(frame).collect::<Vec<_>>());
    let live = futures::stream::unfold(rx, move |mut rx| {
        let only_backlog = only_backlog;
        let collection = collection.clone();
        let params = params.clone();
        async move {
            if only_backlog {
                return None;
            }
            loop {
                match rx.recv().await {
                    Ok(Msg::Event(_, c, e))
                        if c == collection && matches(&e["object"], &params) =>
                    {
                        return Some((frame(&e), rx));
                    }
                    Ok(Msg::Event(..)) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Ok(Msg::Close) | Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        }
    });
    use futures::StreamExt;
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(backlog.chain(live))))
        .unwrap()
}
