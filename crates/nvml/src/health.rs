//! The NVML backend of the [`HealthSource`] seam: an event set for XID and uncorrectable ECC
//! events, and a probe of each GPU's reachability and recovery action.
//!
//! One NVML session lives for the whole watch (unlike discovery, which opens one per call):
//! an event set only reports events that happen while it exists. NVML's event wait blocks, so
//! [`HealthSource::watch`] runs on a thread of its own and waits in short slices (at most 500 ms)
//! to notice `stop` and the next probe.
//!
//! The session ends, and the watch returns an error, when NVML as a whole is out of reach (no
//! kernel module, library and module of different versions, session no longer initialised:
//! the driver unloaded or upgraded in place under it); its
//! GPUs are then not reported unreachable, which would taint every device of the node for
//! what is no fault of theirs. The caller opens a new session once NVML answers again, from a
//! fresh library lookup: no handle is kept across a driver swap.
//!
//! Facts this relies on (NVML headers; NVIDIA's k8s-device-plugin does the same): events are
//! registered per GPU (not per MIG device); an event carries the GPU instance and compute
//! instance it is limited to, or `0xFFFFFFFF` for both when it concerns the whole GPU; a GPU
//! that fell off the bus answers `NVML_ERROR_GPU_IS_LOST`; field 230
//! (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, R550 and later) tells what the driver asks for
//! before the GPU may be used again. An H100 with driver 580 reports the event mask `0xff9f` as
//! supported and field 230 as an unsigned int.

// Raw NVML calls (event sets and field values have no safe wrapper that fits); each unsafe
// block says why it is sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_ulonglong};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpu_dra_device::{DeviceError, HealthEvent, HealthObservation, HealthSource, InstanceId};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlFieldValue_t,
    nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST, nvmlReturn_enum_NVML_ERROR_TIMEOUT,
    nvmlReturn_enum_NVML_SUCCESS,
};

use crate::NvmlInventory;

/// `nvmlEventTypeDoubleBitEccError`, uncorrectable ECC errors (single-bit ones are corrected
/// by the hardware and not watched).
const EVENT_DOUBLE_BIT_ECC: c_ulonglong = 0x2;
/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: c_ulonglong = 0x8;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
const FIELD_RECOVERY_ACTION: c_uint = 230;
/// An event's GPU/compute instance ID when it is not limited to one MIG instance.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;
/// Longest single event wait, so that `stop` and probes are noticed.
const WAIT_SLICE: Duration = Duration::from_millis(500);

impl HealthSource for NvmlInventory {
    fn watch(
        &self,
        gpus: &[String],
        probe_interval: Duration,
        stop: &AtomicBool,
        sink: &mut dyn FnMut(HealthObservation),
    ) -> Result<(), DeviceError> {
        let options = self.options();
        let nvml = options.library.open()?;
        let set = EventSet::create(&nvml)?;
        // Handles of the watched GPUs, to map an event's device back to its UUID.
        let mut handles: HashMap<usize, String> = HashMap::new();
        for uuid in gpus {
            match nvml.device_by_uuid(uuid.as_str()) {
                Ok(device) => {
                    // SAFETY: the handle is only compared and passed back to NVML while `nvml`
                    // lives (this function's scope).
                    let raw = unsafe { device.handle() };
                    if let Err(reason) = set.register(&nvml, raw) {
                        tracing::warn!(gpu = %uuid, %reason, "cannot watch this GPU's NVML events; it is still probed");
                    }
                    handles.insert(raw as usize, uuid.clone());
                }
                Err(e) => {
                    tracing::warn!(gpu = %uuid, error = %e, "cannot open this GPU to watch its events");
                }
            }
        }
        tracing::info!(gpus = handles.len(), probe_every = ?probe_interval, "watching GPU health through NVML");
        let probe_all = |sink: &mut dyn FnMut(HealthObservation)| -> Result<(), DeviceError> {
            for uuid in gpus {
                sink(probe(&nvml, uuid)?);
            }
            Ok(())
        };
        probe_all(sink)?;
        let mut next_probe = Instant::now() + probe_interval;
        while !stop.load(Ordering::Relaxed) {
            let left = next_probe.saturating_duration_since(Instant::now());
            if left.is_zero() {
                probe_all(sink)?;
                next_probe = Instant::now() + probe_interval;
                continue;
            }
            match set.wait(&nvml, left.min(WAIT_SLICE)) {
                Wait::Timeout => {}
                Wait::Event(data) => {
                    let Some(uuid) = handles.get(&(data.device as usize)).cloned() else {
                        continue;
                    };
                    let event = match data.eventType {
                        t if t & EVENT_XID != 0 => HealthEvent::Xid(data.eventData),
                        t if t & EVENT_DOUBLE_BIT_ECC != 0 => HealthEvent::UncorrectableEcc,
                        _ => continue,
                    };
                    let instance = (data.gpuInstanceId != NO_INSTANCE
                        && data.computeInstanceId != NO_INSTANCE)
                        .then_some(InstanceId {
                            gi: data.gpuInstanceId,
                            ci: data.computeInstanceId,
                        });
                    sink(HealthObservation::Event {
                        gpu_uuid: uuid.clone(),
                        event,
                        instance,
                    });
                    // What the driver asks for after this event, at once.
                    sink(probe(&nvml, &uuid)?);
                }
                Wait::Lost => {
                    // Some registered GPU is gone; the probes say which.
                    probe_all(sink)?;
                    std::thread::sleep(WAIT_SLICE);
                }
                Wait::Failed(e) if session_over(&e) => {
                    return Err(session_ended("nvmlEventSetWait_v2", &e));
                }
                Wait::Failed(e) => {
                    tracing::warn!(reason = %e, "waiting for NVML events failed; probing");
                    probe_all(sink)?;
                    std::thread::sleep(WAIT_SLICE);
                }
            }
        }
        Ok(())
    }
}

