//! The simulator library as the driver sees it: loaded with `nvml-wrapper` from a simulated
//! root, checked against exact expected values for every profile, plus raw C-ABI calls for
//! the MIG functions nvml-wrapper does not wrap, layouts and error codes.

// Raw NVML calls through nvml-wrapper-sys are unsafe by nature.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_uint};
use std::mem::{offset_of, size_of};

use gpu_dra_sim::ffi;
use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Brand, ComputeMode};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as sys;

fn open(host: &SimHost) -> Nvml {
    Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("nvml init")
}

struct Want {
    profile: &'static str,
    count: u32,
    name: &'static str,
    memory_mib: u64,
    cc: (i32, i32),
    arch: DeviceArchitecture,
    brand: Brand,
    buses: &'static [&'static str],
    numa: &'static [u32],
    mig_capable: bool,
    mig_enabled_first: u32,
}

const DGX_BUSES: &[&str] = &[
    "00000000:07:00.0",
    "00000000:0F:00.0",
    "00000000:47:00.0",
    "00000000:4E:00.0",
    "00000000:87:00.0",
    "00000000:90:00.0",
    "00000000:B7:00.0",
    "00000000:BD:00.0",
];
const DGX_NUMA: &[u32] = &[0, 0, 0, 0, 1, 1, 1, 1];
/// The DGX A100 in NPS4 mode, as its real `nvidia-smi topo -m` shows.
const DGX_A100_NUMA: &[u32] = &[3, 3, 1, 1, 7, 7, 5, 5];

fn wants() -> Vec<Want> {
    vec![
        Want {
            profile: "t4",
            count: 1,
            name: "Tesla T4",
            memory_mib: 15360,
            cc: (7, 5),
            arch: DeviceArchitecture::Turing,
            brand: Brand::Nvidia,
            buses: &["00000000:00:04.0"],
            numa: &[0],
            mig_capable: false,
            mig_enabled_first: 0,
        },
        Want {
            profile: "p4",
            count: 1,
            name: "Tesla P4",
            memory_mib: 7680,
            cc: (6, 1),
            arch: DeviceArchitecture::Pascal,
            brand: Brand::Nvidia,
            buses: &["00000000:00:05.0"],
            numa: &[0],
            mig_capable: false,
            mig_enabled_first: 0,
        },
        Want {
            profile: "rtx4090",
            count: 1,
            name: "NVIDIA GeForce RTX 4090",
            memory_mib: 24564,
            cc: (8, 9),
            arch: DeviceArchitecture::Ada,
            brand: Brand::GeForce,
            buses: &["00000000:01:00.0"],
            numa: &[0],
            mig_capable: false,
            mig_enabled_first: 0,
        },
        Want {
            profile: "dgx-a100-40gb",
            count: 8,
            name: "NVIDIA A100-SXM4-40GB",
            memory_mib: 40960,
            cc: (8, 0),
            arch: DeviceArchitecture::Ampere,
            brand: Brand::Nvidia,
            buses: DGX_BUSES,
            numa: DGX_A100_NUMA,
            mig_capable: true,
            mig_enabled_first: 4,
        },
        Want {
            profile: "dgx-h100",
            count: 8,
            name: "NVIDIA H100 80GB HBM3",
            memory_mib: 81559,
            cc: (9, 0),
            arch: DeviceArchitecture::Hopper,
            brand: Brand::Nvidia,
            buses: DGX_BUSES,
            numa: DGX_NUMA,
            mig_capable: true,
            mig_enabled_first: 0,
        },
        Want {
            profile: "h200",
            count: 1,
            name: "NVIDIA H200",
            memory_mib: 143771,
            cc: (9, 0),
            arch: DeviceArchitecture::Hopper,
            brand: Brand::Nvidia,
            buses: &["00000000:19:00.0"],
            numa: &[0],
            mig_capable: true,
            mig_enabled_first: 0,
        },
    ]
}

