//! The state file: where it is, and reading and updating it under a lock.
//!
//! Reads take a shared `flock` on a sibling lock file, updates an exclusive one and replace
//! the file atomically (see the parent module for why the lock is on a separate file). A
//! process finds its state file through [`locate`]: `GPU_SIM_STATE`, else walking up from
//! the library's or executable's own path.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use super::{ChangeCounter, ENV_PROFILE, ENV_STATE, STATE_RELATIVE, State};
use crate::SimError;
use crate::profile::Profile;

/// The state file of one simulated host.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// A handle on the state file at `path` (nothing is read yet).
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    /// The state file under a simulated root.
    pub fn under_root(root: &Path) -> StateFile {
        StateFile::new(root.join(STATE_RELATIVE))
    }

    /// The state file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".lock");
        PathBuf::from(p)
    }

    fn io(&self, path: &Path) -> impl FnOnce(std::io::Error) -> SimError {
        let path = path.to_path_buf();
        move |source| SimError::Io { path, source }
    }

    /// Opens the lock file for an exclusive lock and for counting changes (which maps it
    /// shared, for reading and writing).
    fn open_lock(&self) -> Result<File, SimError> {
        let lock = self.lock_path();
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock)
            .map_err(self.io(&lock))
    }

    /// The simulated root this file belongs to, when it sits at `<root>/etc/gpu-sim/state.json`
    /// (`/` inside a container, where the node's `etc/gpu-sim` is mounted at `/etc/gpu-sim`).
    pub fn root(&self) -> Option<PathBuf> {
        let mut p = self.path.clone();
        if !p.ends_with(STATE_RELATIVE) {
            return None;
        }
        for _ in 0..3 {
            p.pop();
        }
        Some(p)
    }

    /// The `dev/` folder whose nodes decide what this process sees (see the module doc), if
    /// there is one; without it (a bare state file) every device is visible.
    pub fn dev_dir(&self) -> Option<PathBuf> {
        self.root().map(|r| r.join("dev")).filter(|d| d.is_dir())
    }

    /// Reads the state as this process sees it: [`State::visible`] through [`Self::dev_dir`].
    pub fn load_visible(&self) -> Result<State, SimError> {
        let state = self.load()?;
        Ok(match self.dev_dir() {
            Some(dev) => state.visible(|name| dev.join(name).exists()),
            None => state,
        })
    }

    /// Opens the lock file for a shared lock: read-only when it exists, so that a state
    /// folder mounted read-only (as in containers) can still be read.
    fn open_lock_shared(&self) -> Result<File, SimError> {
        match File::open(self.lock_path()) {
            Ok(f) => Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.open_lock(),
            Err(e) => Err(SimError::Io {
                path: self.lock_path(),
                source: e,
            }),
        }
    }

    /// Reads the state under a shared lock.
    pub fn load(&self) -> Result<State, SimError> {
        let lock = self.open_lock_shared()?;
        lock.lock_shared().map_err(self.io(&self.lock_path()))?;
        let text = std::fs::read_to_string(&self.path).map_err(self.io(&self.path));
        // The lock is released when `lock` is dropped.
        let text = text?;
        self.parse(&text)
    }

    fn parse(&self, text: &str) -> Result<State, SimError> {
        serde_json::from_str(text).map_err(|e| SimError::InvalidState {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// Writes `state` as the new content (creating parent directories), under the
    /// exclusive lock.
    pub fn create(&self, state: &State) -> Result<(), SimError> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(self.io(dir))?;
        }
        let lock = self.open_lock()?;
        lock.lock().map_err(self.io(&self.lock_path()))?;
        self.write_atomic(state)?;
        count_change(&lock);
        Ok(())
    }

    /// The change counter of this state, for a process that waits for the state to change,
    /// or `None` when there is none to wait on (see [`ChangeCounter::for_waiter`]).
    pub fn change_counter(&self) -> Option<ChangeCounter> {
        ChangeCounter::for_waiter(&File::open(self.lock_path()).ok()?)
    }

    /// Applies `f` to the state under the exclusive lock and writes the result back if `f`
    /// succeeds. Returns what `f` returned.
    pub fn update<T, E>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T, E>,
    ) -> Result<Result<T, E>, SimError> {
        let lock = self.open_lock()?;
        lock.lock().map_err(self.io(&self.lock_path()))?;
        let text = std::fs::read_to_string(&self.path).map_err(self.io(&self.path))?;
        let mut state = self.parse(&text)?;
        if let Some(dev) = self.dev_dir()
            && state.visible(|name| dev.join(name).exists()) != state
        {
            return Err(SimError::NotPermitted {
                path: self.path.clone(),
                dev,
            });
        }
        let before = state.clone();
        let out = f(&mut state);
        if out.is_ok() && state != before {
            self.write_atomic(&state)?;
            count_change(&lock);
        }
        Ok(out)
    }

    /// Replaces the file with `state`; the caller holds the exclusive lock. The lock is on
    /// the sibling lock file, not on the state file, so replacing the state file by a rename
    /// keeps every other process's lock meaningful.
    fn write_atomic(&self, state: &State) -> Result<(), SimError> {
        let mut text = serde_json::to_vec_pretty(state).map_err(|e| SimError::InvalidState {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        text.push(b'\n');
        if let (Some(dir), Some(name)) = (self.path.parent(), self.path.file_name()) {
            // Temps of processes killed mid-write go (no writer holds them any more).
            gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy());
        }
        // 0o666 less the umask: the mode `File::create` gave the file before.
        gpu_dra_fsutil::write_atomic(&self.path, &text, 0o666).map_err(self.io(&self.path))
    }
}

