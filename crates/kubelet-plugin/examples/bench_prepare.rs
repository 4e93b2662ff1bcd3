//! Benchmark: plugin-side prepare and unprepare over the DRA unix socket, against the disk's
//! floor, with the node's real inventory path, and the syscalls each operation makes.
//!
//! Every part runs the real DRA gRPC server and driver with a tonic client over the socket
//! (claims in memory, real CDI and checkpoint writes with fsync). Prints:
//! 1. fixture inventory like a DGX A100 40GB (10 GPUs with MIG, 8 whole), simulated device
//!    nodes: p50/p99 of a one-GPU claim's prepare and unprepare, the durable-write floor of
//!    the same run (one crash-safe small-file write: write, fsync, rename, fsync the folder)
//!    and the ratios against it, and the checkpoint journal's commit alone (a record appended
//!    to a preallocated file, one `fdatasync`: what an operation now writes instead); one of
//!    each disk write follows each prepare/unprepare cycle, so that a load on the shared disk
//!    weighs on both sides of the ratio alike; the transport alone (a call with no claim) and unprepare's
//!    p50 split into journal commit, transport and the rest; 64 claims on disjoint devices, all at
//!    once vs one at a time, with the CPU per prepare of each and the bound the CPU sets on the
//!    speedup (a burst cannot end before 64 x its CPU per call / cores); resident memory. Targets: prepare p50 <= 2.5x the floor, unprepare p50 <= 1.5x, the
//!    burst >= 16x faster than one at a time, RSS <= 20 MiB.
//! 2. the NVML backend over the GPU simulator (`dgx-a100-40gb`: 8 GPUs, 20 devices;
//!    `dgx-h100`: 8 GPUs) and the plugin's sharing manager (its state file included), with
//!    the simulated NVML made as slow per call as a real driver
//!    (`GPU_SIM_CALL_DELAY_US`, default [`ASSUMED_CALL_DELAY_US`]) and an NVML session held
//!    open beside the driver, as the plugin's health watch holds one: prepare and unprepare
//!    p50/p99 of a whole-GPU and a MIG claim, and what one whole-node NVML discovery costs
//!    (what every prepare paid before prepare checked only its claim's devices). Each profile
//!    runs in a child process: the simulator reads its delay once per process.
//! 3. syscalls per prepare and per unprepare (fsync family, stat family, readlink, rename:
//!    a file written through a new temp file), median
//!    over cycles, and on the fixture those of 64 prepares at once (the group commit's
//!    fsyncs): children run under `strace -f` and mark each operation's start and end
//!    with a `statx` of a path under `/bench-mark/`, so only the syscalls between the marks
//!    count. Tracing is the one way to count `statx` and `readlink` without instrumenting the
//!    code (the kernel's per-process I/O counters count only reads and writes); it slows the
//!    traced run, so the counts come from separate runs that are not timed. Needs `strace`;
//!    skipped without it, with `BENCH_SYSCALLS=0`, and in quick mode unless
//!    `BENCH_SYSCALLS=1`.
//!
//! `BENCH_QUICK=1` (`make bench-check`): a handful of iterations of each part.

// A benchmark's job is to print its figures.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use gpu_dra_device::testing::a100_inventory;
use gpu_dra_device::{GpuInventory, HealthSource, Inventory};
use gpu_dra_kubelet_plugin::grpc::{bind_socket, incoming};
use gpu_dra_kubelet_plugin::sharing::{
    DriverRoot, FileStore, SharingManager, SharingMetrics, SharingOptions,
};
use gpu_dra_kubelet_plugin::testing::{
    DriverBuilder, MemoryClaims, allocated_claim, connect_dra, dra_service, simulate_host,
};
use gpu_dra_nvml::{NvmlInventory, NvmlOptions};
use gpu_dra_proto::dra::v1;
use gpu_dra_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpu_dra_sim::testing::SimHost;
use tonic::transport::Channel;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "bench-node";
const LATENCY_ITERS: usize = 400;
const NVML_ITERS: usize = 200;
const WARMUP: usize = 20;
const CONCURRENT: usize = 64;
const ROUNDS: usize = 5;
const SYSCALL_CYCLES: usize = 30;
/// Simulator profiles of part 2.
const PROFILES: [&str; 2] = ["dgx-a100-40gb", "dgx-h100"];
/// Assumed cost of one NVML call on a real driver, in microseconds: a query is an ioctl into
/// the driver's resource manager. No per-call figure was measured on a real host; this one
/// fits the one real figure we have, `discover` on an H100 host with driver 580 taking 29 ms
/// of wall time for process start, library load, `nvmlInit` and some 40 calls.
const ASSUMED_CALL_DELAY_US: u64 = 20;
/// Environment variable selecting what a child process runs.
const PHASE: &str = "BENCH_PREPARE_PHASE";
/// Folder of the marker paths in traced runs (never exists).
const MARK: &str = "/bench-mark/";

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

