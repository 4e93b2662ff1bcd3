//! The self-test bundle on simulated hosts: `selftest.sh`'s command (`gpu-kubelet-plugin
//! selftest` with the bundle's runc, hook and root file system) passes on every profile, with
//! and without `--leave-settings`, and fails with a named check when the host is broken under
//! it: a driver library missing, a device node that is not one.
//!
//! Runs when `SELFTEST_BUNDLE` names a built bundle (`make selftest-check`), as root (runc
//! starts containers). The simulated host's state folder is every container's `/etc/gpu-sim`
//! (`--container-mount`), as the kernel driver is every process's on a real host.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpu_dra_sim::profile::DriverLayout;
use gpu_dra_sim::state::ComputeMode;
use gpu_dra_sim::testing::SimHost;
use serde_json::Value;

fn bundle() -> Option<PathBuf> {
    let dir = std::env::var_os("SELFTEST_BUNDLE").filter(|s| !s.is_empty())?;
    Some(PathBuf::from(dir))
}

/// Runs the bundle's self-test against `host` with `extra` flags; the JSON report and the log.
fn selftest(bundle: &Path, host: &SimHost, extra: &[&str]) -> (Value, String) {
    let root = host.root().display().to_string();
    // Where the profile installs the driver: the host's root, or `/usr/local/nvidia` under it
    // (the real H100 host's layout), as an admin sets `nvidiaDriverRoot`.
    let driver_root = match host.profile().driver_layout {
        DriverLayout::Distro => host.root().to_path_buf(),
        DriverLayout::UsrLocalNvidia => host.root().join("usr/local/nvidia"),
    };
    let out = Command::new(bundle.join("bin/gpu-kubelet-plugin"))
        .arg("selftest")
        .arg("--nvidia-driver-root")
        .arg(&driver_root)
        .args(["--dev-root", &root])
        .arg("--sysfs-root")
        .arg(host.sysfs_root())
        .arg("--rootfs")
        .arg(bundle.join("rootfs"))
        .arg("--runtime")
        .arg(bundle.join("bin/runc"))
        .arg("--nvidia-cdi-hook-path")
        .arg(bundle.join("bin/nvidia-cdi-hook"))
        .arg("--container-mount")
        .arg(format!(
            "{}:/etc/gpu-sim",
            host.root().join("etc/gpu-sim").display()
        ))
        .args(["--node-name", "sim", "-o", "json", "--log-level", "info"])
        .args(extra)
        .env_remove("GPU_SIM_STATE")
        .output()
        .expect("the bundle's plugin runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("report does not parse ({e}):\n{stdout}\n{log}"));
    let failed = report["failed"].as_u64().unwrap_or(u64::MAX);
    assert_eq!(
        out.status.success(),
        failed == 0,
        "exit status {:?} with {failed} failed checks",
        out.status
    );
    (report, log)
}

/// `(name, status, detail)` of every check.
fn checks(report: &Value) -> Vec<(String, String, String)> {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
            (s("name"), s("status"), s("detail"))
        })
        .collect()
}

fn status_of(report: &Value, name: &str) -> (String, String) {
    checks(report)
        .into_iter()
        .find(|(n, _, _)| n == name)
        .map(|(_, s, d)| (s, d))
        .unwrap_or_else(|| panic!("no check {name} in {report:#}"))
}

fn has_mig_devices(host: &SimHost) -> bool {
    let state = host.state();
    state.gpus.iter().any(|g| {
        g.mig_current
            && g.gpu_instances
                .iter()
                .any(|gi| !gi.compute_instances.is_empty())
    })
}

#[test]
fn selftest_passes_on_every_simulated_profile() {
    let Some(bundle) = bundle() else {
        eprintln!("SELFTEST_BUNDLE not set: skipped (make selftest-check runs it)");
        return;
    };
    for profile in gpu_dra_sim::profile::builtin_names() {
        let host = SimHost::new(profile);
        let (report, log) = selftest(&bundle, &host, &[]);
        let all = checks(&report);
        let failed: Vec<_> = all.iter().filter(|(_, s, _)| s == "fail").collect();
        assert!(failed.is_empty(), "{profile}: {failed:#?}\n{log}");
        // What the host offers is run; what it lacks is skipped, and said why.
        for name in [
            "discovery",
            "discovery/nvidia-smi",
            "whole-gpu/nvidia-smi",
            "whole-gpu/cuda",
            "whole-gpu/unprepare",
            "mps/nvidia-smi",
            "mps/cuda",
            "mps/memory-limit",
            "mps/thread-percentage",
            "time-slicing/unprepare",
            "host/restored",
        ] {
            assert_eq!(
                status_of(&report, name).0,
                "pass",
                "{profile}: {name} in {all:#?}"
            );
        }
        // GPUs before Volta have no time-slice setting: the claim is refused with advice.
        let (status, detail) = status_of(&report, "time-slicing/prepare");
        if status == "skip" {
            assert!(
                detail.contains("does not support time-slicing"),
                "{profile}: {detail}"
            );
        } else {
            assert_eq!(
                status_of(&report, "time-slicing/cuda").0,
                "pass",
                "{profile}: {all:#?}"
            );
        }
        if has_mig_devices(&host) {
            assert_eq!(
                status_of(&report, "mig/cuda").0,
                "pass",
                "{profile}: {all:#?}"
            );
            assert_eq!(status_of(&report, "mig/nvidia-smi").0, "pass", "{profile}");
        } else {
            assert_eq!(status_of(&report, "mig").0, "skip", "{profile}: {all:#?}");
        }
    }
}

