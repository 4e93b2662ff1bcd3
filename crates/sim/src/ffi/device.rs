//! Exports: device enumeration (count, handles by index, UUID and PCI bus ID) and identity
//! (name, UUID, serial, minor number, brand, architecture, compute capability, memory, PCI
//! and NUMA information).

// Exports of the C ABI: `no_mangle` and caller-owned memory behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint};

use super::handles::{Key, handle};
use super::library::{guard, state};
use super::pointers::{get_str, get_version, put, put_str};
use super::resolve::{Dev, alive, dev, full_gpu, gpu_of, memory_bytes, pci_info};
use super::{Handle, MEMORY_V2, Memory, MemoryV2, NvmlReturn, PciInfo, ret};

/// `nvmlDeviceGetCount_v2`: number of GPUs (MIG devices are not counted).
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(count, st.gpus.len() as c_uint) }
    })
}

/// `nvmlDeviceGetCount`.
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(count) }
}

/// `nvmlDeviceGetHandleByIndex_v2`.
///
/// # Safety
/// `device` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        if index as usize >= st.gpus.len() {
            return Err(ret::INVALID_ARGUMENT);
        }
        alive(&st, index as usize)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(device, handle(Key::Gpu(index))) }
    })
}

/// `nvmlDeviceGetHandleByIndex`.
///
/// # Safety
/// `device` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut Handle,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

/// `nvmlDeviceGetHandleByUUID`: GPU or MIG UUID.
///
/// # Safety
/// `uuid` must be null or NUL-terminated; `device` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (C string).
        let uuid = unsafe { get_str(uuid) }?;
        let key = if let Some(i) = st.gpu_by_uuid(&uuid) {
            alive(&st, i)?;
            Key::Gpu(i as u32)
        } else if let Some((i, gi, ci)) = st.mig_by_uuid(&uuid) {
            alive(&st, i)?;
            Key::Mig(i as u32, gi, ci)
        } else {
            return Err(ret::NOT_FOUND);
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(device, handle(key)) }
    })
}

/// `nvmlDeviceGetHandleByPciBusId_v2`: any of the `DDDDDDDD:BB:DD.F`, `DDDD:BB:DD.F`,
/// `BB:DD.F` forms.
///
/// # Safety
/// `bus_id` must be null or NUL-terminated; `device` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (C string).
        let s = unsafe { get_str(bus_id) }?;
        let want = crate::profile::PciAddress::parse(&s).ok_or(ret::INVALID_ARGUMENT)?;
        let i = st
            .profile
            .gpus
            .iter()
            .position(|g| g.pci() == want)
            .ok_or(ret::NOT_FOUND)?;
        alive(&st, i)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(device, handle(Key::Gpu(i as u32))) }
    })
}

/// `nvmlDeviceGetHandleByPciBusId` (the `_v1` name; same forms as `_v2`).
///
/// # Safety
/// `bus_id` must be null or NUL-terminated; `device` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    device: *mut Handle,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(bus_id, device) }
}

/// `nvmlDeviceGetIndex` (full GPUs only).
///
/// # Safety
/// `device` must be a handle from this library; `index` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: Handle, index: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(index, i as c_uint) }
    })
}

/// `nvmlDeviceGetName`: product name; for a MIG device `<GPU name> MIG <profile>`.
///
/// # Safety
/// `name` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: Handle,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let d = dev(&st, device)?;
        let gpu = &st.profile.gpus[gpu_of(&d)].name;
        let s = match &d {
            Dev::Gpu(_) => gpu.clone(),
            Dev::Mig(_, m) => format!("{gpu} MIG {}", m.name()),
        };
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(name, length, &s) }
    })
}

/// `nvmlDeviceGetUUID`: `GPU-…` or `MIG-…`.
///
/// # Safety
/// `uuid` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: Handle,
    uuid: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let s = match dev(&st, device)? {
            Dev::Gpu(i) => st.profile.gpus[i].uuid.clone(),
            Dev::Mig(_, m) => m.ci.uuid.clone(),
        };
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(uuid, length, &s) }
    })
}

/// `nvmlDeviceGetSerial` (`NOT_SUPPORTED` on boards without one).
///
/// # Safety
/// `serial` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: Handle,
    serial: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let s = st.profile.gpus[i]
            .serial
            .clone()
            .ok_or(ret::NOT_SUPPORTED)?;
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(serial, length, &s) }
    })
}

/// `nvmlDeviceGetMinorNumber` (full GPUs only).
///
/// # Safety
/// `minor` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: Handle,
    minor: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(minor, st.profile.gpus[i].minor) }
    })
}

/// `nvmlDeviceGetBrand` (a MIG device reports its parent's).
///
/// # Safety
/// `brand` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(device: Handle, brand: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = gpu_of(&dev(&st, device)?);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(brand, st.profile.gpus[i].brand_value()) }
    })
}

/// `nvmlDeviceGetArchitecture` (a MIG device reports its parent's).
///
/// # Safety
/// `arch` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: Handle,
    arch: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = gpu_of(&dev(&st, device)?);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(arch, st.profile.gpus[i].architecture_value()) }
    })
}

/// `nvmlDeviceGetCudaComputeCapability` (a MIG device reports its parent's).
///
/// # Safety
/// `major` and `minor` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: Handle,
    major: *mut c_int,
    minor: *mut c_int,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = gpu_of(&dev(&st, device)?);
        let (a, b) = st.profile.gpus[i].cc();
        if major.is_null() || minor.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        // SAFETY: caller contract (out-parameters), both non-null.
        unsafe {
            put(major, a)?;
            put(minor, b)
        }
    })
}

/// `nvmlDeviceGetMemoryInfo` (v1 struct).
///
/// # Safety
/// `memory` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: Handle,
    memory: *mut Memory,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let d = dev(&st, device)?;
        let total = memory_bytes(&st, &d);
        let used = super::processes::used_bytes(&st, &d)?.min(total);
        let m = Memory {
            total,
            free: total - used,
            used,
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(memory, m) }
    })
}

/// `nvmlDeviceGetMemoryInfo_v2` (versioned struct; the caller sets `version`).
///
/// # Safety
/// `memory` must be null or valid for reads and writes of `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: Handle,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let d = dev(&st, device)?;
        let total = memory_bytes(&st, &d);
        let used = super::processes::used_bytes(&st, &d)?.min(total);
        // SAFETY: caller contract (struct starts with its version field).
        let version = unsafe { get_version(memory.cast::<c_uint>()) }?;
        if version != MEMORY_V2 {
            return Err(ret::INVALID_ARGUMENT);
        }
        let m = MemoryV2 {
            version,
            total,
            reserved: 0,
            free: total - used,
            used,
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(memory, m) }
    })
}

/// `nvmlDeviceGetPciInfo_v3` (a MIG device reports its parent's).
///
/// # Safety
/// `pci` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(device: Handle, pci: *mut PciInfo) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = gpu_of(&dev(&st, device)?);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(pci, pci_info(&st, i)) }
    })
}

/// `nvmlDeviceGetPciInfo_v2` (same layout as `_v3`).
///
/// # Safety
/// `pci` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(device: Handle, pci: *mut PciInfo) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetPciInfo_v3(device, pci) }
}

/// `nvmlDeviceGetNumaNodeId` (full GPUs only).
///
/// # Safety
/// `node` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: Handle, node: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(node, st.profile.gpus[i].numa_node) }
    })
}