/// Counts a change of the state in its lock file `lock` (held exclusively), waking the
/// processes waiting for one. The state is written whatever happens here: a counter that
/// cannot be mapped leaves waiters to notice the change at their next re-read.
fn count_change(lock: &File) {
    if let Ok(counter) = ChangeCounter::for_writer(lock) {
        counter.count();
    }
}

/// Finds the state file for a process: `GPU_SIM_STATE` (created from `GPU_SIM_PROFILE`
/// when missing), else the first `etc/gpu-sim/state.json` found walking up from `anchor`
/// (the library's or executable's own path).
pub fn locate(anchor: Option<&Path>) -> Result<StateFile, SimError> {
    if let Some(path) = std::env::var_os(ENV_STATE).filter(|p| !p.is_empty()) {
        let file = StateFile::new(PathBuf::from(path));
        if !file.path().exists() {
            match std::env::var(ENV_PROFILE) {
                Ok(profile) if !profile.is_empty() => {
                    let state = State::from_profile(Profile::load(&profile)?);
                    file.create(&state)?;
                }
                _ => {
                    return Err(SimError::NoState {
                        searched: file.path().display().to_string(),
                    });
                }
            }
        }
        return Ok(file);
    }
    let Some(anchor) = anchor else {
        return Err(SimError::NoState {
            searched: format!("${ENV_STATE} (unset)"),
        });
    };
    let mut dir = anchor.parent();
    while let Some(d) = dir {
        let candidate = d.join(STATE_RELATIVE);
        if candidate.is_file() {
            return Ok(StateFile::new(candidate));
        }
        dir = d.parent();
    }
    Err(SimError::NoState {
        searched: format!(
            "${ENV_STATE} (unset) and {STATE_RELATIVE} above {}",
            anchor.display()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_is_persisted_and_failed_update_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let r: Result<(), ()> = file
            .update(|s| {
                s.gpus[0].timeslice = 2;
                Ok(())
            })
            .expect("update");
        assert!(r.is_ok());
        assert_eq!(file.load().expect("load").gpus[0].timeslice, 2);
        let r: Result<(), &str> = file
            .update(|s| {
                s.gpus[0].timeslice = 3;
                Err("no")
            })
            .expect("update");
        assert_eq!(r, Err("no"));
        assert_eq!(file.load().expect("load").gpus[0].timeslice, 2);
    }

    #[test]
    fn concurrent_updates_are_not_lost() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                // Each thread opens its own lock file description, like separate processes.
                let file = file.clone();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        file.update(|s| {
                            s.generation += 1;
                            Ok::<(), ()>(())
                        })
                        .expect("update")
                        .expect("ok");
                        let _ = file.load().expect("readers never see a torn file");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        assert_eq!(file.load().expect("load").generation, 100);
    }

    #[test]
    fn load_visible_follows_the_dev_folder_and_update_refuses_a_partial_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(
            Profile::load("dgx-h100").expect("h100"),
        ))
        .expect("create");
        // No dev folder: a bare state file shows everything.
        assert_eq!(file.load_visible().expect("load").gpus.len(), 8);
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).expect("dev");
        for m in [1, 3] {
            std::fs::write(dev.join(format!("nvidia{m}")), b"").expect("node");
        }
        let v = file.load_visible().expect("load");
        assert_eq!(
            v.profile.gpus.iter().map(|g| g.minor).collect::<Vec<_>>(),
            [1, 3]
        );
        assert_eq!(file.load().expect("raw").gpus.len(), 8, "load stays raw");
        let err = file
            .update(|s| {
                s.gpus[0].timeslice = 1;
                Ok::<(), ()>(())
            })
            .expect_err("partial view");
        assert!(matches!(err, SimError::NotPermitted { .. }), "{err}");
        assert_eq!(file.load().expect("raw").gpus[0].timeslice, 0);
        for m in 0..8 {
            std::fs::write(dev.join(format!("nvidia{m}")), b"").expect("node");
        }
        file.update(|s| {
            s.gpus[0].timeslice = 1;
            Ok::<(), ()>(())
        })
        .expect("whole view")
        .expect("applied");
        assert_eq!(file.load_visible().expect("load").gpus[0].timeslice, 1);
    }

    #[test]
    fn load_works_on_a_read_only_state_folder() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let folder = file.path().parent().expect("folder").to_path_buf();
        let lock = folder.join("state.json.lock");
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o444)).expect("chmod");
        // Root ignores file modes, so this checks that the lock is opened read-only: a
        // read-write open of a read-only file fails for everyone else.
        let f = File::open(&lock).expect("read-only open");
        drop(f);
        assert_eq!(file.load().expect("load").profile.name, "t4");
        assert_eq!(file.root().as_deref(), Some(dir.path()));
        assert_eq!(StateFile::new("/x/state.json").root(), None);
    }

    #[test]
    fn locate_walks_up_from_the_anchor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let lib = dir
            .path()
            .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        // Only meaningful when GPU_SIM_STATE is not set in the test environment.
        if std::env::var_os(ENV_STATE).is_none() {
            let found = locate(Some(&lib)).expect("found");
            assert_eq!(found.path(), file.path());
            let err = locate(Some(Path::new("/nonexistent/lib.so"))).expect_err("none");
            assert!(err.to_string().contains("state.json"), "{err}");
        }
    }
}
