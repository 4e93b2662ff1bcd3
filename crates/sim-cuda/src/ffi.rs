//! The CUDA driver API subset, exported from the `cdylib` with the exact ABI of `cuda.h`:
//! `CUresult` and `CUdevice` are `int`, `CUdeviceptr` is `unsigned long long`, sizes are
//! `size_t`, `CUcontext`, `CUmodule`, `CUfunction` and `CUstream` are opaque pointers, and
//! `CUuuid` is 16 bytes. Entry points carry the names the real library exports for the
//! current ABI (`cuCtxCreate_v2`, `cuMemAlloc_v2`, ...), which is what `cuda.h` maps the
//! plain names to.
//!
//! Invariants: no panic crosses the boundary (every export runs in [`guard`], a panic
//! answers `CUDA_ERROR_UNKNOWN`); every caller pointer is null-checked
//! (`CUDA_ERROR_INVALID_VALUE`); calls before a successful `cuInit` answer
//! `CUDA_ERROR_NOT_INITIALIZED`. Handles are the driver's numbers as pointers, never
//! dereferenced. The current context is per thread, as in CUDA; `cuCtxCreate` makes the
//! new context current. The driver lives until the process exits, when an `atexit` hook
//! withdraws its record of use.

// The C ABI: raw pointers from the caller, `no_mangle` exports, `dladdr` and `atexit`.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::driver::{self, Driver, handle_ptr, ptr_handle};
use crate::ptx::Geometry;
use crate::result::{self, CuResult};

/// `CUdevice`.
type CuDevice = c_int;
/// `CUdeviceptr`.
type CuDevicePtr = c_ulonglong;
/// `CUcontext`, `CUmodule`, `CUfunction`, `CUstream`.
type Handle = *mut c_void;

/// `CU_DEVICE_ATTRIBUTE_*` values of `cuda.h` answered by `cuDeviceGetAttribute`.
mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const MAX_BLOCK_DIM_X: i32 = 2;
    pub const MAX_BLOCK_DIM_Y: i32 = 3;
    pub const MAX_BLOCK_DIM_Z: i32 = 4;
    pub const MAX_GRID_DIM_X: i32 = 5;
    pub const MAX_GRID_DIM_Y: i32 = 6;
    pub const MAX_GRID_DIM_Z: i32 = 7;
    pub const WARP_SIZE: i32 = 10;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const COMPUTE_MODE: i32 = 20;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

fn lock() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs an export's body: `Err` codes and panics become the returned `CUresult`.
fn guard(f: impl FnOnce() -> Result<(), CuResult>) -> CuResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => result::SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => result::UNKNOWN,
    }
}

/// Runs `f` on the initialised driver.
fn with_driver<T>(f: impl FnOnce(&mut Driver) -> Result<T, CuResult>) -> Result<T, CuResult> {
    let mut d = lock();
    let d = d.as_mut().ok_or(result::NOT_INITIALIZED)?;
    f(d)
}

/// The calling thread's current context.
fn current() -> Result<u64, CuResult> {
    match CURRENT.with(Cell::get) {
        0 => Err(result::INVALID_CONTEXT),
        c => Ok(c),
    }
}

/// Writes `value` through the caller's out-pointer.
///
/// # Safety
/// `ptr` must be null or valid for a write of `T`.
unsafe fn put<T>(ptr: *mut T, value: T) -> Result<(), CuResult> {
    if ptr.is_null() {
        return Err(result::INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write of `T` by the caller's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

extern "C" fn release_at_exit() {
    if let Ok(mut d) = DRIVER.lock()
        && let Some(d) = d.as_mut()
    {
        d.release();
    }
}

/// `cuInit(unsigned int Flags)`: flags must be 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    guard(|| {
        if flags != 0 {
            return Err(result::INVALID_VALUE);
        }
        let mut d = lock();
        if d.is_none() {
            let env = driver::process_environment(gpu_dra_sim::ffi::own_path());
            *d = Some(Driver::init(&env)?);
            static HOOKED: OnceLock<()> = OnceLock::new();
            HOOKED.get_or_init(|| {
                // SAFETY: `release_at_exit` is a plain `extern "C" fn()` that lives as long
                // as the process (this library is never unloaded while a driver exists).
                unsafe { libc::atexit(release_at_exit) };
            });
        }
        Ok(())
    })
}