/// `n`, or a handful with `BENCH_QUICK` set (`make bench-check`).
fn scaled(n: usize) -> usize {
    if quick() { n.min(3) } else { n }
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

/// CPU time this process's threads have run so far (`/proc/self/task/*/schedstat`, in
/// nanoseconds; a thread that ended is no longer counted, so measure spans in which the
/// runtime's threads live).
fn cpu_time() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let ns: u64 = tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn uid(i: usize) -> String {
    format!("00000000-0000-4000-8000-{i:012x}")
}

fn claim(i: usize) -> v1::Claim {
    v1::Claim {
        namespace: "bench".into(),
        uid: uid(i),
        name: format!("c{i}"),
    }
}

/// A driver serving the DRA socket in this process, and a client of it.
struct Node {
    claims: Arc<MemoryClaims>,
    client: DraPluginClient<Channel>,
    inventory: Inventory,
    /// Where the checkpoint lives (the floor is measured here).
    dir: tempfile::TempDir,
    /// The simulated host, the NVML backend and the stop flag of its health watch.
    nvml: Option<(SimHost, Arc<NvmlInventory>, Arc<AtomicBool>)>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some((_, _, stop)) = &self.nvml {
            stop.store(true, Ordering::SeqCst);
        }
    }
}

impl Node {
    /// A node on a fixture inventory: 10 GPUs with MIG on (70 MIG devices) + 8 whole GPUs.
    async fn fixture() -> anyhow::Result<Node> {
        let dir = tempfile::tempdir()?;
        let inventory = a100_inventory(18, 10);
        simulate_host(&dir.path().join("host"), &inventory)?;
        let builder = DriverBuilder::new(dir.path(), inventory.clone());
        Node::serve(dir, inventory, builder, None).await
    }

