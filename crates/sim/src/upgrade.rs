//! `gpu-sim upgrade-driver`: swaps the driver version under a running node, as an upgrade of
//! the driver in place does, and the version checks that make the swap visible to NVML users.
//!
//! What a real upgrade does, and what is simulated of it:
//! - The user-space files carry the version in their names (`libnvidia-ml.so.<ver>`,
//!   `libcuda.so.<ver>`, `lib/firmware/nvidia/<ver>/`): the old ones are removed, the new
//!   ones written, the soname links (`libnvidia-ml.so.1`, ...) repointed, the loader cache
//!   rewritten. A process that resolved the versioned path before the swap finds nothing
//!   there afterwards; one that follows `libnvidia-ml.so.1` again finds the new file. The
//!   tools are replaced (new files: a container that mounted the old ones keeps those).
//! - The kernel module is unloaded and the new one loaded. While none is loaded, NVML's init
//!   and every call answer `NVML_ERROR_DRIVER_NOT_LOADED` (9) and `nvidia-smi` prints that it
//!   "couldn't communicate with the NVIDIA driver" (exit 9). A library whose version is not
//!   the loaded module's answers `NVML_ERROR_LIB_RM_VERSION_MISMATCH` (18), and `nvidia-smi`
//!   prints "Failed to initialize NVML: Driver/library version mismatch" with the library's
//!   version (exit 18), as real hosts report after a package upgrade without a module reload.
//!   A library knows its version from its own file name, as the real one has it built in.
//!
//! Two orders, one per way a driver is installed ([`UpgradeStyle`]):
//! - [`UpgradeStyle::Container`], the GPU Operator's driver container restarting with a new
//!   version (its root is `/run/nvidia/driver`): the module is unloaded and the old files go
//!   first, the window passes with no library at all, then the new files appear and the new
//!   module is loaded;
//! - [`UpgradeStyle::Package`], a distribution package upgraded on the host (root `/`), then
//!   the module reloaded: the new files replace the old ones while the old module is still
//!   loaded (every new NVML session fails with the version mismatch for the window), then
//!   the module is reloaded.
//!
//! Kinder than a real host (documented in `docs/STATUS.md`): the swap does not wait for the
//! GPUs' users to stop (a real module cannot be unloaded while any process has a GPU open;
//! the GPU Operator evicts GPU pods first), MIG instances survive it, and a workload that keeps
//! running across it is not disturbed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::SimError;
use crate::setup::{self, Artefacts};
use crate::state::{State, StateFile};

/// Prefix of the NVML library's versioned file name.
pub const NVML_VERSIONED_PREFIX: &str = "libnvidia-ml.so.";

/// In which order the files and the kernel module change (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UpgradeStyle {
    /// The GPU Operator's driver container restarting with another version: module unloaded
    /// and files gone for the window, then the new files and module.
    Container,
    /// A distribution package upgraded in place, then the module reloaded: the new files
    /// beside the old module for the window (version mismatch), then the new module.
    Package,
}

/// One swap of the driver version.
#[derive(Debug, Clone)]
pub struct Upgrade {
    /// The new driver version (`580.105.08`).
    pub version: String,
    /// The order of the steps.
    pub style: UpgradeStyle,
    /// How long NVML cannot be reached.
    pub window: Duration,
}

/// The driver version of an NVML library file (`libnvidia-ml.so.580.95.05` or a link to it):
/// its resolved name's suffix, when that is a dotted version; `None` for any other name (the
/// simulator's own `libgpu_dra_sim.so` in its tests).
pub fn nvml_library_version(path: &Path) -> Option<String> {
    library_version(path, NVML_VERSIONED_PREFIX)
}

/// The driver version of a driver library file named `<prefix><version>` (`libcuda.so.` for
/// `libcuda.so.580.95.05`) or a link to one, as [`nvml_library_version`] reads NVML's.
pub fn library_version(path: &Path, prefix: &str) -> Option<String> {
    let file = std::fs::canonicalize(path).ok()?;
    let name = file.file_name()?.to_str()?;
    let ver = name.strip_prefix(prefix)?;
    is_version(ver).then(|| ver.to_owned())
}

