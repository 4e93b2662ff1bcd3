//! CDI (Container Device Interface) specs for prepared claims, built from plain inputs.
//!
//! One spec per claim: kind `k8s.gpu.nvidia.com/claim`, one CDI device per prepared device
//! named `<claimUID>-<deviceName>`, `cdiVersion` 1.1.0. Devices are selected by device nodes
//! only, so two MIG devices of one GPU in one claim each carry their own capability nodes and
//! are both visible. Node paths and driver files are resolved by the caller (the plugin reads
//! the host); this module only shapes the document.
//!
//! Invariant: every claim spec's common edits set `NVIDIA_VISIBLE_DEVICES=void`
//! ([`VISIBLE_DEVICES_VOID`]). On GPU Operator nodes containerd's default runtime is NVIDIA's
//! `nvidia-container-runtime`, which after the CDI devices are applied reads
//! `NVIDIA_VISIBLE_DEVICES` from the container's environment and adds the GPUs it names from
//! the node's own CDI spec (`nvidia.com/gpu=<name>`), in unprivileged containers too; every
//! CUDA base image sets it to `all`. Without the override a claim's container on a CUDA image
//! would get every GPU of the node, other tenants' included. CDI edits replace the image's and
//! the pod's value, and `void` makes the runtime add nothing (unset or empty would too, but
//! edits cannot unset). NVIDIA's driver and `nvidia-ctk cdi generate` write the same entry.
//! A container with no claim keeps what its image asks for: that is the node's runtime
//! setting (`accept-nvidia-visible-devices-envvar-when-unprivileged`), not a claim's.

use serde::{Deserialize, Serialize};

/// CDI spec version written.
pub const CDI_VERSION: &str = "1.1.0";
/// CDI vendor of claim specs.
pub const CDI_VENDOR: &str = "k8s.gpu.nvidia.com";
/// CDI class of claim specs.
pub const CDI_CLASS: &str = "claim";

/// Environment entry of every claim spec: NVIDIA's container runtime, where it is the node's
/// runtime, adds no GPU of its own to the claim's containers (see the module doc).
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

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

/// CDI device name of the device metadata file of request `request` of a claim
/// (`crate::device_metadata`): `<claimUID>_metadata_<request>`. A device name in a pool is a
/// DNS label, which has no `_`, so this never names a prepared device of [`cdi_device_name`].
pub fn metadata_cdi_device_name(claim_uid: &str, request: &str) -> String {
    format!("{claim_uid}_metadata_{request}")
}

/// Fully qualified CDI device ID of [`metadata_cdi_device_name`].
pub fn metadata_cdi_device_id(claim_uid: &str, request: &str) -> String {
    format!(
        "{}={}",
        cdi_kind(),
        metadata_cdi_device_name(claim_uid, request)
    )
}

/// The request whose metadata device `cdi_id` of claim `claim_uid` is
/// ([`metadata_cdi_device_id`]), if it is one.
pub fn metadata_request_of(claim_uid: &str, cdi_id: &str) -> Option<String> {
    cdi_id
        .strip_prefix(&metadata_cdi_device_id(claim_uid, ""))
        .filter(|r| !r.is_empty())
        .map(str::to_owned)
}

/// The CDI device that mounts a request's device metadata file read-only into the containers
/// that get it: the kubelet gives a container the CDI devices of the requests it uses, so
/// each request's file is a device of its own, named by [`metadata_cdi_device_name`].
pub fn metadata_device(
    claim_uid: &str,
    request: &str,
    host_path: String,
    container_path: String,
) -> Device {
    Device {
        name: metadata_cdi_device_name(claim_uid, request),
        container_edits: ContainerEdits {
            mounts: vec![Mount::read_only(host_path, container_path)],
            ..ContainerEdits::default()
        },
    }
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
    /// `KEY=value` environment of the hook.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
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
/// Device nodes given to every GPU container when the host has them (the toolkit does the
/// same): `nvidia-modeset` exists only where the display driver module is loaded.
pub const OPTIONAL_CONTROL_NODES: &[&str] = &["/dev/nvidia-modeset"];

/// Inputs for one device of a claim spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecDevice {
    /// Device name in the pool.
    pub device: String,
    /// Container paths of its device nodes ([`device_node_paths`]).
    pub node_paths: Vec<String>,
}

/// Builds the spec of one claim. `common` carries the driver files, control nodes and hooks
/// (resolved on the host); `dev_root` maps device node paths to host paths. The spec's common
/// edits also set [`VISIBLE_DEVICES_VOID`], in place of any `NVIDIA_VISIBLE_DEVICES` of
/// `common`.
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
        container_edits: claim_common_edits(common),
    }
}

/// The edits every device of a claim spec shares: the driver's files (`common`, as the host
/// scan found them) and `NVIDIA_VISIBLE_DEVICES=void`.
pub fn claim_common_edits(mut common: ContainerEdits) -> ContainerEdits {
    common
        .env
        .retain(|e| !e.starts_with("NVIDIA_VISIBLE_DEVICES="));
    common.env.push(VISIBLE_DEVICES_VOID.to_owned());
    common
}

