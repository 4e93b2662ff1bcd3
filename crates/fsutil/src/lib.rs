//! Crash-safe file writes on the node, the one implementation used by the node plugin
//! (checkpoint, CDI specs, sharing state) and the GPU simulator (its state file).
//!
//! [`write_atomic`] writes a temp file in the target's directory, fsyncs it, renames it over
//! the target and fsyncs the directory. After a crash at any point the target is either the
//! old complete file or the new complete file, never a torn one.
//!
//! [`replace_atomic`] and [`remove`] are the same without the directory fsync ([`replace_volatile`]
//! without any fsync, for content the next boot rewrites before it is trusted): the change is
//! atomic (no reader ever sees a torn file) but not yet durable, and becomes durable with the
//! next fsync of that directory or the filesystem's next commit. For files that another
//! durable record vouches for: a CDI spec is trusted only while the checkpoint (written with
//! [`write_atomic`]) says its claim is prepared in this boot, and a spec the checkpoint does
//! not name is removed as stray, so a power loss that undoes the rename or the unlink leaves
//! nothing that is acted on. The directory fsync is a journal commit on most filesystems, as
//! costly as the file's own, so leaving out the one that is not needed halves such a write.
//!
//! [`record_log`] is the cheaper durable commit for a stream of small changes: checksummed
//! records appended to a preallocated file with one `fdatasync` each, folded into a file
//! written with [`write_atomic`] from time to time.
//!
//! # Temp names
//!
//! A temp file is named `.<target>.tmp-<pid>-<seq>-<noise>`: the process id, a process-wide
//! counter and 64 bits hashed from the clock with a per-process random key. It is created
//! with `O_EXCL` and a new name is drawn if one exists. The PID alone is not enough: in a
//! container it is usually 1, so two plugin instances on one node (a rolling upgrade) would
//! otherwise write through the same temp file, and two threads of one process would too.
//! The leading dot and the suffix keep readers away: the kubelet and the container runtime
//! only read `*.json`/`*.yaml` specs, and our own readers only the target name.
//!
//! # Stale temps
//!
//! A process that dies mid-write leaves its temp file behind. [`remove_stale_temps`]
//! recognises temps by the leading dot, the target prefix and the `.tmp-` marker (names of
//! older versions, `.<target>.tmp-<pid>`, included) and removes those that no live writer
//! holds. A writer holds an exclusive `flock` on its temp file from just after creating it
//! until the rename is done; the kernel drops the lock when the writer's process dies, even
//! on SIGKILL. So a temp whose lock can be taken belongs to a dead process (or to a write
//! that already finished) and goes at once: a plugin restarted right after a crash finds a
//! clean directory. The lock works across PID namespaces (two plugin instances of a rolling
//! upgrade, in different pods), where a PID or an age could not tell a live writer from a
//! dead one.
//!
//! One window remains: between the writer's `O_EXCL` create and its lock, a cleaner may lock
//! and remove the fresh temp. The writer notices (after locking, the path no longer names
//! the inode it holds) and starts over with a new name, so the write still succeeds. A
//! temp removed under a live write for any other reason makes its rename fail with
//! `NotFound`: the write reports an error and the target keeps its old complete content.
//!
//! # Errors
//!
//! Functions return [`std::io::Error`], as `std::fs` does, rather than an error enum of this
//! crate: every caller already wraps I/O errors with the path and the operation in its own
//! error type, and a wrapper here would only add a layer without adding information.

pub mod record_log;

use std::collections::hash_map::RandomState;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Marks a temp file of [`write_atomic`]: `.<target>` + this + a unique suffix.
pub const TEMP_MARKER: &str = ".tmp-";

/// How many names [`write_atomic`] tries before giving up on `AlreadyExists`; each try
/// draws a new counter value, so a second collision needs another writer racing on exactly
/// the same name again.
const NAME_ATTEMPTS: u32 = 16;

/// Process-wide counter: temp names of one process never repeat.
static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// Atomically replaces `path` with `bytes`; a new file gets mode `mode` (less the umask).
///
/// The parent directory must exist. On error the target is unchanged (old content, or still
/// missing) and the temp file is removed.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_atomic_with(path, mode, |file| file.write_all(bytes))?;
    File::open(parent(path))?.sync_all()
}

/// Atomically replaces `path` with `bytes` like [`write_atomic`], without the fsync of the
/// directory: the content is on disk before the rename, but the rename itself may be lost
/// in a power loss (see the module documentation for when that is enough).
pub fn replace_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_atomic_with(path, mode, |file| file.write_all(bytes))
}

/// Atomically replaces `path` with `bytes` without any fsync: readers and a restarted
/// process see the old or the new content, never a torn file, but after a power loss the
/// file may be missing, old, or empty. Only for files that the next boot writes again before
/// anyone trusts them (a CDI spec of a claim prepared in another boot is prepared again).
pub fn replace_volatile(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_temp_and_rename(path, mode, |file| file.write_all(bytes))
}

