//! Dynamic MIG's hardware operations over the GPU simulator (a real `libnvidia-ml.so` with the
//! NVML C ABI and the A100-40GB placement rules): profiles, create, list, destroy, refusals.

use gpu_dra_device::{GpuInventory, Placement};
use gpu_dra_nvml::{MigOps, MigOpsError, NvmlInventory, NvmlOptions, find_library};
use gpu_dra_sim::testing::SimHost;

const INVALID_ARGUMENT: u32 = 2;
const NOT_SUPPORTED: u32 = 3;
const NO_PERMISSION: u32 = 4;
const NOT_FOUND: u32 = 6;
const IN_USE: u32 = 19;
const INSUFFICIENT_RESOURCES: u32 = 23;
const MIB: u64 = 1 << 20;

/// GPU 4 of `dgx-a100-40gb`: MIG capable, MIG off at boot.
const GPU: usize = 4;

fn ops(host: &SimHost) -> MigOps {
    MigOps::open(&find_library(host.root()).expect("library")).expect("open NVML")
}

fn uuid(host: &SimHost, gpu: usize) -> String {
    host.profile().gpus[gpu].uuid.clone()
}

fn enable_mig(host: &SimHost) {
    host.update_state(|s| s.set_mig_mode(GPU, true).expect("enable MIG"));
}

fn code(e: &MigOpsError) -> u32 {
    e.code().unwrap_or_else(|| panic!("not an NVML error: {e}"))
}

#[test]
fn a100_profiles_follow_the_table_and_are_named_as_discovery_names_them() {
    let host = SimHost::new("dgx-a100-40gb");
    let ops = ops(&host);
    // GPU 0 has MIG enabled at boot.
    let profiles = ops.mig_profiles(&uuid(&host, 0)).expect("profiles");
    let got: Vec<(u32, &str, u32, u32)> = profiles
        .iter()
        .map(|p| {
            (
                p.gi_profile_id,
                p.name.as_str(),
                p.compute_slices,
                p.memory_slices,
            )
        })
        .collect();
    // NVML profile index order: 1_SLICE, 2, 3, 4, 7, then 1_SLICE_REV1 (0x7), REV2 (0x9).
    assert_eq!(
        got,
        [
            (19, "1g.5gb", 1, 1),
            (14, "2g.10gb", 2, 2),
            (9, "3g.20gb", 3, 4),
            (5, "4g.20gb", 4, 4),
            (0, "7g.40gb", 7, 8),
            (20, "1g.5gb+me", 1, 1),
            (15, "1g.10gb", 1, 2),
        ]
    );
    let g3 = &profiles[2];
    assert_eq!(
        g3.placements,
        [
            Placement { start: 0, size: 4 },
            Placement { start: 4, size: 4 }
        ]
    );
    assert_eq!(g3.memory_bytes, 19968 * MIB);
    assert_eq!(
        (
            g3.multiprocessors,
            g3.copy_engines,
            g3.decoders,
            g3.encoders,
            g3.jpeg_engines,
            g3.ofa_engines
        ),
        (42, 3, 2, 0, 0, 0)
    );
    assert_eq!(profiles[0].placements.len(), 7);
    assert_eq!(profiles[1].placements.len(), 3);
    let me = &profiles[5];
    assert_eq!((me.decoders, me.jpeg_engines, me.ofa_engines), (1, 1, 1));
    // The names are the driver's own (`nvmlGpuInstanceProfileInfo_v2.name` less "MIG ").
    let table = gpu_dra_sim::mig::table("a100-40gb").expect("table");
    for p in &profiles {
        let want = gpu_dra_sim::mig::by_id(table, p.gi_profile_id).expect("in table");
        assert_eq!(p.name, want.name);
    }
}

#[test]
fn discovery_lists_profiles_of_mig_enabled_gpus_only() {
    let host = SimHost::new("dgx-a100-40gb");
    let inv = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(find_library(host.root()).expect("library")),
        sysfs_root: host.sysfs_root(),
    })
    .discover()
    .expect("discover");
    for gpu in &inv.gpus {
        if gpu.mig_enabled() {
            assert_eq!(gpu.mig_profiles.len(), 7, "{}", gpu.device_name());
            assert_eq!(
                gpu.mig_profiles,
                ops(&host).mig_profiles(&gpu.uuid).expect("profiles")
            );
        } else {
            assert!(gpu.mig_profiles.is_empty(), "{}", gpu.device_name());
        }
    }
    assert!(inv.gpus[0].mig_enabled() && !inv.gpus[GPU].mig_enabled());
    let t4 = SimHost::new("t4");
    let inv = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(find_library(t4.root()).expect("library")),
        sysfs_root: t4.sysfs_root(),
    })
    .discover()
    .expect("discover");
    assert!(inv.gpus[0].mig_profiles.is_empty());
}

