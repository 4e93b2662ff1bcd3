//! CDI (Container Device Interface) specs for prepared claims, built from plain inputs.
//!
//! One spec per claim: kind `k8s.gpu.nvidia.com/claim`, one CDI device per prepared device
//! named `<claimUID>-<deviceName>`, `cdiVersion` 1.1.0. Devices are selected by device nodes
//! only (no `NVIDIA_VISIBLE_DEVICES`), so two MIG devices of one GPU in one claim each carry
//! their own capability nodes and are both visible. Node paths and driver files are resolved
//! by the caller (the plugin reads the host); this module only shapes the document.

use serde::{Deserialize, Serialize};

/// CDI spec version written.
pub const CDI_VERSION: &str = "1.1.0";
/// CDI vendor of claim specs.
pub const CDI_VENDOR: &str = "k8s.gpu.nvidia.com";
/// CDI class of claim specs.
pub const CDI_CLASS: &str = "claim";

/// The CDI kind of claim specs: `k8s.gpu.nvidia.com/claim`.
pub fn cdi_kind() -> String {
    format!("{CDI_VENDOR}/{CDI_CLASS}")
}

/// CDI device name of a prepared device: `<claimUID>-<deviceName>`.
pub fn cdi_device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// Fully qualified CDI device ID: `k8s.gpu.nvidia.com/claim=<claimUID>-<deviceName>`.
pub fn cdi_device_id(claim_uid: &str, device: &str) -> String {
    format!("{}={}", cdi_kind(), cdi_device_name(claim_uid, device))
}

/// Spec file name of a claim: `k8s.gpu.nvidia.com-claim_<claimUID>.json`.
pub fn spec_file_name(claim_uid: &str) -> String {
    format!("{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json")
}

/// Spec file name NVIDIA's driver gives a claim: `k8s.gpu.nvidia.com-claim_<claimUID>.yaml`
/// (CDI's transient spec name, written as YAML). It defines the same CDI device names as
/// ours, so the two must never exist for one claim at the same time.
pub fn nvidia_spec_file_name(claim_uid: &str) -> String {
    format!("{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.yaml")
}

/// Claim UID of a spec file name written by [`spec_file_name`], if it is one.
pub fn claim_uid_of_spec_file(file_name: &str) -> Option<&str> {
    file_name
        .strip_prefix(&format!("{CDI_VENDOR}-{CDI_CLASS}_"))?
        .strip_suffix(".json")
        .filter(|uid| !uid.is_empty())
}

/// A CDI spec document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// `1.1.0`.
    pub cdi_version: String,
    /// `k8s.gpu.nvidia.com/claim`.
    pub kind: String,
    /// Devices of the claim.
    pub devices: Vec<Device>,
    /// Edits applied once when any device of the spec is injected.
    pub container_edits: ContainerEdits,
}

/// One CDI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// `<claimUID>-<deviceName>`.
    pub name: String,
    /// Device-specific edits.
    pub container_edits: ContainerEdits,
}

/// Container edits (the subset of CDI we use).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=value` environment entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// OCI hooks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host (driver/dev root applied).
    pub host_path: String,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount options.
    pub options: Vec<String>,
}

impl Mount {
    /// A read-only bind mount (`ro`, `nosuid`, `nodev`, `rbind`, `rprivate`).
    pub fn read_only(host_path: String, container_path: String) -> Self {
        Mount {
            host_path,
            container_path,
            options: ["ro", "nosuid", "nodev", "rbind", "rprivate"]
                .map(String::from)
                .to_vec(),
        }
    }
}

/// An OCI hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// `createContainer`, ...
    pub hook_name: String,
    /// Hook binary on the host.
    pub path: String,
    /// Arguments, `args[0]` being the program name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
}

/// Host paths a container path maps to: `root` + `path` (`root` of `/` leaves it unchanged).
pub fn host_path(root: &str, path: &str) -> String {
    let root = root.trim_end_matches('/');
    format!("{root}{path}")
}

/// Container paths of the device nodes of one device, in injection order.
///
/// `caps` are the `nvidia-cap<N>` minors of a MIG device (GPU instance then compute
/// instance), empty for a whole GPU.
pub fn device_node_paths(gpu_minor: u32, caps: &[u32]) -> Vec<String> {
    let mut paths = vec![format!("/dev/nvidia{gpu_minor}")];
    paths.extend(
        caps.iter()
            .map(|n| format!("/dev/nvidia-caps/nvidia-cap{n}")),
    );
    paths
}

/// Device nodes every GPU container needs, whichever device.
pub const CONTROL_NODES: &[&str] = &["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// Inputs for one device of a claim spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecDevice {
    /// Device name in the pool.
    pub device: String,
    /// Container paths of its device nodes ([`device_node_paths`]).
    pub node_paths: Vec<String>,
}

