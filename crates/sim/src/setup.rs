//! `gpu-sim setup`: lays out a self-contained simulated host under a directory.
//!
//! The tree mirrors what the driver finds on a real node (paths relative to the root):
//! - `usr/lib/x86_64-linux-gnu/libnvidia-ml.so.<ver>` (the simulator library) with the
//!   `libnvidia-ml.so.1` and `libnvidia-ml.so` links, as the driver installs it (runtimes
//!   mount the versioned file); `libcuda.so.<ver>` (+ `libcuda.so.1`), the simulated CUDA
//!   driver library (package `gpu-dra-sim-cuda`, whose ELF soname is `libcuda.so.1`),
//!   `libnvidia-ptxjitcompiler.so.<ver>` (+ `.so.1`), `lib/firmware/nvidia/<ver>/gsp_ga10x.bin`;
//! - beside `libnvidia-ml.so.1`, in every layout, the host distribution's system libraries
//!   ([`HOST_SYSTEM_LIBRARIES`]: `libc.so.6`, ...) as stand-ins no loader can use (see
//!   [`crate::driverfiles::host_system_library`]): on a real host the folder holding the
//!   driver's libraries holds a glibc other than the one of the process running a tool from a
//!   container, so a tool started with `LD_LIBRARY_PATH` naming that folder fails at start
//!   here as it does there;
//! - `usr/bin/nvidia-smi`, `usr/bin/nvidia-cuda-mps-control`, `usr/bin/nvidia-persistenced`;
//! - `dev/nvidia<minor>`, `dev/nvidiactl`, `dev/nvidia-uvm`, `dev/nvidia-uvm-tools`,
//!   `dev/nvidia-caps/nvidia-cap<N>` (regular files standing in for device nodes);
//! - `proc/devices`, `proc/driver/nvidia/capabilities/mig/{config,monitor}` and
//!   `.../gpu<minor>/mig/gi<G>/access`, `.../gi<G>/ci<C>/access` for the MIG devices present;
//! - `sys/bus/pci/devices/<busid>` links into `sys/devices/<pcieRoot>/<bridge>/<busid>` with
//!   `numa_node`, `vendor`, `device`;
//! - `etc/gpu-sim/state.json`.
//!
//! Invariant: the library and tools are *copied* (not linked) so that their own path, which
//! they use to find the state, lies inside the root.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::SimError;
use crate::mig;
use crate::profile::{DriverLayout, Profile};
use crate::state::{State, StateFile};

/// Library directory under the root.
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";
/// Installed NVML library path under the root.
pub const NVML_LIB: &str = "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
/// Tool directory under the root.
pub const BIN_DIR: &str = "usr/bin";
/// File name of the cdylib as cargo builds it.
pub const CDYLIB_NAME: &str = "libgpu_dra_sim.so";
/// File name of the simulated CUDA driver library (package `gpu-dra-sim-cuda`) as cargo
/// builds it; installed as `libcuda.so.<ver>`.
pub const CUDA_CDYLIB_NAME: &str = "libgpu_dra_sim_cuda.so";
/// The host distribution's system libraries that setup puts beside the NVML library (the
/// ones a driver tool links against).
pub const HOST_SYSTEM_LIBRARIES: &[&str] = &[
    "libc.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "libm.so.6",
    "librt.so.1",
];
/// The stand-in tools installed by setup.
pub const TOOLS: &[&str] = &["nvidia-smi", "nvidia-cuda-mps-control"];

/// Where the build artefacts to install come from.
#[derive(Debug, Clone)]
pub struct Artefacts {
    /// The cdylib (`libgpu_dra_sim.so`).
    pub cdylib: PathBuf,
    /// The simulated CUDA driver library (`libgpu_dra_sim_cuda.so`).
    pub libcuda: PathBuf,
    /// Directory holding the `nvidia-smi` and `nvidia-cuda-mps-control` executables.
    pub bin_dir: PathBuf,
}