#[test]
fn create_list_and_destroy_on_an_a100() {
    let host = SimHost::new("dgx-a100-40gb");
    let ops = ops(&host);
    let gpu = uuid(&host, GPU);
    assert!(
        ops.list_mig_instances(&gpu).expect("list").is_empty(),
        "MIG off"
    );
    enable_mig(&host);

    // 3g.20gb@4 + 2g.10gb@0 + 1g.5gb@2 fit together on an A100-40GB.
    let g3 = ops.create_mig_device(&gpu, 9, 4).expect("3g.20gb at 4");
    let g2 = ops.create_mig_device(&gpu, 14, 0).expect("2g.10gb at 0");
    let g1 = ops.create_mig_device(&gpu, 19, 2).expect("1g.5gb at 2");
    for m in [&g3, &g2, &g1] {
        assert!(m.uuid.starts_with("MIG-"), "{}", m.uuid);
        assert_eq!(m.ci_id, 0);
        assert_eq!(
            host.state().mig_by_uuid(&m.uuid),
            Some((GPU, m.gi_id, m.ci_id))
        );
    }
    let list = ops.list_mig_instances(&gpu).expect("list");
    let mut want = vec![
        (
            g3.gi_id,
            9,
            Placement { start: 4, size: 4 },
            g3.uuid.clone(),
        ),
        (
            g2.gi_id,
            14,
            Placement { start: 0, size: 2 },
            g2.uuid.clone(),
        ),
        (
            g1.gi_id,
            19,
            Placement { start: 2, size: 1 },
            g1.uuid.clone(),
        ),
    ];
    want.sort_by_key(|w| w.0);
    let got: Vec<_> = list
        .iter()
        .map(|m| (m.gi_id, m.gi_profile_id, m.placement, m.uuid.clone()))
        .collect();
    assert_eq!(got, want);

    // Discovery sees them as MIG devices, named by profile and placement.
    let inv = NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(find_library(host.root()).expect("library")),
        sysfs_root: host.sysfs_root(),
    })
    .discover()
    .expect("discover");
    let mut names: Vec<String> = inv
        .devices()
        .filter(|d| d.gpu().index == 4)
        .map(|d| d.name())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "gpu-4-mig-1g5gb-19-2",
            "gpu-4-mig-2g10gb-14-0",
            "gpu-4-mig-3g20gb-9-4"
        ]
    );

    // A GPU instance that keeps another compute instance is not destroyed.
    let err = ops
        .destroy_mig_device(&gpu, g3.gi_id, 5)
        .expect_err("CI 0 still in the GI");
    assert_eq!(code(&err), IN_USE, "{err}");
    assert!(err.to_string().contains("nvmlGpuInstanceDestroy"), "{err}");

    ops.destroy_mig_device(&gpu, g2.gi_id, g2.ci_id)
        .expect("destroy 2g");
    // Idempotent: already gone is success.
    ops.destroy_mig_device(&gpu, g2.gi_id, g2.ci_id)
        .expect("destroy again");
    assert_eq!(ops.list_mig_instances(&gpu).expect("list").len(), 2);
    assert!(
        !host
            .root()
            .join(format!(
                "proc/driver/nvidia/capabilities/gpu4/mig/gi{}",
                g2.gi_id
            ))
            .exists()
    );

    // Recreated at the same place: a new UUID.
    let again = ops.create_mig_device(&gpu, 14, 0).expect("2g.10gb again");
    assert_ne!(again.uuid, g2.uuid);

    for m in [&g3, &g1, &again] {
        ops.destroy_mig_device(&gpu, m.gi_id, m.ci_id)
            .expect("destroy");
    }
    assert!(ops.list_mig_instances(&gpu).expect("list").is_empty());
    assert!(host.state().gpus[GPU].gpu_instances.is_empty());
}

#[test]
fn refusals_carry_the_drivers_codes_and_change_nothing() {
    let host = SimHost::new("dgx-a100-40gb");
    let ops = ops(&host);
    let gpu = uuid(&host, GPU);
    let err = ops.create_mig_device(&gpu, 9, 4).expect_err("MIG off");
    assert_eq!(code(&err), NOT_SUPPORTED, "{err}");
    // Nothing can exist with MIG off: destroying is success.
    ops.destroy_mig_device(&gpu, 1, 0)
        .expect("nothing to destroy");

    enable_mig(&host);
    ops.create_mig_device(&gpu, 9, 4).expect("3g.20gb at 4");
    for (profile, start, want) in [
        (9, 4, INSUFFICIENT_RESOURCES),  // taken
        (19, 5, INSUFFICIENT_RESOURCES), // inside the 3g
        (0, 0, INSUFFICIENT_RESOURCES),  // 7g needs every slice
        (14, 1, INVALID_ARGUMENT),       // 2g starts at 0, 2 or 4
        (9, 2, INVALID_ARGUMENT),        // 3g starts at 0 or 4
        (99, 0, INVALID_ARGUMENT),       // no such profile
    ] {
        let err = ops
            .create_mig_device(&gpu, profile, start)
            .expect_err("refused");
        assert_eq!(code(&err), want, "profile {profile} at {start}: {err}");
        assert!(err.to_string().contains(&gpu), "{err}");
    }
    assert_eq!(host.state().gpus[GPU].gpu_instances.len(), 1);

    let err = ops
        .create_mig_device("GPU-00000000-0000-0000-0000-000000000000", 9, 0)
        .expect_err("no such GPU");
    assert_eq!(code(&err), NOT_FOUND, "{err}");
    // A GPU without MIG.
    let t4 = SimHost::new("t4");
    let err = self::ops(&t4)
        .create_mig_device(&uuid(&t4, 0), 19, 0)
        .expect_err("no MIG");
    assert_eq!(code(&err), NOT_SUPPORTED, "{err}");
}

#[test]
fn a_process_that_does_not_see_every_gpu_may_not_create() {
    let host = SimHost::new("dgx-a100-40gb");
    enable_mig(&host);
    // As in a container given some GPUs only.
    std::fs::remove_file(host.root().join("dev/nvidia7")).expect("remove node");
    let err = ops(&host)
        .create_mig_device(&uuid(&host, GPU), 9, 4)
        .expect_err("partial view");
    assert_eq!(code(&err), NO_PERMISSION, "{err}");
    assert!(host.state().gpus[GPU].gpu_instances.is_empty());
}
