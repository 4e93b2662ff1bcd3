//! GPU sharing on the node: time-slicing and MPS, chosen per claim and device group.
//!
//! - Time-slicing on whole GPUs sets compute mode `DEFAULT` and the time-slice interval with
//!   `nvidia-smi`; the GPU is reset to the default interval when the last claim using it is
//!   unprepared (reference counted in the persisted state, so it survives restarts). On MIG
//!   devices time-slicing is plain sharing and nothing is set ([`timeslice`]).
//! - MPS runs one `nvidia-cuda-mps-control -f` per claim and device group, supervised by this
//!   process (restarted with backoff when it crashes), with private pipe and log directories
//!   under `<plugin-dir>/mps/<claimUID>-<group>` ([`supervise`], [`mps`]); after a plugin
//!   restart [`recovery`] re-adopts or restarts daemons, cleans up what was interrupted and
//!   undoes the sharing of claims the checkpoint no longer knows. With a Kubernetes client and
//!   an image, each daemon runs in a pod of its own instead, so that it outlives the plugin's
//!   container ([`pods`]); one watch per node on those pods tells every supervisor when its
//!   pod is gone ([`pod_watch`]).
//!   Client containers get the pipe directory and `CUDA_MPS_PIPE_DIRECTORY`, and keep their own
//!   `/dev/shm` (see `gpu_dra_core::sharing` for why, and for the GPUs that would need more).
//!   A memory-share GPU has one daemon shared by all claims holding a share of it, each
//!   client limited by its own environment ([`shared_mps`]).
//! - Whatever ends a GPU's last use puts it back to compute mode `DEFAULT` and the default
//!   time-slice: an unprepare, recovery after a plugin crash (above), and on uninstall
//!   [`restore`] (all recorded sharing undone, run by `gpu-kubelet-plugin cleanup`). A crashed
//!   MPS daemon is restarted by its supervisor and keeps its GPUs; they go back to `DEFAULT`
//!   when its claim is unprepared.
//!
//! The input is the prepare plan's group: its name, its devices and the api crate's validated
//! [`gpu_dra_api::Sharing`] value, used as is (no second decoding or validation here). The
//! pure parts (group and daemon names, MPS limits per device UUID, the client container edits)
//! live in `gpu_dra_core::sharing`; this module carries them out with the driver's tools,
//! found under the driver root by [`DriverRoot`], the same way on real and simulated hosts.
//!
//! Invariant: nothing sharing changes on the node exists without a record in
//! [`SharingState`] saved first; see [`manager`] for the ordering.

pub mod error;
pub mod executor;
pub mod manager;
pub mod mps;
pub mod pod_watch;
pub mod pods;
pub mod recovery;
pub mod reshape;
pub mod restore;
pub mod shared_mps;
pub mod smi;
pub mod state;
pub mod supervise;
pub mod timeslice;
pub mod tools;

pub use error::SharingError;
pub use executor::{Applied, SharingExecutor};
pub use gpu_dra_core::sharing::{SharedDevice, daemon_id};
pub use manager::{SharingManager, SharingMetrics, SharingOptions};
pub use pods::{DaemonPodArgs, PodDaemons, PodSettings};
pub use recovery::RecoveryReport;
pub use reshape::{ReshapeOutcome, Reshaped};
pub use restore::RestoreReport;
pub use state::{FileStore, SharingState, SharingStore};
pub use tools::DriverRoot;