impl Artefacts {
    /// Finds the artefacts next to `dir` (a cargo profile directory such as
    /// `target/debug`): the cdylibs in `dir` or `dir/deps`, the tools in `dir`.
    pub fn beside(dir: &Path) -> Result<Artefacts, SimError> {
        let find = |name: &str| {
            let candidates = [dir.join(name), dir.join("deps").join(name)];
            candidates
                .iter()
                .find(|p| p.is_file())
                .cloned()
                .ok_or_else(|| SimError::MissingArtefact {
                    what: name.to_string(),
                    searched: format!(
                        "{} and {}",
                        candidates[0].display(),
                        candidates[1].display()
                    ),
                })
        };
        let cdylib = find(CDYLIB_NAME)?;
        let libcuda = find(CUDA_CDYLIB_NAME)?;
        for tool in TOOLS {
            let p = dir.join(tool);
            if !p.is_file() {
                return Err(SimError::MissingArtefact {
                    what: (*tool).to_string(),
                    searched: dir.display().to_string(),
                });
            }
        }
        Ok(Artefacts {
            cdylib,
            libcuda,
            bin_dir: dir.to_path_buf(),
        })
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SimError {
    let path = path.to_path_buf();
    move |source| SimError::Io { path, source }
}

fn write(path: &Path, content: &[u8]) -> Result<(), SimError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(content).map_err(io(path))
}

fn copy(from: &Path, to: &Path) -> Result<(), SimError> {
    if let Some(dir) = to.parent() {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    // Remove first: overwriting a library another process has mapped would corrupt it.
    let _ = fs::remove_file(to);
    fs::copy(from, to).map_err(io(from))?;
    Ok(())
}

fn symlink(target: &str, link: &Path) -> Result<(), SimError> {
    if let Some(dir) = link.parent() {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let _ = fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).map_err(io(link))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), SimError> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io(path))
}

/// Major of `/dev/nvidia<N>` and `/dev/nvidiactl` (fixed by the kernel module).
pub const NVIDIA_MAJOR: u32 = 195;
/// Major of `/dev/nvidia-uvm*` (dynamic on real hosts; the value `proc/devices` lists here).
pub const UVM_MAJOR: u32 = 508;
/// Major of `/dev/nvidia-caps/*` (dynamic; the value `proc/devices` lists here).
pub const CAPS_MAJOR: u32 = 236;

/// Makes a character device node, as the driver does; where that is not permitted (not
/// root, or a user namespace), a regular file stands in for it.
fn device_node(path: &Path, major: u32, minor: u32) -> Result<(), SimError> {
    use std::os::unix::ffi::OsStrExt;
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let _ = fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| SimError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    if rc == 0 {
        return set_mode(path, 0o666);
    }
    write(path, b"")
}

/// `/proc/driver/nvidia-caps/mig-minors`: the capability minor of every possible GPU and
/// compute instance of the node's GPUs, as the driver publishes it whether MIG is on or not.
fn mig_minors(profile: &Profile) -> String {
    let mut s = String::from("config 1\nmonitor 2\n");
    for g in &profile.gpus {
        for gi in 0..mig::MAX_GPU_INSTANCES {
            s.push_str(&format!(
                "gpu{}/gi{gi}/access {}\n",
                g.minor,
                mig::gi_cap_minor(g.minor, gi)
            ));
            for ci in 0..mig::MAX_COMPUTE_INSTANCES {
                s.push_str(&format!(
                    "gpu{}/gi{gi}/ci{ci}/access {}\n",
                    g.minor,
                    mig::ci_cap_minor(g.minor, gi, ci)
                ));
            }
        }
    }
    s
}

