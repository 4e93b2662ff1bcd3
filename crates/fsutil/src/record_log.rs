//! An append-only log of checksummed records in a preallocated file: a durable commit that
//! costs one `fdatasync` of data blocks the file already owns, instead of the temp file,
//! fsync, rename and folder fsync of [`crate::write_atomic`].
//!
//! Why preallocated: appending past the end of a file changes its size, and `fdatasync` then
//! commits the inode too (a filesystem journal commit, most of what a durable small-file write
//! costs). Overwriting blocks that were written once (zeros at creation, not `fallocate`, whose
//! unwritten extents need a metadata change on first write) leaves the inode alone, so the
//! `fdatasync` flushes data only.
//!
//! # Layout
//!
//! A header of [`HEADER_LEN`] bytes: the magic `GDRAJRN1`, the generation (u64), the base
//! (u64: what the records extend, the caller's tag of its snapshot file) and a CRC-32 of those
//! 24 bytes. Then records, each `len` (u32), `crc` (u32) and `len` bytes of payload, where
//! `crc` is the CRC-32 of the generation, `len` and the payload; all integers little-endian.
//! The rest of the file is zeros or what earlier generations left.
//!
//! # Invariants
//!
//! - a record is durable when [`RecordLog::append`] returns `Ok`; appends never touch the
//!   header or a durable record;
//! - reading stops at the first record that is not whole and valid: a zero length (never
//!   written), a length past the end, or a CRC that does not match. A torn last record (a
//!   crash during its write, so its append never returned) is dropped this way, and so is the
//!   remainder of an earlier generation: its CRC covers its own generation;
//! - [`RecordLog::reset`] empties the log by writing a header with the next generation, so no
//!   record written before it is read again; the caller resets only once everything the
//!   records said is durable elsewhere (its snapshot), so a crash around the reset loses
//!   nothing. A header that does not check out (a torn reset) reads as an empty log, and its
//!   next reset zeroes the whole file first, as no generation can be trusted to be new then.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes of the header at the start of the file.
pub const HEADER_LEN: u64 = 32;
/// Bytes before each record's payload (length and CRC).
pub const RECORD_OVERHEAD: u64 = 8;
const MAGIC: &[u8; 8] = b"GDRAJRN1";

/// A record log open for appending.
pub struct RecordLog {
    path: PathBuf,
    file: File,
    capacity: u64,
    generation: u64,
    /// Where the next record goes.
    end: u64,
    /// The header did not check out: zero the file before the next generation.
    untrusted: bool,
}

/// What [`RecordLog::open`] found in the file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// The base of the current generation (`None`: no valid header, e.g. a file just created
    /// or a torn reset; then there are no records either).
    pub base: Option<u64>,
    /// The payloads of the whole, valid records of the current generation, in order.
    pub records: Vec<Vec<u8>>,
    /// Reading stopped at bytes that are not a valid record (a torn record, or what an
    /// earlier generation left) rather than at never-written zeros.
    pub invalid_tail: bool,
}

