//! MIG profile tables of the MIG-capable GPUs this project knows, and the arithmetic around
//! them (placements, overlap, capability-file minor numbers). The simulator serves them as
//! NVML would (`gpu-dra-sim`, its `mig` module); `gpu-dra advise` picks right-sized profiles
//! from them ([`table_for_product`]). Pure data, so both depend on one copy.
//!
//! Invariants: the tables reproduce the values real drivers of the R580 generation report
//! (`nvidia-smi mig -lgip` / `-lgipp`, `nvmlDeviceGetGpuInstanceProfileInfo`) for A100-40GB,
//! A100-80GB, H100-80GB and H200. Placement starts and sizes are in memory slices (8 per
//! GPU); `slice_count` is in compute slices (7 per GPU).

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of the API v13 header: profile indices at or above it
/// are invalid arguments, those below it that a GPU does not offer are "not supported".
pub const GI_PROFILE_INDEX_COUNT: u32 = 0x12;

/// Number of memory slices of every MIG-capable GPU simulated here.
pub const MEMORY_SLICES: u32 = 8;

/// One GPU-instance profile as NVML describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML profile index constant (`NVML_GPU_INSTANCE_PROFILE_1_SLICE` = 0, ...).
    pub index: u32,
    /// Profile ID (`info.id`, the number `nvidia-smi mig -cgi` takes), e.g. 19.
    pub id: u32,
    /// Marketed name without the `MIG ` prefix, e.g. `1g.5gb`.
    pub name: &'static str,
    /// Compute slices.
    pub slice_count: u32,
    /// Maximum number of instances of this profile on one GPU.
    pub instance_count: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg: u32,
    /// Optical-flow accelerators.
    pub ofa: u32,
    /// Valid placement starts, in memory slices.
    pub placement_starts: &'static [u32],
    /// Placement size, in memory slices.
    pub placement_size: u32,
}

impl GiProfile {
    /// The compute-instance profile constant of the default (full-size) compute instance:
    /// 1g -> 0, 2g -> 1, 3g -> 2, 4g -> 3, 7g -> 4.
    pub fn default_ci_profile(&self) -> u32 {
        match self.slice_count {
            1 => 0,
            2 => 1,
            3 => 2,
            4 => 3,
            _ => 4,
        }
    }

    /// Whether `start` is one of this profile's placements.
    pub fn is_valid_start(&self, start: u32) -> bool {
        self.placement_starts.contains(&start)
    }
}

/// Start set shared by the 1-slice profiles.
const ALL7: &[u32] = &[0, 1, 2, 3, 4, 5, 6];

macro_rules! gi {
    ($index:expr, $id:expr, $name:expr, $slices:expr, $count:expr, $mem:expr, $sm:expr,
     $ce:expr, $dec:expr, $enc:expr, $jpeg:expr, $ofa:expr, $starts:expr, $size:expr) => {
        GiProfile {
            index: $index,
            id: $id,
            name: $name,
            slice_count: $slices,
            instance_count: $count,
            memory_mib: $mem,
            multiprocessors: $sm,
            copy_engines: $ce,
            decoders: $dec,
            encoders: $enc,
            jpeg: $jpeg,
            ofa: $ofa,
            placement_starts: $starts,
            placement_size: $size,
        }
    };
}

/// A100-SXM4-40GB: profiles, engines, counts and placements as in NVIDIA's MIG User Guide
/// ("Supported MIG Profiles", and the `-lgip`/`-lgipp` output of "Getting Started with MIG",
/// <https://docs.nvidia.com/datacenter/tesla/mig-user-guide/>), memory and SMs as in
/// NVIDIA/go-nvml `pkg/nvml/mock/dgxa100` (values from real hardware).
const A100_40GB: &[GiProfile] = &[
    gi!(0x0, 19, "1g.5gb", 1, 7, 4864, 14, 1, 0, 0, 0, 0, ALL7, 1),
    gi!(
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
        2
    ),
    gi!(
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
        4
    ),
    gi!(0x3, 5, "4g.20gb", 4, 1, 19968, 56, 4, 2, 0, 0, 0, &[0], 4),
    gi!(0x4, 0, "7g.40gb", 7, 1, 40192, 98, 7, 5, 0, 1, 1, &[0], 8),
    gi!(0x7, 20, "1g.5gb+me", 1, 1, 4864, 14, 1, 1, 0, 1, 1, ALL7, 1),
    gi!(
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
        2
    ),
];

