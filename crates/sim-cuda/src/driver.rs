//! The simulated CUDA driver's model: the devices a process sees, its contexts with their
//! memory, modules and kernels, and the node it reports its use to. The C exports
//! (`ffi`) are a thin shell over [`Driver`]; everything here is plain Rust.
//!
//! It behaves as `cuda-app` ([`gpu_dra_sim::cuda`]) does, using that module's code:
//! - Devices: those whose device nodes the process's `/dev` has
//!   ([`gpu_dra_sim::state::StateFile::load_visible`]), narrowed by `CUDA_VISIBLE_DEVICES`,
//!   a GPU in MIG mode showing one device per MIG device, named `<GPU> MIG <profile>` with
//!   the MIG UUID ([`gpu_dra_sim::cuda::devices`]).
//! - MPS: `cuInit` joins the control daemon through `CUDA_MPS_PIPE_DIRECTORY` as CUDA does
//!   when it is first initialised ([`gpu_dra_sim::cuda::attach`]); the connection stays open
//!   while the driver lives. The server's terms apply: the pinned device memory limit of
//!   its device bounds allocations (`CUDA_ERROR_OUT_OF_MEMORY` past it) and is the total
//!   `cuMemGetInfo` reports on a whole GPU (on a MIG device the physical size, as observed on
//!   real MIG + MPS); the active thread percentage scales the SM count of every device,
//!   rounded up (`ceil(sms * pct / 100)`, at least 1). That rounding is this simulator's
//!   choice: NVIDIA documents that the client sees fewer SMs, not how they are rounded.
//! - Without a daemon, a context on a GPU in `EXCLUSIVE_PROCESS` (the compute mode an MPS
//!   claim's GPU gets) or `PROHIBITED` mode fails with `CUDA_ERROR_DEVICE_UNAVAILABLE`,
//!   cuda-app's `cudaErrorDevicesUnavailable`.
//! - Use: while a context lives, the process is registered with the node
//!   ([`gpu_dra_sim::processes::register`]) on the first live context's device with the
//!   memory its contexts on that device hold, so NVML lists it; the record follows every
//!   allocation and free and goes with the last context. Registration is best effort: a
//!   process without a writable `/dev/shm` still computes, unseen by NVML.
//! - The driver's version checks of an upgrade in place ([`gpu_dra_sim::upgrade`]): with
//!   no kernel module loaded `cuInit` answers `CUDA_ERROR_NO_DEVICE`, with a module of
//!   another version than the library's (from its own file name, `libcuda.so.<ver>`)
//!   `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`.
//!
//! Kinder than real CUDA: other processes' memory does not reduce what `cuMemGetInfo`
//! reports free or what an allocation may take; a module's `.version` is checked against
//! the driver's CUDA version by major version only (PTX ISA `N.x` needs CUDA `N+4`).

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use gpu_dra_sim::cuda::{self, ClientEnv, Device};
use gpu_dra_sim::processes::{self, ProcessRecord, Registration};
use gpu_dra_sim::state::{self, ComputeMode};
use gpu_dra_sim::upgrade::{self, NvmlRefusal};

use crate::memory::DeviceMemory;
use crate::ptx::{self, Geometry, LaunchError, Module};
use crate::result::{self, CuResult};

/// Prefix of this library's versioned file name.
pub const VERSIONED_PREFIX: &str = "libcuda.so.";

/// Threads per block, and the block's x and y extent, CUDA allows (z: 64).
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;

/// What the driver knows of the process it runs in.
#[derive(Debug, Clone)]
pub struct Environment {
    /// The library's own path (`None`: not loaded from a file).
    pub library: Option<PathBuf>,
    /// The CUDA variables of the process.
    pub client: ClientEnv,
    /// Where the process registers its use (`/dev/shm`).
    pub shm_dir: PathBuf,
}

/// A device as the driver presents it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverDevice {
    /// What the simulator's CUDA model says of it.
    pub device: Device,
    /// Its GPU's compute mode.
    pub compute_mode: ComputeMode,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// PCI domain, bus, device.
    pub pci: (u32, u32, u32),
    /// SMs as this process sees them (fewer under MPS with an active thread percentage).
    pub multiprocessors: u32,
    /// The pinned memory limit of this process's MPS server on the device, in bytes.
    pub mps_limit: Option<u64>,
}