impl RecordLog {
    /// Opens the log at `path`, creating it (durably: [`crate::write_atomic`]) with
    /// `capacity` bytes of zeros and mode `mode` when missing, and reads its records. A file
    /// shorter than `capacity` is extended with zeros; a longer one keeps its length.
    pub fn open(path: &Path, capacity: u64, mode: u32) -> io::Result<(RecordLog, Replay)> {
        let capacity = capacity.max(HEADER_LEN + RECORD_OVERHEAD);
        if !path.exists() {
            let len = usize::try_from(capacity)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "capacity too large"))?;
            crate::write_atomic(path, &vec![0; len], mode)?;
        }
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        if len < capacity {
            zero(&file, len, capacity)?;
            file.sync_all()?;
        }
        let capacity = capacity.max(len);
        let bytes = std::fs::read(path)?;
        let (replay, end) = parse(&bytes);
        let log = RecordLog {
            path: path.to_owned(),
            file,
            capacity,
            generation: header(&bytes).map_or(0, |(generation, _)| generation),
            end,
            untrusted: replay.base.is_none() && bytes.iter().any(|&b| b != 0),
        };
        Ok((log, replay))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a record of `len` payload bytes fits after the records written so far.
    pub fn fits(&self, len: usize) -> bool {
        self.end + RECORD_OVERHEAD + len as u64 <= self.capacity
    }

    /// Bytes of records written in this generation (header excluded).
    pub fn used(&self) -> u64 {
        self.end - HEADER_LEN
    }

    /// Appends `payload` as one record and returns once it is durable (one `fdatasync`).
    /// A payload that does not fit ([`RecordLog::fits`]) is an error of kind `StorageFull`
    /// and writes nothing: the caller makes its change durable another way and resets.
    pub fn append(&mut self, payload: &[u8]) -> io::Result<()> {
        if !self.fits(payload.len()) {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "{}: a record of {} bytes does not fit in the {} bytes left",
                    self.path.display(),
                    payload.len(),
                    self.capacity.saturating_sub(self.end + RECORD_OVERHEAD)
                ),
            ));
        }
        let len = u32::try_from(payload.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "record too large"))?;
        let mut buf = Vec::with_capacity(RECORD_OVERHEAD as usize + payload.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&record_crc(self.generation, len, payload).to_le_bytes());
        buf.extend_from_slice(payload);
        self.file.write_all_at(&buf, self.end)?;
        self.file.sync_data()?;
        self.end += buf.len() as u64;
        Ok(())
    }

    /// Empties the log: a new generation extending `base`, durable when this returns.
    pub fn reset(&mut self, base: u64) -> io::Result<()> {
        if self.untrusted {
            zero(&self.file, 0, self.capacity)?;
            self.generation = 0;
        }
        let generation = self.generation + 1;
        let mut head = [0u8; HEADER_LEN as usize];
        head[..8].copy_from_slice(MAGIC);
        head[8..16].copy_from_slice(&generation.to_le_bytes());
        head[16..24].copy_from_slice(&base.to_le_bytes());
        let crc = crc32(&head[..24]);
        head[24..28].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&head, 0)?;
        self.file.sync_data()?;
        self.generation = generation;
        self.end = HEADER_LEN;
        self.untrusted = false;
        Ok(())
    }
}

/// Reads the records of the log at `path` without opening it for writing (a missing file
/// has none): what [`RecordLog::open`] would replay.
pub fn read(path: &Path) -> io::Result<Replay> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(parse(&bytes).0),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Replay::default()),
        Err(e) => Err(e),
    }
}

/// The records of the current generation in `bytes`, and where the next one goes.
fn parse(bytes: &[u8]) -> (Replay, u64) {
    let Some((generation, base)) = header(bytes) else {
        return (Replay::default(), HEADER_LEN);
    };
    let mut replay = Replay {
        base: Some(base),
        ..Replay::default()
    };
    let mut at = HEADER_LEN as usize;
    while let Some(head) = bytes.get(at..at + RECORD_OVERHEAD as usize) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len == 0 && crc == 0 {
            break;
        }
        let start = at + RECORD_OVERHEAD as usize;
        let Some(payload) = bytes.get(start..start + len as usize) else {
            replay.invalid_tail = true;
            break;
        };
        if record_crc(generation, len, payload) != crc {
            replay.invalid_tail = true;
            break;
        }
        replay.records.push(payload.to_vec());
        at = start + len as usize;
    }
    (replay, at as u64)
}

/// The generation and base of a valid header.
fn header(bytes: &[u8]) -> Option<(u64, u64)> {
    let head = bytes.get(..HEADER_LEN as usize)?;
    if &head[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(head[24..28].try_into().ok()?);
    if crc32(&head[..24]) != crc {
        return None;
    }
    let generation = u64::from_le_bytes(head[8..16].try_into().ok()?);
    let base = u64::from_le_bytes(head[16..24].try_into().ok()?);
    Some((generation, base))
}

fn record_crc(generation: u64, len: u32, payload: &[u8]) -> u32 {
    let mut crc = Crc32::new();
    crc.update(&generation.to_le_bytes());
    crc.update(&len.to_le_bytes());
    crc.update(payload);
    crc.finish()
}

/// Writes zeros over `from..to` of `file`.
fn zero(file: &File, from: u64, to: u64) -> io::Result<()> {
    const CHUNK: u64 = 64 * 1024;
    let zeros = vec![0u8; CHUNK as usize];
    let mut at = from;
    while at < to {
        let n = (to - at).min(CHUNK);
        file.write_all_at(&zeros[..n as usize], at)?;
        at += n;
    }
    file.sync_data()
}

/// The CRC-32 (IEEE 802.3, as zlib computes it) of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = Crc32::new();
    crc.update(bytes);
    crc.finish()
}

struct Crc32(u32);

const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

