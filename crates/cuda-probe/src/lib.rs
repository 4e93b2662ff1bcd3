//! `gpu-cuda-probe`: checks that a container can use its GPUs through CUDA, with nothing
//! but the driver: it loads `libcuda.so.1` at run time, lists the devices CUDA sees, creates
//! a context on one, runs a PTX kernel the driver JIT-compiles and verifies its result, and
//! optionally tries one allocation of a given size. It needs no CUDA toolkit, and it runs the
//! same against NVIDIA's driver and against the simulator's `libcuda.so.1`.
//!
//! Output: exactly one JSON object on stdout ([`Report`]):
//! `{"driver_version", "devices": [{"index", "name", "uuid", "total_memory", "sm_count"}],
//! "memory": {"free", "total"}, "kernel": {"device", "elements", "ok", "mismatches"},
//! "alloc": {"bytes", "ok", "error"}, "error"}`; `alloc` only with `--alloc-bytes`; `error`
//! is `"<call>: <CUDA error name>"` for the first failed step before the allocation (or the
//! loader's message when `libcuda.so.1` cannot be loaded), else null. Exit status 0 when
//! init, context, kernel launch and verification succeeded, else 1 (the allocation's outcome
//! is reported, not judged).
//!
//! Modules: [`cli`] (the command line), [`kernel`] (the PTX and its host-side check),
//! [`cuda`] (the driver API loaded with `dlopen`), [`report`] (the run and its JSON).
//!
//! Unsafe code: `unsafe_code` is denied for the crate (`[lints]` in its Cargo.toml) and
//! allowed only for the C calls, every block with a `// SAFETY:` comment:
//! - the driver API through `dlopen`, the whole module: `src/cuda.rs`.

pub mod cli;
pub mod cuda;
pub mod kernel;
pub mod report;

pub use cli::Args;
pub use report::{Report, run};
