//! Crash-safe file writes: temp file in the same directory, fsync, rename, fsync directory.
//!
//! After a crash at any point the target is either the old complete file or the new
//! complete file, never a torn one; a leftover temp file (`.<name>.tmp-<pid>`) is ignored by
//! readers and replaced by the next write.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Atomically replaces `path` with `bytes`, file mode `mode`.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `path` and syncs its directory; a missing file is not an error.
pub fn remove_durable(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    File::open(dir)?.sync_all()
}

/// Removes temp files that [`write_atomic`] left in `dir` for targets starting with `prefix`
/// when a process died mid-write. Temp files of this process are kept (a write may be in
/// flight). Returns how many were removed.
pub fn remove_stale_temps(dir: &Path, prefix: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let own = format!(".tmp-{}", std::process::id());
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name
            .strip_prefix('.')
            .is_some_and(|n| n.starts_with(prefix) && n.contains(".tmp-"));
        if ours && !name.ends_with(&own) && fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        write_atomic(&path, b"one", 0o600).expect("write");
        write_atomic(&path, b"two", 0o600).expect("rewrite");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("e").file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        remove_durable(&path).expect("remove");
        remove_durable(&path).expect("remove again is fine");
        assert!(!path.exists());

        std::fs::write(dir.path().join(".a.json.tmp-1"), "x").expect("stale temp");
        std::fs::write(
            dir.path()
                .join(format!(".a.json.tmp-{}", std::process::id())),
            "x",
        )
        .expect("own temp");
        std::fs::write(dir.path().join(".other.tmp-1"), "x").expect("foreign");
        assert_eq!(remove_stale_temps(dir.path(), "a.json"), 1);
        assert_eq!(fs::read_dir(dir.path()).expect("ls").count(), 2);
    }
}