    /// A node on the NVML backend over a simulated host of `profile`, with an NVML session
    /// held open by a health watch beside it, as in the plugin.
    async fn nvml(profile: &str) -> anyhow::Result<Node> {
        let dir = tempfile::tempdir()?;
        let host = SimHost::try_new(profile)?;
        let backend = Arc::new(NvmlInventory::new(NvmlOptions {
            library: gpu_dra_nvml::NvmlLibrary::Path(host.lib_path()),
            sysfs_root: host.sysfs_root(),
        }));
        let inventory = backend.discover()?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (backend, stop) = (backend.clone(), stop.clone());
            let gpus: Vec<String> = inventory.gpus.iter().map(|g| g.uuid.clone()).collect();
            std::thread::spawn(move || {
                let _ = backend.watch(&gpus, Duration::from_secs(3600), &stop, &mut |_| {});
            });
        }
        // The plugin's sharing manager, its state in `<plugin-dir>/sharing.json`: a claim
        // without sharing must not write it.
        let sharing = SharingManager::new(
            SharingOptions::new(
                DriverRoot::new(host.root(), Some(host.lib_path())),
                dir.path().join("plugin"),
            ),
            Arc::new(FileStore::new(dir.path().join("plugin/sharing.json"))),
            SharingMetrics::default(),
        )?;
        let builder = DriverBuilder::new(dir.path(), inventory.clone())
            .host(host.root())
            .backend(backend.clone())
            .sharing(Arc::new(sharing));
        Node::serve(dir, inventory, builder, Some((host, backend, stop))).await
    }

    async fn serve(
        dir: tempfile::TempDir,
        inventory: Inventory,
        builder: DriverBuilder,
        nvml: Option<(SimHost, Arc<NvmlInventory>, Arc<AtomicBool>)>,
    ) -> anyhow::Result<Node> {
        let claims = Arc::new(MemoryClaims::default());
        // The plugin reads the node's boot ID at start; so does the bench.
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
        let driver = Arc::new(
            builder
                .node_name(NODE)
                .claims(claims.clone())
                .boot_id(boot_id.trim())
                .build()?,
        );
        let socket = dir.path().join("plugin/dra.sock");
        let listener = bind_socket(&socket)?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(dra_service(
                    driver,
                )))
                .serve_with_incoming(incoming(listener)),
        );
        let client = connect_dra(socket).await?;
        Ok(Node {
            claims,
            client,
            inventory,
            dir,
            nvml,
        })
    }

    /// Allocates claim number `i` the one device `device`.
    fn allocate(&self, i: usize, device: &str) {
        self.claims.insert(allocated_claim(
            "bench",
            &format!("c{i}"),
            &uid(i),
            DRIVER,
            NODE,
            &[("gpu", device)],
            &[],
        ));
    }

    /// The first whole GPU and the first MIG device of the inventory.
    fn one_gpu_and_one_mig(&self) -> (Option<String>, Option<String>) {
        let names: Vec<String> = self.inventory.devices().map(|d| d.name()).collect();
        (
            names.iter().find(|d| !d.contains("-mig-")).cloned(),
            names.iter().find(|d| d.contains("-mig-")).cloned(),
        )
    }

    async fn prepare(&mut self, claims: Vec<v1::Claim>) -> anyhow::Result<()> {
        let r = self
            .client
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
            .await?
            .into_inner();
        for (uid, c) in &r.claims {
            anyhow::ensure!(c.error.is_empty(), "prepare of {uid} failed: {}", c.error);
        }
        Ok(())
    }

    async fn unprepare(&mut self, claims: Vec<v1::Claim>) -> anyhow::Result<()> {
        let r = self
            .client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
            .await?
            .into_inner();
        for (uid, c) in &r.claims {
            anyhow::ensure!(c.error.is_empty(), "unprepare of {uid} failed: {}", c.error);
        }
        Ok(())
    }

    /// Prepare and unprepare latencies of claim `i` over `iters` cycles, with one durable-write
    /// floor and one journal commit after each cycle when `disk` is given: the disk's figures
    /// under the same load as the calls'.
    async fn cycles_beside(
        &mut self,
        i: usize,
        iters: usize,
        mut disk: Option<&mut Disk>,
    ) -> anyhow::Result<Cycles> {
        let mut c = Cycles::default();
        for n in 0..iters + WARMUP {
            let t = Instant::now();
            self.prepare(vec![claim(i)]).await?;
            let p = t.elapsed();
            let t = Instant::now();
            self.unprepare(vec![claim(i)]).await?;
            let u = t.elapsed();
            let samples = match disk.as_deref_mut() {
                Some(disk) => Some((disk.floor(n)?, disk.commit()?)),
                None => None,
            };
            if n >= WARMUP {
                c.prepares.push(p);
                c.unprepares.push(u);
                if let Some((floor, journal)) = samples {
                    c.floor.push(floor);
                    c.journal.push(journal);
                }
            }
        }
        for v in [
            &mut c.prepares,
            &mut c.unprepares,
            &mut c.floor,
            &mut c.journal,
        ] {
            v.sort();
        }
        Ok(c)
    }
}

/// Sorted latencies of a cycle run: the calls' and the disk's beside them.
#[derive(Default)]
struct Cycles {
    prepares: Vec<Duration>,
    unprepares: Vec<Duration>,
    /// Durable-write floor: one crash-safe small-file write (write, fsync, rename, fsync the
    /// folder) next to the checkpoint.
    floor: Vec<Duration>,
    /// The checkpoint journal's commit alone: a record of a one-GPU claim's size appended to a
    /// preallocated journal, one `fdatasync` (what a prepare or unprepare writes instead of
    /// the floor's write).
    journal: Vec<Duration>,
}

/// The disk's own figures, next to the checkpoint.
struct Disk {
    dir: PathBuf,
    log: gpu_dra_fsutil::record_log::RecordLog,
    record: Vec<u8>,
}

impl Disk {
    fn new(dir: &Path) -> anyhow::Result<Disk> {
        let (mut log, _) = gpu_dra_fsutil::record_log::RecordLog::open(
            &dir.join("bench.journal"),
            1 << 20,
            0o600,
        )?;
        log.reset(0)?;
        Ok(Disk {
            dir: dir.to_owned(),
            log,
            record: vec![b'x'; 700],
        })
    }

    fn floor(&mut self, i: usize) -> anyhow::Result<Duration> {
        let t = Instant::now();
        gpu_dra_fsutil::write_atomic(
            &self.dir.join("floor.json"),
            format!("{i}").as_bytes(),
            0o600,
        )?;
        Ok(t.elapsed())
    }

