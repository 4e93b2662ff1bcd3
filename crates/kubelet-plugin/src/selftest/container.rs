//! One container of the self-test, started from a claim's CDI spec the way a CDI-aware runtime
//! does (containerd's CRI plugin applies the official CDI library's edits, then runs `runc`):
//! the spec's common edits and those of the devices named, then an OCI runtime bundle for
//! `runc`.
//!
//! What the edits become, as the CDI library makes them: `env` entries are appended; each device
//! node's host path is `stat`ed for its type and numbers (a path that is not a device node is
//! refused, as the library refuses it: "not a device node") and allowed in the device cgroup;
//! mounts become bind mounts with their options; hooks are added under their OCI name. Only
//! `extra_mounts` are ours (read-only binds the caller names, see `selftest --container-mount`).
//!
//! The root file system is copied for each container: the spec's `createContainer` hooks
//! write into it (`create-symlinks`, `update-ldcache`), as they write into a container's
//! writable layer on a node. `rlimits` are left out of the OCI spec: the runtime keeps the
//! caller's.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use gpu_dra_core::cdi::{ContainerEdits, Spec};
use serde_json::{Value, json};

/// Errors building or running a container.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// A CDI device the claim was answered with is not in its spec.
    #[error("CDI device {0} is not in the claim's spec")]
    UnknownDevice(String),
    /// A device node's host path is missing or not a device node.
    #[error("device node {path} (host {host_path}): {reason}")]
    DeviceNode {
        /// Path in the container.
        path: String,
        /// Path on the host.
        host_path: String,
        /// What is wrong.
        reason: String,
    },
    /// A file of the bundle could not be written or copied.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The runtime could not be started.
    #[error("cannot run {runtime}: {source}")]
    Spawn {
        /// The runtime binary.
        runtime: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// How the self-test runs containers.
#[derive(Debug, Clone)]
pub struct Runtime {
    /// The `runc` binary.
    pub runc: PathBuf,
    /// `runc --root`: its state folder, apart from any other runtime's on the host.
    pub state_root: PathBuf,
    /// The root file system every container starts from (copied for each).
    pub rootfs: PathBuf,
    /// Read-only bind mounts added to every container (`(host, container)`).
    pub extra_mounts: Vec<(PathBuf, String)>,
    /// How long one container may run before it is killed.
    pub timeout: Duration,
}

/// How a container ended and what it printed.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Exit code (`None`: killed, or timed out).
    pub code: Option<i32>,
    /// Standard output (the container's).
    pub stdout: String,
    /// Standard error (the container's and the runtime's).
    pub stderr: String,
    /// The container ran past [`Runtime::timeout`].
    pub timed_out: bool,
}

impl Finished {
    /// The last lines of stderr, for a report line.
    pub fn stderr_tail(&self) -> String {
        let lines: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        lines[lines.len().saturating_sub(3)..].join(" | ")
    }
}

/// The edits for `devices` (fully qualified CDI IDs or bare device names) of `spec`: the
/// spec's common edits, then each device's, in the order given.
pub fn edits_for(spec: &Spec, devices: &[String]) -> Result<ContainerEdits, ContainerError> {
    let mut out = spec.container_edits.clone();
    for id in devices {
        let name = id.rsplit_once('=').map_or(id.as_str(), |(_, n)| n);
        let device = spec
            .devices
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| ContainerError::UnknownDevice(id.clone()))?;
        let e = &device.container_edits;
        out.env.extend(e.env.iter().cloned());
        out.device_nodes.extend(e.device_nodes.iter().cloned());
        out.mounts.extend(e.mounts.iter().cloned());
        out.hooks.extend(e.hooks.iter().cloned());
    }
    Ok(out)
}

/// Linux's `major()` and `minor()` of a device number.
fn dev_numbers(rdev: u64) -> (u64, u64) {
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & 0xffff_f000);
    let minor = (rdev & 0xff) | ((rdev >> 12) & 0xffff_ff00);
    (major, minor)
}

