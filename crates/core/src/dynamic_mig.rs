//! Dynamic MIG rendering: a GPU whose MIG instances are created on demand is published as
//! partitionable devices (Kubernetes `DRAPartitionableDevices`, beta and on by default in
//! 1.37) so the scheduler, not the node, keeps two allocations off the same hardware.
//!
//! # The problem
//! A dynamic GPU has MIG mode on and no instances yet. Prepare will later create the GPU and
//! compute instance of the allocated (profile, placement) and unprepare will destroy it; here we
//! only publish what may be allocated. Every placement of every profile is offered, plus the
//! whole GPU, and most of them overlap: `3g.20gb` at 0 and `1g.5gb` at 2 need the same memory
//! slice, so the scheduler must never hand out both.
//!
//! # The design
//! - **One counter set per dynamic GPU**, `gpu-<minor>-counter-set` (NVIDIA's name), holding
//!   - `memory-slice-<i>` = 1 for every memory slice `i` any placement covers (8 on
//!     A100/H100/H200): a device consumes the slices of its placement, so two overlapping
//!     placements need the same counter and only one of them can be allocated;
//!   - totals, named as NVIDIA's driver names them: `multiprocessors`, `copy-engines`,
//!     `decoders`, `encoders`, `jpeg-engines`, `ofa-engines`, `memory` (bytes), each the largest
//!     value any profile has (the `7g` profile on every GPU in our tables). A counter no profile
//!     uses (encoders on A100) is left out, and so are zero consumptions: a zero neither limits
//!     nor informs. The totals are not decoration: `+me` profiles are the only small ones with
//!     an OFA engine and the GPU has one, so `ofa-engines` is what keeps two `1g.5gb+me`
//!     instances, which never overlap in memory, from being allocated together, matching the
//!     hardware's one-`+me`-instance rule.
//! - **Devices.** The whole GPU `gpu-<minor>` (rendered as a whole GPU is today) consumes every
//!   counter of the set. Each (profile, placement start) is a device named like a static MIG
//!   device, `gpu-<minor>-mig-<profile>-<giProfileId>-<start>`, rendered by the static MIG code
//!   from a MIG device that does not exist yet, so it has the same attributes and capacities
//!   (`memorySlice<i>` included) except **`uuid`**: a MIG UUID is assigned by the driver when
//!   the instance is created and changes with every re-creation, so it is left out rather than
//!   invented. Selectors that need it must guard with `'uuid' in ...`.
//! - **Slice layout.** Since 1.35 a slice holds `devices` or `sharedCounters`, never both. The
//!   pool is rendered as: the static devices exactly as [`slices::render_slices_tainted`]
//!   renders them (same chunking, same names from `-0`), then the dynamic devices in slices of at
//!   most [`MAX_DEVICES_PER_SLICE_WITH_COUNTERS`], then the counter sets, at most
//!   [`MAX_COUNTER_SETS_PER_SLICE`] per slice. Every slice carries the same generation and the
//!   pool's total slice count, and slices are named `<node>-<driver>-<n>` in that order. With no
//!   dynamic GPU the output is byte-identical to `render_slices_tainted`.
//! - **Counter sets in other slices.** `ValidateResourceSlice` checks one object: names, sizes
//!   and the devices/counters exclusivity, not whether a consumed set exists. The allocator
//!   (`k8s.io/dynamic-resource-allocation`, `buildPool`) gathers the counter sets of every slice
//!   of the pool's current generation, rejects duplicate set names, and marks the **whole pool
//!   invalid** if a device consumes a set or counter it cannot find. So a device may consume a
//!   set published in another slice of the same pool, and the renderer must never emit a
//!   consumption without its set: both come from one pass over one GPU.
//!
//! # Limits (from `pkg/apis/resource/types.go` and `validation.go`, 1.37.1)
//! [`MAX_COUNTER_SETS_PER_SLICE`], [`MAX_COUNTERS_PER_COUNTER_SET`],
//! [`MAX_COUNTER_CONSUMPTIONS_PER_DEVICE`], [`MAX_COUNTERS_PER_CONSUMPTION`],
//! [`MAX_DEVICES_PER_SLICE_WITH_COUNTERS`]; set and counter names must be DNS labels
//! ([`MAX_DNS_LABEL_LENGTH`]). The 1.37.1 validation sets no limit on the total counters
//! consumed per slice. A device consumes from one set only and at most as many counters as the
//! set has, so the per-device limits follow from the per-set one. An A100-40GB needs 8 + 6
//! counters and 26 devices (25 placements and the whole GPU).
//!
//! # Order
//! Devices follow discovery order: the whole GPU, then each profile's placements from slice 0.
//! The allocator is first-fit, so small requests take the low placements first; ordering them
//! to keep large placements free (NVIDIA's driver creates `1g` instances from slice 6 down) is
//! left for later. A GPU that would need more than [`MAX_COUNTERS_PER_COUNTER_SET`]
//! counters (or whose profiles are unusable, see [`StaticReason`]) is rendered statically, with
//! a [`RenderWarning`] saying why: never an invalid slice, which would fail the whole publish.
//!
//! # Which GPUs are dynamic
//! The caller names them by UUID. A GPU qualifies when it reports MIG profiles and some
//! placement is free (below). MIG mode itself is not checked: NVIDIA's driver enables it
//! lazily on Hopper, and discovery only lists profiles where it can. Once prepare creates
//! instances for dynamic devices, the caller must leave those instances out of `mig_devices`
//! before rendering, so the published pool stays the same while they are allocated.
//!
//! # Instances that are not the scheduler's
//! Every MIG device the caller leaves in `mig_devices` is an instance no dynamic device stands
//! for: a static MIG device a claim was prepared with before the GPU became dynamic, an
//! instance an admin made, a leftover the node plugin has not destroyed yet. The scheduler
//! knows nothing of them, so offering a placement over one would let it allocate what cannot
//! be created, or, worse, what a running pod uses. Such an instance
//! - is published as the static MIG device it is (with its `uuid`, consuming no counter): a
//!   claim allocated it before the switch keeps a published device, and new claims may use it;
//! - is subtracted from the counter set: the set holds what the instances leave (memory slices
//!   they cover and counters they exhaust drop out, as zeros do), and a device is offered only
//!   when its consumption fits in that. So no placement overlapping such an instance is
//!   offered, nor the whole GPU, nor a `+me` placement next to a `+me` instance (the
//!   `ofa-engines` total is spent). The arithmetic is the scheduler's own: a device that does
//!   not fit could never be allocated, and publishing it would name counters the set lacks;
//! - makes the GPU static ([`StaticReason::NoFreePlacement`]) when no placement fits at all.
//!
//! The pool changes when such an instance appears or goes (rare: the switch of a GPU to
//! dynamic, an admin's work). A claim allocated the static device before the switch keeps it
//! published under the same name.
//!
//! # Rejected alternatives
//! - *Counters and devices in one slice*: rejected by validation since 1.35.
//! - *One counter per (profile, placement)* or per pair of overlapping placements: quadratic,
//!   beyond 32 counters for one GPU; memory slices express overlap exactly with 8.
//! - *Compute-slice counters*: placements that are disjoint in memory are never over the 7
//!   compute slices in NVIDIA's tables, and `multiprocessors` bounds them anyway; NVIDIA does not
//!   publish them either.
//! - *Totals from the whole GPU's memory (40 GiB) instead of the `7g` profile (40192 MiB)*:
//!   the whole-GPU device consumes the set's own values, so any choice would do for it, but MIG
//!   devices can only ever use the `7g` share; the profile maximum keeps the numbers honest.
//! - *A placeholder `uuid`*: a selector matching it would match nothing real.
//! - *`compatibilityGroups` / `partitionTypeAttribute`*: 1.37 alpha fields behind gates that are
//!   off by default (`DRADeviceCompatibilityGroups`, `DRAPartitionableDevicesType`) and absent
//!   from the `v1_34` API types we build against.
//! - *Dynamic and static devices in the same slices*: a slice with any counter-consuming device
//!   holds at most 64 devices; keeping them apart leaves the static slices as they were.

