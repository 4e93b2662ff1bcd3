//! `explain` against slices rendered by the real renderer: which devices match a claim's
//! selectors, which selector rejects the others and why, and who holds the allocated ones.

use gpu_dra_core::slices::{SliceParams, render_slices};
use gpu_dra_device::testing::{MigBuilder, a100, inventory, t4};
use gpu_dra_selectors::explain;
use serde_json::{Value, json};

const DRIVER: &str = "gpu.nvidia.com";

fn slices() -> Vec<Value> {
    let a100_node = inventory([
        a100(0).build(),
        a100(1).migs([MigBuilder::new("1g.5gb", 19, 0, 1)]).build(),
    ]);
    let t4_node = inventory([t4(0).build()]);
    let mut out = Vec::new();
    for (node, inv) in [("node-a100", a100_node), ("node-t4", t4_node)] {
        let params = SliceParams {
            node_name: node,
            driver_name: DRIVER,
            generation: 1,
        };
        for s in render_slices(&inv, &params).slices {
            out.push(serde_json::to_value(s).expect("slices serialize"));
        }
    }
    out
}

/// The DeviceClasses as the chart renders them.
fn classes() -> Vec<Value> {
    ["gpu", "mig"]
        .iter()
        .map(|t| {
            json!({"metadata": {"name": format!("{t}.nvidia.com")}, "spec": {"selectors": [{"cel": {"expression":
                format!("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '{t}'")}}]}})
        })
        .collect()
}

fn claim(name: &str, selector: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": "gpu.nvidia.com"});
    if let Some(s) = selector {
        exactly["selectors"] = json!([{"cel": {"expression": s}}]);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    })
}

fn verdicts(e: &gpu_dra_selectors::Explanation) -> Vec<(String, String, bool, Option<String>)> {
    e.requests[0]
        .nodes
        .iter()
        .flat_map(|n| {
            n.devices.iter().map(move |d| {
                (
                    n.node.clone(),
                    d.device.clone(),
                    d.matches,
                    d.reason.clone(),
                )
            })
        })
        .collect()
}

#[test]
fn the_index_selector_is_rejected_on_every_gpu_with_no_such_key() {
    let c = claim(
        "idx",
        Some("device.attributes['gpu.nvidia.com'].index == 0"),
    );
    let e = explain(&c, &classes(), &slices(), std::slice::from_ref(&c), DRIVER);
    assert!(!e.allocated);
    assert_eq!(e.findings.len(), 1, "{:?}", e.findings);
    let r = &e.requests[0];
    assert_eq!((r.matching, r.available), (0, 0));
    let v = verdicts(&e);
    assert_eq!(v.len(), 3, "{v:?}");
    // Whole GPUs pass the class and fail on the request's selector.
    let gpu0 = v
        .iter()
        .find(|(n, d, ..)| n == "node-a100" && d == "gpu-0")
        .unwrap();
    assert_eq!(
        gpu0.3.as_deref(),
        Some(
            "`device.attributes['gpu.nvidia.com'].index == 0`: evaluation error: no such key: index (index is not published)"
        )
    );
    assert_eq!(r.nodes[0].devices[0].rejected_by, Some(1));
    // The MIG device fails the class selector first, naming the value seen.
    let mig = v.iter().find(|(_, d, ..)| d.contains("-mig-")).unwrap();
    assert_eq!(
        mig.3.as_deref(),
        Some("`device.attributes['gpu.nvidia.com'].type == 'gpu'` is false (type is \"mig\")")
    );
    let text = e.to_text();
    assert!(
        text.contains("ResourceClaim ns/idx: not allocated"),
        "{text}"
    );
    assert!(text.contains("gpu-0: rejected by request selector 0: `device.attributes['gpu.nvidia.com'].index == 0`: evaluation error: no such key: index"), "{text}");
    assert!(
        text.contains("0 of 3 gpu.nvidia.com devices match"),
        "{text}"
    );
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(json["requests"][0]["selectors"][1]["source"], "request");
}

#[test]
fn matching_devices_and_allocations_of_other_claims_are_shown() {
    let mine = claim(
        "a100",
        Some(
            "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA A100') && device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
        ),
    );
    let mut other = claim("other", None);
    other["status"] = json!({"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": "node-a100", "device": "gpu-0"}]}}});
    let e = explain(&mine, &classes(), &slices(), &[mine.clone(), other], DRIVER);
    assert!(e.findings.is_empty(), "{:?}", e.findings);
    let r = &e.requests[0];
    assert_eq!((r.matching, r.available), (1, 0));
    let gpu0 = &r.nodes[0].devices[0];
    assert_eq!((gpu0.device.as_str(), gpu0.matches), ("gpu-0", true));
    assert_eq!(gpu0.allocated_to.as_deref(), Some("ns/other"));
    let t4 = &r.nodes[1].devices[0];
    assert_eq!(
        t4.reason.as_deref(),
        Some(
            "`device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA A100')` is false (productName is \"Tesla T4\")"
        )
    );
}

#[test]
fn versions_quantities_and_foreign_domains_evaluate_as_in_the_scheduler() {
    for (selector, matching) in [
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('500.0.0')) > 0",
            2,
        ),
        (
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isLessThan(semver('8.0.0'))",
            1,
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('16Gi'))",
            1,
        ),
        (
            "device.attributes['resource.kubernetes.io'].pciBusID != ''",
            2,
        ),
        // A domain the devices have nothing in is an empty map, not an error.
        ("!('model' in device.attributes['example.com'])", 2),
        ("device.allowMultipleAllocations == false", 2),
    ] {
        let c = claim("c", Some(selector));
        let e = explain(&c, &classes(), &slices(), &[], DRIVER);
        assert_eq!(
            e.requests[0].matching,
            matching,
            "{selector}: {}",
            e.to_text()
        );
    }
}

