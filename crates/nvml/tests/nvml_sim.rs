//! The NVML backend over the GPU simulator: every shipped profile, exact expected values.
//!
//! The simulator is a real `libnvidia-ml.so` implementing the NVML C ABI, so this exercises the
//! production code path (library loading, nvml-wrapper, the raw GPU-instance calls, sysfs).

use gpu_dra_device::{ComputeCapability, Gpu, GpuInventory, Inventory, MigMode, Placement};
use gpu_dra_nvml::{NvmlInventory, NvmlOptions, find_library};
use gpu_dra_sim::testing::SimHost;

const MIB: u64 = 1 << 20;

fn discover(host: &SimHost) -> Inventory {
    // The library is found the way the plugin finds it: under the driver root.
    let lib = find_library(host.root()).expect("simulated libnvidia-ml.so.1 under the root");
    NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(lib),
        sysfs_root: host.sysfs_root(),
    })
    .discover()
    .expect("discovery over the simulator")
}

/// (minor, uuid, bus id, pcie root, numa node)
type Placed = (u32, &'static str, &'static str, &'static str, i64);

/// (product name, brand, architecture, compute capability, memory MiB)
type Product = (&'static str, &'static str, &'static str, (u32, u32), u64);

fn check_gpu(gpu: &Gpu, index: u32, placed: Placed, product: Product) {
    let (name, brand, arch, cc, mem_mib) = product;
    let (minor, uuid, bus, root, numa) = placed;
    assert_eq!(gpu.index, index);
    assert_eq!(gpu.minor, minor);
    assert_eq!(gpu.uuid, uuid);
    assert_eq!(gpu.product_name, name);
    assert_eq!(gpu.brand, brand);
    assert_eq!(gpu.architecture, arch);
    assert_eq!(
        gpu.cuda_compute_capability,
        ComputeCapability {
            major: cc.0,
            minor: cc.1
        }
    );
    assert_eq!(gpu.memory_bytes, mem_mib * MIB);
    assert_eq!(gpu.pci_bus_id, bus);
    assert_eq!(gpu.pcie_root.as_deref(), Some(root));
    assert_eq!(gpu.numa_node, Some(numa));
}

fn versions(inv: &Inventory) {
    assert_eq!(inv.driver_version, "580.95.05");
    assert_eq!(inv.cuda_driver_version, "13.0");
}

#[test]
fn t4() {
    let inv = discover(&SimHost::new("t4"));
    versions(&inv);
    assert_eq!(inv.gpus.len(), 1);
    let g = &inv.gpus[0];
    check_gpu(
        g,
        0,
        (
            0,
            "GPU-5da43f92-3f83-db9a-873d-013ec7c7ffd9",
            "0000:00:04.0",
            "pci0000:00",
            0,
        ),
        ("Tesla T4", "Nvidia", "Turing", (7, 5), 15360),
    );
    assert_eq!(g.mig, None);
    assert!(g.mig_devices.is_empty());
    assert_eq!(
        inv.devices().map(|d| d.name()).collect::<Vec<_>>(),
        ["gpu-0"]
    );
}

#[test]
fn rtx4090() {
    let inv = discover(&SimHost::new("rtx4090"));
    versions(&inv);
    assert_eq!(inv.gpus.len(), 1);
    check_gpu(
        &inv.gpus[0],
        0,
        (
            0,
            "GPU-c56029b0-6d47-e649-e305-1f81215dcb1f",
            "0000:01:00.0",
            "pci0000:00",
            0,
        ),
        (
            "NVIDIA GeForce RTX 4090",
            "GeForce",
            "Ada Lovelace",
            (8, 9),
            24564,
        ),
    );
    assert_eq!(inv.gpus[0].mig, None);
}

#[test]
fn p4() {
    let inv = discover(&SimHost::new("p4"));
    check_gpu(
        &inv.gpus[0],
        0,
        (
            0,
            "GPU-46b1e52f-62a6-a91e-8297-ced4ee7348b9",
            "0000:00:05.0",
            "pci0000:00",
            0,
        ),
        ("Tesla P4", "Nvidia", "Pascal", (6, 1), 7680),
    );
}

/// NUMA nodes as the real DGX A100 in NPS4 mode reports them.
const DGX_A100: [Placed; 8] = [
    (
        0,
        "GPU-8614e54a-4d5b-70ec-4cf8-cfd33eb7be95",
        "0000:07:00.0",
        "pci0000:00",
        3,
    ),
    (
        1,
        "GPU-3963c85c-bae8-9177-3f36-3941a5f7aea5",
        "0000:0f:00.0",
        "pci0000:00",
        3,
    ),
    (
        2,
        "GPU-0b17ac05-0bfd-e136-88b3-a14dc8eec6bd",
        "0000:47:00.0",
        "pci0000:40",
        1,
    ),
    (
        3,
        "GPU-ad14e50b-a593-2ea6-9655-72ef9ec2f8ec",
        "0000:4e:00.0",
        "pci0000:40",
        1,
    ),
    (
        4,
        "GPU-71a35d98-f093-7755-e9fc-851e6008ea3a",
        "0000:87:00.0",
        "pci0000:80",
        7,
    ),
    (
        5,
        "GPU-f6774c11-ac75-edcc-bcbd-d875fa56aec4",
        "0000:90:00.0",
        "pci0000:80",
        7,
    ),
    (
        6,
        "GPU-580b38dd-5349-759a-44c1-2e6d24de7bf4",
        "0000:b7:00.0",
        "pci0000:b0",
        5,
    ),
    (
        7,
        "GPU-28fdd06e-ee69-3292-7569-a6879b3f58d6",
        "0000:bd:00.0",
        "pci0000:b0",
        5,
    ),
];

#[test]
fn dgx_a100_40gb_has_4_whole_gpus_and_16_mig_devices() {
    let inv = discover(&SimHost::new("dgx-a100-40gb"));
    versions(&inv);
    assert_eq!(inv.gpus.len(), 8);
    for (i, (gpu, placed)) in inv.gpus.iter().zip(DGX_A100).enumerate() {
        check_gpu(
            gpu,
            u32::try_from(i).expect("GPU index fits u32"),
            placed,
            ("NVIDIA A100-SXM4-40GB", "Nvidia", "Ampere", (8, 0), 40960),
        );
        let on = i < 4;
        assert_eq!(
            gpu.mig,
            Some(MigMode {
                current: on,
                pending: on
            })
        );
        if !on {
            assert!(gpu.mig_devices.is_empty());
            continue;
        }
        // (profile, giProfileId, gi, start, size, MiB, SMs, CE, DEC, ENC, JPEG, OFA) in NVML order.
        let expected = [
            ("3g.20gb", 9, 1, 4, 4, 19968, 42, 3, 2, 0, 0, 0),
            ("2g.10gb", 14, 6, 2, 2, 9856, 28, 2, 1, 0, 0, 0),
            ("1g.5gb", 19, 11, 0, 1, 4864, 14, 1, 0, 0, 0, 0),
            ("1g.5gb", 19, 12, 1, 1, 4864, 14, 1, 0, 0, 0, 0),
        ];
        assert_eq!(gpu.mig_devices.len(), 4);
        for (m, e) in gpu.mig_devices.iter().zip(expected) {
            assert_eq!(m.profile, e.0);
            assert_eq!(m.gi_profile_id, e.1);
            assert_eq!(m.gi_id, e.2);
            assert_eq!(m.ci_id, 0);
            assert_eq!(
                m.placement,
                Placement {
                    start: e.3,
                    size: e.4
                }
            );
            assert_eq!(m.memory_bytes, e.5 * MIB);
            assert_eq!(
                (
                    m.multiprocessors,
                    m.copy_engines,
                    m.decoders,
                    m.encoders,
                    m.jpeg_engines,
                    m.ofa_engines
                ),
                (e.6, e.7, e.8, e.9, e.10, e.11)
            );
            assert!(
                m.uuid.starts_with("MIG-") && m.uuid.len() == 40,
                "{}",
                m.uuid
            );
        }
    }
    let names: Vec<String> = inv.devices().map(|d| d.name()).collect();
    assert_eq!(names.len(), 20);
    assert_eq!(names.iter().filter(|n| n.contains("-mig-")).count(), 16);
    assert_eq!(
        &names[..4],
        [
            "gpu-0-mig-3g20gb-9-4",
            "gpu-0-mig-2g10gb-14-2",
            "gpu-0-mig-1g5gb-19-0",
            "gpu-0-mig-1g5gb-19-1"
        ]
    );
    assert_eq!(&names[16..], ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]);
    // MIG UUIDs are unique across the node.
    let mut uuids: Vec<&str> = inv.devices().map(|d| d.uuid()).collect();
    uuids.sort_unstable();
    uuids.dedup();
    assert_eq!(uuids.len(), 20);
}

#[test]
fn dgx_h100_is_mig_capable_with_mig_off() {
    let inv = discover(&SimHost::new("dgx-h100"));
    versions(&inv);
    let placed: [Placed; 8] = [
        (
            0,
            "GPU-9a6bc3b8-473e-3ab1-f06d-fdce1dce7cb8",
            "0000:07:00.0",
            "pci0000:00",
            0,
        ),
        (
            1,
            "GPU-5d6ab604-4b07-2690-707c-3b458b8d0f99",
            "0000:0f:00.0",
            "pci0000:00",
            0,
        ),
        (
            2,
            "GPU-ccad0d88-aeef-ede5-390a-6d7b6ef6533d",
            "0000:47:00.0",
            "pci0000:40",
            0,
        ),
        (
            3,
            "GPU-0be34b7a-6c8a-7546-8a5d-acb700e7d6af",
            "0000:4e:00.0",
            "pci0000:40",
            0,
        ),
        (
            4,
            "GPU-cbd7d97d-263c-3180-88c7-89a0d74a2a62",
            "0000:87:00.0",
            "pci0000:80",
            1,
        ),
        (
            5,
            "GPU-5a1f16ac-75d1-378c-4eb1-5e9c801a8c06",
            "0000:90:00.0",
            "pci0000:80",
            1,
        ),
        (
            6,
            "GPU-d3954dd5-5316-2654-5971-ddc426273a77",
            "0000:b7:00.0",
            "pci0000:b0",
            1,
        ),
        (
            7,
            "GPU-ed914cfe-c2e3-3382-c2f2-1e3924102e60",
            "0000:bd:00.0",
            "pci0000:b0",
            1,
        ),
    ];
    assert_eq!(inv.gpus.len(), 8);
    for (i, (gpu, p)) in inv.gpus.iter().zip(placed).enumerate() {
        check_gpu(
            gpu,
            u32::try_from(i).expect("GPU index fits u32"),
            p,
            ("NVIDIA H100 80GB HBM3", "Nvidia", "Hopper", (9, 0), 81559),
        );
        assert_eq!(
            gpu.mig,
            Some(MigMode {
                current: false,
                pending: false
            })
        );
        assert!(gpu.mig_devices.is_empty());
    }
}

#[test]
fn h200() {
    let inv = discover(&SimHost::new("h200"));
    versions(&inv);
    assert_eq!(inv.gpus.len(), 1);
    check_gpu(
        &inv.gpus[0],
        0,
        (
            0,
            "GPU-187a8fcb-4c4b-cc09-86b2-cc22af207693",
            "0000:19:00.0",
            "pci0000:17",
            0,
        ),
        ("NVIDIA H200", "Nvidia", "Hopper", (9, 0), 143771),
    );
    assert_eq!(
        inv.gpus[0].mig,
        Some(MigMode {
            current: false,
            pending: false
        })
    );
}

#[test]
fn rediscovery_sees_mig_reconfiguration_including_media_extension_profiles() {
    let host = SimHost::new("h200");
    host.update_state(|s| {
        s.set_mig_mode(0, true).expect("enable MIG");
        let gi = s.create_gpu_instance(0, 20, Some(6)).expect("1g.18gb+me");
        s.create_compute_instance(0, gi).expect("ci");
        let gi = s.create_gpu_instance(0, 9, Some(0)).expect("3g.71gb");
        s.create_compute_instance(0, gi).expect("ci");
    });
    let inv = discover(&host);
    let gpu = &inv.gpus[0];
    assert!(gpu.mig_enabled());
    let mut got: Vec<(String, u32, u32, u64)> = gpu
        .mig_devices
        .iter()
        .map(|m| {
            (
                m.profile.clone(),
                m.gi_profile_id,
                m.placement.start,
                m.memory_bytes / MIB,
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("1g.18gb+me".to_string(), 20, 6, 16384),
            ("3g.71gb".to_string(), 9, 0, 71168)
        ]
    );
    let me = gpu
        .mig_devices
        .iter()
        .find(|m| m.gi_profile_id == 20)
        .expect("+me device");
    assert_eq!((me.decoders, me.jpeg_engines, me.ofa_engines), (1, 1, 1));
    let mut names: Vec<String> = inv.devices().map(|d| d.name()).collect();
    names.sort();
    assert_eq!(names, ["gpu-0-mig-1g18gb-me-20-6", "gpu-0-mig-3g71gb-9-0"]);
}

#[test]
fn mig_enabled_without_instances_publishes_nothing_for_that_gpu() {
    let host = SimHost::new("h200");
    host.update_state(|s| s.set_mig_mode(0, true).expect("enable MIG"));
    let inv = discover(&host);
    assert!(inv.gpus[0].mig_enabled());
    assert!(inv.gpus[0].mig_devices.is_empty());
    assert_eq!(inv.devices().count(), 0);
}

#[test]
fn missing_sysfs_entries_leave_topology_unset() {
    let host = SimHost::new("t4");
    let inv = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(host.lib_path()),
        sysfs_root: host.root().join("no-such-sysfs"),
    })
    .discover()
    .expect("discovery without sysfs");
    assert_eq!(inv.gpus[0].pcie_root, None);
    assert_eq!(inv.gpus[0].numa_node, None);
    assert_eq!(inv.gpus[0].pci_bus_id, "0000:00:04.0");
}