use std::collections::{BTreeMap, BTreeSet};

use gpu_dra_device::{DeviceRef, Gpu, Inventory, MigDevice, MigProfile, Placement};
use k8s_openapi::api::resource::v1::{Counter, CounterSet, Device, DeviceCounterConsumption};

use crate::health::Taint;
use crate::slices::{self, RenderWarning, Rendered, SliceParams, capacity_quantity};

/// Most counter sets one ResourceSlice may define (`ResourceSliceMaxCounterSets`).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Most counters one counter set may hold (`ResourceSliceMaxCountersPerCounterSet`).
pub const MAX_COUNTERS_PER_COUNTER_SET: usize = 32;
/// Most counter consumptions one device may list
/// (`ResourceSliceMaxDeviceCounterConsumptionsPerDevice`).
pub const MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// Most counters one consumption may name (`ResourceSliceMaxCountersPerDeviceCounterConsumption`).
pub const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;
/// Most devices one ResourceSlice may hold when any consumes counters
/// (`ResourceSliceMaxDevicesWithAdvancedFeatures`).
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS: usize = slices::MAX_DEVICES_PER_SLICE_WITH_TAINTS;
/// Longest DNS label: counter set names, counter names and device names.
pub const MAX_DNS_LABEL_LENGTH: usize = 63;

/// Counter names (DNS labels, as validation requires; NVIDIA's driver uses the same names).
pub mod counter {
    /// Prefix of the per-memory-slice counters (`memory-slice-0`...), value 1 each.
    pub const MEMORY_SLICE_PREFIX: &str = "memory-slice-";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    /// Copy engines.
    pub const COPY_ENGINES: &str = "copy-engines";
    /// Video decoders.
    pub const DECODERS: &str = "decoders";
    /// Video encoders.
    pub const ENCODERS: &str = "encoders";
    /// JPEG engines.
    pub const JPEG_ENGINES: &str = "jpeg-engines";
    /// Optical flow accelerators.
    pub const OFA_ENGINES: &str = "ofa-engines";
    /// Memory in bytes.
    pub const MEMORY: &str = "memory";
}

/// Why a GPU asked to be dynamic is rendered statically instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StaticReason {
    /// The GPU UUID is not in the inventory.
    #[error("no GPU with this UUID on the node; ignored")]
    UnknownGpu,
    /// Discovery listed no MIG profiles (not MIG capable, or MIG mode off).
    #[error(
        "the GPU reports no MIG profiles (not MIG capable or MIG mode off); rendered statically"
    )]
    NoProfiles,
    /// The MIG instances that stay on the GPU (a claim's static device, or instances made
    /// before the GPU became dynamic) leave no placement free.
    #[error(
        "its {count} MIG instances that are not dynamic claims' leave no placement free; rendered statically until they are gone"
    )]
    NoFreePlacement {
        /// How many such MIG instances exist.
        count: usize,
    },
    /// A profile lists a placement that covers no memory slice, which no counter could guard.
    #[error("profile {profile} has an empty placement at {start}; rendered statically")]
    EmptyPlacement {
        /// The profile name.
        profile: String,
        /// The placement start.
        start: u32,
    },
    /// The counter set would exceed the API's per-set limit.
    #[error(
        "needs {needed} counters, over the API limit of {MAX_COUNTERS_PER_COUNTER_SET} per counter set; rendered statically"
    )]
    TooManyCounters {
        /// Counters the GPU would need.
        needed: usize,
    },
    /// Two placements render to the same device name, or a name is not a DNS label.
    #[error(
        "device name {name} is duplicated or longer than {MAX_DNS_LABEL_LENGTH}; rendered statically"
    )]
    BadDeviceName {
        /// The offending name.
        name: String,
    },
}