#[test]
fn leave_settings_skips_time_slicing_and_leaves_compute_modes_alone() {
    let Some(bundle) = bundle() else {
        eprintln!("SELFTEST_BUNDLE not set: skipped (make selftest-check runs it)");
        return;
    };
    let host = SimHost::new("dgx-h100");
    let (report, log) = selftest(&bundle, &host, &["--leave-settings"]);
    assert_eq!(report["failed"], 0, "{report:#}\n{log}");
    let (status, why) = status_of(&report, "time-slicing");
    assert_eq!(status, "skip");
    assert!(why.contains("--leave-settings"), "{why}");
    for name in [
        "whole-gpu/cuda",
        "mps/memory-limit",
        "mps/thread-percentage",
        "host/restored",
    ] {
        assert_eq!(status_of(&report, name).0, "pass", "{name}: {report:#}");
    }

    // GPUs an admin keeps in EXCLUSIVE_PROCESS: the plugin's MPS path sets the mode and puts
    // DEFAULT back after, so only a run that never touches the mode leaves it so.
    let exclusive = |h: &SimHost| {
        h.update_state(|s| {
            for g in &mut s.gpus {
                g.compute_mode = ComputeMode::ExclusiveProcess;
            }
        });
    };
    let modes = |h: &SimHost| -> Vec<ComputeMode> {
        h.state().gpus.iter().map(|g| g.compute_mode).collect()
    };
    let host = SimHost::new("dgx-h100");
    exclusive(&host);
    let (report, log) = selftest(&bundle, &host, &["--leave-settings", "--kinds", "mps"]);
    assert_eq!(report["failed"], 0, "{report:#}\n{log}");
    assert_eq!(status_of(&report, "mps/memory-limit").0, "pass");
    assert!(
        modes(&host)
            .iter()
            .all(|m| *m == ComputeMode::ExclusiveProcess)
    );
    // Without it, the same host is not left as it was, and the report says so.
    let (report, _) = selftest(&bundle, &host, &["--kinds", "mps"]);
    let (status, detail) = status_of(&report, "host/restored");
    assert_eq!(status, "fail", "{report:#}");
    assert!(
        detail.contains("compute mode Default (was Exclusive_Process)"),
        "{detail}"
    );
}

#[test]
fn a_missing_driver_library_fails_the_cuda_check_by_name() {
    let Some(bundle) = bundle() else {
        eprintln!("SELFTEST_BUNDLE not set: skipped (make selftest-check runs it)");
        return;
    };
    let host = SimHost::new("t4");
    // The driver's libcuda gone from the host: the spec cannot name it, the container has none.
    for entry in std::fs::read_dir(host.lib_path().parent().expect("lib dir")).expect("lib dir") {
        let path = entry.expect("entry").path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libcuda.so"))
        {
            std::fs::remove_file(&path).expect("remove");
        }
    }
    let (report, _) = selftest(&bundle, &host, &["--kinds", "whole-gpu"]);
    let (status, detail) = status_of(&report, "whole-gpu/cuda");
    assert_eq!(status, "fail", "{report:#}");
    assert!(detail.contains("libcuda.so.1"), "{detail}");
    // The host is restored all the same.
    assert_eq!(status_of(&report, "host/restored").0, "pass", "{report:#}");
}

#[test]
fn a_device_node_that_is_not_one_fails_by_path() {
    let Some(bundle) = bundle() else {
        eprintln!("SELFTEST_BUNDLE not set: skipped (make selftest-check runs it)");
        return;
    };
    let host = SimHost::new("t4");
    let node = host.root().join("dev/nvidia0");
    std::fs::remove_file(&node).expect("remove");
    std::fs::write(&node, b"").expect("plain file");
    let (report, _) = selftest(&bundle, &host, &["--kinds", "whole-gpu"]);
    let (status, detail) = status_of(&report, "whole-gpu/cuda");
    assert_eq!(status, "fail", "{report:#}");
    assert!(
        detail.contains("/dev/nvidia0") && detail.contains("not a device node"),
        "{detail}"
    );
    assert_eq!(status_of(&report, "whole-gpu/nvidia-smi").0, "fail");
}

#[test]
fn the_bundle_script_runs_under_its_own_loader_and_writes_both_reports() {
    let Some(bundle) = bundle() else {
        eprintln!("SELFTEST_BUNDLE not set: skipped (make selftest-check runs it)");
        return;
    };
    let host = SimHost::new("dgx-a100-40gb");
    let reports = tempfile::tempdir().expect("tempdir");
    let root = host.root();
    let out = Command::new(bundle.join("selftest.sh"))
        .arg("--nvidia-driver-root")
        .arg(root)
        .arg("--dev-root")
        .arg(root)
        .arg("--sysfs-root")
        .arg(host.sysfs_root())
        .arg("--container-mount")
        .arg(format!(
            "{}:/etc/gpu-sim",
            root.join("etc/gpu-sim").display()
        ))
        .env("REPORT_DIR", reports.path())
        .output()
        .expect("selftest.sh runs");
    let text = std::fs::read_to_string(reports.path().join("selftest-report.txt")).expect("text");
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.ends_with("0 failed, 1 skipped\n"), "{text}");
    assert!(text.contains("PASS  mig/cuda"), "{text}");
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(reports.path().join("selftest-report.json")).expect("json"),
    )
    .expect("parses");
    assert_eq!(json["failed"], 0);
    assert_eq!(status_of(&json, "time-slicing").0, "skip");
}
