//! GPU simulator below NVML.
//!
//! This crate builds these things from one source tree:
//! - a `cdylib` (`libgpu_dra_sim.so`, installed as `libnvidia-ml.so.1`) exporting the subset of
//!   the NVML C API the driver calls, with the exact ABI of `nvml.h` ([`ffi`]), and every other
//!   function go-nvml binds as a `NOT_SUPPORTED` stub ([`unsupported`]);
//! - stand-ins for `nvidia-smi` and `nvidia-cuda-mps-control` that speak the real tools'
//!   command-line and stdin protocols ([`smi`], [`mps`]);
//! - `cuda-app`, the stand-in for a CUDA program in a container ([`cuda`]), which can hold
//!   device memory and keep a share of the SMs busy, registered with the node as the kernel
//!   driver would know it ([`processes`]) so that NVML reports it, and which plays NVIDIA's
//!   nbody CUDA sample when given its flags ([`nbody`]); the same model of CUDA's view
//!   backs the simulated `libcuda.so.1` of the `gpu-dra-sim-cuda` package, which `setup`
//!   installs beside the NVML library;
//! - `gpu-sim`, which lays out a self-contained simulated host (libraries, tools, `/dev`,
//!   `/proc` and `/sys` files, state file) under a directory ([`setup`], with the driver's
//!   other user-space files from [`driverfiles`]) and injects GPU faults (XID, ECC, fallen off
//!   the bus) for tests (the fault methods of [`state::State`], on the records of [`health`]),
//!   and swaps the driver version under a running host as an upgrade in place does
//!   ([`upgrade`]);
//! - behind the `testing` feature, a simulated host in a temporary directory for other
//!   crates' tests (`testing`).
//!
//! Invariants: every process that looks at one simulated root sees one fleet, because all
//! mutable state lives in `etc/gpu-sim/state.json` under that root ([`state`]), found from
//! the library's or tool's own location; fleet descriptions ([`profile`]) and MIG tables
//! ([`mig`]) reproduce real hardware values, and [`topology`] answers the pair questions
//! (NVLink peers, PCIe common ancestor, peer-to-peer) from a profile. The modules depend on each other without
//! circles: [`health`] and [`mig`] use no other module, [`profile`] builds on them, [`state`]
//! on all three, and the tools, the library and the setup on [`state`]; [`upgrade`] builds
//! on [`setup`], and the library and tools use its version checks.
//!
//! Unsafe code: `unsafe_code` is denied for the crate (`[lints]` in its Cargo.toml) and
//! allowed only where the C ABI or a C call needs it, every block with a `// SAFETY:`
//! comment (clippy's `undocumented_unsafe_blocks`):
//! - the NVML exports and their pointer and loader plumbing, whole modules: `src/ffi/init.rs`,
//!   `src/ffi/device.rs`, `src/ffi/mig.rs`, `src/ffi/instances.rs`, `src/ffi/events.rs`,
//!   `src/ffi/processes.rs`, `src/ffi/topology.rs`,
//!   `src/ffi/library.rs` (`dladdr`), `src/ffi/pointers.rs`;
//! - the `NOT_SUPPORTED` exports (`no_mangle`), the whole module: `src/unsupported.rs`;
//! - the state's change counter (`mmap`, `futex`), the whole module: `src/state/notify.rs`;
//! - one function, `make_fifo` (`mkfifo`), in `src/mps/daemon.rs`;
//! - one statement, the `mknod` of `device_node`, in `src/setup.rs`.
//!
//! The rest of `src/ffi/` (`mod.rs`, `handles.rs`, `resolve.rs`) and every other module has
//! none; `repo-tests/tests/docs.rs` keeps the list above and the `allow`s in step. The
//! integration tests that call raw NVML or `dlopen` allow it for themselves.

use std::path::PathBuf;

pub mod cuda;
pub mod driverfiles;
pub mod ffi;
pub mod health;
pub mod mig;
pub mod mps;
pub mod nbody;
pub mod processes;
pub mod profile;
pub mod setup;
pub mod smi;
pub mod state;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
/// Every other NVML function go-nvml binds, returning `NVML_ERROR_NOT_SUPPORTED` (generated).
pub mod unsupported;
pub mod upgrade;

pub use profile::Profile;
pub use state::{State, StateFile};

/// Errors of the simulator library and tools.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No built-in profile has this name and it does not look like a path.
    #[error("unknown profile {name:?}: use one of {known} or a path to a .json file")]
    UnknownProfile {
        /// What was asked for.
        name: String,
        /// The built-in names.
        known: String,
    },
    /// A profile failed to parse or validate.
    #[error("profile {origin}: {field}: {message}")]
    InvalidProfile {
        /// Where the profile came from.
        origin: String,
        /// JSON path of the offending field.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// The state file is not valid.
    #[error("state file {path}: {message}")]
    InvalidState {
        /// The state file.
        path: PathBuf,
        /// Parse error.
        message: String,
    },
    /// No state file could be found for this process.
    #[error(
        "no simulator state found (looked at {searched}); run `gpu-sim setup` or set GPU_SIM_STATE"
    )]
    NoState {
        /// What was searched.
        searched: String,
    },
    /// A process that does not see every device of the node tried to change it.
    #[error(
        "insufficient permissions: {path} has devices whose nodes are missing from {dev}; only a process that sees the whole node may change it"
    )]
    NotPermitted {
        /// The state file.
        path: PathBuf,
        /// The `dev/` folder of the process's view.
        dev: PathBuf,
    },
    /// A command-line argument is not valid.
    #[error("{field}: {message}")]
    InvalidArgument {
        /// The flag or argument.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// A build artefact the caller needs is missing.
    #[error("{what} not found (looked in {searched}); build the gpu-dra-sim package first")]
    MissingArtefact {
        /// The artefact.
        what: String,
        /// Where it was looked for.
        searched: String,
    },
}
