//! `cuda-app`: stand-in for a CUDA program (see [`gpu_dra_sim::cuda`]); prints the GPUs it
//! sees and the MPS server settings it gets through `CUDA_MPS_PIPE_DIRECTORY`, and with a
//! load holds device memory and keeps SMs busy, as NVML then reports.

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
    let args = Args::parse();
    let exe = std::env::current_exe().ok();
    let file = gpu_dra_sim::state::locate(exe.as_deref()).ok();
    let state = file.as_ref().and_then(|f| f.load_visible().ok());
    let env = gpu_dra_sim::cuda::ClientEnv::from_process();
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