/// `(library, soname)` of the driver libraries a layout installs; `None` when the soname is
/// the versioned file name itself.
fn libraries(layout: DriverLayout) -> &'static [(&'static str, Option<&'static str>)] {
    match layout {
        DriverLayout::Distro => &[
            ("libnvidia-ml", Some("libnvidia-ml.so.1")),
            ("libcuda", Some("libcuda.so.1")),
            (
                "libnvidia-ptxjitcompiler",
                Some("libnvidia-ptxjitcompiler.so.1"),
            ),
        ],
        DriverLayout::UsrLocalNvidia => &[
            ("libEGL_nvidia", Some("libEGL_nvidia.so.0")),
            ("libGLESv1_CM_nvidia", Some("libGLESv1_CM_nvidia.so.1")),
            ("libGLESv2_nvidia", Some("libGLESv2_nvidia.so.2")),
            ("libGLX_nvidia", Some("libGLX_nvidia.so.0")),
            ("libcuda", Some("libcuda.so.1")),
            ("libcudadebugger", Some("libcudadebugger.so.1")),
            ("libnvcuvid", Some("libnvcuvid.so.1")),
            ("libnvidia-allocator", Some("libnvidia-allocator.so.1")),
            ("libnvidia-cfg", Some("libnvidia-cfg.so.1")),
            ("libnvidia-eglcore", None),
            ("libnvidia-encode", Some("libnvidia-encode.so.1")),
            ("libnvidia-fbc", Some("libnvidia-fbc.so.1")),
            ("libnvidia-glcore", None),
            ("libnvidia-glsi", None),
            ("libnvidia-glvkspirv", None),
            ("libnvidia-gpucomp", None),
            ("libnvidia-ml", Some("libnvidia-ml.so.1")),
            ("libnvidia-nvvm", Some("libnvidia-nvvm.so.4")),
            ("libnvidia-opencl", Some("libnvidia-opencl.so.1")),
            ("libnvidia-opticalflow", Some("libnvidia-opticalflow.so.1")),
            ("libnvidia-pkcs11-openssl3", None),
            (
                "libnvidia-ptxjitcompiler",
                Some("libnvidia-ptxjitcompiler.so.1"),
            ),
            ("libnvidia-rtcore", None),
            ("libnvidia-tls", None),
            ("libnvoptix", Some("libnvoptix.so.1")),
            ("libvdpau_nvidia", Some("libvdpau_nvidia.so.1")),
        ],
    }
}

/// Installs the GSP firmware of driver version `ver` (`<firmware dir>/nvidia/<ver>/`).
pub(crate) fn install_firmware(
    root: &Path,
    layout: DriverLayout,
    ver: &str,
) -> Result<(), SimError> {
    let files: &[&str] = match layout {
        DriverLayout::Distro => &["gsp_ga10x.bin"],
        DriverLayout::UsrLocalNvidia => &["gsp_ga10x.bin", "gsp_tu10x.bin"],
    };
    for name in files {
        write(
            &firmware_dir(root, layout, ver).join(name),
            b"simulated GSP firmware\n",
        )?;
    }
    Ok(())
}

/// The folder of driver version `ver`'s firmware.
pub(crate) fn firmware_dir(root: &Path, layout: DriverLayout, ver: &str) -> PathBuf {
    root.join(format!("{}/nvidia/{ver}", layout.firmware_dir()))
}

/// Installs the stand-in tools (copies, so that they find the state from their own path) and
/// the layout's other tools as scripts that succeed.
pub(crate) fn install_tools(
    root: &Path,
    layout: DriverLayout,
    artefacts: &Artefacts,
) -> Result<(), SimError> {
    let bin = root.join(layout.bin_dir());
    for tool in TOOLS {
        let to = bin.join(tool);
        copy(&artefacts.bin_dir.join(tool), &to)?;
        set_mode(&to, 0o755)?;
    }
    let scripts: &[&str] = match layout {
        DriverLayout::Distro => &["nvidia-persistenced"],
        DriverLayout::UsrLocalNvidia => &[
            "nvidia-persistenced",
            "nvidia-debugdump",
            "nvidia-cuda-mps-server",
        ],
    };
    for name in scripts {
        let path = bin.join(name);
        write(&path, b"#!/bin/sh\nexit 0\n")?;
        set_mode(&path, 0o755)?;
    }
    Ok(())
}

