//! The NVML backend of the [`GpuInventory`] seam: discovers GPUs and MIG devices through
//! `libnvidia-ml.so.1`, and reads the PCIe topology from sysfs.
//!
//! This crate holds all of the driver's hardware I/O (library loading, raw NVML calls, sysfs
//! reads), so that the pure crates (`gpu-dra-device`, `gpu-dra-core`) never link NVML: the node
//! binary injects this backend at startup.
//!
//! Invariants:
//! - Only the NVML entry points the simulator implements are called (see the project
//!   contracts); anything else would work on real hardware and fail in every test.
//! - NVML is initialised per discovery (and per [`GpuInventory::still_current`] check) and
//!   shut down when it ends (the `Nvml` value is dropped), so each sees the driver's current
//!   MIG layout and no handle outlives its session.
//! - The library is looked up afresh for every session ([`NvmlLibrary::locate`]): a driver
//!   upgraded in place renames its files (`libnvidia-ml.so.<version>`), so a path resolved
//!   once would name a file that is gone; and the loader hands out a library it still has
//!   loaded under the same path, so only the new file's own name reaches the new driver.
//! - NVML out of reach as a whole (no library, no kernel module, library and module of
//!   different versions) is [`DeviceError::Init`]; a failure of one GPU or query is not.
//! - The check prepare makes before each claim ([`GpuInventory::still_current`]) reads the
//!   driver version and only the claim's devices by UUID: its cost does not grow with the
//!   node's GPUs, and it reads no sysfs (the PCIe root of a GPU whose UUID, index and minor
//!   are unchanged is unchanged); another driver version answers "not current", so the full
//!   discovery that follows finds the new version's files.
//! - A GPU that does not support MIG is not an error: its `mig` is `None`.
//!
//! Modules: [`sysfs`] (PCIe root and NUMA node of a GPU), [`topology`] (NVLink peers from
//! NVML's peer-to-peer status), [`health`] (the NVML health source:
//! XID and ECC events, probes of each GPU), [`mig_ops`] (dynamic MIG's instance creation and
//! destruction), [`usage`] (the processes on each device and what they use).
//!
//! The safe nvml-wrapper API lacks the GPU-instance calls (`nvmlDeviceGetGpuInstanceId`,
//! `nvmlDeviceGetComputeInstanceId`, `nvmlDeviceGetGpuInstanceById`, `nvmlGpuInstanceGetInfo`)
//! and maps brand/architecture to enums that reject values newer than the crate; those calls go
//! through the raw bindings.
//!
//! Unsafe code: `unsafe_code` is denied for the crate (`[lints]` in its Cargo.toml) and
//! allowed only where raw NVML calls are made, every block with a `// SAFETY:` comment
//! (clippy's `undocumented_unsafe_blocks`):
//! - `src/lib.rs`: the raw calls and handles of discovery, one `allow` on each function that
//!   uses one (`NvmlInventory::gpu`, `gi_profile_indices`, `gpu_instance_info`,
//!   `addressing_mode`, `raw_u32`);
//! - `src/health.rs`: the event set and the field-value read (the whole module);
//! - `src/mig_ops.rs`: dynamic MIG's GPU- and compute-instance calls (the whole module).
//!
//! `src/sysfs.rs` has none. `repo-tests/tests/docs.rs` keeps this list and the `allow`s in step.

pub mod health;
pub mod mig_ops;
pub mod sysfs;
pub mod topology;
pub mod usage;

pub use mig_ops::{CreatedMig, MigInstance, MigOps, MigOpsError};

use std::collections::HashMap;
use std::ffi::c_uint;
use std::path::{Path, PathBuf};

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlDeviceAddressingMode_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstanceProfileInfo_t, nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

use gpu_dra_device::{
    ComputeCapability, DeviceError, DeviceRef, Gpu, GpuInventory, Inventory, MigDevice, MigMode,
    Placement, names,
};

/// Where the NVML backend finds its library and sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlOptions {
    /// The NVML library.
    pub library: NvmlLibrary,
    /// Root of sysfs, `/sys` on a host (read for PCIe root and NUMA node).
    pub sysfs_root: PathBuf,
}

/// Which NVML library a session loads, decided anew for every session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlLibrary {
    /// This path, as given (`--nvml-lib`); a link is followed by the loader each time.
    Path(PathBuf),
    /// The first `libnvidia-ml.so.1` under this driver root ([`find_library`]).
    Under(PathBuf),
}