    fn commit(&mut self) -> anyhow::Result<Duration> {
        if !self.log.fits(self.record.len()) {
            self.log.reset(0)?;
        }
        let t = Instant::now();
        self.log.append(&self.record)?;
        Ok(t.elapsed())
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Part 1: the fixture inventory.
async fn fixture_part() -> anyhow::Result<()> {
    let mut node = Node::fixture().await?;
    let devices: Vec<String> = node.inventory.devices().map(|d| d.name()).collect();
    for (i, device) in devices.iter().take(CONCURRENT).enumerate() {
        node.allocate(i, device);
    }
    let (whole, _) = node.one_gpu_and_one_mig();
    let one = CONCURRENT;
    node.allocate(one, &whole.context("no whole GPU")?);

    let mut disk = Disk::new(node.dir.path())?;
    let Cycles {
        prepares,
        unprepares,
        floor,
        journal,
    } = node
        .cycles_beside(one, scaled(LATENCY_ITERS), Some(&mut disk))
        .await?;
    let rss_warm = rss_kib();
    // What a call costs that has nothing to do (an unknown claim's unprepare): the socket,
    // gRPC and the engine's bookkeeping, without a durable write.
    let mut idle = Vec::new();
    for _ in 0..scaled(LATENCY_ITERS) {
        let t = Instant::now();
        node.unprepare(vec![claim(CONCURRENT + 1)]).await?;
        idle.push(t.elapsed());
    }
    idle.sort();
    // The transport alone: a call with no claim, answered before the engine is asked.
    let mut empty = Vec::new();
    for _ in 0..scaled(LATENCY_ITERS) {
        let t = Instant::now();
        node.unprepare(Vec::new()).await?;
        empty.push(t.elapsed());
    }
    empty.sort();

    // 64 claims on disjoint devices: one at a time vs all at once.
    let rounds = scaled(ROUNDS);
    let (mut sequential, mut concurrent) = (Vec::new(), Vec::new());
    let (mut cpu_sequential, mut cpu_concurrent) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let (t, cpu) = (Instant::now(), cpu_time());
        for i in 0..CONCURRENT {
            node.prepare(vec![claim(i)]).await?;
        }
        sequential.push(t.elapsed());
        cpu_sequential += cpu_time().saturating_sub(cpu);
        node.unprepare((0..CONCURRENT).map(claim).collect()).await?;

        let (t, cpu) = (Instant::now(), cpu_time());
        let calls = (0..CONCURRENT).map(|i| {
            let mut c = node.client.clone();
            async move {
                c.node_prepare_resources(v1::NodePrepareResourcesRequest {
                    claims: vec![claim(i)],
                })
                .await
                .map(|r| r.into_inner())
            }
        });
        for r in futures::future::join_all(calls).await {
            anyhow::ensure!(
                r?.claims.values().all(|c| c.error.is_empty()),
                "concurrent prepare failed"
            );
        }
        concurrent.push(t.elapsed());
        cpu_concurrent += cpu_time().saturating_sub(cpu);
        node.unprepare((0..CONCURRENT).map(claim).collect()).await?;
    }
    let per_call = |cpu: Duration| cpu / (rounds * CONCURRENT) as u32;
    sequential.sort();
    concurrent.sort();
    let (seq, conc) = (sequential[rounds / 2], concurrent[rounds / 2]);
    let rss_end = rss_kib();

    let floor_p50 = percentile(&floor, 0.5);
    let ratio = |d: &[Duration]| ms(percentile(d, 0.5)) / ms(floor_p50);
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "bench_prepare: fixture inventory (18 GPUs, 78 devices), one-GPU claim over the DRA socket, real CDI + checkpoint writes with fsync"
    );
    println!(
        "  durable-write floor (write, fsync, rename, fsync folder; one after each prepare/unprepare cycle): p50 {:.3} ms, p99 {:.3} ms",
        ms(floor_p50),
        ms(percentile(&floor, 0.99))
    );
    println!(
        "  checkpoint journal commit alone (700-byte record into a preallocated file, fdatasync; one after each cycle): p50 {:.3} ms, p99 {:.3} ms = {:.2}x the floor",
        ms(percentile(&journal, 0.5)),
        ms(percentile(&journal, 0.99)),
        ratio(&journal)
    );
    println!(
        "  prepare:   p50 {:.3} ms, p99 {:.3} ms over {} calls: {:.2}x the floor (target <= 2.5x: {})",
        ms(percentile(&prepares, 0.5)),
        ms(percentile(&prepares, 0.99)),
        prepares.len(),
        ratio(&prepares),
        verdict(ratio(&prepares) <= 2.5)
    );
    println!(
        "  unprepare: p50 {:.3} ms, p99 {:.3} ms over {} calls: {:.2}x the floor (target <= 1.5x: {})",
        ms(percentile(&unprepares, 0.5)),
        ms(percentile(&unprepares, 0.99)),
        unprepares.len(),
        ratio(&unprepares),
        verdict(ratio(&unprepares) <= 1.5)
    );
    println!(
        "  a call with nothing to write (unknown claim's unprepare): p50 {:.3} ms, p99 {:.3} ms",
        ms(percentile(&idle, 0.5)),
        ms(percentile(&idle, 0.99))
    );
    let (unprepare_p50, empty_p50) = (percentile(&unprepares, 0.5), percentile(&empty, 0.5));
    println!(
        "  the transport alone (a call with no claim: tonic client, h2 over the socket, tonic server): p50 {:.3} ms, p99 {:.3} ms = {:.2}x the floor",
        ms(empty_p50),
        ms(percentile(&empty, 0.99)),
        ms(empty_p50) / ms(floor_p50)
    );
    println!(
        "  unprepare p50 split: journal commit {:.3} + transport {:.3} + the rest {:.3} ms (engine, CDI spec removal, the hop to the blocking pool)",
        ms(percentile(&journal, 0.5)),
        ms(empty_p50),
        ms(unprepare_p50) - ms(percentile(&journal, 0.5)) - ms(empty_p50)
    );
    let speedup = seq.as_secs_f64() / conc.as_secs_f64();
    println!(
        "  {CONCURRENT} claims, disjoint devices: one at a time {:.1} ms, all at once {:.1} ms, speedup {speedup:.1}x (target >= 16x: {}; median of {rounds})",
        ms(seq),
        ms(conc),
        verdict(speedup >= 16.0)
    );
    let (cpu_seq, cpu_conc) = (per_call(cpu_sequential), per_call(cpu_concurrent));
    println!(
        "  CPU per prepare (client and plugin, all threads): one at a time {:.0} us, all at once {:.0} us; at once on {} cores the burst cannot end before {:.1} ms, {:.1}x the one-at-a-time time",
        cpu_seq.as_secs_f64() * 1e6,
        cpu_conc.as_secs_f64() * 1e6,
        cores(),
        ms(cpu_conc * CONCURRENT as u32) / cores() as f64,
        seq.as_secs_f64() / ((cpu_conc * CONCURRENT as u32).as_secs_f64() / cores() as f64)
    );
    println!(
        "  RSS (plugin and client in one process): {:.1} MiB after warm-up, {:.1} MiB at end (target <= 20 MiB)",
        rss_warm as f64 / 1024.0,
        rss_end as f64 / 1024.0
    );
    Ok(())
}

