//! The publisher's decision: the difference between the desired slices and what the API server
//! holds, as the operations that close it ([`diff`] -> [`SliceDiff`]).
//!
//! Pure and synchronous so every rule is unit-tested without an API server. (Named apart from
//! `gpu_dra_core::plan`, the prepare plan of a claim, which has nothing to do with slices.)
//!
//! Pool generation rules (what the scheduler relies on):
//! - every slice of the pool carries the same `pool.generation` and the pool's slice count;
//! - when the published content would change, the generation goes up (above every generation
//!   seen and every one this process wrote), and every slice is rewritten with it;
//! - when content is unchanged but slices are missing (someone deleted one) or carry the wrong
//!   owner, they are restored at the *current* generation, so the pool is complete again
//!   without making the scheduler discard it;
//! - slices of ours that the desired state does not name are deleted.
//!
//! Updates come before creations and deletions last, so a newer generation is complete as
//! early as possible and no device disappears before its replacement exists.

use std::collections::{BTreeMap, BTreeSet};

use gpu_dra_core::health::Taint;
use gpu_dra_core::list_forms;
use gpu_dra_core::partitioning::Partitioning;
use gpu_dra_core::slices::{self, Rendered, SliceParams};
use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// One write against the API server.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Create this slice.
    Create(ResourceSlice),
    /// Replace this slice (its `metadata.resourceVersion` is the observed one).
    Update(ResourceSlice),
    /// Delete the slice with this name (precondition: this resource version, when known).
    Delete {
        /// Slice name.
        name: String,
        /// Observed resource version.
        resource_version: Option<String>,
    },
}

impl Op {
    /// The slice name the operation targets.
    pub fn name(&self) -> &str {
        match self {
            Op::Create(s) | Op::Update(s) => s.metadata.name.as_deref().unwrap_or_default(),
            Op::Delete { name, .. } => name,
        }
    }
}

/// What to do and the generation the pool ends up with.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceDiff {
    /// Pool generation after the operations.
    pub generation: i64,
    /// Operations in the order to apply them (empty: nothing to do).
    pub ops: Vec<Op>,
    /// Render warnings (attributes left out), for logging.
    pub warnings: Vec<slices::RenderWarning>,
}

/// Inputs of [`diff`] besides the inventory and the observed slices.
#[derive(Debug, Clone)]
pub struct DiffParams<'a> {
    /// Node name (pool name).
    pub node_name: &'a str,
    /// Driver name.
    pub driver_name: &'a str,
    /// Owner reference to the Node, set on every slice so they go away with it.
    pub owner: &'a OwnerReference,
    /// Highest generation this process has written (0 if none); a bump never goes below it, so
    /// the generation never moves backwards even if all slices were deleted meanwhile.
    pub last_generation: i64,
    /// Device taints from the health view (device name -> taints).
    pub taints: &'a BTreeMap<String, Vec<Taint>>,
    /// How each GPU is offered (static, dynamic MIG, memory shares).
    pub partitioning: &'a Partitioning,
    /// Dynamic MIG devices that claims' records hold: their instances are left to their
    /// placements ([`gpu_dra_core::partitioning::render`]).
    pub dynamic_mig_devices: &'a BTreeSet<String>,
    /// Publish the list-type forms of attributes ([`gpu_dra_core::list_forms`]; the plugin's
    /// `--list-type-attributes`).
    pub list_attributes: bool,
    /// The API server drops device taints: devices with a taint are left out of the slices
    /// instead ([`super::features`]).
    pub withhold_tainted: bool,
}

