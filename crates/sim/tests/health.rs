//! GPU health through the simulated NVML, as a node plugin's event loop and recovery-action
//! probe see it: faults injected through the state file (the API `gpu-sim` uses) or the
//! `gpu-sim` command itself, read back with `nvml-wrapper` and raw C-ABI calls.

// Raw NVML calls through nvml-wrapper-sys are unsafe by nature.
#![allow(unsafe_code)]

use std::ffi::{CString, c_uint};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpu_dra_sim::health::{HealthError, NO_INSTANCE, RecoveryAction};
use gpu_dra_sim::state::State;
use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings as sys;

const SUCCESS: u32 = sys::nvmlReturn_enum_NVML_SUCCESS;
const INVALID_ARGUMENT: u32 = sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: u32 = sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const TIMEOUT: u32 = sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: u32 = sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const XID: u64 = sys::nvmlEventTypeXidCriticalError as u64;
const DBE: u64 = sys::nvmlEventTypeDoubleBitEccError as u64;
const RECOVERY_ACTION: u32 = sys::field_id::NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;

fn open(host: &SimHost) -> Nvml {
    Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("nvml init")
}

/// Applies a fault through the state file, as `gpu-sim` does.
fn inject<T>(host: &SimHost, f: impl FnOnce(&mut State) -> Result<T, HealthError>) -> T {
    host.state_file()
        .update(f)
        .expect("state file")
        .expect("fault applies")
}

/// Raw `nvmlEventSetWait_v2`.
fn wait(nvml: &Nvml, set: sys::nvmlEventSet_t, ms: u32) -> (u32, sys::nvmlEventData_t) {
    // SAFETY: a set from this library (or a deliberately bad one) and a valid out-pointer.
    unsafe {
        let mut data: sys::nvmlEventData_t = std::mem::zeroed();
        let r = nvml.lib().nvmlEventSetWait_v2(set, &mut data, ms);
        (r, data)
    }
}

fn new_set(nvml: &Nvml) -> sys::nvmlEventSet_t {
    let mut set: sys::nvmlEventSet_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { nvml.lib().nvmlEventSetCreate(&mut set) }, SUCCESS);
    assert!(!set.is_null());
    set
}

fn register(nvml: &Nvml, device: sys::nvmlDevice_t, types: u64, set: sys::nvmlEventSet_t) -> u32 {
    // SAFETY: handles from this library (or deliberately bad ones).
    unsafe { nvml.lib().nvmlDeviceRegisterEvents(device, types, set) }
}

fn handle_by_index(nvml: &Nvml, index: u32) -> (u32, sys::nvmlDevice_t) {
    let mut h: sys::nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let r = unsafe { nvml.lib().nvmlDeviceGetHandleByIndex_v2(index, &mut h) };
    (r, h)
}

/// The address of export `name` of the host's library (already loaded by `Nvml`), for the
/// unversioned names nvml-wrapper-sys does not bind.
fn export(host: &SimHost, name: &str) -> *mut std::ffi::c_void {
    use std::os::unix::ffi::OsStrExt;
    let path = CString::new(host.lib_path().as_os_str().as_bytes()).expect("path");
    let name = CString::new(name).expect("name");
    // SAFETY: NUL-terminated strings; RTLD_NOLOAD only takes another reference on the
    // library `Nvml` loaded, which stays loaded for the test.
    let sym = unsafe {
        let lib = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!lib.is_null(), "library not loaded");
        libc::dlsym(lib, name.as_ptr())
    };
    assert!(!sym.is_null(), "{name:?} not exported");
    sym
}

type WaitFn = unsafe extern "C" fn(sys::nvmlEventSet_t, *mut sys::nvmlEventData_t, c_uint) -> u32;
type ByIndexFn = unsafe extern "C" fn(c_uint, *mut sys::nvmlDevice_t) -> u32;
type ByBusIdFn = unsafe extern "C" fn(*const std::ffi::c_char, *mut sys::nvmlDevice_t) -> u32;