/// The OCI `config.json` of a container running `args` with `edits` applied.
pub fn oci_config(
    edits: &ContainerEdits,
    args: &[String],
    extra_mounts: &[(PathBuf, String)],
) -> Result<Value, ContainerError> {
    let mut devices = Vec::new();
    let mut allowed = vec![json!({"allow": false, "access": "rwm"})];
    for node in &edits.device_nodes {
        let refuse = |reason: String| ContainerError::DeviceNode {
            path: node.path.clone(),
            host_path: node.host_path.clone(),
            reason,
        };
        let meta = std::fs::metadata(&node.host_path).map_err(|e| refuse(e.to_string()))?;
        let kind = if meta.file_type().is_char_device() {
            "c"
        } else if meta.file_type().is_block_device() {
            "b"
        } else {
            return Err(refuse("not a device node".into()));
        };
        let (major, minor) = dev_numbers(meta.rdev());
        devices.push(json!({
            "path": node.path, "type": kind, "major": major, "minor": minor,
            "fileMode": meta.permissions().mode() & 0o777, "uid": 0, "gid": 0,
        }));
        allowed.push(
            json!({"allow": true, "type": kind, "major": major, "minor": minor, "access": "rwm"}),
        );
    }
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777"]}),
    ];
    for m in &edits.mounts {
        mounts.push(json!({
            "destination": m.container_path, "source": m.host_path, "type": "bind",
            "options": m.options,
        }));
    }
    for (host, container) in extra_mounts {
        mounts.push(json!({
            "destination": container, "source": host, "type": "bind",
            "options": ["rbind", "ro", "nosuid", "nodev"],
        }));
    }
    let mut hooks = serde_json::Map::new();
    for h in &edits.hooks {
        let entry = hooks
            .entry(h.hook_name.clone())
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(list) = entry {
            let mut hook = json!({"path": h.path, "args": h.args});
            if !h.env.is_empty() {
                hook["env"] = json!(h.env);
            }
            list.push(hook);
        }
    }
    let mut env =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    env.extend(edits.env.iter().cloned());
    let caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_KILL",
    ];
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": true,
        },
        "root": {"path": "rootfs", "readonly": false},
        "hostname": "gpu-dra-selftest",
        "mounts": mounts,
        "hooks": hooks,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}],
            "devices": devices,
            "resources": {"devices": allowed},
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }))
}

/// Copies the tree `from` to `to` (files, folders, symbolic links; modes kept).
fn copy_tree(from: &Path, to: &Path) -> Result<(), ContainerError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ContainerError::Io { path, source }
    };
    let meta = std::fs::symlink_metadata(from).map_err(io(from))?;
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(from).map_err(io(from))?;
        std::os::unix::fs::symlink(target, to).map_err(io(to))?;
    } else if meta.is_dir() {
        std::fs::create_dir_all(to).map_err(io(to))?;
        for entry in std::fs::read_dir(from).map_err(io(from))? {
            let entry = entry.map_err(io(from))?;
            copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        std::fs::set_permissions(to, meta.permissions()).map_err(io(to))?;
    } else if meta.is_file() {
        std::fs::copy(from, to).map_err(io(from))?;
    }
    Ok(())
}

impl Runtime {
    /// Runs `args` in a container named `id` (unique per run) with `edits` applied, in the
    /// bundle folder `bundle` (created; removed after), and waits for it to end.
    pub async fn run(
        &self,
        id: &str,
        bundle: &Path,
        edits: &ContainerEdits,
        args: &[String],
    ) -> Result<Finished, ContainerError> {
        let config = oci_config(edits, args, &self.extra_mounts)?;
        let _ = std::fs::remove_dir_all(bundle);
        copy_tree(&self.rootfs, &bundle.join("rootfs"))?;
        let text = serde_json::to_vec_pretty(&config).unwrap_or_default();
        let path = bundle.join("config.json");
        std::fs::write(&path, text).map_err(|source| ContainerError::Io { path, source })?;
        let result = self.run_bundle(id, bundle).await;
        let _ = std::fs::remove_dir_all(bundle);
        result
    }

