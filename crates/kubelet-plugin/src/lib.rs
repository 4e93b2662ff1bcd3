//! The node plugin `gpu-kubelet-plugin`: kubelet registration and DRA gRPC, prepare/unprepare
//! with CDI specs and a crash-safe checkpoint, metrics and health endpoints.
//!
//! Layout: [`cli`] (flags, `run`), [`discover`] (the `discover` subcommand), [`cleanup`] and
//! [`uninstall`] (the `cleanup` and `uninstall` subcommands: the node put back as it was on
//! `helm uninstall`), [`publish`]
//! (ResourceSlice publisher), [`grpc`] (sockets, services), [`authority`] (grpc-go
//! `:authority` fix), [`driver`] (prepare/unprepare state machine), [`checkpoint_file`]
//! (checkpoint migration and NVIDIA import), [`claim_locks`] (one operation per claim),
//! [`claims`] (where claims come from), [`cdi_io`] (CDI on the host), [`sharing`]
//! (time-slicing and MPS), [`failpoint`] (fault injection), [`mig`] (dynamic MIG's hardware seam), [`metrics`] and [`http`]
//! (operations). Crash-safe writes come from `gpu-dra-fsutil`. Pure
//! planning, CDI and checkpoint models live in `gpu-dra-core`.

pub mod authority;
pub mod cdi_hook;
pub mod cdi_io;
pub mod checkpoint_file;
pub mod claim_locks;
pub mod claims;
pub mod cleanup;
pub mod cli;
pub mod digest;
pub mod discover;
pub mod driver;
pub mod failpoint;
pub mod grpc;
pub mod health;
pub mod http;
pub mod inventory;
pub mod metrics;
pub mod mig;
pub mod publish;
pub mod sharing;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uninstall;
