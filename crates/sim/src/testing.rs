//! Test support for other crates: a simulated host in a temporary directory.
//!
//! Behind the `testing` feature, which crates enable from `[dev-dependencies]` only, so the
//! simulator's library and tools carry no test harness.
//!
//! `SimHost::new("dgx-a100-40gb")` makes sure the simulator libraries and tools are built
//! (once per process: `$CARGO build -p gpu-dra-sim -p gpu-dra-sim-cuda`, env `CARGO` being
//! set by `cargo test`),
//! then runs the same setup as `gpu-sim setup` into a fresh temp dir. The directory is
//! removed when the `SimHost` is dropped.
//!
//! The build goes to the target directory of the running test, derived from the test
//! executable's path `<target>/<profile>/deps/<test>` (which reflects `CARGO_TARGET_DIR`),
//! with the same cargo profile.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::SimError;
use crate::profile::Profile;
use crate::setup::{self, Artefacts};
use crate::state::{State, StateFile};

/// A simulated host under a temporary root.
#[derive(Debug)]
pub struct SimHost {
    dir: tempfile::TempDir,
    profile: Profile,
}

static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// The cargo profile directory of the running executable (`target/debug`).
fn profile_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // <target>/<profile>/deps/<test>, <target>/<profile>/examples/<bench> or
    // <target>/<profile>/<bin>.
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir
        .file_name()
        .is_some_and(|n| n == "deps" || n == "examples")
    {
        dir.pop();
    }
    // The executable's directory is authoritative: cargo put this build there, so it
    // already reflects `CARGO_TARGET_DIR` (whose value, if relative, would be relative to a
    // directory this process does not know).
    Ok(dir)
}

/// Builds the simulator package into the running test's target directory (once per
/// process) and returns the cargo profile directory holding the artefacts.
pub fn ensure_built() -> Result<PathBuf, SimError> {
    BUILT
        .get_or_init(|| {
            let dir = profile_dir()?;
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "gpu-dra-sim",
                "-p",
                "gpu-dra-sim-cuda",
                "--lib",
                "--bins",
            ]);
            match dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") | None => {}
                Some("release") => {
                    cmd.arg("--release");
                }
                Some(other) => {
                    cmd.args(["--profile", other]);
                }
            }
            if let Some(target) = dir.parent() {
                cmd.env("CARGO_TARGET_DIR", target);
            }
            let out = cmd.output().map_err(|e| format!("running cargo: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "cargo build -p gpu-dra-sim -p gpu-dra-sim-cuda failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(dir)
        })
        .clone()
        .map_err(|e| SimError::MissingArtefact {
            what: "gpu-dra-sim build".to_string(),
            searched: e,
        })
}

impl SimHost {
    /// A fresh simulated host for a built-in profile name or profile path.
    ///
    /// # Panics
    /// When the profile is unknown or the simulator cannot be built: this is test support,
    /// and a test cannot go on without its host. Use [`SimHost::try_new`] to handle errors.
    pub fn new(profile: &str) -> SimHost {
        match SimHost::try_new(profile) {
            Ok(h) => h,
            Err(e) => panic!("SimHost::new({profile:?}): {e}"),
        }
    }

    /// Like [`SimHost::new`], returning errors.
    pub fn try_new(profile: &str) -> Result<SimHost, SimError> {
        let profile = Profile::load(profile)?;
        SimHost::with_profile(profile)
    }

    /// A simulated host for an already loaded profile.
    pub fn with_profile(profile: Profile) -> Result<SimHost, SimError> {
        let dir = ensure_built()?;
        let artefacts = Artefacts::beside(&dir)?;
        let tmp = tempfile::Builder::new()
            .prefix("gpu-sim-")
            .tempdir()
            .map_err(|source| SimError::Io {
                path: std::env::temp_dir(),
                source,
            })?;
        setup::setup(tmp.path(), &profile, &artefacts)?;
        Ok(SimHost { dir: tmp, profile })
    }

    /// `<root>/<library folder>/libcuda.so.1`, the simulated CUDA driver library.
    pub fn libcuda_path(&self) -> PathBuf {
        self.root()
            .join(self.profile().driver_layout.lib_dir())
            .join("libcuda.so.1")
    }

    /// The simulated root (driver root, dev root and sysfs parent).
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// `<root>/<library folder>/libnvidia-ml.so.1` (`usr/lib/x86_64-linux-gnu` in the
    /// default layout).
    pub fn lib_path(&self) -> PathBuf {
        self.root()
            .join(self.profile().driver_layout.lib_dir())
            .join("libnvidia-ml.so.1")
    }

    /// `<root>/<tool folder>/<tool>` (`usr/bin` in the default layout).
    pub fn tool(&self, name: &str) -> PathBuf {
        self.root()
            .join(self.profile().driver_layout.bin_dir())
            .join(name)
    }

    /// `<root>/sys` (the sysfs root).
    pub fn sysfs_root(&self) -> PathBuf {
        self.root().join("sys")
    }

    /// The profile this host was made from.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The state file.
    pub fn state_file(&self) -> StateFile {
        StateFile::under_root(self.root())
    }

    /// Changes the host's state as other tests need (compute mode, MIG layout, ...), then
    /// brings the MIG capability files under `proc/` and `dev/` in line with it.
    ///
    /// # Panics
    /// When the state file cannot be read or written (test support).
    pub fn update_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let res = self
            .state_file()
            .update(|s| Ok::<T, std::convert::Infallible>(f(s)));
        let value = match res {
            Ok(Ok(v)) => v,
            Ok(Err(never)) => match never {},
            Err(e) => panic!("updating simulator state: {e}"),
        };
        if let Err(e) = setup::sync_mig_files(self.root(), &self.state()) {
            panic!("syncing MIG capability files: {e}");
        }
        value
    }

    /// Upgrades the host's driver in place to `version` ([`crate::upgrade`]), blocking for
    /// `window`; returns the state afterwards.
    ///
    /// # Panics
    /// When the upgrade fails (test support).
    pub fn upgrade_driver(
        &self,
        version: &str,
        style: crate::upgrade::UpgradeStyle,
        window: std::time::Duration,
    ) -> State {
        let upgrade = crate::upgrade::Upgrade {
            version: version.to_owned(),
            style,
            window,
        };
        let res = ensure_built()
            .and_then(|dir| Artefacts::beside(&dir))
            .and_then(|art| crate::upgrade::upgrade_driver(self.root(), &upgrade, &art));
        match res {
            Ok(st) => st,
            Err(e) => panic!("upgrading the simulated driver to {version}: {e}"),
        }
    }

    /// The current state (as other processes left it).
    ///
    /// # Panics
    /// When the state file is unreadable (test support).
    pub fn state(&self) -> State {
        match self.state_file().load() {
            Ok(s) => s,
            Err(e) => panic!("reading simulator state: {e}"),
        }
    }
}
