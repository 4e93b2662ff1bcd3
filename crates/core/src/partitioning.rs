//! How each GPU of a node is offered: statically (as it is: a whole GPU, or its existing MIG
//! devices), as **dynamic MIG** (every MIG profile placement, created at prepare), or as
//! **memory shares** (one GPU allocated to several claims, each consuming an amount of its
//! memory). On top of that, NVIDIA's node-wide **consumable shares**
//! ([`crate::consumable_shares`], `--consumable-shares`) make every whole GPU and MIG device
//! of the statically offered GPUs one several claims may hold; a GPU selected for dynamic MIG
//! or memory shares keeps that form (the per-GPU selection wins).
//!
//! Static is the default. The chart sets a node-wide default through the plugin's flags
//! (`--dynamic-mig-gpus`, `--memory-share-gpus`); a node overrides it with the annotations
//! [`DYNAMIC_MIG_ANNOTATION`] / [`MEMORY_SHARE_ANNOTATION`] on its Node object (an admin marks
//! one node's GPUs without a chart change). Each setting is a [`GpuSelection`]: empty (none),
//! `all`, or a comma-separated list of GPU indexes, minor numbers (`gpu-<minor>` names them) or
//! UUIDs. A GPU selected for both is refused for both (static), with a warning: the two ways
//! of sharing a GPU exclude each other.

use std::collections::{BTreeMap, BTreeSet};

use gpu_dra_device::{Gpu, Inventory};

use crate::consumable_shares::ConsumableShares;
use crate::health::Taint;
use crate::slices::{Rendered, SliceParams};

/// Node annotation selecting dynamic MIG GPUs (overrides `--dynamic-mig-gpus`).
pub const DYNAMIC_MIG_ANNOTATION: &str = "gpu.nvidia.com/dynamic-mig-gpus";
/// Node annotation selecting memory-share GPUs (overrides `--memory-share-gpus`).
pub const MEMORY_SHARE_ANNOTATION: &str = "gpu.nvidia.com/memory-share-gpus";

/// A set of GPUs named by index, minor (`gpu-<minor>` or the number) or UUID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GpuSelection {
    /// No GPU.
    #[default]
    None,
    /// Every GPU.
    All,
    /// The GPUs named.
    Some(BTreeSet<String>),
}

impl GpuSelection {
    /// Parses `""`, `all`, `none` or a comma-separated list; says what is wrong with an entry.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text.eq_ignore_ascii_case("none") {
            return Ok(GpuSelection::None);
        }
        if text.eq_ignore_ascii_case("all") {
            return Ok(GpuSelection::All);
        }
        let mut names = BTreeSet::new();
        for item in text.split(',').map(str::trim) {
            let valid = !item.is_empty()
                && (item.bytes().all(|b| b.is_ascii_digit())
                    || item
                        .strip_prefix("gpu-")
                        .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
                    || item.starts_with("GPU-"));
            if !valid {
                return Err(format!(
                    "{item:?} names no GPU (expected all, none, or a comma-separated list of GPU indexes, gpu-<minor> names or GPU-... UUIDs)"
                ));
            }
            names.insert(item.to_string());
        }
        Ok(GpuSelection::Some(names))
    }

    /// Whether `gpu` is selected.
    pub fn contains(&self, gpu: &Gpu) -> bool {
        match self {
            GpuSelection::None => false,
            GpuSelection::All => true,
            GpuSelection::Some(names) => {
                names.contains(&gpu.uuid)
                    || names.contains(&gpu.index.to_string())
                    || names.contains(&gpu.device_name())
            }
        }
    }
}

/// How one GPU is offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMode {
    /// As it is (whole GPU, or its existing MIG devices).
    Static,
    /// MIG instances created on demand at every profile placement.
    DynamicMig,
    /// Several claims, each an amount of its memory.
    MemoryShares,
}

/// The node's partitioning settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partitioning {
    /// GPUs offered as dynamic MIG.
    pub dynamic_mig: GpuSelection,
    /// GPUs offered as memory shares.
    pub memory_shares: GpuSelection,
    /// NVIDIA's node-wide consumable shares, for the devices of statically offered GPUs.
    pub consumable_shares: ConsumableShares,
}

impl Partitioning {
    /// The mode of `gpu` (static when selected for both).
    pub fn mode(&self, gpu: &Gpu) -> GpuMode {
        match (
            self.dynamic_mig.contains(gpu),
            self.memory_shares.contains(gpu),
        ) {
            (true, false) => GpuMode::DynamicMig,
            (false, true) => GpuMode::MemoryShares,
            _ => GpuMode::Static,
        }
    }

