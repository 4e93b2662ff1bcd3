//! `gpu-kubelet-plugin discover` as users run it, on simulated nodes.

use std::process::Command;

use gpu_dra_sim::testing::SimHost;
use serde_json::Value;

fn discover(host: &SimHost, format: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .arg("discover")
        .arg("--driver-root")
        .arg(host.root())
        .arg("--sysfs-root")
        .arg(host.sysfs_root())
        .args(["--node-name", "node-a", "--output", format])
        .env_remove("NVML_LIB")
        .env_remove("NODE_NAME")
        .output()
        .expect("running the binary");
    assert!(
        out.status.success(),
        "discover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[test]
fn dgx_a100_shows_4_whole_gpus_and_16_mig_devices() {
    let host = SimHost::new("dgx-a100-40gb");
    let report: Value = serde_json::from_str(&discover(&host, "json")).expect("json");
    assert_eq!(report["nodeName"], "node-a");
    assert_eq!(
        report["inventory"]["gpus"].as_array().map(Vec::len),
        Some(8)
    );
    let slices = report["resourceSlices"].as_array().expect("slices");
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0]["metadata"]["name"], "node-a-gpu-nvidia-com-0");
    let devices = slices[0]["spec"]["devices"].as_array().expect("devices");
    let of_type = |t: &str| {
        devices
            .iter()
            .filter(|d| d["attributes"]["type"]["string"] == t)
            .count()
    };
    assert_eq!(of_type("gpu"), 4);
    assert_eq!(of_type("mig"), 16);
    for d in devices {
        let attrs = d["attributes"].as_object().expect("attributes");
        for key in [
            "type",
            "uuid",
            "productName",
            "brand",
            "architecture",
            "cudaComputeCapability",
            "driverVersion",
            "cudaDriverVersion",
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
            "resource.kubernetes.io/numaNode",
        ] {
            assert!(attrs.contains_key(key), "{} lacks {key}", d["name"]);
        }
    }
    assert_eq!(report["warnings"].as_array().map(Vec::len), Some(0));
}

#[test]
fn yaml_output_names_the_devices() {
    let host = SimHost::new("t4");
    let yaml = discover(&host, "yaml");
    assert!(yaml.contains("name: gpu-0"), "{yaml}");
    assert!(yaml.contains("productName: Tesla T4"), "{yaml}");
    assert!(yaml.contains("node-a-gpu-nvidia-com-0"), "{yaml}");
}

#[test]
fn a_root_without_nvml_fails_with_a_hint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .arg("discover")
        .arg("--driver-root")
        .arg(dir.path())
        .env_remove("NVML_LIB")
        .output()
        .expect("running the binary");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NVIDIA_DRIVER_ROOT"), "{err}");
}

#[test]
fn a_pod_uid_that_is_not_a_uuid_is_refused_before_anything_is_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin_dir = dir.path().join("plugin");
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .args(["run", "--node-name", "node-a", "--pod-uid", "../escape"])
        .arg("--plugin-dir")
        .arg(&plugin_dir)
        .arg("--registrar-dir")
        .arg(dir.path().join("registry"))
        .output()
        .expect("running the binary");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--pod-uid (POD_UID) \"../escape\" is not a UUID")
            && err.contains("metadata.uid"),
        "{err}"
    );
    assert!(
        !plugin_dir.exists(),
        "nothing created for a refused pod UID"
    );
}
