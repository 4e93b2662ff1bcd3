//! Every manifest under `examples/` against the one validation (`gpu_dra_api::objects`).
//!
//! - each scenario folder has a README naming the devices it needs and YAML manifests whose
//!   `resource.k8s.io` objects are all `v1`; every object passes `check_object` with no error,
//!   no unknown request and no warning, and the webhook allows it without a warning; pods'
//!   claim references resolve inside the folder; every CEL selector parses and the selector
//!   lint finds nothing in it;
//! - each `examples/invalid/<name>.yaml` fails with exactly the lines of
//!   `<name>.expected.txt` (errors, then unknown requests; `UPDATE_GENERATED=1` rewrites them
//!   for review);
//! - `gpu-dra validate` (the operator CLI's library entry) passes every valid file and fails
//!   every invalid one, printing each expected message.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpu_dra_api::objects::check_object;
use gpu_dra_webhook::validation;
use serde_json::Value;

const DRIVER: &str = "gpu.nvidia.com";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("examples directory is readable")
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn documents(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).expect("example is readable UTF-8");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .unwrap_or_else(|e| panic!("{}: not YAML: {e}", file.display()));
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    assert!(!docs.is_empty(), "{}: no documents", file.display());
    docs
}

fn names_of(docs: &[Value], kind: &str) -> BTreeSet<String> {
    docs.iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| {
            d["metadata"]["name"]
                .as_str()
                .expect("objects have a name")
                .to_owned()
        })
        .collect()
}

/// Every `cel.expression` string anywhere in `v`.
fn cel_expressions<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(map) => {
            if let Some(e) = map
                .get("cel")
                .and_then(|c| c.get("expression"))
                .and_then(Value::as_str)
            {
                out.push(e);
            }
            map.values().for_each(|v| cel_expressions(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| cel_expressions(v, out)),
        _ => {}
    }
}

/// The pod spec of a Pod or of a workload's pod template.
fn pod_spec(doc: &Value) -> Option<&Value> {
    match doc["kind"].as_str()? {
        "Pod" => Some(&doc["spec"]),
        "Deployment" | "StatefulSet" | "DaemonSet" | "Job" | "ReplicaSet" => {
            Some(&doc["spec"]["template"]["spec"])
        }
        _ => None,
    }
}

#[test]
fn valid_examples_pass() {
    let expected = [
        "whole-gpu",
        "gpu-memory-quantity",
        "driver-version-semver",
        "same-pcie-root",
        "nvlink-pair",
        "nvlink-four",
        "nvlink-or-numa",
        "time-slicing-shared",
        "mps",
        "mig-1g5gb",
        "mig-four-from-one-gpu",
        "mig-time-slicing",
        "mig-mps",
        "dynamic-mig",
        "deviceclass-admin-default",
        "extended-resource",
        "resource-quota",
        "memory-shares",
    ];
    let mut seen = Vec::new();
    let mut checked_objects = 0;
    for entry in std::fs::read_dir(examples()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() || dir.ends_with("invalid") {
            continue;
        }
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let readme = std::fs::read_to_string(dir.join("README.md"))
            .unwrap_or_else(|_| panic!("{name}: README.md missing"));
        assert!(
            readme.contains("Devices on the simulated `dgx-a100-40gb` node"),
            "{name}: the README must list the devices it expects"
        );
        let files = yaml_files(&dir);
        assert!(!files.is_empty(), "{name}: no manifests");
        let docs: Vec<Value> = files.iter().flat_map(|f| documents(f)).collect();

        for doc in &docs {
            let label = format!("{name}: {} {}", doc["kind"], doc["metadata"]["name"]);
            let api_version = doc["apiVersion"].as_str().unwrap_or_default();
            assert!(doc["kind"].is_string(), "{label}: no kind");
            if api_version.starts_with("resource.k8s.io/") {
                assert_eq!(api_version, "resource.k8s.io/v1", "{label}");
            }
            let report = check_object(doc, DRIVER);
            assert!(
                report.is_ok() && report.warnings.is_empty(),
                "{label}: {report:?}"
            );
            let lint = gpu_dra_selectors::lint_object(doc, DRIVER);
            assert!(lint.is_empty(), "{label}: selector lint says {lint:?}");
            let findings = validation::check(doc, DRIVER);
            assert!(
                findings.problems.is_empty() && findings.warnings.is_empty(),
                "{label}: webhook says {findings:?}"
            );
            checked_objects += 1;

            let mut selectors = Vec::new();
            cel_expressions(doc, &mut selectors);
            for expr in selectors {
                assert!(
                    expr.contains("device."),
                    "{label}: selector {expr:?} looks at no device"
                );
                if let Err(e) = cel::Program::compile(expr) {
                    panic!("{label}: selector {expr:?} does not parse: {e}");
                }
            }

            // Claim references resolve inside the folder; containers use declared claims.
            if let Some(spec) = pod_spec(doc) {
                let claims = names_of(&docs, "ResourceClaim");
                let templates = names_of(&docs, "ResourceClaimTemplate");
                let mut declared = BTreeSet::new();
                for rc in spec["resourceClaims"].as_array().into_iter().flatten() {
                    declared.insert(rc["name"].as_str().unwrap());
                    if let Some(c) = rc["resourceClaimName"].as_str() {
                        assert!(claims.contains(c), "{label}: claim {c} not in the folder");
                    }
                    if let Some(t) = rc["resourceClaimTemplateName"].as_str() {
                        assert!(
                            templates.contains(t),
                            "{label}: template {t} not in the folder"
                        );
                    }
                }
                for c in spec["containers"].as_array().unwrap() {
                    for used in c["resources"]["claims"].as_array().into_iter().flatten() {
                        let used = used["name"].as_str().unwrap();
                        assert!(
                            declared.contains(used),
                            "{label}: container uses undeclared claim {used}"
                        );
                    }
                }
            }
        }
        seen.push(name);
    }
    seen.sort();
    let mut want: Vec<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    assert_eq!(seen, want, "scenario folders");
    assert!(
        checked_objects >= 30,
        "only {checked_objects} objects checked"
    );
}

