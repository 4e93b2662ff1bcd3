//! Dynamic MIG's hardware operations: create a MIG device (a GPU instance at a chosen
//! placement and its full-size compute instance), destroy it, list the instances that exist,
//! and describe the profiles a GPU offers, all through the raw NVML C API.
//!
//! nvml-wrapper wraps none of the GPU-instance lifecycle calls, so every call here goes
//! through `nvml-wrapper-sys` with a `// SAFETY:` comment; handles never leave the function
//! that obtained them, and every NVML failure keeps its return code ([`MigOpsError::code`]) so
//! callers can tell "slices taken" (`INSUFFICIENT_RESOURCES`) from "wrong placement"
//! (`INVALID_ARGUMENT`) or "MIG off" (`NOT_SUPPORTED`).
//!
//! Invariants:
//! - [`MigOps::create_mig_device`] leaves nothing behind when it fails after creating the GPU
//!   instance: the half-made instance is destroyed again, so a failed prepare can be retried.
//! - [`MigOps::destroy_mig_device`] is idempotent: a compute or GPU instance that is already
//!   gone (or a GPU whose MIG mode is off, where none can exist) is success, so an unprepare
//!   repeated after a crash does not fail.
//! - Instances are named by (GPU UUID, GI ID, CI ID), never by handle: IDs are what survives a
//!   restart of the plugin (a checkpoint can hold them), handles are per NVML session.
//! - Profile names follow the discovery's naming (`names::profile_name`, the go-nvlib formula),
//!   so a profile listed here and a MIG device discovered later carry the same name.