#[test]
fn every_profile_answers_exact_values() {
    for w in wants() {
        let host = SimHost::new(w.profile);
        let nvml = open(&host);
        let p = w.profile;
        assert_eq!(
            nvml.sys_driver_version().expect("driver"),
            "580.95.05",
            "{p}"
        );
        assert_eq!(
            nvml.sys_nvml_version().expect("nvml"),
            "13.580.95.05",
            "{p}"
        );
        assert_eq!(nvml.sys_cuda_driver_version().expect("cuda"), 13000, "{p}");
        assert_eq!(nvml.device_count().expect("count"), w.count, "{p}");
        for i in 0..w.count {
            let d = nvml.device_by_index(i).expect("device");
            let spec = &host.profile().gpus[i as usize];
            assert_eq!(d.name().expect("name"), w.name, "{p}");
            assert_eq!(d.uuid().expect("uuid"), spec.uuid, "{p}");
            assert_eq!(d.index().expect("index"), i, "{p}");
            assert_eq!(d.minor_number().expect("minor"), i, "{p}");
            assert_eq!(d.brand().expect("brand"), w.brand, "{p}");
            assert_eq!(d.architecture().expect("arch"), w.arch, "{p}");
            let cc = d.cuda_compute_capability().expect("cc");
            assert_eq!((cc.major, cc.minor), w.cc, "{p}");
            let mem = d.memory_info().expect("memory");
            assert_eq!(mem.total, w.memory_mib * 1024 * 1024, "{p}");
            let pci = d.pci_info().expect("pci");
            assert_eq!(pci.bus_id, w.buses[i as usize], "{p}");
            assert_eq!(pci.domain, 0);
            assert_eq!(
                format!("{:02X}", pci.bus),
                &w.buses[i as usize][9..11],
                "{p}"
            );
            assert_eq!(d.numa_node_id().expect("numa"), w.numa[i as usize], "{p}");
            assert_eq!(d.compute_mode().expect("mode"), ComputeMode::Default, "{p}");
            assert!(!d.mig_is_mig_device_handle().expect("is mig"), "{p}");
            let by_uuid = nvml.device_by_uuid(spec.uuid.as_str()).expect("by uuid");
            assert_eq!(by_uuid.index().expect("index"), i);
            let by_pci = nvml
                .device_by_pci_bus_id(w.buses[i as usize])
                .expect("by pci");
            assert_eq!(by_pci.index().expect("index"), i);
            match d.mig_mode() {
                Ok(m) => {
                    assert!(w.mig_capable, "{p}");
                    let on = u32::from(i < w.mig_enabled_first);
                    assert_eq!((m.current, m.pending), (on, on), "{p} gpu {i}");
                }
                Err(NvmlError::NotSupported) => assert!(!w.mig_capable, "{p}"),
                Err(e) => panic!("{p}: mig_mode: {e}"),
            }
        }
        assert!(matches!(
            nvml.device_by_index(w.count),
            Err(NvmlError::InvalidArg)
        ));
        assert!(matches!(
            nvml.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000"),
            Err(NvmlError::NotFound)
        ));
    }
}

#[test]
fn serial_is_not_supported_on_geforce() {
    let host = SimHost::new("rtx4090");
    let nvml = open(&host);
    let d = nvml.device_by_index(0).expect("device");
    assert!(matches!(d.serial(), Err(NvmlError::NotSupported)));
    let host = SimHost::new("t4");
    let nvml = open(&host);
    let d = nvml.device_by_index(0).expect("device");
    assert_eq!(d.serial().expect("serial"), "1321020000001");
}

