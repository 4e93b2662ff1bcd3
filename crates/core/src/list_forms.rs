//! List-type forms of attributes, for clusters with `DRAListTypeAttributes` (KEP-5491, alpha
//! since Kubernetes 1.36): the plugin flag `--list-type-attributes` turns them on.
//!
//! What changes with lists on (everything else stays as [`crate::slices`] renders it):
//! - `gpu.nvidia.com/nvlinkDomain` becomes `strings`: every maximal all-to-all NVLink set the
//!   GPU is in, its scalar domain first ([`crate::topology::NvlinkDomains::cliques_of`]). With
//!   list semantics (`matchAttribute` needs a value common to all devices) a constraint still
//!   means "pairwise NVLink peers", and the cross pairs of a partial mesh become allocatable.
//!   A GPU whose peers all went to a larger set in the scalar partition (so it has no scalar
//!   `nvlinkDomain`) gets its sets here.
//! - `resource.kubernetes.io/numaNode` becomes `ints` with the one node, as NVIDIA's driver
//!   publishes it under its gate of the same name (the same-socket nodes of KEP-6072 need the
//!   ACPI SLIT distances, which discovery does not read).
//! - Every slice holding a list holds at most
//!   [`crate::slices::MAX_DEVICES_PER_SLICE_WITH_TAINTS`] devices, the API's limit for slices
//!   with advanced features: larger slices are split and the pool's slices renumbered.
//!
//! The Kubernetes types this crate builds on (k8s-openapi, API 1.35) have no list fields, so a
//! list cannot live in the typed [`DeviceAttribute`]. The typed slice carries an empty
//! attribute in its place, which is also what a list attribute reads back as through those
//! types, so the publisher's comparison of the specs still sees the attribute's presence; the
//! values themselves travel in the slice's annotation [`ANNOTATION`] (JSON, device -> attribute
//! -> list), which the comparison of annotations covers, and [`wire`] writes them into the
//! JSON sent to the API server. A cluster without the gate drops the lists and then refuses
//! the empty attribute: that is why the flag is off by default.

use std::collections::BTreeMap;

use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::{DeviceAttribute, ResourceSlice};
use serde::{Deserialize, Serialize};

use crate::slices::{
    self, DeviceKind, MAX_DEVICES_PER_SLICE_WITH_TAINTS, Rendered, SliceParams, attr,
};
use crate::topology::NvlinkDomains;

/// The slice annotation holding the list values of its devices (JSON).
pub const ANNOTATION: &str = "gpu.nvidia.com/list-attributes";

/// A list-type attribute value as the API spells it (`{"ints": [...]}`, `{"strings": [...]}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ListValue {
    /// `ints`.
    #[serde(rename = "ints")]
    Ints(Vec<i64>),
    /// `strings`.
    #[serde(rename = "strings")]
    Strings(Vec<String>),
}

/// Device name -> attribute name -> list value: the content of [`ANNOTATION`].
pub type SliceLists = BTreeMap<String, BTreeMap<String, ListValue>>;