/// Decides the operations that turn `observed` (our pool's slices on the server) into the
/// rendering of `inventory`.
pub fn diff(
    inventory: &Inventory,
    params: &DiffParams<'_>,
    observed: &[ResourceSlice],
) -> SliceDiff {
    let render = |generation| {
        let slice_params = SliceParams {
            node_name: params.node_name,
            driver_name: params.driver_name,
            generation,
        };
        let no_taints = BTreeMap::new();
        let mut rendered = gpu_dra_core::partitioning::render(
            inventory,
            &slice_params,
            if params.withhold_tainted {
                &no_taints
            } else {
                params.taints
            },
            params.partitioning,
            params.dynamic_mig_devices,
        );
        if params.withhold_tainted {
            withhold(&mut rendered.slices, params.taints);
        }
        if params.list_attributes {
            gpu_dra_core::list_forms::apply(&mut rendered, inventory, &slice_params);
        }
        let Rendered {
            mut slices,
            warnings,
        } = rendered;
        for s in &mut slices {
            s.metadata.owner_references = Some(vec![params.owner.clone()]);
        }
        (slices, warnings)
    };

    let current = common_generation(observed);
    if let Some(generation) = current {
        let (desired, warnings) = render(generation);
        let unchanged = observed.iter().all(|o| {
            desired
                .iter()
                .find(|d| d.metadata.name == o.metadata.name)
                .is_none_or(|d| same_spec(&o.spec, &d.spec) && same_lists(o, d))
        });
        if unchanged {
            let mut ops = Vec::new();
            for d in desired.iter() {
                match find(observed, d) {
                    Some(o) if owned_by(o, params.owner) => {}
                    Some(o) => ops.push(Op::Update(with_version(d, o))),
                    None => ops.push(Op::Create(d.clone())),
                }
            }
            ops.sort_by_key(|op| matches!(op, Op::Create(_)));
            ops.extend(deletions(observed, &desired));
            return SliceDiff {
                generation,
                ops,
                warnings,
            };
        }
    }

    let seen = observed
        .iter()
        .map(|o| o.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let generation = seen.max(params.last_generation).saturating_add(1);
    let (desired, warnings) = render(generation);
    let mut updates = Vec::new();
    let mut creates = Vec::new();
    for d in &desired {
        match find(observed, d) {
            Some(o) => updates.push(Op::Update(with_version(d, o))),
            None => creates.push(Op::Create(d.clone())),
        }
    }
    let mut ops = updates;
    ops.extend(creates);
    ops.extend(deletions(observed, &desired));
    SliceDiff {
        generation,
        ops,
        warnings,
    }
}

/// The generation all observed slices share, if they share one (and exist).
fn common_generation(observed: &[ResourceSlice]) -> Option<i64> {
    let first = observed.first()?.spec.pool.generation;
    observed
        .iter()
        .all(|o| o.spec.pool.generation == first)
        .then_some(first)
}

fn find<'a>(observed: &'a [ResourceSlice], desired: &ResourceSlice) -> Option<&'a ResourceSlice> {
    observed
        .iter()
        .find(|o| o.metadata.name == desired.metadata.name)
}

fn with_version(desired: &ResourceSlice, observed: &ResourceSlice) -> ResourceSlice {
    let mut s = desired.clone();
    s.metadata.resource_version = observed.metadata.resource_version.clone();
    s
}

fn deletions<'a>(
    observed: &'a [ResourceSlice],
    desired: &'a [ResourceSlice],
) -> impl Iterator<Item = Op> + 'a {
    observed
        .iter()
        .filter(|o| !desired.iter().any(|d| d.metadata.name == o.metadata.name))
        .map(|o| Op::Delete {
            name: o.metadata.name.clone().unwrap_or_default(),
            resource_version: o.metadata.resource_version.clone(),
        })
}

fn owned_by(slice: &ResourceSlice, owner: &OwnerReference) -> bool {
    slice
        .metadata
        .owner_references
        .as_ref()
        .is_some_and(|refs| {
            refs.iter()
                .any(|r| r.uid == owner.uid && r.kind == owner.kind)
        })
}

/// Leaves the devices with a taint out of `slices` (where the server cannot keep taints).
fn withhold(slices: &mut [ResourceSlice], taints: &BTreeMap<String, Vec<Taint>>) {
    for s in slices {
        if let Some(devices) = s.spec.devices.as_mut() {
            devices.retain(|d| taints.get(&d.name).is_none_or(Vec::is_empty));
        }
    }
}