#[test]
fn a_missing_device_class_is_said() {
    let mut c = claim("c", None);
    c["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = json!("gpu.example.com");
    let e = explain(&c, &classes(), &slices(), &[], DRIVER);
    assert!(!e.requests[0].device_class_found);
    assert!(
        e.to_text()
            .contains("DeviceClass gpu.example.com does not exist")
    );
}

/// A node of four A100s bridged in pairs (0-1, 2-3), rendered with or without list forms.
fn bridged_pairs(lists: bool) -> Vec<Value> {
    let u = |i| a100(i).build().uuid;
    let inv = inventory([
        a100(0).nvlink_peers(&[&u(1)]).build(),
        a100(1).nvlink_peers(&[&u(0)]).build(),
        a100(2).nvlink_peers(&[&u(3)]).build(),
        a100(3).nvlink_peers(&[&u(2)]).build(),
    ]);
    let params = SliceParams {
        node_name: "node-pairs",
        driver_name: DRIVER,
        generation: 1,
    };
    let mut rendered = render_slices(&inv, &params);
    if lists {
        gpu_dra_core::list_forms::apply(&mut rendered, &inv, &params);
    }
    rendered
        .slices
        .iter()
        .map(|s| gpu_dra_core::list_forms::wire(s).expect("wire"))
        .collect()
}

fn nvlink_claim(name: &str, count: u32) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
        "spec": {"devices": {
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": count}}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/nvlinkDomain"}],
        }},
    })
}

#[test]
fn a_match_attribute_constraint_shows_each_values_free_devices_per_node() {
    let mine = nvlink_claim("pair", 2);
    // Another claim holds one GPU of each pair: no pair is whole.
    let mut other = nvlink_claim("other", 2);
    other["status"] = json!({"allocation": {"devices": {"results": [
        {"request": "gpus", "driver": DRIVER, "pool": "node-pairs", "device": "gpu-0"},
        {"request": "gpus", "driver": DRIVER, "pool": "node-pairs", "device": "gpu-2"}]}}});
    let e = explain(
        &mine,
        &classes(),
        &bridged_pairs(false),
        &[mine.clone(), other],
        DRIVER,
    );
    assert_eq!(e.constraints.len(), 1);
    let c = &e.constraints[0];
    assert_eq!(c.needed, Some(2));
    let node = &c.nodes[0];
    assert_eq!(node.values.len(), 2, "{node:?}");
    assert!(
        node.values
            .iter()
            .all(|g| g.devices.len() == 2 && g.free() == 1)
    );
    let text = e.to_text();
    assert!(
        text.contains("constraint matchAttribute gpu.nvidia.com/nvlinkDomain over [gpus], 2 devices with one value needed:"),
        "{text}"
    );
    assert!(
        text.contains("node node-pairs: does not fit: at most 1 free with one value, 2 needed"),
        "{text}"
    );
    assert!(text.contains("taken: gpu-0 by ns/other"), "{text}");
    // Nobody else holding anything: it fits.
    let e = explain(&mine, &classes(), &bridged_pairs(false), &[], DRIVER);
    assert!(
        e.to_text().contains("node node-pairs: fits"),
        "{}",
        e.to_text()
    );
    // Four GPUs on one NVLink domain: no node has them.
    let four = nvlink_claim("four", 4);
    let e = explain(&four, &classes(), &bridged_pairs(false), &[], DRIVER);
    assert!(
        e.to_text()
            .contains("does not fit: at most 2 free with one value, 4 needed"),
        "{}",
        e.to_text()
    );
}

#[test]
fn constraints_read_list_values_and_first_available_alternatives() {
    let mut c = nvlink_claim("fa", 2);
    c["spec"]["devices"] = json!({
        "requests": [{"name": "gpus", "firstAvailable": [
            {"name": "nvlink", "deviceClassName": "gpu.nvidia.com", "count": 2},
            {"name": "numa", "deviceClassName": "gpu.nvidia.com", "count": 2},
        ]}],
        "constraints": [
            {"requests": ["gpus/nvlink"], "matchAttribute": "gpu.nvidia.com/nvlinkDomain"},
            {"requests": ["gpus/numa"], "matchAttribute": "resource.kubernetes.io/numaNode"},
        ],
    });
    let e = explain(&c, &classes(), &bridged_pairs(true), &[], DRIVER);
    assert_eq!(e.constraints.len(), 2);
    let nvlink = &e.constraints[0];
    assert_eq!(nvlink.needed, Some(2));
    assert_eq!(nvlink.nodes[0].values.len(), 2, "{:?}", nvlink.nodes);
    // The NUMA node as a one-element list: all four GPUs (node 0) in one group.
    let numa = &e.constraints[1];
    assert_eq!(numa.nodes[0].values.len(), 1);
    assert_eq!(numa.nodes[0].values[0].value, "0");
    assert_eq!(numa.nodes[0].values[0].devices.len(), 4);
    // The T4-and-A100 fleet has no nvlinkDomain: every matching device is without it.
    let e = explain(&c, &classes(), &slices(), &[], DRIVER);
    assert_eq!(e.constraints[0].nodes[0].node, "node-a100");
    assert_eq!(e.constraints[0].nodes[0].without_attribute, ["gpu-0"]);
    assert!(e.constraints[0].nodes[0].values.is_empty());
}
