//! The simulated CUDA driver library: a `cdylib` (`libgpu_dra_sim_cuda.so`, ELF soname
//! `libcuda.so.1`) that `gpu-sim setup` installs as `libcuda.so.<ver>` on a simulated host,
//! so a CUDA program that loads the driver API at run time (the probe `gpu-cuda-probe`)
//! runs on simulated GPUs as on real ones.
//!
//! It exports a subset of the CUDA driver API with the exact ABI of `cuda.h` (`ffi`):
//! initialisation and version, device enumeration and attributes, contexts, memory,
//! modules loaded from PTX text, kernel launches, error names. What the devices are, how
//! MPS and compute modes apply and how use is reported to the node is the simulator's
//! CUDA model ([`gpu_dra_sim::cuda`], shared with `cuda-app`), driven per process by
//! [`driver`]; device memory is [`memory`]; PTX is checked and run by [`ptx`], an
//! interpreter of the subset element-wise kernels use, so a kernel's results are computed,
//! never assumed; the `CUresult` codes are [`result`].
//!
//! Invariants: the library finds its simulated host as the NVML library does (its own path
//! via `dladdr`, walking up to `etc/gpu-sim/state.json`, or `GPU_SIM_STATE`); it links the
//! simulator's code, never another copy of its rules.
//!
//! Unsafe code: `unsafe_code` is denied for the crate (`[lints]` in its Cargo.toml) and
//! allowed only for the C ABI, every block with a `// SAFETY:` comment:
//! - the driver API exports, the whole module: `src/ffi.rs`.

pub mod driver;
mod ffi;
pub mod memory;
pub mod ptx;
pub mod result;
