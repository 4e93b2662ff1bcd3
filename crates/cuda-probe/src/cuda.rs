//! The CUDA driver API, loaded at run time from `libcuda.so.1` with `dlopen`: the entry
//! points the probe calls, with the ABI of `cuda.h`, behind safe methods that turn a
//! `CUresult` into [`CudaError`] naming the call and CUDA's name for the code.
//!
//! Entry points are resolved by the names the driver exports for the current ABI
//! (`cuCtxCreate_v2`, `cuMemAlloc_v2`, ... as `cuda.h` maps the plain names), so the probe
//! runs against any driver since CUDA 4 without a toolkit. `cuDeviceGetUuid_v2` (the
//! variant that answers a MIG device's own UUID) is used where the driver has it.
//!
//! Invariant: a [`Driver`] keeps its library loaded while it lives, so the function
//! pointers it holds stay valid; every pointer handed to the driver points to a live
//! buffer of the size the call documents.

// Calling C through function pointers resolved with dlsym.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

/// `CUresult`.
type CuResult = c_int;
/// `CUcontext`, `CUmodule`, `CUfunction`, `CUstream`.
type Handle = *mut c_void;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
pub const ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;

/// A failed driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError {
    /// The entry point (`cuCtxCreate_v2`), or `dlopen`/`dlsym`.
    pub call: String,
    /// CUDA's name of the code (`CUDA_ERROR_OUT_OF_MEMORY`), or the loader's message.
    pub name: String,
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.call, self.name)
    }
}

/// The entry points, resolved.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut [u8; 16], c_int) -> CuResult,
    device_get_uuid_name: &'static str,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> CuResult,
    ctx_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult,
    module_unload: unsafe extern "C" fn(Handle) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Handle,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// A loaded CUDA driver.
pub struct Driver {
    api: Api,
    // Dropped last (fields drop in order): the pointers in `api` point into it.
    _lib: libloading::Library,
}

/// A context, destroyed when dropped.
pub struct Context<'a> {
    driver: &'a Driver,
    handle: Handle,
}

/// A device allocation, freed when dropped.
pub struct DeviceBuffer<'a> {
    driver: &'a Driver,
    /// The device address.
    pub ptr: u64,
}

/// A loaded module, unloaded when dropped.
pub struct LoadedModule<'a> {
    driver: &'a Driver,
    handle: Handle,
}

/// One device as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetUuid(_v2)`.
    pub uuid: [u8; 16],
    /// `cuDeviceTotalMem_v2`.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
    pub sm_count: i32,
}

impl Driver {
    /// Loads the driver library `path` (a file name such as `libcuda.so.1` is looked up by
    /// the loader; a path is used as is) and resolves the entry points.
    pub fn load(path: &str) -> Result<Driver, CudaError> {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no
        // preconditions of ours; it stays loaded while `Driver` lives.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| CudaError {
            call: "dlopen".into(),
            name: e.to_string(),
        })?;
        fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, CudaError> {
            // SAFETY: each `T` below is the C signature `cuda.h` declares for `name`.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| CudaError {
                    call: "dlsym".into(),
                    name: e.to_string(),
                })
        }
        let (device_get_uuid, device_get_uuid_name) = match sym(&lib, "cuDeviceGetUuid_v2") {
            Ok(f) => (f, "cuDeviceGetUuid_v2"),
            Err(_) => (sym(&lib, "cuDeviceGetUuid")?, "cuDeviceGetUuid"),
        };
        let api = Api {
            init: sym(&lib, "cuInit")?,
            driver_get_version: sym(&lib, "cuDriverGetVersion")?,
            device_get_count: sym(&lib, "cuDeviceGetCount")?,
            device_get: sym(&lib, "cuDeviceGet")?,
            device_get_name: sym(&lib, "cuDeviceGetName")?,
            device_get_uuid,
            device_get_uuid_name,
            device_total_mem: sym(&lib, "cuDeviceTotalMem_v2")?,
            device_get_attribute: sym(&lib, "cuDeviceGetAttribute")?,
            ctx_create: sym(&lib, "cuCtxCreate_v2")?,
            ctx_destroy: sym(&lib, "cuCtxDestroy_v2")?,
            ctx_synchronize: sym(&lib, "cuCtxSynchronize")?,
            mem_get_info: sym(&lib, "cuMemGetInfo_v2")?,
            mem_alloc: sym(&lib, "cuMemAlloc_v2")?,
            mem_free: sym(&lib, "cuMemFree_v2")?,
            memcpy_htod: sym(&lib, "cuMemcpyHtoD_v2")?,
            memcpy_dtoh: sym(&lib, "cuMemcpyDtoH_v2")?,
            module_load_data: sym(&lib, "cuModuleLoadData")?,
            module_get_function: sym(&lib, "cuModuleGetFunction")?,
            module_unload: sym(&lib, "cuModuleUnload")?,
            launch_kernel: sym(&lib, "cuLaunchKernel")?,
            get_error_name: sym(&lib, "cuGetErrorName")?,
        };
        Ok(Driver { api, _lib: lib })
    }

    /// `Ok` for `CUDA_SUCCESS`, else the error named by `cuGetErrorName`.
    fn check(&self, call: &str, code: CuResult) -> Result<(), CudaError> {
        if code == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` is a valid out-pointer; the driver stores a static string or null.
        let rc = unsafe { (self.api.get_error_name)(code, &mut name) };
        let name = if rc == 0 && !name.is_null() {
            // SAFETY: the driver returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {code}")
        };
        Err(CudaError {
            call: call.into(),
            name,
        })
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> Result<(), CudaError> {
        // SAFETY: no pointers.
        self.check("cuInit", unsafe { (self.api.init)(0) })
    }

    /// `cuDriverGetVersion`.
    pub fn version(&self) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer.
        self.check("cuDriverGetVersion", unsafe {
            (self.api.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32, CudaError> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.api.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    /// `cuDeviceGet`: the device handle of `ordinal`.
    pub fn device(&self, ordinal: i32) -> Result<c_int, CudaError> {
        let mut d = 0;
        // SAFETY: `d` is a valid out-pointer.
        self.check("cuDeviceGet", unsafe {
            (self.api.device_get)(&mut d, ordinal)
        })?;
        Ok(d)
    }

    /// Name, UUID, memory and SM count of device `dev`.
    pub fn device_info(&self, dev: c_int) -> Result<DeviceInfo, CudaError> {
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` is writable for its length, which is passed.
        self.check("cuDeviceGetName", unsafe {
            (self.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        // SAFETY: the driver NUL-terminates within the length given.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut uuid = [0u8; 16];
        // SAFETY: `uuid` is a writable 16-byte `CUuuid`.
        self.check(self.api.device_get_uuid_name, unsafe {
            (self.api.device_get_uuid)(&mut uuid, dev)
        })?;
        let mut total = 0usize;
        // SAFETY: `total` is a valid out-pointer.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.api.device_total_mem)(&mut total, dev)
        })?;
        let mut sms = 0;
        // SAFETY: `sms` is a valid out-pointer.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.api.device_get_attribute)(&mut sms, ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        })?;
        Ok(DeviceInfo {
            name,
            uuid,
            total_memory: total as u64,
            sm_count: sms,
        })
    }

    /// `cuCtxCreate_v2`: a context on `dev`, current on this thread.
    pub fn create_context(&self, dev: c_int) -> Result<Context<'_>, CudaError> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer.
        self.check("cuCtxCreate_v2", unsafe {
            (self.api.ctx_create)(&mut handle, 0, dev)
        })?;
        Ok(Context {
            driver: self,
            handle,
        })
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from `cuCtxCreate_v2` and is destroyed once.
        unsafe { (self.driver.api.ctx_destroy)(self.handle) };
    }
}

