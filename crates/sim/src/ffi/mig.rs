//! Exports: compute mode and MIG queries (MIG mode, MIG device handles and IDs, device
//! attributes, GPU- and compute-instance profiles, placements and lookups). What changes the
//! MIG layout is in [`super::instances`].

// Exports of the C ABI: `no_mangle` and caller-owned memory behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::c_uint;

use super::handles::{Key, handle, key_of};
use super::library::{guard, state, update};
use super::pointers::{fixed, get_version, put};
use super::resolve::{Dev, alive, dev, find_mig, full_gpu, gi_handle, mig_device, mig_table};
use super::{
    CI_PROFILE_INFO_V2, CI_PROFILE_INFO_V3, CiProfileInfo, CiProfileInfoV3, ComputeInstanceInfo,
    DeviceAttributes, GI_PROFILE_INFO_V2, GI_PROFILE_INFO_V3, GiProfileInfo, GiProfileInfoV2,
    GiProfileInfoV3, GpuInstanceInfo, Handle, NAME_LEN, NvmlReturn, Placement, ret,
};
use crate::mig;
use crate::state::{ComputeMode, State};

/// `nvmlDeviceGetComputeMode` (full GPUs only).
///
/// # Safety
/// `mode` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(device: Handle, mode: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(mode, st.gpus[i].compute_mode.value()) }
    })
}

/// `nvmlDeviceSetComputeMode`: `NOT_SUPPORTED` on a MIG-enabled GPU, `INVALID_ARGUMENT` for
/// the removed `EXCLUSIVE_THREAD` and unknown values.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(device: Handle, mode: c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let mode = match ComputeMode::from_value(mode) {
            Some(ComputeMode::ExclusiveThread) | None => return Err(ret::INVALID_ARGUMENT),
            Some(m) => m,
        };
        update(|s| {
            if s.gpus[i].mig_current {
                return Err(ret::NOT_SUPPORTED);
            }
            s.gpus[i].compute_mode = mode;
            Ok(())
        })
    })
}

/// `nvmlDeviceGetMigMode`: `NOT_SUPPORTED` on GPUs without MIG.
///
/// # Safety
/// `current` and `pending` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: Handle,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        mig_table(&st, i)?;
        if current.is_null() || pending.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        // SAFETY: caller contract (out-parameters), both non-null.
        unsafe {
            put(current, c_uint::from(st.gpus[i].mig_current))?;
            put(pending, c_uint::from(st.gpus[i].mig_pending))
        }
    })
}

/// `nvmlDeviceGetMaxMigDeviceCount`: 7 with MIG enabled, else 0.
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: Handle,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let n = if st.gpus[i].mig_current && st.profile.gpus[i].mig_profiles().is_some() {
            7
        } else {
            0
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(count, n) }
    })
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: MIG devices in ascending (GI ID, CI ID) order;
/// `NOT_FOUND` past the last existing one, `INVALID_ARGUMENT` past the maximum.
///
/// # Safety
/// `mig_device` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: Handle,
    index: c_uint,
    mig_device: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        mig_table(&st, i)?;
        if !st.gpus[i].mig_current || index >= 7 {
            return Err(ret::INVALID_ARGUMENT);
        }
        let devs = st.mig_devices(i);
        let m = devs.get(index as usize).ok_or(ret::NOT_FOUND)?;
        let key = Key::Mig(i as u32, m.gi.id, m.ci.id);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(mig_device, handle(key)) }
    })
}

/// `nvmlDeviceIsMigDeviceHandle`.
///
/// # Safety
/// `is_mig` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: Handle,
    is_mig: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let v = matches!(dev(&st, device)?, Dev::Mig(..));
        // SAFETY: caller contract (out-parameter).
        unsafe { put(is_mig, c_uint::from(v)) }
    })
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
///
/// # Safety
/// `device` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: Handle,
    device: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let Dev::Mig(i, _) = dev(&st, mig_device)? else {
            return Err(ret::INVALID_ARGUMENT);
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(device, handle(Key::Gpu(i as u32))) }
    })
}

/// `nvmlDeviceGetGpuInstanceId` (MIG devices only).
///
/// # Safety
/// `id` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: Handle, id: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let m = mig_device(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(id, m.gi.id) }
    })
}

/// `nvmlDeviceGetComputeInstanceId` (MIG devices only).
///
/// # Safety
/// `id` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: Handle,
    id: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let m = mig_device(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(id, m.ci.id) }
    })
}