#[test]
fn dgx_a100_mig_devices_walk_like_the_nvidia_driver() {
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    let state = host.state();
    let lib = nvml.lib();
    let mut total = 0;
    for i in 0..8u32 {
        let d = nvml.device_by_index(i).expect("device");
        let max = d.mig_device_count().expect("max");
        if i >= 4 {
            assert_eq!(max, 0);
            continue;
        }
        assert_eq!(max, 7);
        // Ascending GI ID: 3g.20gb (GI 1 @4), 2g.10gb (GI 6 @2), 1g.5gb (GI 11 @0), 1g.5gb (GI 12 @1).
        let want = [
            ("3g.20gb", 1, 9, 4, 4, 19968, 42, 3, 2, 3),
            ("2g.10gb", 6, 14, 2, 2, 9856, 28, 2, 1, 2),
            ("1g.5gb", 11, 19, 0, 1, 4864, 14, 1, 0, 1),
            ("1g.5gb", 12, 19, 1, 1, 4864, 14, 1, 0, 1),
        ];
        for (k, (pname, gi, pid, start, size, mem, sm, ce, dec, slices)) in
            want.into_iter().enumerate()
        {
            let m = d.mig_device_by_index(k as u32).expect("mig device");
            assert!(m.mig_is_mig_device_handle().expect("is mig"));
            assert_eq!(
                m.name().expect("name"),
                format!("NVIDIA A100-SXM4-40GB MIG {pname}")
            );
            let uuid = m.uuid().expect("uuid");
            assert!(uuid.starts_with("MIG-"), "{uuid}");
            assert_eq!(
                state.mig_by_uuid(&uuid),
                Some((i as usize, gi, 0)),
                "{uuid}"
            );
            assert_eq!(m.memory_info().expect("mem").total, mem * 1024 * 1024);
            let a = m.attributes().expect("attributes");
            assert_eq!(a.multiprocessor_count, sm);
            assert_eq!(a.shared_copy_engine_count, ce);
            assert_eq!(a.shared_decoder_count, dec);
            assert_eq!(a.gpu_instance_slice_count, slices);
            assert_eq!(a.compute_instance_slice_count, slices);
            assert_eq!(a.memory_size_mb, mem);
            let parent = m.mig_parent_device().expect("parent");
            assert_eq!(parent.index().expect("index"), i);
            assert!(matches!(m.minor_number(), Err(NvmlError::NotSupported)));
            let by_uuid = nvml.device_by_uuid(uuid.as_str()).expect("mig by uuid");
            assert!(by_uuid.mig_is_mig_device_handle().expect("is mig"));

            // The static-MIG discovery path of the NVIDIA driver, through the raw C API.
            // SAFETY: handles come from this library; out-pointers are valid locals.
            unsafe {
                let mh = m.handle();
                let (mut gi_id, mut ci_id): (c_uint, c_uint) = (99, 99);
                assert_eq!(lib.nvmlDeviceGetGpuInstanceId(mh, &mut gi_id), 0);
                assert_eq!(lib.nvmlDeviceGetComputeInstanceId(mh, &mut ci_id), 0);
                assert_eq!((gi_id, ci_id), (gi, 0));
                let mut gih: sys::nvmlGpuInstance_t = std::ptr::null_mut();
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceById(d.handle(), gi_id, &mut gih),
                    0
                );
                let mut info: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
                assert_eq!(lib.nvmlGpuInstanceGetInfo(gih, &mut info), 0);
                assert_eq!(info.device, d.handle());
                assert_eq!(info.id, gi);
                assert_eq!(info.profileId, pid);
                assert_eq!((info.placement.start, info.placement.size), (start, size));
                let mut cih: sys::nvmlComputeInstance_t = std::ptr::null_mut();
                assert_eq!(
                    lib.nvmlGpuInstanceGetComputeInstanceById(gih, ci_id, &mut cih),
                    0
                );
                let mut cinfo: sys::nvmlComputeInstanceInfo_t = std::mem::zeroed();
                assert_eq!(lib.nvmlComputeInstanceGetInfo_v2(cih, &mut cinfo), 0);
                assert_eq!(cinfo.device, mh);
                assert_eq!(cinfo.gpuInstance, gih);
                assert_eq!(cinfo.profileId, slices_to_ci_profile(slices));
                assert_eq!(cinfo.placement.size, slices);
                // Unknown IDs.
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceById(d.handle(), 14, &mut gih),
                    sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND
                );
            }
            total += 1;
        }
        assert!(matches!(d.mig_device_by_index(4), Err(NvmlError::NotFound)));
        assert!(matches!(
            d.mig_device_by_index(7),
            Err(NvmlError::InvalidArg)
        ));
        // Compute mode cannot be set on a MIG-enabled GPU.
        let mut d = d;
        assert!(matches!(
            d.set_compute_mode(ComputeMode::ExclusiveProcess),
            Err(NvmlError::NotSupported)
        ));
    }
    assert_eq!(total, 16);

    // GpuInstances by profile: GPU 0 has two 1g.5gb (profile ID 19).
    let d = nvml.device_by_index(0).expect("device");
    // SAFETY: buffer of 7 handles = instanceCount of profile 19.
    unsafe {
        let mut gis: [sys::nvmlGpuInstance_t; 7] = [std::ptr::null_mut(); 7];
        let mut n: c_uint = 0;
        assert_eq!(
            lib.nvmlDeviceGetGpuInstances(d.handle(), 19, gis.as_mut_ptr(), &mut n),
            0
        );
        assert_eq!(n, 2);
        let mut info: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
        assert_eq!(lib.nvmlGpuInstanceGetInfo(gis[0], &mut info), 0);
        assert_eq!(info.id, 11);
    }
    // MIG off: GI queries are not supported.
    let d4 = nvml.device_by_index(4).expect("device");
    // SAFETY: valid out-pointer.
    unsafe {
        let mut gih: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(
            lib.nvmlDeviceGetGpuInstanceById(d4.handle(), 1, &mut gih),
            sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
        );
    }
}

