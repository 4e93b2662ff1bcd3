//! Where a simulated host's GPUs sit: NVLink links (to peer GPUs or to NVSwitches), the PCIe
//! tree and the NUMA nodes, and the answers NVML and `nvidia-smi topo -m` derive from them.
//!
//! The profile describes the hardware (see [`crate::profile::GpuSpec::nvlinks`],
//! `pcieSwitch`, `pcieRoot`, `numaNode`, and [`crate::profile::Profile::nvswitches`]); this
//! module answers the pair questions from it. Pure: no state file, no FFI, so the library and
//! the `nvidia-smi` stand-in give the same answers.
//!
//! Model (what the real driver reports, see the project's topology notes):
//! - A GPU's links are numbered in the order its `nvlinks` entries list them; an entry of `n`
//!   links takes the next `n` numbers. Link numbers at or above the count are
//!   `INVALID_ARGUMENT`; a GPU without links answers `NOT_SUPPORTED` to every link query.
//! - A link to an NVSwitch reports the switch as the remote end (device type SWITCH, the
//!   switch's PCI address), never the peer GPU. Two GPUs that reach a common switch are
//!   NVLink peers with the smaller of their switch link counts (`NV12` on a DGX A100).
//! - Peer-to-peer over NVLink needs a direct link or a common switch, and neither GPU in MIG
//!   mode (MIG has no GPU-to-GPU peer-to-peer). PCIe peer-to-peer works within a NUMA node
//!   and is `CHIPSET_NOT_SUPPORTED` across sockets (an assumption, not checked on hardware).
//! - Common ancestor: one PCIe switch `SINGLE` (PIX), one root complex `MULTIPLE` (PXB), one
//!   NUMA node `NODE`, else `SYSTEM`; the GPU with itself `INTERNAL`.

use crate::profile::{GpuSpec, NvLinkSpec, Profile};

/// `nvmlGpuTopologyLevel_t` values.
pub mod level {
    /// The same board (the GPU with itself).
    pub const INTERNAL: u32 = 0;
    /// One PCIe switch.
    pub const SINGLE: u32 = 10;
    /// Several PCIe switches, no host bridge.
    pub const MULTIPLE: u32 = 20;
    /// One host bridge.
    pub const HOSTBRIDGE: u32 = 30;
    /// One NUMA node.
    pub const NODE: u32 = 40;
    /// Across the SMP interconnect.
    pub const SYSTEM: u32 = 50;
}

/// `nvmlGpuP2PCapsIndex_t` values.
pub mod p2p_caps {
    /// Read.
    pub const READ: u32 = 0;
    /// Write.
    pub const WRITE: u32 = 1;
    /// NVLink.
    pub const NVLINK: u32 = 2;
    /// Atomics.
    pub const ATOMICS: u32 = 3;
    /// PCI (`PROP`).
    pub const PCI: u32 = 4;
}

/// `nvmlGpuP2PStatus_t` values.
pub mod p2p_status {
    /// Supported.
    pub const OK: u32 = 0;
    /// The chipset does not support it (across sockets).
    pub const CHIPSET_NOT_SUPPORTED: u32 = 1;
    /// Not supported (no NVLink, or MIG mode).
    pub const NOT_SUPPORTED: u32 = 5;
}

/// `nvmlIntNvLinkDeviceType_t` values.
pub mod remote_type {
    /// A GPU.
    pub const GPU: u32 = 0x00;
    /// An NVSwitch.
    pub const SWITCH: u32 = 0x02;
}

/// The remote end of one NVLink link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteEnd {
    /// A peer GPU at this PCI bus ID.
    Gpu(String),
    /// NVSwitch number `n` of the profile's `nvswitches`.
    Switch(usize),
}

/// The NVLink version the profile's GPUs speak (3 on Ampere, 4 on Hopper, 2 on Volta).
pub fn nvlink_version(gpu: &GpuSpec) -> u32 {
    match gpu.architecture.as_str() {
        "Volta" => 2,
        "Ampere" => 3,
        "Hopper" | "Ada" => 4,
        "Blackwell" => 5,
        _ => 1,
    }
}