/// `nvmlDeviceGetAttributes_v2` (MIG devices only, as on real drivers).
///
/// # Safety
/// `attributes` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: Handle,
    attributes: *mut DeviceAttributes,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let m = mig_device(&st, device)?;
        let p = m.profile;
        let a = DeviceAttributes {
            multiprocessor_count: m.multiprocessors(),
            shared_copy_engine_count: p.copy_engines,
            shared_decoder_count: p.decoders,
            shared_encoder_count: p.encoders,
            shared_jpeg_count: p.jpeg,
            shared_ofa_count: p.ofa,
            gpu_instance_slice_count: p.slice_count,
            compute_instance_slice_count: m.ci.slice_count,
            memory_size_mb: p.memory_mib,
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(attributes, a) }
    })
}

/// Looks up GI profile `index` (an NVML index constant) of a full GPU.
fn gi_profile(
    st: &State,
    device: Handle,
    index: c_uint,
) -> Result<&'static mig::GiProfile, NvmlReturn> {
    let i = full_gpu(st, device)?;
    let table = mig_table(st, i)?;
    if index >= mig::GI_PROFILE_INDEX_COUNT {
        return Err(ret::INVALID_ARGUMENT);
    }
    mig::by_index(table, index).ok_or(ret::NOT_SUPPORTED)
}