impl Crc32 {
    fn new() -> Self {
        Crc32(0xFFFF_FFFF)
    }

    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = CRC_TABLE[((self.0 ^ u32::from(b)) & 0xFF) as usize] ^ (self.0 >> 8);
        }
    }

    fn finish(&self) -> u32 {
        !self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: u64 = 4096;

    fn open(path: &Path) -> (RecordLog, Replay) {
        RecordLog::open(path, CAP, 0o600).expect("opens")
    }

    #[test]
    fn crc32_is_zlibs() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn records_survive_a_reopen_in_order_and_a_reset_empties_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let (mut log, replay) = open(&path);
        assert_eq!(replay, Replay::default(), "a new file has no header yet");
        assert_eq!(std::fs::metadata(&path).expect("file").len(), CAP);
        log.reset(7).expect("reset");
        log.append(b"one").expect("append");
        log.append(b"two").expect("append");
        drop(log);
        let (mut log, replay) = open(&path);
        assert_eq!(replay.base, Some(7));
        assert_eq!(replay.records, [b"one".to_vec(), b"two".to_vec()]);
        assert!(!replay.invalid_tail);
        log.append(b"three").expect("append after reopen");
        drop(log);
        let (mut log, replay) = open(&path);
        assert_eq!(replay.records.len(), 3);
        log.reset(8).expect("reset");
        log.append(b"new").expect("append");
        drop(log);
        let (_, replay) = open(&path);
        assert_eq!(replay.base, Some(8));
        assert_eq!(
            replay.records,
            [b"new".to_vec()],
            "the earlier generation's records after the new one are not read"
        );
        assert!(replay.invalid_tail, "they are what stops the reading");
    }

    #[test]
    fn a_torn_last_record_is_dropped_and_the_ones_before_it_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let (mut log, _) = open(&path);
        log.reset(1).expect("reset");
        log.append(b"whole").expect("append");
        let torn_at = HEADER_LEN + RECORD_OVERHEAD + 5;
        log.append(b"torn record").expect("append");
        drop(log);
        // The crash hit mid-write: the last bytes of the payload never reached the disk.
        let file = OpenOptions::new().write(true).open(&path).expect("open");
        file.write_all_at(&[0; 4], torn_at + RECORD_OVERHEAD + 7)
            .expect("tear");
        drop(file);
        let (mut log, replay) = open(&path);
        assert_eq!(replay.records, [b"whole".to_vec()]);
        assert!(replay.invalid_tail);
        assert_eq!(
            read(&path).expect("reads"),
            replay,
            "a reader sees the same"
        );
        // The next append takes the torn record's place.
        log.append(b"next").expect("append");
        drop(log);
        let (_, replay) = open(&path);
        assert_eq!(replay.records, [b"whole".to_vec(), b"next".to_vec()]);
    }

    #[test]
    fn a_record_that_does_not_fit_is_refused_and_writes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let (mut log, _) = open(&path);
        log.reset(1).expect("reset");
        let big = vec![1u8; (CAP - HEADER_LEN - RECORD_OVERHEAD) as usize];
        assert!(log.fits(big.len()));
        assert!(!log.fits(big.len() + 1));
        let err = log.append(&[1; CAP as usize]).expect_err("too big");
        assert_eq!(err.kind(), io::ErrorKind::StorageFull);
        assert!(err.to_string().contains("does not fit"), "{err}");
        log.append(&big).expect("exactly fits");
        assert!(!log.fits(0));
        drop(log);
        let (_, replay) = open(&path);
        assert_eq!(replay.records, [big]);
    }

    #[test]
    fn a_torn_header_reads_as_an_empty_log_and_the_next_reset_zeroes_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let (mut log, _) = open(&path);
        log.reset(1).expect("reset");
        log.append(b"old").expect("append");
        drop(log);
        let file = OpenOptions::new().write(true).open(&path).expect("open");
        file.write_all_at(&[0xFF; 4], 9).expect("tear header");
        drop(file);
        let (mut log, replay) = open(&path);
        assert_eq!(replay, Replay::default());
        log.reset(2).expect("reset");
        drop(log);
        let bytes = std::fs::read(&path).expect("read");
        assert!(bytes[HEADER_LEN as usize..].iter().all(|&b| b == 0));
        let (_, replay) = open(&path);
        assert_eq!(replay.base, Some(2));
        assert!(replay.records.is_empty() && !replay.invalid_tail);
    }

    #[test]
    fn a_short_file_is_extended_to_the_capacity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        std::fs::write(&path, b"").expect("empty file");
        let (mut log, replay) = open(&path);
        assert_eq!(replay, Replay::default());
        assert_eq!(std::fs::metadata(&path).expect("file").len(), CAP);
        log.reset(3).expect("reset");
        assert_eq!(log.used(), 0);
        assert_eq!(log.path(), path);
        assert_eq!(
            read(&dir.path().join("missing")).expect("reads"),
            Replay::default()
        );
    }
}
