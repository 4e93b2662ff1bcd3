//! The layering rule, kept by Cargo and checked here: the pure crates (`gpu-dra-api`,
//! `gpu-dra-device`, `gpu-dra-core`, `gpu-dra-selectors`) link no hardware library, no async
//! runtime and no Kubernetes or gRPC client. A dependency that pulls one in fails this test, with the path
//! through which it came.

use std::process::Command;

/// Packages that mean I/O: NVML and its loader, the async runtime, clients and servers.
const FORBIDDEN: &[&str] = &[
    "gpu-dra-nvml",
    "nvml-wrapper",
    "nvml-wrapper-sys",
    "libloading",
    "tokio",
    "mio",
    "tonic",
    "hyper",
    "kube",
    "kube-client",
    "reqwest",
];

fn normal_dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--locked",
            "--edges",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
            "--package",
            package,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn pure_crates_link_no_io() {
    for package in [
        "gpu-dra-api",
        "gpu-dra-device",
        "gpu-dra-core",
        "gpu-dra-selectors",
    ] {
        let deps = normal_dependencies(package);
        assert!(
            deps.iter().any(|d| d == package),
            "cargo tree of {package} does not list the package itself: {deps:?}"
        );
        let bad: Vec<&String> = deps
            .iter()
            .filter(|d| FORBIDDEN.contains(&d.as_str()))
            .collect();
        assert!(
            bad.is_empty(),
            "{package} depends on {bad:?}; run `cargo tree -p {package} -i <name>` to see how"
        );
    }
}

#[test]
fn the_check_sees_io_where_there_is_some() {
    // The same query on the NVML backend must find NVML, or the test above proves nothing.
    let deps = normal_dependencies("gpu-dra-nvml");
    assert!(deps.iter().any(|d| d == "nvml-wrapper"), "{deps:?}");
}