// Raw NVML calls; each unsafe block says why it is sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_uint};
use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{
    NvmlLib, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t,
    nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlMemory_t, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

use gpu_dra_device::{DeviceError, MigProfile, Placement, names};

/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT` of the API v13 header (the bindings carry an older,
/// smaller value); constants past a driver's own count answer `INVALID_ARGUMENT`, skipped.
const CI_PROFILE_INDEX_END: u32 = 0x9;
/// `NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1`: a media-extension variant, never the default
/// compute instance (NVIDIA's driver leaves it out too).
const CI_PROFILE_1_SLICE_REV1: u32 = 0x7;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile.
const CI_ENGINE_PROFILE_SHARED: u32 = 0x0;
/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
const UUID_BUFFER: usize = 96;
const MIB: u64 = 1 << 20;

/// A MIG device made by [`MigOps::create_mig_device`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedMig {
    /// GPU instance ID (no relation to the placement).
    pub gi_id: u32,
    /// Compute instance ID within the GPU instance.
    pub ci_id: u32,
    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, new on every creation.
    pub uuid: String,
}

/// A compute instance that exists now, with its GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInstance {
    /// GPU instance ID.
    pub gi_id: u32,
    /// Compute instance ID within the GPU instance.
    pub ci_id: u32,
    /// GPU instance profile ID (19 for `1g.*`, 0 for `7g.*`).
    pub gi_profile_id: u32,
    /// Placement of the GPU instance in memory slices.
    pub placement: Placement,
    /// The MIG device's UUID.
    pub uuid: String,
}

/// Why a MIG operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MigOpsError {
    /// The NVML library could not be loaded or initialised.
    #[error("cannot initialise NVML from {path}: {source}")]
    Init {
        /// Library path that was tried.
        path: String,
        /// What nvml-wrapper said.
        #[source]
        source: NvmlError,
    },
    /// The loaded library lacks an entry point these operations need (a driver without MIG).
    #[error("NVML {call} is missing from the loaded library: {reason}")]
    Missing {
        /// The NVML function.
        call: &'static str,
        /// What the loader said.
        reason: String,
    },
    /// An NVML call returned an error.
    #[error("NVML {call} failed for {target}: {message} (NVML return code {code})")]
    Nvml {
        /// The NVML function, e.g. `nvmlDeviceCreateGpuInstanceWithPlacement`.
        call: &'static str,
        /// What it was called for, e.g. `GPU GPU-... profile 9 at 4`.
        target: String,
        /// The `nvmlReturn_t` (`NVML_ERROR_INSUFFICIENT_RESOURCES` = 23, ...).
        code: u32,
        /// NVML's description of the code.
        message: String,
    },
}

impl MigOpsError {
    /// The NVML return code, when an NVML call failed.
    pub fn code(&self) -> Option<u32> {
        match self {
            MigOpsError::Nvml { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The same failure as a discovery error.
    pub(crate) fn into_device_error(self, target: &str) -> DeviceError {
        match self {
            MigOpsError::Nvml {
                call,
                target,
                message,
                code,
            } => DeviceError::Query {
                call,
                target,
                reason: format!("{message} (NVML return code {code})"),
            },
            MigOpsError::Missing { call, reason } => DeviceError::Query {
                call,
                target: target.to_string(),
                reason,
            },
            MigOpsError::Init { path, source } => DeviceError::Init {
                path,
                reason: source.to_string(),
            },
        }
    }
}

/// An NVML entry point, or [`MigOpsError::Missing`].
fn sym<'a, T, E: std::fmt::Display>(
    call: &'static str,
    s: &'a Result<T, E>,
) -> Result<&'a T, MigOpsError> {
    s.as_ref().map_err(|e| MigOpsError::Missing {
        call,
        reason: e.to_string(),
    })
}

/// `Ok` for `NVML_SUCCESS`, else [`MigOpsError::Nvml`] naming the call and its target.
fn check(
    call: &'static str,
    target: impl FnOnce() -> String,
    ret: nvmlReturn_t,
) -> Result<(), MigOpsError> {
    if ret == nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(MigOpsError::Nvml {
            call,
            target: target(),
            code: ret,
            message: NvmlError::from(ret).to_string(),
        })
    }
}

fn count(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// NVML opened from a library path, for dynamic MIG's create, destroy and list calls. NVML
/// stays initialised while this value lives and is shut down when it is dropped.
pub struct MigOps {
    nvml: Nvml,
}

impl std::fmt::Debug for MigOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigOps").finish_non_exhaustive()
    }
}

impl MigOps {
    /// Loads `libnvidia-ml.so.1` from `lib_path` (see [`crate::find_library`]) and initialises
    /// NVML.
    pub fn open(lib_path: &Path) -> Result<MigOps, MigOpsError> {
        let nvml = Nvml::builder()
            .lib_path(lib_path.as_os_str())
            .init()
            .map_err(|source| MigOpsError::Init {
                path: lib_path.display().to_string(),
                source,
            })?;
        Ok(MigOps { nvml })
    }

    fn lib(&self) -> &NvmlLib {
        self.nvml.lib()
    }

    /// The full-GPU handle of `gpu_uuid`.
    fn device(&self, gpu_uuid: &str) -> Result<nvmlDevice_t, MigOpsError> {
        let get = sym(
            "nvmlDeviceGetHandleByUUID",
            &self.lib().nvmlDeviceGetHandleByUUID,
        )?;
        let uuid = std::ffi::CString::new(gpu_uuid).map_err(|_| MigOpsError::Nvml {
            call: "nvmlDeviceGetHandleByUUID",
            target: format!("GPU {gpu_uuid:?}"),
            code: nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
            message: "the UUID contains a NUL byte".to_string(),
        })?;
        let mut device: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a NUL-terminated string and a valid out-pointer, during the session `self`
        // holds open.
        let ret = unsafe { get(uuid.as_ptr(), &mut device) };
        check(
            "nvmlDeviceGetHandleByUUID",
            || format!("GPU {gpu_uuid}"),
            ret,
        )?;
        Ok(device)
    }

    /// Whether MIG mode is enabled now on `device`.
    fn mig_enabled(&self, device: nvmlDevice_t, gpu_uuid: &str) -> Result<bool, MigOpsError> {
        let get = sym("nvmlDeviceGetMigMode", &self.lib().nvmlDeviceGetMigMode)?;
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: a live device handle of this session and two valid out-pointers.
        let ret = unsafe { get(device, &mut current, &mut pending) };
        check("nvmlDeviceGetMigMode", || format!("GPU {gpu_uuid}"), ret)?;
        Ok(current == 1)
    }

    /// Creates a GPU instance of profile `gi_profile_id` (19, 14, 9, ...) at memory slice
    /// `placement_start`, then its full-size compute instance, and returns the new MIG
    /// device. The driver refuses with `NOT_SUPPORTED` when MIG mode is off,
    /// `INVALID_ARGUMENT` for a profile the GPU lacks or a start the profile does not have,
    /// and `INSUFFICIENT_RESOURCES` when the slices are taken.
    pub fn create_mig_device(
        &self,
        gpu_uuid: &str,
        gi_profile_id: u32,
        placement_start: u32,
    ) -> Result<CreatedMig, MigOpsError> {
        let lib = self.lib();
        let device = self.device(gpu_uuid)?;
        let target = || format!("GPU {gpu_uuid} profile {gi_profile_id} at {placement_start}");
        // The placement's size is the profile's: every placement of a profile has the same.
        // A start the profile lacks still goes to the driver, which refuses it.
        let placements = possible_placements(lib, device, gi_profile_id, &target)?;
        let size = placements
            .iter()
            .find(|p| p.start == placement_start)
            .or(placements.first())
            .map_or(0, |p| p.size);
        let create = sym(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            &lib.nvmlDeviceCreateGpuInstanceWithPlacement,
        )?;
        let placement = nvmlGpuInstancePlacement_t {
            start: placement_start,
            size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a live device handle, a valid placement and out-pointer.
        let ret = unsafe { create(device, gi_profile_id, &placement, &mut gi) };
        check("nvmlDeviceCreateGpuInstanceWithPlacement", target, ret)?;
        match self.fill_gpu_instance(gi, gpu_uuid) {
            Ok(created) => Ok(created),
            Err(e) => {
                // Leave nothing half-made; the first error is the one to report.
                if let Ok(destroy) = sym("nvmlGpuInstanceDestroy", &lib.nvmlGpuInstanceDestroy) {
                    // SAFETY: `gi` was created above in this session and is not used after.
                    let _ = unsafe { destroy(gi) };
                }
                Err(e)
            }
        }
    }

    /// Creates the full-size compute instance in the new GPU instance `gi` and reads the MIG
    /// device it makes. A compute instance made here is destroyed again when a later read
    /// fails.
    fn fill_gpu_instance(
        &self,
        gi: nvmlGpuInstance_t,
        gpu_uuid: &str,
    ) -> Result<CreatedMig, MigOpsError> {
        let lib = self.lib();
        let gi_info =
            gpu_instance_info(lib, gi, &|| format!("new GPU instance of GPU {gpu_uuid}"))?;
        let at = || format!("GPU instance {} of GPU {gpu_uuid}", gi_info.id);
        // The full-size compute instance is the largest CI profile the GI offers (NVIDIA's
        // driver picks the one whose slice count equals the GI's: the same one).
        let full = ci_profiles(lib, gi, &at)?
            .into_iter()
            .max_by_key(|p| p.sliceCount)
            .ok_or_else(|| MigOpsError::Nvml {
                call: "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                target: at(),
                code: nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
                message: "the GPU instance offers no compute instance profile".to_string(),
            })?;
        let create = sym(
            "nvmlGpuInstanceCreateComputeInstance",
            &lib.nvmlGpuInstanceCreateComputeInstance,
        )?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: a GPU-instance handle created in this session and a valid out-pointer.
        let ret = unsafe { create(gi, full.id, &mut ci) };
        check("nvmlGpuInstanceCreateComputeInstance", at, ret)?;
        match compute_instance(lib, ci, &at) {
            Ok((ci_id, uuid)) => Ok(CreatedMig {
                gi_id: gi_info.id,
                ci_id,
                uuid,
            }),
            Err(e) => {
                if let Ok(destroy) = sym(
                    "nvmlComputeInstanceDestroy",
                    &lib.nvmlComputeInstanceDestroy,
                ) {
                    // SAFETY: `ci` was created above in this session and is not used after.
                    let _ = unsafe { destroy(ci) };
                }
                Err(e)
            }
        }
    }

    /// Destroys compute instance `ci_id` of GPU instance `gi_id`, then the GPU instance. What
    /// is already gone is success; a GPU instance that still holds other compute instances is
    /// refused by the driver (`IN_USE`) and reported.
    pub fn destroy_mig_device(
        &self,
        gpu_uuid: &str,
        gi_id: u32,
        ci_id: u32,
    ) -> Result<(), MigOpsError> {
        let lib = self.lib();
        let device = self.device(gpu_uuid)?;
        if !self.mig_enabled(device, gpu_uuid)? {
            // No instance exists with MIG off.
            return Ok(());
        }
        let gi_target = || format!("GPU instance {gi_id} of GPU {gpu_uuid}");
        let by_id = sym(
            "nvmlDeviceGetGpuInstanceById",
            &lib.nvmlDeviceGetGpuInstanceById,
        )?;
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a live device handle and a valid out-pointer.
        let ret = unsafe { by_id(device, gi_id, &mut gi) };
        if ret == nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
            return Ok(());
        }
        check("nvmlDeviceGetGpuInstanceById", gi_target, ret)?;

        let ci_target = || format!("compute instance {ci_id} of {}", gi_target());
        let ci_by_id = sym(
            "nvmlGpuInstanceGetComputeInstanceById",
            &lib.nvmlGpuInstanceGetComputeInstanceById,
        )?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: a GPU-instance handle of this session and a valid out-pointer.
        let ret = unsafe { ci_by_id(gi, ci_id, &mut ci) };
        if ret != nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
            check("nvmlGpuInstanceGetComputeInstanceById", ci_target, ret)?;
            let destroy = sym(
                "nvmlComputeInstanceDestroy",
                &lib.nvmlComputeInstanceDestroy,
            )?;
            // SAFETY: a compute-instance handle of this session, not used after.
            let ret = unsafe { destroy(ci) };
            if ret != nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
                check("nvmlComputeInstanceDestroy", ci_target, ret)?;
            }
        }
        let destroy = sym("nvmlGpuInstanceDestroy", &lib.nvmlGpuInstanceDestroy)?;
        // SAFETY: a GPU-instance handle of this session, not used after.
        let ret = unsafe { destroy(gi) };
        if ret == nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
            return Ok(());
        }
        check("nvmlGpuInstanceDestroy", gi_target, ret)
    }

    /// Every compute instance on `gpu_uuid` with its GPU instance, in ascending (GI ID, CI ID)
    /// order; empty when MIG mode is off. GPU instances without a compute instance are not MIG
    /// devices and are left out.
    pub fn list_mig_instances(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, MigOpsError> {
        let lib = self.lib();
        let device = self.device(gpu_uuid)?;
        if !self.mig_enabled(device, gpu_uuid)? {
            return Ok(Vec::new());
        }
        let target = || format!("GPU {gpu_uuid}");
        let get_gis = sym("nvmlDeviceGetGpuInstances", &lib.nvmlDeviceGetGpuInstances)?;
        let get_cis = sym(
            "nvmlGpuInstanceGetComputeInstances",
            &lib.nvmlGpuInstanceGetComputeInstances,
        )?;
        let mut out = Vec::new();
        for (_, profile) in gi_profiles(lib, device, &target)? {
            let mut gis: Vec<nvmlGpuInstance_t> =
                vec![std::ptr::null_mut(); count(profile.instanceCount)];
            let mut n: c_uint = 0;
            // SAFETY: the buffer holds the profile's `instanceCount` handles, as the call
            // requires; `n` is a valid out-pointer.
            let ret = unsafe { get_gis(device, profile.id, gis.as_mut_ptr(), &mut n) };
            check(
                "nvmlDeviceGetGpuInstances",
                || format!("GPU {gpu_uuid} profile {}", profile.id),
                ret,
            )?;
            gis.truncate(count(n));
            for gi in gis {
                let info = gpu_instance_info(lib, gi, &target)?;
                let at = || format!("GPU instance {} of GPU {gpu_uuid}", info.id);
                for ci_profile in ci_profiles(lib, gi, &at)? {
                    let mut cis: Vec<nvmlComputeInstance_t> =
                        vec![std::ptr::null_mut(); count(ci_profile.instanceCount)];
                    let mut n: c_uint = 0;
                    // SAFETY: the buffer holds the CI profile's `instanceCount` handles; `n` is
                    // a valid out-pointer; `gi` belongs to this session.
                    let ret = unsafe { get_cis(gi, ci_profile.id, cis.as_mut_ptr(), &mut n) };
                    check("nvmlGpuInstanceGetComputeInstances", at, ret)?;
                    cis.truncate(count(n));
                    for ci in cis {
                        let (ci_id, uuid) = compute_instance(lib, ci, &at)?;
                        out.push(MigInstance {
                            gi_id: info.id,
                            ci_id,
                            gi_profile_id: info.profileId,
                            placement: Placement {
                                start: info.placement.start,
                                size: info.placement.size,
                            },
                            uuid,
                        });
                    }
                }
            }
        }
        out.sort_by_key(|m| (m.gi_id, m.ci_id));
        Ok(out)
    }

    /// The GPU-instance profiles `gpu_uuid` offers, with their placements, in NVML profile
    /// index order. On an A100 the driver answers these only while MIG mode is enabled.
    pub fn mig_profiles(&self, gpu_uuid: &str) -> Result<Vec<MigProfile>, MigOpsError> {
        let lib = self.lib();
        let device = self.device(gpu_uuid)?;
        let target = format!("GPU {gpu_uuid}");
        let get = sym("nvmlDeviceGetMemoryInfo", &lib.nvmlDeviceGetMemoryInfo)?;
        let mut memory = nvmlMemory_t {
            total: 0,
            free: 0,
            used: 0,
        };
        // SAFETY: a live device handle and a valid out-struct of the C type.
        let ret = unsafe { get(device, &mut memory) };
        check("nvmlDeviceGetMemoryInfo", || target.clone(), ret)?;
        profiles_of(lib, device, memory.total, &target)
    }
}

/// The GPU-instance profiles of `device` with their placements; `parent_memory_bytes` (the
/// GPU's total memory) feeds the profile names, as in discovery.
pub(crate) fn profiles_of(
    lib: &NvmlLib,
    device: nvmlDevice_t,
    parent_memory_bytes: u64,
    target: &str,
) -> Result<Vec<MigProfile>, MigOpsError> {
    let at = || target.to_string();
    let mut out = Vec::new();
    for (index, p) in gi_profiles(lib, device, &at)? {
        let placements = possible_placements(lib, device, p.id, &at)?;
        out.push(MigProfile {
            gi_profile_id: p.id,
            name: names::profile_name(
                p.sliceCount,
                p.sliceCount,
                p.memorySizeMB,
                parent_memory_bytes,
                index,
            ),
            memory_slices: placements.first().map_or(0, |pl| pl.size),
            compute_slices: p.sliceCount,
            memory_bytes: p.memorySizeMB.saturating_mul(MIB),
            multiprocessors: p.multiprocessorCount,
            copy_engines: p.copyEngineCount,
            decoders: p.decoderCount,
            encoders: p.encoderCount,
            jpeg_engines: p.jpegCount,
            ofa_engines: p.ofaCount,
            placements,
        });
    }
    Ok(out)
}

/// (profile index, info) of every GPU-instance profile `device` offers, probing each index
/// as go-nvlib does: `NOT_SUPPORTED` (not offered) and `INVALID_ARGUMENT` (past the driver's
/// count) are skipped; an ID seen at an earlier index is not listed again.
fn gi_profiles(
    lib: &NvmlLib,
    device: nvmlDevice_t,
    target: &dyn Fn() -> String,
) -> Result<Vec<(u32, nvmlGpuInstanceProfileInfo_t)>, MigOpsError> {
    let get = sym(
        "nvmlDeviceGetGpuInstanceProfileInfo",
        &lib.nvmlDeviceGetGpuInstanceProfileInfo,
    )?;
    let mut out: Vec<(u32, nvmlGpuInstanceProfileInfo_t)> = Vec::new();
    for index in 0..crate::GI_PROFILE_INDEX_END {
        // SAFETY: a live device handle and a zeroed out-struct of the exact C type.
        let (ret, info) = unsafe {
            let mut info: nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
            let ret = get(device, index, &mut info);
            (ret, info)
        };
        if ret == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
            || ret == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        {
            continue;
        }
        check("nvmlDeviceGetGpuInstanceProfileInfo", target, ret)?;
        if out.iter().all(|(_, p)| p.id != info.id) {
            out.push((index, info));
        }
    }
    Ok(out)
}

/// Every placement of GPU-instance profile `profile_id` on `device` (a count query, then the
/// list, as go-nvml does).
fn possible_placements(
    lib: &NvmlLib,
    device: nvmlDevice_t,
    profile_id: u32,
    target: &dyn Fn() -> String,
) -> Result<Vec<Placement>, MigOpsError> {
    const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let get = sym(CALL, &lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2)?;
    let mut n: c_uint = 0;
    // SAFETY: a live device handle; a null list asks for the count only, written to `n`.
    let ret = unsafe { get(device, profile_id, std::ptr::null_mut(), &mut n) };
    check(CALL, target, ret)?;
    let mut list = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count(n)];
    // SAFETY: the buffer holds `n` placements, the count passed in.
    let ret = unsafe { get(device, profile_id, list.as_mut_ptr(), &mut n) };
    check(CALL, target, ret)?;
    list.truncate(count(n));
    Ok(list
        .into_iter()
        .map(|p| Placement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

/// The info of GPU instance `gi` (ID, profile ID, placement).
fn gpu_instance_info(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    target: &dyn Fn() -> String,
) -> Result<nvmlGpuInstanceInfo_t, MigOpsError> {
    let get = sym("nvmlGpuInstanceGetInfo", &lib.nvmlGpuInstanceGetInfo)?;
    // SAFETY: a GPU-instance handle of the live session and a zeroed out-struct of the C
    // type.
    let (ret, info) = unsafe {
        let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
        let ret = get(gi, &mut info);
        (ret, info)
    };
    check("nvmlGpuInstanceGetInfo", target, ret)?;
    Ok(info)
}

/// The compute-instance profiles GPU instance `gi` offers (skipping `1_SLICE_REV1`), one per
/// profile ID.
fn ci_profiles(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    target: &dyn Fn() -> String,
) -> Result<Vec<nvmlComputeInstanceProfileInfo_t>, MigOpsError> {
    let get = sym(
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        &lib.nvmlGpuInstanceGetComputeInstanceProfileInfo,
    )?;
    let mut out: Vec<nvmlComputeInstanceProfileInfo_t> = Vec::new();
    for index in (0..CI_PROFILE_INDEX_END).filter(|i| *i != CI_PROFILE_1_SLICE_REV1) {
        // SAFETY: a GPU-instance handle of the live session and a zeroed out-struct of the C
        // type.
        let (ret, info) = unsafe {
            let mut info: nvmlComputeInstanceProfileInfo_t = std::mem::zeroed();
            let ret = get(gi, index, CI_ENGINE_PROFILE_SHARED, &mut info);
            (ret, info)
        };
        if ret == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
            || ret == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        {
            continue;
        }
        check("nvmlGpuInstanceGetComputeInstanceProfileInfo", target, ret)?;
        if out.iter().all(|p| p.id != info.id) {
            out.push(info);
        }
    }
    Ok(out)
}

/// The ID of compute instance `ci` and the UUID of its MIG device (`nvmlComputeInstanceGetInfo`
/// gives the MIG device handle, as NVIDIA's driver reads it).
fn compute_instance(
    lib: &NvmlLib,
    ci: nvmlComputeInstance_t,
    target: &dyn Fn() -> String,
) -> Result<(u32, String), MigOpsError> {
    let get_info = sym(
        "nvmlComputeInstanceGetInfo_v2",
        &lib.nvmlComputeInstanceGetInfo_v2,
    )?;
    let get_uuid = sym("nvmlDeviceGetUUID", &lib.nvmlDeviceGetUUID)?;
    // SAFETY: a compute-instance handle of the live session and a zeroed out-struct of the C
    // type.
    let (ret, info) = unsafe {
        let mut info: nvmlComputeInstanceInfo_t = std::mem::zeroed();
        let ret = get_info(ci, &mut info);
        (ret, info)
    };
    check("nvmlComputeInstanceGetInfo_v2", target, ret)?;
    let mut buf = [0 as c_char; UUID_BUFFER];
    let len = c_uint::try_from(buf.len()).unwrap_or(0);
    // SAFETY: the MIG device handle NVML just returned and a buffer of the length passed.
    let ret = unsafe { get_uuid(info.device, buf.as_mut_ptr(), len) };
    let at = || format!("MIG device of compute instance {} of {}", info.id, target());
    check("nvmlDeviceGetUUID", at, ret)?;
    let bytes: Vec<u8> = buf.iter().map(|c| c.to_ne_bytes()[0]).collect();
    let uuid = CStr::from_bytes_until_nul(&bytes)
        .map_err(|_| MigOpsError::Nvml {
            call: "nvmlDeviceGetUUID",
            target: at(),
            code: nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
            message: "the UUID is not NUL-terminated".to_string(),
        })?
        .to_string_lossy()
        .into_owned();
    Ok((info.id, uuid))
}
