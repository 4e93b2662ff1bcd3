//! Fault injection with MPS: the real plugin binary, on a simulated host (its NVML, its
//! `nvidia-smi` and `nvidia-cuda-mps-control`), is SIGKILLed at every step of prepare and
//! unprepare of an MPS claim, restarted, and the kubelet's call repeated. After a prepare
//! answer exactly one daemon serves the claim and answers with its limits; after an
//! unprepare answer no daemon, directory or exclusive compute mode is left.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gpu_dra_kubelet_plugin::failpoint::STEPS;
use gpu_dra_kubelet_plugin::sharing::mps;
use gpu_dra_kubelet_plugin::testing::{PluginCommand, allocated_claim, connect_dra};
use gpu_dra_proto::dra::v1;
use gpu_dra_sim::state::ComputeMode;
use gpu_dra_sim::testing::SimHost;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const UID: &str = "3d000000-0000-4000-8000-0000000000aa";
// dgx-a100-40gb: GPU 4 is a whole GPU (MIG disabled).
const GPU: usize = 4;

/// The plugin on a simulated host, everything else under `root`.
struct Layout {
    host: SimHost,
    /// Kept so the folder lives as long as the layout.
    _root: tempfile::TempDir,
    cmd: PluginCommand,
}

impl Layout {
    fn new() -> Layout {
        let host = SimHost::new("dgx-a100-40gb");
        let root = tempfile::tempdir().unwrap();
        let cmd = PluginCommand::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"), root.path())
            .node_name(NODE)
            .host_root(host.root())
            .sysfs_root(&host.sysfs_root())
            .log_level("warn");
        Layout {
            host,
            _root: root,
            cmd,
        }
    }

    fn pipe_dir(&self) -> PathBuf {
        gpu_dra_kubelet_plugin::node_layout::mps_root_in(&self.cmd.plugin_dir())
            .join(gpu_dra_core::sharing::daemon_dir_name(UID, "c0"))
            .join("pipe")
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
    let spec = std::fs::read_dir(layout.cmd.cdi_dir())
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
    let left: Vec<_> = std::fs::read_dir(gpu_dra_kubelet_plugin::node_layout::mps_root_in(
        &layout.cmd.plugin_dir(),
    ))
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
    let layout = Layout::new();
    let cmd = &layout.cmd;
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
    std::fs::write(cmd.claims_file(), serde_json::to_vec(&vec![claim]).unwrap()).unwrap();

    let mut problems = Vec::new();
    for step in STEPS {
        let is_prepare = step.starts_with("prepare.");
        if !is_prepare {
            let mut plugin = cmd.respawn("").unwrap();
            cmd.wait_for(&cmd.socket(), "socket");
            let error = call(cmd.socket(), true).await.expect("setup prepare");
            problems.extend(
                check_prepared(&layout, &error)
                    .into_iter()
                    .map(|p| format!("{step} setup: {p}")),
            );
            plugin.kill().unwrap();
            plugin.wait().unwrap();
        }
        let mut plugin = cmd.respawn(&format!("{step}=pause")).unwrap();
        cmd.wait_for(&cmd.socket(), "socket");
        // The call that the kill interrupts (its outcome does not matter).
        let pending = tokio::spawn(call(cmd.socket(), is_prepare));
        cmd.wait_for(&cmd.failpoint_marker(), step);
        plugin.kill().unwrap();
        plugin.wait().unwrap();
        pending.abort();
        let _ = pending.await;

        let mut plugin = cmd.respawn("").unwrap();
        cmd.wait_for(&cmd.socket(), "socket after restart");
        let error = call(cmd.socket(), is_prepare).await.unwrap_or_else(|e| e);
        let found = if is_prepare {
            check_prepared(&layout, &error)
        } else {
            check_unprepared(&layout, &error)
        };
        problems.extend(found.into_iter().map(|p| format!("{step}: {p}")));
        if is_prepare {
            let error = call(cmd.socket(), false).await.expect("cleanup unprepare");
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
        cmd.log()
    );
}
