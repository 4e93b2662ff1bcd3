//! Differential test against NVIDIA's container toolkit: on a simulated host of every
//! profile, `nvidia-ctk cdi generate` lists the device nodes, driver files and hooks a GPU
//! container gets; our spec for a claim of all the node's devices must hold each of them,
//! with the same host and container paths and the same hook arguments. On the profile laid
//! out like a real H100 host, our spec must also hold what the toolkit listed on that host
//! (`testdata/h100-580-ctk-spec.json`), paths relative to the driver root aside.
//!
//! Runs when `NVIDIA_CTK` names the `nvidia-ctk` binary (`make cdi-check`), as root: the
//! toolkit reads some host files outside `--driver-root` (the MIG minors table under
//! `/proc/driver/nvidia-caps`, the kernel's firmware search path under `/sys/module`, and
//! `PATH` for binaries), so it runs in a private mount namespace (`unshare -m`) where those
//! show what a real host with that driver shows. Nothing of the toolkit's output is
//! special-cased; the intended differences are listed below with their reasons.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use gpu_dra_core::plan::{DeviceNodesNeed, MigIds};
use gpu_dra_kubelet_plugin::cdi_io::CdiHost;
use gpu_dra_kubelet_plugin::host::DriverRoots;
use gpu_dra_sim::testing::SimHost;
use serde_json::Value;

/// The hook path given to both (NVIDIA's chart default is the same).
const HOOK: &str = "/usr/local/bin/nvidia-cdi-hook";

/// Hooks of the toolkit we do not emit, and why.
const HOOKS_NOT_EMITTED: &[(&str, &str)] = &[
    (
        "update-application-profile",
        "writes the OpenGL/Vulkan application profile of the driver; graphics only",
    ),
    (
        "apply-cuda-memory-limits",
        "a per-device createRuntime hook of toolkit 1.20 that caps CUDA memory per GPU \
         from the toolkit's own configuration; sharing limits come from the claim config",
    ),
    (
        "chmod",
        "opens /dev/dri folder permissions for graphics device nodes, which we do not inject",
    ),
];

/// Files of the toolkit we do not mount, and why: graphics and display configuration
/// (Vulkan ICD and layers, EGL/GLVND vendor files, GBM, X server modules), which a compute
/// container does not use and which live outside the driver's folders.
const MOUNTS_NOT_EMITTED: &[&str] = &[
    "/etc/vulkan/",
    "/usr/share/vulkan/",
    "/usr/share/glvnd/",
    "/usr/share/egl/",
    "/usr/lib/xorg/",
    "/gbm/",
];

/// Links of `create-symlinks` we do not emit: graphics ones the toolkit adds beyond the
/// soname and `.so` links (the GBM backend in `gbm/`, GLVND's `libGLX_indirect.so.0`).
fn link_emitted(link: &str) -> bool {
    !link.contains("/gbm/") && !link.ends_with("/libGLX_indirect.so.0")
}

