//! NVML health surface: event sets (`nvmlEventSet*`, `nvmlDeviceRegisterEvents`,
//! `nvmlDeviceGetSupportedEventTypes`) and `nvmlDeviceGetFieldValues` for the GPU recovery
//! action.
//!
//! An event set is an in-process object: a box whose address is the opaque
//! `nvmlEventSet_t`, registered in a table so a foreign or freed pointer is recognised
//! without being dereferenced. It remembers, per registered GPU UUID, the event mask and a
//! cursor: the sequence number of the next event of the node's log ([`crate::health`]) it
//! may deliver for that GPU. Registration sets the cursor to the log's next sequence number,
//! so earlier events are never delivered; delivering (or skipping, when the mask does not
//! match) an event moves the cursor past it, so each event reaches each set once, in order.
//!
//! `nvmlEventSetWait` sleeps in the kernel, as a real driver's wait does: on the state's
//! change counter ([`crate::state::ChangeCounter`], a futex in the state's lock file, which
//! every writer of the state counts and wakes), and reads the state again when woken, through
//! the library's usual cheap path (a few `stat` calls, a parse only when the file changed).
//! It also reads the state once a second without a wake-up, for writers that do not count (a
//! test editing the file), and polls every 100 ms when the lock file has no counter. The lock
//! file sits beside the state file, so the state folder stays the only channel between
//! processes (a container sees the node's `etc/gpu-sim` through a bind mount and nothing
//! else).

// Exports of the C ABI: caller-owned memory behind raw pointers (see the parent module).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_int, c_longlong, c_uint, c_ulong, c_ulonglong, c_ushort};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::handles::{Key, handle, lock};
use super::library::{guard, state, state_file};
use super::pointers::put;
use super::resolve::{Dev, dev, full_gpu};
use super::{Handle, NvmlReturn, ret};
use crate::state::State;

/// `nvmlEventData_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EventData {
    /// The GPU the event happened on (the parent GPU for MIG-scoped events).
    pub device: Handle,
    /// One `nvmlEventType*` bit.
    pub event_type: c_ulonglong,
    /// The XID for XID events, 0 otherwise.
    pub event_data: c_ulonglong,
    /// GPU-instance ID, `0xFFFFFFFF` when not MIG-specific.
    pub gpu_instance_id: c_uint,
    /// Compute-instance ID, `0xFFFFFFFF` when not MIG-specific.
    pub compute_instance_id: c_uint,
}

/// `nvmlValue_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Value {
    /// `dVal`.
    pub d: f64,
    /// `siVal`.
    pub si: c_int,
    /// `uiVal`.
    pub ui: c_uint,
    /// `ulVal`.
    pub ul: c_ulong,
    /// `ullVal`.
    pub ull: c_ulonglong,
    /// `sllVal`.
    pub sll: c_longlong,
    /// `usVal`.
    pub us: c_ushort,
}

/// `nvmlFieldValue_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FieldValue {
    /// `NVML_FI_*` (set by the caller).
    pub field_id: c_uint,
    /// Scope such as an NVLink index (set by the caller).
    pub scope_id: c_uint,
    /// Microseconds since 1970 when the value was read.
    pub timestamp: c_longlong,
    /// How long the read took, in microseconds.
    pub latency_usec: c_longlong,
    /// `nvmlValueType_t` of `value`.
    pub value_type: c_uint,
    /// This entry's result.
    pub nvml_return: NvmlReturn,
    /// The value.
    pub value: Value,
}

/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
pub const FI_DEV_GET_GPU_RECOVERY_ACTION: c_uint = 230;
/// `NVML_VALUE_TYPE_UNSIGNED_INT`.
pub const VALUE_TYPE_UNSIGNED_INT: c_uint = 1;

/// How often a waiting set reads the state file when the state has no change counter: each
/// read parses the whole node state, and every plugin of a test cluster waits all the time; a
/// tenth of a second is quick enough for health events.
const POLL: Duration = Duration::from_millis(100);

