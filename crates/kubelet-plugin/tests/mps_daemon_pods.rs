//! MPS daemons in pods of their own, against the fake API server (through kube's real client)
//! and the simulator's `nvidia-cuda-mps-control`: a stand-in kubelet runs each pod's command
//! with the pod's environment when the pod is created and kills it when the pod is deleted.
//!
//! What is checked: the API requests a node makes while its daemons simply run do not grow
//! with the number of daemons (one watch per node, not one GET per daemon and second), and the
//! supervisors still replace a daemon pod that was deleted, that failed, or that went while the
//! API server was down (seen when the watch lists again).

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod fake_api;

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fake_api::FakeApi;
use gpu_dra_api::{MpsConfig, Sharing};
use gpu_dra_kubelet_plugin::sharing::pods::pod_name;
use gpu_dra_kubelet_plugin::sharing::{
    DriverRoot, FileStore, PodDaemons, PodSettings, ReshapeOutcome, SharedDevice, SharingManager,
    SharingMetrics, SharingOptions, daemon_id,
};
use gpu_dra_sim::testing::SimHost;
use serde_json::{Value, json};

const NAMESPACE: &str = "gpu-dra";
const PODS: &str = "/api/v1/namespaces/gpu-dra/pods";
/// Eight whole GPUs with MIG off: one daemon per GPU.
const PROFILE: &str = "dgx-h100";

/// A simulated node with a plugin's sharing manager whose daemons run in pods.
struct Node {
    host: SimHost,
    plugin_dir: tempfile::TempDir,
    metrics: SharingMetrics,
    api: FakeApi,
    /// The daemon processes the stand-in kubelet runs, by pod name.
    containers: Arc<Mutex<HashMap<String, Child>>>,
    manager: SharingManager,
}

/// Daemon pod settings as the chart gives them.
fn settings() -> PodSettings {
    PodSettings {
        namespace: NAMESPACE.into(),
        node: "node-a".into(),
        image: "registry.example/gpu-dra-driver:test".into(),
        host_driver_root: "/".into(),
        priority_class: String::new(),
        service_account: "gpu-dra-mps-daemon".into(),
        image_pull_policy: "IfNotPresent".into(),
        image_pull_secrets: Vec::new(),
    }
}

/// A sharing manager on `plugin_dir` whose daemons run in pods made with `settings`.
fn manager(
    host: &SimHost,
    plugin_dir: &Path,
    metrics: &SharingMetrics,
    api: &FakeApi,
    settings: PodSettings,
) -> SharingManager {
    let mut opts = SharingOptions::new(DriverRoot::new(host.root(), None), plugin_dir);
    opts.restart_backoff_initial = Duration::from_millis(20);
    opts.restart_backoff_max = Duration::from_millis(500);
    // Short, as in the other sharing tests: a supervisor that polls does so often.
    opts.liveness_interval = Duration::from_millis(20);
    let manager = SharingManager::new(
        opts,
        Arc::new(FileStore::new(plugin_dir.join("sharing.json"))),
        metrics.clone(),
    )
    .unwrap();
    manager.use_pod_daemons(PodDaemons::new(api.client(), settings));
    manager
}

impl Node {
    fn new() -> Node {
        Node::with(settings())
    }

    fn with(settings: PodSettings) -> Node {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("gpu_dra_kubelet_plugin=debug")
            .try_init();
        let host = SimHost::new(PROFILE);
        let plugin_dir = tempfile::tempdir().unwrap();
        let metrics = SharingMetrics::default();
        let api = FakeApi::new();
        api.collection(PODS, "v1", "Pod");
        let containers = kubelet(&api);
        let manager = manager(&host, plugin_dir.path(), &metrics, &api, settings);
        Node {
            host,
            plugin_dir,
            metrics,
            api,
            containers,
            manager,
        }
    }

    /// The plugin stops (its daemons keep running) and another one starts on the same node,
    /// making daemon pods with `settings`, and recovers.
    async fn restart_plugin(&mut self, settings: PodSettings) {
        self.manager.detach();
        self.manager = manager(
            &self.host,
            self.plugin_dir.path(),
            &self.metrics,
            &self.api,
            settings,
        );
        self.manager.recover().await.unwrap();
    }

    fn gpu_uuid(&self, index: usize) -> String {
        self.host.profile().gpus[index].uuid.clone()
    }

    /// Prepares claim `claim-<index>` with MPS (30% of the threads) on GPU `index`.
    async fn prepare(&self, index: usize) {
        let config = MpsConfig {
            active_thread_percentage: Some(30),
            ..Default::default()
        };
        self.manager
            .prepare(
                "ns",
                &claim(index),
                "0",
                &[SharedDevice::gpu(self.gpu_uuid(index))],
                &Sharing::Mps(config),
            )
            .await
            .unwrap();
    }

    /// The daemon pod of claim `claim-<index>`.
    fn pod_name(&self, index: usize) -> String {
        pod_name(&self.manager.state().mps[&daemon_id(&claim(index), "0")])
    }

    fn pod_uid(&self, index: usize) -> Option<String> {
        self.api
            .get(PODS, &self.pod_name(index))
            .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
    }

