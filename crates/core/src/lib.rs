//! Pure driver logic: no I/O, no async runtime, no Kubernetes client, no NVML.
//!
//! - [`plan`]: a ResourceClaim + the node inventory + opaque configs -> a prepare plan.
//! - [`cdi`]: CDI spec documents for a prepared claim, built from plain inputs.
//! - [`dynamic_mig`]: dynamic MIG GPUs as partitionable devices (counter sets + placements).
//! - [`memory_shares`]: memory-share GPUs (several claims, each an amount of memory).
//! - [`checkpoint`]: the node plugin's checkpoint model, versioned and tolerant of unknown fields.
//! - [`sharing`]: sharing group names, MPS limits per device UUID, MPS client container edits.
//! - [`nvidia_checkpoint`]: NVIDIA's driver's checkpoint, read into our entries for an in-place switch.

pub mod cdi;
pub mod checkpoint;
pub mod dynamic_mig;
pub mod health;
pub mod ldcache;
pub mod memory_shares;
pub mod nvidia_checkpoint;
pub mod partitioning;
pub mod plan;
pub mod sharing;
pub mod slices;
