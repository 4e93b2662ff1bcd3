//! `gpu-dra-webhook` entry point: parse flags, set up logging, run the library.

use clap::Parser;
use gpu_dra_webhook::{Args, init_tracing, run, worker_threads};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_tracing(args.log_format, &args.log_level)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .enable_all()
        .build()?
        .block_on(run(args))
}