/// Writes the content through `fill` into a fresh locked temp, fsyncs it and renames it over
/// `path`; the directory is not synced.
fn write_atomic_with(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    write_temp_and_rename(path, mode, |file| fill(file).and_then(|()| file.sync_all()))
}

/// Writes the content through `fill` into a fresh locked temp and renames it over `path`.
fn write_temp_and_rename(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let dir = parent(path);
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no file name", path.display()),
        )
    })?;
    let (tmp, mut file) = create_temp(dir, name, mode)?;
    let written = fill(&mut file);
    drop(file);
    if let Err(e) = written.and_then(|()| fs::rename(&tmp, path)) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}

/// Creates a new temp file for `target` in `dir` with `O_EXCL` and takes its writer lock,
/// drawing a new name when one is taken or when a cleaner removed the file before the lock.
fn create_temp(dir: &Path, target: &OsStr, mode: u32) -> io::Result<(PathBuf, File)> {
    let mut attempt = 1;
    loop {
        let tmp = dir.join(temp_name(target));
        let retry = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
        {
            Ok(file) => {
                file.lock()?;
                if still_named(&file, &tmp)? {
                    return Ok((tmp, file));
                }
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "temp file {} was removed before it was locked",
                        tmp.display()
                    ),
                )
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => e,
            Err(e) => return Err(e),
        };
        if attempt >= NAME_ATTEMPTS {
            return Err(retry);
        }
        attempt += 1;
    }
}

