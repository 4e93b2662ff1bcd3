//! `gpu-dra-webhook` entry point: parse flags, set up logging, run the library.

use clap::Parser;
use gpu_dra_webhook::{Args, run, worker_threads};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    gpu_dra_telemetry::init(&args.log)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .enable_all()
        .build()?
        .block_on(run(args))
}
