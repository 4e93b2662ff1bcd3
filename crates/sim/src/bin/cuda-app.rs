//! `cuda-app`: stand-in for a CUDA program (see [`gpu_dra_sim::cuda`]); prints the GPUs it
//! sees and the MPS server settings it gets through `CUDA_MPS_PIPE_DIRECTORY`, and with a
//! load holds device memory and keeps SMs busy, as NVML then reports. Given the nbody
//! sample's flags (`--benchmark --numbodies=N`, see [`gpu_dra_sim::nbody`]) it is that
//! sample, as `/tmp/sample` of NVIDIA's nbody images.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;

/// The command line.
#[derive(Debug, Parser)]
#[command(name = "cuda-app", about = "Stand-in for a CUDA program")]
struct Args {
    /// Keep running this long after printing (formerly `--hold-seconds`); with a load and
    /// without it, run until killed.
    #[arg(
        long,
        alias = "hold-seconds",
        env = "CUDA_APP_SECONDS",
        value_name = "N"
    )]
    seconds: Option<u64>,
    /// Device memory to hold: bytes or a quantity such as `512Mi`, `2Gi`.
    #[arg(long, env = "CUDA_APP_HOLD_MEMORY", value_parser = memory, default_value = "0")]
    hold_memory: u64,
    /// Percentage of the device's SMs to keep busy.
    #[arg(long, env = "CUDA_APP_SM_LOAD", value_parser = clap::value_parser!(u32).range(0..=100), default_value_t = 0)]
    sm_load: u32,
}

fn memory(s: &str) -> Result<u64, String> {
    gpu_dra_sim::processes::parse_bytes(s)
        .ok_or_else(|| format!("{s:?} is not a memory amount; use bytes or e.g. 512Mi, 2Gi"))
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let nbody = match gpu_dra_sim::nbody::NbodyArgs::parse(&argv) {
        Ok(nbody) => nbody,
        Err(err) => {
            eprintln!("{err}");
            std::process::exit(2);
        }
    };
    let exe = std::env::current_exe().ok();
    let file = gpu_dra_sim::state::locate(exe.as_deref()).ok();
    let state = file.as_ref().and_then(|f| f.load_visible().ok());
    let env = gpu_dra_sim::cuda::ClientEnv::from_process();
    if let Some(nbody) = nbody {
        std::process::exit(run_nbody(&nbody, state.as_ref(), &env));
    }
    let args = Args::parse();
    let load = gpu_dra_sim::cuda::Load {
        memory_bytes: args.hold_memory,
        sm_percent: args.sm_load,
        state_dir: file
            .as_ref()
            .and_then(|f| f.path().parent().map(std::path::Path::to_path_buf))
            .unwrap_or_default(),
        shm_dir: PathBuf::from("/dev/shm"),
    };
    let hold = args.seconds.map(std::time::Duration::from_secs);
    let mut out = std::io::stdout();
    let code = gpu_dra_sim::cuda::run(state.as_ref(), &env, &load, hold, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}

/// The nbody sample: prints its header for the devices it sees, computes for the simulated
/// time (attached to MPS when the claim has it), prints the figures; 0 when done.
fn run_nbody(
    args: &gpu_dra_sim::nbody::NbodyArgs,
    state: Option<&gpu_dra_sim::state::State>,
    env: &gpu_dra_sim::cuda::ClientEnv,
) -> i32 {
    let mut out = std::io::stdout();
    let devices = state.map(gpu_dra_sim::nbody::devices).unwrap_or_default();
    let run = match gpu_dra_sim::nbody::plan(args, &devices) {
        Ok(run) => run,
        Err(text) => {
            let _ = out.write_all(text.as_bytes());
            return 1;
        }
    };
    let _ = out.write_all(run.header.as_bytes());
    let _ = out.flush();
    let mps = match state.map(|s| gpu_dra_sim::cuda::join_mps(s, env)) {
        Some(Err(line)) => {
            let _ = writeln!(out, "{line}");
            return 1;
        }
        Some(Ok(conn)) => conn,
        None => None,
    };
    let Some(benchmark) = run.benchmark else {
        // The windowed simulation runs until its window is closed: here, until killed.
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    };
    std::thread::sleep(std::time::Duration::from_secs_f64(
        benchmark.millis / 1000.0,
    ));
    let _ = out.write_all(benchmark.report().as_bytes());
    let _ = out.flush();
    drop(mps);
    0
}