impl NvmlLibrary {
    /// The library file to load now. The error names what was looked for.
    pub fn locate(&self) -> Result<PathBuf, DeviceError> {
        match self {
            NvmlLibrary::Path(path) if path.exists() => Ok(path.clone()),
            NvmlLibrary::Path(path) => Err(DeviceError::Init {
                path: path.display().to_string(),
                reason: "the file does not exist".into(),
            }),
            NvmlLibrary::Under(root) => find_library(root).ok_or_else(|| DeviceError::Init {
                path: format!(
                    "{} under {} (in {})",
                    LIBRARY_NAME,
                    root.display(),
                    LIBRARY_DIRS.join(", ")
                ),
                reason: "no such library (is the driver installed, or being upgraded?)".into(),
            }),
        }
    }

    /// What identifies the library a session would load now: its path and the file's device
    /// and inode (`None` when there is none). A driver upgraded in place changes it.
    pub fn identity(&self) -> Option<(PathBuf, u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let path = self.locate().ok()?;
        let meta = std::fs::metadata(&path).ok()?;
        Some((path, meta.dev(), meta.ino()))
    }

    /// Loads the library and initialises NVML.
    pub fn open(&self) -> Result<Nvml, DeviceError> {
        let path = self.locate()?;
        Nvml::builder()
            .lib_path(path.as_os_str())
            .init()
            .map_err(|e| DeviceError::Init {
                path: path.display().to_string(),
                reason: e.to_string(),
            })
    }
}

/// Directories searched under a driver root for `libnvidia-ml.so.1`, in order.
pub const LIBRARY_DIRS: [&str; 6] = [
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib",
];

/// The NVML library file name.
pub const LIBRARY_NAME: &str = "libnvidia-ml.so.1";

/// Finds `libnvidia-ml.so.1` under `driver_root`: the first of [`LIBRARY_DIRS`] that holds it.
/// Symlinks are resolved inside the driver root (an absolute link target such as
/// `/usr/lib/libnvidia-ml.so.580.95.05` means `<driver_root>/usr/lib/...`), so a driver
/// installed in a container image or a host mount is found as it would be on its own root.
pub fn find_library(driver_root: &Path) -> Option<PathBuf> {
    LIBRARY_DIRS
        .iter()
        .map(|dir| driver_root.join(dir).join(LIBRARY_NAME))
        .find_map(|candidate| resolve_in_root(driver_root, &candidate))
}

/// Follows symlinks of `path`, re-rooting absolute targets under `root`; returns the final path
/// when it is a regular file. Gives up after 16 links (a loop).
pub fn resolve_in_root(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..16 {
        let meta = std::fs::symlink_metadata(&current).ok()?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&current).ok()?;
            current = if target.is_absolute() {
                let relative = target.strip_prefix("/").unwrap_or(&target);
                root.join(relative)
            } else {
                current.parent()?.join(target)
            };
        } else if meta.is_file() {
            return Some(current);
        } else {
            return None;
        }
    }
    None
}

/// GPU inventory read from NVML.
#[derive(Debug, Clone)]
pub struct NvmlInventory {
    options: NvmlOptions,
}

impl NvmlInventory {
    /// A backend that loads NVML from `options.library` on each discovery.
    pub fn new(options: NvmlOptions) -> Self {
        Self { options }
    }

    /// The options this backend was built with.
    pub fn options(&self) -> &NvmlOptions {
        &self.options
    }
}

impl GpuInventory for NvmlInventory {
    /// The driver version, then a few NVML calls per named device (handle by UUID, index,
    /// minor, MIG mode, and for a MIG device its GPU and compute instance IDs), none per other
    /// GPU and no sysfs read. Any NVML error answers `false`: the full discovery that follows
    /// reports it properly.
    fn still_current(&self, known: &Inventory, names: &[&str]) -> Result<bool, DeviceError> {
        let mut devices = Vec::with_capacity(names.len());
        for name in names {
            match known.device(name) {
                Some(d) if !known.lost_gpus.contains(&d.gpu().index) => devices.push(d),
                _ => return Ok(false),
            }
        }
        if devices.is_empty() {
            return Ok(true);
        }
        let nvml = self.options.library.open()?;
        // A driver upgraded in place keeps the GPUs' UUIDs but not its files: the spec of
        // this claim must name the new version's, which only a discovery finds.
        if nvml.sys_driver_version().ok().as_deref() != Some(known.driver_version.as_str()) {
            return Ok(false);
        }
        Ok(devices
            .into_iter()
            .all(|d| device_unchanged(&nvml, d).unwrap_or(false)))
    }