/// Part 2 for one profile (a child process).
async fn nvml_part(profile: &str) -> anyhow::Result<()> {
    let mut node = Node::nvml(profile).await?;
    let (whole, mig) = node.one_gpu_and_one_mig();
    let iters = scaled(NVML_ITERS);
    let gpus = node.inventory.gpus.len();
    let count = node.inventory.devices().count();
    println!("  {profile} ({gpus} GPUs, {count} devices)");
    let mut disk = Disk::new(node.dir.path())?;
    for (i, (kind, device)) in [("whole GPU", whole), ("MIG device", mig)]
        .into_iter()
        .enumerate()
    {
        let Some(device) = device else { continue };
        node.allocate(i, &device);
        let c = node.cycles_beside(i, iters, Some(&mut disk)).await?;
        let floor_p50 = percentile(&c.floor, 0.5);
        let (p, u) = (&c.prepares, &c.unprepares);
        println!(
            "    {kind:<10} prepare p50 {:.3} ms ({:.2}x floor), p99 {:.3} ms; unprepare p50 {:.3} ms ({:.2}x floor), p99 {:.3} ms; floor p50 {:.3} ms, journal commit p50 {:.3} ms (one each after every cycle)",
            ms(percentile(p, 0.5)),
            ms(percentile(p, 0.5)) / ms(floor_p50),
            ms(percentile(p, 0.99)),
            ms(percentile(u, 0.5)),
            ms(percentile(u, 0.5)) / ms(floor_p50),
            ms(percentile(u, 0.99)),
            ms(floor_p50),
            ms(percentile(&c.journal, 0.5)),
        );
    }
    if let Some((_, backend, _)) = &node.nvml {
        let mut walks = Vec::new();
        for _ in 0..scaled(50) {
            let t = Instant::now();
            backend.discover()?;
            walks.push(t.elapsed());
        }
        walks.sort();
        println!(
            "    one whole-node NVML discovery (every prepare made one before it checked only its claim's devices): p50 {:.3} ms, p99 {:.3} ms",
            ms(percentile(&walks, 0.5)),
            ms(percentile(&walks, 0.99))
        );
    }
    Ok(())
}