/// `nvmlDeviceGetGpuInstanceProfileInfo` (v1 struct; `profile` is an index constant). Works
/// whether MIG is enabled or not.
///
/// # Safety
/// `info` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: Handle,
    profile: c_uint,
    info: *mut GiProfileInfo,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let p = gi_profile(&st, device, profile)?;
        let v = GiProfileInfo {
            id: p.id,
            is_p2p_supported: 0,
            slice_count: p.slice_count,
            instance_count: p.instance_count,
            multiprocessor_count: p.multiprocessors,
            copy_engine_count: p.copy_engines,
            decoder_count: p.decoders,
            encoder_count: p.encoders,
            jpeg_count: p.jpeg,
            ofa_count: p.ofa,
            memory_size_mb: p.memory_mib,
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(info, v) }
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV`: fills a v2 or v3 struct according to the
/// caller-set `version`; any other version is `INVALID_ARGUMENT`.
///
/// # Safety
/// `info` must be null or valid for reads and writes of the struct its version names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: Handle,
    profile: c_uint,
    info: *mut GiProfileInfoV2,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (struct starts with its version field).
        let version = unsafe { get_version(info.cast::<c_uint>()) }?;
        let p = gi_profile(&st, device, profile)?;
        let name = fixed::<NAME_LEN>(&format!("MIG {}", p.name));
        match version {
            GI_PROFILE_INFO_V2 => {
                let v = GiProfileInfoV2 {
                    version,
                    id: p.id,
                    is_p2p_supported: 0,
                    slice_count: p.slice_count,
                    instance_count: p.instance_count,
                    multiprocessor_count: p.multiprocessors,
                    copy_engine_count: p.copy_engines,
                    decoder_count: p.decoders,
                    encoder_count: p.encoders,
                    jpeg_count: p.jpeg,
                    ofa_count: p.ofa,
                    memory_size_mb: p.memory_mib,
                    name,
                };
                // SAFETY: caller contract: the version says the buffer is a v2 struct.
                unsafe { put(info, v) }
            }
            GI_PROFILE_INFO_V3 => {
                let v = GiProfileInfoV3 {
                    version,
                    id: p.id,
                    slice_count: p.slice_count,
                    instance_count: p.instance_count,
                    multiprocessor_count: p.multiprocessors,
                    copy_engine_count: p.copy_engines,
                    decoder_count: p.decoders,
                    encoder_count: p.encoders,
                    jpeg_count: p.jpeg,
                    ofa_count: p.ofa,
                    memory_size_mb: p.memory_mib,
                    name,
                    capabilities: 0,
                };
                // SAFETY: caller contract: the version says the buffer is a v3 struct.
                unsafe { put(info.cast::<GiProfileInfoV3>(), v) }
            }
            _ => Err(ret::INVALID_ARGUMENT),
        }
    })
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (`profile_id` is a profile ID). With a
/// null `placements` only the count is returned; a short buffer gives `INSUFFICIENT_SIZE`
/// with the needed count.
///
/// # Safety
/// `placements` must be null or valid for `*count` elements; `count` readable and writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: Handle,
    profile_id: c_uint,
    placements: *mut Placement,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let table = mig_table(&st, i)?;
        let p = mig::by_id(table, profile_id).ok_or(ret::INVALID_ARGUMENT)?;
        if count.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let n = p.placement_starts.len();
        if placements.is_null() {
            // SAFETY: caller contract (out-parameter), non-null.
            return unsafe { put(count, n as c_uint) };
        }
        // SAFETY: caller contract, non-null.
        let room = unsafe { count.read_unaligned() } as usize;
        // SAFETY: caller contract (out-parameter), non-null.
        unsafe { put(count, n as c_uint) }?;
        if room < n {
            return Err(ret::INSUFFICIENT_SIZE);
        }
        for (k, start) in p.placement_starts.iter().enumerate() {
            let v = Placement {
                start: *start,
                size: p.placement_size,
            };
            // SAFETY: `k < n <= room` elements the caller said the buffer holds.
            unsafe { put(placements.add(k), v) }?;
        }
        Ok(())
    })
}

/// `nvmlDeviceGetGpuInstanceById`: `NOT_SUPPORTED` with MIG off, `NOT_FOUND` if absent.
///
/// # Safety
/// `gpu_instance` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: Handle,
    id: c_uint,
    gpu_instance: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        mig_table(&st, i)?;
        if !st.gpus[i].mig_current {
            return Err(ret::NOT_SUPPORTED);
        }
        if !st.gpus[i].gpu_instances.iter().any(|g| g.id == id) {
            return Err(ret::NOT_FOUND);
        }
        // SAFETY: caller contract (out-parameter).
        unsafe { put(gpu_instance, handle(Key::Gi(i as u32, id))) }
    })
}

/// `nvmlDeviceGetGpuInstances`: the GPU instances of profile `profile_id`; the buffer must
/// hold the profile's `instanceCount` handles (as in nvml.h); `count` is output only.
///
/// # Safety
/// `gpu_instances` must be null or valid for the profile's `instanceCount` handles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: Handle,
    profile_id: c_uint,
    gpu_instances: *mut Handle,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let table = mig_table(&st, i)?;
        let p = mig::by_id(table, profile_id).ok_or(ret::INVALID_ARGUMENT)?;
        if !st.gpus[i].mig_current {
            return Err(ret::NOT_SUPPORTED);
        }
        if gpu_instances.is_null() || count.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let ids: Vec<u32> = st.gpus[i]
            .gpu_instances
            .iter()
            .filter(|g| g.profile_id == p.id)
            .map(|g| g.id)
            .take(p.instance_count as usize)
            .collect();
        for (k, id) in ids.iter().enumerate() {
            // SAFETY: at most `instanceCount` elements, which the caller's buffer holds.
            unsafe { put(gpu_instances.add(k), handle(Key::Gi(i as u32, *id))) }?;
        }
        // SAFETY: caller contract (out-parameter), non-null.
        unsafe { put(count, ids.len() as c_uint) }
    })
}

/// `nvmlGpuInstanceGetInfo`.
///
/// # Safety
/// `info` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: Handle,
    info: *mut GpuInstanceInfo,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let (i, id) = gi_handle(&st, gpu_instance)?;
        let gi = st.gpus[i]
            .gpu_instances
            .iter()
            .find(|g| g.id == id)
            .ok_or(ret::INVALID_ARGUMENT)?;
        let table = mig_table(&st, i)?;
        let p = mig::by_id(table, gi.profile_id).ok_or(ret::UNKNOWN)?;
        let v = GpuInstanceInfo {
            device: handle(Key::Gpu(i as u32)),
            id,
            profile_id: gi.profile_id,
            placement: Placement {
                start: gi.placement_start,
                size: p.placement_size,
            },
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(info, v) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceById`: `NOT_FOUND` if absent.
///
/// # Safety
/// `compute_instance` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: Handle,
    id: c_uint,
    compute_instance: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let (i, gi) = gi_handle(&st, gpu_instance)?;
        find_mig(&st, i, gi, id).ok_or(ret::NOT_FOUND)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(compute_instance, handle(Key::Ci(i as u32, gi, id))) }
    })
}