fn ctk() -> Option<String> {
    std::env::var("NVIDIA_CTK").ok().filter(|s| !s.is_empty())
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Runs `nvidia-ctk cdi generate` on the simulated host in a private mount namespace.
fn toolkit_spec(ctk: &str, host: &SimHost) -> Value {
    let root = host.root().to_string_lossy().into_owned();
    let layout = host.profile().driver_layout;
    let fw_dir = format!("/{}", layout.firmware_dir());
    let bin_dir = format!("/{}", layout.bin_dir());
    let fw_file = host.root().join("etc/gpu-sim/firmware_class.path");
    std::fs::write(&fw_file, &fw_dir).expect("firmware path file");
    let script = format!(
        "set -e; mount -t tmpfs none /proc/driver; mkdir -p /proc/driver/nvidia-caps; \
         cp {root}/proc/driver/nvidia-caps/mig-minors /proc/driver/nvidia-caps/; \
         if [ -e /sys/module/firmware_class/parameters/path ]; then \
           mount --bind {fw} /sys/module/firmware_class/parameters/path; fi; \
         PATH=\"$PATH:{bin_dir}\" exec {ctk} cdi generate --driver-root {root} --dev-root {root} \
           --nvidia-cdi-hook-path {HOOK} --format json",
        root = sh_quote(&root),
        fw = sh_quote(&fw_file.to_string_lossy()),
        ctk = sh_quote(ctk),
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .expect("run unshare (util-linux)");
    assert!(
        out.status.success(),
        "nvidia-ctk failed on {}: {}",
        host.profile().name,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("toolkit prints JSON")
}

/// Every device of the node, as a claim of all of them would have it.
fn our_spec(host: &SimHost) -> Value {
    let tmp = tempfile::tempdir().expect("tmp");
    let state = host.state();
    let cdi = CdiHost::discover(
        tmp.path().to_path_buf(),
        &DriverRoots::same(host.root()),
        host.root(),
        &state.profile.driver_version,
        Some(Path::new(HOOK)),
    );
    let mut devices = Vec::new();
    for (spec, gpu) in state.profile.gpus.iter().zip(&state.gpus) {
        let mut needs = Vec::new();
        if gpu.mig_current {
            for gi in &gpu.gpu_instances {
                for ci in &gi.compute_instances {
                    needs.push(DeviceNodesNeed {
                        gpu_minor: spec.minor,
                        mig: Some(MigIds {
                            gi: gi.id,
                            ci: ci.id,
                        }),
                    });
                }
            }
        } else {
            needs.push(DeviceNodesNeed {
                gpu_minor: spec.minor,
                mig: None,
            });
        }
        for (i, need) in needs.iter().enumerate() {
            devices.push(gpu_dra_core::cdi::SpecDevice {
                device: format!("gpu-{}-{i}", spec.minor),
                node_paths: cdi.device_nodes(need).expect("device nodes exist"),
            });
        }
    }
    serde_json::to_value(cdi.spec("uid", &devices)).expect("json")
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// What a spec gives a container: device nodes, mounts and hooks, each as comparable text.
#[derive(Default, Debug)]
struct Edits {
    nodes: BTreeSet<String>,
    mounts: BTreeSet<String>,
    links: BTreeSet<String>,
    hooks: BTreeSet<String>,
}

impl Edits {
    fn add(&mut self, edits: &Value, root: &str) {
        let strip = |p: &str| p.strip_prefix(root).unwrap_or(p).to_owned();
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let path = n["path"].as_str().unwrap_or_default();
            let host = n["hostPath"].as_str().unwrap_or(path);
            self.nodes.insert(format!("{path} <- {}", strip(host)));
        }
        for m in edits["mounts"].as_array().into_iter().flatten() {
            let c = m["containerPath"].as_str().unwrap_or_default();
            let h = m["hostPath"].as_str().unwrap_or_default();
            if MOUNTS_NOT_EMITTED
                .iter()
                .any(|x| c.contains(x) || h.contains(x))
            {
                continue;
            }
            self.mounts.insert(format!("{c} <- {}", strip(h)));
        }
        for h in edits["hooks"].as_array().into_iter().flatten() {
            let args = strs(&h["args"]);
            let name = args.get(1).cloned().unwrap_or_default();
            if HOOKS_NOT_EMITTED.iter().any(|(n, _)| *n == name) {
                continue;
            }
            let path = h["path"].as_str().unwrap_or_default();
            let kind = h["hookName"].as_str().unwrap_or_default();
            if name == "create-symlinks" {
                for pair in args.chunks(2).skip(1) {
                    if let Some(link) = pair.get(1).filter(|l| link_emitted(l)) {
                        self.links.insert(link.clone());
                    }
                }
                self.hooks.insert(format!("{kind} {path} create-symlinks"));
            } else {
                self.hooks
                    .insert(format!("{kind} {path} {}", args.join(" ")));
            }
        }
    }

    fn of(spec: &Value, root: &str) -> Edits {
        let mut e = Edits::default();
        e.add(&spec["containerEdits"], root);
        for d in spec["devices"].as_array().into_iter().flatten() {
            e.add(&d["containerEdits"], root);
        }
        e
    }

    /// What `self` lacks of `want`, one line per item.
    fn missing(&self, want: &Edits) -> Vec<String> {
        let lack = |kind: &str, have: &BTreeSet<String>, want: &BTreeSet<String>| {
            want.difference(have)
                .map(|x| format!("{kind}: {x}"))
                .collect::<Vec<_>>()
        };
        let mut out = lack("device node", &self.nodes, &want.nodes);
        out.extend(lack("mount", &self.mounts, &want.mounts));
        out.extend(lack("link", &self.links, &want.links));
        out.extend(lack("hook", &self.hooks, &want.hooks));
        out
    }
}

#[test]
fn our_specs_hold_what_the_toolkit_lists_on_every_profile() {
    let Some(ctk) = ctk() else {
        eprintln!("NVIDIA_CTK not set: skipped (make cdi-check runs it)");
        return;
    };
    for name in gpu_dra_sim::profile::builtin_names() {
        let host = SimHost::new(name);
        let root = host.root().to_string_lossy().into_owned();
        let theirs = Edits::of(&toolkit_spec(&ctk, &host), &root);
        let ours = Edits::of(&our_spec(&host), &root);
        assert!(
            !theirs.nodes.is_empty() && !theirs.mounts.is_empty() && !theirs.hooks.is_empty(),
            "{name}: the toolkit listed nothing: {theirs:?}"
        );
        let missing = ours.missing(&theirs);
        assert!(
            missing.is_empty(),
            "{name}: our spec lacks what the toolkit gives:\n{}",
            missing.join("\n")
        );
    }
}

#[test]
fn on_the_real_h100_layout_our_spec_holds_the_real_hosts_spec() {
    let host = SimHost::new("h100-usr-local-nvidia");
    let root = host.root().to_string_lossy().into_owned();
    let real: Value =
        serde_json::from_str(include_str!("testdata/h100-580-ctk-spec.json")).expect("real spec");
    // The real host's driver root is `/`; the real spec's per-device hook names it as "".
    let theirs = Edits::of(&real, "");
    let ours = Edits::of(&our_spec(&host), &root);
    let missing = ours.missing(&theirs);
    assert!(
        missing.is_empty(),
        "our spec on the simulated layout lacks what the toolkit gave on the real host:\n{}",
        missing.join("\n")
    );
    assert_eq!(
        theirs.mounts.len(),
        33,
        "26 libraries, 5 binaries, 2 firmware files"
    );
}
