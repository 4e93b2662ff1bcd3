//! Processes using the simulated GPUs: what the kernel driver knows of each CUDA context (its
//! PID, the device it runs on, the memory it holds, the share of the SMs it keeps busy), which
//! NVML reports through `nvmlDeviceGetComputeRunningProcesses`, `nvmlDeviceGetProcessUtilization`,
//! `nvmlDeviceGetUtilizationRates` and `nvmlDeviceGetMemoryInfo`.
//!
//! The problem: a CUDA program runs in a container, which sees the node's state folder
//! read-only and has PID and mount namespaces of its own, while NVML is asked from another
//! namespace (the plugin's, the host's) and must answer with PIDs of that namespace. The
//! kernel knows both; the simulator has no kernel part. So a program registers as the kernel
//! would see it, through two things the kernel itself translates:
//! - it writes a [`ProcessRecord`] into a file of its own `/dev/shm` (writable in every
//!   container, private to it) and holds an exclusive `flock` on that file while it runs;
//! - a reader lists `/proc/locks`, where the kernel shows each lock's holder with its PID in
//!   the reader's PID namespace and the file's device and inode, and reads the record through
//!   `/proc/<pid>/root/dev/shm`, matching the inode.
//!
//! Invariants: a record counts only while its lock is held, so a process that exits (or is
//! killed) vanishes from the answers at once, whatever happens to its file; a record names the
//! state folder its process uses, and a reader keeps only those whose folder is its own (the
//! same directory, by device and inode, seen through the process's root), so several
//! simulated nodes on one machine never see each other's processes.
//!
//! Alternatives rejected: records in the shared state file (containers mount it read-only,
//! and a PID written by the process is of its own namespace); a registry daemon on a socket
//! (a process that must run on every simulated node, for every test).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::SimError;

/// Prefix of the record files in a process's `/dev/shm`.
pub const RECORD_PREFIX: &str = "gpu-sim-process-";

/// What a process using a GPU tells the simulated driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessRecord {
    /// The state folder (`etc/gpu-sim`) this process uses, as a path in its own mount
    /// namespace (`/etc/gpu-sim` in a container).
    pub state_dir: PathBuf,
    /// The device it runs on: a GPU UUID, or a MIG device's UUID.
    pub uuid: String,
    /// Device memory it holds, in bytes.
    pub used_bytes: u64,
    /// Percentage of the device's SMs it keeps busy (0 to 100).
    pub sm_percent: u32,
    /// It runs as a client of an MPS server.
    #[serde(default)]
    pub mps: bool,
}

/// A registered process: its record file stays locked until this is dropped (or the process
/// ends), and is removed on drop.
#[derive(Debug)]
pub struct Registration {
    _file: File,
    path: PathBuf,
}

impl Registration {
    /// The record file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Registers this process with `record`, in `shm_dir` (`/dev/shm` for programs; a test may
/// pick another folder of the same machine). The lock is taken before the record is written
/// completely, so a reader that sees the lock may find a partial record: it skips it.
pub fn register(record: &ProcessRecord, shm_dir: &Path) -> Result<Registration, SimError> {
    let path = shm_dir.join(format!("{RECORD_PREFIX}{}.json", std::process::id()));
    let io = |source| SimError::Io {
        path: path.clone(),
        source,
    };
    let mut file = File::create(&path).map_err(io)?;
    file.lock().map_err(io)?;
    let json = serde_json::to_vec(record).map_err(|e| SimError::InvalidArgument {
        field: "process record".into(),
        message: e.to_string(),
    })?;
    file.write_all(&json).map_err(io)?;
    file.flush().map_err(io)?;
    Ok(Registration { _file: file, path })
}

/// A process running on a device of this node, as a reader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningProcess {
    /// Its PID in the reader's PID namespace.
    pub pid: u32,
    /// What it registered.
    pub record: ProcessRecord,
}

