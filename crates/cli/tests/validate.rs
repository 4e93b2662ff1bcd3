//! Runs the `gpu-dra` binary on fixture files and checks its output and exit code.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

fn gpu_dra(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(args)
        .env_remove("DRIVER_NAME")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpu-dra");
    let mut input = child.stdin.take().expect("stdin is piped");
    input
        .write_all(stdin.unwrap_or("").as_bytes())
        .expect("write stdin");
    drop(input);
    child.wait_with_output().expect("wait for gpu-dra")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("utf-8 output")
}

#[test]
fn valid_file_exits_0_with_summary() {
    let file = fixture("valid.yaml");
    let o = gpu_dra(&["validate", &file], None);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(stdout(&o), format!("{file}: ok (3 objects checked)\n"));
}

#[test]
fn invalid_file_lists_every_problem_and_exits_1() {
    let file = fixture("invalid.yaml");
    let o = gpu_dra(&["validate", &file], None);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let expected = [
        "ResourceClaim default/x: spec.devices.config[0].opaque.parameters.sharing.strategy: \
         unknown strategy \"Time-Slicing\"; did you mean \"TimeSlicing\"? valid: \"TimeSlicing\" \
         or \"MPS\"",
        "ResourceClaim default/x: spec.devices.config[0].opaque.parameters.sharing.mpsConfig.\
         defaultActiveThreadPercentage: 150 is out of range 1..=100",
        "ResourceClaim default/x: spec.devices.config[0].requests[1]: request \"gpus\" does not \
         exist; requests here: gpu",
        "DeviceClass broken.nvidia.com: spec.config[0].opaque.parameters.sharing.\
         timeSlicingConfig: not supported in MigDeviceConfig: MIG devices have no time-slice \
         setting; remove it (strategy TimeSlicing alone is allowed)",
        "ResourceClaim ml/no-params: spec.devices.config[0].opaque.parameters: required: configs \
         for driver gpu.nvidia.com carry a GpuConfig or MigDeviceConfig object here",
        &format!("{file}: invalid (5 problems, 3 objects checked)"),
    ];
    assert_eq!(stdout(&o).lines().collect::<Vec<_>>(), expected);
}

#[test]
fn json_list_items_are_checked() {
    let file = fixture("list.json");
    let o = gpu_dra(&["validate", &file], None);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(
        stdout(&o),
        format!(
            "ResourceClaim ns/a: spec.devices.config[0].opaque.parameters.sharing.mpsConfig.\
             defaultPinnedDeviceMemoryLimit: 1M is below the minimum 1Mi: MPS takes pinned \
             memory limits in whole MiB\n{file}: invalid (1 problem, 2 objects checked)\n"
        )
    );
}

#[test]
fn malformed_yaml_names_file_and_line() {
    let file = fixture("malformed.yaml");
    let o = gpu_dra(&["validate", &file], None);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let out = stdout(&o);
    assert!(
        out.starts_with(&format!("{file}:6:12: invalid YAML: ")),
        "{out}"
    );
    assert!(
        out.ends_with(&format!("{file}: invalid (not parsed)\n")),
        "{out}"
    );
}

#[test]
fn several_files_and_stdin() {
    let valid = std::fs::read_to_string(fixture("valid.yaml")).unwrap();
    let list = fixture("list.json");
    let o = gpu_dra(&["validate", "-", &list], Some(&valid));
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let out = stdout(&o);
    assert!(
        out.starts_with("<stdin>: ok (3 objects checked)\n"),
        "{out}"
    );
    assert!(out.ends_with(&format!("{list}: invalid (1 problem, 2 objects checked)\n")));
}

#[test]
fn driver_name_flag_and_env_select_the_configs_judged() {
    let file = fixture("invalid.yaml");
    // Under another driver name none of the configs are ours.
    let o = gpu_dra(
        &["validate", "--driver-name", "other.example.com", &file],
        None,
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(["validate", &file])
        .env("DRIVER_NAME", "other.example.com")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(stdout(&o), format!("{file}: ok (3 objects checked)\n"));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["validate"][..],
        &["validate", "--bogus", "x"],
        &["frobnicate"],
        &[],
    ] {
        let o = gpu_dra(args, None);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {o:?}");
    }
    let o = gpu_dra(&["validate", "/nonexistent/claims.yaml"], None);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.starts_with("gpu-dra: cannot read /nonexistent/claims.yaml: "),
        "{err}"
    );
}

#[test]
fn warnings_do_not_fail_the_run() {
    let claim = r#"{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "w"},
        "spec": {"devices": {
          "requests": [{"name": "m", "exactly": {"deviceClassName": "mig.nvidia.com"}}],
          "config": [{"opaque": {"driver": "gpu.nvidia.com", "parameters":
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}]}}}"#;
    let o = gpu_dra(&["validate", "-"], Some(claim));
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(
        stdout(&o),
        "ResourceClaim default/w: warning: spec.devices.config[0]: GpuConfig applies to request \
         \"m\", whose DeviceClass \"mig.nvidia.com\" gives MIG devices; it will fail when the \
         device is prepared (use MigDeviceConfig)\n<stdin>: ok (1 object checked, 1 warning)\n"
    );
}
