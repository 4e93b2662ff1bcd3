//! The NVML C API subset, exported from the `cdylib` with the exact ABI of `nvml.h`.
//!
//! Invariants:
//! - No panic crosses the FFI boundary: every export runs inside [`guard`], which turns a
//!   panic into `NVML_ERROR_UNKNOWN`.
//! - Every pointer from the caller is null-checked (`NVML_ERROR_INVALID_ARGUMENT`); string
//!   buffers that are too small give `NVML_ERROR_INSUFFICIENT_SIZE`; calls before `nvmlInit`
//!   (or after the matching `nvmlShutdown`) give `NVML_ERROR_UNINITIALIZED`. Init is
//!   reference counted like real NVML.
//! - Handles are opaque pointers to leaked, never-freed allocations registered in a table,
//!   so they stay valid for the process lifetime and a foreign pointer is recognised (by
//!   address) without ever being dereferenced.
//! - Answers come from the state file (see [`crate::state`]); it is re-read only when its
//!   inode, size or mtime changed, so other processes' changes are seen on the next call.
//! - A GPU marked lost ([`crate::health`]) answers `NVML_ERROR_GPU_IS_LOST` to every call
//!   that resolves it, through a handle or a lookup; `nvmlDeviceGetCount` still counts it.
//!
//! Health events and field values are in [`events`].

// This module is the C ABI surface: reading and writing caller-owned memory through raw
// pointers and asking the dynamic loader where this library lives cannot be done without
// `unsafe`. The rest of the crate stays safe.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use crate::mig;
use crate::state::{self, ComputeMode, MigDeviceRef, State, StateFile};

pub mod events;

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

// ---------------------------------------------------------------------------------------
// Handles.

/// What a handle points at. GPU indices are NVML indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Gpu(u32),
    Mig(u32, u32, u32),
    Gi(u32, u32),
    Ci(u32, u32, u32),
}

#[derive(Default)]
struct Registry {
    by_key: HashMap<Key, usize>,
    by_addr: HashMap<usize, Key>,
}

static HANDLES: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a guarded call cannot leave these maps half-updated in a way that
    // matters (inserts are paired), so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn handle(key: Key) -> Handle {
    let mut reg = lock(&HANDLES);
    if let Some(addr) = reg.by_key.get(&key) {
        return *addr as Handle;
    }
    // Leaked on purpose: handles must stay valid for the life of the process.
    let addr = Box::into_raw(Box::new(key)) as usize;
    reg.by_key.insert(key, addr);
    reg.by_addr.insert(addr, key);
    addr as Handle
}

fn key_of(h: Handle) -> Result<Key, NvmlReturn> {
    lock(&HANDLES)
        .by_addr
        .get(&(h as usize))
        .copied()
        .ok_or(ret::INVALID_ARGUMENT)
}

// ---------------------------------------------------------------------------------------
// Library state.

#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_ns: i64,
    dev_dirs: [(i64, i64); 2],
}

struct Lib {
    refcount: u32,
    file: Option<StateFile>,
    cache: Option<(Stamp, Arc<State>)>,
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    refcount: 0,
    file: None,
    cache: None,
});

/// The path of the object this code lives in (the `.so` when loaded as a library).
fn own_path() -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let addr = own_path as *const c_void;
    // SAFETY: `dladdr` only reads the loader's tables for an address inside this object and
    // fills `info`, which is a valid, writable `Dl_info`.
    let rc = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    if rc == 0 {
        return None;
    }
    // SAFETY: `dladdr` returned non-zero, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is a NUL-terminated string owned by the loader that lives as
    // long as the object is loaded, which outlives this call.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

fn stamp(file: &StateFile) -> Option<Stamp> {
    let m = std::fs::metadata(file.path()).ok()?;
    // Which devices this process sees changes with the device nodes (a new MIG device's
    // capability nodes appear after the state): the folders' change times are part of it.
    let mut dirs = [(0, 0); 2];
    if let Some(dev) = file.dev_dir() {
        for (slot, dir) in dirs.iter_mut().zip([dev.clone(), dev.join("nvidia-caps")]) {
            if let Ok(d) = std::fs::metadata(dir) {
                *slot = (d.mtime(), d.mtime_nsec());
            }
        }
    }
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: m.mtime(),
        mtime_ns: m.mtime_nsec(),
        dev_dirs: dirs,
    })
}

