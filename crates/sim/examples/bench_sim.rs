//! Simulator benchmark: how fast the simulated host answers the driver's calls.
//!
//! Prints medians and p99 for: a full NVML discovery walk of `dgx-a100-40gb` (init, every
//! GPU's identity, MIG devices with their GPU/compute-instance info, shutdown); one NVML
//! query; an `nvidia-smi -c` round trip; an MPS daemon start until its limits are applied
//! (`-f`, wait for the control socket, one client with the limit commands), then `quit`.
//!
//! Run with `make bench` (release); `BENCH_QUICK=1` runs a handful of iterations so that CI
//! proves the benchmark still runs.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if std::env::var_os("BENCH_QUICK").is_some() {
        n.min(3)
    } else {
        n
    }
}

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort_unstable();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (p(0.5), p(0.99))
}

fn report(out: &mut impl Write, what: &str, v: Vec<Duration>) -> anyhow::Result<()> {
    let n = v.len();
    let (p50, p99) = stats(v);
    writeln!(out, "{what:<52} n={n:<5} p50={p50:>10.3?} p99={p99:>10.3?}")?;
    Ok(())
}

fn discovery(nvml: &Nvml) -> anyhow::Result<usize> {
    let mut devices = 0;
    for i in 0..nvml.device_count()? {
        let d = nvml.device_by_index(i)?;
        let _ = (d.name()?, d.uuid()?, d.pci_info()?, d.memory_info()?);
        let _ = (
            d.minor_number()?,
            d.cuda_compute_capability()?,
            d.architecture()?,
        );
        let _ = d.brand()?;
        if d.mig_mode().is_ok_and(|m| m.current == 1) {
            for k in 0..d.mig_device_count()? {
                let Ok(m) = d.mig_device_by_index(k) else {
                    continue;
                };
                let _ = (m.uuid()?, m.attributes()?, m.memory_info()?);
                devices += 1;
            }
        } else {
            devices += 1;
        }
    }
    Ok(devices)
}

fn main() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let host = SimHost::try_new("dgx-a100-40gb")?;
    let lib = host.lib_path();

    let mut walks = Vec::new();
    for _ in 0..scaled(200) {
        let t = Instant::now();
        let nvml = Nvml::builder().lib_path(lib.as_os_str()).init()?;
        let n = discovery(&nvml)?;
        drop(nvml);
        walks.push(t.elapsed());
        anyhow::ensure!(n == 20, "expected 4 whole GPUs and 16 MIG devices, saw {n}");
    }
    report(
        &mut out,
        "NVML discovery walk, dgx-a100-40gb (20 devices)",
        walks,
    )?;

    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init()?;
    let d = nvml.device_by_index(3)?;
    let mut calls = Vec::new();
    for _ in 0..scaled(5000) {
        let t = Instant::now();
        let _ = d.uuid()?;
        calls.push(t.elapsed());
    }
    report(&mut out, "one NVML call (nvmlDeviceGetUUID)", calls)?;
    drop(nvml);

    let smi = host.tool("nvidia-smi");
    let mut smis = Vec::new();
    for k in 0..scaled(50) {
        let mode = if k % 2 == 0 {
            "EXCLUSIVE_PROCESS"
        } else {
            "DEFAULT"
        };
        let t = Instant::now();
        let o = Command::new(&smi).args(["-i", "5", "-c", mode]).output()?;
        smis.push(t.elapsed());
        anyhow::ensure!(o.status.success(), "nvidia-smi failed");
    }
    report(&mut out, "nvidia-smi -i 5 -c <mode> (spawn to exit)", smis)?;

    let mps = host.tool("nvidia-cuda-mps-control");
    let uuid = host.profile().gpus[5].uuid.clone();
    let mut starts = Vec::new();
    for _ in 0..scaled(30) {
        let dir = tempfile::tempdir()?;
        let (pipe, log) = (dir.path().join("pipe"), dir.path().join("log"));
        let t = Instant::now();
        let mut daemon = Command::new(&mps)
            .arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &log)
            .env("CUDA_VISIBLE_DEVICES", &uuid)
            .stdout(Stdio::null())
            .spawn()?;
        while !pipe.join("control").exists() {
            std::thread::sleep(Duration::from_micros(200));
        }
        let client = |input: String| -> anyhow::Result<String> {
            let mut c = Command::new(&mps)
                .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            if let Some(mut stdin) = c.stdin.take() {
                stdin.write_all(input.as_bytes())?;
            }
            let o = c.wait_with_output()?;
            Ok(String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let answer = client(format!(
            "set_default_active_thread_percentage 50\n\
             set_default_device_pinned_mem_limit {uuid} 10240M\n\
             get_default_active_thread_percentage\n"
        ))?;
        starts.push(t.elapsed());
        anyhow::ensure!(answer == "50.0\n", "unexpected answer {answer:?}");
        client("quit\n".to_string())?;
        daemon.wait()?;
    }
    report(&mut out, "MPS daemon start + limits applied (-f)", starts)?;
    Ok(())
}
