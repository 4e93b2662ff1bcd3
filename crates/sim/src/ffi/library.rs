//! The library's own state: the `nvmlInit` reference count, the state file found at the first
//! init, and the last state read from it with the stamp that tells when to read it again.
//! Every export body runs through [`guard`].
//!
//! Invariant: the cached state is reused only while the state file and the `dev/` folders
//! that decide visibility are unchanged (device, inode, size and times), so a change by
//! another process is seen on the next call.
//!
//! The driver's version checks ([`crate::upgrade`]): init and every call answer
//! `DRIVER_NOT_LOADED` while the node's kernel module is unloaded, and
//! `LIB_RM_VERSION_MISMATCH` when this library's version (from its own file name, read at the
//! first init after it was loaded) is not the loaded module's. So a process that keeps the
//! library of before a driver upgrade loaded, or a session open across it, fails as it would
//! on a real host, and one that loads the library again from a fresh lookup works.

// `dladdr` (where this library lives, to find the simulated host) is a C call.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::handles::lock;
use super::{NvmlReturn, ret};
use crate::state::{self, State, StateFile};

/// What identifies one version of the state file and of the device folders.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_ns: i64,
    dev_dirs: [(i64, i64); 2],
}

/// The library's process-wide state.
struct Lib {
    refcount: u32,
    file: Option<StateFile>,
    cache: Option<(Stamp, Arc<State>)>,
}

/// This library's driver version, from its own file name (`None`: not a versioned file, as
/// the simulator's own `libgpu_dra_sim.so` in its tests). Read once: the file may be gone or
/// replaced later, while the code mapped stays the version it was.
static OWN_VERSION: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

fn own_version() -> Option<&'static str> {
    OWN_VERSION
        .get_or_init(|| own_path().and_then(|p| crate::upgrade::nvml_library_version(&p)))
        .as_deref()
}

/// The driver's version checks on `state` as NVML return codes.
fn check_driver(state: &State) -> Result<(), NvmlReturn> {
    crate::upgrade::nvml_access(state, own_version()).map_err(|refusal| match refusal {
        crate::upgrade::NvmlRefusal::DriverNotLoaded => ret::DRIVER_NOT_LOADED,
        crate::upgrade::NvmlRefusal::VersionMismatch => ret::LIB_RM_VERSION_MISMATCH,
    })
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    refcount: 0,
    file: None,
    cache: None,
});

/// The path of the object this code lives in (the `.so` when loaded as a library: the NVML
/// library, or the CUDA library that links this crate).
pub fn own_path() -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let addr = own_path as *const c_void;
    // SAFETY: `dladdr` only reads the loader's tables for an address inside this object and
    // fills `info`, which is a valid, writable `Dl_info`.
    let rc = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    if rc == 0 {
        return None;
    }
    // SAFETY: `dladdr` returned non-zero, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is a NUL-terminated string owned by the loader that lives as
    // long as the object is loaded, which outlives this call.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The current stamp of `file`; `None` when the file cannot be stat'ed (then nothing is
/// cached).
fn stamp(file: &StateFile) -> Option<Stamp> {
    let m = std::fs::metadata(file.path()).ok()?;
    // Which devices this process sees changes with the device nodes (a new MIG device's
    // capability nodes appear after the state): the folders' change times are part of it.
    let mut dirs = [(0, 0); 2];
    if let Some(dev) = file.dev_dir() {
        for (slot, dir) in dirs.iter_mut().zip([dev.clone(), dev.join("nvidia-caps")]) {
            if let Ok(d) = std::fs::metadata(dir) {
                *slot = (d.mtime(), d.mtime_nsec());
            }
        }
    }
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: m.mtime(),
        mtime_ns: m.mtime_nsec(),
        dev_dirs: dirs,
    })
}

/// `nvmlInit`: finds the state file on the first call, checks the driver's versions, then
/// counts one more reference. `DRIVER_NOT_LOADED` when no simulated host can be found.
pub(super) fn init() -> Result<(), NvmlReturn> {
    let mut lib = lock(&LIB);
    if lib.file.is_none() {
        let file = state::locate(own_path().as_deref()).map_err(|_| ret::DRIVER_NOT_LOADED)?;
        lib.file = Some(file);
    }
    if let Some(file) = &lib.file {
        // Unreadable state is left to the calls to report, as before.
        if let Ok(st) = file.load() {
            check_driver(&st)?;
        }
    }
    lib.refcount += 1;
    Ok(())
}

/// `nvmlShutdown`: drops one reference; the last one also drops the cached state.
pub(super) fn shutdown() -> Result<(), NvmlReturn> {
    let mut lib = lock(&LIB);
    if lib.refcount == 0 {
        return Err(ret::UNINITIALIZED);
    }
    lib.refcount -= 1;
    if lib.refcount == 0 {
        lib.cache = None;
    }
    Ok(())
}

/// The state file, while the library is initialised.
pub(super) fn state_file() -> Result<StateFile, NvmlReturn> {
    // Changes go through the same driver checks as reads.
    state()?;
    let lib = lock(&LIB);
    if lib.refcount == 0 {
        return Err(ret::UNINITIALIZED);
    }
    lib.file.clone().ok_or(ret::UNINITIALIZED)
}

/// The state folder (`etc/gpu-sim`) of the state file, while the library is initialised:
/// what the processes of this node register with ([`crate::processes`]).
pub(super) fn state_dir() -> Result<PathBuf, NvmlReturn> {
    let lib = lock(&LIB);
    if lib.refcount == 0 {
        return Err(ret::UNINITIALIZED);
    }
    let file = lib.file.as_ref().ok_or(ret::UNINITIALIZED)?;
    Ok(file
        .path()
        .parent()
        .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf))
}

/// The current state (re-read when the file changed).
pub(super) fn state() -> Result<Arc<State>, NvmlReturn> {
    let mut lib = lock(&LIB);
    if lib.refcount == 0 {
        return Err(ret::UNINITIALIZED);
    }
    let file = lib.file.clone().ok_or(ret::UNINITIALIZED)?;
    let now = stamp(&file);
    if let (Some(now), Some((old, st))) = (now, &lib.cache)
        && now == *old
    {
        check_driver(st)?;
        return Ok(st.clone());
    }
    let st = Arc::new(file.load_visible().map_err(|_| ret::UNKNOWN)?);
    if let Some(now) = now {
        lib.cache = Some((now, st.clone()));
    }
    check_driver(&st)?;
    Ok(st)
}

/// Applies `f` to the state file under its exclusive lock.
pub(super) fn update(
    f: impl FnOnce(&mut State) -> Result<(), NvmlReturn>,
) -> Result<(), NvmlReturn> {
    state_file()?.update(f).map_err(|e| match e {
        crate::SimError::NotPermitted { .. } => ret::NO_PERMISSION,
        _ => ret::UNKNOWN,
    })?
}

/// The cost given to every call ([`crate::state::ENV_CALL_DELAY_US`]), read once.
fn call_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var(crate::state::ENV_CALL_DELAY_US)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|us| *us > 0)
            .map(std::time::Duration::from_micros)
    })
}

/// Runs an export body, mapping `Err(code)` to the code and a panic to `UNKNOWN`. With a
/// call delay set, first spends that long: busy, as a real driver's ioctl keeps a CPU busy,
/// and because a sleep this short would overshoot by the timer slack.
pub(super) fn guard(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    if let Some(delay) = call_delay() {
        let start = std::time::Instant::now();
        while start.elapsed() < delay {
            std::hint::spin_loop();
        }
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => ret::SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => ret::UNKNOWN,
    }
}