/// Syscall families counted per operation.
const FAMILIES: [(&str, &[&str]); 4] = [
    (
        "fsync",
        &["fsync", "fdatasync", "syncfs", "sync_file_range", "sync"],
    ),
    (
        "stat",
        &[
            "statx",
            "newfstatat",
            "fstatat64",
            "stat",
            "lstat",
            "fstat",
            "stat64",
            "lstat64",
            "fstat64",
        ],
    ),
    ("readlink", &["readlink", "readlinkat"]),
    // A rename is a file written through a new temp file: a new inode.
    ("rename", &["rename", "renameat", "renameat2"]),
];

/// Part 3 in the traced child: marked cycles of one-GPU claims on `backend`.
async fn syscalls_child(backend: &str) -> anyhow::Result<()> {
    let mut node = match backend {
        "fixture" => Node::fixture().await?,
        profile => Node::nvml(profile).await?,
    };
    let (whole, _) = node.one_gpu_and_one_mig();
    node.allocate(0, &whole.context("no whole GPU")?);
    let mark = |label: &str| {
        let _ = std::fs::metadata(format!("{MARK}{label}"));
    };
    for n in 0..scaled(SYSCALL_CYCLES) + 5 {
        // The first cycles warm up (first writes create folders and files).
        let counted = n >= 5;
        if counted {
            mark("prepare-begin");
        }
        node.prepare(vec![claim(0)]).await?;
        if counted {
            mark("prepare-end");
            mark("unprepare-begin");
        }
        node.unprepare(vec![claim(0)]).await?;
        if counted {
            mark("unprepare-end");
        }
    }
    if backend == "fixture" {
        // A burst of claims on disjoint devices, each in its own call: how many durable
        // writes the group commit makes for all of them.
        let devices: Vec<String> = node.inventory.devices().map(|d| d.name()).collect();
        for (i, device) in devices.iter().take(CONCURRENT).enumerate() {
            node.allocate(i + 1, device);
        }
        for round in 0..3 {
            let label = if round == 0 { "warm" } else { "burst" };
            mark(&format!("{label}-begin"));
            let calls = (1..=CONCURRENT).map(|i| {
                let mut c = node.client.clone();
                async move {
                    c.node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: vec![claim(i)],
                    })
                    .await
                }
            });
            for r in futures::future::join_all(calls).await {
                r?;
            }
            mark(&format!("{label}-end"));
            node.unprepare((1..=CONCURRENT).map(claim).collect())
                .await?;
        }
    }
    Ok(())
}

/// Medians per operation and family from a `strace -f` log with the marks of
/// [`syscalls_child`].
fn count_syscalls(log: &str) -> BTreeMap<(String, &'static str), usize> {
    let mut per_op: BTreeMap<(String, &'static str), Vec<usize>> = BTreeMap::new();
    let mut open: Option<(String, BTreeMap<&'static str, usize>)> = None;
    for line in log.lines() {
        if line.contains(" resumed>") || line.contains("+++") || line.contains("---") {
            continue;
        }
        if let Some(at) = line.find(MARK) {
            let label = line[at + MARK.len()..]
                .split('"')
                .next()
                .unwrap_or_default();
            if let Some(op) = label.strip_suffix("-begin") {
                open = Some((op.to_owned(), BTreeMap::new()));
            } else if let Some((op, counts)) = open.take() {
                for (family, _) in FAMILIES {
                    per_op
                        .entry((op.clone(), family))
                        .or_default()
                        .push(counts.get(family).copied().unwrap_or(0));
                }
            }
            continue;
        }
        let Some((_, counts)) = open.as_mut() else {
            continue;
        };
        // `<pid> name(args...) = result`
        let call = line
            .split_once(' ')
            .map_or(line, |(first, rest)| {
                if first.chars().all(|c| c.is_ascii_digit()) {
                    rest.trim_start()
                } else {
                    line
                }
            })
            .split('(')
            .next()
            .unwrap_or_default();
        if let Some((family, _)) = FAMILIES.iter().find(|(_, names)| names.contains(&call)) {
            *counts.entry(family).or_default() += 1;
        }
    }
    per_op
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_unstable();
            (k, v[v.len() / 2])
        })
        .collect()
}

