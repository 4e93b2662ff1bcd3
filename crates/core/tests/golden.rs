//! Golden ResourceSlices per simulator profile: what a node with that fleet publishes.
//!
//! The files under `tests/golden/` are reviewed artefacts: a change in device names,
//! attributes or capacities shows up as a diff there. `UPDATE_GENERATED=1` (`make generate`)
//! rewrites them; otherwise the test fails on any difference.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use gpu_dra_core::consumable_shares::ConsumableShares;
use gpu_dra_core::dynamic_mig;
use gpu_dra_core::list_forms;
use gpu_dra_core::partitioning::{self, GpuSelection, Partitioning};
use gpu_dra_core::slices::{self, SliceParams};
use gpu_dra_device::testing::{a100, a100_dynamic, inventory, mig_1g5gb};
use gpu_dra_device::{GpuInventory, Inventory};
use gpu_dra_nvml::{NvmlInventory, NvmlOptions};
use gpu_dra_sim::testing::SimHost;

const PROFILES: [&str; 11] = [
    "t4",
    "rtx4090",
    "p4",
    "dgx-a100-40gb",
    "dgx-h100",
    "h200",
    "a100-pcie-x4-nvlink",
    "h100-pcie-x8-nvlink",
    "l40s-x8",
    "dgx1-v100",
    "hgx-a100-80gb-x4",
];

const SIM_NODE: SliceParams<'static> = SliceParams {
    node_name: "sim-node",
    driver_name: "gpu.nvidia.com",
    generation: 1,
};

fn discover(profile: &str) -> Inventory {
    let host = SimHost::new(profile);
    NvmlInventory::new(NvmlOptions {
        library: gpu_dra_nvml::NvmlLibrary::Path(host.lib_path()),
        sysfs_root: host.sysfs_root(),
    })
    .discover()
    .expect("discovery over the simulator")
}

fn render(profile: &str) -> String {
    let rendered = slices::render_slices(&discover(profile), &SIM_NODE);
    assert!(rendered.warnings.is_empty(), "{:?}", rendered.warnings);
    let mut text = serde_json::to_string_pretty(&rendered.slices).expect("serialisable");
    text.push('\n');
    text
}

/// The DGX-1's hybrid cube-mesh with `--list-type-attributes`, as sent to the API server
/// (`list_forms::wire`): every all-to-all NVLink set per GPU, the NUMA node as a one-element
/// list. Also validated by `e2e/harness/slices_validation_test.go`.
const LIST_FORMS_GOLDEN: &str = "dgx1-v100-list-attributes";

fn wire_with_lists(profile: &str) -> Vec<serde_json::Value> {
    let inventory = discover(profile);
    let mut rendered = slices::render_slices(&inventory, &SIM_NODE);
    list_forms::apply(&mut rendered, &inventory, &SIM_NODE);
    assert!(rendered.warnings.is_empty(), "{:?}", rendered.warnings);
    rendered
        .slices
        .iter()
        .map(|s| list_forms::wire(s).expect("wire form"))
        .collect()
}

fn render_list_forms() -> String {
    let mut text =
        serde_json::to_string_pretty(&wire_with_lists("dgx1-v100")).expect("serialisable");
    text.push('\n');
    text
}

/// A node with one dynamic MIG A100 (MIG on, no instances, every profile), one whole A100 and
/// one A100 with a static `1g.5gb`: the three ways a GPU is published, in one pool. Also read by
/// the Go test `e2e/harness/slices_validation_test.go`, which runs Kubernetes' own validation
/// on it.
const DYNAMIC_MIG_GOLDEN: &str = "dynamic-mig-a100";

fn render_dynamic_mig() -> String {
    let gpus = [
        a100_dynamic(0).build(),
        a100(1).build(),
        a100(2).mig(mig_1g5gb(0)).build(),
    ];
    let dynamic = BTreeSet::from([gpus[0].uuid.clone()]);
    let rendered = dynamic_mig::render_pool(
        &inventory(gpus),
        &SliceParams {
            node_name: "sim-node",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        },
        &BTreeMap::new(),
        &dynamic,
    );
    assert!(rendered.warnings.is_empty(), "{:?}", rendered.warnings);
    let mut text = serde_json::to_string_pretty(&rendered.slices).expect("serialisable");
    text.push('\n');
    text
}