/// Removes the driver libraries of version `ver` that [`install_libraries`] installs and
/// the version's firmware, then the soname and `.so` links left dangling (those an upgrade
/// already repointed to its new files stay): what an upgrade, or the removal of a driver
/// container's root, takes away. Missing files are fine.
pub(crate) fn remove_driver_files(
    root: &Path,
    layout: DriverLayout,
    ver: &str,
) -> Result<(), SimError> {
    let remove = |p: &Path| match fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(p)(e)),
        _ => Ok(()),
    };
    let lib = root.join(layout.lib_dir());
    for (stem, _) in libraries(layout) {
        remove(&lib.join(format!("{stem}.so.{ver}")))?;
    }
    // The `.so` link names the soname link: soname links first.
    for (stem, soname) in libraries(layout) {
        for link in soname
            .iter()
            .map(|so| lib.join(so))
            .chain([lib.join(format!("{stem}.so"))])
        {
            if fs::symlink_metadata(&link).is_ok() && fs::metadata(&link).is_err() {
                remove(&link)?;
            }
        }
    }
    let fw = firmware_dir(root, layout, ver);
    match fs::remove_dir_all(&fw) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&fw)(e)),
        _ => Ok(()),
    }
}

/// Installs the driver libraries with their soname and `.so` links, as the driver's
/// installer does, and the root's `etc/ld.so.cache` listing them by soname (as `ldconfig`
/// would). The NVML library is the simulator itself, the CUDA library the simulated CUDA
/// driver; the others are ELF stubs carrying only their soname.
pub(crate) fn install_libraries(
    root: &Path,
    layout: DriverLayout,
    ver: &str,
    artefacts: &Artefacts,
) -> Result<(), SimError> {
    let lib = root.join(layout.lib_dir());
    let mut cache = Vec::new();
    for (stem, soname) in libraries(layout) {
        let file = format!("{stem}.so.{ver}");
        if *stem == "libnvidia-ml" {
            copy(&artefacts.cdylib, &lib.join(&file))?;
        } else if *stem == "libcuda" {
            // The soname the toolkit reads, which the link could not give it (see
            // `driverfiles::set_soname`).
            let mut bytes = fs::read(&artefacts.libcuda).map_err(io(&artefacts.libcuda))?;
            if bytes.starts_with(b"\x7fELF") {
                crate::driverfiles::set_soname(&mut bytes, "libcuda.so.1").map_err(|message| {
                    SimError::InvalidArgument {
                        field: artefacts.libcuda.display().to_string(),
                        message,
                    }
                })?;
            }
            let to = lib.join(&file);
            // Removed first, as `copy` does: a process may have the old file mapped.
            let _ = fs::remove_file(&to);
            write(&to, &bytes)?;
            set_mode(&to, 0o755)?;
        } else {
            let so = soname.map_or(file.clone(), str::to_owned);
            write(&lib.join(&file), &crate::driverfiles::elf_with_soname(&so))?;
        }
        let so = match soname {
            Some(so) => {
                symlink(&file, &lib.join(so))?;
                so.to_string()
            }
            None => file.clone(),
        };
        symlink(&so, &lib.join(format!("{stem}.so")))?;
        cache.push((so.clone(), format!("/{}/{so}", layout.lib_dir())));
    }
    // The host's own glibc beside the driver's libraries. Not in the root's ld.so.cache: the
    // toolkit looks up driver libraries there, and only those.
    for so in HOST_SYSTEM_LIBRARIES {
        write(&lib.join(so), &crate::driverfiles::host_system_library(so))?;
    }
    // ldconfig lists entries in descending name order.
    cache.sort_by(|a, b| b.0.cmp(&a.0));
    write(
        &root.join("etc/ld.so.cache"),
        &crate::driverfiles::ld_so_cache(&cache),
    )
}