/// Whether `observed` carries the list values of `desired` ([`list_forms::ANNOTATION`]): the
/// typed specs cannot show them (see [`gpu_dra_core::list_forms`]).
fn same_lists(observed: &ResourceSlice, desired: &ResourceSlice) -> bool {
    let lists = |s: &ResourceSlice| {
        s.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(list_forms::ANNOTATION))
            .cloned()
    };
    lists(observed) == lists(desired)
}

/// Spec equality as the API server sees it: an absent device list equals an empty one and
/// quantities compare by value (the server may return another spelling of the same amount).
pub fn same_spec(observed: &ResourceSliceSpec, desired: &ResourceSliceSpec) -> bool {
    normalize(observed) == normalize(desired)
}

fn normalize(spec: &ResourceSliceSpec) -> ResourceSliceSpec {
    let mut spec = spec.clone();
    let mut devices = spec.devices.take().unwrap_or_default();
    for d in &mut devices {
        if let Some(caps) = d.capacity.as_mut() {
            for c in caps.values_mut() {
                let exact = gpu_dra_api::quantity::Quantity::parse(&c.value.0)
                    .ok()
                    .and_then(|q| q.to_u64_exact());
                if let Some(v) = exact {
                    c.value = slices::capacity_quantity(v);
                }
            }
        }
        if d.attributes.as_ref().is_some_and(|a| a.is_empty()) {
            d.attributes = None;
        }
        if d.capacity.as_ref().is_some_and(|c| c.is_empty()) {
            d.capacity = None;
        }
    }
    spec.devices = Some(devices);
    spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::h100_inventory as inventory;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: "node-a".into(),
            uid: "uid-1".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }

    static NO_TAINTS: BTreeMap<String, Vec<Taint>> = BTreeMap::new();
    static NO_DYNAMIC_DEVICES: BTreeSet<String> = BTreeSet::new();
    static STATIC: Partitioning = Partitioning {
        dynamic_mig: gpu_dra_core::partitioning::GpuSelection::None,
        memory_shares: gpu_dra_core::partitioning::GpuSelection::None,
        consumable_shares: gpu_dra_core::consumable_shares::ConsumableShares::Disabled,
    };

    fn params(owner: &OwnerReference, last: i64) -> DiffParams<'_> {
        DiffParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            owner,
            last_generation: last,
            taints: &NO_TAINTS,
            partitioning: &STATIC,
            dynamic_mig_devices: &NO_DYNAMIC_DEVICES,
            list_attributes: false,
            withhold_tainted: false,
        }
    }

    /// Applies a diff as an API server with `DRAListTypeAttributes` would: it stores what
    /// [`list_forms::wire`] sends, and the typed client reads the lists back as empty
    /// attributes (k8s-openapi has no list fields).
    fn apply_through_the_wire(server: &mut Vec<ResourceSlice>, diff: &SliceDiff) {
        let mut wired = diff.clone();
        for op in &mut wired.ops {
            if let Op::Create(s) | Op::Update(s) = op {
                let json = list_forms::wire(s).expect("wire");
                *s = serde_json::from_value(json).expect("typed read-back");
            }
        }
        apply(server, &wired);
    }

    /// GPUs 0-1 NVLink peers, 2 alone.
    fn linked() -> Inventory {
        use gpu_dra_device::testing::{h100, inventory};
        let (u0, u1) = (h100(0).build().uuid, h100(1).build().uuid);
        inventory([
            h100(0).nvlink_peers(&[&u1]).build(),
            h100(1).nvlink_peers(&[&u0]).build(),
            h100(2).build(),
        ])
    }

    #[test]
    fn list_attributes_converge_and_a_change_of_lists_alone_is_published() {
        let o = owner();
        let mut server = vec![];
        let mut lists = params(&o, 0);
        lists.list_attributes = true;
        let inv = linked();
        let first = diff(&inv, &lists, &server);
        apply_through_the_wire(&mut server, &first);
        lists.last_generation = first.generation;
        let again = diff(&inv, &lists, &server);
        assert!(again.ops.is_empty(), "{:?}", kinds(&again));
        // Turning lists off rewrites the slices with the scalars, at a new generation.
        let mut scalars = params(&o, first.generation);
        let off = diff(&inv, &scalars, &server);
        assert_eq!(kinds(&off), ["update node-a-gpu-nvidia-com-0"]);
        assert!(off.generation > first.generation);
        apply(&mut server, &off);
        scalars.last_generation = off.generation;
        assert!(diff(&inv, &scalars, &server).ops.is_empty());
        // A list that changes while every placeholder stays (GPU 1 loses NUMA node 0 to
        // node 1: same attributes, other values) is seen through the annotation.
        lists.last_generation = off.generation;
        let on = diff(&inv, &lists, &server);
        apply_through_the_wire(&mut server, &on);
        let mut moved = inv.clone();
        moved.gpus[1].numa_node = Some(1);
        lists.last_generation = on.generation;
        let p = diff(&moved, &lists, &server);
        assert_eq!(kinds(&p), ["update node-a-gpu-nvidia-com-0"]);
    }

    /// Applies a diff to a fake server state, as the API server would.
    fn apply(server: &mut Vec<ResourceSlice>, diff: &SliceDiff) {
        for op in &diff.ops {
            match op {
                Op::Create(s) => {
                    assert!(server.iter().all(|o| o.metadata.name != s.metadata.name));
                    let mut s = s.clone();
                    s.metadata.resource_version = Some("1".into());
                    server.push(s);
                }
                Op::Update(s) => {
                    let o = server
                        .iter_mut()
                        .find(|o| o.metadata.name == s.metadata.name)
                        .expect("update of a missing slice");
                    assert_eq!(o.metadata.resource_version, s.metadata.resource_version);
                    *o = s.clone();
                }
                Op::Delete { name, .. } => {
                    server.retain(|o| o.metadata.name.as_deref() != Some(name));
                }
            }
        }
        server.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    }

    /// Diffs against the fake server state and applies the operations.
    fn publish(server: &mut Vec<ResourceSlice>, inv: &Inventory, params: &DiffParams<'_>) {
        let p = diff(inv, params, server);
        apply(server, &p);
    }

    fn kinds(diff: &SliceDiff) -> Vec<String> {
        diff.ops
            .iter()
            .map(|op| {
                let k = match op {
                    Op::Create(_) => "create",
                    Op::Update(_) => "update",
                    Op::Delete { .. } => "delete",
                };
                format!("{k} {}", op.name())
            })
            .collect()
    }

    #[test]
    fn first_publication_creates_generation_one_and_then_converges() {
        let o = owner();
        let inv = inventory(2);
        let mut server = vec![];
        let p = diff(&inv, &params(&o, 0), &server);
        assert_eq!(p.generation, 1);
        assert_eq!(kinds(&p), ["create node-a-gpu-nvidia-com-0"]);
        apply(&mut server, &p);
        let again = diff(&inv, &params(&o, 1), &server);
        assert!(again.ops.is_empty(), "{:?}", kinds(&again));
        assert_eq!(again.generation, 1);
        let s = &server[0];
        assert_eq!(
            s.metadata.owner_references.as_ref().unwrap()[0].uid,
            "uid-1"
        );
    }

    #[test]
    fn changed_inventory_bumps_the_generation_on_every_slice() {
        let o = owner();
        let mut server = vec![];
        publish(&mut server, &inventory(130), &params(&o, 0));
        assert_eq!(server.len(), 2);
        let p = diff(&inventory(131), &params(&o, 1), &server);
        assert_eq!(p.generation, 2);
        assert_eq!(
            kinds(&p),
            [
                "update node-a-gpu-nvidia-com-0",
                "update node-a-gpu-nvidia-com-1"
            ]
        );
        apply(&mut server, &p);
        assert!(server.iter().all(|s| s.spec.pool.generation == 2));
    }

    #[test]
    fn shrinking_deletes_stale_slices_after_updating_the_rest() {
        let o = owner();
        let mut server = vec![];
        publish(&mut server, &inventory(200), &params(&o, 0));
        let p = diff(&inventory(3), &params(&o, 1), &server);
        assert_eq!(
            kinds(&p),
            [
                "update node-a-gpu-nvidia-com-0",
                "delete node-a-gpu-nvidia-com-1"
            ]
        );
        apply(&mut server, &p);
        assert_eq!(server.len(), 1);
        assert_eq!(server[0].spec.pool.resource_slice_count, 1);
        assert_eq!(server[0].spec.pool.generation, 2);
    }

    #[test]
    fn a_deleted_slice_is_restored_at_the_same_generation() {
        let o = owner();
        let inv = inventory(200);
        let mut server = vec![];
        publish(&mut server, &inv, &params(&o, 0));
        server.remove(1);
        let p = diff(&inv, &params(&o, 1), &server);
        assert_eq!(p.generation, 1);
        assert_eq!(kinds(&p), ["create node-a-gpu-nvidia-com-1"]);
    }

    #[test]
    fn all_slices_deleted_restarts_above_the_last_written_generation() {
        let o = owner();
        let p = diff(&inventory(1), &params(&o, 7), &[]);
        assert_eq!(p.generation, 8);
    }

    #[test]
    fn an_edited_slice_is_rewritten_with_a_new_generation() {
        let o = owner();
        let inv = inventory(2);
        let mut server = vec![];
        publish(&mut server, &inv, &params(&o, 0));
        server[0].spec.devices.as_mut().unwrap()[0].name = "gpu-99".into();
        let p = diff(&inv, &params(&o, 1), &server);
        assert_eq!(p.generation, 2);
        assert_eq!(kinds(&p), ["update node-a-gpu-nvidia-com-0"]);
        apply(&mut server, &p);
        assert!(diff(&inv, &params(&o, 2), &server).ops.is_empty());
    }

    #[test]
    fn mixed_generations_are_unified_above_the_highest() {
        let o = owner();
        let inv = inventory(200);
        let mut server = vec![];
        publish(&mut server, &inv, &params(&o, 0));
        server[1].spec.pool.generation = 5;
        let p = diff(&inv, &params(&o, 1), &server);
        assert_eq!(p.generation, 6);
        assert_eq!(p.ops.len(), 2);
    }

    #[test]
    fn a_missing_owner_reference_is_repaired_without_a_bump() {
        let o = owner();
        let inv = inventory(1);
        let mut server = vec![];
        publish(&mut server, &inv, &params(&o, 0));
        server[0].metadata.owner_references = None;
        let p = diff(&inv, &params(&o, 1), &server);
        assert_eq!(p.generation, 1);
        assert_eq!(kinds(&p), ["update node-a-gpu-nvidia-com-0"]);
        // A Node recreated with a new UID: slices are re-owned.
        let mut new_owner = owner();
        new_owner.uid = "uid-2".into();
        apply(&mut server, &p);
        let p = diff(&inv, &params(&new_owner, 1), &server);
        assert_eq!(kinds(&p), ["update node-a-gpu-nvidia-com-0"]);
    }

    #[test]
    fn server_spellings_of_the_same_quantity_and_empty_lists_are_equal() {
        let o = owner();
        let inv = inventory(1);
        let mut server = vec![];
        publish(&mut server, &inv, &params(&o, 0));
        let caps = server[0].spec.devices.as_mut().unwrap()[0]
            .capacity
            .as_mut()
            .unwrap();
        caps.get_mut("memory").unwrap().value = Quantity(format!("{}", 81559u64 << 20));
        assert!(diff(&inv, &params(&o, 1), &server).ops.is_empty());

        let empty = inventory(0);
        let mut server = vec![];
        publish(&mut server, &empty, &params(&o, 0));
        server[0].spec.devices = None;
        assert!(diff(&empty, &params(&o, 1), &server).ops.is_empty());
    }

    /// Something that happens to the server between reconciles.
    #[derive(Debug, Clone)]
    enum Disturbance {
        Nothing,
        DeleteSlice(usize),
        EditSlice(usize),
        BumpGeneration(usize, i64),
        DropOwner(usize),
    }

    fn arb_disturbance() -> impl proptest::strategy::Strategy<Value = Disturbance> {
        use proptest::prelude::*;
        prop_oneof![
            Just(Disturbance::Nothing),
            (0usize..4).prop_map(Disturbance::DeleteSlice),
            (0usize..4).prop_map(Disturbance::EditSlice),
            ((0usize..4), 1i64..50).prop_map(|(i, g)| Disturbance::BumpGeneration(i, g)),
            (0usize..4).prop_map(Disturbance::DropOwner),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// Whatever the inventory changes and third-party edits, one diff brings the server to
        /// the desired pool: a second diff is empty, every slice has the same generation and
        /// the right count, the generation never goes down, and the devices are the inventory's.
        #[test]
        fn one_diff_always_converges(
            steps in proptest::collection::vec(((0u32..300), arb_disturbance()), 1..10),
        ) {
            let o = owner();
            let mut server: Vec<ResourceSlice> = vec![];
            let mut last = 0i64;
            for (n, disturbance) in steps {
                match disturbance {
                    Disturbance::Nothing => {}
                    Disturbance::DeleteSlice(i) if i < server.len() => {
                        server.remove(i);
                    }
                    Disturbance::EditSlice(i) if i < server.len() => {
                        if let Some(d) = server[i].spec.devices.as_mut().and_then(|d| d.first_mut()) {
                            d.name = "edited".into();
                        } else {
                            server[i].spec.pool.resource_slice_count += 1;
                        }
                    }
                    Disturbance::BumpGeneration(i, g) if i < server.len() => {
                        server[i].spec.pool.generation += g;
                    }
                    Disturbance::DropOwner(i) if i < server.len() => {
                        server[i].metadata.owner_references = None;
                    }
                    _ => {}
                }
                let inv = inventory(n);
                let p = diff(&inv, &params(&o, last), &server);
                proptest::prop_assert!(p.generation >= last);
                apply(&mut server, &p);
                last = last.max(p.generation);
                let again = diff(&inv, &params(&o, last), &server);
                proptest::prop_assert!(again.ops.is_empty(), "{:?}", kinds(&again));
                let count = server.len() as i64;
                proptest::prop_assert!(server.iter().all(|s| s.spec.pool.generation == p.generation
                    && s.spec.pool.resource_slice_count == count
                    && owned_by(s, &o)));
                let devices: usize = server.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum();
                proptest::prop_assert_eq!(devices, n as usize);
            }
        }
    }

    #[test]
    fn where_taints_are_not_kept_a_tainted_device_is_withheld() {
        let o = owner();
        let taints = BTreeMap::from([(
            "gpu-0".to_string(),
            vec![Taint {
                key: "gpu.nvidia.com/xid".into(),
                value: Some("79".into()),
                effect: gpu_dra_core::health::TaintEffect::NoExecute,
                since: 0,
            }],
        )]);
        let names = |d: &SliceDiff| -> Vec<(String, bool)> {
            d.ops
                .iter()
                .filter_map(|op| match op {
                    Op::Create(s) => s.spec.devices.clone(),
                    _ => None,
                })
                .flatten()
                .map(|d| (d.name, d.taints.is_some_and(|t| !t.is_empty())))
                .collect()
        };
        let tainted = DiffParams {
            taints: &taints,
            ..params(&o, 0)
        };
        let published = names(&diff(&inventory(2), &tainted, &[]));
        assert!(
            published.contains(&("gpu-0".to_string(), true)),
            "{published:?}"
        );
        let withheld = names(&diff(
            &inventory(2),
            &DiffParams {
                withhold_tainted: true,
                ..tainted
            },
            &[],
        ));
        assert!(!withheld.iter().any(|(n, _)| n == "gpu-0"), "{withheld:?}");
        assert!(
            withheld.iter().any(|(n, t)| n == "gpu-1" && !t),
            "{withheld:?}"
        );
    }
}