/// The driver version whose files a spec mounts, told by the version in the name of its
/// `libcuda.so.<version>` or `libnvidia-ml.so.<version>` (`None`: it mounts neither). For
/// specs whose claim's record does not say (written by older versions).
pub fn driver_version_named(spec: &Spec) -> Option<String> {
    spec.container_edits.mounts.iter().find_map(|m| {
        let file = m.host_path.rsplit('/').next()?;
        ["libcuda.so.", "libnvidia-ml.so."]
            .iter()
            .find_map(|p| file.strip_prefix(p))
            .filter(|v| v.contains('.'))
            .map(str::to_owned)
    })
}

/// Arguments `nvidia-cdi-hook` is started with: the environment the toolkit gives it.
const HOOK_ENV: &str = "NVIDIA_CTK_DEBUG=false";

fn hook(hook_path: &str, args: Vec<String>) -> Hook {
    let mut all = vec!["nvidia-cdi-hook".to_owned()];
    all.extend(args);
    Hook {
        hook_name: "createContainer".to_owned(),
        path: hook_path.to_owned(),
        args: all,
        env: vec![HOOK_ENV.to_owned()],
    }
}

/// The hooks the NVIDIA container toolkit's `nvidia-cdi-hook` runs in a GPU container, in the
/// toolkit's order and with its arguments: `create-symlinks` (`symlinks` are
/// `(target, link)`, e.g. `libcuda.so.1` -> `/usr/lib64/libcuda.so`), `enable-cuda-compat`
/// (use the image's CUDA forward-compatibility libraries when newer than the host driver),
/// `update-ldcache` (add the mounted library folders to the container's loader cache) and
/// `disable-device-node-modification` (stop CUDA from creating device nodes the container
/// was not given).
pub fn toolkit_hooks(
    hook_path: &str,
    driver_version: &str,
    library_dirs: &[String],
    symlinks: &[(String, String)],
) -> Vec<Hook> {
    let mut hooks = Vec::new();
    if !symlinks.is_empty() {
        let mut args = vec!["create-symlinks".to_owned()];
        for (target, link) in symlinks {
            args.push("--link".to_owned());
            args.push(format!("{target}::{link}"));
        }
        hooks.push(hook(hook_path, args));
    }
    if !driver_version.is_empty() {
        hooks.push(hook(
            hook_path,
            vec![
                "enable-cuda-compat".to_owned(),
                format!("--host-driver-version={driver_version}"),
            ],
        ));
    }
    if !library_dirs.is_empty() {
        let mut args = vec!["update-ldcache".to_owned()];
        for dir in library_dirs {
            args.push("--folder".to_owned());
            args.push(dir.clone());
        }
        hooks.push(hook(hook_path, args));
    }
    hooks.push(hook(
        hook_path,
        vec!["disable-device-node-modification".to_owned()],
    ));
    hooks
}

/// `libcuda.so` for `libcuda.so.1` or `libcuda.so.580.95.05`: the name up to `.so` (`None`
/// when the name has no `.so`).
pub fn so_link_name(name: &str) -> Option<&str> {
    let at = name.find(".so")?;
    let rest = &name[at + 3..];
    (rest.is_empty() || rest.starts_with('.')).then_some(&name[..at + 3])
}