    fn runc(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.runc);
        cmd.arg("--root").arg(&self.state_root);
        cmd
    }

    async fn run_bundle(&self, id: &str, bundle: &Path) -> Result<Finished, ContainerError> {
        let mut cmd = self.runc();
        cmd.args(["run", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|source| ContainerError::Spawn {
            runtime: self.runc.clone(),
            source,
        })?;
        let finished = match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(Ok(out)) => Finished {
                code: out.status.code(),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                timed_out: false,
            },
            Ok(Err(source)) => {
                return Err(ContainerError::Spawn {
                    runtime: self.runc.clone(),
                    source,
                });
            }
            Err(_) => {
                let _ = self.runc().args(["kill", id, "KILL"]).output().await;
                Finished {
                    code: None,
                    stdout: String::new(),
                    stderr: format!("killed after {} s", self.timeout.as_secs()),
                    timed_out: true,
                }
            }
        };
        let _ = self.runc().args(["delete", "--force", id]).output().await;
        Ok(finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_core::cdi::{Device, DeviceNode, Hook, Mount};

    fn spec() -> Spec {
        Spec {
            cdi_version: "1.1.0".into(),
            kind: "k8s.gpu.nvidia.com/claim".into(),
            devices: vec![Device {
                name: "uid-gpu-0".into(),
                container_edits: ContainerEdits {
                    env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
                    device_nodes: vec![DeviceNode {
                        path: "/dev/null-as-gpu".into(),
                        host_path: "/dev/null".into(),
                    }],
                    ..ContainerEdits::default()
                },
            }],
            container_edits: ContainerEdits {
                env: vec!["A=1".into()],
                mounts: vec![Mount::read_only(
                    "/usr/bin/true".into(),
                    "/usr/bin/nvidia-smi".into(),
                )],
                hooks: vec![Hook {
                    hook_name: "createContainer".into(),
                    path: "/hook".into(),
                    args: vec!["nvidia-cdi-hook".into(), "update-ldcache".into()],
                    env: vec![],
                }],
                ..ContainerEdits::default()
            },
        }
    }

    #[test]
    fn edits_are_the_common_ones_then_each_device_s() {
        let e = edits_for(&spec(), &["k8s.gpu.nvidia.com/claim=uid-gpu-0".into()]).expect("known");
        assert_eq!(e.env, ["A=1", "NVIDIA_VISIBLE_DEVICES=void"]);
        assert_eq!(e.device_nodes.len(), 1);
        let err = edits_for(&spec(), &["k8s.gpu.nvidia.com/claim=uid-gpu-1".into()])
            .expect_err("unknown");
        assert!(err.to_string().contains("uid-gpu-1"), "{err}");
    }

    #[test]
    fn config_carries_devices_mounts_hooks_and_env() {
        let e = edits_for(&spec(), &["uid-gpu-0".into()]).expect("known");
        let c = oci_config(
            &e,
            &["nvidia-smi".into(), "-L".into()],
            &[(PathBuf::from("/etc/sim"), "/etc/gpu-sim".into())],
        )
        .expect("config");
        let dev = &c["linux"]["devices"][0];
        assert_eq!(dev["path"], "/dev/null-as-gpu");
        assert_eq!(
            (
                dev["type"].as_str(),
                dev["major"].as_u64(),
                dev["minor"].as_u64()
            ),
            (Some("c"), Some(1), Some(3))
        );
        assert_eq!(c["linux"]["resources"]["devices"][1]["allow"], true);
        assert_eq!(
            c["hooks"]["createContainer"][0]["args"][1],
            "update-ldcache"
        );
        let mounts = c["mounts"].as_array().expect("mounts");
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == "/usr/bin/nvidia-smi" && m["options"][0] == "ro")
        );
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == "/etc/gpu-sim" && m["options"][1] == "ro")
        );
        assert!(
            c["process"]["env"]
                .as_array()
                .expect("env")
                .iter()
                .any(|v| v == "A=1")
        );
        assert!(c["process"].get("rlimits").is_none());
    }

    #[test]
    fn a_device_node_that_is_a_plain_file_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("nvidia0");
        std::fs::write(&file, b"").expect("file");
        let edits = ContainerEdits {
            device_nodes: vec![DeviceNode {
                path: "/dev/nvidia0".into(),
                host_path: file.display().to_string(),
            }],
            ..ContainerEdits::default()
        };
        let err = oci_config(&edits, &[], &[]).expect_err("plain file");
        assert!(
            err.to_string().contains("/dev/nvidia0")
                && err.to_string().contains("not a device node"),
            "{err}"
        );
        let missing = ContainerEdits {
            device_nodes: vec![DeviceNode {
                path: "/dev/nvidia9".into(),
                host_path: dir.path().join("nvidia9").display().to_string(),
            }],
            ..ContainerEdits::default()
        };
        assert!(oci_config(&missing, &[], &[]).is_err());
    }

    #[test]
    fn device_numbers_split_as_linux_does() {
        // makedev(195, 255) and makedev(508, 1) in glibc's encoding.
        assert_eq!(dev_numbers((195 << 8) | 255), (195, 255));
        assert_eq!(dev_numbers((508 << 8) | 1), (508, 1));
        assert_eq!(
            dev_numbers((0x1000 << 32) | (1 << 8) | ((0x0001_2345 << 12) & !0x000f_ffff) | 0x45),
            (4097, 0x0001_2345)
        );
    }
}
