//! A parser of glibc's `ld.so.cache`, the dynamic loader's index of libraries by soname.
//!
//! The NVIDIA container toolkit finds the driver's libraries through the driver root's
//! `etc/ld.so.cache` (the folder holding `libcuda.so.1` there is the driver's library
//! folder), so the driver does the same to name the same files. Only the new format is
//! read (`glibc-ld.so.cache1.1`, written alone by glibc >= 2.32 and appended after the old
//! `ld.so-1.7.0` table by older ones); a cache in the old format only is rejected. Pure:
//! bytes in, entries out.

/// `FLAG_TYPE_MASK`: the library kind bits of an entry's flags.
const FLAG_TYPE_MASK: i32 = 0x00ff;
/// `FLAG_ELF_LIBC6`: a glibc ELF library.
const FLAG_ELF_LIBC6: i32 = 0x0003;
/// `FLAG_REQUIRED_MASK`: the architecture bits.
const FLAG_REQUIRED_MASK: i32 = 0xff00;
/// `FLAG_X8664_LIB64`: x86-64.
const FLAG_X8664_LIB64: i32 = 0x0300;
/// `FLAG_AARCH64_LIB64`: aarch64.
const FLAG_AARCH64_LIB64: i32 = 0x0a00;

const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
const NEW_HEADER: usize = 48;
const NEW_ENTRY: usize = 24;
const OLD_HEADER: usize = 16;
const OLD_ENTRY: usize = 12;

/// One library of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The soname the loader looks up, e.g. `libcuda.so.1`.
    pub name: String,
    /// The file, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1`.
    pub path: String,
    /// Whether this is a 64-bit glibc library (x86-64 or aarch64), the kind a container's
    /// 64-bit programs load.
    pub lib64: bool,
}

