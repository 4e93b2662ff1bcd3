//! `gpu-kubelet-plugin`: parse flags, set up logging, run.

use clap::{Parser, Subcommand};
use gpu_kubelet_plugin::cli;

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
    Run(cli::RunArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => {
            cli::init_logging(&args.log);
            cli::run(args).await
        }
    }
}