fn gpu_sim(host: &SimHost, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-sim"))
        .args(args)
        .arg("--root")
        .arg(host.root())
        .env_remove("GPU_SIM_GPU")
        .env_remove("GPU_SIM_GI")
        .env_remove("GPU_SIM_CI")
        .output()
        .expect("spawn gpu-sim");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn xid_and_ecc_events_reach_a_registered_set_once() {
    let host = SimHost::new("dgx-h100");
    let nvml = open(&host);
    let d = nvml.device_by_index(2).expect("device");
    let uuid = host.profile().gpus[2].uuid.clone();
    // Before registration: never delivered.
    inject(&host, |s| s.inject_xid(2, 13, None, None));
    assert_eq!(
        d.supported_event_types().expect("types").bits(),
        0x9F,
        "ECC, P-state, XID, clock, power source"
    );
    let set = d
        .register_events(
            EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR,
            nvml.create_event_set().expect("set"),
        )
        .expect("register");
    assert!(matches!(set.wait(0), Err(NvmlError::Timeout)));
    inject(&host, |s| s.inject_xid(2, 48, None, None));
    inject(&host, |s| s.inject_xid(3, 48, None, None));
    inject(&host, |s| s.inject_ecc(2, None));

    let e = set.wait(2000).expect("xid event");
    assert_eq!(e.device.uuid().expect("uuid"), uuid);
    assert_eq!(e.device.index().expect("index"), 2);
    assert_eq!(e.event_type, EventTypes::CRITICAL_XID_ERROR);
    assert_eq!(e.event_data, Some(XidError::Value(48)));
    let e = set.wait(2000).expect("ecc event");
    assert_eq!(e.event_type, EventTypes::DOUBLE_BIT_ECC_ERROR);
    assert_eq!(e.event_data, None);
    // GPU 3's event is not for this set, and each event comes once.
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    set.release_events().expect("free");
}

#[test]
fn each_set_gets_its_own_copy_filtered_by_its_mask() {
    let host = SimHost::new("dgx-h100");
    let nvml = open(&host);
    let (_, gpu0) = handle_by_index(&nvml, 0);
    let (_, gpu1) = handle_by_index(&nvml, 1);
    let a = new_set(&nvml);
    let b = new_set(&nvml);
    assert_ne!(a, b);
    assert_eq!(register(&nvml, gpu0, XID, a), SUCCESS);
    assert_eq!(register(&nvml, gpu0, DBE, b), SUCCESS);
    assert_eq!(register(&nvml, gpu0, XID, b), SUCCESS, "adds to the mask");
    assert_eq!(register(&nvml, gpu1, XID, b), SUCCESS);
    inject(&host, |s| s.inject_ecc(0, None));
    inject(&host, |s| s.inject_xid(1, 48, None, None));
    inject(&host, |s| s.inject_xid(0, 13, None, None));

    let (r, e) = wait(&nvml, a, 2000);
    assert_eq!(r, SUCCESS);
    assert_eq!(
        (e.device, e.eventType, e.eventData),
        (gpu0, XID, 13),
        "ECC filtered out"
    );
    assert_eq!(
        (e.gpuInstanceId, e.computeInstanceId),
        (NO_INSTANCE, NO_INSTANCE)
    );
    assert_eq!(wait(&nvml, a, 0).0, TIMEOUT);

    let got: Vec<(sys::nvmlDevice_t, u64, u64)> = (0..3)
        .map(|_| {
            let (r, e) = wait(&nvml, b, 2000);
            assert_eq!(r, SUCCESS);
            (e.device, e.eventType, e.eventData)
        })
        .collect();
    assert_eq!(got, [(gpu0, DBE, 0), (gpu1, XID, 48), (gpu0, XID, 13)]);
    assert_eq!(wait(&nvml, b, 0).0, TIMEOUT);

    // SAFETY: sets from this library, freed once; then deliberately stale or bad arguments.
    unsafe {
        let lib = nvml.lib();
        assert_eq!(lib.nvmlEventSetFree(a), SUCCESS);
        assert_eq!(lib.nvmlEventSetFree(a), INVALID_ARGUMENT);
        assert_eq!(wait(&nvml, a, 0).0, INVALID_ARGUMENT);
        assert_eq!(register(&nvml, gpu0, XID, a), INVALID_ARGUMENT);
        assert_eq!(
            lib.nvmlEventSetWait_v2(b, std::ptr::null_mut(), 0),
            INVALID_ARGUMENT
        );
        assert_eq!(lib.nvmlEventSetFree(std::ptr::null_mut()), INVALID_ARGUMENT);
        assert_eq!(
            lib.nvmlEventSetCreate(std::ptr::null_mut()),
            INVALID_ARGUMENT
        );
        // The older wait has the same behaviour.
        inject(&host, |s| s.inject_xid(1, 94, None, None));
        let wait_v1: WaitFn = std::mem::transmute(export(&host, "nvmlEventSetWait"));
        let mut e: sys::nvmlEventData_t = std::mem::zeroed();
        assert_eq!(wait_v1(b, &mut e, 2000), SUCCESS);
        assert_eq!((e.device, e.eventData), (gpu1, 94));
        assert_eq!(lib.nvmlEventSetFree(b), SUCCESS);
    }
}

#[test]
fn mig_scoped_events_carry_instance_ids_on_the_parent() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    let (_, gpu0) = handle_by_index(&nvml, 0);
    let mut mig: sys::nvmlDevice_t = std::ptr::null_mut();
    let mut types = 0u64;
    // SAFETY: handles from this library, valid out-pointers.
    unsafe {
        let lib = nvml.lib();
        assert_eq!(
            lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 0, &mut mig),
            SUCCESS
        );
        assert_eq!(
            lib.nvmlDeviceGetSupportedEventTypes(mig, &mut types),
            NOT_SUPPORTED
        );
        assert_eq!(
            lib.nvmlDeviceGetSupportedEventTypes(gpu0, &mut types),
            SUCCESS
        );
    }
    assert_eq!(types, 0x9F);
    let set = new_set(&nvml);
    assert_eq!(
        register(&nvml, mig, XID, set),
        NOT_SUPPORTED,
        "register on the parent"
    );
    assert_eq!(
        register(&nvml, gpu0, sys::nvmlEventMigConfigChange as u64, set),
        NOT_SUPPORTED,
        "not among the supported types"
    );
    assert_eq!(register(&nvml, gpu0, XID | DBE, set), SUCCESS);
    // GPU 0 boots with GIs 1, 6, 11, 12 (CI 0 each).
    inject(&host, |s| s.inject_xid(0, 31, Some((6, 0)), None));
    inject(&host, |s| s.inject_ecc(0, Some((11, 0))));
    inject(&host, |s| s.inject_xid(0, 48, None, None));
    let got: Vec<(sys::nvmlDevice_t, u64, u64, u32, u32)> = (0..3)
        .map(|_| {
            let (r, e) = wait(&nvml, set, 2000);
            assert_eq!(r, SUCCESS);
            (
                e.device,
                e.eventType,
                e.eventData,
                e.gpuInstanceId,
                e.computeInstanceId,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (gpu0, XID, 31, 6, 0),
            (gpu0, DBE, 0, 11, 0),
            (gpu0, XID, 48, NO_INSTANCE, NO_INSTANCE)
        ]
    );
}

