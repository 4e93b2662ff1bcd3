//! Exports: the processes on a device and what they use (`nvmlDeviceGetComputeRunningProcesses`
//! in its three versions, `nvmlDeviceGetMPSComputeRunningProcesses_v3`,
//! `nvmlDeviceGetProcessUtilization`, `nvmlDeviceGetUtilizationRates`), from the processes
//! registered with this node ([`crate::processes`]).
//!
//! What each answers, as NVML does (facts in the project's NVIDIA notes):
//! - the process list of a GPU handle holds every process on the GPU, those on its MIG devices
//!   included with their GPU- and compute-instance IDs; a MIG device handle's, the processes
//!   on that MIG device; outside MIG both IDs are `0xFFFFFFFF`;
//! - per-process and device utilisation exist for whole GPUs only: a MIG device, or a GPU in
//!   MIG mode, answers `NOT_SUPPORTED`; no sample since `lastSeenTimeStamp` is `NOT_FOUND`;
//! - the device's utilisation is the sum of its processes' SM loads (at most 100); the memory
//!   controller's is not simulated and reads 0.

// Exports of the C ABI: `no_mangle` and caller-owned arrays behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

use super::library::{guard, state, state_dir};
use super::pointers::put;
use super::resolve::{Dev, dev};
use super::{Handle, NvmlReturn, ret};
use crate::processes::{RunningProcess, Verdicts};
use crate::state::State;

/// `NVML_VALUE_NOT_AVAILABLE` as an instance ID: not in MIG.
const NO_ID: c_uint = 0xFFFF_FFFF;