/// A100-SXM4-80GB / A100 80GB PCIe: profiles, engines and counts as in NVIDIA's MIG User
/// Guide, "Supported MIG Profiles" (A100 80GB table); memory sizes as `nvidia-smi mig -lgip`
/// reports them on real A100 80GB boards, the 7g one that of the R580 generation (it differs
/// between driver generations).
const A100_80GB: &[GiProfile] = &[
    gi!(0x0, 19, "1g.10gb", 1, 7, 9728, 14, 1, 0, 0, 0, 0, ALL7, 1),
    gi!(
        0x1,
        14,
        "2g.20gb",
        2,
        3,
        19968,
        28,
        2,
        1,
        0,
        0,
        0,
        &[0, 2, 4],
        2
    ),
    gi!(
        0x2,
        9,
        "3g.40gb",
        3,
        2,
        40192,
        42,
        3,
        2,
        0,
        0,
        0,
        &[0, 4],
        4
    ),
    gi!(0x3, 5, "4g.40gb", 4, 1, 40192, 56, 4, 2, 0, 0, 0, &[0], 4),
    gi!(0x4, 0, "7g.80gb", 7, 1, 80896, 98, 7, 5, 0, 1, 1, &[0], 8),
    gi!(
        0x7,
        20,
        "1g.10gb+me",
        1,
        1,
        9728,
        14,
        1,
        1,
        0,
        1,
        1,
        ALL7,
        1
    ),
    gi!(
        0x9,
        15,
        "1g.20gb",
        1,
        4,
        19968,
        14,
        1,
        1,
        0,
        0,
        0,
        &[0, 2, 4, 6],
        2
    ),
];

/// H100 80GB HBM3: profiles, engines and counts as in NVIDIA's MIG User Guide, "Supported
/// MIG Profiles" (H100 table), and its "Getting Started with MIG" (3g.40gb: 40448 MiB, 60
/// SMs on driver 580); memory sizes and SMs of every profile as `nvidia-smi mig -lgip` prints
/// them on a real H100 (for example <https://jbarrow.ai/field_notes/nvidia-mig>).
const H100_80GB: &[GiProfile] = &[
    gi!(0x0, 19, "1g.10gb", 1, 7, 9984, 16, 1, 1, 0, 1, 0, ALL7, 1),
    gi!(
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
        2
    ),
    gi!(
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
        4
    ),
    gi!(0x3, 5, "4g.40gb", 4, 1, 40448, 64, 4, 4, 0, 4, 0, &[0], 4),
    gi!(0x4, 0, "7g.80gb", 7, 1, 81152, 132, 8, 7, 0, 7, 1, &[0], 8),
    gi!(
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
        ALL7,
        1
    ),
    gi!(
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
        2
    ),
];

/// H200 141GB: profiles, engines and counts as in NVIDIA's MIG User Guide, "Supported MIG
/// Profiles" (H200 table); memory sizes and SMs from the `nvidia-smi mig -lgip` of an 8-GPU
/// H200 node in <https://github.com/NVIDIA/mig-parted/issues/120>. Placements are assumed to
/// be the H100's (not seen in any published output).
const H200: &[GiProfile] = &[
    gi!(0x0, 19, "1g.18gb", 1, 7, 16384, 16, 1, 1, 0, 1, 0, ALL7, 1),
    gi!(
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
        2
    ),
    gi!(
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
        4
    ),
    gi!(0x3, 5, "4g.71gb", 4, 1, 71168, 64, 4, 4, 0, 4, 0, &[0], 4),
    gi!(
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
        8
    ),
    gi!(
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
        ALL7,
        1
    ),
    gi!(
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
        2
    ),
];

/// Names of the MIG tables a profile may reference with `migTable`.
pub const TABLE_NAMES: &[&str] = &["a100-40gb", "a100-80gb", "h100-80gb", "h200"];

