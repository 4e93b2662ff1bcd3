//! Fault injection with MPS: the real plugin binary, on a simulated host (its NVML, its
//! `nvidia-smi` and `nvidia-cuda-mps-control`), is SIGKILLed at every step of prepare and
//! unprepare of an MPS claim, restarted, and the kubelet's call repeated. After a prepare
//! answer exactly one daemon serves the claim and answers with its limits; after an
//! unprepare answer no daemon, directory or exclusive compute mode is left.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_dra_kubelet_plugin::client::connect_dra;
use gpu_dra_kubelet_plugin::failpoint::STEPS;
use gpu_dra_kubelet_plugin::sharing::mps;
use gpu_dra_kubelet_plugin::testing::ChildGuard as Plugin;
use gpu_dra_kubelet_plugin::testing::{PluginCommand, allocated_claim};
use gpu_dra_proto::dra::v1;
use gpu_dra_sim::state::ComputeMode;
use gpu_dra_sim::testing::SimHost;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const UID: &str = "3d000000-0000-4000-8000-0000000000aa";
// dgx-a100-40gb: GPU 4 is a whole GPU (MIG disabled).
const GPU: usize = 4;

struct Layout {
    host: SimHost,
    root: tempfile::TempDir,
}

impl Layout {
    fn plugin_dir(&self) -> PathBuf {
        self.root.path().join("plugin")
    }
    fn socket(&self) -> PathBuf {
        self.plugin_dir().join("dra.sock")
    }
    fn pipe_dir(&self) -> PathBuf {
        self.plugin_dir()
            .join("mps")
            .join(gpu_dra_core::sharing::daemon_dir_name(UID, "c0"))
            .join("pipe")
    }

    fn start(&self, failpoints: &str) -> Plugin {
        let _ = std::fs::remove_file(self.plugin_dir().join("failpoint.reached"));
        let _ = std::fs::remove_file(self.socket());
        PluginCommand::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"), self.root.path())
            .node_name(NODE)
            .host_root(self.host.root())
            .sysfs_root(&self.host.sysfs_root())
            .failpoints(failpoints)
            .log_level("warn")
            .spawn()
            .unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.root.path().join("plugin.log")).unwrap_or_default()
    }
}

fn wait_for(layout: &Layout, path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; plugin log:\n{}",
            layout.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn claims() -> Vec<v1::Claim> {
    vec![v1::Claim {
        namespace: "ns".into(),
        uid: UID.into(),
        name: "m".into(),
    }]
}

/// One kubelet call; a transport error (a plugin just restarted under load) is retried a few
/// times, as the kubelet retries. Returns the claim's error string.
async fn call(socket: PathBuf, prepare: bool) -> Result<String, String> {
    let mut last = String::new();
    for _ in 0..20 {
        match call_once(&socket, prepare).await {
            Ok(e) => return Ok(e),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

async fn call_once(socket: &Path, prepare: bool) -> Result<String, String> {
    let mut client = connect_dra(socket.to_path_buf())
        .await
        .map_err(|e| e.to_string())?;
    if prepare {
        let r = client
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: claims() })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        Ok(r.claims
            .get(UID)
            .map(|c| c.error.clone())
            .unwrap_or_else(|| "missing".into()))
    } else {
        let r = client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: claims() })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        Ok(r.claims
            .get(UID)
            .map(|c| c.error.clone())
            .unwrap_or_else(|| "missing".into()))
    }
}

/// Runs the MPS client against the claim's pipe.
fn query(layout: &Layout) -> String {
    use std::io::Write;
    let mut child = Command::new(layout.host.tool("nvidia-cuda-mps-control"))
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", layout.pipe_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child
        .stdin
        .take()
        .unwrap()
        .write_all(b"get_default_active_thread_percentage\n");
    String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout).into_owned()
}