fn slices_to_ci_profile(slices: u32) -> u32 {
    match slices {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        _ => 4,
    }
}

/// (index, id, name, slices, count, mem, sm, ce, dec, enc, jpeg, ofa, placements, size)
type Row = (
    u32,
    u32,
    &'static str,
    u32,
    u32,
    u64,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    &'static [u32],
    u32,
);

const A100_40: &[Row] = &[
    (
        0x0,
        19,
        "1g.5gb",
        1,
        7,
        4864,
        14,
        1,
        0,
        0,
        0,
        0,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x7,
        20,
        "1g.5gb+me",
        1,
        1,
        4864,
        14,
        1,
        1,
        0,
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x9,
        15,
        "1g.10gb",
        1,
        4,
        9856,
        14,
        1,
        1,
        0,
        0,
        0,
        &[0, 2, 4, 6],
        2,
    ),
    (
        0x1,
        14,
        "2g.10gb",
        2,
        3,
        9856,
        28,
        2,
        1,
        0,
        0,
        0,
        &[0, 2, 4],
        2,
    ),
    (
        0x2,
        9,
        "3g.20gb",
        3,
        2,
        19968,
        42,
        3,
        2,
        0,
        0,
        0,
        &[0, 4],
        4,
    ),
    (0x3, 5, "4g.20gb", 4, 1, 19968, 56, 4, 2, 0, 0, 0, &[0], 4),
    (0x4, 0, "7g.40gb", 7, 1, 40192, 98, 7, 5, 0, 1, 1, &[0], 8),
];

const H100_80: &[Row] = &[
    (
        0x0,
        19,
        "1g.10gb",
        1,
        7,
        9984,
        16,
        1,
        1,
        0,
        1,
        0,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x7,
        20,
        "1g.10gb+me",
        1,
        1,
        9984,
        16,
        1,
        1,
        0,
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x9,
        15,
        "1g.20gb",
        1,
        4,
        20096,
        26,
        1,
        1,
        0,
        1,
        0,
        &[0, 2, 4, 6],
        2,
    ),
    (
        0x1,
        14,
        "2g.20gb",
        2,
        3,
        20096,
        32,
        2,
        2,
        0,
        2,
        0,
        &[0, 2, 4],
        2,
    ),
    (
        0x2,
        9,
        "3g.40gb",
        3,
        2,
        40448,
        60,
        3,
        3,
        0,
        3,
        0,
        &[0, 4],
        4,
    ),
    (0x3, 5, "4g.40gb", 4, 1, 40448, 64, 4, 4, 0, 4, 0, &[0], 4),
    (0x4, 0, "7g.80gb", 7, 1, 81152, 132, 8, 7, 0, 7, 1, &[0], 8),
];

const H200: &[Row] = &[
    (
        0x0,
        19,
        "1g.18gb",
        1,
        7,
        16384,
        16,
        1,
        1,
        0,
        1,
        0,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x7,
        20,
        "1g.18gb+me",
        1,
        1,
        16384,
        16,
        1,
        1,
        0,
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        0x9,
        15,
        "1g.35gb",
        1,
        4,
        33024,
        26,
        1,
        1,
        0,
        1,
        0,
        &[0, 2, 4, 6],
        2,
    ),
    (
        0x1,
        14,
        "2g.35gb",
        2,
        3,
        33024,
        32,
        2,
        2,
        0,
        2,
        0,
        &[0, 2, 4],
        2,
    ),
    (
        0x2,
        9,
        "3g.71gb",
        3,
        2,
        71168,
        60,
        3,
        3,
        0,
        3,
        0,
        &[0, 4],
        4,
    ),
    (0x3, 5, "4g.71gb", 4, 1, 71168, 64, 4, 4, 0, 4, 0, &[0], 4),
    (
        0x4,
        0,
        "7g.141gb",
        7,
        1,
        143104,
        132,
        8,
        7,
        0,
        7,
        1,
        &[0],
        8,
    ),
];

