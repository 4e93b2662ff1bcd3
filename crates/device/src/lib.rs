//! GPU inventory: the model, the `GpuInventory` seam and the in-memory fixture backend.
//!
//! The model ([`model`]) is plain data shared by every consumer. Backends implement
//! [`GpuInventory`]; the node binary picks one at startup and nothing else knows which:
//! [`fixture`] serves an inventory held in memory, and the health seam ([`health`]) carries what
//! a backend observes about GPU health. [`names`] holds the naming rules every backend shares
//! (MIG profile names, PCI bus IDs, brands); [`mig_tables`] the real MIG profile tables per GPU
//! model. [`usage`] is the seam for what devices are used for
//! now (processes, memory, utilisation). [`testing`] (feature `testing`) builds inventories
//! for tests and benchmarks. This
//! crate does no I/O and links no NVML: the NVML backend lives in `gpu-dra-nvml`, so the pure
//! crates that depend on the model (`gpu-dra-core`) stay free of hardware code (Cargo enforces
//! it; a test in `gpu-dra-core` checks its dependency tree).

pub mod fixture;
pub mod health;
pub mod mig_tables;
pub mod model;
pub mod names;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod usage;

pub use health::{HealthEvent, HealthObservation, HealthSource, InstanceId};
pub use model::{
    ComputeCapability, DeviceRef, Gpu, Inventory, MigDevice, MigMode, MigProfile, Placement,
};

/// Errors while discovering GPUs.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The NVML library could not be loaded or initialised.
    #[error("cannot initialise NVML from {path}: {reason}")]
    Init {
        /// Library path that was tried.
        path: String,
        /// What NVML or the loader said.
        reason: String,
    },
    /// An NVML query failed.
    #[error("NVML {call} failed for {target}: {reason}")]
    Query {
        /// The NVML call, e.g. `nvmlDeviceGetUUID`.
        call: &'static str,
        /// What was queried, e.g. `GPU 3`.
        target: String,
        /// What NVML said.
        reason: String,
    },
    /// A GPU answered `NVML_ERROR_GPU_IS_LOST`: it fell off the bus.
    #[error("NVML {call} failed for {target}: the GPU is lost (fallen off the bus)")]
    GpuLost {
        /// The NVML call, e.g. `nvmlDeviceGetUUID`.
        call: &'static str,
        /// What was queried, e.g. `GPU index 3`.
        target: String,
    },
    /// A fixture inventory could not be read or parsed (or a failure was injected).
    #[error("fixture inventory {path}: {reason}")]
    Fixture {
        /// File that was read, or `<inline>` / `<injected>`.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// Reading sysfs failed.
    #[error("cannot read {path}: {source}")]
    Sysfs {
        /// Path that failed.
        path: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The seam in front of the hardware: returns the node's current inventory.
pub trait GpuInventory: Send + Sync {
    /// Discovers the GPUs now present. Called at startup and whenever a refresh is wanted.
    fn discover(&self) -> Result<Inventory, DeviceError>;

    /// Whether each device named in `names` is still on the node as `known` (an earlier
    /// discovery) records it: the same UUID on the same GPU (index and minor), the same MIG
    /// mode, and for a MIG device the same GPU and compute instance IDs. `Ok(false)` when one
    /// differs, is gone, is on a lost GPU or is not in `known`: the caller then discovers the
    /// whole node. A backend answers at a cost that grows with `names`, not with the node
    /// (prepare asks this for a claim's devices); the default discovers and compares.
    fn still_current(&self, known: &Inventory, names: &[&str]) -> Result<bool, DeviceError> {
        if names.is_empty() {
            return Ok(true);
        }
        let now = self.discover()?;
        Ok(names.iter().all(|name| same_device(known, &now, name)))
    }
}

/// Whether device `name` is recorded alike in `known` and `now` (same GPU record, and for a
/// MIG device the same MIG record), on a GPU lost in neither.
pub fn same_device(known: &Inventory, now: &Inventory, name: &str) -> bool {
    match (known.device(name), now.device(name)) {
        (Some(a), Some(b)) => {
            let index = a.gpu().index;
            a == b && !known.lost_gpus.contains(&index) && !now.lost_gpus.contains(&index)
        }
        _ => false,
    }
}
