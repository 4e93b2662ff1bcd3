//! `gpu-kubelet-plugin health`: watches this node's GPUs with the plugin's own NVML health
//! source for a while and prints what the plugin would report: every observation, then each
//! device's taints and health. An operator's check on a node; the plugin's own watch is
//! [`crate::health`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_dra_core::health::{HealthBook, HealthPolicy};
use gpu_dra_device::{GpuInventory, HealthSource};

use crate::host::HostArgs;

/// Flags of the `health` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// The host whose GPUs are watched.
    #[command(flatten)]
    pub host: HostArgs,
    /// How long to watch, in seconds.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds between probes of each GPU.
    #[arg(long, alias = "probe-interval", default_value_t = 2)]
    pub probe_interval_seconds: u64,
}

/// The `health` subcommand: watches the GPUs with the plugin's own NVML health source for a
/// while and prints every observation (with the milliseconds since the start), then the taints
/// and health the plugin would publish (an operator's check of what the driver reports on this node).
pub fn run(args: HealthArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let (_, backend) = args.host.nvml_inventory()?;
    let inventory = backend.discover()?;
    let gpus: Vec<String> = inventory.gpus.iter().map(|g| g.uuid.clone()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let timer = {
        let stop = stop.clone();
        let seconds = args.seconds;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(seconds));
            stop.store(true, Ordering::Relaxed);
        })
    };
    let mut book = HealthBook::new(HealthPolicy::new("gpu.nvidia.com"));
    let mut lines = Vec::new();
    let started = std::time::Instant::now();
    backend.watch(
        &gpus,
        Duration::from_secs(args.probe_interval_seconds.max(1)),
        &stop,
        &mut |o| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            book.observe(&o, now);
            lines.push(format!("+{}ms {o:?}", started.elapsed().as_millis()));
        },
    )?;
    let _ = timer.join();
    for l in &lines {
        writeln!(out, "{l}")?;
    }
    let view = book.view(&inventory);
    for (device, health) in &view.devices {
        let taints: Vec<String> = view
            .taints
            .get(device)
            .into_iter()
            .flatten()
            .map(ToString::to_string)
            .collect();
        writeln!(
            out,
            "{device}: {} {} {}",
            if health.healthy {
                "healthy"
            } else {
                "unhealthy"
            },
            taints.join(","),
            health.message
        )?;
    }
    Ok(())
}
