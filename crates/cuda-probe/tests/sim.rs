//! `gpu-cuda-probe` against the simulator's `libcuda.so.1` on simulated hosts: the devices
//! CUDA shows (whole GPUs, `CUDA_VISIBLE_DEVICES`, MIG devices), the kernel's verified
//! result, MPS limits (SM count, pinned memory), compute-mode refusal.
//!
//! The probe loads the host's library by absolute path (`--libcuda`): the host's library
//! folder also holds stand-ins of another glibc, which `LD_LIBRARY_PATH` would pick up.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpu_dra_sim::testing::SimHost;
use serde_json::Value;

/// The probe's report and exit status.
struct Run {
    code: i32,
    json: Value,
}

/// Runs the probe on `host` with `args`, `env` set, MPS reached through `pipe` (an empty
/// folder when the test runs no daemon).
fn probe(host: &SimHost, pipe: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-cuda-probe"));
    cmd.arg("--libcuda")
        .arg(host.libcuda_path())
        .args(args)
        .env_remove("GPU_SIM_STATE")
        .env_remove("GPU_SIM_PROFILE")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run gpu-cuda-probe");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout}");
    let json: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    Run {
        code: out.status.code().unwrap_or(-1),
        json,
    }
}

/// A GPU or MIG UUID as the probe prints it: without its prefix.
fn bare(uuid: &str) -> String {
    uuid.trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .to_lowercase()
}

