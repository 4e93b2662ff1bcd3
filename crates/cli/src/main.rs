//! `gpu-dra` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // clap exits with status 2 on usage errors.
    let cli = gpu_dra_cli::Cli::parse();
    let mut stderr = std::io::stderr().lock();
    match gpu_dra_cli::run(
        &cli,
        &mut std::io::stdin().lock(),
        &mut std::io::stdout().lock(),
        &mut stderr,
    ) {
        Ok(outcome) => ExitCode::from(outcome.code()),
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(stderr, "gpu-dra: {e}");
            ExitCode::from(2)
        }
    }
}