impl DriverDevice {
    /// The 16 bytes of its UUID (`GPU-`/`MIG-` prefix dropped, hex decoded).
    pub fn uuid_bytes(&self) -> [u8; 16] {
        uuid_bytes(&self.device.uuid)
    }

    /// Bytes an allocation may reach in total on it: its memory, or less under an MPS limit.
    pub fn room(&self) -> u64 {
        self.mps_limit.map_or(self.device.memory_bytes, |l| {
            l.min(self.device.memory_bytes)
        })
    }

    /// The total `cuMemGetInfo` reports: the MPS limit on a whole GPU, else the memory.
    pub fn reported_total(&self) -> u64 {
        if self.device.mig {
            self.device.memory_bytes
        } else {
            self.room()
        }
    }
}

/// The 16 bytes of a `GPU-...`/`MIG-...` UUID (zeros where it is not hex).
pub fn uuid_bytes(uuid: &str) -> [u8; 16] {
    let hex: Vec<u8> = uuid
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .bytes()
        .filter(u8::is_ascii_hexdigit)
        .collect();
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        let s = std::str::from_utf8(pair).unwrap_or("0");
        out[i] = u8::from_str_radix(s, 16).unwrap_or(0);
    }
    out
}

/// A context.
#[derive(Debug)]
struct Context {
    device: usize,
    memory: DeviceMemory,
    /// The error a failed kernel left (CUDA's sticky errors): every later call on the
    /// context answers it.
    sticky: Option<CuResult>,
}

/// A loaded module.
#[derive(Debug)]
struct LoadedModule {
    context: u64,
    module: Module,
}

/// The driver of one process, from `cuInit` on.
#[derive(Debug)]
pub struct Driver {
    devices: Vec<DriverDevice>,
    cuda_version: i32,
    state_dir: PathBuf,
    shm_dir: PathBuf,
    _mps: Option<UnixStream>,
    contexts: HashMap<u64, Context>,
    modules: HashMap<u64, LoadedModule>,
    /// Function handle -> (module, kernel index).
    functions: HashMap<u64, (u64, usize)>,
    next_handle: u64,
    registration: Option<Registration>,
    /// The last PTX refusal, for `cuGetErrorString`.
    pub last_ptx_error: Option<String>,
}

/// Device address where context `n`'s memory starts.
fn memory_base(n: u64) -> u64 {
    0x7f00_0000_0000 + (n << 36)
}

impl Driver {
    /// `cuInit`: finds the simulated host, checks the driver's versions, enumerates the
    /// devices and joins MPS.
    pub fn init(env: &Environment) -> Result<Driver, CuResult> {
        let file = state::locate(env.library.as_deref()).map_err(|_| result::NO_DEVICE)?;
        let full = file.load().map_err(|_| result::NO_DEVICE)?;
        let own = env
            .library
            .as_deref()
            .and_then(|p| upgrade::library_version(p, VERSIONED_PREFIX));
        upgrade::nvml_access(&full, own.as_deref()).map_err(|r| match r {
            NvmlRefusal::DriverNotLoaded => result::NO_DEVICE,
            NvmlRefusal::VersionMismatch => result::SYSTEM_DRIVER_MISMATCH,
        })?;
        let visible = file.load_visible().map_err(|_| result::NO_DEVICE)?;
        let attached = cuda::attach(&env.client);
        let (mps_device, pct) = attached
            .as_ref()
            .map(|(reply, _)| cuda::mps_terms(reply))
            .unwrap_or((None, None));
        let devices: Vec<DriverDevice> =
            cuda::devices(&visible, env.client.visible_devices.as_deref())
                .into_iter()
                .map(|device| {
                    let spec = &visible.profile.gpus[device.gpu];
                    let pci = spec.pci();
                    let multiprocessors = match pct {
                        Some(p) => {
                            let sms = f64::from(device.multiprocessors) * p / 100.0;
                            (sms.ceil() as u32).clamp(1, device.multiprocessors.max(1))
                        }
                        None => device.multiprocessors,
                    };
                    let mps_limit = mps_device
                        .as_ref()
                        .filter(|(uuid, _)| *uuid == device.uuid)
                        .and_then(|(_, limit)| *limit);
                    DriverDevice {
                        compute_mode: visible.gpus[device.gpu].compute_mode,
                        cc: spec.cc(),
                        pci: (pci.domain, pci.bus, pci.device),
                        multiprocessors,
                        mps_limit,
                        device,
                    }
                })
                .collect();
        if devices.is_empty() {
            return Err(result::NO_DEVICE);
        }
        Ok(Driver {
            devices,
            cuda_version: i32::try_from(visible.profile.cuda_driver_version).unwrap_or(0),
            state_dir: file
                .path()
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            shm_dir: env.shm_dir.clone(),
            _mps: attached.map(|(_, conn)| conn),
            contexts: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            next_handle: 1,
            registration: None,
            last_ptx_error: None,
        })
    }