/// Why a cache could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LdCacheError {
    /// Neither format's magic is where it should be.
    #[error("not an ld.so.cache (no `glibc-ld.so.cache1.1` header)")]
    NotACache,
    /// A count or offset points past the end of the file.
    #[error("truncated ld.so.cache: {what} lies past the end of the file")]
    Truncated {
        /// The part that does not fit.
        what: &'static str,
    },
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn cstr_at(b: &[u8], at: usize) -> Option<String> {
    let rest = b.get(at..)?;
    let end = rest.iter().position(|c| *c == 0)?;
    Some(String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// Parses a little-endian cache (every platform the driver supports).
pub fn parse(bytes: &[u8]) -> Result<Vec<Entry>, LdCacheError> {
    let start = if bytes.starts_with(NEW_MAGIC) {
        0
    } else if bytes.starts_with(OLD_MAGIC) {
        // Old table first: 16-byte header with the entry count at 12, 12-byte entries, then
        // the new table, aligned like glibc's `ALIGN_CACHE` (8 bytes).
        let n = u32_at(bytes, 12).ok_or(LdCacheError::Truncated { what: "header" })? as usize;
        (OLD_HEADER + n * OLD_ENTRY).next_multiple_of(8)
    } else {
        return Err(LdCacheError::NotACache);
    };
    let cache = bytes.get(start..).ok_or(LdCacheError::NotACache)?;
    if !cache.starts_with(NEW_MAGIC) {
        return Err(LdCacheError::NotACache);
    }
    let n = u32_at(cache, 20).ok_or(LdCacheError::Truncated { what: "header" })? as usize;
    if cache.len() < NEW_HEADER + n * NEW_ENTRY {
        return Err(LdCacheError::Truncated {
            what: "entry table",
        });
    }
    (0..n)
        .map(|i| {
            let e = NEW_HEADER + i * NEW_ENTRY;
            let flags = u32_at(cache, e).unwrap_or_default() as i32;
            let key = u32_at(cache, e + 4).unwrap_or_default() as usize;
            let value = u32_at(cache, e + 8).unwrap_or_default() as usize;
            let name = cstr_at(cache, key).ok_or(LdCacheError::Truncated { what: "a name" })?;
            let path = cstr_at(cache, value).ok_or(LdCacheError::Truncated { what: "a path" })?;
            let arch = flags & FLAG_REQUIRED_MASK;
            Ok(Entry {
                name,
                path,
                lib64: flags & FLAG_TYPE_MASK == FLAG_ELF_LIBC6
                    && (arch == FLAG_X8664_LIB64 || arch == FLAG_AARCH64_LIB64),
            })
        })
        .collect()
}

/// The folders of the 64-bit libraries named `soname` (e.g. `libcuda.so.1`), in cache order
/// and without repeats: where the toolkit takes the driver's libraries from.
pub fn folders_of(entries: &[Entry], soname: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in entries.iter().filter(|e| e.lib64 && e.name == soname) {
        let dir = e.path.rsplit_once('/').map_or("/", |(d, _)| d);
        let dir = if dir.is_empty() { "/" } else { dir };
        if !out.iter().any(|d| d == dir) {
            out.push(dir.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new-format cache as glibc's `ldconfig` writes it.
    fn cache(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let strings_start = NEW_HEADER + entries.len() * NEW_ENTRY;
        let mut strings = Vec::new();
        let mut table = Vec::new();
        for (flags, k, v) in entries {
            let ko = strings_start + strings.len();
            strings.extend_from_slice(k.as_bytes());
            strings.push(0);
            let vo = strings_start + strings.len();
            strings.extend_from_slice(v.as_bytes());
            strings.push(0);
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&(ko as u32).to_le_bytes());
            table.extend_from_slice(&(vo as u32).to_le_bytes());
            table.extend_from_slice(&[0; 12]);
        }
        let mut f = NEW_MAGIC.to_vec();
        f.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        f.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        f.extend_from_slice(&[2, 0, 0, 0]);
        f.extend_from_slice(&[0; 16]);
        f.extend_from_slice(&table);
        f.extend_from_slice(&strings);
        f
    }

    #[test]
    fn reads_names_paths_and_kinds() {
        let c = cache(&[
            (
                0x0303,
                "libcuda.so.1",
                "/usr/local/nvidia/lib64/libcuda.so.1",
            ),
            (
                0x0003,
                "libcuda.so.1",
                "/usr/lib/i386-linux-gnu/libcuda.so.1",
            ),
            (0x0303, "libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
        ]);
        let e = parse(&c).expect("parses");
        assert_eq!(e.len(), 3);
        assert_eq!(e[0].path, "/usr/local/nvidia/lib64/libcuda.so.1");
        assert!(e[0].lib64);
        assert!(!e[1].lib64, "32-bit entries are not for 64-bit containers");
        assert_eq!(folders_of(&e, "libcuda.so.1"), ["/usr/local/nvidia/lib64"]);
        assert!(folders_of(&e, "libnvidia-ml.so.1").is_empty());
    }

    #[test]
    fn reads_the_new_table_after_an_old_one() {
        let mut f = OLD_MAGIC.to_vec();
        f.push(0);
        f.extend_from_slice(&1u32.to_le_bytes());
        f.extend_from_slice(&[0; OLD_ENTRY]);
        f.resize((OLD_HEADER + OLD_ENTRY).next_multiple_of(8), 0);
        let new = cache(&[(0x0303, "libcuda.so.1", "/lib64/libcuda.so.1")]);
        // String offsets of the combined format count from the new table.
        f.extend_from_slice(&new);
        let e = parse(&f).expect("parses");
        assert_eq!(e[0].name, "libcuda.so.1");
        assert_eq!(folders_of(&e, "libcuda.so.1"), ["/lib64"]);
    }

    #[test]
    fn rejects_what_is_not_a_cache() {
        assert_eq!(parse(b"hello"), Err(LdCacheError::NotACache));
        let mut c = cache(&[(0x0303, "libcuda.so.1", "/lib64/libcuda.so.1")]);
        c.truncate(60);
        assert!(matches!(parse(&c), Err(LdCacheError::Truncated { .. })));
    }
}