/// The MIG table called `name`, if known.
pub fn table(name: &str) -> Option<&'static [GiProfile]> {
    match name {
        "a100-40gb" => Some(A100_40GB),
        "a100-80gb" => Some(A100_80GB),
        "h100-80gb" => Some(H100_80GB),
        "h200" => Some(H200),
        _ => None,
    }
}

/// The MIG table of the GPU whose NVML product name (`productName` in our ResourceSlices) is
/// `product`; `None` for a GPU without MIG (T4, L4, L40S, consumer boards) or one whose table
/// is not known here (H100 NVL, H200 NVL, B200: their memory sizes differ).
pub fn table_for_product(product: &str) -> Option<&'static [GiProfile]> {
    let name = match product.trim() {
        "NVIDIA A100-SXM4-40GB" | "NVIDIA A100-PCIE-40GB" => "a100-40gb",
        "NVIDIA A100-SXM4-80GB" | "NVIDIA A100 80GB PCIe" => "a100-80gb",
        "NVIDIA H100 80GB HBM3" | "NVIDIA H100 PCIe" => "h100-80gb",
        "NVIDIA H200" => "h200",
        _ => return None,
    };
    table(name)
}

/// The profile with NVML index constant `index` in `table`.
pub fn by_index(table: &[GiProfile], index: u32) -> Option<&GiProfile> {
    table.iter().find(|p| p.index == index)
}

/// The profile with profile ID `id` in `table`.
pub fn by_id(table: &[GiProfile], id: u32) -> Option<&GiProfile> {
    table.iter().find(|p| p.id == id)
}

