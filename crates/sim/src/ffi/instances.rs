//! Exports: creating and destroying GPU and compute instances, and their remaining
//! capacity.
//!
//! Every change goes through `State::create_gpu_instance` and friends, the rules the
//! `nvidia-smi mig` stand-in uses, under the state lock with the capability files brought in
//! line (`setup::change_mig_layout`), so a created instance is at once a MIG device that
//! `nvmlDeviceGetMigDeviceHandleByIndex`, `nvmlDeviceGetHandleByUUID` and CDI see.
//!
//! Handles of GPU and compute instances name (GPU, GI ID[, CI ID]): after a destroy and a
//! recreate with the same IDs an old handle names the new instance, where a real driver would
//! hand out a new pointer. Callers that look instances up by ID, as the DRA driver does, do not
//! see the difference.

// Exports of the C ABI: `no_mangle` and caller-owned memory behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::c_uint;

use super::handles::{Key, handle, key_of};
use super::library::{guard, state, state_file};
use super::mig::ci_profile;
use super::pointers::{get_placement, put};
use super::resolve::{find_mig, full_gpu, gi_handle};
use super::{Handle, NvmlReturn, Placement, ret};
use crate::mig;
use crate::state::{self, State};

/// The NVML code a driver returns for each refusal of a MIG layout change (nvml.h on
/// `nvmlDeviceCreateGpuInstance*`, `nvmlGpuInstanceCreateComputeInstance*`, `*Destroy`):
/// - MIG not supported, or MIG mode disabled: `NOT_SUPPORTED` ("If device doesn't have MIG
///   mode enabled");
/// - a profile the GPU (or GPU instance) does not offer, or a placement that is not one of the
///   profile's: `INVALID_ARGUMENT` ("If device, profileId, placement or gpuInstance are
///   invalid");
/// - slices taken by another instance, no instance ID left, the profile's `instanceCount`
///   reached: `INSUFFICIENT_RESOURCES` (nvidia-smi prints "Insufficient Resources" for an
///   overlapping `-cgi`);
/// - destroying a GPU instance that still has compute instances: `IN_USE`;
/// - an instance that is gone: `NOT_FOUND`.
fn mig_code(e: &state::MigError) -> NvmlReturn {
    use state::MigError as E;
    match e {
        E::NotCapable | E::NotEnabled => ret::NOT_SUPPORTED,
        E::UnknownProfile | E::BadPlacement => ret::INVALID_ARGUMENT,
        E::Insufficient => ret::INSUFFICIENT_RESOURCES,
        E::NotFound => ret::NOT_FOUND,
        E::InUse => ret::IN_USE,
    }
}

/// Applies a MIG layout change to the state file (and its capability files) under the lock.
/// A process that does not see every device of the node may not change it (`NO_PERMISSION`,
/// as for an unprivileged container on a real node).
fn change_mig<T>(
    f: impl FnOnce(&mut State) -> Result<T, state::MigError>,
) -> Result<T, NvmlReturn> {
    match crate::setup::change_mig_layout(&state_file()?, f) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(mig_code(&e)),
        Err(crate::SimError::NotPermitted { .. }) => Err(ret::NO_PERMISSION),
        Err(_) => Err(ret::UNKNOWN),
    }
}

/// What the four create exports share: reads the caller's placement (the `WithPlacement`
/// forms pass `Some`), checks the out-parameter, creates the instance with `create` and
/// writes its handle.
///
/// # Safety
/// `placement`, when given, must be null or readable; `out` null or writable.
unsafe fn create_export(
    placement: Option<*const Placement>,
    out: *mut Handle,
    create: impl FnOnce(Option<Placement>) -> Result<Handle, NvmlReturn>,
) -> NvmlReturn {
    guard(|| {
        let placement = match placement {
            // SAFETY: caller contract (input struct).
            Some(p) => Some(unsafe { get_placement(p) }?),
            None => None,
        };
        if out.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let h = create(placement)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(out, h) }
    })
}

/// Creates a GPU instance on the full GPU `device`; `placement` `None` lets the driver pick.
fn create_gpu_instance(
    device: Handle,
    profile_id: c_uint,
    placement: Option<Placement>,
) -> Result<Handle, NvmlReturn> {
    let st = state()?;
    let i = full_gpu(&st, device)?;
    let id = change_mig(|s| {
        let id = s.create_gpu_instance(i, profile_id, placement.map(|p| p.start))?;
        // The driver checks the whole placement: a size other than the profile's is as
        // invalid as a wrong start (an assumption; refusing it is the safe side). Returning
        // the error here leaves the state unwritten.
        let size = s.profile.gpus[i]
            .mig_profiles()
            .and_then(|t| mig::by_id(t, profile_id))
            .map(|p| p.placement_size);
        match placement {
            Some(p) if Some(p.size) != size => Err(state::MigError::BadPlacement),
            _ => Ok(id),
        }
    })?;
    Ok(handle(Key::Gi(i as u32, id)))
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: a GPU instance of profile ID `profile_id` at
/// `placement` (memory slices). Refusals: see `mig_code`.
///
/// # Safety
/// `placement` must be null or readable; `gpu_instance` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: Handle,
    profile_id: c_uint,
    placement: *const Placement,
    gpu_instance: *mut Handle,
) -> NvmlReturn {
    // SAFETY: this export's contract is the helper's.
    unsafe {
        create_export(Some(placement), gpu_instance, |p| {
            create_gpu_instance(device, profile_id, p)
        })
    }
}