/// Errors of [`wire`].
#[derive(Debug, thiserror::Error)]
pub enum ListFormError {
    /// The slice does not serialize (never expected of k8s-openapi types).
    #[error("serializing ResourceSlice {slice}")]
    Serialize {
        /// Slice name.
        slice: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The annotation is not what [`apply`] writes.
    #[error(
        "annotation {ANNOTATION} of ResourceSlice {slice} is not a device -> attribute -> list map"
    )]
    Annotation {
        /// Slice name.
        slice: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Turns the list-capable attributes of `rendered` into their list forms (see the module
/// doc), splitting slices over the advanced-feature limit. `params` names the slices again
/// when the count changes.
pub fn apply(rendered: &mut Rendered, inventory: &Inventory, params: &SliceParams<'_>) {
    let domains = NvlinkDomains::of(inventory);
    let mut slices = Vec::with_capacity(rendered.slices.len());
    for slice in rendered.slices.drain(..) {
        let devices = slice.spec.devices.as_deref().unwrap_or_default();
        if devices.len() <= MAX_DEVICES_PER_SLICE_WITH_TAINTS {
            slices.push(slice);
            continue;
        }
        for chunk in devices.chunks(MAX_DEVICES_PER_SLICE_WITH_TAINTS) {
            let mut part = slice.clone();
            part.spec.devices = Some(chunk.to_vec());
            slices.push(part);
        }
    }
    let count = slices.len() as i64;
    for (n, slice) in slices.iter_mut().enumerate() {
        slice.metadata.name = Some(slices::slice_name(params.node_name, params.driver_name, n));
        slice.spec.pool.resource_slice_count = count;
        let mut lists = SliceLists::new();
        for device in slice.spec.devices.iter_mut().flatten() {
            let Some(attributes) = device.attributes.as_mut() else {
                continue;
            };
            let device_lists = device_lists(attributes, &domains);
            for key in device_lists.keys() {
                attributes.insert(key.clone(), DeviceAttribute::default());
            }
            if !device_lists.is_empty() {
                lists.insert(device.name.clone(), device_lists);
            }
        }
        if !lists.is_empty() {
            let json = serde_json::to_string(&lists).unwrap_or_default();
            slice
                .metadata
                .annotations
                .get_or_insert_default()
                .insert(ANNOTATION.to_string(), json);
        }
    }
    rendered.slices = slices;
}

/// The list forms of one rendered device's list-capable attributes (attribute name -> list),
/// from its scalar `attributes` as [`crate::slices`] renders them and the node's NVLink
/// domains: what [`apply`] publishes for the device, and what device metadata tells its
/// containers ([`crate::device_metadata`]).
pub fn device_lists(
    attributes: &BTreeMap<String, DeviceAttribute>,
    domains: &NvlinkDomains,
) -> BTreeMap<String, ListValue> {
    let uuid = attributes
        .get(attr::UUID)
        .and_then(|a| a.string.as_deref())
        .unwrap_or_default();
    let mut lists = BTreeMap::new();
    if let Some(node) = attributes.get(attr::NUMA_NODE).and_then(|a| a.int) {
        lists.insert(attr::NUMA_NODE.to_string(), ListValue::Ints(vec![node]));
    }
    // Whole GPUs only (MIG devices have no peer-to-peer), and also those the scalar
    // partition left without a domain because their peers were taken by a larger set.
    let whole_gpu = attributes.get(attr::TYPE).and_then(|a| a.string.as_deref())
        == Some(DeviceKind::Gpu.as_str());
    let cliques = domains.cliques_of(uuid);
    if whole_gpu && !cliques.is_empty() {
        lists.insert(
            attr::NVLINK_DOMAIN.to_string(),
            ListValue::Strings(cliques.to_vec()),
        );
    }
    lists
}

/// The list values `slice` carries in [`ANNOTATION`] (empty without it).
pub fn lists_of(slice: &ResourceSlice) -> Result<SliceLists, ListFormError> {
    let Some(json) = slice
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
    else {
        return Ok(SliceLists::new());
    };
    serde_json::from_str(json).map_err(|source| ListFormError::Annotation {
        slice: slice.metadata.name.clone().unwrap_or_default(),
        source,
    })
}

/// `slice` as the JSON to send to the API server: the typed slice with the list values of
/// its annotation written into its devices' attributes. A slice without the annotation is
/// its plain serialization.
pub fn wire(slice: &ResourceSlice) -> Result<serde_json::Value, ListFormError> {
    let name = || slice.metadata.name.clone().unwrap_or_default();
    let lists = lists_of(slice)?;
    let mut json = serde_json::to_value(slice).map_err(|source| ListFormError::Serialize {
        slice: name(),
        source,
    })?;
    if lists.is_empty() {
        return Ok(json);
    }
    let devices = json
        .pointer_mut("/spec/devices")
        .and_then(serde_json::Value::as_array_mut);
    for device in devices.into_iter().flatten() {
        let Some(name) = device.get("name").and_then(|n| n.as_str()) else {
            continue;
        };
        let Some(device_lists) = lists.get(name) else {
            continue;
        };
        let Some(attributes) = device
            .get_mut("attributes")
            .and_then(serde_json::Value::as_object_mut)
        else {
            continue;
        };
        for (key, value) in device_lists {
            let value = serde_json::to_value(value).map_err(|source| ListFormError::Serialize {
                slice: slice.metadata.name.clone().unwrap_or_default(),
                source,
            })?;
            attributes.insert(key.clone(), value);
        }
    }
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::{a100, inventory, mig_1g5gb};

    const PARAMS: SliceParams<'static> = SliceParams {
        node_name: "node-a",
        driver_name: "gpu.nvidia.com",
        generation: 1,
    };

    fn uuid(i: u32) -> String {
        a100(i).build().uuid
    }

    /// GPUs 0-2 fully linked, 2-3 a pair: GPU 2 is in two maximal sets.
    fn linked() -> Inventory {
        let (u0, u1, u2, u3) = (uuid(0), uuid(1), uuid(2), uuid(3));
        inventory([
            a100(0).nvlink_peers(&[&u1, &u2]).build(),
            a100(1).nvlink_peers(&[&u0, &u2]).build(),
            a100(2).nvlink_peers(&[&u0, &u1, &u3]).build(),
            a100(3).nvlink_peers(&[&u2]).numa_node(Some(1)).build(),
            a100(4).mig(mig_1g5gb(0)).numa_node(None).build(),
        ])
    }

    fn rendered(inv: &Inventory) -> Rendered {
        let mut r = slices::render_slices(inv, &PARAMS);
        apply(&mut r, inv, &PARAMS);
        r
    }

    fn attribute(wire: &serde_json::Value, device: &str, key: &str) -> serde_json::Value {
        wire["spec"]["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["name"] == device)
            .map(|d| d["attributes"][key].clone())
            .unwrap_or_default()
    }

    #[test]
    fn numa_node_becomes_a_one_element_list_and_domains_every_set() {
        let inv = linked();
        let r = rendered(&inv);
        assert_eq!(r.slices.len(), 1);
        let w = wire(&r.slices[0]).expect("wire");
        assert_eq!(
            attribute(&w, "gpu-3", attr::NUMA_NODE),
            serde_json::json!({"ints": [1]})
        );
        let domains = NvlinkDomains::of(&inv);
        let own = domains.domain_of(&uuid(2)).expect("domain");
        let l2 = attribute(&w, "gpu-2", attr::NVLINK_DOMAIN);
        let l2 = l2["strings"].as_array().expect("strings");
        assert_eq!(l2.len(), 2, "{l2:?}");
        assert_eq!(l2[0], own);
        // GPU 3 has no scalar domain (its one peer is in the triangle), but its pair with
        // GPU 2 as a list; it shares nothing with GPU 0.
        assert_eq!(domains.domain_of(&uuid(3)), None);
        let l3 = attribute(&w, "gpu-3", attr::NVLINK_DOMAIN);
        let l0 = attribute(&w, "gpu-0", attr::NVLINK_DOMAIN);
        assert_eq!(l3["strings"].as_array().expect("strings").len(), 1);
        assert!(l2.contains(&l3["strings"][0]));
        assert!(
            !l0["strings"]
                .as_array()
                .expect("strings")
                .contains(&l3["strings"][0])
        );
        // Nothing scalar is left where a list is published.
        for d in ["gpu-0", "gpu-1", "gpu-2", "gpu-3"] {
            assert!(
                attribute(&w, d, attr::NUMA_NODE).get("int").is_none(),
                "{d}"
            );
        }
    }

    #[test]
    fn mig_devices_get_the_numa_list_but_no_domain() {
        let inv = linked();
        let r = rendered(&inv);
        let w = wire(&r.slices[0]).expect("wire");
        let mig = w["spec"]["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["attributes"]["type"]["string"] == "mig")
            .expect("a MIG device")
            .clone();
        assert!(mig["attributes"].get(attr::NVLINK_DOMAIN).is_none());
        // GPU 4 has no NUMA node: no list either.
        assert!(mig["attributes"].get(attr::NUMA_NODE).is_none());
    }

    #[test]
    fn the_typed_slice_has_placeholders_and_the_annotation_the_values() {
        let inv = linked();
        let r = rendered(&inv);
        let d = &r.slices[0].spec.devices.as_ref().expect("devices")[0];
        let attrs = d.attributes.as_ref().expect("attributes");
        assert_eq!(attrs[attr::NUMA_NODE], DeviceAttribute::default());
        let lists = lists_of(&r.slices[0]).expect("annotation");
        assert_eq!(lists[&d.name][attr::NUMA_NODE], ListValue::Ints(vec![0]));
    }

    #[test]
    fn without_lists_the_wire_form_is_the_plain_serialization() {
        let inv = inventory([a100(0).numa_node(None).pcie_root(None).build()]);
        let r = slices::render_slices(&inv, &PARAMS);
        let w = wire(&r.slices[0]).expect("wire");
        assert_eq!(w, serde_json::to_value(&r.slices[0]).expect("json"));
        let mut r2 = r.clone();
        apply(&mut r2, &inv, &PARAMS);
        assert_eq!(r2, r, "nothing to turn into a list: nothing changes");
    }

    #[test]
    fn slices_over_the_advanced_limit_are_split_and_renumbered() {
        // 20 GPUs with 7 MIG devices each: 140 devices, 2 slices without lists, 3 with.
        let gpus: Vec<_> = (0..20)
            .map(|i| a100(i).migs((0..7).map(mig_1g5gb)).build())
            .collect();
        let inv = inventory(gpus);
        let plain = slices::render_slices(&inv, &PARAMS);
        assert_eq!(plain.slices.len(), 2);
        let r = rendered(&inv);
        assert_eq!(r.slices.len(), 3);
        for (n, s) in r.slices.iter().enumerate() {
            assert_eq!(
                s.metadata.name.as_deref(),
                Some(format!("node-a-gpu-nvidia-com-{n}").as_str())
            );
            assert_eq!(s.spec.pool.resource_slice_count, 3);
            assert!(s.spec.devices.as_ref().expect("devices").len() <= 64);
        }
        let total: usize = r
            .slices
            .iter()
            .map(|s| s.spec.devices.as_ref().expect("devices").len())
            .sum();
        assert_eq!(total, 140);
    }

    #[test]
    fn a_broken_annotation_is_an_error_that_names_the_slice() {
        let inv = linked();
        let mut r = rendered(&inv);
        r.slices[0]
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(ANNOTATION.into(), "[1]".into());
        let e = wire(&r.slices[0]).expect_err("broken");
        assert!(e.to_string().contains("node-a-gpu-nvidia-com-0"), "{e}");
    }
}