/// Whether an NVML error ends the session: NVML as a whole is out of reach, not one GPU.
fn session_over(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::DriverNotLoaded | NvmlError::LibRmVersionMismatch | NvmlError::Uninitialized
    )
}

fn session_ended(call: &'static str, e: &NvmlError) -> DeviceError {
    DeviceError::Query {
        call,
        target: "the health watch's NVML session".into(),
        reason: e.to_string(),
    }
}

/// Probes one GPU: reachable, and its recovery action when the driver reports one. An error
/// when NVML as a whole is out of reach (see [`session_over`]).
fn probe(nvml: &Nvml, uuid: &str) -> Result<HealthObservation, DeviceError> {
    let unreachable = || HealthObservation::Probe {
        gpu_uuid: uuid.to_string(),
        reachable: false,
        recovery_action: None,
    };
    let device = match nvml.device_by_uuid(uuid) {
        Ok(d) => d,
        Err(NvmlError::GpuLost) => return Ok(unreachable()),
        Err(e) if session_over(&e) => return Err(session_ended("nvmlDeviceGetHandleByUUID", &e)),
        Err(e) => {
            tracing::debug!(gpu = %uuid, error = %e, "GPU not reachable by UUID");
            return Ok(unreachable());
        }
    };
    // A cheap call that fails on a GPU that fell off the bus after its handle was made.
    match device.minor_number() {
        Err(NvmlError::GpuLost) => return Ok(unreachable()),
        Err(e) if session_over(&e) => return Err(session_ended("nvmlDeviceGetMinorNumber", &e)),
        _ => {}
    }
    // SAFETY: the handle belongs to `nvml`, which outlives this call.
    let raw = unsafe { device.handle() };
    Ok(HealthObservation::Probe {
        gpu_uuid: uuid.to_string(),
        reachable: true,
        recovery_action: recovery_action(nvml, raw),
    })
}

/// Field 230 through the raw call (the typed wrapper insists on value types this field's
/// older drivers do not all use); `None` when not reported.
fn recovery_action(nvml: &Nvml, device: nvmlDevice_t) -> Option<u32> {
    let get = nvml.lib().nvmlDeviceGetFieldValues.as_ref().ok()?;
    // SAFETY: nvmlFieldValue_t is plain old data; all-zero is a valid value.
    let mut value: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
    value.fieldId = FIELD_RECOVERY_ACTION;
    // SAFETY: one valid, writable nvmlFieldValue_t and a count of 1; the handle is live.
    let ret = unsafe { get(device, 1 as c_int, &mut value) };
    if ret != nvmlReturn_enum_NVML_SUCCESS || value.nvmlReturn != nvmlReturn_enum_NVML_SUCCESS {
        return None;
    }
    // SAFETY: every member of the 8-byte union is plain data; the value types NVML uses for
    // this field (unsigned int, unsigned long, unsigned long long) all start with the value's
    // low bytes on little-endian hosts, and values are below 2^32.
    let raw = unsafe { value.value.ullVal };
    Some(match value.valueType {
        // NVML_VALUE_TYPE_UNSIGNED_INT: only the low 32 bits are written.
        1 => (raw & 0xFFFF_FFFF) as u32,
        _ => u32::try_from(raw).unwrap_or(u32::MAX),
    })
}

