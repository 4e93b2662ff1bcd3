//! Freshness check of the committed protobuf bindings in `src/gen/`.
//!
//! The bindings are generated with `protox` (a pure-Rust protobuf compiler) and
//! `tonic-prost-build`, so no `protoc` is needed to build or to regenerate. This test
//! regenerates into a temporary directory and fails on any difference; with
//! `UPDATE_GENERATED=1` it rewrites `src/gen/` instead (`make generate`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The proto files, relative to `proto/`, in a fixed order.
const PROTOS: &[&str] = &[
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "pluginregistration/v1/api.proto",
    "dra-health/v1alpha1/api.proto",
    "podresources/v1/api.proto",
];

fn generate(out_dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let files: Vec<PathBuf> = PROTOS.iter().map(|p| root.join(p)).collect();
    let fds = protox::compile(&files, [&root]).expect("protos compile");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(true)
        .emit_rerun_if_changed(false)
        .out_dir(out_dir)
        .compile_fds(fds)
        .expect("bindings generate");
}

fn read_dir(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .expect("readable dir")
        .map(|e| {
            let e = e.expect("dir entry");
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read_to_string(e.path()).expect("utf-8 file"),
            )
        })
        .filter(|(name, _)| name.ends_with(".rs"))
        .collect()
}

#[test]
fn generated_bindings_are_fresh() {
    let committed_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/gen");
    let tmp = tempfile::tempdir().expect("temp dir");
    generate(tmp.path());
    let fresh = read_dir(tmp.path());
    assert!(!fresh.is_empty(), "generation produced no files");

    if std::env::var_os("UPDATE_GENERATED").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(&committed_dir).expect("create src/gen");
        for name in read_dir(&committed_dir).keys() {
            if !fresh.contains_key(name) {
                std::fs::remove_file(committed_dir.join(name)).expect("remove stale file");
            }
        }
        for (name, text) in &fresh {
            std::fs::write(committed_dir.join(name), text).expect("write generated file");
        }
        return;
    }

    let committed = read_dir(&committed_dir);
    let stale: Vec<&String> = fresh
        .iter()
        .filter(|(name, text)| committed.get(*name) != Some(*text))
        .map(|(name, _)| name)
        .chain(committed.keys().filter(|n| !fresh.contains_key(*n)))
        .collect();
    assert!(
        stale.is_empty(),
        "generated bindings are stale: {stale:?}; run `make generate` and commit src/gen/"
    );
}
