//! `cuda-app`: stand-in for a CUDA program (see [`gpu_dra_sim::cuda`]); prints the GPUs it
//! sees and the MPS server settings it gets through `CUDA_MPS_PIPE_DIRECTORY`.

use std::io::Write;

fn main() {
    let exe = std::env::current_exe().ok();
    let state = gpu_dra_sim::state::locate(exe.as_deref())
        .and_then(|f| f.load_visible())
        .ok();
    let env = gpu_dra_sim::cuda::ClientEnv::from_process();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hold = match args.as_slice() {
        [] => None,
        [flag, n] if flag == "--hold-seconds" => match n.parse::<u64>() {
            Ok(n) => Some(std::time::Duration::from_secs(n)),
            Err(_) => usage(),
        },
        _ => usage(),
    };
    let mut out = std::io::stdout();
    let code = gpu_dra_sim::cuda::run(state.as_ref(), &env, hold, &mut out);
    let _ = out.flush();
    std::process::exit(code);
}

fn usage() -> ! {
    eprintln!("usage: cuda-app [--hold-seconds <n>]");
    std::process::exit(2);
}