/// `cuDriverGetVersion(int *driverVersion)`: works before `cuInit`, as CUDA's does.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    guard(|| {
        let v = match lock().as_ref() {
            Some(d) => d.version(),
            None => {
                let env = driver::process_environment(gpu_dra_sim::ffi::own_path());
                gpu_dra_sim::state::locate(env.library.as_deref())
                    .and_then(|f| f.load())
                    .map(|s| i32::try_from(s.profile.cuda_driver_version).unwrap_or(0))
                    .map_err(|_| result::NO_DEVICE)?
            }
        };
        // SAFETY: caller contract.
        unsafe { put(version, v) }
    })
}

/// `cuDeviceGetCount(int *count)`.
///
/// # Safety
/// `count` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    guard(|| {
        let n = with_driver(|d| Ok(d.devices().len()))?;
        // SAFETY: caller contract.
        unsafe { put(count, c_int::try_from(n).unwrap_or(c_int::MAX)) }
    })
}

/// `cuDeviceGet(CUdevice *device, int ordinal)`.
///
/// # Safety
/// `device` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CuDevice, ordinal: c_int) -> CuResult {
    guard(|| {
        with_driver(|d| d.device(ordinal).map(|_| ()))?;
        // SAFETY: caller contract.
        unsafe { put(device, ordinal) }
    })
}

/// `cuDeviceGetName(char *name, int len, CUdevice dev)`: truncated to `len - 1` bytes and
/// NUL-terminated.
///
/// # Safety
/// `name` must be null or writable for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CuDevice) -> CuResult {
    guard(|| {
        let text = with_driver(|d| Ok(d.device(dev)?.device.name.clone()))?;
        let len = usize::try_from(len).map_err(|_| result::INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(result::INVALID_VALUE);
        }
        let n = text.len().min(len - 1);
        // SAFETY: `name` is writable for `len` bytes (caller contract) and `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

fn get_uuid(uuid: *mut [u8; 16], dev: CuDevice) -> CuResult {
    guard(|| {
        let bytes = with_driver(|d| Ok(d.device(dev)?.uuid_bytes()))?;
        // SAFETY: the exports' callers guarantee `uuid` is null or a writable `CUuuid`.
        unsafe { put(uuid, bytes) }
    })
}

/// `cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)`: the GPU's UUID, or a MIG device's.
///
/// # Safety
/// `uuid` must be null or a writable `CUuuid` (16 bytes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CuDevice) -> CuResult {
    get_uuid(uuid, dev)
}

/// `cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)`: as `cuDeviceGetUuid` (a MIG device
/// answers its MIG UUID).
///
/// # Safety
/// `uuid` must be null or a writable `CUuuid` (16 bytes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CuDevice) -> CuResult {
    get_uuid(uuid, dev)
}

/// `cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)`: the device's memory.
///
/// # Safety
/// `bytes` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CuDevice) -> CuResult {
    guard(|| {
        let total = with_driver(|d| Ok(d.device(dev)?.device.memory_bytes))?;
        // SAFETY: caller contract.
        unsafe { put(bytes, usize::try_from(total).unwrap_or(usize::MAX)) }
    })
}

/// `cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`: the attributes
/// in [`attr`]; others answer `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `pi` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_int,
    dev: CuDevice,
) -> CuResult {
    guard(|| {
        let v = with_driver(|d| {
            let dev = d.device(dev)?;
            let clamp = |v: u32| c_int::try_from(v).unwrap_or(c_int::MAX);
            Ok(match attrib {
                attr::MAX_THREADS_PER_BLOCK | attr::MAX_BLOCK_DIM_X | attr::MAX_BLOCK_DIM_Y => {
                    clamp(driver::MAX_THREADS_PER_BLOCK)
                }
                attr::MAX_BLOCK_DIM_Z => 64,
                attr::MAX_GRID_DIM_X => c_int::MAX,
                attr::MAX_GRID_DIM_Y | attr::MAX_GRID_DIM_Z => 65535,
                attr::WARP_SIZE => 32,
                attr::MULTIPROCESSOR_COUNT => clamp(dev.multiprocessors),
                attr::COMPUTE_MODE => clamp(dev.compute_mode.value()),
                attr::PCI_BUS_ID => clamp(dev.pci.1),
                attr::PCI_DEVICE_ID => clamp(dev.pci.2),
                attr::PCI_DOMAIN_ID => clamp(dev.pci.0),
                attr::UNIFIED_ADDRESSING => 1,
                attr::COMPUTE_CAPABILITY_MAJOR => dev.cc.0,
                attr::COMPUTE_CAPABILITY_MINOR => dev.cc.1,
                _ => return Err(result::INVALID_VALUE),
            })
        })?;
        // SAFETY: caller contract.
        unsafe { put(pi, v) }
    })
}

