//! Benchmark: MPS claim prepare on the simulator, from the prepare call to a daemon that
//! answered on its pipe with its limits applied; plus unprepare, and time-slicing for
//! comparison. Prints medians and percentiles; the target is an MPS prepare p50 <= 300 ms.
//!
//! Run with `make bench` (release). The simulated host comes from `gpu_dra_sim::testing`,
//! which builds the simulator into the same target directory first.

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra_api::{DeviceKey, Interval, MpsConfig, Sharing};
use gpu_dra_kubelet_plugin::node_layout;
use gpu_dra_kubelet_plugin::sharing::{
    DriverRoot, FileStore, SharedDevice, SharingManager, SharingMetrics, SharingOptions,
};
use gpu_dra_sim::testing::SimHost;

const ITERATIONS: usize = 40;
const PROFILE: &str = "dgx-a100-40gb";

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
    sorted[i]
}

fn report(name: &str, mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p50 = percentile(&samples, 0.5);
    println!(
        "{name:<34} n={:<3} p50={:>8.2} ms  p90={:>8.2} ms  p99={:>8.2} ms  max={:>8.2} ms",
        samples.len(),
        ms(p50),
        ms(percentile(&samples, 0.9)),
        ms(percentile(&samples, 0.99)),
        ms(samples[samples.len() - 1]),
    );
    p50
}

#[tokio::main]
async fn main() {
    let host = SimHost::new(PROFILE);
    let plugin_dir = tempfile::tempdir().unwrap();
    let opts = SharingOptions::new(DriverRoot::new(host.root(), None), plugin_dir.path());
    let store = Arc::new(FileStore::new(node_layout::sharing_state_in(
        plugin_dir.path(),
    )));
    let m = SharingManager::new(opts, store, SharingMetrics::default()).unwrap();

    // Whole GPUs of the profile (GPUs 4-7 have MIG disabled).
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(host.root().join("etc/gpu-sim/state.json")).unwrap())
            .unwrap();
    let uuids: Vec<String> = state
        .pointer("/profile/gpus")
        .and_then(|g| g.as_array())
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_string())
        .collect();
    let (g4, g5) = (&uuids[4], &uuids[5]);

    let one_gpu = (
        vec![SharedDevice::gpu(g4)],
        Sharing::Mps(MpsConfig {
            active_thread_percentage: Some(50),
            pinned_memory_limit_mib: Some(4096),
            ..Default::default()
        }),
    );
    let two_gpus = (
        vec![SharedDevice::gpu(g4), SharedDevice::gpu(g5)],
        Sharing::Mps(MpsConfig {
            active_thread_percentage: Some(50),
            pinned_memory_limit_mib: Some(4096),
            per_device_pinned_memory_limit_mib: [(DeviceKey::Index(1), 2048)].into(),
            multi_user: false,
        }),
    );
    let timeslice = (
        vec![SharedDevice::gpu(g4)],
        Sharing::TimeSlicing {
            interval: Interval::Long,
        },
    );

    let (iterations, build) = (
        scaled(ITERATIONS),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    );
    println!("sharing on the simulator ({PROFILE}), {iterations} claims each, {build} build");
    let mut mps_p50 = Duration::ZERO;
    for (name, (devices, sharing)) in [
        ("MPS prepare, 1 GPU", &one_gpu),
        ("MPS prepare, 2 GPUs + per-device", &two_gpus),
        ("time-slicing prepare, 1 GPU", &timeslice),
    ] {
        let mut prepare = Vec::new();
        let mut unprepare = Vec::new();
        for i in 0..iterations {
            let claim = format!("00000000-0000-4000-8000-{i:012}");
            let t = Instant::now();
            m.prepare("bench", &claim, "0", devices, sharing)
                .await
                .unwrap();
            prepare.push(t.elapsed());
            let t = Instant::now();
            m.unprepare(&claim).await.unwrap();
            unprepare.push(t.elapsed());
        }
        let p50 = report(name, prepare);
        if name == "MPS prepare, 1 GPU" {
            mps_p50 = p50;
        }
        report(&name.replace("prepare", "unprepare"), unprepare);
    }
    println!(
        "MPS prepare p50 {:.1} ms vs target 300 ms: {:.1}x under target",
        mps_p50.as_secs_f64() * 1e3,
        0.3 / mps_p50.as_secs_f64()
    );
}
