//! Link arguments of the simulated CUDA library.
//!
//! - The ELF soname of NVIDIA's CUDA driver library, `libcuda.so.1` (the container toolkit
//!   reads it). Cargo also hands this cdylib the link arguments of gpu-dra-sim's build script
//!   (rust-lang/cargo#9562), after this one, so the linker keeps gpu-dra-sim's
//!   `libnvidia-ml.so.1`; `gpu-sim setup` therefore writes the soname into the file it
//!   installs (`driverfiles::set_soname`). This argument takes effect if cargo stops passing
//!   a dependency's cdylib arguments on.
//! - `--exclude-libs ALL`: the symbols of the Rust libraries linked in (gpu-dra-sim's NVML
//!   exports among them) are not exported, so the library exports the CUDA driver API only
//!   and never interposes NVML in a process that also loads `libnvidia-ml.so.1`.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
}