/// The processes registered with the state folder `state_dir` (a path of this process), read
/// through the procfs at `proc_root` (`/proc`). Unreadable entries are skipped: a process may
/// exit while it is being read.
pub fn running(proc_root: &Path, state_dir: &Path) -> Vec<RunningProcess> {
    let Ok(locks) = std::fs::read_to_string(proc_root.join("locks")) else {
        return Vec::new();
    };
    running_with_locks(&locks, proc_root, state_dir, &mut Verdicts::default())
}

/// What earlier readings found of each lock still held: whether its file is a record of this
/// node, and which. A held lock's holder, file and record do not change while it is held (a
/// record is written before its process uses a GPU and stays as it is), so a reading looks
/// only at locks it has not seen before. Kept by a caller that reads often, for one
/// `state_dir`.
#[derive(Default)]
pub struct Verdicts {
    by_lock: std::collections::HashMap<HeldLock, Option<RunningProcess>>,
}

/// [`running`] with the text of `/proc/locks` already read, and what earlier readings found.
///
/// What it costs grows with the machine's new locks, not with its files or its old locks:
/// `/proc/locks` lists every `flock` of the machine (on a machine with many simulated nodes,
/// every plugin's own locks too, and the locks a state update takes for a moment); a lock
/// seen before costs a lookup in `verdicts`; a new one is matched by its file's device
/// against the holder's `/dev/shm` (one `stat`), and only a lock held on a file there leads
/// to reading that folder, once per folder and reading however many holders share it (every
/// process of the host shares the host's).
pub fn running_with_locks(
    locks: &str,
    proc_root: &Path,
    state_dir: &Path,
    verdicts: &mut Verdicts,
) -> Vec<RunningProcess> {
    let Ok(ours) = std::fs::metadata(state_dir) else {
        return Vec::new();
    };
    let held: Vec<HeldLock> = locks.lines().filter_map(parse_lock).collect();
    let still: std::collections::HashSet<&HeldLock> = held.iter().collect();
    verdicts.by_lock.retain(|lock, _| still.contains(lock));
    let mut folders = ShmFolders::default();
    let mut out = Vec::new();
    for lock in &held {
        let verdict = match verdicts.by_lock.get(lock) {
            Some(known) => known.clone(),
            None => match judge(lock, proc_root, &ours, &mut folders) {
                Some(verdict) => {
                    verdicts.by_lock.insert(lock.clone(), verdict.clone());
                    verdict
                }
                // Read again next time: a record being written, a process exiting.
                None => None,
            },
        };
        out.extend(verdict);
    }
    out.sort_by_key(|p| p.pid);
    out.dedup_by_key(|p| p.pid);
    out
}

/// What a lock is, for as long as it is held: `Some(Some(process))` when the locked file is a
/// process's record naming the state folder `ours`, `Some(None)` when it is not (another
/// file, another node's record), `None` when that cannot be told yet (a record still being
/// written, a process exiting).
fn judge(
    lock: &HeldLock,
    proc_root: &Path,
    ours: &std::fs::Metadata,
    folders: &mut ShmFolders,
) -> Option<Option<RunningProcess>> {
    let root = proc_root.join(lock.pid.to_string()).join("root");
    let record = match folders.record(&root.join("dev/shm"), lock) {
        Found::Record(record) => record,
        Found::NotARecord => return Some(None),
        Found::Unreadable => return None,
    };
    let theirs = root.join(
        record
            .state_dir
            .strip_prefix("/")
            .unwrap_or(&record.state_dir),
    );
    let theirs = std::fs::metadata(&theirs).ok()?;
    let same = theirs.dev() == ours.dev() && theirs.ino() == ours.ino();
    Some(same.then_some(RunningProcess {
        pid: lock.pid,
        record,
    }))
}

/// What the file behind a lock is.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    /// A process's record.
    Record(ProcessRecord),
    /// Not a record: a file elsewhere, or one of the folder that is no record.
    NotARecord,
    /// A record file that does not read (yet), or a folder that cannot be looked at.
    Unreadable,
}

/// A held `flock` of `/proc/locks`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HeldLock {
    /// The holder's PID in the reader's PID namespace.
    pid: u32,
    /// The locked file's device, as the kernel prints it (major and minor numbers).
    major: u32,
    minor: u32,
    /// The locked file's inode.
    inode: u64,
}