/// Links a container needs next to driver library `file` of folder `dir` (container path),
/// as the toolkit derives them: the soname link to the file and the `.so` link to the soname
/// (`file` itself when it is its own soname), each only where the host folder has it too.
/// `host_links` are the folder's symlinks as `(name, target)`. The soname is the link named
/// `<stem>.so.<N>` that points at `file`: on a driver install it is the link `ldconfig` made
/// from the library's ELF `SONAME`, which the toolkit reads instead.
pub fn library_links(
    dir: &str,
    file: &str,
    host_links: &[(String, String)],
) -> Vec<(String, String)> {
    let Some(so) = so_link_name(file) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let soname = host_links
        .iter()
        .filter(|(name, target)| {
            target == file
                && name != file
                && name
                    .strip_prefix(so)
                    .and_then(|v| v.strip_prefix('.'))
                    .is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|(name, _)| name.clone())
        .min();
    if let Some(soname) = &soname {
        out.push((file.to_owned(), format!("{dir}/{soname}")));
    }
    let so_target = soname.unwrap_or_else(|| file.to_owned());
    if so != so_target && host_links.iter().any(|(name, _)| name == so) {
        out.push((so_target, format!("{dir}/{so}")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_version_a_spec_names_comes_from_its_versioned_libraries() {
        let mount = |p: &str| Mount::read_only(p.to_owned(), p.to_owned());
        let mut common = ContainerEdits::default();
        common
            .mounts
            .push(mount("/usr/lib/x86_64-linux-gnu/libcuda.so.1"));
        let spec = claim_spec("u1", &[], "/", common.clone());
        assert_eq!(driver_version_named(&spec), None, "an unversioned name");
        common
            .mounts
            .push(mount("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05"));
        let spec = claim_spec("u1", &[], "/", common);
        assert_eq!(driver_version_named(&spec).as_deref(), Some("580.95.05"));
        assert_eq!(
            spec.container_edits.env.last().map(String::as_str),
            Some(VISIBLE_DEVICES_VOID)
        );
    }

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
    fn every_claim_spec_turns_nvidias_runtime_off() {
        let common = ContainerEdits {
            env: vec![
                "NVIDIA_VISIBLE_DEVICES=all".into(),
                "NVIDIA_CTK_DEBUG=false".into(),
            ],
            ..ContainerEdits::default()
        };
        for common in [ContainerEdits::default(), common] {
            let spec = claim_spec(
                "u1",
                &[SpecDevice {
                    device: "gpu-0".into(),
                    node_paths: device_node_paths(0, &[]),
                }],
                "/",
                common,
            );
            let visible: Vec<&str> = spec
                .container_edits
                .env
                .iter()
                .map(String::as_str)
                .filter(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES="))
                .collect();
            assert_eq!(visible, ["NVIDIA_VISIBLE_DEVICES=void"]);
            let json = serde_json::to_value(&spec).expect("serializes");
            assert!(
                json["containerEdits"]["env"]
                    .as_array()
                    .is_some_and(|env| env.contains(&"NVIDIA_VISIBLE_DEVICES=void".into())),
                "{json}"
            );
        }
    }

    #[test]
    fn hooks_follow_the_toolkit() {
        let hooks = toolkit_hooks("/h", "", &[], &[]);
        assert_eq!(hooks.len(), 1);
        assert_eq!(
            hooks[0].args,
            ["nvidia-cdi-hook", "disable-device-node-modification"]
        );
        let hooks = toolkit_hooks(
            "/h",
            "580.95.05",
            &["/usr/lib64".into()],
            &[("libcuda.so.1".into(), "/usr/lib64/libcuda.so".into())],
        );
        let names: Vec<&str> = hooks.iter().map(|h| h.args[1].as_str()).collect();
        assert_eq!(
            names,
            [
                "create-symlinks",
                "enable-cuda-compat",
                "update-ldcache",
                "disable-device-node-modification"
            ]
        );
        assert_eq!(hooks[1].args[2], "--host-driver-version=580.95.05");
        assert_eq!(
            hooks[2].args,
            [
                "nvidia-cdi-hook",
                "update-ldcache",
                "--folder",
                "/usr/lib64"
            ]
        );
        assert!(hooks.iter().all(|h| h.env == ["NVIDIA_CTK_DEBUG=false"]));
        assert!(hooks.iter().all(|h| h.hook_name == "createContainer"));
    }

    fn links(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn library_links_are_the_soname_and_so_links_the_host_has() {
        let host = links(&[
            ("libcuda.so.1", "libcuda.so.580.95.05"),
            ("libcuda.so", "libcuda.so.1"),
            ("libnvidia-eglcore.so", "libnvidia-eglcore.so.580.95.05"),
            ("libGLX_nvidia.so.0", "libGLX_nvidia.so.580.95.05"),
            ("libGLX_indirect.so.0", "libGLX_nvidia.so.580.95.05"),
        ]);
        assert_eq!(
            library_links("/d", "libcuda.so.580.95.05", &host),
            links(&[
                ("libcuda.so.580.95.05", "/d/libcuda.so.1"),
                ("libcuda.so.1", "/d/libcuda.so"),
            ])
        );
        // Its own soname: only the .so link.
        assert_eq!(
            library_links("/d", "libnvidia-eglcore.so.580.95.05", &host),
            links(&[("libnvidia-eglcore.so.580.95.05", "/d/libnvidia-eglcore.so")])
        );
        // No .so link on the host: none in the container; other stems are not sonames.
        assert_eq!(
            library_links("/d", "libGLX_nvidia.so.580.95.05", &host),
            links(&[("libGLX_nvidia.so.580.95.05", "/d/libGLX_nvidia.so.0")])
        );
        assert!(library_links("/d", "nvidia_icd.json", &host).is_empty());
        assert_eq!(so_link_name("libcuda.so.1"), Some("libcuda.so"));
        assert_eq!(so_link_name("libfoo.sox"), None);
    }

    #[test]
    fn metadata_devices_are_told_apart_from_prepared_devices_by_name() {
        let id = metadata_cdi_device_id("uid-1", "gpus");
        assert_eq!(id, "k8s.gpu.nvidia.com/claim=uid-1_metadata_gpus");
        assert_eq!(metadata_request_of("uid-1", &id).as_deref(), Some("gpus"));
        assert_eq!(metadata_request_of("uid-2", &id), None, "another claim's");
        assert_eq!(
            metadata_request_of("uid-1", &cdi_device_id("uid-1", "gpu-0")),
            None
        );
        assert_eq!(
            metadata_request_of("uid-1", &metadata_cdi_device_id("uid-1", "")),
            None
        );
        let device = metadata_device("uid-1", "gpus", "/host/f.json".into(), "/c/f.json".into());
        assert_eq!(device.name, "uid-1_metadata_gpus");
        assert_eq!(device.container_edits.mounts[0].options[0], "ro");
    }
}
