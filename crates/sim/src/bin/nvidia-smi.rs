//! `nvidia-smi` stand-in for the GPU simulator: finds the simulated host from its own
//! location (or `GPU_SIM_STATE`) and runs [`gpu_dra_sim::smi::run`].

use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exe = std::env::current_exe().ok();
    let file = gpu_dra_sim::state::locate(exe.as_deref());
    let mut out = std::io::stdout().lock();
    let code = gpu_dra_sim::smi::run(file, &args, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}