/// Creates (or refreshes) a simulated host for `profile` under `root`, installing the
/// library and tools from `artefacts`. An existing state file is replaced by the profile's
/// boot state.
pub fn setup(root: &Path, profile: &Profile, artefacts: &Artefacts) -> Result<State, SimError> {
    fs::create_dir_all(root).map_err(io(root))?;
    let ver = &profile.driver_version;

    let layout = profile.driver_layout;
    install_libraries(root, layout, ver, artefacts)?;
    install_firmware(root, layout, ver)?;
    install_tools(root, layout, artefacts)?;

    // State first: the device files below are derived from it.
    let state = State::from_profile(profile.clone());
    StateFile::under_root(root).create(&state)?;

    // Device nodes and /proc.
    let dev = root.join("dev");
    for (name, major, minor) in [
        ("nvidiactl", NVIDIA_MAJOR, 255),
        ("nvidia-uvm", UVM_MAJOR, 0),
        ("nvidia-uvm-tools", UVM_MAJOR, 1),
    ] {
        device_node(&dev.join(name), major, minor)?;
    }
    for g in &profile.gpus {
        device_node(
            &dev.join(format!("nvidia{}", g.minor)),
            NVIDIA_MAJOR,
            g.minor,
        )?;
    }
    write(
        &root.join("proc/driver/nvidia-caps/mig-minors"),
        mig_minors(profile).as_bytes(),
    )?;
    write(
        &root.join("proc/devices"),
        b"Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n195 nvidiactl\n236 nvidia-caps\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
    )?;
    let caps = root.join("proc/driver/nvidia/capabilities");
    write(
        &caps.join("mig/config"),
        b"DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n",
    )?;
    write(
        &caps.join("mig/monitor"),
        b"DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
    )?;
    device_node(&dev.join("nvidia-caps/nvidia-cap1"), CAPS_MAJOR, 1)?;
    device_node(&dev.join("nvidia-caps/nvidia-cap2"), CAPS_MAJOR, 2)?;
    sync_mig_files(root, &state)?;

    // sysfs.
    for g in &profile.gpus {
        let a = g.pci();
        let busid = a.sysfs();
        // A root-port bridge between the root complex and the GPU, as on real systems.
        let bridge = format!("{:04x}:{:02x}:01.0", a.domain, a.bus.saturating_sub(1));
        let rel = format!("devices/{}/{bridge}/{busid}", g.pcie_root);
        let devdir = root.join("sys").join(&rel);
        write(
            &devdir.join("numa_node"),
            format!("{}\n", g.numa_node).as_bytes(),
        )?;
        write(&devdir.join("vendor"), b"0x10de\n")?;
        let id = crate::profile::pci_id(&g.pci_device_id) >> 16;
        write(&devdir.join("device"), format!("0x{id:04x}\n").as_bytes())?;
        symlink(
            &format!("../../../{rel}"),
            &root.join("sys/bus/pci/devices").join(&busid),
        )?;
    }
    Ok(state)
}

