//! Resolution of handles against the current state: which GPU or MIG device a handle names
//! now, and the per-device values several exports report.
//!
//! Invariant: every lookup of a GPU goes through [`alive`], so a GPU fallen off the bus
//! answers `GPU_IS_LOST` whichever export reaches it.

use super::handles::{Key, key_of};
use super::pointers::fixed;
use super::{Handle, NvmlReturn, PciInfo, ret};
use crate::mig;
use crate::state::{MigDeviceRef, State};

/// What a device handle names now: a full GPU (index) or a MIG device (parent index, device).
pub(super) enum Dev<'a> {
    Gpu(usize),
    Mig(usize, MigDeviceRef<'a>),
}

/// The MIG device (GI `gi`, CI `ci`) of GPU `gpu`, if it exists and is visible.
pub(super) fn find_mig(st: &State, gpu: usize, gi: u32, ci: u32) -> Option<MigDeviceRef<'_>> {
    st.mig_devices(gpu)
        .into_iter()
        .find(|m| m.gi.id == gi && m.ci.id == ci)
}

/// `GPU_IS_LOST` when GPU `i` has fallen off the bus.
pub(super) fn alive(st: &State, i: usize) -> Result<(), NvmlReturn> {
    if st.gpus.get(i).is_some_and(|g| g.health.lost) {
        return Err(ret::GPU_IS_LOST);
    }
    Ok(())
}

/// Resolves a device handle: `INVALID_ARGUMENT` for a foreign handle or a device that is
/// gone, `GPU_IS_LOST` for a GPU fallen off the bus.
pub(super) fn dev(st: &State, h: Handle) -> Result<Dev<'_>, NvmlReturn> {
    match key_of(h)? {
        Key::Gpu(i) if (i as usize) < st.gpus.len() => {
            alive(st, i as usize)?;
            Ok(Dev::Gpu(i as usize))
        }
        Key::Mig(i, gi, ci) => {
            alive(st, i as usize)?;
            find_mig(st, i as usize, gi, ci)
                .map(|m| Dev::Mig(i as usize, m))
                .ok_or(ret::INVALID_ARGUMENT)
        }
        _ => Err(ret::INVALID_ARGUMENT),
    }
}

/// The GPU index of a device (a MIG device's parent).
pub(super) fn gpu_of(d: &Dev<'_>) -> usize {
    match d {
        Dev::Gpu(i) | Dev::Mig(i, _) => *i,
    }
}

/// A full-GPU handle (not a MIG device).
pub(super) fn full_gpu(st: &State, h: Handle) -> Result<usize, NvmlReturn> {
    match dev(st, h)? {
        Dev::Gpu(i) => Ok(i),
        Dev::Mig(..) => Err(ret::NOT_SUPPORTED),
    }
}

/// A MIG-device handle (not a full GPU).
pub(super) fn mig_device(st: &State, h: Handle) -> Result<MigDeviceRef<'_>, NvmlReturn> {
    match dev(st, h)? {
        Dev::Mig(_, m) => Ok(m),
        Dev::Gpu(_) => Err(ret::NOT_SUPPORTED),
    }
}

/// A GPU-instance handle of a GPU with MIG enabled whose instance still exists: (GPU index,
/// GI ID).
pub(super) fn gi_handle(st: &State, h: Handle) -> Result<(usize, u32), NvmlReturn> {
    let key = key_of(h)?;
    if let Key::Gi(i, _) = key {
        alive(st, i as usize)?;
    }
    match key {
        Key::Gi(i, gi)
            if st
                .gpus
                .get(i as usize)
                .is_some_and(|g| g.mig_current && g.gpu_instances.iter().any(|x| x.id == gi)) =>
        {
            Ok((i as usize, gi))
        }
        _ => Err(ret::INVALID_ARGUMENT),
    }
}

/// GPU `i`'s MIG profile table; `NOT_SUPPORTED` for a GPU without MIG.
pub(super) fn mig_table(st: &State, i: usize) -> Result<&'static [mig::GiProfile], NvmlReturn> {
    st.profile.gpus[i].mig_profiles().ok_or(ret::NOT_SUPPORTED)
}

/// `nvmlPciInfo_t` of GPU `i`.
pub(super) fn pci_info(st: &State, i: usize) -> PciInfo {
    let g = &st.profile.gpus[i];
    let a = g.pci();
    PciInfo {
        bus_id_legacy: fixed(&a.legacy()),
        domain: a.domain,
        bus: a.bus,
        device: a.device,
        pci_device_id: crate::profile::pci_id(&g.pci_device_id),
        pci_sub_system_id: crate::profile::pci_id(&g.pci_sub_system_id),
        bus_id: fixed(&a.long()),
    }
}

const MIB: u64 = 1024 * 1024;

/// Memory of a device in bytes: the GPU's, or the MIG device's GI profile's.
pub(super) fn memory_bytes(st: &State, d: &Dev<'_>) -> u64 {
    match d {
        Dev::Gpu(i) => st.profile.gpus[*i].memory_mib * MIB,
        Dev::Mig(_, m) => m.profile.memory_mib * MIB,
    }
}
