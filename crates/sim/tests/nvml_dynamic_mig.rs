//! Creating and destroying GPU and compute instances through the simulator's NVML, as the
//! DRA driver's dynamic MIG does at prepare and unprepare: placement rules of the A100-40GB
//! table, the refusals and their codes, destroy order, what the MIG-device calls and the
//! capability files show afterwards.

// Raw NVML calls through nvml-wrapper-sys are unsafe by nature.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_uint};

use gpu_dra_sim::mig;
use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings as sys;

const SUCCESS: u32 = 0;
const INVALID_ARGUMENT: u32 = 2;
const NOT_SUPPORTED: u32 = 3;
const NO_PERMISSION: u32 = 4;
const IN_USE: u32 = 19;
const INSUFFICIENT_RESOURCES: u32 = 23;

/// GPU 4 of `dgx-a100-40gb`: MIG capable, MIG off at boot, minor 4.
const GPU: u32 = 4;

fn open(host: &SimHost) -> Nvml {
    Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("nvml init")
}

fn create_gi(
    nvml: &Nvml,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<sys::nvmlGpuInstance_t, u32> {
    let d = nvml.device_by_index(GPU).expect("device");
    let placement = sys::nvmlGpuInstancePlacement_t { start, size };
    let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: a device handle of this library, a valid placement and out-pointer.
    let r = unsafe {
        nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement(
            d.handle(),
            profile_id,
            &placement,
            &mut gi,
        )
    };
    if r == SUCCESS { Ok(gi) } else { Err(r) }
}

fn gi_info(nvml: &Nvml, gi: sys::nvmlGpuInstance_t) -> sys::nvmlGpuInstanceInfo_t {
    // SAFETY: a GPU-instance handle of this library and a zeroed out-struct of the C type.
    unsafe {
        let mut info: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
        assert_eq!(nvml.lib().nvmlGpuInstanceGetInfo(gi, &mut info), SUCCESS);
        info
    }
}

fn create_ci(
    nvml: &Nvml,
    gi: sys::nvmlGpuInstance_t,
    profile: u32,
) -> Result<sys::nvmlComputeInstance_t, u32> {
    let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: a GPU-instance handle of this library and a valid out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci)
    };
    if r == SUCCESS { Ok(ci) } else { Err(r) }
}

/// The UUID of the MIG device behind compute instance `ci`, as the DRA driver reads it.
fn ci_uuid(
    nvml: &Nvml,
    ci: sys::nvmlComputeInstance_t,
) -> (sys::nvmlComputeInstanceInfo_t, String) {
    // SAFETY: handles of this library; zeroed out-struct; a 96-byte UUID buffer.
    unsafe {
        let mut info: sys::nvmlComputeInstanceInfo_t = std::mem::zeroed();
        assert_eq!(
            nvml.lib().nvmlComputeInstanceGetInfo_v2(ci, &mut info),
            SUCCESS
        );
        let mut buf = [0 as c_char; 96];
        assert_eq!(
            nvml.lib()
                .nvmlDeviceGetUUID(info.device, buf.as_mut_ptr(), 96),
            SUCCESS
        );
        let uuid = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
        (info, uuid)
    }
}

fn gi_capacity(nvml: &Nvml, profile_id: u32) -> Result<u32, u32> {
    let d = nvml.device_by_index(GPU).expect("device");
    let mut n: c_uint = 99;
    // SAFETY: a device handle of this library and a valid out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuInstanceRemainingCapacity(d.handle(), profile_id, &mut n)
    };
    if r == SUCCESS { Ok(n) } else { Err(r) }
}

fn enable_mig(host: &SimHost) {
    host.update_state(|s| s.set_mig_mode(GPU as usize, true).expect("enable MIG"));
}

