//! Exports: GPU topology. The PCIe common ancestor and peer-to-peer status of a GPU pair,
//! each NVLink link's state, version, capabilities and remote end (a peer GPU, or on
//! NVSwitch systems the switch), and the baseboard module ID. The answers come from
//! [`crate::topology`]; full GPUs only (a MIG device has no topology of its own:
//! `NOT_SUPPORTED`).

// Exports of the C ABI: `no_mangle` and caller-owned memory behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::c_uint;

use super::library::{guard, state};
use super::pointers::{fixed, put};
use super::resolve::{full_gpu, pci_info};
use super::{Handle, NvmlReturn, PciInfo, ret};
use crate::profile::{GpuSpec, PciAddress};
use crate::state::State;
use crate::topology::{self, RemoteEnd};

/// `NVML_FEATURE_ENABLED`.
const FEATURE_ENABLED: c_uint = 1;

/// GPU `i`'s spec and the remote end of its link `link`: `NOT_SUPPORTED` for a GPU without
/// NVLink, `INVALID_ARGUMENT` past its last link.
fn link_of(st: &State, i: usize, link: c_uint) -> Result<(&GpuSpec, RemoteEnd), NvmlReturn> {
    let g = &st.profile.gpus[i];
    if g.nvlinks.is_empty() {
        return Err(ret::NOT_SUPPORTED);
    }
    let end = topology::remote_end(g, link).ok_or(ret::INVALID_ARGUMENT)?;
    Ok((g, end))
}

/// `nvmlPciInfo_t` of a device known only by address (the subsystem ID is not filled, as
/// NVML documents for the remote end of a link).
fn pci_at(bus: &str, device_id: u32) -> Result<PciInfo, NvmlReturn> {
    let a = PciAddress::parse(bus).ok_or(ret::UNKNOWN)?;
    Ok(PciInfo {
        bus_id_legacy: fixed(&a.legacy()),
        domain: a.domain,
        bus: a.bus,
        device: a.device,
        pci_device_id: device_id,
        pci_sub_system_id: 0,
        bus_id: fixed(&a.long()),
    })
}

/// The combined device and vendor ID an NVSwitch of a GPU generation reports: the first
/// NVSwitch (`0x1AF1`) with Volta and Ampere, the third (`0x22A3`) with Hopper.
fn switch_device_id(g: &GpuSpec) -> u32 {
    match g.architecture.as_str() {
        "Hopper" | "Blackwell" => 0x22A3_10DE,
        _ => 0x1AF1_10DE,
    }
}

/// `nvmlDeviceGetTopologyCommonAncestor`.
///
/// # Safety
/// `path_info` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: Handle,
    device2: Handle,
    path_info: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let a = full_gpu(&st, device1)?;
        let b = full_gpu(&st, device2)?;
        let level = topology::common_ancestor(&st.profile.gpus[a], &st.profile.gpus[b]);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(path_info, level) }
    })
}

/// `nvmlDeviceGetP2PStatus`: a GPU in MIG mode has no peer-to-peer.
///
/// # Safety
/// `status` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    device1: Handle,
    device2: Handle,
    p2p_index: c_uint,
    status: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let a = full_gpu(&st, device1)?;
        let b = full_gpu(&st, device2)?;
        if a == b {
            return Err(ret::INVALID_ARGUMENT);
        }
        let s = topology::p2p_status(
            &st.profile.gpus[a],
            st.gpus[a].mig_current,
            &st.profile.gpus[b],
            st.gpus[b].mig_current,
            p2p_index,
        )
        .ok_or(ret::INVALID_ARGUMENT)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(status, s) }
    })
}

/// `nvmlDeviceGetNvLinkState`: every link of the profile is up.
///
/// # Safety
/// `is_active` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: Handle,
    link: c_uint,
    is_active: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        link_of(&st, i, link)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(is_active, FEATURE_ENABLED) }
    })
}

/// `nvmlDeviceGetNvLinkVersion`: 2 on Volta, 3 on Ampere, 4 on Hopper.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkVersion(
    device: Handle,
    link: c_uint,
    version: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let (g, _) = link_of(&st, i, link)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(version, topology::nvlink_version(g)) }
    })
}

/// `nvmlDeviceGetNvLinkCapability`: peer-to-peer, system memory access, peer-to-peer atomics
/// and a valid link on every link; no system-memory atomics, no SLI bridge.
///
/// # Safety
/// `cap_result` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkCapability(
    device: Handle,
    link: c_uint,
    capability: c_uint,
    cap_result: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        link_of(&st, i, link)?;
        let v = match capability {
            0..=2 | 5 => 1,
            3 | 4 => 0,
            _ => return Err(ret::INVALID_ARGUMENT),
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(cap_result, v) }
    })
}

/// `nvmlDeviceGetNvLinkRemotePciInfo_v2`: the peer GPU's PCI information, or the NVSwitch's.
///
/// # Safety
/// `pci` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: Handle,
    link: c_uint,
    pci: *mut PciInfo,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let (g, end) = link_of(&st, i, link)?;
        let info = match end {
            RemoteEnd::Gpu(bus) => {
                let want = PciAddress::parse(&bus);
                match st.profile.gpus.iter().position(|p| Some(p.pci()) == want) {
                    Some(peer) => PciInfo {
                        pci_sub_system_id: 0,
                        ..pci_info(&st, peer)
                    },
                    // A peer this process does not see is still at the end of the link.
                    None => pci_at(&bus, crate::profile::pci_id(&g.pci_device_id))?,
                }
            }
            RemoteEnd::Switch(n) => {
                let bus = st.profile.nvswitches.get(n).ok_or(ret::UNKNOWN)?;
                pci_at(bus, switch_device_id(g))?
            }
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(pci, info) }
    })
}

/// `nvmlDeviceGetNvLinkRemotePciInfo` (the header maps the name to `_v2`).
///
/// # Safety
/// `pci` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo(
    device: Handle,
    link: c_uint,
    pci: *mut PciInfo,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci) }
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`: GPU or SWITCH.
///
/// # Safety
/// `device_type` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: Handle,
    link: c_uint,
    device_type: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let (_, end) = link_of(&st, i, link)?;
        let t = match end {
            RemoteEnd::Gpu(_) => topology::remote_type::GPU,
            RemoteEnd::Switch(_) => topology::remote_type::SWITCH,
        };
        // SAFETY: caller contract (out-parameter).
        unsafe { put(device_type, t) }
    })
}

/// `nvmlDeviceGetModuleId`: the baseboard module, 0 for boards not on a baseboard.
///
/// # Safety
/// `module_id` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetModuleId(
    device: Handle,
    module_id: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(module_id, st.profile.gpus[i].module_id) }
    })
}