/// `nvmlComputeInstanceGetInfo_v2`: `device` is the MIG device handle of this CI.
///
/// # Safety
/// `info` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: Handle,
    info: *mut ComputeInstanceInfo,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let Key::Ci(i, gi, ci) = key_of(compute_instance)? else {
            return Err(ret::INVALID_ARGUMENT);
        };
        alive(&st, i as usize)?;
        let m = find_mig(&st, i as usize, gi, ci).ok_or(ret::INVALID_ARGUMENT)?;
        let v = ComputeInstanceInfo {
            device: handle(Key::Mig(i, gi, ci)),
            gpu_instance: handle(Key::Gi(i, gi)),
            id: ci,
            profile_id: m.ci.profile_id,
            placement: Placement {
                start: m.ci.placement_start,
                size: m.ci.slice_count,
            },
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(info, v) }
    })
}

/// The CI profile `index` inside GPU instance `gpu_instance`: a GI of `s` compute slices
/// offers every profile of `c <= s` slices, `s / c` times, with the GI's SMs split evenly and
/// its engines shared (the `nvidia-smi mig -lcip` listings of NVIDIA's MIG User Guide,
/// "Getting Started with MIG", and the A100 CI profiles of NVIDIA/go-nvml
/// `pkg/nvml/mock/dgxa100`, taken from real hardware).
pub(super) fn ci_profile(
    gpu_instance: Handle,
    index: c_uint,
    engine_profile: c_uint,
) -> Result<(CiProfileInfo, String), NvmlReturn> {
    let st = state()?;
    let (i, id) = gi_handle(&st, gpu_instance)?;
    if index >= mig::CI_PROFILE_INDEX_COUNT || engine_profile != 0 {
        return Err(ret::INVALID_ARGUMENT);
    }
    let gi = st.gpus[i]
        .gpu_instances
        .iter()
        .find(|g| g.id == id)
        .ok_or(ret::INVALID_ARGUMENT)?;
    let p = mig::by_id(mig_table(&st, i)?, gi.profile_id).ok_or(ret::UNKNOWN)?;
    let c = mig::ci_profile_slices(index)
        .filter(|c| *c <= p.slice_count)
        .ok_or(ret::NOT_SUPPORTED)?;
    let name = if c == p.slice_count {
        p.name.to_string()
    } else {
        format!("{c}c.{}", p.name)
    };
    let info = CiProfileInfo {
        id: index,
        slice_count: c,
        instance_count: p.slice_count / c,
        multiprocessor_count: p.multiprocessors * c / p.slice_count,
        shared_copy_engine_count: p.copy_engines,
        shared_decoder_count: p.decoders,
        shared_encoder_count: p.encoders,
        shared_jpeg_count: p.jpeg,
        shared_ofa_count: p.ofa,
    };
    Ok((info, name))
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo`: `NOT_SUPPORTED` for a profile the GPU
/// instance does not offer, `INVALID_ARGUMENT` past the last constant (callers enumerate until
/// then).
///
/// # Safety
/// `info` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: Handle,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut CiProfileInfo,
) -> NvmlReturn {
    guard(|| {
        let (v, _) = ci_profile(gpu_instance, profile, eng_profile)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(info, v) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfoV`: a v2 or v3 struct by its `version`.
///
/// # Safety
/// `info` must be null or valid for reads and writes of the struct its version names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: Handle,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut CiProfileInfoV3,
) -> NvmlReturn {
    guard(|| {
        // SAFETY: caller contract (struct starts with its version field).
        let version = unsafe { get_version(info.cast::<c_uint>()) }?;
        if version != CI_PROFILE_INFO_V2 && version != CI_PROFILE_INFO_V3 {
            return Err(ret::INVALID_ARGUMENT);
        }
        let (v, name) = ci_profile(gpu_instance, profile, eng_profile)?;
        let out = CiProfileInfoV3 {
            version,
            info: v,
            name: fixed::<NAME_LEN>(&format!("MIG {name}")),
            capabilities: 0,
        };
        let len = if version == CI_PROFILE_INFO_V3 {
            size_of::<CiProfileInfoV3>()
        } else {
            size_of::<CiProfileInfoV3>() - size_of::<c_uint>()
        };
        // SAFETY: caller contract: the version says the buffer holds `len` bytes; `out` is
        // a local of at least `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping((&raw const out).cast::<u8>(), info.cast::<u8>(), len);
        }
        Ok(())
    })
}