fn init() -> NvmlReturn {
    let mut lib = lock(&LIB);
    if lib.file.is_none() {
        match state::locate(own_path().as_deref()) {
            Ok(f) => lib.file = Some(f),
            Err(_) => return ret::DRIVER_NOT_LOADED,
        }
    }
    lib.refcount += 1;
    ret::SUCCESS
}

/// The current state (re-read when the file changed).
fn state() -> Result<Arc<State>, NvmlReturn> {
    let mut lib = lock(&LIB);
    if lib.refcount == 0 {
        return Err(ret::UNINITIALIZED);
    }
    let file = lib.file.clone().ok_or(ret::UNINITIALIZED)?;
    let now = stamp(&file);
    if let (Some(now), Some((old, st))) = (now, &lib.cache)
        && now == *old
    {
        return Ok(st.clone());
    }
    let st = Arc::new(file.load_visible().map_err(|_| ret::UNKNOWN)?);
    if let Some(now) = now {
        lib.cache = Some((now, st.clone()));
    }
    Ok(st)
}

/// Applies `f` to the state file under its exclusive lock.
fn update(f: impl FnOnce(&mut State) -> Result<(), NvmlReturn>) -> Result<(), NvmlReturn> {
    let file = {
        let lib = lock(&LIB);
        if lib.refcount == 0 {
            return Err(ret::UNINITIALIZED);
        }
        lib.file.clone().ok_or(ret::UNINITIALIZED)?
    };
    file.update(f).map_err(|e| match e {
        crate::SimError::NotPermitted { .. } => ret::NO_PERMISSION,
        _ => ret::UNKNOWN,
    })?
}

/// Runs an export body, mapping `Err(code)` to the code and a panic to `UNKNOWN`.
fn guard(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => ret::SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => ret::UNKNOWN,
    }
}

// ---------------------------------------------------------------------------------------
// Pointer helpers. Callers must pass pointers that are null or valid for the access, which
// is the NVML contract for every out-parameter.

/// Writes `v` through `p`.
///
/// # Safety
/// `p` must be null or valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid for writes per this function's contract.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Copies `s` NUL-terminated into the caller's `len`-byte buffer.
///
/// # Safety
/// `buf` must be null or valid for writes of `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if (len as usize) < bytes.len() + 1 {
        return Err(ret::INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` has room for `len >= bytes.len() + 1` bytes per the contract, and the
    // source is a distinct Rust allocation.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a NUL-terminated string.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string.
unsafe fn get_str(p: *const c_char) -> Result<String, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let s = unsafe { CStr::from_ptr(p) };
    Ok(s.to_string_lossy().into_owned())
}

/// Reads the `version` field (first `unsigned int`) of a versioned struct.
///
/// # Safety
/// `p` must be null or valid for a read of a `c_uint`.
unsafe fn get_version(p: *const c_uint) -> Result<c_uint, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and readable per this function's contract.
    Ok(unsafe { p.read_unaligned() })
}

fn fixed<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

// ---------------------------------------------------------------------------------------
// Resolution of handles against the current state.

enum Dev<'a> {
    Gpu(usize),
    Mig(usize, MigDeviceRef<'a>),
}

fn find_mig(st: &State, gpu: usize, gi: u32, ci: u32) -> Option<MigDeviceRef<'_>> {
    st.mig_devices(gpu)
        .into_iter()
        .find(|m| m.gi.id == gi && m.ci.id == ci)
}

/// `GPU_IS_LOST` when GPU `i` has fallen off the bus.
fn alive(st: &State, i: usize) -> Result<(), NvmlReturn> {
    if st.gpus.get(i).is_some_and(|g| g.health.lost) {
        return Err(ret::GPU_IS_LOST);
    }
    Ok(())
}

fn dev(st: &State, h: Handle) -> Result<Dev<'_>, NvmlReturn> {
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

fn gpu_of(d: &Dev<'_>) -> usize {
    match d {
        Dev::Gpu(i) | Dev::Mig(i, _) => *i,
    }
}

/// A full-GPU handle (not a MIG device).
fn full_gpu(st: &State, h: Handle) -> Result<usize, NvmlReturn> {
    match dev(st, h)? {
        Dev::Gpu(i) => Ok(i),
        Dev::Mig(..) => Err(ret::NOT_SUPPORTED),
    }
}

fn gi_handle(st: &State, h: Handle) -> Result<(usize, u32), NvmlReturn> {
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

fn mig_table(st: &State, i: usize) -> Result<&'static [mig::GiProfile], NvmlReturn> {
    st.profile.gpus[i].mig_profiles().ok_or(ret::NOT_SUPPORTED)
}

fn pci_info(st: &State, i: usize) -> PciInfo {
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

fn memory_bytes(st: &State, d: &Dev<'_>) -> u64 {
    match d {
        Dev::Gpu(i) => st.profile.gpus[*i].memory_mib * MIB,
        Dev::Mig(_, m) => m.profile.memory_mib * MIB,
    }
}

// ---------------------------------------------------------------------------------------
// Exports: initialisation and system queries.

/// `nvmlInit_v2`: initialise (reference counted).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    guard(|| match init() {
        ret::SUCCESS => Ok(()),
        e => Err(e),
    })
}

/// `nvmlInit` (legacy name of `nvmlInit_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    nvmlInit_v2()
}

