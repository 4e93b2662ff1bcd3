//! Pure driver logic: no I/O, no async runtime, no Kubernetes client, no NVML.
//!
//! - [`plan`]: a ResourceClaim + the node inventory + opaque configs -> a prepare plan.
//! - [`cdi`]: CDI spec documents for a prepared claim, built from plain inputs.
//! - [`dynamic_mig`]: dynamic MIG GPUs as partitionable devices (counter sets + placements).
//! - [`memory_shares`]: memory-share GPUs (several claims, each an amount of memory).
//! - [`consumable_shares`]: NVIDIA's node-wide consumable shares (`disabled`, `memory`,
//!   `unlimited`, `<N>`) on every eligible GPU and MIG device.
//! - [`checkpoint`]: the node plugin's checkpoint model, versioned and tolerant of unknown fields.
//! - [`sharing`]: sharing group names, MPS limits per device UUID, MPS client container edits.
//! - [`nvidia_checkpoint`]: NVIDIA's driver's checkpoint, read into our entries for an in-place switch.
//! - [`slices`]: an inventory -> ResourceSlices (devices, attributes, capacities, the split to
//!   API limits), and the schema of what is published.
//! - [`partitioning`]: how each GPU is offered (static, dynamic MIG, memory shares) from flags
//!   and Node annotations.
//! - [`health`]: health observations -> device taints and the health the kubelet reports.
//! - [`feature_gates`]: the Kubernetes feature gates the driver's features need and the
//!   release from which each is on by default.
//! - [`topology`]: NVLink domains (sets of GPUs that are pairwise NVLink peers) from the
//!   inventory, published as `nvlinkDomain`.
//! - [`list_forms`]: the list-type forms of `nvlinkDomain` and `numaNode`, for clusters with
//!   `DRAListTypeAttributes`.
//! - [`device_metadata`]: the device metadata file Kubernetes mounts into a claim's
//!   containers (KEP-5304): its format, its path in containers, its content from the slices'
//!   attributes.
//! - [`ldcache`]: a reader of glibc's `ld.so.cache`, to find the driver's libraries as the
//!   container toolkit does.

pub mod cdi;
pub mod checkpoint;
pub mod consumable_shares;
pub mod device_metadata;
pub mod dynamic_mig;
pub mod feature_gates;
pub mod health;
pub mod ldcache;
pub mod list_forms;
pub mod memory_shares;
pub mod nvidia_checkpoint;
pub mod partitioning;
pub mod plan;
pub mod sharing;
pub mod slices;
pub mod topology;
