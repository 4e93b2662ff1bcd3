//! The lifecycle of device metadata files through the driver: written at prepare and mounted
//! from the claim's spec, left alone by a repeated prepare, restored when missing, removed by
//! unprepare and by every rollback, stray files removed by the cleanup.

use std::path::PathBuf;
use std::sync::Arc;

use gpu_dra_core::cdi::{metadata_cdi_device_id, metadata_cdi_device_name};
use gpu_dra_core::device_metadata::{self, AttributeValue, POD_CLAIM_NAME_ANNOTATION};
use gpu_dra_device::testing::a100_inventory;
use k8s_openapi::api::resource::v1::DeviceAttribute;

use super::ClaimRef;
use super::fixtures::*;
use crate::failpoint::Failpoints;
use crate::node_layout::device_metadata_file;
use crate::testing::{DriverBuilder, MemoryClaims, allocated_claim};

/// [`super::fixtures::driver_in`] with `--device-metadata` and `failpoints`.
fn metadata_driver(env: &Env, failpoints: &str) -> super::Driver {
    DriverBuilder::new(env.dir.path(), a100_inventory(4, 1))
        .node_name(NODE)
        .claims(env.claims.clone())
        .checkpoint_path(env.dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
        .failpoints(Failpoints::parse(failpoints, None).expect("failpoints"))
        .device_metadata(false)
        .build()
        .expect("driver")
}

fn file(env: &Env, uid: &str, request: &str) -> PathBuf {
    device_metadata_file(
        &crate::node_layout::device_metadata_dir_in(&env.dir.path().join("plugin")),
        uid,
        request,
    )
}

fn files_left(env: &Env) -> Vec<String> {
    let dir = crate::node_layout::device_metadata_dir_in(&env.dir.path().join("plugin"));
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn string(v: &AttributeValue) -> Option<&str> {
    match v {
        AttributeValue::Scalar(DeviceAttribute {
            string: Some(s), ..
        }) => Some(s),
        _ => None,
    }
}

const MIXED: &[(&str, &str)] = &[
    ("gpu", "gpu-1"),
    ("mig", "gpu-0-mig-1g5gb-19-0"),
    ("mig", "gpu-0-mig-1g5gb-19-1"),
];

#[tokio::test]
async fn prepare_writes_a_file_per_request_that_the_requests_cdi_device_mounts() {
    let env = env();
    let driver = metadata_driver(&env, "");
    let c = add(&env, "a", "uid-a", MIXED);
    let devices = driver.prepare(&c).await.expect("prepares");

    // Each request's metadata device rides with the first of its devices.
    let ids: Vec<Vec<String>> = devices.iter().map(|d| d.cdi_device_ids.clone()).collect();
    assert_eq!(
        ids,
        [
            vec![
                "k8s.gpu.nvidia.com/claim=uid-a-gpu-1".to_owned(),
                metadata_cdi_device_id("uid-a", "gpu"),
            ],
            vec![
                "k8s.gpu.nvidia.com/claim=uid-a-gpu-0-mig-1g5gb-19-0".to_owned(),
                metadata_cdi_device_id("uid-a", "mig"),
            ],
            vec!["k8s.gpu.nvidia.com/claim=uid-a-gpu-0-mig-1g5gb-19-1".to_owned()],
        ]
    );

    // The spec defines them, valid for the CDI crate, each mounting its request's file.
    let path = spec_path(&env, "uid-a");
    let mut spec = container_device_interface::spec::read_spec(&path, 0).expect("CDI reads it");
    assert_eq!(spec.validate().expect("CDI validates it").len(), 5);
    let raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("spec")).expect("json");
    for request in ["gpu", "mig"] {
        let name = metadata_cdi_device_name("uid-a", request);
        let device = raw["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["name"] == name.as_str())
            .unwrap_or_else(|| panic!("no device {name}"));
        let mounts = device["containerEdits"]["mounts"]
            .as_array()
            .expect("mounts");
        assert_eq!(mounts.len(), 1);
        assert_eq!(
            mounts[0]["hostPath"],
            file(&env, "uid-a", request).to_string_lossy().as_ref()
        );
        assert_eq!(
            mounts[0]["containerPath"],
            format!(
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/a/{request}/gpu.nvidia.com-metadata.json"
            )
        );
        assert_eq!(mounts[0]["options"][0], "ro");
        assert!(device["containerEdits"]["deviceNodes"].is_null());
    }

    // The files name the claim's devices with their UUIDs and attributes.
    let inventory = a100_inventory(4, 1);
    let mig = device_metadata::decode(&std::fs::read(file(&env, "uid-a", "mig")).expect("file"))
        .expect("decodes");
    assert_eq!(mig.len(), device_metadata::VERSIONS.len());
    let doc = &mig[0];
    assert_eq!(doc.api_version, "metadata.resource.k8s.io/v1beta1");
    assert_eq!(
        (
            doc.metadata.name.as_str(),
            doc.metadata.namespace.as_str(),
            doc.metadata.uid.as_str()
        ),
        ("a", "ns", "uid-a")
    );
    assert_eq!(doc.requests.len(), 1);
    assert_eq!(doc.requests[0].name, "mig");
    let found: Vec<(&str, Option<&str>, Option<&str>)> = doc.requests[0]
        .devices
        .iter()
        .map(|d| {
            (
                d.name.as_str(),
                d.attributes.get("uuid").and_then(string),
                d.attributes.get("profile").and_then(string),
            )
        })
        .collect();
    let uuid = |n: &str| inventory.device(n).expect("device").uuid().to_owned();
    assert_eq!(
        found,
        [
            (
                "gpu-0-mig-1g5gb-19-0",
                Some(uuid("gpu-0-mig-1g5gb-19-0").as_str()),
                Some("1g.5gb")
            ),
            (
                "gpu-0-mig-1g5gb-19-1",
                Some(uuid("gpu-0-mig-1g5gb-19-1").as_str()),
                Some("1g.5gb")
            ),
        ]
    );
    let gpu = device_metadata::decode(&std::fs::read(file(&env, "uid-a", "gpu")).expect("file"))
        .expect("decodes");
    let d = &gpu[0].requests[0].devices[0];
    assert_eq!((d.driver.as_str(), d.pool.as_str()), (DRIVER, NODE));
    assert_eq!(
        d.attributes.get("uuid").and_then(string),
        Some(uuid("gpu-1").as_str())
    );
    assert_eq!(files_left(&env), ["uid-a_gpu.json", "uid-a_mig.json"]);
}

#[tokio::test]
async fn a_repeated_prepare_keeps_the_files_and_one_that_went_missing_is_written_again() {
    let env = env();
    let driver = metadata_driver(&env, "");
    let c = add(&env, "a", "uid-a", MIXED);
    let first = driver.prepare(&c).await.expect("prepares");
    let content = std::fs::read(file(&env, "uid-a", "gpu")).expect("file");
    std::fs::write(file(&env, "uid-a", "gpu"), b"marker").expect("mark");

    // After a restart, answered from the checkpoint: nothing is written.
    let restarted = metadata_driver(&env, "");
    assert_eq!(restarted.prepare(&c).await.expect("repeat"), first);
    assert_eq!(
        std::fs::read(file(&env, "uid-a", "gpu")).expect("file"),
        b"marker"
    );

    // A file gone (someone cleaned the folder): the claim is prepared again, same answer.
    std::fs::remove_file(file(&env, "uid-a", "mig")).expect("remove");
    assert_eq!(restarted.prepare(&c).await.expect("again"), first);
    assert_eq!(
        std::fs::read(file(&env, "uid-a", "gpu")).expect("file"),
        content
    );
    assert!(file(&env, "uid-a", "mig").exists());
}

#[tokio::test]
async fn unprepare_removes_the_files_even_once_the_plugin_writes_none() {
    let env = env();
    let driver = metadata_driver(&env, "");
    let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
    let b = add(&env, "b", "uid-b", &[("gpu", "gpu-2")]);
    driver.prepare(&a).await.expect("a");
    driver.prepare(&b).await.expect("b");
    driver.unprepare(&a).await.expect("unprepare a");
    assert!(!spec_path(&env, "uid-a").exists());
    assert_eq!(files_left(&env), ["uid-b_gpu.json"]);
    driver.unprepare(&a).await.expect("again");

    // Restarted without --device-metadata: b's files still go with b.
    let plain = driver_in(env.dir.path(), env.claims.clone());
    plain.unprepare(&b).await.expect("unprepare b");
    assert!(files_left(&env).is_empty(), "{:?}", files_left(&env));
}

#[tokio::test]
async fn files_no_entry_names_are_removed_by_the_cleanup() {
    let env = env();
    let driver = metadata_driver(&env, "");
    let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
    driver.prepare(&a).await.expect("a");
    // What a crash between writing the files and the first checkpoint write leaves.
    std::fs::write(file(&env, "uid-gone", "gpu"), b"{}").expect("stray");
    let restarted = metadata_driver(&env, "");
    restarted.reconcile().await;
    assert_eq!(files_left(&env), ["uid-a_gpu.json"]);
}

#[tokio::test]
async fn a_failure_after_the_files_are_written_rolls_them_back() {
    let env = env();
    for step in ["prepare.after_metadata", "prepare.after_cdi_write"] {
        let driver = metadata_driver(&env, &format!("{step}=error"));
        let a = add(&env, "a", "uid-a", MIXED);
        let err = driver.prepare(&a).await.expect_err(step).to_string();
        assert!(err.contains(step), "{err}");
        assert!(
            files_left(&env).is_empty(),
            "{step}: {:?}",
            files_left(&env)
        );
        assert!(!spec_path(&env, "uid-a").exists(), "{step}");
        assert!(driver.checkpoint().claims.is_empty(), "{step}");
    }
}

#[tokio::test]
async fn a_claim_from_a_template_is_mounted_under_the_pods_name_for_it() {
    let env = env();
    let driver = metadata_driver(&env, "");
    let with_annotation = |name: &str, uid: &str, value: &str| {
        let mut rc = allocated_claim("ns", name, uid, DRIVER, NODE, &[("gpus", "gpu-1")], &[]);
        rc.metadata.annotations = Some(
            [(POD_CLAIM_NAME_ANNOTATION.to_owned(), value.to_owned())]
                .into_iter()
                .collect(),
        );
        env.claims.insert(rc);
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    };
    let c = with_annotation("pod-1-gpu-x7k2p", "uid-t", "gpu");
    driver.prepare(&c).await.expect("prepares");
    let spec = std::fs::read_to_string(spec_path(&env, "uid-t")).expect("spec");
    assert!(
        spec.contains(
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpus/gpu.nvidia.com-metadata.json"
        ),
        "{spec}"
    );
    let doc = device_metadata::decode(&std::fs::read(file(&env, "uid-t", "gpus")).expect("file"))
        .expect("decodes");
    assert_eq!(doc[0].pod_claim_name.as_deref(), Some("gpu"));
    assert_eq!(doc[0].metadata.name, "pod-1-gpu-x7k2p");
    driver.unprepare(&c).await.expect("unprepare");

    // An annotation that cannot name a folder refuses the claim, saying which field.
    let bad = with_annotation("b", "uid-bad", "../x");
    let err = driver.prepare(&bad).await.expect_err("refused").to_string();
    assert!(
        err.starts_with("metadata.annotations[resource.kubernetes.io/pod-claim-name]"),
        "{err}"
    );
    assert!(files_left(&env).is_empty());
    assert!(!spec_path(&env, "uid-bad").exists());
    assert!(driver.checkpoint().claims.is_empty());
}

#[tokio::test]
async fn without_the_flag_specs_and_answers_are_as_before() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::testing::simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
    let claims = Arc::new(MemoryClaims::default());
    let env = Env {
        driver: Arc::new(driver_in(dir.path(), claims.clone())),
        dir,
        claims,
    };
    let c = add(&env, "a", "uid-a", MIXED);
    let devices = env.driver.prepare(&c).await.expect("prepares");
    assert!(devices.iter().all(|d| d.cdi_device_ids.len() == 1));
    assert!(files_left(&env).is_empty());
    let spec = std::fs::read_to_string(spec_path(&env, "uid-a")).expect("spec");
    assert!(!spec.contains("_metadata_"), "{spec}");
}