/// Builds the spec of one claim. `common` carries the driver files, control nodes and hooks
/// (resolved on the host); `dev_root` maps device node paths to host paths.
pub fn claim_spec(
    claim_uid: &str,
    devices: &[SpecDevice],
    dev_root: &str,
    common: ContainerEdits,
) -> Spec {
    Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: cdi_kind(),
        devices: devices
            .iter()
            .map(|d| Device {
                name: cdi_device_name(claim_uid, &d.device),
                container_edits: ContainerEdits {
                    device_nodes: d
                        .node_paths
                        .iter()
                        .map(|p| DeviceNode {
                            path: p.clone(),
                            host_path: host_path(dev_root, p),
                        })
                        .collect(),
                    ..ContainerEdits::default()
                },
            })
            .collect(),
        container_edits: common,
    }
}

/// Hooks the NVIDIA container toolkit's `nvidia-cdi-hook` provides: refresh the container's
/// ldcache for the mounted library folders, and create the `libcuda.so` style symlinks.
pub fn toolkit_hooks(
    hook_path: &str,
    library_dirs: &[String],
    symlinks: &[(String, String)],
) -> Vec<Hook> {
    let mut hooks = Vec::new();
    if !symlinks.is_empty() {
        let mut args = vec!["nvidia-cdi-hook".to_owned(), "create-symlinks".to_owned()];
        for (target, link) in symlinks {
            args.push("--link".to_owned());
            args.push(format!("{target}::{link}"));
        }
        hooks.push(Hook {
            hook_name: "createContainer".to_owned(),
            path: hook_path.to_owned(),
            args,
        });
    }
    if !library_dirs.is_empty() {
        let mut args = vec!["nvidia-cdi-hook".to_owned(), "update-ldcache".to_owned()];
        for dir in library_dirs {
            args.push("--folder".to_owned());
            args.push(dir.clone());
        }
        hooks.push(Hook {
            hook_name: "createContainer".to_owned(),
            path: hook_path.to_owned(),
            args,
        });
    }
    hooks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_follow_the_nvidia_driver() {
        assert_eq!(
            cdi_device_id("u1", "gpu-0"),
            "k8s.gpu.nvidia.com/claim=u1-gpu-0"
        );
        assert_eq!(spec_file_name("u1"), "k8s.gpu.nvidia.com-claim_u1.json");
        assert_eq!(
            claim_uid_of_spec_file("k8s.gpu.nvidia.com-claim_u1.json"),
            Some("u1")
        );
        assert_eq!(
            claim_uid_of_spec_file("k8s.gpu.nvidia.com-claim_.json"),
            None
        );
        assert_eq!(claim_uid_of_spec_file("other.json"), None);
    }

    #[test]
    fn two_mig_devices_of_one_gpu_each_carry_parent_and_caps() {
        let spec = claim_spec(
            "u1",
            &[
                SpecDevice {
                    device: "gpu-1-mig-1g5gb-19-0".into(),
                    node_paths: device_node_paths(1, &[30, 31]),
                },
                SpecDevice {
                    device: "gpu-1-mig-1g5gb-19-1".into(),
                    node_paths: device_node_paths(1, &[39, 40]),
                },
            ],
            "/host/",
            ContainerEdits::default(),
        );
        assert_eq!(spec.devices.len(), 2);
        let nodes: Vec<&str> = spec.devices[1]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.host_path.as_str())
            .collect();
        assert_eq!(
            nodes,
            [
                "/host/dev/nvidia1",
                "/host/dev/nvidia-caps/nvidia-cap39",
                "/host/dev/nvidia-caps/nvidia-cap40"
            ]
        );
        let json = serde_json::to_value(&spec).expect("serializes");
        assert_eq!(json["cdiVersion"], "1.1.0");
        assert_eq!(json["kind"], "k8s.gpu.nvidia.com/claim");
        assert_eq!(
            json["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"],
            "/host/dev/nvidia1"
        );
    }

    #[test]
    fn hooks_only_list_what_is_given() {
        assert!(toolkit_hooks("/h", &[], &[]).is_empty());
        let hooks = toolkit_hooks(
            "/h",
            &["/usr/lib64".into()],
            &[("libcuda.so.1".into(), "/usr/lib64/libcuda.so".into())],
        );
        assert_eq!(hooks.len(), 2);
        assert_eq!(hooks[0].args[1], "create-symlinks");
        assert_eq!(
            hooks[1].args,
            [
                "nvidia-cdi-hook",
                "update-ldcache",
                "--folder",
                "/usr/lib64"
            ]
        );
    }
}