#[test]
fn invalid_examples_fail_with_their_expected_messages() {
    let dir = examples().join("invalid");
    let update = std::env::var_os("UPDATE_GENERATED").is_some();
    let files = yaml_files(&dir);
    assert!(files.len() >= 9, "only {} invalid examples", files.len());
    let mut mismatches = Vec::new();
    for file in files {
        let mut got = Vec::new();
        for doc in documents(&file) {
            let report = check_object(&doc, DRIVER);
            got.extend(report.errors.iter().map(ToString::to_string));
            got.extend(report.unknown_requests.iter().map(ToString::to_string));
        }
        let name = file.file_stem().unwrap().to_string_lossy().into_owned();
        assert!(
            !got.is_empty(),
            "{name}: passes, but it is in examples/invalid"
        );
        let expected_file = dir.join(format!("{name}.expected.txt"));
        let text = got.join("\n") + "\n";
        if update {
            std::fs::write(&expected_file, &text).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&expected_file)
            .unwrap_or_else(|_| panic!("{name}: {} missing", expected_file.display()));
        if want != text {
            mismatches.push(format!("{name}:\n  want:\n{want}  got:\n{text}"));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn gpu_dra_validate_agrees() {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(examples())
        .expect("examples directory is readable")
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    let mut files = 0;
    for dir in dirs {
        let invalid = dir.ends_with("invalid");
        for file in yaml_files(&dir) {
            let text = std::fs::read_to_string(&file).expect("example is readable UTF-8");
            let mut out = Vec::new();
            let outcome = gpu_dra_cli::validate_text("f", &text, DRIVER, true, &mut out)
                .expect("in-memory output");
            let out = String::from_utf8(out).expect("UTF-8 report");
            if invalid {
                assert_eq!(
                    outcome,
                    gpu_dra_cli::Outcome::Invalid,
                    "{}: {out}",
                    file.display()
                );
                let expected = std::fs::read_to_string(file.with_extension("expected.txt"))
                    .expect("expected messages");
                for line in expected.lines() {
                    assert!(
                        out.contains(line),
                        "{}: {line:?} not in\n{out}",
                        file.display()
                    );
                }
            } else {
                assert_eq!(
                    outcome,
                    gpu_dra_cli::Outcome::Valid,
                    "{}: {out}",
                    file.display()
                );
                assert!(!out.contains("warning"), "{}: {out}", file.display());
            }
            files += 1;
        }
    }
    assert!(files >= 25, "only {files} files");
}
