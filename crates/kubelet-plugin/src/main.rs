//! `gpu-kubelet-plugin`: the node binary. Parses arguments and hands over to the library.

use clap::{Parser, Subcommand};

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
    /// Print the GPU inventory and the ResourceSlices this node would publish.
    Discover(gpu_kubelet_plugin::discover::DiscoverArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .init();
    match Cli::parse().command {
        Command::Discover(args) => gpu_kubelet_plugin::discover::run(args),
    }
}