fn uuids(r: &Run) -> Vec<String> {
    r.json["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| d["uuid"].as_str().expect("uuid").to_string())
        .collect()
}

fn no_daemon() -> tempfile::TempDir {
    tempfile::tempdir().expect("tmp")
}

#[test]
fn a_whole_gpu_runs_the_kernel_and_every_gpu_is_listed() {
    let host = SimHost::new("dgx-h100");
    let pipe = no_daemon();
    let r = probe(&host, pipe.path(), &["--elements", "1000"], &[]);
    assert_eq!(r.code, 0, "{}", r.json);
    assert_eq!(r.json["error"], Value::Null);
    let p = host.profile();
    assert_eq!(r.json["driver_version"], p.cuda_driver_version);
    let want: Vec<String> = p.gpus.iter().map(|g| bare(&g.uuid)).collect();
    assert_eq!(uuids(&r), want);
    let d0 = &r.json["devices"][0];
    assert_eq!(d0["name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(d0["sm_count"], 132);
    assert_eq!(d0["total_memory"], p.gpus[0].memory_mib * 1024 * 1024);
    assert_eq!(
        r.json["kernel"],
        serde_json::json!({"device": 0, "elements": 1000, "ok": true, "mismatches": 0})
    );
    assert_eq!(
        r.json["memory"]["total"],
        p.gpus[0].memory_mib * 1024 * 1024
    );
    assert!(r.json.get("alloc").is_none(), "alloc only when asked");

    // A kernel on another device, and an allocation larger than the GPU.
    let r = probe(
        &host,
        pipe.path(),
        &[
            "--elements",
            "300",
            "--device",
            "7",
            "--alloc-bytes",
            "100000000000",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.json);
    assert_eq!(r.json["kernel"]["device"], 7);
    assert_eq!(
        r.json["alloc"],
        serde_json::json!({"bytes": 100000000000u64, "ok": false, "error": "CUDA_ERROR_OUT_OF_MEMORY"})
    );
    let r = probe(&host, pipe.path(), &["--device", "8"], &[]);
    assert_eq!(r.code, 1);
    assert_eq!(r.json["error"], "cuDeviceGet: CUDA_ERROR_INVALID_DEVICE");
}

#[test]
fn cuda_visible_devices_restricts_by_index_and_uuid() {
    let host = SimHost::new("dgx-h100");
    let pipe = no_daemon();
    let gpus = &host.profile().gpus;
    let r = probe(
        &host,
        pipe.path(),
        &["--elements", "10"],
        &[("CUDA_VISIBLE_DEVICES", "3")],
    );
    assert_eq!(r.code, 0, "{}", r.json);
    assert_eq!(uuids(&r), vec![bare(&gpus[3].uuid)]);
    let list = format!("{},{}", gpus[5].uuid, gpus[1].uuid);
    let r = probe(
        &host,
        pipe.path(),
        &["--elements", "10"],
        &[("CUDA_VISIBLE_DEVICES", &list)],
    );
    assert_eq!(uuids(&r), vec![bare(&gpus[1].uuid), bare(&gpus[5].uuid)]);
    let r = probe(
        &host,
        pipe.path(),
        &[],
        &[("CUDA_VISIBLE_DEVICES", "GPU-nonexistent")],
    );
    assert_eq!(r.code, 1);
    assert_eq!(r.json["error"], "cuInit: CUDA_ERROR_NO_DEVICE");
}

#[test]
fn a_gpu_in_mig_mode_shows_its_mig_devices() {
    let host = SimHost::new("dgx-a100-40gb");
    let pipe = no_daemon();
    let state = host.state();
    let mig_gpu = (0..state.gpus.len())
        .find(|&i| !state.mig_devices(i).is_empty())
        .expect("a GPU with MIG devices at boot");
    let migs = state.mig_devices(mig_gpu);
    let r = probe(&host, pipe.path(), &["--elements", "10"], &[]);
    assert_eq!(r.code, 0, "{}", r.json);
    let seen = uuids(&r);
    for m in &migs {
        assert!(
            seen.contains(&bare(&m.ci.uuid)),
            "{} not in {seen:?}",
            m.ci.uuid
        );
    }
    let parent = bare(&state.profile.gpus[mig_gpu].uuid);
    assert!(
        !seen.contains(&parent),
        "a GPU in MIG mode is not a CUDA device itself"
    );

    let m = migs[0];
    let r = probe(
        &host,
        pipe.path(),
        &["--elements", "500"],
        &[("CUDA_VISIBLE_DEVICES", &m.ci.uuid)],
    );
    assert_eq!(r.code, 0, "{}", r.json);
    assert_eq!(uuids(&r), vec![bare(&m.ci.uuid)]);
    let d = &r.json["devices"][0];
    assert_eq!(
        d["name"],
        format!("{} MIG {}", state.profile.gpus[mig_gpu].name, m.name())
    );
    assert_eq!(d["total_memory"], m.profile.memory_mib * 1024 * 1024);
    assert_eq!(d["sm_count"], m.multiprocessors());
    assert_eq!(r.json["kernel"]["ok"], true);
}

#[test]
fn exclusive_process_without_a_daemon_refuses_the_context() {
    let host = SimHost::new("t4");
    host.update_state(|s| {
        s.gpus[0].compute_mode = gpu_dra_sim::state::ComputeMode::ExclusiveProcess
    });
    let pipe = no_daemon();
    let r = probe(&host, pipe.path(), &[], &[]);
    assert_eq!(r.code, 1, "{}", r.json);
    assert_eq!(
        r.json["error"],
        "cuCtxCreate_v2: CUDA_ERROR_DEVICE_UNAVAILABLE"
    );
    assert_eq!(r.json["devices"].as_array().map(Vec::len), Some(1));
    assert_eq!(r.json["kernel"], Value::Null);
}

/// An MPS control daemon on a host, quit when dropped.
struct Daemon {
    host_tool: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(host: &SimHost, visible: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tmp");
        let d = Daemon {
            host_tool: host.tool("nvidia-cuda-mps-control"),
            pipe: dir.path().join("pipe"),
            log: dir.path().join("log"),
            _dir: dir,
        };
        let o = d
            .cmd()
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", visible)
            .output()
            .expect("daemon");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        d
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.host_tool);
        c.env_remove("GPU_SIM_STATE")
            .env_remove("GPU_SIM_PROFILE")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log);
        c
    }

    fn send(&self, input: &str) -> String {
        use std::io::Write;
        let mut child = self
            .cmd()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("front end");
        let _ = child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes());
        let out = child.wait_with_output().expect("wait");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.send("quit\n");
    }
}

#[test]
fn an_mps_client_gets_the_servers_sm_share_and_pinned_memory_limit() {
    let host = SimHost::new("t4");
    let gpu = host.profile().gpus[0].uuid.clone();
    host.update_state(|s| {
        s.gpus[0].compute_mode = gpu_dra_sim::state::ComputeMode::ExclusiveProcess
    });
    let daemon = Daemon::start(&host, &gpu);
    assert_eq!(
        daemon.send(&format!(
            "set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit {gpu} 2048M\n"
        )),
        ""
    );
    let gib = 1u64 << 30;
    let over = (3 * gib).to_string();
    let r = probe(
        &host,
        &daemon.pipe,
        &["--elements", "1000", "--alloc-bytes", &over],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.json);
    // T4: 40 SMs; 25 % of them.
    assert_eq!(r.json["devices"][0]["sm_count"], 10);
    assert_eq!(r.json["devices"][0]["total_memory"], 15360u64 << 20);
    assert_eq!(
        r.json["memory"]["total"],
        2 * gib,
        "a whole GPU's MPS client sees its limit"
    );
    assert_eq!(r.json["kernel"]["ok"], true);
    assert_eq!(r.json["alloc"]["ok"], false);
    assert_eq!(r.json["alloc"]["error"], "CUDA_ERROR_OUT_OF_MEMORY");
    let under = gib.to_string();
    let r = probe(
        &host,
        &daemon.pipe,
        &["--elements", "1000", "--alloc-bytes", &under],
        &[],
    );
    assert_eq!(r.json["alloc"]["ok"], true, "{}", r.json);
    assert_eq!(r.json["alloc"]["error"], Value::Null);

    // The client's own limits only lower the server's.
    let r = probe(
        &host,
        &daemon.pipe,
        &["--elements", "10"],
        &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")],
    );
    assert_eq!(r.json["devices"][0]["sm_count"], 4, "{}", r.json);
}