fn c_name(name: &[c_char]) -> String {
    // SAFETY: the library NUL-terminates names inside the 96-byte field.
    unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn gi_profile_tables_and_placements_are_exact() {
    for (profile, gpu, rows) in [
        ("dgx-a100-40gb", 0u32, A100_40),
        ("dgx-a100-40gb", 5, A100_40),
        ("dgx-h100", 0, H100_80),
        ("h200", 0, H200),
    ] {
        let host = SimHost::new(profile);
        let nvml = open(&host);
        let lib = nvml.lib();
        let d = nvml.device_by_index(gpu).expect("device");
        // SAFETY: handles from this library, out-pointers are valid locals/buffers.
        unsafe {
            let h = d.handle();
            for &(index, id, name, slices, count, mem, sm, ce, dec, enc, jpeg, ofa, starts, size) in
                rows
            {
                let mut v1: sys::nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index, &mut v1),
                    0
                );
                let got = (
                    v1.id,
                    v1.isP2pSupported,
                    v1.sliceCount,
                    v1.instanceCount,
                    v1.memorySizeMB,
                    v1.multiprocessorCount,
                    v1.copyEngineCount,
                    v1.decoderCount,
                    v1.encoderCount,
                    v1.jpegCount,
                    v1.ofaCount,
                );
                assert_eq!(
                    got,
                    (id, 0, slices, count, mem, sm, ce, dec, enc, jpeg, ofa),
                    "{profile} {name}"
                );

                let mut v2: sys::nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
                v2.version = (size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>() | (2 << 24)) as u32;
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceProfileInfoV(h, index, &mut v2),
                    0
                );
                assert_eq!((v2.id, v2.memorySizeMB), (id, mem));
                assert_eq!(c_name(&v2.name), format!("MIG {name}"));

                let mut v3: sys::nvmlGpuInstanceProfileInfo_v3_t = std::mem::zeroed();
                v3.version = (size_of::<sys::nvmlGpuInstanceProfileInfo_v3_t>() | (3 << 24)) as u32;
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceProfileInfoV(h, index, (&raw mut v3).cast()),
                    0
                );
                assert_eq!((v3.id, v3.sliceCount, v3.memorySizeMB), (id, slices, mem));
                assert_eq!(c_name(&v3.name), format!("MIG {name}"));
                assert_eq!(v3.capabilities, 0);

                // Placements: count with NULL, short buffer, full buffer.
                let mut n: c_uint = 0;
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                        h,
                        id,
                        std::ptr::null_mut(),
                        &mut n
                    ),
                    0
                );
                assert_eq!(n as usize, starts.len());
                let mut buf = vec![
                    sys::nvmlGpuInstancePlacement_t {
                        start: 99,
                        size: 99
                    };
                    8
                ];
                if starts.len() > 1 {
                    let mut short = n - 1;
                    assert_eq!(
                        lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                            h,
                            id,
                            buf.as_mut_ptr(),
                            &mut short
                        ),
                        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE
                    );
                    assert_eq!(short, n);
                }
                let mut room: c_uint = 8;
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                        h,
                        id,
                        buf.as_mut_ptr(),
                        &mut room
                    ),
                    0
                );
                let got: Vec<(u32, u32)> = buf[..room as usize]
                    .iter()
                    .map(|p| (p.start, p.size))
                    .collect();
                let want: Vec<(u32, u32)> = starts.iter().map(|s| (*s, size)).collect();
                assert_eq!(got, want, "{profile} {name}");
            }
            // Indices the GPU does not offer, and past the end.
            let mut v1: sys::nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
            for index in [5, 6, 8, 0xA, 0x11] {
                assert_eq!(
                    lib.nvmlDeviceGetGpuInstanceProfileInfo(h, index, &mut v1),
                    sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
                    "index {index}"
                );
            }
            assert_eq!(
                lib.nvmlDeviceGetGpuInstanceProfileInfo(h, 0x12, &mut v1),
                sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            );
            // A bad struct version.
            let mut v2: sys::nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
            v2.version = 1;
            assert_eq!(
                lib.nvmlDeviceGetGpuInstanceProfileInfoV(h, 0, &mut v2),
                sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            );
        }
    }
}

