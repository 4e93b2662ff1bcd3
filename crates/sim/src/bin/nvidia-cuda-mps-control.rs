//! `nvidia-cuda-mps-control` stand-in for the GPU simulator: reads its environment and runs
//! [`nvidia_ml::mps::run`]. The simulated host (found from this executable's location or
//! `GPU_SIM_STATE`) is only used to validate device UUIDs.

use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = nvidia_ml::mps::MpsEnv::from_process();
    let exe = std::env::current_exe().ok();
    let state = nvidia_ml::state::locate(exe.as_deref())
        .and_then(|f| f.load())
        .ok();
    let mut stdin = std::io::stdin().lock();
    let mut out = std::io::stdout();
    let code = nvidia_ml::mps::run(&args, &env, state.as_ref(), &mut stdin, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}