/// The held `flock` of a line of `/proc/locks` (`1: FLOCK  ADVISORY  WRITE 26577 00:1b:2 0 EOF`:
/// holder, then `major:minor:inode` with the device numbers in hex); waiters
/// (`-> FLOCK ...`) and other lock kinds give `None`.
fn parse_lock(line: &str) -> Option<HeldLock> {
    let mut fields = line.split_whitespace();
    let _id = fields.next()?;
    if fields.next()? != "FLOCK" {
        return None;
    }
    let _advisory = fields.next()?;
    if fields.next()? != "WRITE" {
        return None;
    }
    let pid = fields.next()?.parse().ok()?;
    let mut file = fields.next()?.split(':');
    let major = u32::from_str_radix(file.next()?, 16).ok()?;
    let minor = u32::from_str_radix(file.next()?, 16).ok()?;
    let inode = file.next()?.parse().ok()?;
    Some(HeldLock {
        pid,
        major,
        minor,
        inode,
    })
}

/// The record files of each `/dev/shm` folder one reading has looked into, by inode, so a
/// folder that several holders share is listed once.
#[derive(Default)]
struct ShmFolders {
    /// By the folder's device and inode: its record files' inodes and paths.
    listed: std::collections::HashMap<(u64, u64), Vec<(u64, PathBuf)>>,
}

impl ShmFolders {
    /// What the file `lock` holds is, looked for in `dir`.
    fn record(&mut self, dir: &Path, lock: &HeldLock) -> Found {
        let Ok(folder) = std::fs::metadata(dir) else {
            return Found::Unreadable;
        };
        // A file of this folder lives on the folder's file system (`/dev/shm` is a tmpfs
        // mount, or a folder of the container's root): a lock on another device is not a
        // record, and costs no listing.
        let dev = folder.dev();
        if (libc::major(dev), libc::minor(dev)) != (lock.major, lock.minor) {
            return Found::NotARecord;
        }
        let files = self
            .listed
            .entry((dev, folder.ino()))
            .or_insert_with(|| record_files(dir));
        // A record's file exists before its process locks it, so a locked file missing
        // from the listing is none.
        let Some((_, path)) = files.iter().find(|(inode, _)| *inode == lock.inode) else {
            return Found::NotARecord;
        };
        std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .map_or(Found::Unreadable, Found::Record)
    }
}

/// The record files of `dir`, with their inodes.
fn record_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(RECORD_PREFIX))
        .filter_map(|e| Some((e.metadata().ok()?.ino(), e.path())))
        .collect()
}