/// How long a waiter on the change counter sleeps at most before it reads the state anyway:
/// a writer that does not count the change is noticed this late.
const RECHECK: Duration = Duration::from_secs(1);

/// One GPU's registration in a set.
struct Registration {
    uuid: String,
    mask: u64,
    /// Sequence number of the next event this set may deliver for the GPU.
    cursor: u64,
}

#[derive(Default)]
struct EventSet {
    registrations: Vec<Registration>,
}

/// What the handle's box holds: a serial number, so every live set has its own address.
struct SetTag {
    _serial: u64,
}

static SETS: LazyLock<Mutex<HashMap<usize, Arc<Mutex<EventSet>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_SET: AtomicU64 = AtomicU64::new(0);

fn event_set(set: Handle) -> Result<Arc<Mutex<EventSet>>, NvmlReturn> {
    lock(&SETS)
        .get(&(set as usize))
        .cloned()
        .ok_or(ret::INVALID_ARGUMENT)
}

impl EventSet {
    /// Takes the oldest event of `st`'s log this set has not yet delivered or skipped and
    /// whose type it wants, moving cursors past every event looked at.
    fn next(&mut self, st: &State) -> Option<EventData> {
        let from = self.registrations.iter().map(|r| r.cursor).min()?;
        for e in st.events.since(from) {
            let Some(reg) = self
                .registrations
                .iter_mut()
                .find(|r| r.uuid == e.gpu_uuid && e.seq >= r.cursor)
            else {
                continue;
            };
            reg.cursor = e.seq + 1;
            if e.event_type & reg.mask == 0 {
                continue;
            }
            // A GPU this process does not see (any more) has no handle to report.
            let Some(i) = st.gpu_by_uuid(&e.gpu_uuid) else {
                continue;
            };
            return Some(EventData {
                device: handle(Key::Gpu(i as u32)),
                event_type: e.event_type,
                event_data: e.data,
                gpu_instance_id: e.gpu_instance_id,
                compute_instance_id: e.compute_instance_id,
            });
        }
        None
    }
}

/// `nvmlEventSetCreate`.
///
/// # Safety
/// `set` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut Handle) -> NvmlReturn {
    guard(|| {
        state()?;
        if set.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let tag = Box::new(SetTag {
            _serial: NEXT_SET.fetch_add(1, Ordering::Relaxed),
        });
        let addr = Box::into_raw(tag) as usize;
        lock(&SETS).insert(addr, Arc::new(Mutex::new(EventSet::default())));
        // SAFETY: caller contract (out-parameter), non-null.
        unsafe { put(set, addr as Handle) }
    })
}

/// `nvmlEventSetFree`: frees the set; a waiter still inside `nvmlEventSetWait` finishes on
/// its own copy.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: Handle) -> NvmlReturn {
    guard(|| {
        state()?;
        let addr = set as usize;
        lock(&SETS).remove(&addr).ok_or(ret::INVALID_ARGUMENT)?;
        // SAFETY: `addr` came from `Box::into_raw` in `nvmlEventSetCreate` and was still in
        // the table, from which it has just been removed under the lock: it is freed once.
        drop(unsafe { Box::from_raw(addr as *mut SetTag) });
        Ok(())
    })
}

/// `nvmlDeviceGetSupportedEventTypes` (full GPUs; `NOT_SUPPORTED` for MIG devices).
///
/// # Safety
/// `types` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: Handle,
    types: *mut c_ulonglong,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(types, st.profile.gpus[i].supported_event_types) }
    })
}