    fn discover(&self) -> Result<Inventory, DeviceError> {
        let nvml = self.options.library.open()?;
        let system = || "the system".to_string();
        let driver_version = nvml
            .sys_driver_version()
            .map_err(query("nvmlSystemGetDriverVersion", system))?;
        let cuda = nvml
            .sys_cuda_driver_version()
            .map_err(query("nvmlSystemGetCudaDriverVersion_v2", system))?;
        let count = nvml
            .device_count()
            .map_err(query("nvmlDeviceGetCount_v2", system))?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut handles = Vec::with_capacity(count as usize);
        let mut lost_gpus = Vec::new();
        for index in 0..count {
            // A GPU that fell off the bus is reported, not fatal: the rest of the node works.
            let gpu = nvml
                .device_by_index(index)
                .map_err(query("nvmlDeviceGetHandleByIndex_v2", || {
                    format!("GPU index {index}")
                }))
                .and_then(|device| Ok((self.gpu(&nvml, index, &device)?, device)));
            match gpu {
                Err(DeviceError::GpuLost { .. }) => {
                    tracing::warn!(gpu = index, "GPU is lost (fallen off the bus)");
                    lost_gpus.push(index);
                }
                other => {
                    let (gpu, device) = other?;
                    gpus.push(gpu);
                    handles.push(device);
                }
            }
        }
        topology::fill_nvlink_peers(&mut gpus, &handles);
        tracing::debug!(gpus = gpus.len(), driver = %driver_version, "discovered GPUs through NVML");
        Ok(Inventory {
            driver_version,
            cuda_driver_version: names::cuda_driver_version(cuda),
            gpus,
            lost_gpus,
        })
    }
}

/// Whether `device` is on the node as recorded (see [`GpuInventory::still_current`]).
fn device_unchanged(nvml: &Nvml, device: DeviceRef<'_>) -> Result<bool, NvmlError> {
    let gpu = device.gpu();
    let handle = nvml.device_by_uuid(gpu.uuid.as_str())?;
    if handle.index()? != gpu.index || handle.minor_number()? != gpu.minor {
        return Ok(false);
    }
    let mig = match handle.mig_mode() {
        Ok(mode) => Some(mode.current == 1),
        Err(NvmlError::NotSupported) => None,
        Err(e) => return Err(e),
    };
    if mig != gpu.mig.map(|m| m.current) {
        return Ok(false);
    }
    let DeviceRef::Mig { mig, .. } = device else {
        return Ok(true);
    };
    // A MIG UUID names one instance: destroyed and created again, it gets a new one.
    let instance = nvml.device_by_uuid(mig.uuid.as_str())?;
    Ok(
        raw_u32(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref(), &instance)? == mig.gi_id
            && raw_u32(
                nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref(),
                &instance,
            )? == mig.ci_id,
    )
}

/// Maps an NVML error to [`DeviceError::Query`] naming the call and the target.
fn query<F: FnOnce() -> String>(
    call: &'static str,
    target: F,
) -> impl FnOnce(NvmlError) -> DeviceError {
    move |e| match e {
        NvmlError::GpuLost => DeviceError::GpuLost {
            call,
            target: target(),
        },
        e => DeviceError::Query {
            call,
            target: target(),
            reason: e.to_string(),
        },
    }
}

