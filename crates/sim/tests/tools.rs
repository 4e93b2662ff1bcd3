//! The stand-in tools as the driver runs them: spawned from a simulated root (so they find
//! the host from their own location), sharing one state with the NVML library.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::ComputeMode;

fn tool(host: &SimHost, name: &str) -> Command {
    let mut c = Command::new(host.tool(name));
    c.env_remove("GPU_SIM_STATE")
        .env_remove("GPU_SIM_PROFILE")
        .env_remove("CUDA_VISIBLE_DEVICES");
    c
}

fn smi(host: &SimHost, args: &[&str]) -> (i32, String) {
    let out = tool(host, "nvidia-smi").args(args).output().expect("spawn");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn nvidia_smi_and_nvml_see_one_state() {
    let host = SimHost::new("dgx-h100");
    let nvml = Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("init");
    let uuid = host.profile().gpus[1].uuid.clone();
    let (code, out) = smi(&host, &["-i", &uuid, "-c", "EXCLUSIVE_PROCESS"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out,
        "Set compute mode to EXCLUSIVE_PROCESS for GPU 00000000:0F:00.0.\nAll done.\n"
    );
    let mut d = nvml.device_by_index(1).expect("device");
    assert_eq!(
        d.compute_mode().expect("mode"),
        ComputeMode::ExclusiveProcess
    );

    d.set_compute_mode(ComputeMode::Prohibited).expect("set");
    let (code, out) = smi(
        &host,
        &[
            "-i",
            "1",
            "--query-gpu=compute_mode",
            "--format=csv,noheader",
        ],
    );
    assert_eq!((code, out.as_str()), (0, "Prohibited\n"));

    let (code, out) = smi(
        &host,
        &["compute-policy", "-i", &uuid, "--set-timeslice", "1"],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out,
        "Successfully set timeslice policy with value Short for GPU 1\n"
    );
    assert_eq!(host.state().gpus[1].timeslice, 1);
}

#[test]
fn nvidia_smi_lists_the_dgx_a100_fleet() {
    let host = SimHost::new("dgx-a100-40gb");
    let (code, out) = smi(&host, &["-L"]);
    assert_eq!(code, 0);
    let gpus = out.lines().filter(|l| l.starts_with("GPU ")).count();
    let migs = out.lines().filter(|l| l.starts_with("  MIG ")).count();
    assert_eq!((gpus, migs), (8, 16), "{out}");
    let (code, out) = smi(&host, &["--version"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("NVIDIA-SMI version  : 580.95.05\n"),
        "{out}"
    );
}

#[test]
fn nvidia_smi_reports_unsupported_timeslice_on_p4() {
    let host = SimHost::new("p4");
    let (code, out) = smi(
        &host,
        &["compute-policy", "-i", "0", "--set-timeslice", "0"],
    );
    assert_eq!(code, 3);
    assert!(out.ends_with("Failed to set timeslice for requested devices : Not Supported\n"));
}

#[test]
fn nvidia_smi_without_a_host_fails_like_without_a_driver() {
    let host = SimHost::new("t4");
    let dir = tempfile::tempdir().expect("tmp");
    let lone = dir.path().join("nvidia-smi");
    std::fs::copy(host.tool("nvidia-smi"), &lone).expect("copy");
    // Another test thread forking while the copy's write descriptor was open makes that child
    // hold it until it execs: exec then fails with ETXTBSY for a moment. Retry briefly.
    let mut attempt = 0;
    let out = loop {
        match Command::new(&lone)
            .arg("-L")
            .env_remove("GPU_SIM_STATE")
            .output()
        {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && attempt < 50 => {
                attempt += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => break other.expect("spawn"),
        }
    };
    assert_eq!(out.status.code(), Some(9));
}

/// What a driver tool from the container gets on a real host when the loader searches the
/// driver's library folder, which also holds the host's own glibc: it dies at start. Started
/// with the driver's libraries preloaded and the process's own glibc, it runs. Both layouts.
#[test]
fn tools_die_on_the_hosts_glibc_and_run_with_only_the_driver_libraries_preloaded() {
    for profile in ["t4", "h100-usr-local-nvidia"] {
        let host = SimHost::new(profile);
        let lib_dir = host.lib_path().parent().expect("lib dir").to_path_buf();
        for (name, args, stdin) in [
            ("nvidia-smi", &["-L"][..], ""),
            ("nvidia-cuda-mps-control", &[][..], "get_server_list\n"),
        ] {
            let run = |var: &str, value: String| {
                let mut child = tool(&host, name)
                    .args(args)
                    .env(var, value)
                    .env("CUDA_MPS_PIPE_DIRECTORY", host.root().join("no-daemon"))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn");
                let _ = child
                    .stdin
                    .take()
                    .expect("stdin")
                    .write_all(stdin.as_bytes());
                child.wait_with_output().expect("wait")
            };
            let out = run("LD_LIBRARY_PATH", lib_dir.display().to_string());
            assert!(!out.status.success(), "{profile} {name}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("version `GLIBC_9.99' not found"),
                "{profile} {name}: {err}"
            );
            let preload = format!(
                "{} {}",
                host.lib_path().display(),
                lib_dir.join("libcuda.so.1").display()
            );
            let out = run("LD_PRELOAD", preload);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!err.contains("ld.so"), "{profile} {name}: {err}");
            if name == "nvidia-smi" {
                assert!(out.status.success(), "{profile} {name}: {err}");
                assert!(String::from_utf8_lossy(&out.stdout).starts_with("GPU 0: "));
            } else {
                // No daemon to talk to: the tool ran and said so.
                assert!(
                    String::from_utf8_lossy(&out.stdout).contains("Cannot find MPS control daemon"),
                    "{profile} {name}: {}",
                    String::from_utf8_lossy(&out.stdout)
                );
            }
        }
    }
}

struct Mps {
    pipe: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Mps {
    /// Stops a daemon a failed test left behind, so no process outlives the test run.
    fn drop(&mut self) {
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(self.pipe.join("control")) {
            let _ = s.write_all(b"quit\n");
            let mut buf = [0u8; 4];
            let _ = std::io::Read::read(&mut s, &mut buf);
        }
    }
}

fn mps_dirs() -> Mps {
    let dir = tempfile::tempdir().expect("tmp");
    Mps {
        pipe: dir.path().join("pipe"),
        log: dir.path().join("log"),
        _dir: dir,
    }
}

fn mps_cmd(host: &SimHost, m: &Mps) -> Command {
    let mut c = tool(host, "nvidia-cuda-mps-control");
    c.env("CUDA_MPS_PIPE_DIRECTORY", &m.pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &m.log);
    c
}

/// Sends `input` (exactly as given, so callers test missing trailing newlines) to a
/// front-end process.
fn ui(host: &SimHost, m: &Mps, input: &str) -> Output {
    let mut child = mps_cmd(host, m)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn ui");
    // A front-end without a daemon exits before reading: ignore the broken pipe.
    let _ = child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes());
    child.wait_with_output().expect("wait")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn wait_gone(p: &Path) {
    let t = Instant::now();
    while p.exists() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn mps_daemon_applies_limits_and_quits() {
    let host = SimHost::new("dgx-a100-40gb");
    let state = host.state();
    let gpu = state.profile.gpus[5].uuid.clone();
    let mig = state.gpus[0].gpu_instances[0].compute_instances[0]
        .uuid
        .clone();
    let m = mps_dirs();

    // No daemon yet.
    let o = ui(&host, &m, "get_server_list\n");
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o), "Cannot find MPS control daemon process\n");

    let started = Instant::now();
    let o = mps_cmd(&host, &m)
        .arg("-d")
        .env("CUDA_VISIBLE_DEVICES", format!("{gpu},{mig}"))
        .output()
        .expect("daemon");
    assert!(o.status.success(), "{}", text(&o));
    let ready = started.elapsed();
    assert!(m.pipe.join("control").exists());
    assert!(m.pipe.join("nvidia-cuda-mps-control.pid").exists());
    eprintln!("daemon ready after {ready:?}");

    // A second daemon on the same pipe directory is refused.
    let o = mps_cmd(&host, &m).arg("-d").output().expect("second");
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o), "An instance of this daemon is already running\n");

    // Commands written the way the device plugin does: no trailing newline.
    let o = ui(&host, &m, "set_default_active_thread_percentage 25");
    assert_eq!((o.status.code(), text(&o).as_str()), (Some(0), ""));
    let o = ui(
        &host,
        &m,
        &format!(
            "get_default_active_thread_percentage\nset_default_device_pinned_mem_limit {mig} 2048M\n\
             set_default_device_pinned_mem_limit 0 1500M\nget_default_device_pinned_mem_limit 1\n\
             get_default_device_pinned_mem_limit {gpu}\nget_server_list\n"
        ),
    );
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(text(&o), "25.0\n2G\n1500M\n");

    // Rejected commands print an error and still exit 0.
    let o = ui(
        &host,
        &m,
        "set_default_active_thread_percentage 0\nset_default_device_pinned_mem_limit 2 1G\n\
         set_default_device_pinned_mem_limit GPU-00000000 1G\nbogus 1\n",
    );
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        text(&o),
        "Invalid percentage, expected between (0.0, 100.0]\nInvalid device ordinal!\n\
         Invalid device ordinal!\nUnknown command \"bogus 1\"\n"
    );

    let log = std::fs::read_to_string(m.log.join("control.log")).expect("log");
    assert!(log.contains(&format!(
        "Cmd:set_default_device_pinned_mem_limit {mig} 2048M"
    )));
    assert!(
        log.contains("Starting control daemon using socket "),
        "{log}"
    );
    assert!(
        log.lines()
            .all(|l| l.starts_with('[') && l.contains(" Control ")),
        "{log}"
    );

    let o = ui(&host, &m, "quit");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    wait_gone(&m.pipe.join("control"));
    assert!(!m.pipe.join("control").exists());
    let o = ui(&host, &m, "get_server_list");
    assert_eq!(o.status.code(), Some(1));
    // Settings are lost with the daemon, as on real MPS: a new one starts from defaults.
    let o = mps_cmd(&host, &m).arg("-d").output().expect("daemon");
    assert!(o.status.success());
    let o = ui(&host, &m, "get_default_active_thread_percentage\nquit\n");
    assert_eq!(text(&o), "100.0\n");
}

fn wait_for(p: &Path, child: &mut Child) {
    let t = Instant::now();
    while !p.exists() {
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "daemon exited early"
        );
        assert!(t.elapsed() < Duration::from_secs(10), "daemon not ready");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn mps_foreground_daemon_is_supervisable() {
    let host = SimHost::new("t4");
    let m = mps_dirs();
    let mut child = mps_cmd(&host, &m)
        .arg("-f")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn");
    wait_for(&m.pipe.join("control"), &mut child);
    let o = ui(&host, &m, "get_server_list\n");
    assert_eq!((o.status.code(), text(&o).as_str()), (Some(0), ""));
    // Without CUDA_VISIBLE_DEVICES the daemon serves all GPUs of the host: one on a T4.
    let o = ui(
        &host,
        &m,
        "set_default_device_pinned_mem_limit 0 1G\nset_default_device_pinned_mem_limit 1 1G\n",
    );
    assert_eq!(text(&o), "Invalid device ordinal!\n");
    let o = ui(&host, &m, "quit\n");
    assert_eq!(o.status.code(), Some(0));
    let status = child.wait().expect("wait");
    assert!(status.success());
    for f in [
        "control",
        "control_privileged",
        "log",
        "nvidia-cuda-mps-control.pid",
    ] {
        assert!(!m.pipe.join(f).exists(), "{f} left behind");
    }
}

#[test]
fn mps_daemon_rejects_a_bad_thread_percentage_env() {
    let host = SimHost::new("t4");
    let m = mps_dirs();
    let o = mps_cmd(&host, &m)
        .arg("-d")
        .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0")
        .output()
        .expect("daemon");
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE should be between (0.0, 100.0]\n"
    );
    assert!(!m.pipe.join("control").exists());
}

#[test]
fn gpu_sim_setup_builds_a_host_from_the_build_directory() {
    let gpu_sim = env!("CARGO_BIN_EXE_gpu-sim");
    // The artefacts it installs are the ones SimHost builds.
    let _ = SimHost::new("t4");
    let dir = tempfile::tempdir().expect("tmp");
    let root = dir.path().join("node-a");
    let out = Command::new(gpu_sim)
        .args(["setup", "--profile", "h200", "--root"])
        .arg(&root)
        .env_remove("GPU_SIM_ARTEFACTS")
        .output()
        .expect("gpu-sim setup");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
            .is_file()
    );
    assert!(root.join("usr/bin/nvidia-smi").is_file());
    // A character device when run as root, else a regular file standing in for it.
    assert!(root.join("dev/nvidia0").exists());

    let smi = Command::new(root.join("usr/bin/nvidia-smi"))
        .arg("-L")
        .env_remove("GPU_SIM_STATE")
        .output()
        .expect("smi");
    let text = String::from_utf8_lossy(&smi.stdout);
    assert!(text.starts_with("GPU 0: NVIDIA H200 (UUID: GPU-"), "{text}");

    let state = Command::new(gpu_sim)
        .args(["state", "--root"])
        .arg(&root)
        .output()
        .expect("gpu-sim state");
    let v: serde_json::Value = serde_json::from_slice(&state.stdout).expect("json");
    assert_eq!(v["profile"]["name"], "h200");
    assert_eq!(v["profile"]["gpus"][0]["memoryMiB"], 143771);

    let list = Command::new(gpu_sim)
        .arg("profiles")
        .output()
        .expect("profiles");
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect();
    assert_eq!(
        names,
        [
            "t4",
            "p4",
            "rtx4090",
            "dgx-a100-40gb",
            "dgx-h100",
            "h200",
            "h100-usr-local-nvidia",
            "a100-pcie-x4-nvlink",
            "h100-pcie-x8-nvlink",
            "l40s-x8",
            "dgx1-v100",
            "hgx-a100-80gb-x4"
        ]
    );

    let bad = Command::new(gpu_sim)
        .args(["setup", "--profile", "a100", "--root"])
        .arg(dir.path().join("x"))
        .output()
        .expect("gpu-sim setup");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown profile \"a100\""));
}

#[test]
fn gpu_sim_state_env_overrides_the_tool_location() {
    let host = SimHost::new("dgx-a100-40gb");
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("other/state.json");
    let out = Command::new(host.tool("nvidia-smi"))
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .env("GPU_SIM_STATE", &state)
        .env("GPU_SIM_PROFILE", "t4")
        .output()
        .expect("smi");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "Tesla T4\n");
    assert!(state.is_file(), "the state is created from GPU_SIM_PROFILE");
    // Without GPU_SIM_PROFILE a missing GPU_SIM_STATE is an error, not a silent fallback.
    let out = Command::new(host.tool("nvidia-smi"))
        .arg("-L")
        .env("GPU_SIM_STATE", dir.path().join("missing.json"))
        .env_remove("GPU_SIM_PROFILE")
        .output()
        .expect("smi");
    assert_eq!(out.status.code(), Some(9));
}

#[test]
fn mig_changes_through_nvidia_smi_are_seen_by_nvml() {
    let host = SimHost::new("dgx-h100");
    let nvml = Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("init");
    let d = nvml.device_by_index(6).expect("device");
    assert_eq!(d.mig_device_count().expect("max"), 0);

    let (code, out) = smi(&host, &["-i", "6", "-mig", "1"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = smi(&host, &["mig", "-i", "6", "-cgi", "1g.10gb:5", "-C"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(d.mig_device_count().expect("max"), 7);
    let m = d.mig_device_by_index(0).expect("mig device");
    assert_eq!(m.name().expect("name"), "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
    let gi = host.state().gpus[6].gpu_instances[0].id;
    let access = host.root().join(format!(
        "proc/driver/nvidia/capabilities/gpu6/mig/gi{gi}/ci0/access"
    ));
    assert!(access.is_file(), "{}", access.display());

    // The same through the test helper.
    host.update_state(|s| {
        s.destroy_compute_instance(6, gi, 0).expect("dci");
        s.destroy_gpu_instance(6, gi).expect("dgi");
    });
    assert!(matches!(
        d.mig_device_by_index(0),
        Err(nvml_wrapper::error::NvmlError::NotFound)
    ));
    assert!(!access.exists());
}

/// Runs the CUDA program stand-in against `host` with the given pipe directory.
fn cuda_app(host: &SimHost, pipe: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cuda-app"))
        .env("GPU_SIM_STATE", host.state_file().path())
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .output()
        .expect("spawn cuda-app");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn mps_clients_start_a_server_that_keeps_the_limits_it_started_with() {
    let host = SimHost::new("t4");
    let gpu = host.profile().gpus[0].uuid.clone();
    let m = mps_dirs();

    // No daemon, GPU in DEFAULT mode: CUDA runs without MPS.
    let (code, out) = cuda_app(&host, &m.pipe);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("MPS: not in use"), "{out}");
    // No daemon, GPU in EXCLUSIVE_PROCESS (held by an MPS server elsewhere): refused.
    let (code, out) = smi(&host, &["-i", "0", "-c", "EXCLUSIVE_PROCESS"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cuda_app(&host, &m.pipe);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("cudaErrorDevicesUnavailable"),
        "a client that cannot reach the daemon must fail: {out}"
    );

    let o = mps_cmd(&host, &m)
        .arg("-d")
        .env("CUDA_VISIBLE_DEVICES", &gpu)
        .output()
        .expect("daemon");
    assert!(o.status.success(), "{}", text(&o));
    let o = ui(
        &host,
        &m,
        &format!(
            "set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit {gpu} 2048M\nget_server_list\n"
        ),
    );
    // No server before the first client.
    assert_eq!(text(&o), "");

    let (code, out) = cuda_app(&host, &m.pipe);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("active thread percentage 25.0\n"), "{out}");
    assert!(
        out.contains(&format!("device 0 {gpu} pinned memory limit 2G\n")),
        "{out}"
    );
    let server: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("MPS server "))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no server PID in {out}"));
    assert_eq!(
        text(&ui(&host, &m, "get_server_list\n")),
        format!("{server}\n")
    );

    // New defaults do not change a running server; its clients keep its limits.
    let o = ui(&host, &m, "set_default_active_thread_percentage 50\n");
    assert_eq!(text(&o), "");
    let (_, out) = cuda_app(&host, &m.pipe);
    assert!(out.contains(&format!("MPS server {server}\n")), "{out}");
    assert!(out.contains("active thread percentage 25.0\n"), "{out}");
    let o = ui(
        &host,
        &m,
        &format!(
            "get_active_thread_percentage {server}\nget_device_pinned_mem_limit {server} 0\nget_active_thread_percentage 1\n"
        ),
    );
    assert_eq!(text(&o), "25.0\n2G\nServer 1 not found\n");

    // After the server stops, the next client starts one with the daemon's new defaults.
    let o = ui(
        &host,
        &m,
        &format!("shutdown_server {server}\nget_server_list\n"),
    );
    assert_eq!(text(&o), "");
    let (_, out) = cuda_app(&host, &m.pipe);
    assert!(out.contains("active thread percentage 50.0\n"), "{out}");
    assert!(!out.contains(&format!("MPS server {server}\n")), "{out}");

    let log = std::fs::read_to_string(m.log.join("control.log")).expect("log");
    assert!(
        log.contains("Server is not ready, push client to pending list"),
        "{log}"
    );
    let slog = std::fs::read_to_string(m.log.join("server.log")).expect("server log");
    assert!(
        slog.contains("Active Threads Percentage set to 25.0"),
        "{slog}"
    );
    assert!(
        slog.contains(&format!(
            "Device pinned memory limit for device {gpu} set to 0x80000000 bytes"
        )),
        "{slog}"
    );
    let o = ui(&host, &m, "quit\n");
    assert_eq!(o.status.code(), Some(0));
}

#[test]
fn mps_clients_own_limits_only_lower_the_servers() {
    let host = SimHost::new("t4");
    let gpu = host.profile().gpus[0].uuid.clone();
    let m = mps_dirs();
    let o = mps_cmd(&host, &m)
        .arg("-d")
        .env("CUDA_VISIBLE_DEVICES", &gpu)
        .output()
        .expect("daemon");
    assert!(o.status.success(), "{}", text(&o));
    let client = |pct: &str, pinned: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_cuda-app"))
            .env("GPU_SIM_STATE", host.state_file().path())
            .env("CUDA_MPS_PIPE_DIRECTORY", &m.pipe)
            .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", pct)
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", pinned)
            .output()
            .expect("spawn cuda-app");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    // No daemon defaults: the client's own values apply, each client its own.
    let out = client("25", "0=10G");
    assert!(out.contains("active thread percentage 25.0\n"), "{out}");
    assert!(
        out.contains(&format!("device 0 {gpu} pinned memory limit 10G\n")),
        "{out}"
    );
    let out = client("50", "0=20480M");
    assert!(out.contains("active thread percentage 50.0\n"), "{out}");
    assert!(out.contains("pinned memory limit 20G\n"), "{out}");
    let out = client("", "");
    assert!(out.contains("active thread percentage 100.0\n"), "{out}");
    assert!(out.contains("pinned memory limit none\n"), "{out}");

    // With server limits, a client can go below them, never above.
    let server: String = out
        .lines()
        .find_map(|l| l.strip_prefix("MPS server "))
        .expect("server")
        .to_string();
    let o = ui(&host, &m, &format!("shutdown_server {server}\n"));
    assert_eq!(text(&o), "");
    let o = ui(
        &host,
        &m,
        &format!(
            "set_default_active_thread_percentage 40\nset_default_device_pinned_mem_limit {gpu} 4G\n"
        ),
    );
    assert_eq!(text(&o), "");
    let out = client("80", "0=8G");
    assert!(out.contains("active thread percentage 40.0\n"), "{out}");
    assert!(out.contains("pinned memory limit 4G\n"), "{out}");
    let out = client("10", "0=1G");
    assert!(out.contains("active thread percentage 10.0\n"), "{out}");
    assert!(out.contains("pinned memory limit 1G\n"), "{out}");
    let out = client("0", "");
    assert!(out.contains("should be between (0.0, 100.0]"), "{out}");
    let o = ui(&host, &m, "quit\n");
    assert_eq!(o.status.code(), Some(0));
}

/// Makes `path` and the folders above it, up to the temporary folder, reachable by any user,
/// for a client that runs as another user.
fn open_to_all(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let top = std::env::temp_dir();
    for p in path
        .ancestors()
        .take_while(|p| p.starts_with(&top) && *p != top)
    {
        // Read (and search, for folders) for all; a socket keeps the write bit it has.
        let mode = std::fs::metadata(p).expect("stat").permissions().mode();
        let add = if p.is_dir() { 0o555 } else { 0o444 };
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode | add)).expect("chmod");
    }
}

/// Holds an MPS client of this process's user attached to the daemon at `pipe`, as a
/// running CUDA program does, until dropped.
fn hold_client(pipe: &Path) -> std::os::unix::net::UnixStream {
    let mut conn = std::os::unix::net::UnixStream::connect(pipe.join("control")).expect("connect");
    conn.write_all(
        format!(
            "{} {} 0\n",
            gpu_dra_sim::mps::CLIENT_HELLO,
            std::process::id()
        )
        .as_bytes(),
    )
    .expect("hello");
    let mut len = [0u8; 4];
    std::io::Read::read_exact(&mut conn, &mut len).expect("reply");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    std::io::Read::read_exact(&mut conn, &mut body).expect("reply");
    let reply = String::from_utf8_lossy(&body);
    assert!(reply.starts_with("MPS server "), "{reply}");
    conn
}

/// What the node plugin relies on when it mounts an MPS pipe folder read-only into client
/// containers: a CUDA client attaches through a read-only bind mount of the folder (connect()
/// on a socket needs no writable mount), and nothing in it can be created, renamed or
/// removed through that mount. Needs root and a private mount namespace (`unshare -m`), as
/// a container has; skipped elsewhere.
#[test]
fn an_mps_client_attaches_through_a_read_only_pipe_folder_it_cannot_change() {
    let unshare = Command::new("unshare").args(["-m", "true"]).status();
    if effective_uid() != 0 || !unshare.is_ok_and(|s| s.success()) {
        eprintln!("skipped: a read-only bind mount needs root and unshare -m");
        return;
    }
    let host = SimHost::new("t4");
    let m = mps_dirs();
    let o = mps_cmd(&host, &m).arg("-d").output().expect("daemon");
    assert!(o.status.success(), "{}", text(&o));
    let ro = m._dir.path().join("ro");
    std::fs::create_dir(&ro).expect("mount point");
    let script = r#"mount --bind "$PIPE" "$RO" && mount -o remount,bind,ro "$RO" || exit 90
for change in "rm -f $RO/control" "mv $RO/control $RO/moved" "touch $RO/new" "mkdir $RO/sub" "ln -s / $RO/link"; do
  if $change 2>/dev/null; then echo "changed: $change"; fi
done
CUDA_MPS_PIPE_DIRECTORY=$RO exec "$APP"
"#;
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script])
        .env("PIPE", &m.pipe)
        .env("RO", &ro)
        .env("APP", env!("CARGO_BIN_EXE_cuda-app"))
        .env("GPU_SIM_STATE", host.state_file().path())
        .output()
        .expect("unshare");
    let stdout = text(&out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("changed:"), "{stdout}");
    assert!(
        stdout.contains("MPS server "),
        "the client must join the daemon's server: {stdout}"
    );
    assert!(m.pipe.join("control").exists());
}

/// A copy of `cuda-app` in a temporary folder that every user may search, for a client of
/// another user: the build's own copy lies under the checkout, which may be closed to others
/// (a clone into a folder made by `mktemp -d` is mode 0700), and this leaves its modes alone.
fn cuda_app_for_all() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tmp");
    let app = dir.path().join("cuda-app");
    std::fs::copy(env!("CARGO_BIN_EXE_cuda-app"), &app).expect("copy cuda-app");
    open_to_all(&app);
    (dir, app)
}

/// Starts `app` (a copy of `cuda-app`, [`cuda_app_for_all`]) as user `uid` against the
/// daemon at `m`.
fn cuda_app_as(app: &Path, host: &SimHost, m: &Mps, uid: u32) -> Child {
    use std::os::unix::process::CommandExt;
    Command::new(app)
        .env("GPU_SIM_STATE", host.state_file().path())
        .env("CUDA_MPS_PIPE_DIRECTORY", &m.pipe)
        .uid(uid)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn cuda-app")
}

/// Whether `child` exits within `within`.
fn exits_within(child: &mut Child, within: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if child.try_wait().expect("wait").is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The daemon tells users apart by the kernel's credentials for the client's socket, so
/// this needs clients of two real users, which only root can start; elsewhere the same
/// rules are covered by the server's unit tests.
#[test]
fn mps_clients_of_another_user_wait_unless_the_daemon_is_multi_user() {
    if effective_uid() != 0 {
        eprintln!("skipped: starting a client as another user needs root");
        return;
    }
    const OTHER: u32 = 65534;
    for multi_user in [false, true] {
        let host = SimHost::new("t4");
        let m = mps_dirs();
        let mut daemon = mps_cmd(&host, &m);
        daemon.arg("-d");
        if multi_user {
            daemon.arg("-M");
        }
        let o = daemon.output().expect("daemon");
        assert!(o.status.success(), "{}", text(&o));
        open_to_all(&m.pipe.join("control"));
        open_to_all(host.state_file().path());
        let (_app_dir, app) = cuda_app_for_all();

        let held = hold_client(&m.pipe);
        let mut other = cuda_app_as(&app, &host, &m, OTHER);
        if multi_user {
            assert!(
                exits_within(&mut other, Duration::from_secs(10)),
                "-M: a client of another user joins at once"
            );
        } else {
            if exits_within(&mut other, Duration::from_millis(500)) {
                let out = other.wait_with_output().expect("output");
                panic!(
                    "without -M a client of another user waits while root's server has a \
                     client, but it exited: {}",
                    String::from_utf8_lossy(&out.stdout)
                );
            }
            drop(held);
            assert!(
                exits_within(&mut other, Duration::from_secs(10)),
                "the waiting client runs once root's server has no clients"
            );
        }
        let out = other.wait_with_output().expect("output");
        let out = String::from_utf8_lossy(&out.stdout);
        assert!(out.contains("MPS server "), "{out}");
        let log = std::fs::read_to_string(m.log.join("control.log")).expect("log");
        if multi_user {
            assert!(!log.contains(&format!("user {OTHER}")), "{log}");
        } else {
            assert!(
                log.contains("Starting new server") && log.contains(&format!("for user {OTHER}")),
                "{log}"
            );
        }
        let o = ui(&host, &m, "quit\n");
        assert_eq!(o.status.code(), Some(0));
    }
}

/// This process's effective user, from the owner of `/proc/self`.
fn effective_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}