enum Wait {
    Timeout,
    Event(nvmlEventData_t),
    Lost,
    Failed(NvmlError),
}

/// An NVML event set, freed on drop.
struct EventSet<'a> {
    set: nvmlEventSet_t,
    nvml: &'a Nvml,
}

impl<'a> EventSet<'a> {
    fn create(nvml: &'a Nvml) -> Result<Self, DeviceError> {
        let init = |reason: String| DeviceError::Query {
            call: "nvmlEventSetCreate",
            target: "the health watch".into(),
            reason,
        };
        let create = nvml
            .lib()
            .nvmlEventSetCreate
            .as_ref()
            .map_err(|e| init(format!("nvmlEventSetCreate missing: {e}")))?;
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; NVML is initialised.
        let ret = unsafe { create(&mut set) };
        if ret != nvmlReturn_enum_NVML_SUCCESS {
            return Err(init(format!(
                "nvmlEventSetCreate returned {}",
                NvmlError::from(ret)
            )));
        }
        Ok(Self { set, nvml })
    }

    /// Registers XID and uncorrectable-ECC events of `device`, as far as it supports them.
    fn register(&self, nvml: &Nvml, device: nvmlDevice_t) -> Result<(), String> {
        let lib = nvml.lib();
        let supported_fn = lib
            .nvmlDeviceGetSupportedEventTypes
            .as_ref()
            .map_err(|e| e.to_string())?;
        let register = lib
            .nvmlDeviceRegisterEvents
            .as_ref()
            .map_err(|e| e.to_string())?;
        let mut supported: c_ulonglong = 0;
        // SAFETY: live handle and a valid out-pointer.
        let ret = unsafe { supported_fn(device, &mut supported) };
        if ret != nvmlReturn_enum_NVML_SUCCESS {
            return Err(format!(
                "nvmlDeviceGetSupportedEventTypes: {}",
                NvmlError::from(ret)
            ));
        }
        let mask = supported & (EVENT_XID | EVENT_DOUBLE_BIT_ECC);
        if mask == 0 {
            return Err(format!(
                "the GPU supports none of the watched events (supported mask {supported:#x})"
            ));
        }
        // SAFETY: live handle and event set.
        let ret = unsafe { register(device, mask, self.set) };
        if ret != nvmlReturn_enum_NVML_SUCCESS {
            return Err(format!(
                "nvmlDeviceRegisterEvents: {}",
                NvmlError::from(ret)
            ));
        }
        Ok(())
    }

    fn wait(&self, nvml: &Nvml, timeout: Duration) -> Wait {
        let wait = match nvml.lib().nvmlEventSetWait_v2.as_ref() {
            Ok(wait) => wait,
            Err(e) => return Wait::Failed(NvmlError::FailedToLoadSymbol(e.to_string())),
        };
        // SAFETY: plain old data; all-zero is valid.
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        let ms = c_uint::try_from(timeout.as_millis()).unwrap_or(c_uint::MAX);
        // SAFETY: live event set and a valid out-pointer.
        let ret = unsafe { wait(self.set, &mut data, ms) };
        match ret {
            r if r == nvmlReturn_enum_NVML_SUCCESS => Wait::Event(data),
            r if r == nvmlReturn_enum_NVML_ERROR_TIMEOUT => Wait::Timeout,
            r if r == nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => Wait::Lost,
            r => Wait::Failed(NvmlError::from(r)),
        }
    }
}

impl Drop for EventSet<'_> {
    fn drop(&mut self) {
        if let Ok(free) = self.nvml.lib().nvmlEventSetFree.as_ref() {
            // SAFETY: the set was created by nvmlEventSetCreate and is freed once.
            unsafe {
                free(self.set);
            }
        }
    }
}