/// Makes the MIG capability files under `proc/` and `dev/nvidia-caps/` match the GPU and
/// compute instances in `state`: files of instances that no longer exist are removed.
pub fn sync_mig_files(root: &Path, state: &State) -> Result<(), SimError> {
    // Changed in place: files and nodes of instances that stay are left untouched (another
    // claim's container may be starting from them right now), those of instances that are
    // gone are removed and those of new ones created. Minors depend only on the GPU and the
    // instance IDs, so an existing file of a wanted instance is already right.
    let caps = root.join("proc/driver/nvidia/capabilities");
    let capdev = root.join("dev/nvidia-caps");
    let mut wanted_minors = std::collections::BTreeSet::new();
    let mut wanted_files = std::collections::BTreeMap::new();
    for (i, g) in state.profile.gpus.iter().enumerate() {
        let migdir = caps.join(format!("gpu{}/mig", g.minor));
        for gi in &state.gpus[i].gpu_instances {
            let gidir = migdir.join(format!("gi{}", gi.id));
            let m = mig::gi_cap_minor(g.minor, gi.id);
            wanted_minors.insert(m);
            wanted_files.insert(gidir.join("access"), m);
            for ci in &gi.compute_instances {
                let m = mig::ci_cap_minor(g.minor, gi.id, ci.id);
                wanted_minors.insert(m);
                wanted_files.insert(gidir.join(format!("ci{}/access", ci.id)), m);
            }
        }
    }
    // Device files of instances that no longer exist go (1 and 2 are config/monitor).
    if let Ok(entries) = fs::read_dir(&capdev) {
        for e in entries.flatten() {
            let minor = e
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("nvidia-cap"))
                .and_then(|n| n.parse::<u32>().ok());
            if minor.is_some_and(|m| m > 2 && !wanted_minors.contains(&m)) {
                fs::remove_file(e.path()).map_err(io(&e.path()))?;
            }
        }
    }
    // So do the capability folders of GPU and compute instances that no longer exist.
    for g in &state.profile.gpus {
        let migdir = caps.join(format!("gpu{}/mig", g.minor));
        for gidir in subdirs(&migdir) {
            if !wanted_files.contains_key(&gidir.join("access")) {
                fs::remove_dir_all(&gidir).map_err(io(&gidir))?;
                continue;
            }
            for cidir in subdirs(&gidir) {
                if !wanted_files.contains_key(&cidir.join("access")) {
                    fs::remove_dir_all(&cidir).map_err(io(&cidir))?;
                }
            }
        }
    }
    for (path, m) in &wanted_files {
        if !path.exists() {
            write(
                path,
                format!("DeviceFileMinor: {m}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
                    .as_bytes(),
            )?;
        }
    }
    for m in &wanted_minors {
        let node = capdev.join(format!("nvidia-cap{m}"));
        if fs::symlink_metadata(&node).is_err() {
            device_node(&node, CAPS_MAJOR, *m)?;
        }
    }
    Ok(())
}

