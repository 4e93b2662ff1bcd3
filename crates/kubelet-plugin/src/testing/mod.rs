//! Fixtures and test doubles for tests and benchmarks: simulated host folders, claims, a
//! [`Driver`](crate::driver::Driver) wired for tests, the real plugin binary started as a child
//! process, and the in-memory stand-ins for the plugin's seams.
//!
//! The one home of these, so unit tests, `tests/` and `examples/` build the driver and launch
//! the plugin the same way. Compiled for this crate's unit tests and behind the `testing`
//! feature, which only `[dev-dependencies]` enable: the plugin binary never contains them.
//! Inventories themselves come from `gpu_dra_device::testing`.
//!
//! By role:
//! - [`simulate_host`]: the device nodes and driver files of a host, under a folder;
//! - [`allocated_claim`] and [`MemoryClaims`]: claims, and a [`ClaimSource`](crate::claims::ClaimSource)
//!   held in memory;
//! - [`DriverBuilder`] and [`dra_service`]: the driver and its gRPC service in-process;
//! - [`PluginCommand`] (with [`PluginCommand::wait_for`]), [`ChildGuard`], [`connect_dra`] and
//!   [`unix_channel`]: the plugin binary as a child process, and the kubelet's side of its
//!   socket;
//! - [`ExclusiveOnly`]: a [`SharingExecutor`](crate::sharing::SharingExecutor) that refuses
//!   sharing (no driver tools needed);
//! - [`FakeMig`]: a [`MigControl`](crate::mig::MigControl) that keeps MIG instances in memory;
//! - [`FakePodResources`]: the kubelet's PodResources API on a unix socket, from memory.
//!
//! Both [`DriverBuilder`] and [`PluginCommand`] lay everything out under one root folder
//! (`host/` the simulated host, `cdi/`, `plugin/` with the checkpoint and socket), so a test
//! that restarts the driver or the process on the same root finds its previous state.

mod claims;
mod driver;
mod host;
mod mig;
mod plugin;
mod pod_resources;
mod sharing;

pub use claims::{MemoryClaims, allocated_claim};
pub use driver::{DriverBuilder, dra_service};
pub use host::simulate_host;
pub use mig::FakeMig;
pub use plugin::{ChildGuard, PluginCommand, connect_dra, unix_channel};
pub use pod_resources::FakePodResources;
pub use sharing::ExclusiveOnly;

/// DRA driver name the fixtures use.
pub const DRIVER_NAME: &str = "gpu.nvidia.com";
/// Node (and pool) name the fixtures use unless told otherwise.
pub const NODE_NAME: &str = "node-a";