    /// The daemon directory of claim `claim-<index>`.
    fn daemon_dir(&self, index: usize) -> std::path::PathBuf {
        self.plugin_dir
            .path()
            .join("mps")
            .join(gpu_dra_core::sharing::daemon_dir_name(&claim(index), "0"))
    }

    /// Whether the daemon of claim `claim-<index>` answers on its pipe with its limits.
    fn answers(&self, index: usize) -> bool {
        mps_client(
            &self.host,
            &self.daemon_dir(index),
            "get_default_active_thread_percentage\n",
        ) == "30.0\n"
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.manager.detach();
        for (_, mut c) in self.containers.lock().unwrap().drain() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn claim(index: usize) -> String {
    format!("claim-{index}")
}

/// The stand-in kubelet: runs a created pod's first container (command and environment, as
/// the pod says) and reports it running; kills it when the pod is deleted.
fn kubelet(api: &FakeApi) -> Arc<Mutex<HashMap<String, Child>>> {
    let containers: Arc<Mutex<HashMap<String, Child>>> = Arc::default();
    let started = Arc::clone(&containers);
    api.on_create(move |pod: &mut Value| {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        let c = &pod["spec"]["containers"][0];
        let argv: Vec<&str> = c["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let env = c["env"].as_array().unwrap().iter().map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e["value"].as_str().unwrap_or_default().to_owned(),
            )
        });
        let child = Command::new(argv[0])
            .args(&argv[1..])
            .env_clear()
            .envs(env)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        pod["status"] = json!({"phase": "Running"});
        started.lock().unwrap().insert(name, child);
    });
    let running = Arc::clone(&containers);
    api.on_delete(move |pod: &mut Value| {
        let name = pod["metadata"]["name"].as_str().unwrap();
        if let Some(mut c) = running.lock().unwrap().remove(name) {
            let _ = c.kill();
            let _ = c.wait();
        }
    });
    containers
}