impl NvmlInventory {
    // The raw handle for the MIG profile listing of `mig_ops`.
    #[allow(unsafe_code)]
    fn gpu(&self, nvml: &Nvml, index: u32, device: &Device<'_>) -> Result<Gpu, DeviceError> {
        let at = || format!("GPU index {index}");
        let uuid = device.uuid().map_err(query("nvmlDeviceGetUUID", at))?;
        let target = || format!("GPU index {index} ({uuid})");
        let minor = device
            .minor_number()
            .map_err(query("nvmlDeviceGetMinorNumber", target))?;
        let product_name = device.name().map_err(query("nvmlDeviceGetName", target))?;
        let brand = raw_u32(nvml.lib().nvmlDeviceGetBrand.as_ref(), device)
            .map_err(query("nvmlDeviceGetBrand", target))?;
        let arch = raw_u32(nvml.lib().nvmlDeviceGetArchitecture.as_ref(), device)
            .map_err(query("nvmlDeviceGetArchitecture", target))?;
        let cc = device
            .cuda_compute_capability()
            .map_err(query("nvmlDeviceGetCudaComputeCapability", target))?;
        let memory_bytes = device
            .memory_info()
            .map_err(query("nvmlDeviceGetMemoryInfo_v2", target))?
            .total;
        let raw_bus_id = device
            .pci_info()
            .map_err(query("nvmlDeviceGetPciInfo_v3", target))?
            .bus_id;
        let pci_bus_id =
            names::canonical_pci_bus_id(&raw_bus_id).ok_or_else(|| DeviceError::Query {
                call: "nvmlDeviceGetPciInfo_v3",
                target: target(),
                reason: format!(
                    "bus ID {raw_bus_id:?} is not of the form domain:bus:device.function"
                ),
            })?;
        let pcie_root = sysfs::pcie_root(&self.options.sysfs_root, &pci_bus_id);
        if pcie_root.is_none() {
            tracing::warn!(gpu = index, bus_id = %pci_bus_id, sysfs = %self.options.sysfs_root.display(),
                "PCIe root not found in sysfs; publishing without the pcieRoot attribute");
        }
        let numa_node = sysfs::numa_node(&self.options.sysfs_root, &pci_bus_id);
        let mig = match device.mig_mode() {
            Ok(mode) => Some(MigMode {
                current: mode.current == 1,
                pending: mode.pending == 1,
            }),
            Err(NvmlError::NotSupported) => None,
            Err(e) => return Err(query("nvmlDeviceGetMigMode", target)(e)),
        };
        let mut gpu = Gpu {
            index,
            minor,
            uuid: uuid.clone(),
            product_name,
            brand: names::brand_name(brand),
            architecture: names::architecture_name(arch),
            cuda_compute_capability: ComputeCapability {
                major: u32::try_from(cc.major).unwrap_or(0),
                minor: u32::try_from(cc.minor).unwrap_or(0),
            },
            memory_bytes,
            pci_bus_id,
            pcie_root,
            numa_node,
            addressing_mode: addressing_mode(nvml, device),
            nvlink_peers: Vec::new(),
            mig,
            mig_devices: Vec::new(),
            mig_profiles: Vec::new(),
        };
        if gpu.mig_enabled() {
            gpu.mig_devices = mig_devices(nvml, device, &gpu)?;
            if gpu.mig_devices.is_empty() {
                tracing::warn!(gpu = %gpu.device_name(), "MIG is enabled but no MIG devices exist; nothing to publish for this GPU");
            }
            let at = target();
            // SAFETY: the handle of `device`, live for this discovery's NVML session, is only
            // used during the call.
            let handle = unsafe { device.handle() };
            gpu.mig_profiles = mig_ops::profiles_of(nvml.lib(), handle, gpu.memory_bytes, &at)
                .map_err(|e| e.into_device_error(&at))?;
        }
        Ok(gpu)
    }
}

/// Walks the MIG devices of a MIG-enabled GPU (indices up to the maximum count; absent indices
/// are skipped as NVML documents).
fn mig_devices(nvml: &Nvml, parent: &Device<'_>, gpu: &Gpu) -> Result<Vec<MigDevice>, DeviceError> {
    let target = || format!("{} ({})", gpu.device_name(), gpu.uuid);
    let max = parent
        .mig_device_count()
        .map_err(query("nvmlDeviceGetMaxMigDeviceCount", target))?;
    let index_by_profile_id = gi_profile_indices(nvml, parent);
    let mut out = Vec::new();
    for i in 0..max {
        let mig = match parent.mig_device_by_index(i) {
            Ok(mig) => mig,
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                return Err(query("nvmlDeviceGetMigDeviceHandleByIndex", || {
                    format!("MIG index {i} of {}", target())
                })(e));
            }
        };
        let at = || format!("MIG index {i} of {}", target());
        let uuid = mig.uuid().map_err(query("nvmlDeviceGetUUID", at))?;
        let at = || format!("MIG device {uuid} of {}", target());
        let gi_id = raw_u32(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref(), &mig)
            .map_err(query("nvmlDeviceGetGpuInstanceId", at))?;
        let ci_id = raw_u32(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref(), &mig)
            .map_err(query("nvmlDeviceGetComputeInstanceId", at))?;
        let attrs = mig
            .attributes()
            .map_err(query("nvmlDeviceGetAttributes_v2", at))?;
        let gi = gpu_instance_info(nvml, parent, gi_id).map_err(|(call, e)| query(call, at)(e))?;
        let Some(&profile_index) = index_by_profile_id.get(&gi.profileId) else {
            return Err(DeviceError::Query {
                call: "nvmlDeviceGetGpuInstanceProfileInfo",
                target: at(),
                reason: format!(
                    "GPU instance profile ID {} matches none of the profiles the GPU reports",
                    gi.profileId
                ),
            });
        };
        out.push(MigDevice {
            profile: names::profile_name(
                attrs.gpu_instance_slice_count,
                attrs.compute_instance_slice_count,
                attrs.memory_size_mb,
                gpu.memory_bytes,
                profile_index,
            ),
            uuid,
            gi_id,
            ci_id,
            gi_profile_id: gi.profileId,
            placement: Placement {
                start: gi.placement.start,
                size: gi.placement.size,
            },
            memory_bytes: attrs.memory_size_mb.saturating_mul(1 << 20),
            multiprocessors: attrs.multiprocessor_count,
            copy_engines: attrs.shared_copy_engine_count,
            decoders: attrs.shared_decoder_count,
            encoders: attrs.shared_encoder_count,
            jpeg_engines: attrs.shared_jpeg_count,
            ofa_engines: attrs.shared_ofa_count,
        });
    }
    Ok(out)
}