/// A node with two whole A100s, the first offered as memory shares: one device that allows
/// multiple allocations with a request policy on `memory`, one single-allocation device. Also
/// validated by `e2e/harness/slices_validation_test.go`.
const MEMORY_SHARE_GOLDEN: &str = "memory-shares-a100";

fn render_memory_shares() -> String {
    let inv = inventory([a100(0).build(), a100(1).build()]);
    let partitioning = Partitioning {
        memory_shares: GpuSelection::parse("0").expect("selection"),
        ..Partitioning::default()
    };
    let rendered = partitioning::render(
        &inv,
        &SliceParams {
            node_name: "sim-node",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        },
        &BTreeMap::new(),
        &partitioning,
        &BTreeSet::new(),
    );
    assert!(rendered.warnings.is_empty(), "{:?}", rendered.warnings);
    let mut text = serde_json::to_string_pretty(&rendered.slices).expect("serialisable");
    text.push('\n');
    text
}

/// A node with NVIDIA's consumable shares at `4`: a whole A100 and an A100 with a static
/// `1g.5gb`, both multi-allocatable with a `memory` policy (default 0) and 4 `shares`. Also
/// validated by `e2e/harness/slices_validation_test.go`.
const CONSUMABLE_SHARES_GOLDEN: &str = "consumable-shares-a100";

fn render_consumable_shares() -> String {
    let inv = inventory([a100(0).build(), a100(1).mig(mig_1g5gb(0)).build()]);
    let partitioning = Partitioning {
        consumable_shares: ConsumableShares::Count(4),
        ..Partitioning::default()
    };
    let rendered = partitioning::render(
        &inv,
        &SliceParams {
            node_name: "sim-node",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        },
        &BTreeMap::new(),
        &partitioning,
        &BTreeSet::new(),
    );
    assert!(rendered.warnings.is_empty(), "{:?}", rendered.warnings);
    let mut text = serde_json::to_string_pretty(&rendered.slices).expect("serialisable");
    text.push('\n');
    text
}

#[test]
fn generated_golden_slices_are_fresh() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let update = std::env::var_os("UPDATE_GENERATED").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    let renderings = PROFILES
        .iter()
        .map(|profile| (*profile, render(profile)))
        .chain([
            (DYNAMIC_MIG_GOLDEN, render_dynamic_mig()),
            (MEMORY_SHARE_GOLDEN, render_memory_shares()),
            (CONSUMABLE_SHARES_GOLDEN, render_consumable_shares()),
            (LIST_FORMS_GOLDEN, render_list_forms()),
        ]);
    for (name, want) in renderings {
        let path = dir.join(format!("{name}.json"));
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        if have == want {
            continue;
        }
        if update {
            std::fs::write(&path, &want).expect("writing golden file");
        } else {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "golden slices differ from the rendering: {stale:?}; run `make generate` and review the diff"
    );
}