    /// UUIDs of the GPUs in `mode`.
    pub fn uuids(&self, inventory: &Inventory, mode: GpuMode) -> BTreeSet<String> {
        inventory
            .gpus
            .iter()
            .filter(|g| self.mode(g) == mode)
            .map(|g| g.uuid.clone())
            .collect()
    }

    /// Names of the devices several claims may hold at once (as shares, each allocation with a
    /// share ID): the whole-GPU devices of memory-share GPUs with MIG off, and every device
    /// eligible for consumable shares ([`crate::consumable_shares::eligible`]). The same rule
    /// the rendering follows, so prepare accepts exactly the shares the scheduler may make.
    pub fn shareable_devices(&self, inventory: &Inventory) -> BTreeSet<String> {
        inventory
            .devices()
            .filter(|d| match d {
                gpu_dra_device::DeviceRef::Gpu(g) if self.mode(g) == GpuMode::MemoryShares => {
                    crate::memory_shares::request_policy(g.memory_bytes).is_some()
                }
                _ => crate::consumable_shares::eligible(self, d),
            })
            .map(|d| d.name())
            .collect()
    }

    /// These settings without anything that needs consumable capacity (memory shares and
    /// consumable shares off): what the node offers while the API server drops it.
    pub fn without_consumable_capacity(self) -> Partitioning {
        Partitioning {
            memory_shares: GpuSelection::None,
            consumable_shares: ConsumableShares::Disabled,
            ..self
        }
    }

    /// These settings without anything that needs partitionable devices (dynamic MIG off):
    /// what the node offers while the API server drops shared counters.
    pub fn without_partitionable_devices(self) -> Partitioning {
        Partitioning {
            dynamic_mig: GpuSelection::None,
            ..self
        }
    }

    /// GPUs selected for both modes (offered statically): for warnings.
    pub fn conflicts<'a>(&self, inventory: &'a Inventory) -> Vec<&'a Gpu> {
        inventory
            .gpus
            .iter()
            .filter(|g| self.dynamic_mig.contains(g) && self.memory_shares.contains(g))
            .collect()
    }

    /// The settings with a node's annotations applied over these defaults: each annotation
    /// present replaces its flag. Returns what was wrong with an annotation (which is then
    /// ignored).
    pub fn with_node_annotations<'a>(
        &self,
        get: impl Fn(&str) -> Option<&'a str>,
    ) -> (Partitioning, Vec<String>) {
        let mut out = self.clone();
        let mut problems = Vec::new();
        for (key, slot) in [
            (DYNAMIC_MIG_ANNOTATION, &mut out.dynamic_mig),
            (MEMORY_SHARE_ANNOTATION, &mut out.memory_shares),
        ] {
            if let Some(value) = get(key) {
                match GpuSelection::parse(value) {
                    Ok(sel) => *slot = sel,
                    Err(e) => problems.push(format!("node annotation {key}: {e}")),
                }
            }
        }
        (out, problems)
    }
}