fn check_prepared(layout: &Layout, error: &str) -> Vec<String> {
    let mut p = Vec::new();
    if !error.is_empty() {
        p.push(format!("prepare error: {error}"));
    }
    let daemons = mps::find_daemons(&layout.pipe_dir());
    if daemons.len() != 1 {
        p.push(format!("{} daemons serve the claim, want 1", daemons.len()));
    }
    let answer = query(layout);
    if answer != "40.0\n" {
        p.push(format!("daemon answers {answer:?}, want 40.0"));
    }
    if layout.host.state().gpus[GPU].compute_mode != ComputeMode::ExclusiveProcess {
        p.push("compute mode is not EXCLUSIVE_PROCESS".into());
    }
    let spec = std::fs::read_dir(layout.root.path().join("cdi"))
        .map(|d| {
            d.flatten()
                .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
                .collect::<String>()
        })
        .unwrap_or_default();
    if !spec.contains("/tmp/nvidia-mps") {
        p.push("CDI spec lacks the MPS pipe mount".into());
    }
    p
}

fn check_unprepared(layout: &Layout, error: &str) -> Vec<String> {
    let mut p = Vec::new();
    if !error.is_empty() {
        p.push(format!("unprepare error: {error}"));
    }
    let daemons = mps::find_daemons(&layout.pipe_dir());
    if !daemons.is_empty() {
        p.push(format!("orphan daemons {daemons:?}"));
    }
    let left: Vec<_> = std::fs::read_dir(layout.plugin_dir().join("mps"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    if !left.is_empty() {
        p.push(format!("orphan directories {left:?}"));
    }
    if layout.host.state().gpus[GPU].compute_mode != ComputeMode::Default {
        p.push("compute mode not restored to DEFAULT".into());
    }
    p
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_every_step_of_an_mps_claim_leaves_no_orphan() {
    let layout = Layout {
        host: SimHost::new("dgx-a100-40gb"),
        root: tempfile::tempdir().unwrap(),
    };
    let config = serde_json::json!({
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 40}},
    });
    let claim = allocated_claim(
        "ns",
        "m",
        UID,
        DRIVER,
        NODE,
        &[("gpu", &format!("gpu-{GPU}"))],
        &[("FromClaim", &["gpu"], config)],
    );
    std::fs::write(
        layout.root.path().join("claims.json"),
        serde_json::to_vec(&vec![claim]).unwrap(),
    )
    .unwrap();

    let mut problems = Vec::new();
    for step in STEPS {
        let is_prepare = step.starts_with("prepare.");
        if !is_prepare {
            let mut plugin = layout.start("");
            wait_for(&layout, &layout.socket(), "socket");
            let error = call(layout.socket(), true).await.expect("setup prepare");
            problems.extend(
                check_prepared(&layout, &error)
                    .into_iter()
                    .map(|p| format!("{step} setup: {p}")),
            );
            plugin.kill().unwrap();
            plugin.wait().unwrap();
        }
        let mut plugin = layout.start(&format!("{step}=pause"));
        wait_for(&layout, &layout.socket(), "socket");
        // The call that the kill interrupts (its outcome does not matter).
        let pending = tokio::spawn(call(layout.socket(), is_prepare));
        wait_for(
            &layout,
            &layout.plugin_dir().join("failpoint.reached"),
            step,
        );
        plugin.kill().unwrap();
        plugin.wait().unwrap();
        pending.abort();
        let _ = pending.await;

        let mut plugin = layout.start("");
        wait_for(&layout, &layout.socket(), "socket after restart");
        let error = call(layout.socket(), is_prepare)
            .await
            .unwrap_or_else(|e| e);
        let found = if is_prepare {
            check_prepared(&layout, &error)
        } else {
            check_unprepared(&layout, &error)
        };
        problems.extend(found.into_iter().map(|p| format!("{step}: {p}")));
        if is_prepare {
            let error = call(layout.socket(), false)
                .await
                .expect("cleanup unprepare");
            problems.extend(
                check_unprepared(&layout, &error)
                    .into_iter()
                    .map(|p| format!("{step} cleanup: {p}")),
            );
        }
        plugin.kill().unwrap();
        plugin.wait().unwrap();
    }
    for pid in mps::find_daemons(&layout.pipe_dir()) {
        mps::kill(pid);
    }
    println!(
        "MPS crash consistency: {} steps, {} problems",
        STEPS.len(),
        problems.len()
    );
    assert!(
        problems.is_empty(),
        "{problems:#?}\nplugin log:\n{}",
        layout.log()
    );
}