/// `cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)`: the new context
/// becomes the calling thread's current one.
///
/// # Safety
/// `pctx` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut Handle,
    _flags: c_uint,
    dev: CuDevice,
) -> CuResult {
    guard(|| {
        if pctx.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let h = with_driver(|d| d.create_context(dev))?;
        CURRENT.with(|c| c.set(h));
        // SAFETY: caller contract.
        unsafe { put(pctx, handle_ptr(h)) }
    })
}

/// `cuCtxDestroy_v2(CUcontext ctx)`: its memory and modules go; it stops being current.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CuResult {
    guard(|| {
        let h = ptr_handle(ctx);
        with_driver(|d| d.destroy_context(h))?;
        CURRENT.with(|c| {
            if c.get() == h {
                c.set(0);
            }
        });
        Ok(())
    })
}

/// `cuCtxSynchronize(void)`: a failure a kernel left in the current context.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    guard(|| {
        let ctx = current()?;
        with_driver(|d| d.synchronize(ctx))
    })
}

/// `cuMemGetInfo_v2(size_t *free, size_t *total)` of the current context's device.
///
/// # Safety
/// `free` and `total` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    guard(|| {
        if free.is_null() || total.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let ctx = current()?;
        let (f, t) = with_driver(|d| d.mem_info(ctx))?;
        let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        // SAFETY: caller contract.
        unsafe {
            put(free, size(f))?;
            put(total, size(t))
        }
    })
}

/// `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)` in the current context.
///
/// # Safety
/// `dptr` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    guard(|| {
        if dptr.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let ctx = current()?;
        let ptr = with_driver(|d| d.alloc(ctx, bytesize as u64))?;
        // SAFETY: caller contract.
        unsafe { put(dptr, ptr) }
    })
}

/// `cuMemFree_v2(CUdeviceptr dptr)` in the current context.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    guard(|| {
        let ctx = current()?;
        with_driver(|d| d.free(ctx, dptr))
    })
}

/// `cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes)`.
///
/// # Safety
/// `src` must be null or readable for `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CuDevicePtr,
    src: *const c_void,
    bytes: usize,
) -> CuResult {
    guard(|| {
        if src.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let ctx = current()?;
        // SAFETY: `src` is readable for `bytes` bytes (caller contract).
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) };
        with_driver(|d| d.copy_to_device(ctx, dst, data))
    })
}

/// `cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes)`.
///
/// # Safety
/// `dst` must be null or writable for `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CuDevicePtr,
    bytes: usize,
) -> CuResult {
    guard(|| {
        if dst.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let ctx = current()?;
        // SAFETY: `dst` is writable for `bytes` bytes (caller contract).
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), bytes) };
        with_driver(|d| d.copy_from_device(ctx, src, out))
    })
}

/// `cuModuleLoadData(CUmodule *module, const void *image)`: `image` is NUL-terminated PTX
/// text; a cubin or fatbinary (not text) answers `CUDA_ERROR_INVALID_IMAGE`.
///
/// # Safety
/// `module` must be null or writable; `image` null or a NUL-terminated buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CuResult {
    guard(|| {
        if module.is_null() || image.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let ctx = current()?;
        // SAFETY: `image` is NUL-terminated (caller contract for PTX images).
        let bytes = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_bytes();
        let text = std::str::from_utf8(bytes).map_err(|_| result::INVALID_IMAGE)?;
        if bytes.starts_with(b"\x7fELF") {
            return Err(result::INVALID_IMAGE);
        }
        let h = with_driver(|d| d.load_module(ctx, text))?;
        // SAFETY: caller contract.
        unsafe { put(module, handle_ptr(h)) }
    })
}

