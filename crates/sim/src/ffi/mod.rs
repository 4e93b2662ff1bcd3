//! The NVML C API subset, exported from the `cdylib` with the exact ABI of `nvml.h`.
//!
//! Invariants:
//! - No panic crosses the FFI boundary: every export runs inside `guard` (`library`), which
//!   turns a panic into `NVML_ERROR_UNKNOWN`.
//! - Every pointer from the caller is null-checked (`NVML_ERROR_INVALID_ARGUMENT`); string
//!   buffers that are too small give `NVML_ERROR_INSUFFICIENT_SIZE`; calls before `nvmlInit`
//!   (or after the matching `nvmlShutdown`) give `NVML_ERROR_UNINITIALIZED`. Init is
//!   reference counted like real NVML.
//! - Handles are opaque pointers to leaked, never-freed allocations registered in a table,
//!   so they stay valid for the process lifetime and a foreign pointer is recognised (by
//!   address) without ever being dereferenced (`handles`).
//! - Answers come from the state file (see [`crate::state`]); it is re-read only when its
//!   inode, size or mtime changed, so other processes' changes are seen on the next call.
//! - A GPU marked lost ([`crate::health`]) answers `NVML_ERROR_GPU_IS_LOST` to every call
//!   that resolves it, through a handle or a lookup; `nvmlDeviceGetCount` still counts it
//!   (`resolve`).
//!
//! This module holds the `nvml.h` types the exports share; the code is split by role:
//! - plumbing: `handles` (the handle table), `library` (init count, cached state,
//!   `guard`), `pointers` (reads and writes through caller pointers), `resolve` (handles
//!   against the current state);
//! - exports: `init` (initialisation and system queries), `device` (enumeration and
//!   identity), `mig` (compute mode and MIG queries), `instances` (creating and
//!   destroying GPU and compute instances), [`events`] (health events and field values),
//!   `processes` (the processes on a device, their memory and utilisation), `topology`
//!   (common ancestor, peer-to-peer, NVLink links and their remote ends, module ID).
//!
//! Every export is re-exported here, so `ffi::nvmlInit_v2` names it whichever file holds it.
//! The plumbing modules `handles` and `resolve` and this one contain no `unsafe`; the
//! others allow it for the C ABI (see the crate doc).

use std::ffi::{c_char, c_uint, c_ulonglong, c_void};

mod device;
pub mod events;
mod handles;
mod init;
mod instances;
mod library;
mod mig;
mod pointers;
mod processes;
mod resolve;
mod topology;

pub use device::*;
pub use init::*;
pub use instances::*;
pub use library::own_path;
pub use mig::*;
pub use processes::*;
pub use topology::*;

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
/// `nvmlDevice_t`, `nvmlGpuInstance_t`, `nvmlComputeInstance_t`: opaque pointers.
pub type Handle = *mut c_void;

/// `nvmlReturn_t` values.
pub mod ret {
    use super::NvmlReturn;
    /// The operation was successful.
    pub const SUCCESS: NvmlReturn = 0;
    /// NVML was not first initialized with `nvmlInit()`.
    pub const UNINITIALIZED: NvmlReturn = 1;
    /// A supplied argument is invalid.
    pub const INVALID_ARGUMENT: NvmlReturn = 2;
    /// The requested operation is not available on target device.
    pub const NOT_SUPPORTED: NvmlReturn = 3;
    /// The current user does not have permission for operation.
    pub const NO_PERMISSION: NvmlReturn = 4;
    /// A query to find an object was unsuccessful.
    pub const NOT_FOUND: NvmlReturn = 6;
    /// An input argument is not large enough.
    pub const INSUFFICIENT_SIZE: NvmlReturn = 7;
    /// The operation cannot be performed because the GPU is currently in use.
    pub const IN_USE: NvmlReturn = 19;
    /// Ran out of critical resources, other than memory.
    pub const INSUFFICIENT_RESOURCES: NvmlReturn = 23;
    /// RM has detected an NVML/RM version mismatch (library and kernel module of different
    /// driver versions).
    pub const LIB_RM_VERSION_MISMATCH: NvmlReturn = 18;
    /// NVIDIA driver is not loaded.
    pub const DRIVER_NOT_LOADED: NvmlReturn = 9;
    /// User provided timeout passed.
    pub const TIMEOUT: NvmlReturn = 10;
    /// The GPU has fallen off the bus or has otherwise become inaccessible.
    pub const GPU_IS_LOST: NvmlReturn = 15;
    /// An internal driver error occurred.
    pub const UNKNOWN: NvmlReturn = 999;
}