#[test]
fn dgx_a100_golden_has_4_whole_gpus_and_16_mig_devices() {
    let slices: serde_json::Value = serde_json::from_str(&render("dgx-a100-40gb")).expect("json");
    let devices = slices[0]["spec"]["devices"].as_array().expect("devices");
    let kind = |d: &serde_json::Value| {
        d["attributes"]["type"]["string"]
            .as_str()
            .map(str::to_string)
    };
    assert_eq!(
        devices
            .iter()
            .filter(|d| kind(d).as_deref() == Some("gpu"))
            .count(),
        4
    );
    assert_eq!(
        devices
            .iter()
            .filter(|d| kind(d).as_deref() == Some("mig"))
            .count(),
        16
    );
    let mig = &devices[0];
    assert_eq!(mig["name"], "gpu-0-mig-3g20gb-9-4");
    assert_eq!(mig["attributes"]["profile"]["string"], "3g.20gb");
    assert_eq!(mig["attributes"]["driverVersion"]["version"], "580.95.5");
    assert_eq!(mig["attributes"]["cudaDriverVersion"]["version"], "13.0.0");
    assert_eq!(mig["capacity"]["memory"]["value"], "19968Mi");
    assert_eq!(mig["capacity"]["multiprocessors"]["value"], "42");
    let whole = &devices[16];
    assert_eq!(whole["name"], "gpu-4");
    assert_eq!(whole["capacity"]["memory"]["value"], "40Gi");
    // NPS4: GPU 4 of the DGX A100 is on NUMA node 7.
    assert_eq!(
        whole["attributes"]["resource.kubernetes.io/numaNode"]["int"],
        7
    );
    assert_eq!(
        whole["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
        "pci0000:80"
    );
}

/// Devices grouped by `nvlinkDomain`, as discovered through the simulator's NVML.
fn nvlink_domains(profile: &str) -> Vec<Vec<String>> {
    let slices: serde_json::Value = serde_json::from_str(&render(profile)).expect("json");
    let mut by: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in slices[0]["spec"]["devices"].as_array().expect("devices") {
        if let Some(v) = d["attributes"]["nvlinkDomain"]["string"].as_str() {
            by.entry(v.to_string())
                .or_default()
                .push(d["name"].as_str().expect("name").to_string());
        }
    }
    let mut groups: Vec<Vec<String>> = by.into_values().collect();
    groups.sort();
    groups
}

#[test]
fn nvlink_domains_follow_each_hosts_real_topology() {
    let names = |g: &[&[u32]]| -> Vec<Vec<String>> {
        g.iter()
            .map(|s| s.iter().map(|i| format!("gpu-{i}")).collect())
            .collect()
    };
    // NVSwitch: one domain; GPUs 0-3 of the DGX A100 are in MIG mode (no peer-to-peer).
    assert_eq!(
        nvlink_domains("dgx-h100"),
        names(&[&[0, 1, 2, 3, 4, 5, 6, 7]])
    );
    assert_eq!(nvlink_domains("dgx-a100-40gb"), names(&[&[4, 5, 6, 7]]));
    // Bridge pairs, adjacent or not, one across sockets.
    assert_eq!(
        nvlink_domains("a100-pcie-x4-nvlink"),
        names(&[&[0, 1], &[2, 3]])
    );
    assert_eq!(
        nvlink_domains("h100-pcie-x8-nvlink"),
        names(&[&[0, 5], &[1, 2], &[3, 4], &[6, 7]])
    );
    // Hybrid cube-mesh: connected, not all-to-all; the scalar takes the two quads.
    assert_eq!(
        nvlink_domains("dgx1-v100"),
        names(&[&[0, 1, 2, 3], &[4, 5, 6, 7]])
    );
    // No NVLink: no attribute, so the slices are what they were.
    for p in ["l40s-x8", "t4", "p4", "rtx4090", "h200"] {
        assert!(nvlink_domains(p).is_empty(), "{p}");
    }
}

/// With list forms, a `matchAttribute` on `nvlinkDomain` (a value common to every device)
/// holds exactly for sets of GPUs that are pairwise NVLink peers: on the cube-mesh the cross
/// pairs 0-4, 1-5, 2-6 and 3-7 are offered too, and 0-5 never.
#[test]
fn list_forms_offer_exactly_the_pairwise_linked_sets() {
    let slices = wire_with_lists("dgx1-v100");
    let lists: BTreeMap<String, BTreeSet<String>> = slices[0]["spec"]["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| {
            let values = d["attributes"]["nvlinkDomain"]["strings"]
                .as_array()
                .expect("a list on every GPU")
                .iter()
                .map(|v| v.as_str().expect("string").to_string())
                .collect();
            (d["name"].as_str().expect("name").to_string(), values)
        })
        .collect();
    let shared = |a: u32, b: u32| {
        lists[&format!("gpu-{a}")]
            .intersection(&lists[&format!("gpu-{b}")])
            .count()
            > 0
    };
    // Links of the DGX-1 (the sim's profile, as its real `topo -m` shows).
    let linked = [
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 2),
        (1, 3),
        (1, 5),
        (2, 3),
        (2, 6),
        (3, 7),
        (4, 5),
        (4, 6),
        (4, 7),
        (5, 6),
        (5, 7),
        (6, 7),
    ];
    for a in 0..8 {
        for b in a + 1..8 {
            assert_eq!(shared(a, b), linked.contains(&(a, b)), "GPUs {a} and {b}");
        }
    }
    // Three GPUs share a value only when all three pairs are linked: 0, 1, 4 do not.
    let common3 = lists["gpu-0"]
        .intersection(&lists["gpu-1"])
        .filter(|v| lists["gpu-4"].contains(*v))
        .count();
    assert_eq!(common3, 0);
    // Hosts without NVLink: only the NUMA node changes form.
    for d in wire_with_lists("l40s-x8")[0]["spec"]["devices"]
        .as_array()
        .expect("devices")
    {
        assert!(d["attributes"].get("nvlinkDomain").is_none());
        assert!(d["attributes"]["resource.kubernetes.io/numaNode"]["ints"].is_array());
    }
}