/// A GPU that fell off the bus is reported as lost; the node's other GPUs are still
/// discovered, and the GPU is back after a reset.
#[test]
fn a_lost_gpu_is_reported_and_the_others_discovered() {
    let host = SimHost::new("dgx-h100");
    let before = discover(&host);
    assert!(before.lost_gpus.is_empty());
    let count = before.gpus.len();
    assert!(count >= 2, "the profile needs two GPUs for this test");
    host.update_state(|s| s.fall_off_bus(1).expect("fall off the bus"));
    let lost = discover(&host);
    assert_eq!(lost.lost_gpus, [before.gpus[1].index]);
    assert_eq!(lost.gpus.len(), count - 1);
    assert!(lost.gpus.iter().all(|g| g.uuid != before.gpus[1].uuid));
    host.update_state(|s| s.reset_gpu(1).expect("reset"));
    assert_eq!(discover(&host), before);
}

/// Prepare's check of a claim's devices: true while they are as discovered, false once one
/// of them was recreated, lost or had its MIG mode changed; other devices do not matter.
#[test]
fn still_current_checks_only_the_named_devices() {
    let host = SimHost::new("dgx-h100");
    host.update_state(|s| {
        s.set_mig_mode(0, true).expect("enable MIG");
        for start in [0, 4] {
            let gi = s.create_gpu_instance(0, 9, Some(start)).expect("3g");
            s.create_compute_instance(0, gi).expect("ci");
        }
    });
    let backend = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(host.lib_path()),
        sysfs_root: host.sysfs_root(),
    });
    let known = backend.discover().expect("discovery");
    let at = |start: u32| {
        let gpu = &known.gpus[0];
        let mig = gpu.mig_devices.iter().find(|m| m.placement.start == start);
        mig.expect("MIG device").device_name(gpu)
    };
    let (a, b) = (at(0), at(4));
    let (a, b) = (a.as_str(), b.as_str());
    let whole = known.gpus[1].device_name();
    assert!(
        backend
            .still_current(&known, &[a, b, &whole])
            .expect("check")
    );
    assert!(
        !backend.still_current(&known, &["gpu-0"]).expect("check"),
        "not a device now"
    );

    // Placement 4 destroyed and created again: a new instance under the same name.
    host.update_state(|s| {
        let (gi, ci) = s.gpus[0]
            .gpu_instances
            .iter()
            .find(|g| g.placement_start == 4)
            .map(|g| (g.id, g.compute_instances[0].id))
            .expect("instance at 4");
        s.destroy_compute_instance(0, gi, ci).expect("destroy ci");
        s.destroy_gpu_instance(0, gi).expect("destroy gi");
        let gi = s.create_gpu_instance(0, 9, Some(4)).expect("again");
        s.create_compute_instance(0, gi).expect("ci");
    });
    assert!(backend.still_current(&known, &[a, &whole]).expect("check"));
    assert!(
        !backend.still_current(&known, &[b]).expect("check"),
        "recreated"
    );

    // MIG turned on for the whole GPU; then that GPU lost.
    host.update_state(|s| s.set_mig_mode(1, true).expect("enable MIG"));
    assert!(!backend.still_current(&known, &[&whole]).expect("check"));
    host.update_state(|s| s.set_mig_mode(1, false).expect("disable MIG"));
    assert!(backend.still_current(&known, &[&whole]).expect("check"));
    host.update_state(|s| s.fall_off_bus(1).expect("fall off the bus"));
    assert!(
        !backend.still_current(&known, &[&whole]).expect("check"),
        "lost"
    );
    assert!(backend.still_current(&known, &[a]).expect("check"));
}

#[test]
fn nvlink_peers_come_from_the_p2p_status_through_nvswitches_and_bridges() {
    let h100 = discover(&SimHost::new("dgx-h100"));
    for g in &h100.gpus {
        assert_eq!(g.nvlink_peers.len(), 7, "{}", g.uuid);
        assert!(!g.nvlink_peers.contains(&g.uuid));
    }
    // GPUs 0-3 are in MIG mode: no peer-to-peer, so no peers either way.
    let a100 = discover(&SimHost::new("dgx-a100-40gb"));
    let uuids: Vec<&str> = a100.gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert!(a100.gpus[..4].iter().all(|g| g.nvlink_peers.is_empty()));
    assert_eq!(a100.gpus[4].nvlink_peers, uuids[5..8]);
    let pairs = discover(&SimHost::new("h100-pcie-x8-nvlink"));
    assert_eq!(pairs.gpus[0].nvlink_peers, [pairs.gpus[5].uuid.clone()]);
    assert_eq!(pairs.gpus[5].nvlink_peers, [pairs.gpus[0].uuid.clone()]);
    let pcie = discover(&SimHost::new("l40s-x8"));
    assert!(pcie.gpus.iter().all(|g| g.nvlink_peers.is_empty()));
}
