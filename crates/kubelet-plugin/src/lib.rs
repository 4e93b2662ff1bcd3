//! The node plugin `gpu-kubelet-plugin`: kubelet registration and DRA gRPC, prepare/unprepare
//! with CDI specs and a crash-safe checkpoint, metrics and health endpoints.
//!
//! Modules by role:
//! - Entry points: [`cmd`], one module per subcommand (`run`, `discover`, `health`,
//!   `cleanup`, `uninstall`, `selftest`) and the one command line `main` parses; [`selftest`]
//!   (the node path end to end on a host without Kubernetes).
//! - Where things are: [`node_layout`] (every file the plugin keeps on a node, and the list
//!   cleanup removes), [`host`] (the host's driver, device nodes, sysfs and NVML library),
//!   [`kube_client`] (the API server client).
//! - Serving the kubelet: [`grpc`] (sockets, registration and DRA services), [`authority`]
//!   (grpc-go `:authority` fix), [`health`] (the DRA health service and the NVML watch),
//!   [`publish`] (ResourceSlice publisher), [`inventory`] (the live GPU inventory),
//!   [`driver_swap`] (the NVIDIA driver upgraded in place under the plugin).
//! - Prepare and unprepare: [`driver`] (the state machine), [`claim_locks`] (one operation
//!   per claim), [`claims`] (where claims come from), [`pod_resources`] (which claims the
//!   node's containers use, from the kubelet), [`claim_status`] (device data in the
//!   claims' status), [`checkpoint_file`] (checkpoint
//!   migration and NVIDIA import), [`cdi_io`] (CDI on the host), [`cdi_hook`] (the hook
//!   binary our specs name), [`device_metadata`] (the device metadata files a claim's
//!   containers read), [`sharing`] (time-slicing and MPS), [`mig`] (dynamic MIG's
//!   hardware seam).
//! - Operations and tests: [`metrics`] and [`http`], [`node_events`] (events on the node for
//!   findings that need a person), [`usage`] (per-claim GPU usage), [`failpoint`] (fault injection),
//!   [`digest`], `testing` (behind the `testing` feature, never in the shipping binary: the
//!   test doubles `ExclusiveOnly` and `FakeMig`, a DRA client as the kubelet
//!   uses it, the driver builder, the plugin launcher and simulated host folders).
//!
//! Crash-safe writes come from `gpu-dra-fsutil`. Pure planning, CDI and checkpoint models
//! live in `gpu-dra-core`.

pub mod authority;
pub mod cdi_hook;
pub mod cdi_io;
pub mod checkpoint_file;
pub mod claim_locks;
pub mod claim_status;
pub mod claims;
pub mod cmd;
pub mod device_metadata;
pub mod digest;
pub mod driver;
pub mod driver_swap;
pub mod failpoint;
pub mod grpc;
pub mod health;
pub mod host;
pub mod http;
pub mod inventory;
pub mod kube_client;
pub mod metrics;
pub mod mig;
pub mod node_events;
pub mod node_layout;
pub mod pod_resources;
pub mod publish;
pub mod selftest;
pub mod sharing;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod usage;
