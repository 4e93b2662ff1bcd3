//! `cuda-app`: stand-in for a CUDA program (see [`gpu_dra_sim::cuda`]); prints the GPUs it
//! sees and the MPS server settings it gets through `CUDA_MPS_PIPE_DIRECTORY`.

use std::io::Write;

fn main() {
    let exe = std::env::current_exe().ok();
    let state = gpu_dra_sim::state::locate(exe.as_deref())
        .and_then(|f| f.load_visible())
        .ok();
    let env = gpu_dra_sim::cuda::ClientEnv::from_process();
    let mut out = std::io::stdout();
    let code = gpu_dra_sim::cuda::run(state.as_ref(), &env, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}