/// Renders the node's pool as `partitioning` says: dynamic MIG GPUs as partitionable devices
/// ([`crate::dynamic_mig::render_pool`]), memory-share GPUs as whole GPUs several claims may
/// hold ([`crate::memory_shares::apply`]), every other GPU statically, its devices with
/// consumable shares when they are on ([`crate::consumable_shares::apply`]).
///
/// `dynamic_instances` names the MIG devices on dynamic GPUs that claims' dynamic devices stand
/// for (the placements their checkpoint records hold, also before the instance exists): they
/// are left out of the rendering, since the scheduler tracks those allocations on the
/// partitionable devices. Every other MIG device on a dynamic GPU (a claim's static device,
/// an instance made before the GPU became dynamic) stays a static device of the GPU, and no
/// placement overlapping it is offered.
pub fn render(
    inventory: &Inventory,
    params: &SliceParams<'_>,
    taints: &BTreeMap<String, Vec<Taint>>,
    partitioning: &Partitioning,
    dynamic_instances: &BTreeSet<String>,
) -> Rendered {
    let dynamic = partitioning.uuids(inventory, GpuMode::DynamicMig);
    let mut rendered = if dynamic.is_empty() {
        crate::slices::render_slices_tainted(inventory, params, taints)
    } else {
        let mut offered = inventory.clone();
        for gpu in offered
            .gpus
            .iter_mut()
            .filter(|g| dynamic.contains(&g.uuid))
        {
            let parent = gpu.clone();
            gpu.mig_devices
                .retain(|m| !dynamic_instances.contains(&m.device_name(&parent)));
        }
        crate::dynamic_mig::render_pool(&offered, params, taints, &dynamic)
    };
    let shared = partitioning.uuids(inventory, GpuMode::MemoryShares);
    crate::memory_shares::apply(&mut rendered, inventory, &shared);
    crate::consumable_shares::apply(&mut rendered, inventory, partitioning);
    rendered
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::{MigBuilder, a100, a100_dynamic, inventory, mig_1g5gb};

    #[test]
    fn selections_parse_and_match_by_index_minor_or_uuid() {
        let inv = inventory([a100(0).build(), a100(1).build(), a100(2).build()]);
        let uuid2 = inv.gpus[2].uuid.clone();
        let sel = GpuSelection::parse(&format!("0, gpu-1,{uuid2}")).expect("parse");
        assert!(inv.gpus.iter().all(|g| sel.contains(g)));
        assert_eq!(GpuSelection::parse(" ").expect("empty"), GpuSelection::None);
        assert_eq!(GpuSelection::parse("ALL").expect("all"), GpuSelection::All);
        let err = GpuSelection::parse("0,,x").expect_err("bad");
        assert!(err.contains("names no GPU"), "{err}");
    }

    #[test]
    fn modes_annotations_and_conflicts() {
        let inv = inventory([a100(0).build(), a100(1).build()]);
        let flags = Partitioning {
            dynamic_mig: GpuSelection::All,
            ..Partitioning::default()
        };
        assert_eq!(flags.mode(&inv.gpus[1]), GpuMode::DynamicMig);
        let (node, problems) = flags.with_node_annotations(|k| match k {
            MEMORY_SHARE_ANNOTATION => Some("1"),
            DYNAMIC_MIG_ANNOTATION => Some("0"),
            _ => None,
        });
        assert!(problems.is_empty());
        assert_eq!(node.mode(&inv.gpus[0]), GpuMode::DynamicMig);
        assert_eq!(node.mode(&inv.gpus[1]), GpuMode::MemoryShares);
        let both = Partitioning {
            dynamic_mig: GpuSelection::All,
            memory_shares: GpuSelection::All,
            ..Partitioning::default()
        };
        assert_eq!(both.mode(&inv.gpus[0]), GpuMode::Static);
        assert_eq!(both.conflicts(&inv).len(), 2);
        let (kept, problems) = flags.with_node_annotations(|_| Some("nonsense"));
        assert_eq!(kept, flags);
        assert_eq!(problems.len(), 2);
    }

    /// A dynamic GPU with a claim's dynamic instance (named in `dynamic_instances`) and a
    /// static `3g.20gb` a claim was prepared with before the switch: the first is left to its
    /// placement device, the second stays a static device and nothing overlapping it is offered.
    #[test]
    fn only_instances_of_dynamic_devices_are_left_to_their_placements() {
        let gpu = a100_dynamic(0)
            .mig(mig_1g5gb(0).uuid("MIG-dynamic"))
            .mig(MigBuilder::new("3g.20gb", 9, 4, 4).uuid("MIG-static"))
            .build();
        let inv = inventory([gpu]);
        let partitioning = Partitioning {
            dynamic_mig: GpuSelection::All,
            ..Partitioning::default()
        };
        let params = SliceParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        };
        let ours = BTreeSet::from(["gpu-0-mig-1g5gb-19-0".to_string()]);
        let r = render(&inv, &params, &BTreeMap::new(), &partitioning, &ours);
        let devices: BTreeMap<&str, _> = r
            .slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.as_str(), d))
            .collect();
        let uuid = |n: &str| {
            devices[n].attributes.as_ref().unwrap()["uuid"]
                .string
                .clone()
        };
        // The dynamic claim's placement is published as a placement, without its instance.
        assert!(devices["gpu-0-mig-1g5gb-19-0"].consumes_counters.is_some());
        assert!(
            !devices["gpu-0-mig-1g5gb-19-0"]
                .attributes
                .as_ref()
                .unwrap()
                .contains_key("uuid")
        );
        assert_eq!(uuid("gpu-0-mig-3g20gb-9-4").as_deref(), Some("MIG-static"));
        for name in [
            "gpu-0",
            "gpu-0-mig-1g5gb-19-4",
            "gpu-0-mig-2g10gb-14-4",
            "gpu-0-mig-1g10gb-15-6",
            "gpu-0-mig-7g40gb-0-0",
        ] {
            assert!(
                !devices.contains_key(name),
                "{name} overlaps the static 3g.20gb"
            );
        }
        assert!(devices.contains_key("gpu-0-mig-4g20gb-5-0"));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }
}