/// `nvmlProcessInfo_t` (v2 and v3 functions).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessInfo {
    /// PID.
    pub pid: c_uint,
    /// Device memory the process holds (bytes).
    pub used_gpu_memory: c_ulonglong,
    /// GPU instance ID (MIG), else `0xFFFFFFFF`.
    pub gpu_instance_id: c_uint,
    /// Compute instance ID (MIG), else `0xFFFFFFFF`.
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_v1_t` (the unversioned function).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessInfoV1 {
    /// PID.
    pub pid: c_uint,
    /// Device memory the process holds (bytes).
    pub used_gpu_memory: c_ulonglong,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessUtilizationSample {
    /// PID.
    pub pid: c_uint,
    /// CPU timestamp of the sample (microseconds).
    pub time_stamp: c_ulonglong,
    /// SM utilisation (percent).
    pub sm_util: c_uint,
    /// Frame buffer memory utilisation (percent).
    pub mem_util: c_uint,
    /// Encoder utilisation (percent).
    pub enc_util: c_uint,
    /// Decoder utilisation (percent).
    pub dec_util: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Utilization {
    /// Percent of time a kernel ran on the GPU.
    pub gpu: c_uint,
    /// Percent of time device memory was read or written.
    pub memory: c_uint,
}

/// One process on a device, resolved against the state.
struct OnDevice {
    info: ProcessInfo,
    sm: u32,
    mps: bool,
}

/// What [`registered`] keeps between calls: the last answer, when and under which
/// `/proc/locks` text it was read, and what was found of each lock then held.
struct Last {
    at: Instant,
    locks: String,
    procs: Vec<RunningProcess>,
    verdicts: Verdicts,
}

static LAST: std::sync::Mutex<Option<Last>> = std::sync::Mutex::new(None);

/// How long an answer is given again without reading `/proc/locks`, as long as every
/// process in it is still alive: a sample of a device's use is a burst of NVML queries
/// (processes, their utilisation, memory, the device's utilisation), each of which asks, and
/// `/proc/locks` lists every lock of the machine (thousands with many simulated nodes, the
/// kernel formatting each line on every read). A process that starts, or drops its record
/// while it runs on, is seen this much later at most; one that exits, at once.
const FRESH: Duration = Duration::from_millis(20);

/// The registered processes of this node: the last answer while it is [`FRESH`] and all its
/// processes live, or while `/proc/locks` is unchanged; else a reading that looks only at the
/// locks taken since (on a machine with many nodes the text changes all the time, with every
/// state update of every node).
fn registered() -> Result<Vec<RunningProcess>, NvmlReturn> {
    let dir = state_dir()?;
    let proc_root = std::path::Path::new("/proc");
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(last) = last.as_ref()
        && last.at.elapsed() < FRESH
        && last.procs.iter().all(|p| alive(proc_root, p.pid))
    {
        return Ok(last.procs.clone());
    }
    let locks = std::fs::read_to_string(proc_root.join("locks")).unwrap_or_default();
    let last = last.get_or_insert_with(|| Last {
        at: Instant::now(),
        locks: String::new(),
        procs: Vec::new(),
        verdicts: Verdicts::default(),
    });
    if last.locks != locks || last.locks.is_empty() {
        last.procs =
            crate::processes::running_with_locks(&locks, proc_root, &dir, &mut last.verdicts);
        last.locks = locks;
    }
    last.at = Instant::now();
    Ok(last.procs.clone())
}

/// Whether process `pid` still runs: its root can be looked at (an exited process's cannot,
/// from the moment it exits, before its parent reaps it).
fn alive(proc_root: &std::path::Path, pid: u32) -> bool {
    std::fs::metadata(proc_root.join(pid.to_string()).join("root")).is_ok()
}

/// The processes on device `d`: see the module documentation.
fn on_device(st: &State, d: &Dev<'_>, procs: &[RunningProcess]) -> Vec<OnDevice> {
    procs
        .iter()
        .filter_map(|p| {
            let (gpu, gi, ci) = match st.gpu_by_uuid(&p.record.uuid) {
                Some(i) => (i, NO_ID, NO_ID),
                None => st.mig_by_uuid(&p.record.uuid)?,
            };
            let here = match d {
                Dev::Gpu(i) => *i == gpu,
                Dev::Mig(i, m) => *i == gpu && m.gi.id == gi && m.ci.id == ci,
            };
            here.then(|| OnDevice {
                info: ProcessInfo {
                    pid: p.pid,
                    used_gpu_memory: p.record.used_bytes,
                    gpu_instance_id: gi,
                    compute_instance_id: ci,
                },
                sm: p.record.sm_percent.min(100),
                mps: p.record.mps,
            })
        })
        .collect()
}

/// Memory the processes on `device` hold, in bytes (used by `nvmlDeviceGetMemoryInfo`).
pub(super) fn used_bytes(st: &State, d: &Dev<'_>) -> Result<u64, NvmlReturn> {
    Ok(on_device(st, d, &registered()?)
        .iter()
        .map(|p| p.info.used_gpu_memory)
        .sum())
}

/// Writes `items` into the caller's array of `*count` entries, NVML's way: `*count` becomes
/// the number there is; `INSUFFICIENT_SIZE` when it is larger than the room given.
///
/// # Safety
/// `count` must be null or valid for reads and writes; `out` null or valid for writes of
/// `*count` entries.
unsafe fn put_array<T: Copy>(
    count: *mut c_uint,
    out: *mut T,
    items: &[T],
) -> Result<(), NvmlReturn> {
    if count.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and readable per the contract.
    let room = unsafe { count.read_unaligned() } as usize;
    // SAFETY: as above, writable.
    unsafe { put(count, items.len() as c_uint)? };
    if items.is_empty() {
        return Ok(());
    }
    if room < items.len() {
        return Err(ret::INSUFFICIENT_SIZE);
    }
    if out.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    for (k, item) in items.iter().enumerate() {
        // SAFETY: `out` has room for `room >= items.len()` entries per the contract.
        unsafe { out.add(k).write_unaligned(*item) };
    }
    Ok(())
}

/// The process list of `device`, filtered by `keep`.
fn process_infos(
    device: Handle,
    keep: impl Fn(&OnDevice) -> bool,
) -> Result<Vec<ProcessInfo>, NvmlReturn> {
    let st = state()?;
    let d = dev(&st, device)?;
    Ok(on_device(&st, &d, &registered()?)
        .iter()
        .filter(|p| keep(p))
        .map(|p| p.info)
        .collect())
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`: every compute process on the device (MPS
/// clients included).
///
/// # Safety
/// `count` must be null or valid for reads and writes; `infos` null or valid for writes of
/// `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: Handle,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    guard(|| {
        let items = process_infos(device, |_| true)?;
        // SAFETY: caller contract.
        unsafe { put_array(count, infos, &items) }
    })
}