/// Number of NVLink links of `gpu`.
pub fn link_count(gpu: &GpuSpec) -> u32 {
    gpu.nvlinks.iter().map(|l| l.links).sum()
}

/// The remote end of link `link` of `gpu`; `None` past the last link.
pub fn remote_end(gpu: &GpuSpec, link: u32) -> Option<RemoteEnd> {
    let mut first = 0;
    for l in &gpu.nvlinks {
        if link < first + l.links {
            return Some(end_of(l));
        }
        first += l.links;
    }
    None
}

fn end_of(l: &NvLinkSpec) -> RemoteEnd {
    match (&l.gpu, l.switch) {
        (Some(bus), _) => RemoteEnd::Gpu(bus.clone()),
        (None, Some(n)) => RemoteEnd::Switch(n),
        (None, None) => RemoteEnd::Switch(0),
    }
}

fn switch_links(gpu: &GpuSpec) -> Vec<(usize, u32)> {
    gpu.nvlinks
        .iter()
        .filter(|l| l.gpu.is_none())
        .map(|l| (l.switch.unwrap_or(0), l.links))
        .collect()
}

/// NVLink links between `a` and `b` as `topo -m` counts them (`NV<n>`): the direct links
/// between them, or through NVSwitches the smaller of their switch link counts when they
/// reach a common switch. 0 when not NVLink peers.
pub fn nvlinks_between(a: &GpuSpec, b: &GpuSpec) -> u32 {
    if a.pci() == b.pci() {
        return 0;
    }
    let direct: u32 = a
        .nvlinks
        .iter()
        .filter(|l| {
            l.gpu
                .as_deref()
                .and_then(crate::profile::PciAddress::parse)
                .is_some_and(|p| p == b.pci())
        })
        .map(|l| l.links)
        .sum();
    let (sa, sb) = (switch_links(a), switch_links(b));
    let common = sa.iter().any(|(s, _)| sb.iter().any(|(t, _)| s == t));
    let via_switch = if common {
        let total = |v: &[(usize, u32)]| v.iter().map(|(_, n)| n).sum::<u32>();
        total(&sa).min(total(&sb))
    } else {
        0
    };
    direct + via_switch
}

/// `nvmlDeviceGetTopologyCommonAncestor` for GPUs `a` and `b`.
pub fn common_ancestor(a: &GpuSpec, b: &GpuSpec) -> u32 {
    if a.pci() == b.pci() {
        level::INTERNAL
    } else if a.pcie_switch.is_some() && a.pcie_switch == b.pcie_switch {
        level::SINGLE
    } else if a.pcie_root == b.pcie_root {
        level::MULTIPLE
    } else if a.numa_node == b.numa_node {
        level::NODE
    } else {
        level::SYSTEM
    }
}

/// `nvmlDeviceGetP2PStatus` for GPUs `a` and `b` (MIG mode of each given) and capability
/// `caps`; `None` for a capability index NVML does not define.
pub fn p2p_status(a: &GpuSpec, a_mig: bool, b: &GpuSpec, b_mig: bool, caps: u32) -> Option<u32> {
    if caps > p2p_caps::PCI {
        return None;
    }
    if a_mig || b_mig {
        return Some(p2p_status::NOT_SUPPORTED);
    }
    let nvlink = nvlinks_between(a, b) > 0;
    Some(match caps {
        p2p_caps::NVLINK if nvlink => p2p_status::OK,
        p2p_caps::NVLINK => p2p_status::NOT_SUPPORTED,
        p2p_caps::READ | p2p_caps::WRITE | p2p_caps::ATOMICS if nvlink => p2p_status::OK,
        _ if a.numa_node == b.numa_node => p2p_status::OK,
        _ => p2p_status::CHIPSET_NOT_SUPPORTED,
    })
}

/// The `topo -m` label of a GPU pair: `X`, `NV<n>`, `PIX`, `PXB`, `PHB`, `NODE` or `SYS`.
pub fn matrix_label(a: &GpuSpec, b: &GpuSpec) -> String {
    if a.pci() == b.pci() {
        return " X ".into();
    }
    let n = nvlinks_between(a, b);
    if n > 0 {
        return format!("NV{n}");
    }
    match common_ancestor(a, b) {
        level::SINGLE => "PIX",
        level::MULTIPLE => "PXB",
        level::HOSTBRIDGE => "PHB",
        level::NODE => "NODE",
        _ => "SYS",
    }
    .into()
}