impl<'a> Context<'a> {
    /// `cuMemGetInfo_v2`: (free, total).
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers.
        self.driver.check("cuMemGetInfo_v2", unsafe {
            (self.driver.api.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// `cuMemAlloc_v2`.
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBuffer<'a>, CudaError> {
        let size = usize::try_from(bytes).map_err(|_| CudaError {
            call: "cuMemAlloc_v2".into(),
            name: "CUDA_ERROR_INVALID_VALUE".into(),
        })?;
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a valid out-pointer.
        self.driver.check("cuMemAlloc_v2", unsafe {
            (self.driver.api.mem_alloc)(&mut ptr, size)
        })?;
        Ok(DeviceBuffer {
            driver: self.driver,
            ptr,
        })
    }

    /// `cuMemcpyHtoD_v2` of `data` to `dst`.
    pub fn copy_to(&self, dst: &DeviceBuffer<'_>, data: &[f32]) -> Result<(), CudaError> {
        // SAFETY: `data` is readable for its size in bytes, which is passed.
        self.driver.check("cuMemcpyHtoD_v2", unsafe {
            (self.driver.api.memcpy_htod)(dst.ptr, data.as_ptr().cast(), size_of_val(data))
        })
    }

    /// `cuMemcpyDtoH_v2` from `src` into `out`.
    pub fn copy_from(&self, src: &DeviceBuffer<'_>, out: &mut [f32]) -> Result<(), CudaError> {
        // SAFETY: `out` is writable for its size in bytes, which is passed.
        self.driver.check("cuMemcpyDtoH_v2", unsafe {
            (self.driver.api.memcpy_dtoh)(out.as_mut_ptr().cast(), src.ptr, size_of_val(out))
        })
    }

    /// `cuModuleLoadData` with NUL-terminated PTX text.
    pub fn load_module(&self, ptx: &CStr) -> Result<LoadedModule<'a>, CudaError> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer; `ptx` is NUL-terminated.
        self.driver.check("cuModuleLoadData", unsafe {
            (self.driver.api.module_load_data)(&mut handle, ptx.as_ptr().cast())
        })?;
        Ok(LoadedModule {
            driver: self.driver,
            handle,
        })
    }

    /// `cuLaunchKernel` of `entry` in `module` over `grid` blocks of `block` threads, with
    /// `params` (pointers to each argument's value), then `cuCtxSynchronize`.
    pub fn launch(
        &self,
        module: &LoadedModule<'_>,
        entry: &CStr,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        let mut f: Handle = std::ptr::null_mut();
        // SAFETY: `f` is a valid out-pointer; `entry` is NUL-terminated; the module is live.
        self.driver.check("cuModuleGetFunction", unsafe {
            (self.driver.api.module_get_function)(&mut f, module.handle, entry.as_ptr())
        })?;
        // SAFETY: `params` holds one pointer per kernel parameter to a live value of its
        // type (the caller's contract with the kernel); the default stream is null.
        self.driver.check("cuLaunchKernel", unsafe {
            (self.driver.api.launch_kernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: no pointers.
        self.driver.check("cuCtxSynchronize", unsafe {
            (self.driver.api.ctx_synchronize)()
        })
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: the address came from `cuMemAlloc_v2` and is freed once.
        unsafe { (self.driver.api.mem_free)(self.ptr) };
    }
}

impl Drop for LoadedModule<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from `cuModuleLoadData` and is unloaded once.
        unsafe { (self.driver.api.module_unload)(self.handle) };
    }
}
