//! `gpu-cuda-probe`: parses the command line, runs the probe, prints its one JSON object and
//! exits 0 or 1 (see the library's crate doc).

use std::io::Write;

use clap::Parser;

fn main() {
    let args = gpu_dra_cuda_probe::Args::parse();
    let report = gpu_dra_cuda_probe::run(&args);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", report.to_json());
    let _ = out.flush();
    std::process::exit(report.exit_code());
}