#[test]
fn a100_placements_combine_and_overlaps_are_refused() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    assert_eq!(
        create_gi(&nvml, 9, 4, 4).err(),
        Some(NOT_SUPPORTED),
        "MIG off"
    );
    assert_eq!(gi_capacity(&nvml, 9), Err(NOT_SUPPORTED));
    enable_mig(&host);
    assert_eq!(gi_capacity(&nvml, 19), Ok(7));

    // 3g.20gb@4 + 2g.10gb@0 + 1g.5gb@2: the slices 0-1, 2, 4-7 (A100-40GB table).
    let g3 = create_gi(&nvml, 9, 4, 4).expect("3g.20gb at 4");
    let g2 = create_gi(&nvml, 14, 0, 2).expect("2g.10gb at 0");
    let g1 = create_gi(&nvml, 19, 2, 1).expect("1g.5gb at 2");
    for (gi, profile, start, size) in [(g3, 9, 4, 4), (g2, 14, 0, 2), (g1, 19, 2, 1)] {
        let info = gi_info(&nvml, gi);
        assert_eq!(info.profileId, profile);
        assert_eq!((info.placement.start, info.placement.size), (start, size));
    }
    // Slice 3 is the only one left.
    assert_eq!(gi_capacity(&nvml, 19), Ok(1));
    assert_eq!(gi_capacity(&nvml, 14), Ok(0));
    assert_eq!(gi_capacity(&nvml, 9), Ok(0));

    // Overlap: slice 4 is the 3g's, 2-3 hold the 1g at 2.
    assert_eq!(
        create_gi(&nvml, 19, 4, 1).err(),
        Some(INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        create_gi(&nvml, 14, 2, 2).err(),
        Some(INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        create_gi(&nvml, 0, 0, 8).err(),
        Some(INSUFFICIENT_RESOURCES)
    );
    // Starts the profile does not have, a wrong size, a profile the GPU does not offer.
    assert_eq!(create_gi(&nvml, 14, 1, 2).err(), Some(INVALID_ARGUMENT));
    assert_eq!(create_gi(&nvml, 9, 2, 4).err(), Some(INVALID_ARGUMENT));
    assert_eq!(create_gi(&nvml, 19, 3, 2).err(), Some(INVALID_ARGUMENT));
    assert_eq!(create_gi(&nvml, 99, 0, 1).err(), Some(INVALID_ARGUMENT));
    // Nothing refused was written.
    assert_eq!(host.state().gpus[GPU as usize].gpu_instances.len(), 3);

    // Without a placement the driver picks: the last free slice.
    let d = nvml.device_by_index(GPU).expect("device");
    let mut auto: sys::nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: a device handle of this library and a valid out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlDeviceCreateGpuInstance(d.handle(), 19, &mut auto)
    };
    assert_eq!(r, SUCCESS);
    assert_eq!(gi_info(&nvml, auto).placement.start, 3);
    // SAFETY: as above.
    let r = unsafe {
        nvml.lib()
            .nvmlDeviceCreateGpuInstance(d.handle(), 19, &mut auto)
    };
    assert_eq!(r, INSUFFICIENT_RESOURCES, "the GPU is full");

    // A GPU without MIG refuses with NOT_SUPPORTED, as for a disabled mode.
    let t4 = SimHost::new("t4");
    let nvml4 = open(&t4);
    let d = nvml4.device_by_index(0).expect("t4");
    let placement = sys::nvmlGpuInstancePlacement_t { start: 0, size: 1 };
    // SAFETY: a device handle of this library, a valid placement and out-pointer.
    let r = unsafe {
        nvml4
            .lib()
            .nvmlDeviceCreateGpuInstanceWithPlacement(d.handle(), 19, &placement, &mut auto)
    };
    assert_eq!(r, NOT_SUPPORTED);
}