/// True when `path` still names the inode `file` has open.
fn still_named(file: &File, path: &Path) -> io::Result<bool> {
    let held = file.metadata()?;
    match fs::symlink_metadata(path) {
        Ok(named) => Ok(named.dev() == held.dev() && named.ino() == held.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// `.<target>.tmp-<pid>-<seq>-<noise>`.
fn temp_name(target: &OsStr) -> OsString {
    let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // `RandomState` keys come from the OS once per thread, so equal PIDs, counters and
    // clocks in two containers still give different names.
    let noise = RandomState::new().hash_one((nanos, seq));
    let mut name = OsString::from(".");
    name.push(target);
    name.push(format!(
        "{TEMP_MARKER}{}-{seq}-{noise:016x}",
        std::process::id()
    ));
    name
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Removes `path` and syncs its directory; a missing file is not an error.
pub fn remove_durable(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    File::open(parent(path))?.sync_all()
}

/// Removes `path` without syncing its directory (see the module documentation); a missing
/// file is not an error.
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Removes temp files that [`write_atomic`] left in `dir` for targets whose names start with
/// `prefix` and that no live writer holds (see the module documentation), so a write in
/// flight, of this or another process, keeps its temp. Returns how many were removed.
pub fn remove_stale_temps(dir: &Path, prefix: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        if !is_temp_of(&entry.file_name().to_string_lossy(), prefix) {
            continue;
        }
        // `DirEntry::file_type` does not follow symlinks: only our own plain files go.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        else {
            continue;
        };
        // Held by a live writer: leave it. Our lock is released when `file` drops, after
        // the removal, so a writer that locks next sees its name gone and starts over.
        if file.try_lock().is_ok() && fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn is_temp_of(name: &str, prefix: &str) -> bool {
    name.strip_prefix('.')
        .is_some_and(|n| n.starts_with(prefix) && n.contains(TEMP_MARKER))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn write_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        write_atomic(&path, b"one", 0o600).expect("write");
        write_atomic(&path, b"two", 0o600).expect("rewrite");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(names(dir.path()), ["a.json"]);
        remove_durable(&path).expect("remove");
        remove_durable(&path).expect("remove again is fine");
        assert!(!path.exists());
    }

    #[test]
    fn replace_and_remove_without_the_directory_sync_behave_alike() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("spec.json");
        replace_atomic(&path, b"one", 0o644).expect("write");
        replace_volatile(&path, b"two", 0o644).expect("rewrite");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        replace_atomic(&path, b"three", 0o644).expect("rewrite");
        assert_eq!(fs::read(&path).expect("read"), b"three");
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(names(dir.path()), ["spec.json"], "no temp file left");
        remove(&path).expect("remove");
        remove(&path).expect("remove again is fine");
        assert!(!path.exists());
        let missing = dir.path().join("no-such-dir/spec.json");
        replace_atomic(&missing, b"x", 0o644).expect_err("no folder");
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn temp_names_are_unique_and_marked() {
        let a = temp_name(OsStr::new("a.json"))
            .to_string_lossy()
            .into_owned();
        let b = temp_name(OsStr::new("a.json"))
            .to_string_lossy()
            .into_owned();
        assert_ne!(a, b);
        let pid = std::process::id();
        assert!(a.starts_with(&format!(".a.json.tmp-{pid}-")), "{a}");
        assert!(is_temp_of(&a, "a.json"));
        assert!(!is_temp_of(&a, "b.json"));
        // Never a name a spec reader picks up.
        assert!(!a.ends_with(".json") && !a.ends_with(".yaml"), "{a}");
    }

    #[test]
    fn concurrent_writers_never_collide_and_leave_a_complete_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        // Large enough that a torn or interleaved file would be caught by the readers.
        let content = |writer: u8, round: u8| vec![b'a' + writer; 64 * 1024 + usize::from(round)];
        write_atomic(&path, &content(0, 0), 0o600).expect("first");
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (path, done) = (path.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let bytes = fs::read(&path).expect("the target always exists");
                    assert!(bytes.len() >= 64 * 1024, "torn: {} bytes", bytes.len());
                    assert!(bytes.iter().all(|b| *b == bytes[0]), "mixed content");
                }
            })
        };
        let writers: Vec<_> = (0..4u8)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for round in 0..25u8 {
                        write_atomic(&path, &content(w, round), 0o600).expect("write");
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        done.store(true, Ordering::Relaxed);
        reader.join().expect("reader");
        let last = fs::read(&path).expect("read");
        assert!(
            (0..4u8).any(|w| last == content(w, 24)),
            "one writer's last content"
        );
        assert_eq!(names(dir.path()), ["state.json"], "no temp left");
    }

    #[test]
    fn a_write_failing_midway_leaves_no_temp_and_the_old_content() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        write_atomic(&path, b"old", 0o600).expect("write");

        // The content cannot be produced completely.
        let err = write_atomic_with(&path, 0o600, |file| {
            file.write_all(b"half")?;
            Err(io::Error::other("serializer failed"))
        })
        .expect_err("fails");
        assert_eq!(err.to_string(), "serializer failed");
        assert_eq!(fs::read(&path).expect("read"), b"old");
        assert_eq!(names(dir.path()), ["a.json"]);

        // The rename fails: the target is a non-empty directory.
        let blocked = dir.path().join("blocked");
        fs::create_dir_all(blocked.join("inside")).expect("dir");
        write_atomic(&blocked, b"new", 0o600).expect_err("rename onto a directory");
        assert_eq!(names(dir.path()), ["a.json", "blocked"]);
    }

    #[test]
    fn a_live_writer_keeps_its_temp_and_a_dead_one_loses_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        write_atomic(&path, b"old", 0o600).expect("write");
        // During a write the temp is locked: a cleaner leaves it alone and the write lands.
        write_atomic_with(&path, 0o600, |file| {
            file.write_all(b"new")?;
            assert_eq!(remove_stale_temps(dir.path(), "a.json"), 0, "live writer");
            Ok(())
        })
        .expect("write survives a cleaner");
        assert_eq!(fs::read(&path).expect("read"), b"new");
        // A temp nobody holds (its writer died: the kernel dropped the lock) goes at once.
        fs::write(dir.path().join(".a.json.tmp-1-0-00000000deadbeef"), "x").expect("temp");
        assert_eq!(remove_stale_temps(dir.path(), "a.json"), 1);
        assert_eq!(names(dir.path()), ["a.json"]);
    }

    #[test]
    fn a_temp_removed_before_its_lock_is_replaced_by_a_new_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join(".a.json.tmp-x");
        let file = File::create(&tmp).expect("create");
        assert!(still_named(&file, &tmp).expect("stat"));
        fs::remove_file(&tmp).expect("a cleaner removes it");
        assert!(!still_named(&file, &tmp).expect("stat"));
        File::create(&tmp).expect("another file under the name");
        assert!(!still_named(&file, &tmp).expect("stat"), "other inode");
    }

    #[test]
    fn stale_temps_are_removed_and_held_ones_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        for name in [
            "a.json",                               // the target itself
            ".a.json.tmp-1-0-00000000deadbeef",     // a dead writer
            ".a.json.tmp-1",                        // an older version's name
            ".a.json.tmp-77-0-0000000012345678",    // a live writer elsewhere (locked below)
            ".other.json.tmp-1-0-0000000000000001", // another prefix
            "a.json.tmp-1-0-0000000000000002",      // no leading dot: not ours
        ] {
            fs::write(d.join(name), "x").expect("file");
        }
        let live = File::open(d.join(".a.json.tmp-77-0-0000000012345678")).expect("open");
        live.lock().expect("the live writer's lock");
        fs::create_dir(d.join(".a.json.tmp-9-0-0000000000000003")).expect("dir"); // not a file
        std::os::unix::fs::symlink(d.join("a.json"), d.join(".a.json.tmp-5-0-0000000000000004"))
            .expect("symlink"); // not a plain file
        assert_eq!(remove_stale_temps(d, "a.json"), 2);
        assert_eq!(
            names(d),
            [
                ".a.json.tmp-5-0-0000000000000004",
                ".a.json.tmp-77-0-0000000012345678",
                ".a.json.tmp-9-0-0000000000000003",
                ".other.json.tmp-1-0-0000000000000001",
                "a.json",
                "a.json.tmp-1-0-0000000000000002",
            ]
        );
        assert_eq!(remove_stale_temps(d, "a.json"), 0, "the held one stays");
        drop(live);
        assert_eq!(remove_stale_temps(d, "a.json"), 1, "its writer is gone");
        assert_eq!(remove_stale_temps(&d.join("missing"), "a.json"), 0);
    }
}