/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
const NAME_LEN: usize = 96;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    /// Total physical memory (bytes).
    pub total: c_ulonglong,
    /// Unallocated memory (bytes).
    pub free: c_ulonglong,
    /// Allocated memory (bytes).
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryV2 {
    /// Structure version (`nvmlMemory_v2`).
    pub version: c_uint,
    /// Total physical memory (bytes).
    pub total: c_ulonglong,
    /// Memory reserved by the system (bytes).
    pub reserved: c_ulonglong,
    /// Unallocated memory (bytes).
    pub free: c_ulonglong,
    /// Allocated memory (bytes).
    pub used: c_ulonglong,
}

/// `nvmlPciInfo_t` (the layout the `_v2` and `_v3` functions fill).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PciInfo {
    /// `DDDD:BB:DD.F`.
    pub bus_id_legacy: [c_char; 16],
    /// PCI domain.
    pub domain: c_uint,
    /// Bus.
    pub bus: c_uint,
    /// Device.
    pub device: c_uint,
    /// Combined device and vendor ID.
    pub pci_device_id: c_uint,
    /// Combined subsystem ID.
    pub pci_sub_system_id: c_uint,
    /// `DDDDDDDD:BB:DD.F`.
    pub bus_id: [c_char; 32],
}

/// `nvmlDeviceAttributes_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceAttributes {
    /// Streaming multiprocessors.
    pub multiprocessor_count: c_uint,
    /// Shared copy engines.
    pub shared_copy_engine_count: c_uint,
    /// Shared decoders.
    pub shared_decoder_count: c_uint,
    /// Shared encoders.
    pub shared_encoder_count: c_uint,
    /// Shared JPEG engines.
    pub shared_jpeg_count: c_uint,
    /// Shared OFA engines.
    pub shared_ofa_count: c_uint,
    /// GPU-instance slices.
    pub gpu_instance_slice_count: c_uint,
    /// Compute-instance slices.
    pub compute_instance_slice_count: c_uint,
    /// Memory in MiB.
    pub memory_size_mb: c_ulonglong,
}

/// `nvmlGpuInstanceProfileInfo_t` (v1, unversioned).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GiProfileInfo {
    /// Profile ID.
    pub id: c_uint,
    /// Peer-to-peer support.
    pub is_p2p_supported: c_uint,
    /// Compute slices.
    pub slice_count: c_uint,
    /// Maximum instances.
    pub instance_count: c_uint,
    /// SMs.
    pub multiprocessor_count: c_uint,
    /// Copy engines.
    pub copy_engine_count: c_uint,
    /// Decoders.
    pub decoder_count: c_uint,
    /// Encoders.
    pub encoder_count: c_uint,
    /// JPEG engines.
    pub jpeg_count: c_uint,
    /// OFA engines.
    pub ofa_count: c_uint,
    /// Memory in MiB.
    pub memory_size_mb: c_ulonglong,
}

/// `nvmlGpuInstanceProfileInfo_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GiProfileInfoV2 {
    /// Structure version.
    pub version: c_uint,
    /// Profile ID.
    pub id: c_uint,
    /// Peer-to-peer support.
    pub is_p2p_supported: c_uint,
    /// Compute slices.
    pub slice_count: c_uint,
    /// Maximum instances.
    pub instance_count: c_uint,
    /// SMs.
    pub multiprocessor_count: c_uint,
    /// Copy engines.
    pub copy_engine_count: c_uint,
    /// Decoders.
    pub decoder_count: c_uint,
    /// Encoders.
    pub encoder_count: c_uint,
    /// JPEG engines.
    pub jpeg_count: c_uint,
    /// OFA engines.
    pub ofa_count: c_uint,
    /// Memory in MiB.
    pub memory_size_mb: c_ulonglong,
    /// `MIG 1g.5gb`.
    pub name: [c_char; NAME_LEN],
}

/// `nvmlGpuInstanceProfileInfo_v3_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GiProfileInfoV3 {
    /// Structure version.
    pub version: c_uint,
    /// Profile ID.
    pub id: c_uint,
    /// Compute slices.
    pub slice_count: c_uint,
    /// Maximum instances.
    pub instance_count: c_uint,
    /// SMs.
    pub multiprocessor_count: c_uint,
    /// Copy engines.
    pub copy_engine_count: c_uint,
    /// Decoders.
    pub decoder_count: c_uint,
    /// Encoders.
    pub encoder_count: c_uint,
    /// JPEG engines.
    pub jpeg_count: c_uint,
    /// OFA engines.
    pub ofa_count: c_uint,
    /// Memory in MiB.
    pub memory_size_mb: c_ulonglong,
    /// `MIG 1g.5gb`.
    pub name: [c_char; NAME_LEN],
    /// Capability bits (0x1 P2P, 0x2 GFX).
    pub capabilities: c_uint,
}

/// `nvmlGpuInstanceProfileInfo_v2` = `sizeof | 2 << 24`.
pub const GI_PROFILE_INFO_V2: c_uint = (size_of::<GiProfileInfoV2>() as c_uint) | (2 << 24);
/// `nvmlGpuInstanceProfileInfo_v3` = `sizeof | 3 << 24`.
pub const GI_PROFILE_INFO_V3: c_uint = (size_of::<GiProfileInfoV3>() as c_uint) | (3 << 24);
/// `nvmlMemory_v2` = `sizeof | 2 << 24`.
pub const MEMORY_V2: c_uint = (size_of::<MemoryV2>() as c_uint) | (2 << 24);