/// A dynamic GPU as published: its counter set and its devices (whole GPU first, then every
/// placement of every profile in discovery order).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicGpu {
    /// The GPU's counter set.
    pub counter_set: CounterSet,
    /// The devices, each consuming from `counter_set`.
    pub devices: Vec<Device>,
}

/// The counter set name of a dynamic GPU: `gpu-<minor>-counter-set`.
pub fn counter_set_name(gpu: &Gpu) -> String {
    format!("gpu-{}-counter-set", gpu.minor)
}

/// The name of memory slice `i`'s counter: `memory-slice-<i>`.
pub fn memory_slice_counter(i: u32) -> String {
    format!("{}{i}", counter::MEMORY_SLICE_PREFIX)
}

/// The totals counters a profile consumes, in counter-set order.
fn totals(p: &MigProfile) -> [(&'static str, u64); 7] {
    [
        (counter::MULTIPROCESSORS, u64::from(p.multiprocessors)),
        (counter::COPY_ENGINES, u64::from(p.copy_engines)),
        (counter::DECODERS, u64::from(p.decoders)),
        (counter::ENCODERS, u64::from(p.encoders)),
        (counter::JPEG_ENGINES, u64::from(p.jpeg_engines)),
        (counter::OFA_ENGINES, u64::from(p.ofa_engines)),
        (counter::MEMORY, p.memory_bytes),
    ]
}

fn counters(values: impl IntoIterator<Item = (String, u64)>) -> BTreeMap<String, Counter> {
    values
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .map(|(k, v)| {
            (
                k,
                Counter {
                    value: capacity_quantity(v),
                },
            )
        })
        .collect()
}

/// The counters a MIG instance of `gpu` uses: its memory slices and its profile's totals (the
/// instance's own values when its profile is not listed), zeros left out.
fn instance_usage(gpu: &Gpu, m: &MigDevice) -> BTreeMap<String, u64> {
    let own = [
        (counter::MULTIPROCESSORS, u64::from(m.multiprocessors)),
        (counter::COPY_ENGINES, u64::from(m.copy_engines)),
        (counter::DECODERS, u64::from(m.decoders)),
        (counter::ENCODERS, u64::from(m.encoders)),
        (counter::JPEG_ENGINES, u64::from(m.jpeg_engines)),
        (counter::OFA_ENGINES, u64::from(m.ofa_engines)),
        (counter::MEMORY, m.memory_bytes),
    ];
    let totals = gpu
        .mig_profiles
        .iter()
        .find(|p| p.gi_profile_id == m.gi_profile_id)
        .map_or(own, totals);
    usage(m.placement, totals)
}

/// The counters a placement of a profile with `totals` uses, zeros left out.
fn usage(pl: Placement, totals: [(&'static str, u64); 7]) -> BTreeMap<String, u64> {
    (pl.start..pl.start.saturating_add(pl.size))
        .map(|i| (memory_slice_counter(i), 1))
        .chain(totals.into_iter().map(|(k, v)| (k.to_string(), v)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// Renders `gpu` as a dynamic MIG GPU, or says why it must be rendered statically. Warnings of
/// the device rendering (over-long strings, as for static devices) go to `warnings`.
///
/// The MIG devices in `gpu.mig_devices` are instances no claim's dynamic device stands for
/// (see "Instances that are not the scheduler's" in the module doc): each is published as the
/// static MIG device it is, the counter set holds what they leave, and only the placements
/// that fit in it are offered.
pub fn render_dynamic_gpu(
    inventory: &Inventory,
    gpu: &Gpu,
    warnings: &mut Vec<RenderWarning>,
) -> Result<DynamicGpu, StaticReason> {
    if gpu.mig_profiles.is_empty() {
        return Err(StaticReason::NoProfiles);
    }
    let mut memory_slices = 0u32;
    let mut max = BTreeMap::<&str, u64>::new();
    for p in &gpu.mig_profiles {
        if let Some(pl) = p.placements.iter().find(|pl| pl.size == 0) {
            return Err(StaticReason::EmptyPlacement {
                profile: p.name.clone(),
                start: pl.start,
            });
        }
        for pl in &p.placements {
            memory_slices = memory_slices.max(pl.start.saturating_add(pl.size));
        }
        for (name, v) in totals(p) {
            let m = max.entry(name).or_default();
            *m = (*m).max(v);
        }
    }
    let whole: BTreeMap<String, u64> = (0..memory_slices)
        .map(|i| (memory_slice_counter(i), 1))
        .chain(max.iter().map(|(k, v)| (k.to_string(), *v)))
        .filter(|(_, v)| *v > 0)
        .collect();
    let needed = whole.len();
    if needed > MAX_COUNTERS_PER_COUNTER_SET {
        return Err(StaticReason::TooManyCounters { needed });
    }
    // What the instances that stay leave to the placements.
    let mut free = whole.clone();
    for m in &gpu.mig_devices {
        for (k, v) in instance_usage(gpu, m) {
            if let Some(f) = free.get_mut(&k) {
                *f = f.saturating_sub(v);
            }
        }
    }
    let fits = |used: &BTreeMap<String, u64>| {
        used.iter()
            .all(|(k, v)| free.get(k).is_some_and(|f| f >= v))
    };
    let set_name = counter_set_name(gpu);
    let consumes = |values: &BTreeMap<String, u64>| {
        Some(vec![DeviceCounterConsumption {
            counter_set: set_name.clone(),
            counters: counters(values.iter().map(|(k, v)| (k.clone(), *v))),
        }])
    };

    let mut devices = Vec::new();
    let mut names = BTreeSet::new();
    if fits(&whole) {
        let mut device = slices::render_device(inventory, DeviceRef::Gpu(gpu), warnings);
        device.consumes_counters = consumes(&whole);
        names.insert(device.name.clone());
        devices.push(device);
    }
    for mig in &gpu.mig_devices {
        let device =
            slices::render_device(inventory, DeviceRef::Mig { parent: gpu, mig }, warnings);
        if !names.insert(device.name.clone()) {
            return Err(StaticReason::BadDeviceName { name: device.name });
        }
        devices.push(device);
    }
    let mut placements = 0usize;
    for p in &gpu.mig_profiles {
        for pl in &p.placements {
            // The UUID and IDs are assigned by the driver at creation; the UUID is removed
            // from the attributes below.
            let mig = p.device(*pl, String::new(), 0, 0);
            let name = mig.device_name(gpu);
            if name.len() > MAX_DNS_LABEL_LENGTH {
                return Err(StaticReason::BadDeviceName { name });
            }
            let used = usage(*pl, totals(p));
            if !fits(&used) {
                continue;
            }
            if !names.insert(name.clone()) {
                return Err(StaticReason::BadDeviceName { name });
            }
            let mut device = slices::render_device(
                inventory,
                DeviceRef::Mig {
                    parent: gpu,
                    mig: &mig,
                },
                warnings,
            );
            if let Some(attributes) = device.attributes.as_mut() {
                attributes.remove(slices::attr::UUID);
            }
            device.consumes_counters = consumes(&used);
            devices.push(device);
            placements += 1;
        }
    }
    if placements == 0 {
        return Err(StaticReason::NoFreePlacement {
            count: gpu.mig_devices.len(),
        });
    }
    Ok(DynamicGpu {
        counter_set: CounterSet {
            name: set_name,
            counters: counters(free),
        },
        devices,
    })
}

/// The profile and placement that the dynamic device `name` stands for on `gpu` (named as
/// [`render_dynamic_gpu`] names it), or `None` when `name` is no placement of `gpu`. Prepare
/// uses it to know which instance to create for an allocated device.
pub fn placement_of<'a>(gpu: &'a Gpu, name: &str) -> Option<(&'a MigProfile, Placement)> {
    let prefix = format!("gpu-{}-mig-", gpu.minor);
    if !name.starts_with(&prefix) {
        return None;
    }
    gpu.mig_profiles.iter().find_map(|p| {
        p.placements.iter().find_map(|pl| {
            let device = format!(
                "{prefix}{}-{}-{}",
                gpu_dra_device::names::profile_for_device_name(&p.name),
                p.gi_profile_id,
                pl.start
            );
            (device == name).then_some((p, *pl))
        })
    })
}

/// Renders the node's pool with the GPUs whose UUIDs are in `dynamic` as dynamic MIG GPUs (see
/// the module doc for the layout) and every other GPU exactly as
/// [`slices::render_slices_tainted`] does. A GPU in `dynamic` that does not qualify is rendered
/// statically with a [`RenderWarning`] (field `dynamicMig`) giving the [`StaticReason`]. Taints
/// apply by device name to static and dynamic devices alike.
pub fn render_pool(
    inventory: &Inventory,
    params: &SliceParams<'_>,
    taints: &BTreeMap<String, Vec<Taint>>,
    dynamic: &BTreeSet<String>,
) -> Rendered {
    let mut warnings = Vec::new();
    for uuid in dynamic {
        if !inventory.gpus.iter().any(|g| &g.uuid == uuid) {
            warnings.push(RenderWarning {
                device: uuid.clone(),
                field: "dynamicMig".into(),
                reason: StaticReason::UnknownGpu.to_string(),
            });
        }
    }
    let mut dynamic_uuids = BTreeSet::new();
    let mut dynamic_devices = Vec::new();
    let mut counter_sets = Vec::new();
    for gpu in inventory.gpus.iter().filter(|g| dynamic.contains(&g.uuid)) {
        // Device warnings are kept only when the GPU is rendered dynamically.
        let mut device_warnings = Vec::new();
        match render_dynamic_gpu(inventory, gpu, &mut device_warnings) {
            Ok(d) => {
                dynamic_uuids.insert(gpu.uuid.as_str());
                warnings.extend(device_warnings);
                counter_sets.push(d.counter_set);
                dynamic_devices.extend(d.devices);
            }
            Err(reason) => warnings.push(RenderWarning {
                device: gpu.device_name(),
                field: "dynamicMig".into(),
                reason: reason.to_string(),
            }),
        }
    }

    let mut static_devices: Vec<Device> = inventory
        .devices()
        .filter(|d| !dynamic_uuids.contains(d.gpu().uuid.as_str()))
        .map(|d| slices::render_device(inventory, d, &mut warnings))
        .collect();
    let static_chunks = slices::device_chunks(&mut static_devices, taints, counter_sets.is_empty());
    let dynamic_chunks = slices::device_chunks(&mut dynamic_devices, taints, false);
    let counter_chunks: Vec<Vec<CounterSet>> = counter_sets
        .chunks(MAX_COUNTER_SETS_PER_SLICE)
        .map(<[CounterSet]>::to_vec)
        .collect();

    let count = (static_chunks.len() + dynamic_chunks.len() + counter_chunks.len()) as i64;
    let device_slices = static_chunks
        .into_iter()
        .chain(dynamic_chunks)
        .map(|d| (Some(d), None));
    let set_slices = counter_chunks.into_iter().map(|c| (None, Some(c)));
    let slices = device_slices
        .chain(set_slices)
        .enumerate()
        .map(|(n, (devices, sets))| slices::pool_slice(params, n, count, devices, sets))
        .collect();
    Rendered { slices, warnings }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::TaintEffect;
    use gpu_dra_device::testing::{
        MigBuilder, a100, a100_40gb_profiles, a100_dynamic, h100, inventory, mig_1g5gb, t4,
    };
    use gpu_dra_device::{Placement, names};
    use k8s_openapi::api::resource::v1::ResourceSlice;

    fn params() -> SliceParams<'static> {
        SliceParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            generation: 4,
        }
    }

    fn uuids<'a>(gpus: impl IntoIterator<Item = &'a Gpu>) -> BTreeSet<String> {
        gpus.into_iter().map(|g| g.uuid.clone()).collect()
    }

    fn devices(slices: &[ResourceSlice]) -> Vec<&Device> {
        slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect()
    }

    fn sets(slices: &[ResourceSlice]) -> Vec<&CounterSet> {
        slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .collect()
    }

    /// The memory slices a device consumes, from its consumption.
    fn consumed_slices(d: &Device) -> BTreeSet<u32> {
        d.consumes_counters
            .iter()
            .flatten()
            .flat_map(|c| c.counters.keys())
            .filter_map(|k| k.strip_prefix(counter::MEMORY_SLICE_PREFIX)?.parse().ok())
            .collect()
    }

    /// Every device name of a dynamic A100 with the memory slices its placement covers, from the
    /// fixture's profile table (independent of the renderer).
    fn expected_placements(minor: u32) -> BTreeMap<String, BTreeSet<u32>> {
        let mut out = BTreeMap::from([(format!("gpu-{minor}"), (0..8).collect())]);
        for p in a100_40gb_profiles() {
            for pl in p.placements {
                let name = format!(
                    "gpu-{minor}-mig-{}-{}-{}",
                    names::profile_for_device_name(&p.name),
                    p.gi_profile_id,
                    pl.start
                );
                out.insert(name, (pl.start..pl.start + pl.size).collect());
            }
        }
        out
    }

    fn int(s: &str) -> u64 {
        gpu_dra_api::quantity::Quantity::parse(s)
            .ok()
            .and_then(|q| q.to_u64_exact())
            .unwrap_or_else(|| panic!("{s} is not a whole number"))
    }

    fn q(v: u64) -> String {
        capacity_quantity(v).0
    }

    #[test]
    fn a100_renders_static_slice_then_device_slice_then_counter_slice() {
        let dynamic = a100_dynamic(0).build();
        let inv = inventory([dynamic.clone(), a100(1).build()]);
        let r = render_pool(&inv, &params(), &BTreeMap::new(), &uuids([&dynamic]));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.slices.len(), 3);
        for (n, s) in r.slices.iter().enumerate() {
            assert_eq!(
                s.metadata.name.as_deref(),
                Some(format!("node-a-gpu-nvidia-com-{n}").as_str())
            );
            assert_eq!(s.spec.pool.generation, 4);
            assert_eq!(s.spec.pool.resource_slice_count, 3);
            assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
            assert!(s.spec.devices.is_none() || s.spec.shared_counters.is_none());
        }
        let names = |s: &ResourceSlice| -> Vec<String> {
            s.spec
                .devices
                .iter()
                .flatten()
                .map(|d| d.name.clone())
                .collect()
        };
        assert_eq!(names(&r.slices[0]), ["gpu-1"]);
        let dynamic_names: BTreeSet<String> = names(&r.slices[1]).into_iter().collect();
        let want: BTreeSet<String> = expected_placements(0).into_keys().collect();
        assert_eq!(dynamic_names, want);
        // 7 + 3 + 2 + 1 + 1 + 7 + 4 placements and the whole GPU.
        assert_eq!(dynamic_names.len(), 26);
        assert!(r.slices[2].spec.devices.is_none());
        let set = &r.slices[2].spec.shared_counters.as_ref().unwrap()[0];
        assert_eq!(set.name, "gpu-0-counter-set");
        let mut want: BTreeMap<String, String> =
            (0..8).map(|i| (memory_slice_counter(i), q(1))).collect();
        for (k, v) in [
            ("multiprocessors", 98),
            ("copy-engines", 7),
            ("decoders", 5),
            ("jpeg-engines", 1),
            ("ofa-engines", 1),
            ("memory", 40192 << 20),
        ] {
            want.insert(k.into(), q(v));
        }
        let have: BTreeMap<String, String> = set
            .counters
            .iter()
            .map(|(k, c)| (k.clone(), c.value.0.clone()))
            .collect();
        assert_eq!(have, want);
    }

    #[test]
    fn every_device_consumes_the_memory_slices_of_its_placement_and_its_share() {
        let gpu = a100_dynamic(3).build();
        let d = render_dynamic_gpu(&inventory([gpu.clone()]), &gpu, &mut Vec::new()).unwrap();
        let expected = expected_placements(3);
        assert_eq!(d.devices.len(), expected.len());
        for device in &d.devices {
            let consumption = device.consumes_counters.as_deref().unwrap();
            assert_eq!(consumption.len(), 1);
            assert_eq!(consumption[0].counter_set, "gpu-3-counter-set");
            assert_eq!(
                consumed_slices(device),
                expected[&device.name],
                "{}",
                device.name
            );
            let value = |k: &str| consumption[0].counters.get(k).map(|c| c.value.0.clone());
            if device.name == "gpu-3" {
                // The whole GPU consumes the entire set.
                assert_eq!(consumption[0].counters, d.counter_set.counters);
                continue;
            }
            // Its share of the totals is its capacities (which the static code rendered).
            let cap = |k: &str| {
                device
                    .capacity
                    .as_ref()
                    .unwrap()
                    .get(k)
                    .map(|c| c.value.0.clone())
            };
            assert_eq!(value("memory"), cap("memory"), "{}", device.name);
            assert_eq!(value("multiprocessors"), cap("multiprocessors"));
            let nonzero = |v: Option<String>| v.filter(|v| v != "0");
            assert_eq!(value("copy-engines"), nonzero(cap("copyEngines")));
            assert_eq!(value("decoders"), nonzero(cap("decoders")));
            assert_eq!(value("jpeg-engines"), nonzero(cap("jpegEngines")));
            assert_eq!(value("ofa-engines"), nonzero(cap("ofaEngines")));
            // The memorySlice capacities name the same slices as the consumption.
            let cap_slices: BTreeSet<u32> = device
                .capacity
                .as_ref()
                .unwrap()
                .keys()
                .filter_map(|k| k.strip_prefix("memorySlice")?.parse().ok())
                .collect();
            assert_eq!(cap_slices, expected[&device.name]);
            // Every consumed counter exists in the set with at least that value.
            for (k, c) in &consumption[0].counters {
                let total = &d.counter_set.counters[k];
                assert!(
                    int(&c.value.0) <= int(&total.value.0),
                    "{} {k}",
                    device.name
                );
            }
        }
    }

    #[test]
    fn overlapping_placements_share_a_counter_and_disjoint_ones_none() {
        let gpu = a100_dynamic(0).build();
        let d = render_dynamic_gpu(&inventory([gpu.clone()]), &gpu, &mut Vec::new()).unwrap();
        let expected = expected_placements(0);
        let mut overlapping = 0;
        let mut disjoint = 0;
        for (i, a) in d.devices.iter().enumerate() {
            for b in &d.devices[i + 1..] {
                let overlap = !expected[&a.name].is_disjoint(&expected[&b.name]);
                let shared = !consumed_slices(a).is_disjoint(&consumed_slices(b));
                assert_eq!(overlap, shared, "{} / {}", a.name, b.name);
                if overlap {
                    overlapping += 1;
                } else {
                    disjoint += 1;
                }
            }
        }
        assert!(overlapping > 0 && disjoint > 0);
        // Spot checks.
        let slices = |n: &str| consumed_slices(d.devices.iter().find(|d| d.name == n).unwrap());
        assert!(!slices("gpu-0-mig-3g20gb-9-0").is_disjoint(&slices("gpu-0-mig-1g5gb-19-2")));
        assert!(slices("gpu-0-mig-3g20gb-9-4").is_disjoint(&slices("gpu-0-mig-4g20gb-5-0")));
    }

    /// Brute force over every set of placements that are pairwise disjoint in memory: the totals
    /// admit all of them except those with two `+me` instances, which the hardware refuses too.
    #[test]
    fn totals_admit_every_disjoint_combination_but_two_media_instances() {
        let gpu = a100_dynamic(0).build();
        let d = render_dynamic_gpu(&inventory([gpu.clone()]), &gpu, &mut Vec::new()).unwrap();
        let n = int;
        let migs: Vec<(u8, bool, BTreeMap<String, u64>)> = d
            .devices
            .iter()
            .filter(|d| d.name.contains("-mig-"))
            .map(|d| {
                let mask = consumed_slices(d).iter().fold(0u8, |m, i| m | 1 << i);
                let counters = d.consumes_counters.as_ref().unwrap()[0]
                    .counters
                    .iter()
                    .map(|(k, c)| (k.clone(), n(&c.value.0)))
                    .collect();
                (mask, d.name.contains("-me-"), counters)
            })
            .collect();
        let totals: BTreeMap<String, u64> = d
            .counter_set
            .counters
            .iter()
            .map(|(k, c)| (k.clone(), n(&c.value.0)))
            .collect();
        let mut checked = 0;
        let mut stack = vec![(0usize, 0u8, Vec::<usize>::new())];
        while let Some((next, used, chosen)) = stack.pop() {
            if !chosen.is_empty() {
                let mut sum = BTreeMap::<&str, u64>::new();
                for &i in &chosen {
                    for (k, v) in &migs[i].2 {
                        *sum.entry(k).or_default() += v;
                    }
                }
                let fits = sum.iter().all(|(k, v)| *v <= totals[*k]);
                let media = chosen.iter().filter(|&&i| migs[i].1).count();
                assert_eq!(fits, media <= 1, "{chosen:?}");
                checked += 1;
            }
            for (i, (mask, _, _)) in migs.iter().enumerate().skip(next) {
                if used & mask == 0 {
                    let mut c = chosen.clone();
                    c.push(i);
                    stack.push((i + 1, used | mask, c));
                }
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    #[test]
    fn dynamic_mig_devices_are_static_mig_devices_without_uuid() {
        let gpu = a100_dynamic(1).build();
        let inv = inventory([gpu.clone()]);
        let d = render_dynamic_gpu(&inv, &gpu, &mut Vec::new()).unwrap();
        let dynamic = d
            .devices
            .iter()
            .find(|d| d.name == "gpu-1-mig-3g20gb-9-4")
            .unwrap();
        let static_gpu = a100(1)
            .mig(
                MigBuilder::new("3g.20gb", 9, 4, 4)
                    .multiprocessors(42)
                    .copy_engines(3)
                    .decoders(2)
                    .memory_bytes(19968 << 20),
            )
            .build();
        let (static_devices, _) = slices::render_devices(&inventory([static_gpu]));
        let mut want = static_devices[0].clone();
        assert_eq!(want.name, dynamic.name);
        want.attributes.as_mut().unwrap().remove("uuid");
        assert_eq!(dynamic.attributes, want.attributes);
        assert_eq!(dynamic.capacity, want.capacity);
        assert_eq!(
            dynamic.attributes.as_ref().unwrap()["type"]
                .string
                .as_deref(),
            Some("mig")
        );
        // The whole GPU is today's whole-GPU device plus its consumption.
        let (whole, _) = slices::render_devices(&inventory([a100(1).build()]));
        let mut have = d.devices[0].clone();
        have.consumes_counters = None;
        assert_eq!(have, whole[0]);
    }

    #[test]
    fn every_rendered_placement_names_its_profile_and_placement_back() {
        let gpu = a100_dynamic(1).build();
        let inv = inventory([gpu.clone()]);
        let d = render_dynamic_gpu(&inv, &gpu, &mut Vec::new()).unwrap();
        for device in d.devices.iter().skip(1) {
            let (profile, placement) = placement_of(&gpu, &device.name).unwrap();
            assert!(
                device
                    .name
                    .contains(&format!("-{}-{}", profile.gi_profile_id, placement.start))
            );
        }
        let (p, pl) = placement_of(&gpu, "gpu-1-mig-3g20gb-9-4").unwrap();
        assert_eq!((p.name.as_str(), pl.start, pl.size), ("3g.20gb", 4, 4));
        assert!(placement_of(&gpu, "gpu-1").is_none());
        assert!(
            placement_of(&gpu, "gpu-1-mig-3g20gb-9-2").is_none(),
            "no such start"
        );
        assert!(
            placement_of(&gpu, "gpu-0-mig-3g20gb-9-4").is_none(),
            "other GPU"
        );
    }

    #[test]
    fn without_dynamic_gpus_the_pool_is_todays_rendering() {
        let taint = Taint {
            key: "gpu.nvidia.com/xid".into(),
            value: Some("79".into()),
            effect: TaintEffect::NoSchedule,
            since: 1_700_000_000,
        };
        let taints = BTreeMap::from([("gpu-2".to_string(), vec![taint])]);
        let inventories = [
            inventory([]),
            inventory([a100_dynamic(0).build(), a100(1).build(), t4(2).build()]),
            inventory([a100(0).mig(mig_1g5gb(0)).build(), h100(1).build()]),
            inventory((0..200).map(|m| a100(m).build())),
        ];
        for inv in &inventories {
            for t in [&BTreeMap::new(), &taints] {
                assert_eq!(
                    render_pool(inv, &params(), t, &BTreeSet::new()),
                    slices::render_slices_tainted(inv, &params(), t)
                );
            }
        }
    }

    #[test]
    fn gpus_that_cannot_be_dynamic_are_rendered_statically_with_a_warning() {
        // A 7g.40gb instance that is not a dynamic claim's covers every memory slice.
        let with_instances = a100(0)
            .mig(MigBuilder::new("7g.40gb", 0, 0, 8))
            .mig_profiles(a100_40gb_profiles())
            .build();
        let no_profiles = t4(1).build();
        let mut wide = a100_40gb_profiles();
        wide[4].placements = vec![Placement { start: 0, size: 30 }];
        let too_many = a100_dynamic(2).mig_profiles(wide).build();
        let mut empty = a100_40gb_profiles();
        empty[0].placements.push(Placement { start: 3, size: 0 });
        let empty_placement = a100_dynamic(3).mig_profiles(empty).build();
        let gpus = [with_instances, no_profiles, too_many, empty_placement];
        let inv = inventory(gpus.clone());
        let mut dynamic = uuids(&gpus);
        dynamic.insert("GPU-not-here".into());
        let r = render_pool(&inv, &params(), &BTreeMap::new(), &dynamic);
        // Exactly the static rendering: nothing dynamic survived.
        assert_eq!(
            r.slices,
            slices::render_slices_tainted(&inv, &params(), &BTreeMap::new()).slices
        );
        let reasons: Vec<(&str, &str)> = r
            .warnings
            .iter()
            .map(|w| (w.device.as_str(), w.reason.as_str()))
            .collect();
        assert_eq!(reasons.len(), 5, "{reasons:?}");
        assert_eq!(reasons[0].0, "GPU-not-here");
        assert!(
            reasons[1]
                .1
                .contains("1 MIG instances that are not dynamic claims' leave no placement free"),
            "{reasons:?}"
        );
        assert!(reasons[2].1.contains("no MIG profiles"));
        assert!(reasons[3].1.contains("needs 36 counters"), "{reasons:?}");
        assert!(reasons[4].1.contains("empty placement at 3"));
        assert_eq!(
            r.warnings
                .iter()
                .map(|w| w.device.as_str())
                .collect::<Vec<_>>(),
            ["GPU-not-here", "gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        );
        assert!(r.warnings.iter().skip(1).all(|w| w.field == "dynamicMig"));
    }

    /// Instances that no dynamic device stands for (a claim's static `3g.20gb` at 4 and an
    /// admin's `1g.5gb+me` at 0, left in `mig_devices` by the caller) stay published as the
    /// static devices they are; exactly the placements that fit beside them are offered.
    #[test]
    fn no_placement_overlapping_an_instance_that_stays_is_offered() {
        let g3 = MigBuilder::new("3g.20gb", 9, 4, 4)
            .uuid("MIG-static-3g")
            .multiprocessors(42)
            .copy_engines(3)
            .decoders(2)
            .memory_bytes(19968 << 20);
        let me = MigBuilder::new("1g.5gb+me", 20, 0, 1)
            .uuid("MIG-admin-me")
            .decoders(1)
            .jpeg_engines(1)
            .ofa_engines(1);
        let gpu = a100_dynamic(0).mig(g3).mig(me).build();
        let r = render_pool(
            &inventory([gpu.clone()]),
            &params(),
            &BTreeMap::new(),
            &uuids([&gpu]),
        );
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_valid_pool(&r.slices);
        let all = devices(&r.slices);
        for (name, uuid) in [
            ("gpu-0-mig-3g20gb-9-4", "MIG-static-3g"),
            ("gpu-0-mig-1g5gb-me-20-0", "MIG-admin-me"),
        ] {
            let d = all.iter().find(|d| d.name == name).expect(name);
            assert_eq!(
                d.attributes.as_ref().unwrap()["uuid"].string.as_deref(),
                Some(uuid)
            );
            assert!(d.consumes_counters.is_none(), "{name} is static");
        }
        let taken: BTreeSet<u32> = [0, 4, 5, 6, 7].into();
        let offered: BTreeSet<&str> = all
            .iter()
            .filter(|d| d.consumes_counters.is_some())
            .map(|d| d.name.as_str())
            .collect();
        // Every placement disjoint from the instances, but no second `+me` (one OFA engine).
        let expected = expected_placements(0);
        let want: BTreeSet<&str> = expected
            .iter()
            .filter(|(n, slices)| slices.is_disjoint(&taken) && !n.contains("-me-"))
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(offered, want);
        assert!(
            want.contains("gpu-0-mig-2g10gb-14-2") && !want.contains("gpu-0"),
            "{want:?}"
        );
        let set = &sets(&r.slices)[0].counters;
        for gone in [
            "memory-slice-0",
            "memory-slice-4",
            "memory-slice-7",
            "ofa-engines",
        ] {
            assert!(!set.contains_key(gone), "{gone} is spent: {set:?}");
        }
        assert_eq!(int(&set["multiprocessors"].value.0), 98 - 42 - 14);

        // Without them the same GPU offers everything again.
        let mut free = gpu.clone();
        free.mig_devices.clear();
        let r = render_pool(
            &inventory([free.clone()]),
            &params(),
            &BTreeMap::new(),
            &uuids([&free]),
        );
        assert_eq!(devices(&r.slices).len(), expected_placements(0).len());
    }

    #[test]
    fn taints_apply_to_dynamic_devices() {
        let gpu = a100_dynamic(0).build();
        let taint = Taint {
            key: "gpu.nvidia.com/xid".into(),
            value: None,
            effect: TaintEffect::NoExecute,
            since: 1_700_000_000,
        };
        let taints = BTreeMap::from([
            ("gpu-0-mig-1g5gb-19-3".to_string(), vec![taint.clone()]),
            ("gpu-0".to_string(), vec![taint]),
        ]);
        let r = render_pool(
            &inventory([gpu.clone()]),
            &params(),
            &taints,
            &uuids([&gpu]),
        );
        let tainted: Vec<&str> = devices(&r.slices)
            .into_iter()
            .filter(|d| d.taints.is_some())
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(tainted, ["gpu-0", "gpu-0-mig-1g5gb-19-3"]);
    }

    /// The API's limits, checked on the output, and the allocator's pool rules: unique set and
    /// device names, and every consumed set and counter defined somewhere in the pool.
    fn assert_valid_pool(slices: &[ResourceSlice]) {
        let count = slices.len() as i64;
        let label = |s: &str| {
            !s.is_empty()
                && s.len() <= MAX_DNS_LABEL_LENGTH
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        for s in slices {
            assert_eq!(s.spec.pool.resource_slice_count, count);
            assert!(s.spec.devices.is_some() != s.spec.shared_counters.is_some());
            let sets = s.spec.shared_counters.as_deref().unwrap_or_default();
            assert!(sets.len() <= MAX_COUNTER_SETS_PER_SLICE);
            for set in sets {
                assert!(label(&set.name), "{}", set.name);
                assert!(!set.counters.is_empty());
                assert!(set.counters.len() <= MAX_COUNTERS_PER_COUNTER_SET);
                assert!(set.counters.keys().all(|k| label(k)), "{:?}", set.counters);
            }
            let devices = s.spec.devices.as_deref().unwrap_or_default();
            let advanced = devices
                .iter()
                .any(|d| d.consumes_counters.is_some() || d.taints.is_some());
            if advanced {
                assert!(devices.len() <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS);
            }
            assert!(devices.len() <= slices::MAX_DEVICES_PER_SLICE);
            for d in devices {
                assert!(label(&d.name), "{}", d.name);
                let entries = d.attributes.as_ref().map_or(0, BTreeMap::len)
                    + d.capacity.as_ref().map_or(0, BTreeMap::len);
                assert!(entries <= slices::MAX_ATTRIBUTES_AND_CAPACITIES);
                let consumption = d.consumes_counters.as_deref().unwrap_or_default();
                assert!(consumption.len() <= MAX_COUNTER_CONSUMPTIONS_PER_DEVICE);
                for c in consumption {
                    assert!(!c.counters.is_empty());
                    assert!(c.counters.len() <= MAX_COUNTERS_PER_CONSUMPTION);
                }
            }
        }
        let all_sets = sets(slices);
        let set_names: BTreeSet<&str> = all_sets.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(set_names.len(), all_sets.len(), "duplicate counter set");
        let all_devices = devices(slices);
        let device_names: BTreeSet<&str> = all_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(device_names.len(), all_devices.len(), "duplicate device");
        for d in all_devices {
            for c in d.consumes_counters.iter().flatten() {
                let set = all_sets
                    .iter()
                    .find(|s| s.name == c.counter_set)
                    .unwrap_or_else(|| panic!("{}: no set {}", d.name, c.counter_set));
                for k in c.counters.keys() {
                    assert!(set.counters.contains_key(k), "{}: no counter {k}", d.name);
                }
            }
        }
    }

    #[test]
    fn a_large_node_respects_the_api_limits() {
        // 20 dynamic A100s (26 devices each) next to 150 static GPUs.
        let dynamic: Vec<Gpu> = (0..20).map(|m| a100_dynamic(m).build()).collect();
        let gpus = dynamic
            .iter()
            .cloned()
            .chain((20..170).map(|m| h100(m).build()));
        let r = render_pool(
            &inventory(gpus),
            &params(),
            &BTreeMap::new(),
            &uuids(&dynamic),
        );
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_valid_pool(&r.slices);
        let shape: Vec<(usize, usize)> = r
            .slices
            .iter()
            .map(|s| {
                (
                    s.spec.devices.as_ref().map_or(0, Vec::len),
                    s.spec.shared_counters.as_ref().map_or(0, Vec::len),
                )
            })
            .collect();
        // 150 static in 128 + 22; 520 dynamic in 64s; 20 sets in 8s.
        assert_eq!(
            shape,
            [
                (128, 0),
                (22, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (64, 0),
                (8, 0),
                (0, 8),
                (0, 8),
                (0, 4)
            ]
        );
        // Small pools too.
        let gpu = a100_dynamic(0).build();
        let r = render_pool(
            &inventory([gpu.clone()]),
            &params(),
            &BTreeMap::new(),
            &uuids([&gpu]),
        );
        assert_valid_pool(&r.slices);
        assert_eq!(
            r.slices.len(),
            2,
            "no empty static slice next to dynamic ones"
        );
    }
}
