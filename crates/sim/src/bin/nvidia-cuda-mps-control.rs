//! `nvidia-cuda-mps-control` stand-in for the GPU simulator: reads its environment and runs
//! [`gpu_dra_sim::mps::run`]. The simulated host (found from this executable's location or
//! `GPU_SIM_STATE`) is only used to validate device UUIDs.

use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = gpu_dra_sim::mps::MpsEnv::from_process();
    let exe = std::env::current_exe().ok();
    let state = gpu_dra_sim::state::locate(exe.as_deref())
        .and_then(|f| f.load())
        .ok();
    let mut stdin = std::io::stdin().lock();
    let mut out = std::io::stdout();
    let code = gpu_dra_sim::mps::run(&args, &env, state.as_ref(), &mut stdin, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}