/// A driver version: two or three dot-separated numbers.
fn is_version(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    (2..=3).contains(&parts.len())
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Why NVML cannot be used on the node now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmlRefusal {
    /// No kernel module is loaded (`NVML_ERROR_DRIVER_NOT_LOADED`, 9).
    DriverNotLoaded,
    /// The library and the loaded module are of different versions
    /// (`NVML_ERROR_LIB_RM_VERSION_MISMATCH`, 18).
    VersionMismatch,
}

/// Whether a library of version `library` (if known) may use NVML on a node in `state`.
pub fn nvml_access(state: &State, library: Option<&str>) -> Result<(), NvmlRefusal> {
    if state.driver_unloaded {
        return Err(NvmlRefusal::DriverNotLoaded);
    }
    match library {
        Some(v) if v != state.profile.driver_version => Err(NvmlRefusal::VersionMismatch),
        _ => Ok(()),
    }
}

fn invalid(field: &str, message: String) -> SimError {
    SimError::InvalidArgument {
        field: field.to_owned(),
        message,
    }
}

/// Swaps the driver of the simulated host under `root` to `upgrade.version` (see the module
/// doc), installing the new NVML library from `artefacts`. Blocks for the window. Returns the
/// state afterwards.
pub fn upgrade_driver(
    root: &Path,
    upgrade: &Upgrade,
    artefacts: &Artefacts,
) -> Result<State, SimError> {
    let file = StateFile::under_root(root);
    let before = file.load()?;
    let old = before.profile.driver_version.clone();
    let new = upgrade.version.as_str();
    if !is_version(new) {
        return Err(invalid(
            "--version",
            format!(
                "{new:?} is not a driver version: give two or three dot-separated numbers such as 580.105.08"
            ),
        ));
    }
    if new == old {
        return Err(invalid(
            "--version",
            format!("the node already runs driver {old}: give another version"),
        ));
    }
    let layout = before.profile.driver_layout;
    match upgrade.style {
        UpgradeStyle::Container => {
            set_module(&file, None)?;
            setup::remove_driver_files(root, layout, &old)?;
            std::thread::sleep(upgrade.window);
            install(root, layout, new, artefacts)?;
            set_module(&file, Some(new))
        }
        UpgradeStyle::Package => {
            install(root, layout, new, artefacts)?;
            setup::remove_driver_files(root, layout, &old)?;
            std::thread::sleep(upgrade.window);
            set_module(&file, None)?;
            set_module(&file, Some(new))
        }
    }
}

/// Writes version `ver`'s files: libraries and links, loader cache, firmware, tools.
fn install(
    root: &Path,
    layout: crate::profile::DriverLayout,
    ver: &str,
    artefacts: &Artefacts,
) -> Result<(), SimError> {
    setup::install_libraries(root, layout, ver, artefacts)?;
    setup::install_firmware(root, layout, ver)?;
    setup::install_tools(root, layout, artefacts)
}

/// Unloads the kernel module (`None`) or loads the one of version `ver`.
fn set_module(file: &StateFile, ver: Option<&str>) -> Result<State, SimError> {
    file.update(|s| {
        match ver {
            None => s.driver_unloaded = true,
            Some(v) => {
                s.driver_unloaded = false;
                v.clone_into(&mut s.profile.driver_version);
            }
        }
        Ok::<State, std::convert::Infallible>(s.clone())
    })?
    .map_err(|never| match never {})
}

/// The NVML library a driver tool started in this process's environment loads, and its
/// version: the `libnvidia-ml` entry of `LD_PRELOAD` when there is one (`Err` with its path
/// when that file is missing: the loader ignores it and the tool finds no library), else
/// `libnvidia-ml.so.1` in the root's library folder; `Ok(None)` when neither names a
/// versioned library (the version is then not checked).
pub fn tool_library(
    root: Option<&Path>,
    layout: crate::profile::DriverLayout,
    preload: Option<&str>,
) -> Result<Option<String>, PathBuf> {
    let preloaded = preload
        .into_iter()
        .flat_map(|p| p.split([':', ' ']))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvidia-ml.so"))
        });
    if let Some(p) = preloaded {
        return match std::fs::metadata(p) {
            Ok(_) => Ok(nvml_library_version(Path::new(p))),
            Err(_) => Err(PathBuf::from(p)),
        };
    }
    Ok(
        root.and_then(|r| {
            nvml_library_version(&r.join(layout.lib_dir()).join("libnvidia-ml.so.1"))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;
    use std::fs;

    fn fake_artefacts(dir: &Path) -> Artefacts {
        let bin = dir.join("bin");
        fs::create_dir_all(bin.join("deps")).expect("mkdir");
        fs::write(bin.join("deps").join(setup::CDYLIB_NAME), b"lib").expect("lib");
        fs::write(bin.join(setup::CUDA_CDYLIB_NAME), b"cuda").expect("libcuda");
        for t in setup::TOOLS {
            fs::write(bin.join(t), b"tool").expect("tool");
        }
        Artefacts::beside(&bin).expect("artefacts")
    }

    fn upgrade(version: &str, style: UpgradeStyle) -> Upgrade {
        Upgrade {
            version: version.into(),
            style,
            window: Duration::ZERO,
        }
    }

    #[test]
    fn versions_come_from_the_resolved_file_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let file = tmp.path().join("libnvidia-ml.so.580.95.05");
        fs::write(&file, b"x").expect("lib");
        let link = tmp.path().join("libnvidia-ml.so.1");
        std::os::unix::fs::symlink("libnvidia-ml.so.580.95.05", &link).expect("link");
        assert_eq!(nvml_library_version(&link).as_deref(), Some("580.95.05"));
        fs::write(tmp.path().join("libgpu_dra_sim.so"), b"x").expect("cdylib");
        assert_eq!(
            nvml_library_version(&tmp.path().join("libgpu_dra_sim.so")),
            None
        );
        assert_eq!(nvml_library_version(&tmp.path().join("missing")), None);
        assert!(is_version("535.54") && !is_version("1") && !is_version("5x.1"));
    }

    #[test]
    fn both_layouts_swap_every_versioned_file_and_repoint_the_links() {
        for (profile, style) in [
            ("t4", UpgradeStyle::Container),
            ("t4", UpgradeStyle::Package),
            ("h100-usr-local-nvidia", UpgradeStyle::Container),
            ("h100-usr-local-nvidia", UpgradeStyle::Package),
        ] {
            let tmp = tempfile::tempdir().expect("tmp");
            let art = fake_artefacts(tmp.path());
            let root = tmp.path().join("root");
            let p = Profile::load(profile).expect("profile");
            let old = p.driver_version.clone();
            setup::setup(&root, &p, &art).expect("setup");
            let lib = root.join(p.driver_layout.lib_dir());
            let count = |ver: &str| {
                fs::read_dir(&lib)
                    .expect("lib dir")
                    .filter(|e| {
                        e.as_ref().is_ok_and(|e| {
                            e.file_name()
                                .to_string_lossy()
                                .ends_with(&format!(".so.{ver}"))
                        })
                    })
                    .count()
            };
            let n = count(&old);
            let st = upgrade_driver(&root, &upgrade("590.44.01", style), &art).expect("upgrade");
            let what = format!("{profile} {style:?}");
            assert_eq!(st.profile.driver_version, "590.44.01", "{what}");
            assert!(!st.driver_unloaded, "{what}");
            assert_eq!(count(&old), 0, "{what}: old files left");
            assert_eq!(count("590.44.01"), n, "{what}: new files");
            assert_eq!(
                fs::read_link(lib.join("libnvidia-ml.so.1")).expect("soname link"),
                Path::new("libnvidia-ml.so.590.44.01"),
                "{what}"
            );
            assert_eq!(
                nvml_library_version(&lib.join("libnvidia-ml.so.1")).as_deref(),
                Some("590.44.01"),
                "{what}"
            );
            assert!(
                fs::metadata(lib.join("libcuda.so")).is_ok(),
                "{what}: .so link"
            );
            assert!(
                !setup::firmware_dir(&root, p.driver_layout, &old).exists(),
                "{what}: old firmware"
            );
            assert!(
                setup::firmware_dir(&root, p.driver_layout, "590.44.01").is_dir(),
                "{what}: new firmware"
            );
            assert_eq!(nvml_access(&st, Some("590.44.01")), Ok(()), "{what}");
            assert_eq!(
                nvml_access(&st, Some(&old)),
                Err(NvmlRefusal::VersionMismatch),
                "{what}: a library of the old version"
            );
        }
    }

    #[test]
    fn the_window_is_seen_as_real_hosts_show_it() {
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        for style in [UpgradeStyle::Container, UpgradeStyle::Package] {
            let root = tmp.path().join(format!("{style:?}"));
            let p = Profile::load("t4").expect("profile");
            let old = p.driver_version.clone();
            setup::setup(&root, &p, &art).expect("setup");
            let lib = root
                .join(p.driver_layout.lib_dir())
                .join("libnvidia-ml.so.1");
            let file = StateFile::under_root(&root);
            let swap = {
                let (root, art) = (root.clone(), art.clone());
                std::thread::spawn(move || {
                    let mut u = upgrade("590.44.01", style);
                    u.window = Duration::from_millis(600);
                    upgrade_driver(&root, &u, &art)
                })
            };
            std::thread::sleep(Duration::from_millis(300));
            let st = file.load().expect("state");
            match style {
                UpgradeStyle::Container => {
                    assert!(fs::metadata(&lib).is_err(), "no library in the window");
                    assert_eq!(
                        nvml_access(&st, Some(&old)),
                        Err(NvmlRefusal::DriverNotLoaded)
                    );
                }
                UpgradeStyle::Package => {
                    let ver = nvml_library_version(&lib);
                    assert_eq!(ver.as_deref(), Some("590.44.01"), "new library at once");
                    assert_eq!(
                        nvml_access(&st, ver.as_deref()),
                        Err(NvmlRefusal::VersionMismatch),
                        "old module, new library"
                    );
                }
            }
            swap.join().expect("thread").expect("upgrade");
            let st = file.load().expect("state");
            assert_eq!(
                nvml_access(&st, nvml_library_version(&lib).as_deref()),
                Ok(())
            );
        }
    }

    #[test]
    fn bad_versions_are_refused_naming_the_flag() {
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        let root = tmp.path().join("root");
        let p = Profile::load("t4").expect("profile");
        setup::setup(&root, &p, &art).expect("setup");
        for v in ["", "latest", p.driver_version.as_str()] {
            let err = upgrade_driver(&root, &upgrade(v, UpgradeStyle::Container), &art)
                .expect_err("refused")
                .to_string();
            assert!(err.starts_with("--version: "), "{err}");
        }
        assert!(
            !StateFile::under_root(&root)
                .load()
                .expect("state")
                .driver_unloaded
        );
    }

    #[test]
    fn tools_find_their_library_as_the_loader_would() {
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        let root = tmp.path().join("root");
        let p = Profile::load("t4").expect("profile");
        setup::setup(&root, &p, &art).expect("setup");
        let layout = p.driver_layout;
        let want = Some(p.driver_version.clone());
        assert_eq!(tool_library(Some(&root), layout, None), Ok(want.clone()));
        let link = root.join(layout.lib_dir()).join("libnvidia-ml.so.1");
        let preload = link.display().to_string();
        assert_eq!(tool_library(None, layout, Some(&preload)), Ok(want));
        let gone = root.join(layout.lib_dir()).join("libnvidia-ml.so.1.2.3");
        let preload = format!("/lib/other.so:{}", gone.display());
        assert_eq!(tool_library(Some(&root), layout, Some(&preload)), Err(gone));
        assert_eq!(tool_library(None, layout, None), Ok(None));
    }
}