/// Highest GPU-instance profile index probed (`NVML_GPU_INSTANCE_PROFILE_COUNT` of the current
/// header; older drivers answer `INVALID_ARGUMENT` past their own count, which is skipped).
const GI_PROFILE_INDEX_END: u32 = 0x12;

/// Map from GPU-instance profile ID (19, 20, ...) to the NVML profile index constant (0x0,
/// 0x7, ...), probing every index as go-nvlib does. Unsupported indices are skipped.
#[allow(unsafe_code)]
fn gi_profile_indices(nvml: &Nvml, parent: &Device<'_>) -> HashMap<u32, u32> {
    let mut map = HashMap::new();
    let Ok(sym) = nvml.lib().nvmlDeviceGetGpuInstanceProfileInfo.as_ref() else {
        return map;
    };
    for index in 0..GI_PROFILE_INDEX_END {
        // SAFETY: `parent` is a live handle of the initialised `nvml`; `info` is a properly sized
        // and aligned out-parameter of the type the C signature names.
        let (ret, info) = unsafe {
            let mut info: nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
            let ret = sym(parent.handle(), index as c_uint, &mut info);
            (ret, info)
        };
        if ret == nvmlReturn_enum_NVML_SUCCESS {
            // The first index wins: a later alias of the same ID must not re-label it.
            map.entry(info.id).or_insert(index);
        }
    }
    map
}

/// Looks up a GPU instance by ID on `parent` and returns its info (profile ID, placement).
#[allow(unsafe_code)]
fn gpu_instance_info(
    nvml: &Nvml,
    parent: &Device<'_>,
    gi_id: u32,
) -> Result<nvmlGpuInstanceInfo_t, (&'static str, NvmlError)> {
    let lib = nvml.lib();
    let by_id = lib
        .nvmlDeviceGetGpuInstanceById
        .as_ref()
        .map_err(|e| ("nvmlDeviceGetGpuInstanceById", missing(e)))?;
    let get_info = lib
        .nvmlGpuInstanceGetInfo
        .as_ref()
        .map_err(|e| ("nvmlGpuInstanceGetInfo", missing(e)))?;
    // SAFETY: `parent` is a live handle of the initialised `nvml`; the GPU-instance handle is
    // only used within this block while NVML stays initialised; both out-parameters are
    // zero-initialised values of the exact C types.
    unsafe {
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        check(by_id(parent.handle(), gi_id as c_uint, &mut gi))
            .map_err(|e| ("nvmlDeviceGetGpuInstanceById", e))?;
        let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
        check(get_info(gi, &mut info)).map_err(|e| ("nvmlGpuInstanceGetInfo", e))?;
        Ok(info)
    }
}

/// The device's memory addressing mode as NVIDIA's driver publishes it (`addressingMode`):
/// NVML's mode name, or `None` when NVML reports no active mode, does not support the call
/// (older drivers, most GPUs: a real x86 H100 with driver 580 reports none) or fails.
/// Best effort, like NVIDIA's: the attribute is optional.
#[allow(unsafe_code)]
fn addressing_mode(nvml: &Nvml, device: &Device<'_>) -> Option<String> {
    let get = nvml.lib().nvmlDeviceGetAddressingMode.as_ref().ok()?;
    let mut mode = nvmlDeviceAddressingMode_t {
        version: ADDRESSING_MODE_V1,
        value: 0,
    };
    // SAFETY: `device` is a live handle of an initialised NVML session and `mode` is a valid,
    // versioned `nvmlDeviceAddressingMode_v1_t` out-parameter, which is all the call writes.
    check(unsafe { get(device.handle(), &mut mode) }).ok()?;
    addressing_mode_name(mode.value).map(str::to_owned)
}

