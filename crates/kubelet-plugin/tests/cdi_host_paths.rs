//! CDI specs name host paths when the plugin reads the driver elsewhere: a driver installed
//! on the host (`--nvidia-driver-root /`) that the plugin's container sees at
//! `/driver-root` (`--container-driver-root`). The container runtime resolves every spec path
//! on the host, so no spec may name the container's path.

use std::path::Path;

use gpu_dra_kubelet_plugin::cdi_io::CdiHost;
use gpu_dra_kubelet_plugin::host::DriverRoots;
use gpu_dra_sim::testing::SimHost;

const HOOK: &str = "/var/lib/kubelet/plugins/gpu.nvidia.com/bin/nvidia-cdi-hook-0011223344556677";

#[test]
fn a_driver_read_elsewhere_is_named_by_its_host_paths() {
    for profile in ["t4", "h100-usr-local-nvidia"] {
        let host = SimHost::new(profile);
        let here = host.root();
        let version = host.state().profile.driver_version.clone();
        let tmp = tempfile::tempdir().unwrap();
        let roots = DriverRoots {
            host: "/".into(),
            here: here.to_path_buf(),
        };
        let spec = CdiHost::discover(
            tmp.path().to_path_buf(),
            &roots,
            here,
            &version,
            Some(Path::new(HOOK)),
        )
        .spec("uid-1", &[]);
        let edits = &spec.container_edits;
        let mounts = &edits.mounts;
        assert!(
            mounts
                .iter()
                .any(|m| m.host_path.ends_with(&format!("libnvidia-ml.so.{version}"))),
            "{profile}: NVML not mounted: {mounts:#?}"
        );
        assert!(
            mounts.iter().any(|m| m.host_path.ends_with("/nvidia-smi")),
            "{profile}: nvidia-smi not mounted: {mounts:#?}"
        );
        let here_str = here.to_string_lossy();
        for m in mounts {
            assert!(
                !m.host_path.starts_with(here_str.as_ref()),
                "{profile}: {} names the plugin's path",
                m.host_path
            );
            // The host path is the file the plugin found, named from the host's root.
            let on_disk = here.join(m.host_path.trim_start_matches('/'));
            assert!(
                on_disk.exists(),
                "{profile}: {} is not the host path of a driver file",
                m.host_path
            );
            assert_eq!(
                m.host_path, m.container_path,
                "{profile}: same path in both"
            );
        }
        assert!(!edits.hooks.is_empty(), "{profile}: no hooks");
        for h in &edits.hooks {
            assert_eq!(h.path, HOOK, "{profile}: hook binary by its host path");
        }
    }
}

#[test]
fn one_root_for_both_is_named_as_read() {
    let host = SimHost::new("t4");
    let version = host.state().profile.driver_version.clone();
    let tmp = tempfile::tempdir().unwrap();
    let spec = CdiHost::discover(
        tmp.path().to_path_buf(),
        &DriverRoots::same(host.root()),
        host.root(),
        &version,
        None,
    )
    .spec("uid-1", &[]);
    let root = host.root().to_string_lossy().into_owned();
    let mounts = &spec.container_edits.mounts;
    assert!(!mounts.is_empty());
    for m in mounts {
        assert!(m.host_path.starts_with(&root), "{}", m.host_path);
        assert!(Path::new(&m.host_path).exists(), "{}", m.host_path);
    }
    assert!(
        spec.container_edits.hooks.is_empty(),
        "no hook path, no hooks"
    );
}