#[test]
fn non_mig_gpus_report_not_supported_for_mig_queries() {
    let host = SimHost::new("t4");
    let nvml = open(&host);
    let d = nvml.device_by_index(0).expect("device");
    assert_eq!(d.mig_device_count().expect("max"), 0);
    // SAFETY: valid out-pointer.
    unsafe {
        let mut v1: sys::nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
        assert_eq!(
            nvml.lib()
                .nvmlDeviceGetGpuInstanceProfileInfo(d.handle(), 0, &mut v1),
            sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
        );
    }
    assert!(matches!(d.attributes(), Err(NvmlError::NotSupported)));
}

#[test]
fn errors_follow_nvml_conventions() {
    let host = SimHost::new("dgx-h100");
    // SAFETY: loading the simulator library; all pointers passed are valid or deliberately
    // null where the test checks the null handling.
    unsafe {
        let lib = sys::NvmlLib::new(host.lib_path()).expect("load");
        let mut n: c_uint = 0;
        assert_eq!(
            lib.nvmlDeviceGetCount_v2(&mut n),
            sys::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED
        );
        // Reference-counted init.
        assert_eq!(lib.nvmlInit_v2(), 0);
        assert_eq!(lib.nvmlInitWithFlags(0), 0);
        assert_eq!(lib.nvmlShutdown(), 0);
        assert_eq!(lib.nvmlDeviceGetCount_v2(&mut n), 0, "one reference left");
        assert_eq!(n, 8);
        assert_eq!(
            lib.nvmlDeviceGetCount_v2(std::ptr::null_mut()),
            sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
        let mut h: sys::nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            lib.nvmlDeviceGetHandleByIndex_v2(8, &mut h),
            sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(lib.nvmlDeviceGetHandleByIndex_v2(3, &mut h), 0);
        let mut small = [0 as c_char; 8];
        assert_eq!(
            lib.nvmlDeviceGetName(h, small.as_mut_ptr(), small.len() as c_uint),
            sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE
        );
        let mut uuid = [0 as c_char; 41];
        assert_eq!(
            lib.nvmlDeviceGetUUID(h, uuid.as_mut_ptr(), 40),
            sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
            "40 bytes cannot hold 40 characters and the NUL"
        );
        assert_eq!(lib.nvmlDeviceGetUUID(h, uuid.as_mut_ptr(), 41), 0);
        assert_eq!(c_name(&uuid), host.profile().gpus[3].uuid);
        // A pointer that is not a handle of this library.
        let mut x = 0u64;
        let mut mode: c_uint = 0;
        assert_eq!(
            lib.nvmlDeviceGetComputeMode((&raw mut x).cast(), &mut mode),
            sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
        // Memory v2 needs its version.
        let mut m: sys::nvmlMemory_v2_t = std::mem::zeroed();
        assert_eq!(
            lib.nvmlDeviceGetMemoryInfo_v2(h, &mut m),
            sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
        let mut m1: sys::nvmlMemory_t = std::mem::zeroed();
        assert_eq!(lib.nvmlDeviceGetMemoryInfo(h, &mut m1), 0);
        assert_eq!(m1.total, 81559 * 1024 * 1024);
        let msg = CStr::from_ptr(lib.nvmlErrorString(sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND));
        assert_eq!(msg.to_str(), Ok("Not Found"));
        assert_eq!(lib.nvmlShutdown(), 0);
        assert_eq!(
            lib.nvmlShutdown(),
            sys::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED
        );
    }
}

#[test]
fn compute_mode_set_through_nvml_is_persisted() {
    let host = SimHost::new("dgx-h100");
    let nvml = open(&host);
    let mut d = nvml.device_by_index(2).expect("device");
    d.set_compute_mode(ComputeMode::ExclusiveProcess)
        .expect("set");
    assert_eq!(
        d.compute_mode().expect("mode"),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(
        host.state().gpus[2].compute_mode,
        gpu_dra_sim::state::ComputeMode::ExclusiveProcess
    );
    // Another writer (here: the test, through the state file) is seen on the next call.
    host.state_file()
        .update(|s| {
            s.gpus[2].compute_mode = gpu_dra_sim::state::ComputeMode::Prohibited;
            Ok::<(), ()>(())
        })
        .expect("update")
        .expect("ok");
    assert_eq!(d.compute_mode().expect("mode"), ComputeMode::Prohibited);
}

#[test]
fn struct_layouts_match_nvml_wrapper_sys() {
    macro_rules! same {
        ($ours:ty, $theirs:ty, $($a:ident = $b:ident),*) => {
            assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), stringify!($ours));
            assert_eq!(std::mem::align_of::<$ours>(), std::mem::align_of::<$theirs>());
            $(assert_eq!(offset_of!($ours, $a), offset_of!($theirs, $b), stringify!($a));)*
        };
    }
    same!(
        ffi::Memory,
        sys::nvmlMemory_t,
        total = total,
        free = free,
        used = used
    );
    same!(
        ffi::MemoryV2,
        sys::nvmlMemory_v2_t,
        version = version,
        total = total,
        reserved = reserved,
        free = free,
        used = used
    );
    same!(
        ffi::PciInfo,
        sys::nvmlPciInfo_t,
        bus_id_legacy = busIdLegacy,
        domain = domain,
        bus = bus,
        device = device,
        pci_device_id = pciDeviceId,
        pci_sub_system_id = pciSubSystemId,
        bus_id = busId
    );
    same!(
        ffi::DeviceAttributes,
        sys::nvmlDeviceAttributes_t,
        multiprocessor_count = multiprocessorCount,
        shared_copy_engine_count = sharedCopyEngineCount,
        shared_decoder_count = sharedDecoderCount,
        shared_encoder_count = sharedEncoderCount,
        shared_jpeg_count = sharedJpegCount,
        shared_ofa_count = sharedOfaCount,
        gpu_instance_slice_count = gpuInstanceSliceCount,
        compute_instance_slice_count = computeInstanceSliceCount,
        memory_size_mb = memorySizeMB
    );
    same!(
        ffi::GiProfileInfo,
        sys::nvmlGpuInstanceProfileInfo_t,
        id = id,
        is_p2p_supported = isP2pSupported,
        slice_count = sliceCount,
        instance_count = instanceCount,
        multiprocessor_count = multiprocessorCount,
        copy_engine_count = copyEngineCount,
        decoder_count = decoderCount,
        encoder_count = encoderCount,
        jpeg_count = jpegCount,
        ofa_count = ofaCount,
        memory_size_mb = memorySizeMB
    );
    same!(
        ffi::GiProfileInfoV2,
        sys::nvmlGpuInstanceProfileInfo_v2_t,
        version = version,
        id = id,
        is_p2p_supported = isP2pSupported,
        slice_count = sliceCount,
        ofa_count = ofaCount,
        memory_size_mb = memorySizeMB,
        name = name
    );
    same!(
        ffi::GiProfileInfoV3,
        sys::nvmlGpuInstanceProfileInfo_v3_t,
        version = version,
        id = id,
        slice_count = sliceCount,
        ofa_count = ofaCount,
        memory_size_mb = memorySizeMB,
        name = name,
        capabilities = capabilities
    );
    same!(
        ffi::Placement,
        sys::nvmlGpuInstancePlacement_t,
        start = start,
        size = size
    );
    same!(
        ffi::GpuInstanceInfo,
        sys::nvmlGpuInstanceInfo_t,
        device = device,
        id = id,
        profile_id = profileId,
        placement = placement
    );
    same!(
        ffi::events::EventData,
        sys::nvmlEventData_t,
        device = device,
        event_type = eventType,
        event_data = eventData,
        gpu_instance_id = gpuInstanceId,
        compute_instance_id = computeInstanceId
    );
    same!(
        ffi::events::FieldValue,
        sys::nvmlFieldValue_t,
        field_id = fieldId,
        scope_id = scopeId,
        timestamp = timestamp,
        latency_usec = latencyUsec,
        value_type = valueType,
        nvml_return = nvmlReturn,
        value = value
    );
    same!(ffi::events::Value, sys::nvmlValue_t,);
    same!(
        ffi::ComputeInstanceInfo,
        sys::nvmlComputeInstanceInfo_t,
        device = device,
        gpu_instance = gpuInstance,
        id = id,
        profile_id = profileId,
        placement = placement
    );
}
