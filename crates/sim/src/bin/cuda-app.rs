//! `cuda-app`: stand-in for a CUDA program (see [`gpu_dra_sim::cuda`]); prints the GPUs it
//! sees and the MPS server settings it gets through `CUDA_MPS_PIPE_DIRECTORY`.

use std::io::Write;

fn main() {
    let exe = std::env::current_exe().ok();
    let state = gpu_dra_sim::state::locate(exe.as_deref())
        .and_then(|f| f.load_visible())
        .ok();
    let pipe_dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    let mut out = std::io::stdout();
    let code = gpu_dra_sim::cuda::run(state.as_ref(), pipe_dir, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}