/// `nvmlDeviceCreateGpuInstance`: a GPU instance of profile ID `profile_id` at the first free
/// placement in the driver's order (highest start first).
///
/// # Safety
/// `gpu_instance` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: Handle,
    profile_id: c_uint,
    gpu_instance: *mut Handle,
) -> NvmlReturn {
    // SAFETY: this export's contract is the helper's.
    unsafe {
        create_export(None, gpu_instance, |p| {
            create_gpu_instance(device, profile_id, p)
        })
    }
}

/// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more GPU instances of profile ID
/// `profile_id` fit now; `NOT_SUPPORTED` with MIG disabled.
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: Handle,
    profile_id: c_uint,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let n = st
            .gpu_instance_capacity(i, profile_id)
            .map_err(|e| mig_code(&e))?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(count, n) }
    })
}

/// `nvmlGpuInstanceDestroy`: `IN_USE` while the GPU instance has compute instances.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: Handle) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let (i, gi) = gi_handle(&st, gpu_instance)?;
        change_mig(|s| s.destroy_gpu_instance(i, gi))
    })
}

/// Creates a compute instance in the GPU instance `gpu_instance`.
fn create_compute_instance(
    gpu_instance: Handle,
    profile_id: c_uint,
    placement: Option<Placement>,
) -> Result<Handle, NvmlReturn> {
    let st = state()?;
    let (i, gi) = gi_handle(&st, gpu_instance)?;
    let ci = change_mig(|s| {
        let ci = s.create_compute_instance_with(i, gi, profile_id, placement.map(|p| p.start))?;
        // As for GPU instances: the size must be the profile's.
        match placement {
            Some(p) if Some(p.size) != mig::ci_profile_slices(profile_id) => {
                Err(state::MigError::BadPlacement)
            }
            _ => Ok(ci),
        }
    })?;
    Ok(handle(Key::Ci(i as u32, gi, ci)))
}

/// `nvmlGpuInstanceCreateComputeInstance`: a compute instance of CI profile `profile_id`
/// (the `NVML_COMPUTE_INSTANCE_PROFILE_*` constant, which is also its ID) at the first free
/// placement. Refusals: see `mig_code`.
///
/// # Safety
/// `compute_instance` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: Handle,
    profile_id: c_uint,
    compute_instance: *mut Handle,
) -> NvmlReturn {
    // SAFETY: this export's contract is the helper's.
    unsafe {
        create_export(None, compute_instance, |p| {
            create_compute_instance(gpu_instance, profile_id, p)
        })
    }
}

/// `nvmlGpuInstanceCreateComputeInstanceWithPlacement`: as
/// [`nvmlGpuInstanceCreateComputeInstance`] at `placement` (compute slices of the GI).
///
/// # Safety
/// `placement` must be null or readable; `compute_instance` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: Handle,
    profile_id: c_uint,
    placement: *const Placement,
    compute_instance: *mut Handle,
) -> NvmlReturn {
    // SAFETY: this export's contract is the helper's.
    unsafe {
        create_export(Some(placement), compute_instance, |p| {
            create_compute_instance(gpu_instance, profile_id, p)
        })
    }
}

/// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`: how many more compute instances of
/// CI profile `profile_id` fit in the GPU instance now.
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: Handle,
    profile_id: c_uint,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let (i, gi) = gi_handle(&st, gpu_instance)?;
        let n = st
            .compute_instance_capacity(i, gi, profile_id)
            .map_err(|e| mig_code(&e))?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(count, n) }
    })
}

/// `nvmlGpuInstanceGetComputeInstances`: the compute instances of CI profile `profile_id`; the
/// buffer must hold the profile's `instanceCount` handles (as in nvml.h); `count` is output
/// only. A CI profile the GPU instance does not offer is `NOT_SUPPORTED`.
///
/// # Safety
/// `compute_instances` must be null or valid for the profile's `instanceCount` handles;
/// `count` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: Handle,
    profile_id: c_uint,
    compute_instances: *mut Handle,
    count: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let (info, _) = ci_profile(gpu_instance, profile_id, 0)?;
        let st = state()?;
        let (i, gi) = gi_handle(&st, gpu_instance)?;
        if compute_instances.is_null() || count.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let ids: Vec<u32> = st
            .mig_devices(i)
            .iter()
            .filter(|m| m.gi.id == gi && m.ci.profile_id == profile_id)
            .map(|m| m.ci.id)
            .take(info.instance_count as usize)
            .collect();
        for (k, id) in ids.iter().enumerate() {
            // SAFETY: at most `instanceCount` elements, which the caller's buffer holds.
            unsafe { put(compute_instances.add(k), handle(Key::Ci(i as u32, gi, *id))) }?;
        }
        // SAFETY: caller contract (out-parameter), non-null.
        unsafe { put(count, ids.len() as c_uint) }
    })
}

/// `nvmlComputeInstanceDestroy`. The simulator runs no processes on MIG devices, so the
/// driver's `IN_USE` for a busy compute instance never happens here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(compute_instance: Handle) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let Key::Ci(i, gi, ci) = key_of(compute_instance)? else {
            return Err(ret::INVALID_ARGUMENT);
        };
        find_mig(&st, i as usize, gi, ci).ok_or(ret::INVALID_ARGUMENT)?;
        change_mig(|s| s.destroy_compute_instance(i as usize, gi, ci))
    })
}