#[test]
fn new_instances_are_mig_devices_with_capability_files() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    enable_mig(&host);
    let d = nvml.device_by_index(GPU).expect("device");
    assert!(d.mig_device_by_index(0).is_err(), "no MIG device yet");
    let gi = create_gi(&nvml, 9, 4, 4).expect("3g.20gb at 4");
    let gi_id = gi_info(&nvml, gi).id;
    assert!(
        d.mig_device_by_index(0).is_err(),
        "a GPU instance alone is no MIG device"
    );
    let ci = create_ci(&nvml, gi, 2).expect("default CI of a 3g");
    let (info, uuid) = ci_uuid(&nvml, ci);
    assert_eq!(info.gpuInstance, gi);
    assert_eq!((info.id, info.profileId), (0, 2));
    assert_eq!((info.placement.start, info.placement.size), (0, 3));
    assert!(uuid.starts_with("MIG-"), "{uuid}");

    // The existing MIG-device paths see it.
    let m = d.mig_device_by_index(0).expect("MIG device 0");
    assert_eq!(m.uuid().expect("uuid"), uuid);
    // SAFETY: the raw handle is only compared, never used.
    assert_eq!(unsafe { m.handle() }, info.device);
    assert_eq!(m.name().expect("name"), "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
    assert_eq!(m.attributes().expect("attributes").multiprocessor_count, 42);
    let by_uuid = nvml.device_by_uuid(uuid.as_str()).expect("by UUID");
    // SAFETY: the raw handle is only compared, never used.
    assert_eq!(unsafe { by_uuid.handle() }, info.device);
    assert_eq!(
        host.state().mig_by_uuid(&uuid),
        Some((GPU as usize, gi_id, 0))
    );

    // Capability files and device nodes, as after `nvidia-smi mig -cgi 9:4 -C`.
    let caps = host.root().join(format!(
        "proc/driver/nvidia/capabilities/gpu{GPU}/mig/gi{gi_id}"
    ));
    let gi_minor = mig::gi_cap_minor(GPU, gi_id);
    let ci_minor = mig::ci_cap_minor(GPU, gi_id, 0);
    assert_eq!(
        std::fs::read_to_string(caps.join("access")).expect("gi access"),
        format!("DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    );
    assert_eq!(
        std::fs::read_to_string(caps.join("ci0/access")).expect("ci access"),
        format!("DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    );
    for minor in [gi_minor, ci_minor] {
        let node = host
            .root()
            .join(format!("dev/nvidia-caps/nvidia-cap{minor}"));
        assert!(node.exists(), "{}", node.display());
    }

    // A second full-size CI does not fit; a CI profile the 3g does not offer (4c) is invalid.
    assert_eq!(create_ci(&nvml, gi, 2).err(), Some(INSUFFICIENT_RESOURCES));
    assert_eq!(create_ci(&nvml, gi, 3).err(), Some(INVALID_ARGUMENT));
    let mut handles = [std::ptr::null_mut(); 1];
    let mut n: c_uint = 0;
    // SAFETY: a GI handle of this library; the buffer holds the profile's instanceCount (1).
    let r = unsafe {
        nvml.lib()
            .nvmlGpuInstanceGetComputeInstances(gi, 2, handles.as_mut_ptr(), &mut n)
    };
    assert_eq!((r, n), (SUCCESS, 1));
    assert_eq!(handles[0], ci);
}

#[test]
fn destroy_order_is_compute_then_gpu_instance_and_a_recreated_device_has_a_new_uuid() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    enable_mig(&host);
    let gi = create_gi(&nvml, 14, 2, 2).expect("2g.10gb at 2");
    let gi_id = gi_info(&nvml, gi).id;
    let ci = create_ci(&nvml, gi, 1).expect("default CI of a 2g");
    let (_, first) = ci_uuid(&nvml, ci);

    // SAFETY: handles of this library.
    unsafe {
        assert_eq!(
            nvml.lib().nvmlGpuInstanceDestroy(gi),
            IN_USE,
            "CI still there"
        );
        assert_eq!(nvml.lib().nvmlComputeInstanceDestroy(ci), SUCCESS);
        assert_eq!(
            nvml.lib().nvmlComputeInstanceDestroy(ci),
            INVALID_ARGUMENT,
            "a destroyed compute instance's handle is stale"
        );
        assert_eq!(nvml.lib().nvmlGpuInstanceDestroy(gi), SUCCESS);
        assert_eq!(nvml.lib().nvmlGpuInstanceDestroy(gi), INVALID_ARGUMENT);
    }
    let caps = host.root().join(format!(
        "proc/driver/nvidia/capabilities/gpu{GPU}/mig/gi{gi_id}"
    ));
    assert!(!caps.exists(), "capability files go with the instance");
    let node = host.root().join(format!(
        "dev/nvidia-caps/nvidia-cap{}",
        mig::gi_cap_minor(GPU, gi_id)
    ));
    assert!(!node.exists());
    assert!(host.state().gpus[GPU as usize].gpu_instances.is_empty());

    let gi = create_gi(&nvml, 14, 2, 2).expect("again");
    let ci = create_ci(&nvml, gi, 1).expect("CI again");
    let (_, second) = ci_uuid(&nvml, ci);
    assert_ne!(first, second, "a recreated MIG device gets a new UUID");
    assert!(nvml.device_by_uuid(first.as_str()).is_err());
}

#[test]
fn smaller_compute_instances_fill_their_gpu_instance() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    enable_mig(&host);
    let gi = create_gi(&nvml, 9, 0, 4).expect("3g.20gb at 0");
    let capacity = |profile: u32| {
        let mut n: c_uint = 99;
        // SAFETY: a GI handle of this library and a valid out-pointer.
        let r = unsafe {
            nvml.lib()
                .nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, profile, &mut n)
        };
        (r, n)
    };
    assert_eq!(capacity(0), (SUCCESS, 3));
    let a = create_ci(&nvml, gi, 0).expect("1c");
    let placement = sys::nvmlComputeInstancePlacement_t { start: 2, size: 1 };
    let mut b: sys::nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: a GI handle of this library, a valid placement and out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi, 0, &placement, &mut b)
    };
    assert_eq!(r, SUCCESS);
    assert_eq!(capacity(0), (SUCCESS, 1));
    assert_eq!(capacity(2).1, 0, "no room for the full-size CI");
    let (ia, _) = ci_uuid(&nvml, a);
    let (ib, _) = ci_uuid(&nvml, b);
    assert_eq!((ia.id, ia.placement.start), (0, 0));
    assert_eq!((ib.id, ib.placement.start), (1, 2));
    let d = nvml.device_by_index(GPU).expect("device");
    let m = d.mig_device_by_index(1).expect("second MIG device");
    assert_eq!(
        m.name().expect("name"),
        "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb"
    );
    assert_eq!(m.attributes().expect("attributes").multiprocessor_count, 14);
}

#[test]
fn a_process_that_does_not_see_every_device_may_not_change_the_layout() {
    let host = SimHost::new("dgx-a100-40gb");
    enable_mig(&host);
    // As in a container given some GPUs only: GPU 7's node is missing from this view.
    std::fs::remove_file(host.root().join("dev/nvidia7")).expect("remove node");
    let nvml = open(&host);
    assert_eq!(create_gi(&nvml, 9, 4, 4).err(), Some(NO_PERMISSION));
    assert!(host.state().gpus[GPU as usize].gpu_instances.is_empty());
}
