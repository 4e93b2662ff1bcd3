//! Benchmark: plugin-side prepare latency over the DRA unix socket, and concurrency speedup.
//!
//! In one process: the real DRA gRPC server and driver (claims in memory, fixture inventory
//! like a DGX A100 40GB, simulated device nodes in a temp folder, real CDI and checkpoint
//! writes with fsync) and a tonic client over the socket. Prints:
//! - prepare latency of a one-GPU claim (p50/p99 over many prepare+unprepare cycles);
//! - 64 claims on disjoint devices, one call each, all at once vs one at a time (speedup);
//! - resident memory after warm-up and at the end.
//!
//! Targets: p50 <= 2 ms, p99 <= 10 ms, speedup >= 8x, RSS <= 20 MiB.

// A benchmark's job is to print its figures.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra_device::testing::a100_inventory;
use gpu_dra_kubelet_plugin::grpc::{bind_socket, incoming};
use gpu_dra_kubelet_plugin::testing::{
    DriverBuilder, MemoryClaims, allocated_claim, connect_dra, dra_service, simulate_host,
};
use gpu_dra_proto::dra::v1;

const DRIVER: &str = "gpu.nvidia.com";
const UID_ONE: &str = "0e000000-0000-4000-8000-000000000001";
const NODE: &str = "bench-node";
const LATENCY_ITERS: usize = 400;
const CONCURRENT: usize = 64;
const ROUNDS: usize = 5;

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if std::env::var_os("BENCH_QUICK").is_some() {
        n.min(3)
    } else {
        n
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn claim(i: usize) -> v1::Claim {
    v1::Claim {
        namespace: "bench".into(),
        uid: format!("00000000-0000-4000-8000-{i:012x}"),
        name: format!("c{i}"),
    }
}

async fn start(
    root: &Path,
) -> anyhow::Result<(Arc<MemoryClaims>, std::path::PathBuf, Vec<String>)> {
    // 10 GPUs with MIG on (70 MIG devices) + 8 whole GPUs.
    let inventory = a100_inventory(18, 10);
    simulate_host(&root.join("host"), &inventory)?;
    let devices: Vec<String> = inventory.devices().map(|d| d.name()).collect();
    let claims = Arc::new(MemoryClaims::default());
    let driver = Arc::new(
        DriverBuilder::new(root, inventory)
            .node_name(NODE)
            .claims(claims.clone())
            .build()?,
    );
    let socket = root.join("plugin/dra.sock");
    let listener = bind_socket(&socket)?;
    let service = dra_service(driver);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(service))
            .serve_with_incoming(incoming(listener)),
    );
    Ok((claims, socket, devices))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (claims, socket, devices) = start(dir.path()).await?;
    let whole_gpu = devices
        .iter()
        .find(|d| !d.contains("mig"))
        .cloned()
        .unwrap_or_default();
    for (i, device) in devices.iter().take(CONCURRENT).enumerate() {
        claims.insert(allocated_claim(
            "bench",
            &format!("c{i}"),
            &format!("00000000-0000-4000-8000-{i:012x}"),
            DRIVER,
            NODE,
            &[("gpu", device.as_str())],
            &[],
        ));
    }
    claims.insert(allocated_claim(
        "bench",
        "one",
        UID_ONE,
        DRIVER,
        NODE,
        &[("gpu", whole_gpu.as_str())],
        &[],
    ));
    let one = v1::Claim {
        namespace: "bench".into(),
        uid: UID_ONE.into(),
        name: "one".into(),
    };
    let mut client = connect_dra(socket.clone()).await?;

    // Latency of a one-GPU claim.
    let (latency_iters, rounds) = (scaled(LATENCY_ITERS), scaled(ROUNDS));
    let mut samples = Vec::with_capacity(latency_iters);
    let mut rss_warm = 0;
    for i in 0..latency_iters + 20 {
        let t = Instant::now();
        let r = client
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![one.clone()],
            })
            .await?
            .into_inner();
        let took = t.elapsed();
        anyhow::ensure!(
            r.claims[UID_ONE].error.is_empty(),
            "prepare failed: {}",
            r.claims[UID_ONE].error
        );
        client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![one.clone()],
            })
            .await?;
        if i >= 20 {
            samples.push(took);
        } else if i == 19 {
            rss_warm = rss_kib();
        }
    }
    samples.sort();
    let p50 = percentile(&samples, 0.5);
    let p99 = percentile(&samples, 0.99);

    // 64 claims on disjoint devices: one at a time vs all at once.
    let mut sequential = Vec::new();
    let mut concurrent = Vec::new();
    let unprepare_all = |mut c: gpu_dra_proto::dra::v1::dra_plugin_client::DraPluginClient<
        tonic::transport::Channel,
    >| async move {
        c.node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: (0..CONCURRENT).map(claim).collect(),
        })
        .await
        .map(|_| ())
    };
    for _ in 0..rounds {
        let t = Instant::now();
        for i in 0..CONCURRENT {
            let r = client
                .node_prepare_resources(v1::NodePrepareResourcesRequest {
                    claims: vec![claim(i)],
                })
                .await?
                .into_inner();
            anyhow::ensure!(
                r.claims[&format!("00000000-0000-4000-8000-{i:012x}")]
                    .error
                    .is_empty(),
                "sequential prepare failed"
            );
        }
        sequential.push(t.elapsed());
        unprepare_all(client.clone()).await?;

        let t = Instant::now();
        let calls = (0..CONCURRENT).map(|i| {
            let mut c = client.clone();
            async move {
                c.node_prepare_resources(v1::NodePrepareResourcesRequest {
                    claims: vec![claim(i)],
                })
                .await
                .map(|r| r.into_inner())
            }
        });
        for r in futures::future::join_all(calls).await {
            let r = r?;
            anyhow::ensure!(
                r.claims.values().all(|c| c.error.is_empty()),
                "concurrent prepare failed"
            );
        }
        concurrent.push(t.elapsed());
        unprepare_all(client.clone()).await?;
    }
    sequential.sort();
    concurrent.sort();
    let seq = sequential[rounds / 2];
    let conc = concurrent[rounds / 2];
    let rss_end = rss_kib();

    // The floor set by the disk: one crash-safe small-file write (write, fsync, rename, fsync
    // dir). A prepare does three of them (checkpoint started, CDI spec, checkpoint completed).
    let mut floor = Vec::new();
    for i in 0..scaled(100) {
        let t = Instant::now();
        gpu_dra_fsutil::write_atomic(
            &dir.path().join("floor.json"),
            format!("{i}").as_bytes(),
            0o600,
        )?;
        floor.push(t.elapsed());
    }
    floor.sort();

    println!(
        "bench_prepare (one-GPU claim over the DRA socket, real CDI + checkpoint writes with fsync)"
    );
    println!(
        "  prepare latency: p50 {:.3} ms, p99 {:.3} ms over {} calls (target p50 <= 2 ms, p99 <= 10 ms)",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        samples.len()
    );
    println!(
        "  {CONCURRENT} claims, disjoint devices: one at a time {:.1} ms, all at once {:.1} ms, speedup {:.1}x (target >= 8x; median of {rounds})",
        seq.as_secs_f64() * 1e3,
        conc.as_secs_f64() * 1e3,
        seq.as_secs_f64() / conc.as_secs_f64()
    );
    println!(
        "  disk floor: one atomic small-file write p50 {:.3} ms, p99 {:.3} ms",
        percentile(&floor, 0.5).as_secs_f64() * 1e3,
        percentile(&floor, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "  RSS (plugin and client in one process): {:.1} MiB after warm-up, {:.1} MiB at end (target <= 20 MiB)",
        rss_warm as f64 / 1024.0,
        rss_end as f64 / 1024.0
    );
    Ok(())
}
