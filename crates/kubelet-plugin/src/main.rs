//! `gpu-kubelet-plugin`: the node binary. Parses arguments and hands over to the library.

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
    Run(Box<cli::RunArgs>),
    /// Print the GPU inventory and the ResourceSlices this node would publish.
    Discover(gpu_kubelet_plugin::discover::DiscoverArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => {
            cli::init_logging(&args.log);
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(cli::run(*args))
        }
        Command::Discover(args) => {
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
                .init();
            gpu_kubelet_plugin::discover::run(args)
        }
    }
}