/// `nvmlInitWithFlags`: flags are accepted and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    nvmlInit_v2()
}

/// `nvmlShutdown`: drops one reference.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(|| {
        let mut lib = lock(&LIB);
        if lib.refcount == 0 {
            return Err(ret::UNINITIALIZED);
        }
        lib.refcount -= 1;
        if lib.refcount == 0 {
            lib.cache = None;
        }
        Ok(())
    })
}

/// `nvmlErrorString`: static description of a return code (works without init).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, because ECC is enabled",
        23 => c"Insufficient Resources",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Deprecated",
        27 => c"Not Ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
///
/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(version, length, &st.profile.driver_version) }
    })
}

/// `nvmlSystemGetNVMLVersion`: `13.<driver version>`.
///
/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let v = format!(
            "{}.{}",
            st.profile.cuda_driver_version / 1000,
            st.profile.driver_version
        );
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(version, length, &v) }
    })
}

/// `nvmlSystemGetCudaDriverVersion`.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(version, st.profile.cuda_driver_version as c_int) }
    })
}

/// `nvmlSystemGetCudaDriverVersion_v2`.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion(version) }
}

// ---------------------------------------------------------------------------------------
// Exports: device enumeration and identity.

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
        let total = memory_bytes(&st, &dev(&st, device)?);
        let m = Memory {
            total,
            free: total,
            used: 0,
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
        let total = memory_bytes(&st, &dev(&st, device)?);
        // SAFETY: caller contract (struct starts with its version field).
        let version = unsafe { get_version(memory.cast::<c_uint>()) }?;
        if version != MEMORY_V2 {
            return Err(ret::INVALID_ARGUMENT);
        }
        let m = MemoryV2 {
            version,
            total,
            reserved: 0,
            free: total,
            used: 0,
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

// ---------------------------------------------------------------------------------------
// Exports: compute mode and MIG.

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
        let Dev::Mig(_, m) = dev(&st, device)? else {
            return Err(ret::NOT_SUPPORTED);
        };
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
        let Dev::Mig(_, m) = dev(&st, device)? else {
            return Err(ret::NOT_SUPPORTED);
        };
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
        let Dev::Mig(_, m) = dev(&st, device)? else {
            return Err(ret::NOT_SUPPORTED);
        };
        let p = m.profile;
        // A compute instance smaller than its GPU instance gets its share of the SMs.
        let sms = if m.ci.slice_count == p.slice_count {
            p.multiprocessors
        } else {
            p.multiprocessors / p.slice_count * m.ci.slice_count
        };
        let a = DeviceAttributes {
            multiprocessor_count: sms,
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
/// The CI profile `index` inside GPU instance `gpu_instance`: a GI of `s` compute slices
/// offers every profile of `c <= s` slices, `s / c` times (NVIDIA_FACTS A.0), with the GI's
/// SMs split evenly and its engines shared.
fn ci_profile(
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

// ---------------------------------------------------------------------------------------
// Exports: creating and destroying GPU and compute instances.
//
// Every change goes through `State::create_gpu_instance` and friends, the rules the
// `nvidia-smi mig` stand-in uses, under the state lock with the capability files brought in
// line (`setup::change_mig_layout`), so a created instance is at once a MIG device that
// `nvmlDeviceGetMigDeviceHandleByIndex`, `nvmlDeviceGetHandleByUUID` and CDI see.
//
// Handles of GPU and compute instances name (GPU, GI ID[, CI ID]): after a destroy and a
// recreate with the same IDs an old handle names the new instance, where a real driver would
// hand out a new pointer. Callers that look instances up by ID, as the DRA driver does, do not
// see the difference.

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
    let file = {
        let lib = lock(&LIB);
        if lib.refcount == 0 {
            return Err(ret::UNINITIALIZED);
        }
        lib.file.clone().ok_or(ret::UNINITIALIZED)?
    };
    match crate::setup::change_mig_layout(&file, f) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(mig_code(&e)),
        Err(crate::SimError::NotPermitted { .. }) => Err(ret::NO_PERMISSION),
        Err(_) => Err(ret::UNKNOWN),
    }
}

/// Reads a caller's placement struct.
///
/// # Safety
/// `p` must be null or valid for a read of `Placement`.
unsafe fn get_placement(p: *const Placement) -> Result<Placement, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and readable per this function's contract.
    Ok(unsafe { p.read_unaligned() })
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
/// `placement` (memory slices). Refusals: see [`mig_code`].
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
    guard(|| {
        // SAFETY: caller contract (input struct).
        let p = unsafe { get_placement(placement) }?;
        if gpu_instance.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let h = create_gpu_instance(device, profile_id, Some(p))?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(gpu_instance, h) }
    })
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
    guard(|| {
        if gpu_instance.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let h = create_gpu_instance(device, profile_id, None)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(gpu_instance, h) }
    })
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
/// placement. Refusals: see [`mig_code`].
///
/// # Safety
/// `compute_instance` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: Handle,
    profile_id: c_uint,
    compute_instance: *mut Handle,
) -> NvmlReturn {
    guard(|| {
        if compute_instance.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let h = create_compute_instance(gpu_instance, profile_id, None)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(compute_instance, h) }
    })
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
    guard(|| {
        // SAFETY: caller contract (input struct).
        let p = unsafe { get_placement(placement) }?;
        if compute_instance.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let h = create_compute_instance(gpu_instance, profile_id, Some(p))?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(compute_instance, h) }
    })
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
    fn layouts_match_the_facts() {
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

    #[test]
    fn calls_before_init_are_uninitialized() {
        let mut n: c_uint = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { nvmlDeviceGetCount_v2(&mut n) };
        // The unit-test process never calls nvmlInit.
        assert_eq!(r, ret::UNINITIALIZED);
        assert_eq!(nvmlShutdown(), ret::UNINITIALIZED);
    }

    #[test]
    fn foreign_pointers_are_not_handles() {
        let x = 5u64;
        assert_eq!(
            key_of(&x as *const u64 as Handle),
            Err(ret::INVALID_ARGUMENT)
        );
        let h = handle(Key::Gpu(3));
        assert_eq!(key_of(h), Ok(Key::Gpu(3)));
        assert_eq!(handle(Key::Gpu(3)), h, "handles are stable");
    }

    #[test]
    fn error_strings_are_static_c_strings() {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string.
        let s = unsafe { CStr::from_ptr(nvmlErrorString(ret::INSUFFICIENT_SIZE)) };
        assert_eq!(s.to_str(), Ok("Insufficient Size"));
    }
}