/// `nvmlDeviceGetComputeRunningProcesses_v2` (same struct as `_v3`).
///
/// # Safety
/// As `nvmlDeviceGetComputeRunningProcesses_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: Handle,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos) }
}

/// `nvmlDeviceGetComputeRunningProcesses` (v1 struct: PID and memory).
///
/// # Safety
/// `count` must be null or valid for reads and writes; `infos` null or valid for writes of
/// `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: Handle,
    count: *mut c_uint,
    infos: *mut ProcessInfoV1,
) -> NvmlReturn {
    guard(|| {
        let items: Vec<ProcessInfoV1> = process_infos(device, |_| true)?
            .into_iter()
            .map(|p| ProcessInfoV1 {
                pid: p.pid,
                used_gpu_memory: p.used_gpu_memory,
            })
            .collect();
        // SAFETY: caller contract.
        unsafe { put_array(count, infos, &items) }
    })
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: the MPS clients on the device.
///
/// # Safety
/// As `nvmlDeviceGetComputeRunningProcesses_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: Handle,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    guard(|| {
        let items = process_infos(device, |p| p.mps)?;
        // SAFETY: caller contract.
        unsafe { put_array(count, infos, &items) }
    })
}

/// The processes of a whole GPU not in MIG mode; `NOT_SUPPORTED` for anything else.
fn whole_gpu_processes(device: Handle) -> Result<Vec<OnDevice>, NvmlReturn> {
    let st = state()?;
    let d = dev(&st, device)?;
    match d {
        Dev::Gpu(i) if !st.gpus[i].mig_current => Ok(on_device(&st, &d, &registered()?)),
        _ => Err(ret::NOT_SUPPORTED),
    }
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// `nvmlDeviceGetProcessUtilization`: one sample per process with SM activity, taken now.
///
/// # Safety
/// `count` must be null or valid for reads and writes; `samples` null or valid for writes of
/// `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: Handle,
    samples: *mut ProcessUtilizationSample,
    count: *mut c_uint,
    last_seen: c_ulonglong,
) -> NvmlReturn {
    guard(|| {
        let now = now_micros();
        let items: Vec<ProcessUtilizationSample> = whole_gpu_processes(device)?
            .iter()
            .filter(|p| p.sm > 0 && now > last_seen)
            .map(|p| ProcessUtilizationSample {
                pid: p.info.pid,
                time_stamp: now,
                sm_util: p.sm,
                ..ProcessUtilizationSample::default()
            })
            .collect();
        if items.is_empty() {
            return Err(ret::NOT_FOUND);
        }
        // SAFETY: caller contract.
        unsafe { put_array(count, samples, &items) }
    })
}

/// `nvmlDeviceGetUtilizationRates`: the sum of the processes' SM loads, at most 100.
///
/// # Safety
/// `utilization` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: Handle,
    utilization: *mut Utilization,
) -> NvmlReturn {
    guard(|| {
        let gpu = whole_gpu_processes(device)?
            .iter()
            .map(|p| p.sm)
            .sum::<u32>()
            .min(100);
        // SAFETY: caller contract (out-parameter).
        unsafe { put(utilization, Utilization { gpu, memory: 0 }) }
    })
}
