//! A driver upgrade in place as NVML users and `nvidia-smi` see it: sessions and libraries of
//! before the swap fail with the real codes, the window fails as real hosts do, and a fresh
//! load from the new files reports the new version.

use std::process::Command;
use std::time::Duration;

use gpu_dra_sim::testing::SimHost;
use gpu_dra_sim::upgrade::UpgradeStyle;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

const NEW: &str = "590.44.01";

fn smi(host: &SimHost, args: &[&str], preload: Option<&str>) -> (i32, String) {
    let mut c = Command::new(host.tool("nvidia-smi"));
    c.args(args)
        .env_remove("GPU_SIM_STATE")
        .env_remove("GPU_SIM_PROFILE")
        .env_remove("LD_PRELOAD");
    if let Some(p) = preload {
        c.env("LD_PRELOAD", p);
    }
    let out = c.output().expect("spawn nvidia-smi");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn load(path: &std::path::Path) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(path.as_os_str()).init()
}

#[test]
fn a_session_across_the_swap_fails_and_a_fresh_lookup_reaches_the_new_driver() {
    let host = SimHost::new("t4");
    let old = host.profile().driver_version.clone();
    let soname = host.lib_path();
    let held = load(&soname).expect("NVML before the upgrade");
    assert_eq!(held.sys_driver_version().expect("version"), old);

    host.upgrade_driver(NEW, UpgradeStyle::Container, Duration::ZERO);
    assert!(
        matches!(held.device_count(), Err(NvmlError::LibRmVersionMismatch)),
        "a session of the old library: {:?}",
        held.device_count()
    );
    // The loader hands out the library it has loaded under that name already: the old one.
    assert!(matches!(
        load(&soname),
        Err(NvmlError::LibRmVersionMismatch)
    ));
    // The new file by its own name is another library.
    let fresh = gpu_dra_sim_lib(&host);
    let nvml = load(&fresh).expect("NVML from the new file");
    assert_eq!(nvml.sys_driver_version().expect("version"), NEW);
    assert_eq!(nvml.device_count().expect("count"), 1);
    drop(held);
}

/// The versioned NVML file `libnvidia-ml.so.1` names now.
fn gpu_dra_sim_lib(host: &SimHost) -> std::path::PathBuf {
    std::fs::canonicalize(host.lib_path()).expect("soname link resolves")
}

#[test]
fn nvidia_smi_fails_in_the_window_as_real_hosts_do_and_shows_the_new_version_after() {
    for style in [UpgradeStyle::Container, UpgradeStyle::Package] {
        let host = std::sync::Arc::new(SimHost::new("t4"));
        let old = host.profile().driver_version.clone();
        let old_lib = gpu_dra_sim_lib(&host);
        let swap = {
            let host = host.clone();
            std::thread::spawn(move || host.upgrade_driver(NEW, style, Duration::from_secs(2)))
        };
        // Inside the window.
        std::thread::sleep(Duration::from_millis(700));
        let (code, out) = smi(&host, &["-L"], None);
        match style {
            UpgradeStyle::Container => {
                assert_eq!(code, 9, "{out}");
                assert!(
                    out.contains("couldn't communicate with the NVIDIA driver"),
                    "{out}"
                );
                assert!(load(&host.lib_path()).is_err(), "no library in the window");
            }
            UpgradeStyle::Package => {
                assert_eq!(code, 18, "{out}");
                assert_eq!(
                    out,
                    "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 590.44\n"
                );
            }
        }
        let st = swap.join().expect("upgrade thread");
        assert_eq!(st.profile.driver_version, NEW);
        let (code, out) = smi(&host, &[], None);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains(&format!("NVIDIA-SMI {NEW}"))
                && out.contains(&format!("Driver Version: {NEW}")),
            "{out}"
        );
        // A tool told to preload the old file by its path finds no library.
        let (code, out) = smi(&host, &["-L"], Some(&old_lib.display().to_string()));
        assert_eq!(code, 12, "{style:?}: {out}");
        assert!(out.contains("couldn't find libnvidia-ml.so"), "{out}");
        assert!(!old_lib.exists(), "{style:?}: {old} library left");
    }
}