/// The legend `nvidia-smi topo -m` prints under the matrix, verbatim.
pub const LEGEND: &str = "Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
";

/// `nvidia-smi topo -m` for the GPUs of `profile` (those the process sees), in the driver's
/// tab-separated layout with the `CPU Affinity`, `NUMA Affinity` and `GPU NUMA ID` columns.
pub fn matrix(profile: &Profile) -> String {
    let gpus = &profile.gpus;
    let mut s = String::from("\t");
    for i in 0..gpus.len() {
        s.push_str(&format!("GPU{i}\t"));
    }
    s.push_str("CPU Affinity\tNUMA Affinity\tGPU NUMA ID\n");
    for (i, a) in gpus.iter().enumerate() {
        s.push_str(&format!("GPU{i}\t"));
        for b in gpus {
            s.push_str(&matrix_label(a, b));
            s.push('\t');
        }
        let cpus = a.cpu_affinity.as_deref().unwrap_or("N/A");
        s.push_str(&format!("{cpus}\t{}\t\tN/A\n", a.numa_node));
    }
    s.push('\n');
    s.push_str(LEGEND);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(profile: &str) -> Vec<Vec<String>> {
        let p = Profile::load(profile).expect(profile);
        p.gpus
            .iter()
            .map(|a| {
                p.gpus
                    .iter()
                    .map(|b| matrix_label(a, b).trim().to_string())
                    .collect()
            })
            .collect()
    }

    fn row(r: &[String]) -> String {
        r.join(" ")
    }

    #[test]
    fn dgx_a100_is_nv12_all_to_all_through_switches_on_four_numa_nodes() {
        let m = rows("dgx-a100-40gb");
        for (i, r) in m.iter().enumerate() {
            for (j, l) in r.iter().enumerate() {
                assert_eq!(l, if i == j { "X" } else { "NV12" }, "{i},{j}");
            }
        }
        let p = Profile::load("dgx-a100-40gb").expect("profile");
        let numa: Vec<u32> = p.gpus.iter().map(|g| g.numa_node).collect();
        // NPS4, as the real DGX A100's `topo -m` shows.
        assert_eq!(numa, [3, 3, 1, 1, 7, 7, 5, 5]);
        // Every link ends at a switch, never at the peer GPU.
        for g in &p.gpus {
            assert_eq!(link_count(g), 12);
            for l in 0..12 {
                assert!(matches!(remote_end(g, l), Some(RemoteEnd::Switch(_))));
            }
            assert_eq!(remote_end(g, 12), None);
        }
    }

    #[test]
    fn dgx_h100_is_nv18_with_two_sockets() {
        let m = rows("dgx-h100");
        assert_eq!(row(&m[0]), "X NV18 NV18 NV18 NV18 NV18 NV18 NV18");
        let p = Profile::load("dgx-h100").expect("profile");
        assert_eq!(
            p.gpus.iter().map(|g| g.numa_node).collect::<Vec<_>>(),
            [0, 0, 0, 0, 1, 1, 1, 1]
        );
    }

    #[test]
    fn a100_pcie_bridge_pairs_are_the_real_matrix() {
        // kubernetes-sigs/dra-driver-nvidia-gpu#214.
        let m = rows("a100-pcie-x4-nvlink");
        assert_eq!(row(&m[0]), "X NV12 SYS SYS");
        assert_eq!(row(&m[1]), "NV12 X SYS SYS");
        assert_eq!(row(&m[2]), "SYS SYS X NV12");
        assert_eq!(row(&m[3]), "SYS SYS NV12 X");
    }

    #[test]
    fn h100_pcie_pairs_are_not_adjacent_and_one_crosses_sockets() {
        let m = rows("h100-pcie-x8-nvlink");
        assert_eq!(row(&m[0]), "X NODE NODE SYS SYS NV12 SYS SYS");
        assert_eq!(row(&m[5]), "NV12 SYS SYS NODE NODE X NODE NODE");
        assert_eq!(row(&m[1]), "NODE X NV12 SYS SYS SYS SYS SYS");
        assert_eq!(row(&m[6]), "SYS SYS SYS NODE NODE NODE X NV12");
    }

    #[test]
    fn l40s_has_pix_pairs_node_within_a_socket_sys_across() {
        let m = rows("l40s-x8");
        assert_eq!(row(&m[0]), "X PIX NODE NODE SYS SYS SYS SYS");
        assert_eq!(row(&m[5]), "SYS SYS SYS SYS PIX X NODE NODE");
        let p = Profile::load("l40s-x8").expect("profile");
        assert!(p.gpus.iter().all(|g| link_count(g) == 0));
        assert_eq!(
            p2p_status(&p.gpus[0], false, &p.gpus[1], false, p2p_caps::NVLINK),
            Some(p2p_status::NOT_SUPPORTED)
        );
        assert_eq!(
            p2p_status(&p.gpus[0], false, &p.gpus[1], false, p2p_caps::READ),
            Some(p2p_status::OK)
        );
        assert_eq!(
            p2p_status(&p.gpus[0], false, &p.gpus[4], false, p2p_caps::READ),
            Some(p2p_status::CHIPSET_NOT_SUPPORTED)
        );
    }

    #[test]
    fn dgx1_is_a_hybrid_cube_mesh() {
        let m = rows("dgx1-v100");
        assert_eq!(row(&m[0]), "X NV1 NV1 NV2 NV2 SYS SYS SYS");
        assert_eq!(row(&m[7]), "SYS SYS SYS NV1 NV2 NV1 NV2 X");
        let p = Profile::load("dgx1-v100").expect("profile");
        for g in &p.gpus {
            assert_eq!(link_count(g), 6, "{}", g.pci_bus_id);
        }
    }

    #[test]
    fn hgx_a100_80gb_x4_is_nv4_all_to_all_without_switches() {
        // The HGX A100 4-GPU board: each GPU's 12 links go 4 to each peer, no NVSwitch.
        let m = rows("hgx-a100-80gb-x4");
        assert_eq!(row(&m[0]), "X NV4 NV4 NV4");
        assert_eq!(row(&m[3]), "NV4 NV4 NV4 X");
        let p = Profile::load("hgx-a100-80gb-x4").expect("profile");
        for g in &p.gpus {
            assert_eq!(link_count(g), 12, "{}", g.pci_bus_id);
            assert_eq!(g.memory_mib, 81920);
            assert!(!g.mig_enabled);
        }
        assert!(p.nvswitches.is_empty());
    }

    #[test]
    fn links_are_symmetric_and_mig_mode_stops_peer_to_peer() {
        for name in crate::profile::builtin_names() {
            let p = Profile::load(name).expect(name);
            for a in &p.gpus {
                for b in &p.gpus {
                    assert_eq!(nvlinks_between(a, b), nvlinks_between(b, a), "{name}");
                }
            }
        }
        let p = Profile::load("dgx-h100").expect("profile");
        let (a, b) = (&p.gpus[0], &p.gpus[1]);
        assert_eq!(
            p2p_status(a, false, b, false, p2p_caps::NVLINK),
            Some(p2p_status::OK)
        );
        assert_eq!(
            p2p_status(a, true, b, false, p2p_caps::NVLINK),
            Some(p2p_status::NOT_SUPPORTED)
        );
        assert_eq!(p2p_status(a, false, b, false, 5), None);
        assert_eq!(common_ancestor(a, a), level::INTERNAL);
    }

    #[test]
    fn the_matrix_has_the_real_columns_and_legend() {
        let p = Profile::load("a100-pcie-x4-nvlink").expect("profile");
        let text = matrix(&p);
        let first = text.lines().next().expect("header");
        assert_eq!(
            first,
            "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
        );
        assert!(
            text.contains("GPU0\t X \tNV12\tSYS\tSYS\t0-23\t0\t\tN/A\n"),
            "{text}"
        );
        assert!(text.contains("  NV#  = Connection traversing a bonded set of # NVLinks"));
    }
}
