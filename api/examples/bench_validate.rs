//! Benchmark: decode + validate of typical opaque configs and `check_object` of a typical
//! ResourceClaim. Prints per-call median and p99 (`make bench`, release mode; `BENCH_QUICK=1`
//! runs a handful of iterations so that CI proves the benchmark still runs).
#![allow(clippy::print_stdout)] // printing figures is what a benchmark is for

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpu_dra_api::{ClaimDevice, decode, decode_yaml, objects, validate_for_devices};
use serde_json::{Value, json};

const ITERATIONS: usize = 20_000;
const WARMUP: usize = 2_000;

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if std::env::var_os("BENCH_QUICK").is_some() {
        n.min(3)
    } else {
        n
    }
}

/// Times `f` once per iteration; returns the sorted per-call durations.
fn measure(mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..scaled(WARMUP) {
        f();
    }
    let mut samples: Vec<Duration> = (0..scaled(ITERATIONS))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    samples.sort_unstable();
    samples
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, samples: &[Duration]) -> Duration {
    let median = percentile(samples, 0.5);
    println!(
        "{name:<44} median {:>8.2} us   p99 {:>8.2} us",
        median.as_secs_f64() * 1e6,
        percentile(samples, 0.99).as_secs_f64() * 1e6
    );
    median
}

fn main() {
    let gpu = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c";
    let time_slicing = json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    });
    let mps = json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "5Gi",
            "defaultPerDevicePinnedMemoryLimit": {"0": "10Gi", gpu: "1.5Gi"}}}
    });
    let mig = json!({
        "apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}
    });
    // The claim's MIG request gets no sharing: one claim may carry one MPS config only.
    let mig_exclusive = json!({"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "MigDeviceConfig"});
    let invalid = json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "Time-Slicing", "mpsConfig": {"defaultActiveThreadPercentage": 0}}
    });
    let mps_yaml = "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  \
        strategy: MPS\n  mpsConfig:\n    defaultActiveThreadPercentage: 50\n    \
        defaultPinnedDeviceMemoryLimit: 5Gi\n";
    let claim: Value = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "shared", "namespace": "ml"},
        "spec": {"devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
                {"name": "mig", "firstAvailable": [
                    {"name": "small", "deviceClassName": "mig.nvidia.com"},
                    {"name": "big", "deviceClassName": "mig.nvidia.com"}]}
            ],
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": mps}},
                {"requests": ["mig"], "opaque": {"driver": "gpu.nvidia.com", "parameters": mig_exclusive}}
            ]
        }}
    });
    let devices = [
        ClaimDevice::gpu(gpu),
        ClaimDevice::gpu("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"),
    ];
    let decoded_mps = decode(&mps).expect("valid");
    let report_of_claim = objects::check_object(&claim, "gpu.nvidia.com");
    assert!(
        report_of_claim.is_ok(),
        "the benchmark's claim must be valid: {report_of_claim:?}"
    );

    println!(
        "gpu-dra-api bench_validate: {} calls each, per-call figures",
        scaled(ITERATIONS)
    );
    let ts = report(
        "decode TimeSlicing GpuConfig",
        &measure(|| {
            black_box(decode(black_box(&time_slicing)).is_ok());
        }),
    );
    let m = report(
        "decode MPS GpuConfig (limits, 2 per-device)",
        &measure(|| {
            black_box(decode(black_box(&mps)).is_ok());
        }),
    );
    report(
        "decode MPS MigDeviceConfig",
        &measure(|| {
            black_box(decode(black_box(&mig)).is_ok());
        }),
    );
    report(
        "decode invalid config (2 errors)",
        &measure(|| {
            black_box(decode(black_box(&invalid)).is_err());
        }),
    );
    let y = report(
        "decode_yaml MPS GpuConfig",
        &measure(|| {
            black_box(decode_yaml(black_box(mps_yaml)).is_ok());
        }),
    );
    report(
        "validate_for_devices MPS, 2 GPUs",
        &measure(|| {
            black_box(validate_for_devices(black_box(&decoded_mps), black_box(&devices)).is_ok());
        }),
    );
    let c = report(
        "check_object ResourceClaim (2 configs)",
        &measure(|| {
            black_box(objects::check_object(black_box(&claim), "gpu.nvidia.com").is_ok());
        }),
    );
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "ratios (medians): MPS/TimeSlicing decode {:.2}x, YAML/JSON decode {:.2}x, \
         check_object/decode MPS {:.2}x",
        ratio(m, ts),
        ratio(y, m),
        ratio(c, m)
    );
}