/// `nvmlDeviceAddressingMode_v1`: `NVML_STRUCT_VERSION(DeviceAddressingMode, 1)`, the struct's
/// size with the version in the top byte (two `unsigned int`s: 8 bytes).
const ADDRESSING_MODE_V1: c_uint = 8 | (1 << 24);

/// NVML's addressing mode values (`nvmlDeviceAddressingModeType_t`) as published; `NONE` and
/// values newer than this code are left out rather than guessed.
fn addressing_mode_name(value: c_uint) -> Option<&'static str> {
    match value {
        1 => Some("HMM"),
        2 => Some("ATS"),
        _ => None,
    }
}

type U32Getter = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;

/// Calls an NVML getter of the shape `nvmlReturn_t f(nvmlDevice_t, unsigned int *)`.
#[allow(unsafe_code)]
fn raw_u32<E: std::fmt::Display>(
    sym: Result<&U32Getter, &E>,
    device: &Device<'_>,
) -> Result<u32, NvmlError> {
    let sym = sym.map_err(missing)?;
    let mut value: c_uint = 0;
    // SAFETY: `device` is a live handle of an initialised NVML session and `value` is a valid
    // `unsigned int` out-parameter, which is all these getters write.
    check(unsafe { sym(device.handle(), &mut value) })?;
    Ok(value)
}

fn missing<E: std::fmt::Display>(e: E) -> NvmlError {
    NvmlError::FailedToLoadSymbol(e.to_string())
}

fn check(ret: nvmlReturn_t) -> Result<(), NvmlError> {
    if ret == nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::from(ret))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addressing_modes_are_named_as_nvidia_publishes_them() {
        assert_eq!(addressing_mode_name(0), None, "no active mode: left out");
        assert_eq!(addressing_mode_name(1), Some("HMM"));
        assert_eq!(addressing_mode_name(2), Some("ATS"));
        assert_eq!(addressing_mode_name(3), None, "unknown: left out");
        assert_eq!(
            ADDRESSING_MODE_V1,
            u32::try_from(std::mem::size_of::<nvmlDeviceAddressingMode_t>()).unwrap() | (1 << 24)
        );
    }

    #[test]
    fn library_is_found_in_the_first_dir_that_has_it_and_links_stay_in_the_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        assert_eq!(find_library(r), None);
        std::fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::fs::create_dir_all(r.join("lib64")).unwrap();
        std::fs::write(r.join("lib64/libnvidia-ml.so.1"), b"x").unwrap();
        assert_eq!(find_library(r), Some(r.join("lib64/libnvidia-ml.so.1")));
        // An absolute link target is read inside the driver root.
        std::fs::write(r.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580"), b"x").unwrap();
        std::os::unix::fs::symlink(
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580",
            r.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        )
        .unwrap();
        assert_eq!(
            find_library(r),
            Some(r.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580"))
        );
    }

    #[test]
    fn dangling_or_looping_links_are_not_libraries() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("usr/lib64")).unwrap();
        std::os::unix::fs::symlink("nowhere", r.join("usr/lib64/libnvidia-ml.so.1")).unwrap();
        std::fs::create_dir_all(r.join("lib")).unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.1", r.join("lib/libnvidia-ml.so.1")).unwrap();
        assert_eq!(find_library(r), None);
    }

    #[test]
    fn a_missing_library_is_an_init_error_naming_the_path() {
        let inv = NvmlInventory::new(NvmlOptions {
            library: NvmlLibrary::Path(PathBuf::from("/nonexistent/libnvidia-ml.so.1")),
            sysfs_root: PathBuf::from("/sys"),
        });
        let err = inv.discover().unwrap_err();
        assert!(matches!(err, DeviceError::Init { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/libnvidia-ml.so.1"));
        let root = tempfile::tempdir().unwrap();
        let err = NvmlLibrary::Under(root.path().to_path_buf())
            .locate()
            .unwrap_err();
        assert!(err.to_string().contains("libnvidia-ml.so.1 under"), "{err}");
        assert_eq!(
            NvmlLibrary::Under(root.path().to_path_buf()).identity(),
            None
        );
    }
}