#[test]
fn wait_times_out_or_returns_as_soon_as_an_event_arrives() {
    let host = SimHost::new("t4");
    let nvml = open(&host);
    let (_, gpu0) = handle_by_index(&nvml, 0);
    let set = new_set(&nvml);
    assert_eq!(register(&nvml, gpu0, XID, set), SUCCESS);
    let start = Instant::now();
    assert_eq!(wait(&nvml, set, 200).0, TIMEOUT);
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(200), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // A waiter blocked in another thread sees an event injected while it waits.
    let set_addr = set as usize;
    let waiter_nvml = &nvml;
    std::thread::scope(|s| {
        let waiter = s.spawn(move || {
            let start = Instant::now();
            let (r, e) = wait(waiter_nvml, set_addr as sys::nvmlEventSet_t, 20_000);
            (r, e.eventData, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        inject(&host, |s| s.inject_xid(0, 62, None, None));
        let (r, data, took) = waiter.join().expect("waiter");
        assert_eq!((r, data), (SUCCESS, 62));
        assert!(took < Duration::from_secs(15), "returned early: {took:?}");
    });
}

#[test]
fn a_gpu_fallen_off_the_bus_is_lost_until_reset() {
    let host = SimHost::new("dgx-h100");
    let nvml = open(&host);
    let spec = host.profile().gpus[5].clone();
    let (_, gpu5) = handle_by_index(&nvml, 5);
    let set = new_set(&nvml);
    assert_eq!(register(&nvml, gpu5, XID, set), SUCCESS);

    let (code, out, err) = gpu_sim(&host, &["fall-off-bus", "--gpu", &spec.uuid]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("GPU 5 (GPU-") && out.contains("fell off the bus"),
        "{out}"
    );
    let (r, e) = wait(&nvml, set, 2000);
    assert_eq!(r, SUCCESS, "the waiter sees the fall");
    assert_eq!((e.device, e.eventType, e.eventData), (gpu5, XID, 79));

    let uuid = CString::new(spec.uuid.clone()).expect("uuid");
    let long = CString::new(spec.pci_bus_id.clone()).expect("bus id");
    // SAFETY: valid C strings, buffers and out-pointers; `gpu5` is a handle from before.
    unsafe {
        let lib = nvml.lib();
        let mut h: sys::nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(handle_by_index(&nvml, 5).0, GPU_IS_LOST);
        let by_index: ByIndexFn = std::mem::transmute(export(&host, "nvmlDeviceGetHandleByIndex"));
        assert_eq!(by_index(5, &mut h), GPU_IS_LOST);
        assert_eq!(
            lib.nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut h),
            GPU_IS_LOST
        );
        assert_eq!(
            lib.nvmlDeviceGetHandleByPciBusId_v2(long.as_ptr(), &mut h),
            GPU_IS_LOST
        );
        let by_bus: ByBusIdFn = std::mem::transmute(export(&host, "nvmlDeviceGetHandleByPciBusId"));
        assert_eq!(by_bus(long.as_ptr(), &mut h), GPU_IS_LOST);
        let mut buf = [0 as std::ffi::c_char; 96];
        assert_eq!(
            lib.nvmlDeviceGetUUID(gpu5, buf.as_mut_ptr(), 96),
            GPU_IS_LOST
        );
        let mut mode: c_uint = 0;
        assert_eq!(lib.nvmlDeviceGetComputeMode(gpu5, &mut mode), GPU_IS_LOST);
        assert_eq!(register(&nvml, gpu5, XID, set), GPU_IS_LOST);
        let mut n: c_uint = 0;
        assert_eq!(lib.nvmlDeviceGetCount_v2(&mut n), SUCCESS);
        assert_eq!(n, 8, "a lost GPU is still counted");
        assert_eq!(handle_by_index(&nvml, 4).0, SUCCESS, "the others are fine");
    }
    assert!(matches!(nvml.device_by_index(5), Err(NvmlError::GpuLost)));
    assert_eq!(
        host.state().gpus[5].health.recovery_action,
        RecoveryAction::Reboot
    );

    let (code, _, err) = gpu_sim(&host, &["ecc", "--gpu", "5"]);
    assert_ne!(code, 0);
    assert!(err.contains("GPU 5 is lost"), "{err}");
    let (code, out, err) = gpu_sim(&host, &["reset", "--gpu", "5"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reset"), "{out}");
    let d = nvml.device_by_index(5).expect("back after reset");
    assert_eq!(d.uuid().expect("uuid"), spec.uuid);
    let v = d
        .field_values_for(&[FieldId(RECOVERY_ACTION)])
        .expect("fields");
    assert!(matches!(
        v[0].as_ref().expect("sample").value,
        Ok(SampleValue::U32(0))
    ));
    assert_eq!(
        wait(&nvml, set, 0).0,
        TIMEOUT,
        "the fall was delivered once"
    );
}

fn recovery_action(d: &nvml_wrapper::Device<'_>) -> u32 {
    let v = d
        .field_values_for(&[FieldId(RECOVERY_ACTION)])
        .expect("call");
    match v[0].as_ref().expect("sample").value {
        Ok(SampleValue::U32(a)) => a,
        ref other => panic!("recovery action: {other:?}"),
    }
}

#[test]
fn the_recovery_action_field_follows_the_faults() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    let d = nvml.device_by_index(1).expect("device");
    let v = d
        .field_values_for(&[
            FieldId(RECOVERY_ACTION),
            FieldId(sys::field_id::NVML_FI_DEV_ECC_CURRENT),
        ])
        .expect("call succeeds");
    let sample = v[0].as_ref().expect("sample");
    assert!(matches!(sample.value, Ok(SampleValue::U32(0))));
    let now_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    assert!(
        (now_us - sample.timestamp).abs() < 60_000_000,
        "timestamp {} is microseconds since the epoch",
        sample.timestamp
    );
    assert!(matches!(
        v[1].as_ref().expect("sample").value,
        Err(NvmlError::NotSupported)
    ));

    let steps: [(&[&str], u32); 6] = [
        (&["xid", "--gpu", "1", "48"], 1),
        (&["xid", "--gpu", "1", "13"], 0),
        (
            &["xid", "--gpu", "1", "--recovery", "drain-and-reset", "45"],
            4,
        ),
        (&["xid", "--gpu", "1", "--recovery", "drain-p2p", "74"], 3),
        (&["ecc", "--gpu", "1"], 1),
        (&["reset", "--gpu", "1"], 0),
    ];
    for (args, want) in steps {
        let (code, out, err) = gpu_sim(&host, args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_eq!(out.lines().count(), 1, "{out}");
        assert_eq!(recovery_action(&d), want, "after {args:?}");
    }
    assert_eq!(host.state().gpus[1].health.volatile_uncorrectable_ecc, 0);

    // Raw: bad counts, and a MIG device handle (the field is per GPU).
    let (_, gpu0) = handle_by_index(&nvml, 0);
    // SAFETY: handles from this library; buffers of the stated length or deliberately null.
    unsafe {
        let lib = nvml.lib();
        let mut f: sys::nvmlFieldValue_t = std::mem::zeroed();
        f.fieldId = RECOVERY_ACTION;
        assert_eq!(
            lib.nvmlDeviceGetFieldValues(gpu0, -1, &mut f),
            INVALID_ARGUMENT
        );
        assert_eq!(
            lib.nvmlDeviceGetFieldValues(gpu0, 1, std::ptr::null_mut()),
            INVALID_ARGUMENT
        );
        assert_eq!(lib.nvmlDeviceGetFieldValues(gpu0, 1, &mut f), SUCCESS);
        assert_eq!(
            (f.nvmlReturn, f.valueType),
            (
                SUCCESS,
                sys::nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT
            )
        );
        let mut mig: sys::nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 0, &mut mig),
            SUCCESS
        );
        let mut f: sys::nvmlFieldValue_t = std::mem::zeroed();
        f.fieldId = RECOVERY_ACTION;
        assert_eq!(lib.nvmlDeviceGetFieldValues(mig, 1, &mut f), SUCCESS);
        assert_eq!(f.nvmlReturn, NOT_SUPPORTED);
    }
}

#[test]
fn gpu_sim_fault_commands_explain_what_is_wrong() {
    let host = SimHost::new("dgx-a100-40gb");
    let uuid = host.profile().gpus[0].uuid.clone();
    let (code, out, err) = gpu_sim(
        &host,
        &["xid", "--gpu", &uuid, "--gi", "6", "--ci", "0", "31"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        format!(
            "XID 31 on GPU 0 ({uuid}) (GPU instance 6, compute instance 0): event 0, recovery action none\n"
        )
    );
    let cases: [(&[&str], &str); 6] = [
        (&["xid", "--gpu", "8", "48"], "no GPU \"8\""),
        (
            &["ecc", "--gpu", "GPU-00000000-0000-0000-0000-000000000000"],
            "no GPU",
        ),
        (
            &["xid", "--gpu", "0", "--gi", "2", "--ci", "0", "48"],
            "has no MIG device with GPU instance 2",
        ),
        (
            &["ecc", "--gpu", "5", "--gi", "1", "--ci", "0"],
            "existing: none",
        ),
        (&["xid", "--gpu", "0", "--gi", "6", "48"], "--ci"),
        (
            &["xid", "--gpu", "0", "--recovery", "later", "48"],
            "drain-and-reset",
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = gpu_sim(&host, args);
        assert_ne!(code, 0, "{args:?} must fail: {out}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let (code, _, err) = gpu_sim(&host, &["fall-off-bus", "--gpu", "7"]);
    assert_eq!(code, 0, "{err}");
    for args in [
        &["xid", "--gpu", "7", "48"][..],
        &["ecc", "--gpu", "7"],
        &["fall-off-bus", "--gpu", "7"],
    ] {
        let (code, _, err) = gpu_sim(&host, args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains("GPU 7 is lost"), "{args:?}: {err}");
    }
    let st = host.state();
    assert_eq!(
        st.events.next_seq, 2,
        "only the successful commands recorded events"
    );
}