/// `nvmlDeviceRegisterEvents`: adds `types` for the GPU to the set. Only events after this
/// call are delivered. `NOT_SUPPORTED` for a type the GPU does not support and for MIG
/// device handles (consumers register on the parent GPU and read the instance IDs).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: Handle,
    types: c_ulonglong,
    set: Handle,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let i = full_gpu(&st, device)?;
        let set = event_set(set)?;
        let spec = &st.profile.gpus[i];
        if types & !spec.supported_event_types != 0 {
            return Err(ret::NOT_SUPPORTED);
        }
        let mut set = lock(&set);
        match set.registrations.iter_mut().find(|r| r.uuid == spec.uuid) {
            Some(r) => r.mask |= types,
            None => set.registrations.push(Registration {
                uuid: spec.uuid.clone(),
                mask: types,
                cursor: st.events.next_seq,
            }),
        }
        Ok(())
    })
}

/// `nvmlEventSetWait_v2`: the next event of the set, or `TIMEOUT` when none arrives within
/// `timeout_ms` milliseconds.
///
/// # Safety
/// `data` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: Handle,
    data: *mut EventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    guard(|| {
        state()?;
        if data.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let set = event_set(set)?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let counter = state_file()?.change_counter();
        loop {
            // Read before the state: a change after this read makes the wait below return
            // at once.
            let seen = counter.as_ref().map(|c| c.value());
            let st = state()?;
            if let Some(e) = lock(&set).next(&st) {
                // SAFETY: caller contract (out-parameter), non-null.
                return unsafe { put(data, e) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ret::TIMEOUT);
            }
            match (&counter, seen) {
                (Some(counter), Some(seen)) => {
                    counter.wait(seen, RECHECK.min(deadline - now));
                }
                _ => std::thread::sleep(POLL.min(deadline - now)),
            }
        }
    })
}

/// `nvmlEventSetWait` (the older name; same behaviour).
///
/// # Safety
/// `data` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: Handle,
    data: *mut EventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlEventSetWait_v2(set, data, timeout_ms) }
}

/// `nvmlDeviceGetFieldValues`: fills each entry by its `fieldId`. Only
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` of a full GPU is simulated; every other entry gets
/// `nvmlReturn = NOT_SUPPORTED` while the call itself succeeds, as NVML reports per field.
///
/// # Safety
/// `values` must be null or valid for reads and writes of `values_count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: Handle,
    values_count: c_int,
    values: *mut FieldValue,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let d = dev(&st, device)?;
        let Ok(count) = usize::try_from(values_count) else {
            return Err(ret::INVALID_ARGUMENT);
        };
        if count > 0 && values.is_null() {
            return Err(ret::INVALID_ARGUMENT);
        }
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|t| t.as_micros() as c_longlong)
            .unwrap_or(0);
        for k in 0..count {
            // SAFETY: `k < values_count` entries the caller said the buffer holds.
            let p = unsafe { values.add(k) };
            // SAFETY: as above; every bit pattern is a valid `FieldValue`.
            let mut v = unsafe { p.read_unaligned() };
            match (&d, v.field_id) {
                (Dev::Gpu(i), FI_DEV_GET_GPU_RECOVERY_ACTION) => {
                    v.timestamp = now_us;
                    v.latency_usec = 0;
                    v.value_type = VALUE_TYPE_UNSIGNED_INT;
                    v.nvml_return = ret::SUCCESS;
                    v.value = Value { ull: 0 };
                    v.value.ui = st.gpus[*i].health.recovery_action.value();
                }
                _ => v.nvml_return = ret::NOT_SUPPORTED,
            }
            // SAFETY: as above.
            unsafe { put(p, v) }?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_nvml_h() {
        assert_eq!(size_of::<EventData>(), 32);
        assert_eq!(offset_of!(EventData, gpu_instance_id), 24);
        assert_eq!(size_of::<FieldValue>(), 40);
        assert_eq!(offset_of!(FieldValue, value_type), 24);
        assert_eq!(offset_of!(FieldValue, value), 32);
    }

    #[test]
    fn foreign_pointers_are_not_event_sets() {
        let x = 0u64;
        assert!(event_set(&x as *const u64 as Handle).is_err());
        assert!(event_set(std::ptr::null_mut()).is_err());
    }
}
