//! Benchmark: NVML discovery + slice rendering for the `dgx-a100-40gb` simulated node
//! (8 GPUs, 4 of them in MIG mode: 4 whole GPUs + 16 MIG devices), and the share of the
//! NVLink topology step (one P2P status query per pair of GPUs, 28 on 8 GPUs) in the
//! discovery of a `dgx-h100` (8 whole GPUs behind NVSwitches).
//!
//! Prints the median and p99 of each phase over many runs. Run with `make bench` (release);
//! `BENCH_QUICK=1` runs a handful so that CI proves the benchmark still runs.
//! Discovery includes loading and initialising NVML and shutting it down, as every
//! rediscovery of the publisher does.

// A benchmark's output is its figures on stdout.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use gpu_dra_core::slices::{self, SliceParams};
use gpu_dra_device::GpuInventory;
use gpu_dra_nvml::{NvmlInventory, NvmlOptions};
use gpu_dra_sim::testing::SimHost;

const RUNS: usize = 300;

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if std::env::var_os("BENCH_QUICK").is_some() {
        n.min(3)
    } else {
        n
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    let median = percentile(&samples, 0.5);
    println!(
        "{name:<22} median {:>9.1} us   p99 {:>9.1} us   ({} runs)",
        median.as_secs_f64() * 1e6,
        percentile(&samples, 0.99).as_secs_f64() * 1e6,
        samples.len()
    );
    median
}

fn main() -> anyhow::Result<()> {
    let host = SimHost::try_new("dgx-a100-40gb")?;
    let backend = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(host.lib_path()),
        sysfs_root: host.sysfs_root(),
    });
    let params = SliceParams {
        node_name: "bench-node",
        driver_name: "gpu.nvidia.com",
        generation: 1,
    };
    // Warm up (first dlopen, page cache).
    let inventory = backend.discover()?;
    let devices = inventory.devices().count();

    let (mut discover, mut render, mut total) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..scaled(RUNS) {
        let t0 = Instant::now();
        let inventory = backend.discover()?;
        let t1 = Instant::now();
        let rendered = slices::render_slices(&inventory, &params);
        let t2 = Instant::now();
        std::hint::black_box(&rendered);
        discover.push(t1 - t0);
        render.push(t2 - t1);
        total.push(t2 - t0);
    }
    println!("bench_discover: dgx-a100-40gb simulated node, {devices} devices");
    report("discover (NVML)", discover);
    report("render slices", render);
    let median = report("discover + render", total);
    println!(
        "per device: {:.1} us",
        median.as_secs_f64() * 1e6 / devices as f64
    );
    topology()
}

/// Discovery of the DGX H100 next to its NVLink step alone (same NVML session throughout, so
/// the step's figure is the pair queries and nothing else).
fn topology() -> anyhow::Result<()> {
    let host = SimHost::try_new("dgx-h100")?;
    let library = gpu_dra_nvml::NvmlLibrary::Path(host.lib_path());
    let backend = NvmlInventory::new(NvmlOptions {
        library: library.clone(),
        sysfs_root: host.sysfs_root(),
    });
    let base = backend.discover()?;
    let nvml = library.open()?;
    let handles = (0..base.gpus.len() as u32)
        .map(|i| nvml.device_by_index(i))
        .collect::<Result<Vec<_>, _>>()?;
    let n = base.gpus.len();
    let (mut discover, mut peers) = (Vec::new(), Vec::new());
    for _ in 0..scaled(RUNS) {
        let t0 = Instant::now();
        std::hint::black_box(backend.discover()?);
        discover.push(t0.elapsed());
        let mut gpus = base.gpus.clone();
        let t0 = Instant::now();
        gpu_dra_nvml::topology::fill_nvlink_peers(&mut gpus, &handles);
        peers.push(t0.elapsed());
        std::hint::black_box(&gpus);
    }
    println!(
        "bench_discover: dgx-h100 simulated node, {n} whole GPUs, {} P2P queries",
        n * (n - 1) / 2
    );
    let whole = report("discover (NVML)", discover);
    let step = report("of which NVLink peers", peers);
    println!(
        "NVLink step: {:.1} % of discovery",
        step.as_secs_f64() * 100.0 / whole.as_secs_f64()
    );
    Ok(())
}