/// The folders directly in `dir` (none when it cannot be read).
fn subdirs(dir: &Path) -> Vec<std::path::PathBuf> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Applies a MIG layout change `f` to `file` under its exclusive lock and, when `f`
/// succeeds, brings the capability files under the state's root in line with the result
/// before the lock is released, so no other process of the node sees the new layout without
/// its nodes. The one path for every MIG change: `nvidia-smi mig` and the NVML create/destroy
/// calls both come here. Writing the files is best effort (their failure does not undo the
/// change): the state is what NVML answers from; the files are for CDI specs and for which
/// MIG devices a process sees. Only a laid-out root (one with its `dev/` folder) gets files:
/// creating `dev/` under a bare state file would hide every GPU from its own processes.
pub fn change_mig_layout<T, E>(
    file: &StateFile,
    f: impl FnOnce(&mut State) -> Result<T, E>,
) -> Result<Result<T, E>, SimError> {
    let root = file.dev_dir().and_then(|_| file.root());
    file.update(|s| {
        let out = f(s)?;
        if let Some(root) = &root {
            let _ = sync_mig_files(root, s);
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_artefacts(dir: &Path) -> Artefacts {
        let bin = dir.join("bin");
        fs::create_dir_all(bin.join("deps")).expect("mkdir");
        fs::write(bin.join("deps").join(CDYLIB_NAME), b"lib").expect("lib");
        fs::write(bin.join(CUDA_CDYLIB_NAME), b"cuda").expect("libcuda");
        for t in TOOLS {
            fs::write(bin.join(t), b"tool").expect("tool");
        }
        Artefacts::beside(&bin).expect("artefacts")
    }

    #[test]
    fn a_layout_change_leaves_the_files_of_instances_that_stay_in_place() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        let root = tmp.path().join("root");
        let profile = Profile::load("dgx-a100-40gb").expect("profile");
        let mut state = setup(&root, &profile, &art).expect("setup");
        let minor = profile.gpus[0].minor;
        let gis: Vec<u32> = state.gpus[0].gpu_instances.iter().map(|g| g.id).collect();
        let (kept, gone) = (gis[0], gis[1]);
        let node = |gi: u32| {
            root.join(format!(
                "dev/nvidia-caps/nvidia-cap{}",
                mig::gi_cap_minor(minor, gi)
            ))
        };
        let access = |gi: u32| {
            root.join(format!(
                "proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi}/access"
            ))
        };
        let inode = |p: &Path| fs::symlink_metadata(p).expect("exists").ino();
        let (kept_node, kept_access) = (inode(&node(kept)), inode(&access(kept)));
        state.gpus[0].gpu_instances.retain(|g| g.id != gone);
        sync_mig_files(&root, &state).expect("sync");
        assert!(
            !node(gone).exists() && !access(gone).exists(),
            "files of a gone instance stay"
        );
        assert_eq!(
            inode(&node(kept)),
            kept_node,
            "a kept instance's node was recreated"
        );
        assert_eq!(
            inode(&access(kept)),
            kept_access,
            "a kept instance's file was rewritten"
        );
    }

    #[test]
    fn dgx_a100_tree_has_devices_caps_and_sysfs() {
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        let root = tmp.path().join("root");
        let profile = Profile::load("dgx-a100-40gb").expect("profile");
        setup(&root, &profile, &art).expect("setup");

        assert_eq!(fs::read(root.join(NVML_LIB)).expect("lib"), b"lib");
        assert_eq!(
            fs::read_link(root.join(NVML_LIB)).expect("soname link"),
            Path::new("libnvidia-ml.so.580.95.05")
        );
        assert!(root.join(LIB_DIR).join("libnvidia-ml.so").exists());
        assert_eq!(
            fs::read(root.join(LIB_DIR).join("libcuda.so.1")).expect("libcuda"),
            b"cuda"
        );
        assert!(
            root.join("usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
                .is_file()
        );
        assert!(
            root.join("lib/firmware/nvidia/580.95.05/gsp_ga10x.bin")
                .is_file()
        );
        for i in 0..8 {
            assert!(is_node(&root.join(format!("dev/nvidia{i}"))));
        }
        // GPU 0 GI 1 (3g.20gb): minor 12, CI 0: 13 (NVIDIA's mig-minors table).
        let gi =
            fs::read_to_string(root.join("proc/driver/nvidia/capabilities/gpu0/mig/gi1/access"))
                .expect("gi access");
        assert_eq!(
            gi,
            "DeviceFileMinor: 12\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        );
        let ci = fs::read_to_string(
            root.join("proc/driver/nvidia/capabilities/gpu3/mig/gi12/ci0/access"),
        )
        .expect("ci access");
        assert!(ci.starts_with(&format!("DeviceFileMinor: {}\n", 3 + 135 * 3 + 9 * 12 + 1)));
        assert!(is_node(&root.join("dev/nvidia-caps/nvidia-cap13")));
        assert!(is_node(&root.join("dev/nvidia-caps/nvidia-cap1")));
        // Destroying an instance removes its files.
        let mut st = StateFile::under_root(&root).load().expect("state");
        st.destroy_compute_instance(0, 1, 0).expect("dci");
        st.destroy_gpu_instance(0, 1).expect("dgi");
        sync_mig_files(&root, &st).expect("sync");
        assert!(!root.join("dev/nvidia-caps/nvidia-cap13").exists());
        assert!(!root.join("dev/nvidia-caps/nvidia-cap12").exists());
        assert!(is_node(&root.join("dev/nvidia-caps/nvidia-cap1")));
        assert!(is_node(
            &root.join(format!("dev/nvidia-caps/nvidia-cap{}", 3 + 9 * 6))
        ));
        assert!(
            !root
                .join("proc/driver/nvidia/capabilities/gpu4/mig")
                .exists()
        );

        let link = root.join("sys/bus/pci/devices/0000:b7:00.0");
        let target = fs::canonicalize(&link).expect("link resolves");
        assert!(
            target.ends_with("sys/devices/pci0000:b0/0000:b6:01.0/0000:b7:00.0"),
            "{}",
            target.display()
        );
        // GPU 6 of the DGX A100 (NPS4) is on NUMA node 5.
        assert_eq!(
            fs::read_to_string(link.join("numa_node")).expect("numa"),
            "5\n"
        );
        assert_eq!(
            fs::read_to_string(link.join("device")).expect("id"),
            "0x20b0\n"
        );

        let st = StateFile::under_root(&root).load().expect("state");
        assert_eq!(st.profile.name, "dgx-a100-40gb");
    }

    /// A device node, or the regular file standing in for one where mknod is not allowed.
    fn is_node(p: &Path) -> bool {
        use std::os::unix::fs::FileTypeExt;
        fs::metadata(p).is_ok_and(|m| m.is_file() || m.file_type().is_char_device())
    }

    #[test]
    fn driver_files_are_found_the_way_the_toolkit_finds_them() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        let root = tmp.path().join("root");
        let profile = Profile::load("h100-usr-local-nvidia").expect("profile");
        setup(&root, &profile, &art).expect("setup");
        let lib = root.join("usr/local/nvidia/lib64");
        assert_eq!(
            fs::read_link(lib.join("libcuda.so.1")).expect("soname link"),
            Path::new("libcuda.so.580.159.04")
        );
        assert_eq!(
            fs::read_link(lib.join("libnvidia-tls.so")).expect(".so link"),
            Path::new("libnvidia-tls.so.580.159.04")
        );
        let n = fs::read_dir(&lib)
            .expect("lib64")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".so.580.159.04"))
            })
            .count();
        assert_eq!(n, 26);
        let cache = fs::read(root.join("etc/ld.so.cache")).expect("ld cache");
        assert!(cache.starts_with(b"glibc-ld.so.cache1.1"));
        let needle = b"/usr/local/nvidia/lib64/libcuda.so.1\0";
        assert!(cache.windows(needle.len()).any(|w| w == needle));
        for t in ["nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-server"] {
            assert!(root.join("usr/local/nvidia/bin").join(t).is_file(), "{t}");
        }
        assert!(
            root.join("usr/local/nvidia/firmware/nvidia/580.159.04/gsp_tu10x.bin")
                .is_file()
        );
        let minors =
            fs::read_to_string(root.join("proc/driver/nvidia-caps/mig-minors")).expect("minors");
        assert!(minors.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\n"));
        assert!(minors.contains("gpu0/gi14/ci7/access 137\n"));
        let ctl = fs::metadata(root.join("dev/nvidiactl")).expect("nvidiactl");
        if ctl.file_type().is_char_device() {
            assert_eq!(ctl.rdev(), libc::makedev(NVIDIA_MAJOR, 255));
        }
    }

    #[test]
    fn every_profile_has_the_hosts_system_libraries_beside_nvml() {
        let tmp = tempfile::tempdir().expect("tmp");
        let art = fake_artefacts(tmp.path());
        for name in crate::profile::builtin_names() {
            let root = tmp.path().join(name);
            let profile = Profile::load(name).expect("profile");
            setup(&root, &profile, &art).expect("setup");
            let lib = root.join(profile.driver_layout.lib_dir());
            assert!(lib.join("libnvidia-ml.so.1").exists(), "{name}");
            for so in HOST_SYSTEM_LIBRARIES {
                assert_eq!(
                    fs::read(lib.join(so)).expect("stand-in"),
                    crate::driverfiles::host_system_library(so),
                    "{name}: {so}"
                );
            }
        }
    }

    #[test]
    fn missing_artefacts_are_named() {
        let tmp = tempfile::tempdir().expect("tmp");
        let err = Artefacts::beside(tmp.path()).expect_err("missing");
        assert!(err.to_string().contains(CDYLIB_NAME), "{err}");
        fs::write(tmp.path().join(CDYLIB_NAME), b"lib").expect("lib");
        let err = Artefacts::beside(tmp.path()).expect_err("missing");
        assert!(err.to_string().contains(CUDA_CDYLIB_NAME), "{err}");
    }
}