/// A memory amount as `cuda-app --hold-memory` takes it: bytes, or a number with a
/// Kubernetes binary or decimal suffix (`512Mi`, `2Gi`, `1G`).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of a process on `uuid` using the state folder `state_dir`.
    fn record_of(state_dir: &Path, uuid: &str, used_bytes: u64, sm_percent: u32) -> ProcessRecord {
        ProcessRecord {
            state_dir: state_dir.to_path_buf(),
            uuid: uuid.into(),
            used_bytes,
            sm_percent,
            mps: false,
        }
    }

    #[test]
    fn lock_lines_give_holder_and_inode() {
        assert_eq!(
            parse_lock("1: FLOCK  ADVISORY  WRITE 26577 00:1b:2 0 EOF"),
            Some(HeldLock {
                pid: 26577,
                major: 0,
                minor: 0x1b,
                inode: 2
            })
        );
        assert_eq!(
            parse_lock("4: FLOCK  ADVISORY  WRITE 7 fe:01:10051587 0 EOF"),
            Some(HeldLock {
                pid: 7,
                major: 0xfe,
                minor: 1,
                inode: 10051587
            })
        );
        assert_eq!(parse_lock("5: FLOCK  ADVISORY  WRITE 7 fe:01 0 EOF"), None);
        assert_eq!(
            parse_lock("2: FLOCK  ADVISORY  READ 26338 fe:00:10051587 0 EOF"),
            None
        );
        assert_eq!(
            parse_lock("3: POSIX  ADVISORY  WRITE 1 fe:00:7 0 EOF"),
            None
        );
        assert_eq!(
            parse_lock("1: -> FLOCK  ADVISORY  WRITE 9 00:1b:2 0 EOF"),
            None
        );
    }

    #[test]
    fn a_lock_on_another_file_system_is_no_record_and_lists_nothing() {
        // A folder of its own on the machine's /dev/shm: the other test registers this
        // process in /dev/shm itself, under the same name.
        let folder = tempfile::tempdir_in("/dev/shm").expect("tmp");
        let shm = folder.path();
        let node = tempfile::tempdir().expect("tmp");
        let record = record_of(node.path(), "GPU-test", 1 << 30, 10);
        let reg = register(&record, shm).expect("register");
        let inode = std::fs::metadata(reg.path()).expect("stat").ino();
        let dev = std::fs::metadata(shm).expect("stat").dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let mut folders = ShmFolders::default();
        let elsewhere = HeldLock {
            pid: std::process::id(),
            major,
            minor: minor.wrapping_add(1),
            inode,
        };
        assert_eq!(folders.record(shm, &elsewhere), Found::NotARecord);
        assert!(folders.listed.is_empty(), "no folder was listed");
        let here = HeldLock { minor, ..elsewhere };
        assert_eq!(folders.record(shm, &here), Found::Record(record));
        assert_eq!(folders.listed.len(), 1);
    }

    #[test]
    fn a_record_still_being_written_is_read_again_at_the_next_reading() {
        let node = tempfile::tempdir().expect("tmp");
        let path = Path::new("/dev/shm").join(format!(
            "{RECORD_PREFIX}{}-partial.json",
            std::process::id()
        ));
        let mut file = File::create(&path).expect("create");
        file.lock().expect("lock");
        file.write_all(b"{\"stateDir\":").expect("write");
        let proc_root = Path::new("/proc");
        let locks = || std::fs::read_to_string("/proc/locks").expect("/proc/locks");
        let mut verdicts = Verdicts::default();
        let before = running_with_locks(&locks(), proc_root, node.path(), &mut verdicts);
        let record = record_of(node.path(), "GPU-partial", 1 << 20, 5);
        std::fs::write(&path, serde_json::to_vec(&record).expect("json")).expect("complete");
        let after = running_with_locks(&locks(), proc_root, node.path(), &mut verdicts);
        drop(file);
        std::fs::remove_file(&path).expect("remove");
        assert!(before.is_empty(), "{before:?}");
        assert_eq!(
            after,
            vec![RunningProcess {
                pid: std::process::id(),
                record
            }]
        );
    }

    #[test]
    fn memory_amounts_take_kubernetes_suffixes() {
        assert_eq!(parse_bytes("2Gi"), Some(2 << 30));
        assert_eq!(parse_bytes("512Mi"), Some(512 << 20));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("2 GB"), None);
        assert_eq!(parse_bytes("Gi"), None);
    }

    #[test]
    fn a_registered_process_is_seen_while_it_holds_its_record_and_only_by_its_node() {
        let node = tempfile::tempdir().expect("tmp");
        let other = tempfile::tempdir().expect("tmp");
        // Records live in the process's /dev/shm, which the reader finds through
        // /proc/<pid>/root: this process's is the machine's.
        let shm = Path::new("/dev/shm");
        let record = record_of(node.path(), "GPU-test", 3 << 30, 40);
        let reg = register(&record, shm).expect("register");
        let seen = running(Path::new("/proc"), node.path());
        assert_eq!(
            seen,
            vec![RunningProcess {
                pid: std::process::id(),
                record: record.clone()
            }]
        );
        assert!(running(Path::new("/proc"), other.path()).is_empty());
        let path = reg.path().to_path_buf();
        drop(reg);
        assert!(
            !path.exists(),
            "the record is removed with the registration"
        );
        assert!(running(Path::new("/proc"), node.path()).is_empty());
    }
}