/// `nvmlGpuInstancePlacement_t` / `nvmlComputeInstancePlacement_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// Start slice.
    pub start: c_uint,
    /// Size in slices.
    pub size: c_uint,
}

/// `nvmlGpuInstanceInfo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpuInstanceInfo {
    /// Parent device.
    pub device: Handle,
    /// GPU-instance ID.
    pub id: c_uint,
    /// Profile ID.
    pub profile_id: c_uint,
    /// Placement in memory slices.
    pub placement: Placement,
}

/// `nvmlComputeInstanceInfo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ComputeInstanceInfo {
    /// The MIG device handle.
    pub device: Handle,
    /// Parent GPU instance.
    pub gpu_instance: Handle,
    /// Compute-instance ID.
    pub id: c_uint,
    /// CI profile ID.
    pub profile_id: c_uint,
    /// Placement in compute slices.
    pub placement: Placement,
}

/// `nvmlComputeInstanceProfileInfo_t` (v1, what `nvmlGpuInstanceGetComputeInstanceProfileInfo`
/// fills).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CiProfileInfo {
    /// Profile ID (equals the `NVML_COMPUTE_INSTANCE_PROFILE_*` index).
    pub id: c_uint,
    /// Compute slices.
    pub slice_count: c_uint,
    /// Maximum instances of this profile in the GPU instance.
    pub instance_count: c_uint,
    /// SMs.
    pub multiprocessor_count: c_uint,
    /// Copy engines shared within the GPU instance.
    pub shared_copy_engine_count: c_uint,
    /// Decoders shared within the GPU instance.
    pub shared_decoder_count: c_uint,
    /// Encoders shared within the GPU instance.
    pub shared_encoder_count: c_uint,
    /// JPEG engines shared within the GPU instance.
    pub shared_jpeg_count: c_uint,
    /// OFA engines shared within the GPU instance.
    pub shared_ofa_count: c_uint,
}

/// `nvmlComputeInstanceProfileInfo_v2_t` (and `_v3_t`, which appends `capabilities`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CiProfileInfoV3 {
    /// Structure version.
    pub version: c_uint,
    /// The v1 fields.
    pub info: CiProfileInfo,
    /// `MIG <name>`.
    pub name: [c_char; NAME_LEN],
    /// Capability bits (v3 only).
    pub capabilities: c_uint,
}

/// `nvmlComputeInstanceProfileInfo_v2` = `sizeof(v2) | 2 << 24` (v2 is v3 without the last
/// field).
pub const CI_PROFILE_INFO_V2: c_uint =
    ((size_of::<CiProfileInfoV3>() - size_of::<c_uint>()) as c_uint) | (2 << 24);
/// `nvmlComputeInstanceProfileInfo_v3` = `sizeof | 3 << 24`.
pub const CI_PROFILE_INFO_V3: c_uint = (size_of::<CiProfileInfoV3>() as c_uint) | (3 << 24);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn struct_versions_match_nvml_h() {
        assert_eq!(GI_PROFILE_INFO_V2, 0x0200_0098);
        assert_eq!(GI_PROFILE_INFO_V3, 0x0300_0098);
        assert_eq!(MEMORY_V2, (40 | (2 << 24)) as c_uint);
    }

    #[test]
    fn ci_profile_info_layouts_match_nvml_h() {
        assert_eq!(size_of::<CiProfileInfo>(), 36);
        assert_eq!(CI_PROFILE_INFO_V2, 0x0200_0088);
        assert_eq!(CI_PROFILE_INFO_V3, 0x0300_008c);
        assert_eq!(offset_of!(CiProfileInfoV3, name), 40);
    }

    #[test]
    fn layouts_match_nvml_h() {
        assert_eq!(size_of::<GiProfileInfo>(), 48);
        assert_eq!(offset_of!(GiProfileInfo, memory_size_mb), 40);
        assert_eq!(offset_of!(GiProfileInfoV2, memory_size_mb), 48);
        assert_eq!(offset_of!(GiProfileInfoV2, name), 56);
        assert_eq!(offset_of!(GiProfileInfoV3, memory_size_mb), 40);
        assert_eq!(offset_of!(GiProfileInfoV3, name), 48);
        assert_eq!(offset_of!(GiProfileInfoV3, capabilities), 144);
        assert_eq!(size_of::<DeviceAttributes>(), 40);
        assert_eq!(offset_of!(DeviceAttributes, memory_size_mb), 32);
        assert_eq!(size_of::<GpuInstanceInfo>(), 24);
        assert_eq!(size_of::<ComputeInstanceInfo>(), 32);
    }
}