/// `cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)`.
///
/// # Safety
/// `hfunc` must be null or writable; `name` null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    hfunc: *mut Handle,
    hmod: Handle,
    name: *const c_char,
) -> CuResult {
    guard(|| {
        if hfunc.is_null() || name.is_null() {
            return Err(result::INVALID_VALUE);
        }
        // SAFETY: `name` is NUL-terminated (caller contract).
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| result::NOT_FOUND)?;
        let h = with_driver(|d| d.function(ptr_handle(hmod), name))?;
        // SAFETY: caller contract.
        unsafe { put(hfunc, handle_ptr(h)) }
    })
}

/// `cuModuleUnload(CUmodule hmod)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(hmod: Handle) -> CuResult {
    guard(|| with_driver(|d| d.unload_module(ptr_handle(hmod))))
}

/// `cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
/// sharedMemBytes, hStream, kernelParams, extra)` in the current context: the parameters
/// are read from `kernelParams` (one pointer per parameter, each to a value of the size the
/// kernel declares); `extra` is not simulated (must be null); the stream is ignored (the
/// kernel runs before the call returns).
///
/// # Safety
/// `kernel_params` must be null or hold one readable pointer per kernel parameter, each to
/// a value of that parameter's size.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem_bytes: c_uint,
    _stream: Handle,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    guard(|| {
        if !extra.is_null() {
            return Err(result::NOT_SUPPORTED);
        }
        let ctx = current()?;
        let function = ptr_handle(f);
        let sizes = with_driver(|d| d.param_sizes(function))?;
        if !sizes.is_empty() && kernel_params.is_null() {
            return Err(result::INVALID_VALUE);
        }
        let mut params = Vec::with_capacity(sizes.len());
        for (i, size) in sizes.iter().enumerate() {
            // SAFETY: `kernel_params` holds one pointer per parameter (caller contract).
            let p = unsafe { *kernel_params.add(i) };
            if p.is_null() {
                return Err(result::INVALID_VALUE);
            }
            // SAFETY: each parameter pointer is readable for its parameter's size.
            let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), *size) };
            params.push(bytes.to_vec());
        }
        let geometry = Geometry {
            grid: [grid_x, grid_y, grid_z],
            block: [block_x, block_y, block_z],
        };
        with_driver(|d| d.launch(ctx, function, geometry, &params))
    })
}

/// Strings handed out by `cuGetErrorString` for detailed messages: kept for the process's
/// life, as CUDA's static strings are.
static DETAILS: Mutex<Option<HashMap<String, &'static CStr>>> = Mutex::new(None);

fn static_cstr(text: &str) -> &'static CStr {
    let mut map = DETAILS.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(s) = map.get(text) {
        return s;
    }
    let owned = CString::new(text.replace('\0', " ")).unwrap_or_default();
    let leaked: &'static CStr = Box::leak(owned.into_boxed_c_str());
    map.insert(text.to_owned(), leaked);
    leaked
}

/// `cuGetErrorName(CUresult error, const char **pStr)`: `CUDA_ERROR_INVALID_VALUE` (and
/// `*pStr = NULL`) for a code it does not know.
///
/// # Safety
/// `pstr` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CuResult, pstr: *mut *const c_char) -> CuResult {
    guard(|| {
        let name = result::name(error).map(static_cstr);
        // SAFETY: caller contract.
        unsafe { put(pstr, name.map_or(std::ptr::null(), CStr::as_ptr)) }?;
        name.map(|_| ()).ok_or(result::INVALID_VALUE)
    })
}

/// `cuGetErrorString(CUresult error, const char **pStr)`: CUDA's description; for
/// `CUDA_ERROR_INVALID_PTX` and `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` followed by why this
/// process's last PTX was refused.
///
/// # Safety
/// `pstr` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CuResult, pstr: *mut *const c_char) -> CuResult {
    guard(|| {
        let detail = if matches!(error, result::INVALID_PTX | result::UNSUPPORTED_PTX_VERSION) {
            lock().as_ref().and_then(|d| d.last_ptx_error.clone())
        } else {
            None
        };
        let text = result::description(error).map(|d| match detail {
            Some(why) => static_cstr(&format!("{d}: {why}")),
            None => static_cstr(d),
        });
        // SAFETY: caller contract.
        unsafe { put(pstr, text.map_or(std::ptr::null(), CStr::as_ptr)) }?;
        text.map(|_| ()).ok_or(result::INVALID_VALUE)
    })
}
