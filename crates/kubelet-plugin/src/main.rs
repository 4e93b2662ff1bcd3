//! `gpu-kubelet-plugin`: the node binary. Parses arguments and hands over to the library.

use clap::{Parser, Subcommand};
use gpu_dra_kubelet_plugin::cli;

#[derive(Parser)]
#[command(
    name = "gpu-kubelet-plugin",
    version,
    about = "DRA kubelet plugin for NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the kubelet: registration, prepare/unprepare, metrics.
    Run(Box<cli::RunArgs>),
    /// Print the GPU inventory and the ResourceSlices this node would publish.
    Discover(gpu_dra_kubelet_plugin::discover::DiscoverArgs),
    /// Put this node back as it was before the driver (no plugin may run): GPU compute modes
    /// and time-slices to their defaults, MPS daemons stopped, our files removed.
    Cleanup(Box<gpu_dra_kubelet_plugin::cleanup::CleanupArgs>),
    /// Watch this node's GPU health through NVML for a while and print what the plugin would
    /// report (events, probes, then each device's taints and health).
    Health(gpu_dra_kubelet_plugin::health::HealthArgs),
    /// The chart's pre-delete hook: stop the node plugins, then run `cleanup` on every node.
    Uninstall(Box<gpu_dra_kubelet_plugin::uninstall::UninstallArgs>),
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime()?.block_on(cli::run(*args))
        }
        Command::Cleanup(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime()?.block_on(gpu_dra_kubelet_plugin::cleanup::run(*args))
        }
        Command::Uninstall(args) => {
            gpu_dra_telemetry::init(&args.log)?;
            runtime()?.block_on(gpu_dra_kubelet_plugin::uninstall::run(*args))
        }
        Command::Health(args) => {
            gpu_dra_telemetry::init(&gpu_dra_telemetry::LogArgs {
                log_format: gpu_dra_telemetry::LogFormat::Text,
                log_level: "info".into(),
            })?;
            gpu_dra_kubelet_plugin::health::run_watch(args, &mut std::io::stdout().lock())
        }
        Command::Discover(args) => {
            gpu_dra_telemetry::init(&gpu_dra_telemetry::LogArgs {
                log_format: gpu_dra_telemetry::LogFormat::Text,
                log_level: "warn".into(),
            })?;
            gpu_dra_kubelet_plugin::discover::run(args)
        }
    }
}