/// Part 3: runs [`syscalls_child`] under strace for the fixture and each profile.
fn syscalls_part(exe: &Path) -> anyhow::Result<()> {
    let wanted = match std::env::var("BENCH_SYSCALLS").ok().as_deref() {
        Some("0") => false,
        Some(_) => true,
        None => !quick(),
    };
    if !wanted {
        println!("  syscall counts: skipped (BENCH_SYSCALLS=1 counts them in quick mode)");
        return Ok(());
    }
    if Command::new("strace").arg("-V").output().is_err() {
        println!("  syscall counts: skipped (strace is not installed)");
        return Ok(());
    }
    println!(
        "bench_prepare: syscalls per operation of a one-GPU claim (strace -f, median of {} cycles)",
        scaled(SYSCALL_CYCLES)
    );
    let dir = tempfile::tempdir()?;
    for backend in std::iter::once("fixture").chain(PROFILES) {
        let log: PathBuf = dir.path().join(format!("{backend}.strace"));
        let status = Command::new("strace")
            .args(["-f", "-qq", "-o"])
            .arg(&log)
            .args([
                "-e",
                "trace=%stat,%lstat,%fstat,fsync,fdatasync,syncfs,sync_file_range,readlink,readlinkat,rename,renameat,renameat2",
            ])
            .arg(exe)
            .env(PHASE, format!("syscalls:{backend}"))
            .env_remove("GPU_SIM_CALL_DELAY_US")
            .status()?;
        anyhow::ensure!(status.success(), "traced run on {backend} failed: {status}");
        let counts = count_syscalls(&std::fs::read_to_string(&log)?);
        for op in ["prepare", "unprepare", "burst"] {
            if !counts.contains_key(&(op.to_owned(), "fsync")) {
                continue;
            }
            let op_label = if op == "burst" {
                format!("{CONCURRENT} prepares at once")
            } else {
                op.to_owned()
            };
            let of = |family: &str| {
                counts
                    .get(&(op.to_owned(), family))
                    .map_or_else(|| "?".to_owned(), usize::to_string)
            };
            println!(
                "  {backend:<14} {op_label:<9}: fsync {}, stat {}, readlink {}, rename (new files) {}",
                of("fsync"),
                of("stat"),
                of("readlink"),
                of("rename")
            );
        }
    }
    Ok(())
}

fn run_child(exe: &Path, phase: &str, delay_us: &str) -> anyhow::Result<()> {
    let status = Command::new(exe)
        .env(PHASE, phase)
        .env("GPU_SIM_CALL_DELAY_US", delay_us)
        .status()?;
    anyhow::ensure!(status.success(), "{phase} failed: {status}");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match std::env::var(PHASE).ok().as_deref() {
        Some(phase) if phase.starts_with("nvml:") => return nvml_part(&phase[5..]).await,
        Some(phase) if phase.starts_with("syscalls:") => {
            return syscalls_child(&phase[9..]).await;
        }
        Some(other) => anyhow::bail!("unknown {PHASE} {other:?}"),
        None => {}
    }
    fixture_part().await?;

    let exe = std::env::current_exe()?;
    let delay = std::env::var("GPU_SIM_CALL_DELAY_US")
        .unwrap_or_else(|_| ASSUMED_CALL_DELAY_US.to_string());
    let assumed = if delay == ASSUMED_CALL_DELAY_US.to_string() {
        "assumed for a real driver"
    } else {
        "set"
    };
    println!(
        "bench_prepare: NVML backend over the simulator, NVML call cost {delay} us ({assumed}: GPU_SIM_CALL_DELAY_US), NVML held open beside the driver as the health watch holds it"
    );
    for profile in PROFILES {
        run_child(&exe, &format!("nvml:{profile}"), &delay)?;
    }
    syscalls_part(&exe)
}