/// Whether the memory-slice ranges `[a, a+asize)` and `[b, b+bsize)` overlap.
pub fn overlaps(a: u32, asize: u32, b: u32, bsize: u32) -> bool {
    a < b + bsize && b < a + asize
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT`: CI profile constants at or above it are invalid.
pub const CI_PROFILE_INDEX_COUNT: u32 = 0x9;

/// Compute slices of the compute-instance profile constants A100/H100/H200 offer
/// (`_1_SLICE` .. `_7_SLICE`); the others (`_8_SLICE`, `_6_SLICE`, `_1_SLICE_REV1`,
/// `_7_SLICE_NVL`) are not offered. A CI profile's ID equals its constant.
pub fn ci_profile_slices(index: u32) -> Option<u32> {
    match index {
        0 => Some(1),
        1 => Some(2),
        2 => Some(3),
        3 => Some(4),
        4 => Some(7),
        _ => None,
    }
}

/// Placement starts, in compute slices, of a `ci_slices`-slice compute instance inside a GPU
/// instance of `gi_slices` compute slices: multiples of the CI size that fit, so a GI holds
/// `gi_slices / ci_slices` of them, as `instanceCount` says (`nvidia-smi mig -lcip` in
/// NVIDIA's MIG User Guide, "Getting Started with MIG"; NVIDIA/go-nvml
/// `pkg/nvml/mock/dgxa100`, A100 values from real hardware). The exact
/// starts for sizes that do not divide the GI (3c in 7g) are not documented; aligned starts
/// are this simulator's choice.
pub fn ci_placement_starts(ci_slices: u32, gi_slices: u32) -> Vec<u32> {
    if ci_slices == 0 || ci_slices > gi_slices {
        return Vec::new();
    }
    (0..gi_slices)
        .step_by(ci_slices as usize)
        .filter(|s| s + ci_slices <= gi_slices)
        .collect()
}

/// GPU instance IDs a GPU can have (0..15, the driver's `mig-minors` table).
pub const MAX_GPU_INSTANCES: u32 = 15;
/// Compute instance IDs a GPU instance can have (0..8).
pub const MAX_COMPUTE_INSTANCES: u32 = 8;

/// Minor number of `/dev/nvidia-caps/nvidia-cap<N>` for GPU instance `gi` of the GPU with
/// device minor `gpu_minor` (`/proc/driver/nvidia-caps/mig-minors`).
pub fn gi_cap_minor(gpu_minor: u32, gi: u32) -> u32 {
    3 + 135 * gpu_minor + 9 * gi
}

/// Minor number of the capability device of compute instance `ci` in GPU instance `gi`.
pub fn ci_cap_minor(gpu_minor: u32, gi: u32, ci: u32) -> u32 {
    gi_cap_minor(gpu_minor, gi) + 1 + ci
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The go-nvlib naming formula (NVIDIA/go-nvlib `pkg/nvlib/device/mig_profile.go`, which
    /// the DRA driver uses to name MIG profiles), used to check that a table's memory
    /// sizes give the marketed names against the parent's total memory.
    fn marketed_gb(profile_mib: u64, total_mib: u64) -> u64 {
        let total = total_mib as f64 * 1024.0 * 1024.0;
        let mem = profile_mib as f64 * 1024.0 * 1024.0;
        let gib = 1024.0 * 1024.0 * 1024.0;
        ((mem / total * 8.0).ceil() / 8.0 * (total / gib).ceil()).round() as u64
    }

    #[test]
    fn product_names_find_their_tables_and_gpus_without_mig_none() {
        let a100 = table_for_product("NVIDIA A100-SXM4-80GB").expect("A100 80GB");
        assert!(
            a100.iter()
                .any(|p| p.name == "1g.10gb" && p.memory_mib == 9728)
        );
        assert!(table_for_product("NVIDIA A100 80GB PCIe").is_some());
        assert_eq!(
            table_for_product("NVIDIA A100-PCIE-40GB").map(|t| t[0].name),
            Some("1g.5gb")
        );
        for none in [
            "Tesla T4",
            "NVIDIA L4",
            "NVIDIA L40S",
            "NVIDIA H100 NVL",
            "",
        ] {
            assert!(table_for_product(none).is_none(), "{none}");
        }
    }

    #[test]
    fn names_follow_the_go_nvlib_formula() {
        for (key, total) in [
            ("a100-40gb", 40960),
            ("a100-80gb", 81920),
            ("h100-80gb", 81559),
            ("h200", 143771),
        ] {
            for p in table(key).expect("table") {
                let gb = marketed_gb(p.memory_mib, total);
                let base = p.name.trim_end_matches("+me");
                assert_eq!(
                    base,
                    format!("{}g.{}gb", p.slice_count, gb),
                    "{key} profile {}",
                    p.id
                );
            }
        }
    }

    #[test]
    fn placements_fit_in_eight_memory_slices() {
        for key in TABLE_NAMES {
            for p in table(key).expect("table") {
                for s in p.placement_starts {
                    assert!(s + p.placement_size <= MEMORY_SLICES, "{key} {}", p.name);
                }
                assert!(p.instance_count as usize <= p.placement_starts.len());
            }
        }
    }

    #[test]
    fn cap_minors_match_the_driver_table() {
        assert_eq!(gi_cap_minor(0, 1), 12);
        assert_eq!(ci_cap_minor(0, 1, 0), 13);
        assert_eq!(ci_cap_minor(0, 1, 2), 15);
        assert_eq!(ci_cap_minor(3, 3, 3), 439);
        assert_eq!(ci_cap_minor(6, 11, 7), 920);
        assert_eq!(ci_cap_minor(31, 14, 7), 4322);
    }

    #[test]
    fn compute_instances_fill_their_gpu_instance_instance_count_times() {
        assert_eq!(ci_placement_starts(1, 7), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(ci_placement_starts(2, 7), [0, 2, 4]);
        assert_eq!(ci_placement_starts(3, 7), [0, 3]);
        assert_eq!(ci_placement_starts(7, 7), [0]);
        assert_eq!(ci_placement_starts(2, 3), [0]);
        assert_eq!(ci_placement_starts(2, 4), [0, 2]);
        assert!(ci_placement_starts(4, 3).is_empty());
        for index in 0..CI_PROFILE_INDEX_COUNT {
            if let Some(c) = ci_profile_slices(index) {
                for g in [1, 2, 3, 4, 7] {
                    let n = ci_placement_starts(c, g).len() as u32;
                    assert_eq!(n, if c <= g { g / c } else { 0 }, "{c}c in {g}g");
                }
            }
        }
    }

    #[test]
    fn overlap_is_half_open() {
        assert!(!overlaps(0, 1, 1, 1));
        assert!(overlaps(0, 2, 1, 1));
        assert!(overlaps(4, 4, 6, 2));
        assert!(!overlaps(0, 4, 4, 4));
    }
}