    /// `cuDriverGetVersion`: the CUDA version the driver supports (`13000` for 13.0), the
    /// one `nvidia-smi` prints.
    pub fn version(&self) -> i32 {
        self.cuda_version
    }

    /// Whether this process joined an MPS server.
    pub fn mps(&self) -> bool {
        self._mps.is_some()
    }

    /// The devices, in ordinal order.
    pub fn devices(&self) -> &[DriverDevice] {
        &self.devices
    }

    /// Device `ordinal`.
    pub fn device(&self, ordinal: i32) -> Result<&DriverDevice, CuResult> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or(result::INVALID_DEVICE)
    }

    fn handle(&mut self) -> u64 {
        let h = self.next_handle;
        self.next_handle += 1;
        h
    }

    /// `cuCtxCreate`: a context on device `ordinal`; its handle.
    pub fn create_context(&mut self, ordinal: i32) -> Result<u64, CuResult> {
        let dev = self.device(ordinal)?;
        if !self.mps()
            && matches!(
                dev.compute_mode,
                ComputeMode::ExclusiveProcess | ComputeMode::Prohibited
            )
        {
            return Err(result::DEVICE_UNAVAILABLE);
        }
        let device = ordinal as usize;
        let h = self.handle();
        self.contexts.insert(
            h,
            Context {
                device,
                memory: DeviceMemory::new(memory_base(h)),
                sticky: None,
            },
        );
        self.report_use();
        Ok(h)
    }

    /// `cuCtxDestroy`: the context's memory and modules go with it.
    pub fn destroy_context(&mut self, ctx: u64) -> Result<(), CuResult> {
        self.contexts.remove(&ctx).ok_or(result::INVALID_CONTEXT)?;
        let gone: Vec<u64> = self
            .modules
            .iter()
            .filter(|(_, m)| m.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for m in gone {
            self.unload_module(m)?;
        }
        self.report_use();
        Ok(())
    }

    fn context(&mut self, ctx: u64) -> Result<&mut Context, CuResult> {
        let c = self.contexts.get_mut(&ctx).ok_or(result::INVALID_CONTEXT)?;
        match c.sticky {
            Some(e) => Err(e),
            None => Ok(c),
        }
    }

    /// `cuCtxSynchronize`: kernels run when launched, so only a failure they left remains.
    pub fn synchronize(&mut self, ctx: u64) -> Result<(), CuResult> {
        self.context(ctx).map(|_| ())
    }

    /// `cuMemGetInfo`: (free, total) on the context's device.
    pub fn mem_info(&mut self, ctx: u64) -> Result<(u64, u64), CuResult> {
        let device = self.context(ctx)?.device;
        let used = self.used_on(device);
        let total = self.devices[device].reported_total();
        Ok((total.saturating_sub(used), total))
    }

    fn used_on(&self, device: usize) -> u64 {
        self.contexts
            .values()
            .filter(|c| c.device == device)
            .map(|c| c.memory.used())
            .sum()
    }

    /// `cuMemAlloc`: `CUDA_ERROR_OUT_OF_MEMORY` past the device's memory or MPS limit.
    pub fn alloc(&mut self, ctx: u64, size: u64) -> Result<u64, CuResult> {
        if size == 0 {
            return Err(result::INVALID_VALUE);
        }
        let device = self.context(ctx)?.device;
        let room = self.devices[device].room();
        if self.used_on(device).saturating_add(size) > room {
            return Err(result::OUT_OF_MEMORY);
        }
        let ptr = self.context(ctx)?.memory.alloc(size);
        self.report_use();
        Ok(ptr)
    }

    /// `cuMemFree`: `ptr` must be an allocation's start.
    pub fn free(&mut self, ctx: u64, ptr: u64) -> Result<(), CuResult> {
        self.context(ctx)?
            .memory
            .free(ptr)
            .ok_or(result::INVALID_VALUE)?;
        self.report_use();
        Ok(())
    }

    /// `cuMemcpyHtoD`.
    pub fn copy_to_device(&mut self, ctx: u64, dst: u64, data: &[u8]) -> Result<(), CuResult> {
        self.context(ctx)?
            .memory
            .write_bytes(dst, data)
            .map_err(|_| result::INVALID_VALUE)
    }

    /// `cuMemcpyDtoH`.
    pub fn copy_from_device(&mut self, ctx: u64, src: u64, out: &mut [u8]) -> Result<(), CuResult> {
        self.context(ctx)?
            .memory
            .read_bytes(src, out)
            .map_err(|_| result::INVALID_VALUE)
    }

    /// `cuModuleLoadData` with PTX text: parsed and checked against the driver's CUDA
    /// version and the device's compute capability. The refusal's message is kept for
    /// `cuGetErrorString`.
    pub fn load_module(&mut self, ctx: u64, text: &str) -> Result<u64, CuResult> {
        let device = self.context(ctx)?.device;
        let module = match ptx::parse(text) {
            Ok(m) => m,
            Err(e) => {
                self.last_ptx_error = Some(e.to_string());
                return Err(result::INVALID_PTX);
            }
        };
        let max_isa_major = u32::try_from(self.cuda_version / 1000 - 4).unwrap_or(0);
        if module.version.0 > max_isa_major {
            self.last_ptx_error = Some(format!(
                "PTX ISA {}.{} needs a newer driver than CUDA {}.{}",
                module.version.0,
                module.version.1,
                self.cuda_version / 1000,
                self.cuda_version % 1000 / 10
            ));
            return Err(result::UNSUPPORTED_PTX_VERSION);
        }
        let (major, minor) = self.devices[device].cc;
        let sm = u32::try_from(major * 10 + minor).unwrap_or(0);
        if module.target > sm {
            self.last_ptx_error = Some(format!(
                ".target sm_{} is higher than the device's sm_{sm}",
                module.target
            ));
            return Err(result::INVALID_PTX);
        }
        let h = self.handle();
        self.modules.insert(
            h,
            LoadedModule {
                context: ctx,
                module,
            },
        );
        Ok(h)
    }

    /// `cuModuleUnload`.
    pub fn unload_module(&mut self, module: u64) -> Result<(), CuResult> {
        self.modules.remove(&module).ok_or(result::INVALID_HANDLE)?;
        self.functions.retain(|_, (m, _)| *m != module);
        Ok(())
    }

    /// `cuModuleGetFunction`.
    pub fn function(&mut self, module: u64, name: &str) -> Result<u64, CuResult> {
        let m = self.modules.get(&module).ok_or(result::INVALID_HANDLE)?;
        let k = m
            .module
            .kernels
            .iter()
            .position(|k| k.name == name)
            .ok_or(result::NOT_FOUND)?;
        let h = self.handle();
        self.functions.insert(h, (module, k));
        Ok(h)
    }

    /// The parameter sizes of `function`, in order (how `cuLaunchKernel` reads its
    /// `kernelParams`).
    pub fn param_sizes(&self, function: u64) -> Result<Vec<usize>, CuResult> {
        let (m, k) = self
            .functions
            .get(&function)
            .ok_or(result::INVALID_HANDLE)?;
        let m = self.modules.get(m).ok_or(result::INVALID_HANDLE)?;
        Ok(m.module.kernels[*k]
            .params
            .iter()
            .map(|p| p.ty.size())
            .collect())
    }

    /// `cuLaunchKernel` in context `ctx`: runs the kernel to its end. A fault in the kernel
    /// is returned by this and every later call on the context, as CUDA's sticky errors are.
    pub fn launch(
        &mut self,
        ctx: u64,
        function: u64,
        geometry: Geometry,
        params: &[Vec<u8>],
    ) -> Result<(), CuResult> {
        let Geometry { grid, block } = geometry;
        let threads: u64 = block.iter().map(|d| u64::from(*d)).product();
        if grid.contains(&0)
            || block.contains(&0)
            || threads > u64::from(MAX_THREADS_PER_BLOCK)
            || block[2] > 64
            || grid[1] > 65535
            || grid[2] > 65535
            || grid[0] > i32::MAX as u32
        {
            return Err(result::INVALID_VALUE);
        }
        let (m, k) = *self
            .functions
            .get(&function)
            .ok_or(result::INVALID_HANDLE)?;
        let module = self.modules.get(&m).ok_or(result::INVALID_HANDLE)?;
        if module.context != ctx {
            return Err(result::INVALID_HANDLE);
        }
        let kernel = module.module.kernels[k].clone();
        let c = self.context(ctx)?;
        let outcome = kernel.launch(geometry, params, &mut c.memory);
        let code = match outcome {
            Ok(()) => return Ok(()),
            Err(LaunchError::Arguments { .. }) => return Err(result::INVALID_VALUE),
            Err(LaunchError::IllegalAddress(_)) => result::ILLEGAL_ADDRESS,
            Err(LaunchError::Misaligned(_)) => result::MISALIGNED_ADDRESS,
            Err(LaunchError::Timeout) => result::LAUNCH_TIMEOUT,
        };
        c.sticky = Some(code);
        Err(code)
    }

    /// Brings the node's record of this process in line with its contexts (see the module
    /// doc).
    fn report_use(&mut self) {
        // The old record goes first: the new one has the same path.
        self.registration = None;
        let Some(device) = self
            .contexts
            .iter()
            .min_by_key(|(h, _)| **h)
            .map(|(_, c)| c.device)
        else {
            return;
        };
        let record = ProcessRecord {
            state_dir: self.state_dir.clone(),
            uuid: self.devices[device].device.uuid.clone(),
            used_bytes: self.used_on(device),
            sm_percent: 0,
            mps: self.mps(),
        };
        self.registration = processes::register(&record, &self.shm_dir).ok();
    }

    /// Ends the process's use of the devices (at exit): its record goes.
    pub fn release(&mut self) {
        self.registration = None;
    }

    /// The record file of this process's use, while it has one.
    pub fn registration(&self) -> Option<&Path> {
        self.registration.as_ref().map(Registration::path)
    }
}

/// A handle of this driver as the pointer C sees (`CUcontext`, `CUmodule`, `CUfunction`).
pub fn handle_ptr(h: u64) -> *mut std::ffi::c_void {
    h as usize as *mut std::ffi::c_void
}

/// The handle a C pointer carries.
pub fn ptr_handle(p: *mut std::ffi::c_void) -> u64 {
    p as usize as u64
}

/// The environment of the running process, for a library at `library`.
pub fn process_environment(library: Option<PathBuf>) -> Environment {
    Environment {
        library,
        client: ClientEnv::from_process(),
        shm_dir: PathBuf::from("/dev/shm"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_bytes_decode_both_prefixes() {
        assert_eq!(
            uuid_bytes("GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"),
            [
                0x5d, 0x5b, 0xa0, 0xd6, 0xd3, 0x3d, 0x2b, 0x2c, 0x52, 0x4d, 0x9e, 0x3d, 0x8d, 0x2b,
                0x8a, 0x77
            ]
        );
        assert_eq!(
            uuid_bytes("MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f")[..2],
            [0xc6, 0xd4]
        );
    }
}
