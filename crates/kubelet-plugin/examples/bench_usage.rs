//! Benchmark: the CPU cost of one per-claim usage sample on the simulated DGX A100 40GB node
//! (8 GPUs, 4 in MIG mode: 4 whole GPUs and 16 MIG devices), every device held by a prepared
//! claim and running one `cuda-app` under load (20 processes).
//!
//! One sample is what the plugin does every `--usage-interval-seconds`: load and initialise
//! NVML, query the 20 devices (processes, per-process and device utilisation, memory), read
//! each process's cgroup, attribute, publish the series. Prints the median and p99 of the
//! sample's CPU time on its thread (NVML and `/proc`) and of its wall time. The simulated
//! NVML reads `/proc/locks` and each process's record on every process query, work a real
//! driver does in the kernel, so these figures are an upper bound of the plugin's own cost.

// A benchmark's job is to print its figures.
#![allow(clippy::print_stdout)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpu_dra_core::checkpoint::{Checkpoint, ClaimEntry, PrepareState, PreparedDevice};
use gpu_dra_device::GpuInventory;
use gpu_dra_kubelet_plugin::metrics::Metrics;
use gpu_dra_kubelet_plugin::testing::MemoryClaims;
use gpu_dra_kubelet_plugin::usage::Sampler;
use gpu_dra_nvml::usage::NvmlUsage;
use gpu_dra_nvml::{NvmlInventory, NvmlLibrary, NvmlOptions};
use gpu_dra_sim::testing::SimHost;

const RUNS: usize = 200;

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if std::env::var_os("BENCH_QUICK").is_some() {
        n.min(3)
    } else {
        n
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut samples: Vec<f64>) {
    samples.sort_by(f64::total_cmp);
    println!(
        "{name:<24} median {:>8.0} us   p99 {:>8.0} us   ({} runs)",
        percentile(&samples, 0.5) * 1e6,
        percentile(&samples, 0.99) * 1e6,
        samples.len()
    );
}

/// A `cuda-app` under load on device `uuid`, once it runs.
fn start(host: &SimHost, uuid: &str) -> anyhow::Result<Child> {
    let exe = gpu_dra_sim::testing::ensure_built()?.join("cuda-app");
    let mut child = Command::new(exe)
        .env("GPU_SIM_STATE", host.state_file().path())
        .env("CUDA_VISIBLE_DEVICES", uuid)
        .env("CUDA_MPS_PIPE_DIRECTORY", host.root().join("no-mps"))
        .args(["--hold-memory", "1Gi", "--sm-load", "30"])
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    for line in BufReader::new(out).lines() {
        let line = line?;
        if line.starts_with("running on") {
            return Ok(child);
        }
        anyhow::ensure!(!line.starts_with("CUDA error"), "cuda-app: {line}");
    }
    anyhow::bail!("cuda-app ended before running")
}

fn main() -> anyhow::Result<()> {
    let host = SimHost::try_new("dgx-a100-40gb")?;
    let library = NvmlLibrary::Path(host.lib_path());
    let inventory = NvmlInventory::new(NvmlOptions {
        library: library.clone(),
        sysfs_root: host.sysfs_root(),
    })
    .discover()?;
    let mut uuids: Vec<String> = Vec::new();
    for g in &inventory.gpus {
        if g.mig_devices.is_empty() {
            uuids.push(g.uuid.clone());
        } else {
            uuids.extend(g.mig_devices.iter().map(|m| m.uuid.clone()));
        }
    }
    let mut checkpoint = Checkpoint::new();
    for (i, uuid) in uuids.iter().enumerate() {
        let entry = ClaimEntry {
            state: PrepareState::PrepareCompleted,
            namespace: "bench".into(),
            name: format!("claim-{i}"),
            devices: vec![PreparedDevice {
                device: format!("device-{i}"),
                pool: "bench-node".into(),
                request_names: vec!["gpu".into()],
                cdi_device_ids: Vec::new(),
                uuid: uuid.clone(),
                admin_access: false,
                share_id: None,
                memory_share_bytes: None,
                sharing_strategy: None,
                extra: Default::default(),
            }],
            sharing: None,
            boot_id: None,
            driver_version: None,
            imported: None,
            dynamic_mig: Vec::new(),
            extra: Default::default(),
        };
        checkpoint.claims.insert(format!("uid-{i}"), entry);
    }
    let mut children = Vec::new();
    for uuid in &uuids {
        children.push(start(&host, uuid)?);
    }
    let metrics = Metrics::default();
    let mut sampler = Sampler::new(
        Arc::new(NvmlUsage::new(library)),
        Arc::new(MemoryClaims::default()),
        "/proc".into(),
        Duration::from_secs(15),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    let gauge = |text: &str, name: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
    };
    // Warm-up: the first dlopen, the claims' first read.
    runtime.block_on(sampler.sample(&checkpoint, &inventory, &metrics.usage));
    for _ in 0..scaled(RUNS) {
        let usage = runtime.block_on(sampler.sample(&checkpoint, &inventory, &metrics.usage));
        anyhow::ensure!(
            usage
                .iter()
                .all(|u| u.pods.iter().map(|p| p.processes).sum::<u32>() == 1),
            "every claim sees its one process"
        );
        let text = metrics.render();
        cpu.push(gauge(&text, "gpu_dra_usage_sample_cpu_seconds ").unwrap_or(f64::NAN));
        wall.push(gauge(&text, "gpu_dra_usage_sample_duration_seconds ").unwrap_or(f64::NAN));
    }
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    println!(
        "usage sample, {} claims on 20 devices, 20 processes:",
        uuids.len()
    );
    report("cpu per sample", cpu);
    report("wall per sample", wall);
    Ok(())
}