/// Runs the MPS client against a daemon's pipe; returns its stdout.
fn mps_client(host: &SimHost, dir: &Path, commands: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(host.tool("nvidia-cuda-mps-control"))
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(commands.as_bytes())
        .unwrap();
    String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout).into_owned()
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The API requests a node with `daemons` running daemon pods makes in 2 s of steady state.
async fn steady_requests(daemons: usize) -> Vec<String> {
    let node = Node::new();
    node.manager.recover().await.unwrap();
    for i in 0..daemons {
        node.prepare(i).await;
    }
    assert_eq!(node.api.list(PODS).len(), daemons);
    // Settled: the supervisors are running and the watch (if any) has listed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = node.api.request_count();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = node.api.requests()[before..].to_vec();
    for i in 0..daemons {
        node.manager.unprepare(&claim(i)).await.unwrap();
    }
    assert!(node.api.list(PODS).is_empty());
    during
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_running_daemons_do_not_grow_with_their_number() {
    let one = steady_requests(1).await;
    let eight = steady_requests(8).await;
    eprintln!(
        "API requests in 2 s of steady state: {} with 1 daemon pod, {} with 8",
        one.len(),
        eight.len()
    );
    assert_eq!(
        one.len(),
        eight.len(),
        "requests grow with the daemons; with 8: {eight:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_pod_deleted_failed_or_gone_during_an_outage_is_replaced() {
    let node = Node::new();
    node.manager.recover().await.unwrap();
    node.prepare(0).await;
    node.prepare(1).await;
    assert!(node.answers(0) && node.answers(1));
    let first = node.pod_uid(0).unwrap();
    let other = node.pod_uid(1).unwrap();

    // Deleted by someone else (an eviction, an admin): replaced, with the claim's limits.
    node.api.remove(PODS, &node.pod_name(0));
    wait_until("a new daemon pod for claim-0", || {
        node.pod_uid(0).is_some_and(|u| u != first)
    })
    .await;
    wait_until("the new daemon to answer", || node.answers(0)).await;
    assert_eq!(node.metrics.mps_daemon_restarts.get(), 1);
    assert_eq!(
        node.pod_uid(1),
        Some(other.clone()),
        "the other pod is left alone"
    );

    // Failed (its phase says so): replaced.
    node.api.mutate(PODS, &node.pod_name(1), |p| {
        p["status"]["phase"] = json!("Failed");
    });
    wait_until("a new daemon pod for claim-1", || {
        node.pod_uid(1).is_some_and(|u| u != other)
    })
    .await;
    wait_until("the new daemon to answer", || node.answers(1)).await;
    assert_eq!(node.metrics.mps_daemon_restarts.get(), 2);

    // Gone while the API server was down, which lost the event history meanwhile: nothing is
    // done during the outage (the server cannot tell), and the pod is replaced once the watch,
    // refused to resume, has listed again.
    let second = node.pod_uid(0).unwrap();
    node.api.set_down(true);
    node.api.remove(PODS, &node.pod_name(0));
    node.api.compact();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        node.metrics.mps_daemon_restarts.get(),
        2,
        "acted on an outage"
    );
    node.api.set_down(false);
    wait_until("a new daemon pod for claim-0 after the outage", || {
        node.pod_uid(0).is_some_and(|u| u != second)
    })
    .await;
    wait_until("the new daemon to answer", || node.answers(0)).await;
    assert_eq!(node.metrics.mps_daemon_restarts.get(), 3);

    node.manager.unprepare(&claim(0)).await.unwrap();
    node.manager.unprepare(&claim(1)).await.unwrap();
    assert!(node.api.list(PODS).is_empty());
    assert_eq!(
        node.metrics.mps_daemon_restarts.get(),
        3,
        "an unprepare is not a crash"
    );
}

/// A CUDA program (the simulator's) attached to the daemon of `dir` as an MPS client until
/// killed.
fn mps_client_program(host: &SimHost, dir: &Path) -> Child {
    let tool = gpu_dra_sim::testing::ensure_built()
        .unwrap()
        .join("cuda-app");
    let mut child = Command::new(tool)
        .args(["--seconds", "600"])
        .env_clear()
        .env("GPU_SIM_STATE", host.state_file().path())
        .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Attached once it printed what its server gave it.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while std::io::BufRead::read_line(&mut out, &mut text).unwrap() > 0 {
        if text.contains("MPS") {
            break;
        }
    }
    assert!(text.contains("MPS"), "the client did not attach: {text}");
    child
}

fn pod_field(node: &Node, index: usize, pointer: &str) -> Value {
    node.api
        .get(PODS, &node.pod_name(index))
        .unwrap()
        .pointer(pointer)
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_pods_of_an_older_shape_are_replaced_once_they_serve_no_client() {
    // An earlier plugin made the pods: the namespace's default account, no pull secrets.
    let mut node = Node::with(PodSettings {
        service_account: String::new(),
        ..settings()
    });
    node.manager.recover().await.unwrap();
    node.prepare(0).await;
    node.prepare(1).await;
    let (first, second) = (node.pod_uid(0).unwrap(), node.pod_uid(1).unwrap());
    let mut client = mps_client_program(&node.host, &node.daemon_dir(1));

    // The upgrade: the chart's daemon account and a pull secret.
    let upgraded = PodSettings {
        image_pull_secrets: vec!["registry-creds".into()],
        ..settings()
    };
    node.restart_plugin(upgraded.clone()).await;
    assert_eq!(
        node.manager.outdated_daemon_owners(),
        vec![claim(0), claim(1)]
    );
    assert_eq!(node.metrics.mps_daemon_pods_outdated.get(), 2);
    assert_eq!(
        node.pod_uid(0),
        Some(first.clone()),
        "recovery replaces nothing"
    );

    // Idle: replaced by a pod of the new shape, the claim's limits applied again.
    let done = node.manager.reshape(&claim(0)).await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, ReshapeOutcome::Replaced);
    assert!(
        done[0]
            .differences
            .contains(&"serviceAccountName".to_string())
            && done[0]
                .differences
                .contains(&"imagePullSecrets".to_string()),
        "{:?}",
        done[0].differences
    );
    assert!(node.pod_uid(0).is_some_and(|u| u != first));
    assert_eq!(
        pod_field(&node, 0, "/spec/serviceAccountName"),
        json!("gpu-dra-mps-daemon")
    );
    assert_eq!(
        pod_field(&node, 0, "/spec/imagePullSecrets"),
        json!([{"name": "registry-creds"}])
    );
    assert!(node.answers(0));

    // A client attached: kept, and said so, until the client is gone.
    let done = node.manager.reshape(&claim(1)).await;
    assert_eq!(
        done[0].outcome,
        ReshapeOutcome::Busy { clients: 1 },
        "{done:?}"
    );
    assert_eq!(node.pod_uid(1), Some(second.clone()));
    assert_eq!(node.metrics.mps_daemon_pods_outdated.get(), 1);
    client.kill().unwrap();
    client.wait().unwrap();
    let replaced = async {
        for _ in 0..100 {
            let done = node.manager.reshape(&claim(1)).await;
            if done.first().map(|r| &r.outcome) == Some(&ReshapeOutcome::Replaced) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    assert!(replaced.await, "not replaced after its client left");
    assert!(node.pod_uid(1).is_some_and(|u| u != second));
    assert!(node.answers(1));
    assert!(node.manager.outdated_daemon_owners().is_empty());
    assert_eq!(node.metrics.mps_daemon_pods_outdated.get(), 0);
    assert_eq!(
        node.metrics.mps_daemon_restarts.get(),
        0,
        "a replacement is not a crash"
    );

    // Pods of the current shape are left alone by the next plugin, with no request for them.
    let (now0, now1) = (node.pod_uid(0), node.pod_uid(1));
    node.restart_plugin(upgraded).await;
    assert!(node.manager.outdated_daemon_owners().is_empty());
    assert_eq!((node.pod_uid(0), node.pod_uid(1)), (now0, now1));

    node.manager.unprepare(&claim(0)).await.unwrap();
    node.manager.unprepare(&claim(1)).await.unwrap();
    assert!(node.api.list(PODS).is_empty());
}
