//! Stand-ins for the driver's user-space files in the shape NVIDIA's tools inspect them.
//!
//! The container toolkit reads each driver library's ELF `SONAME` to decide which links to
//! create in a container, and finds the libraries through the driver root's
//! `etc/ld.so.cache`. So the simulated libraries are minimal ELF shared objects that carry
//! only a `SONAME` (nothing can be linked against or loaded from them), and the cache is a
//! glibc `ld.so.cache` in the new format (`glibc-ld.so.cache1.1`) written here, because
//! `ldconfig` would skip files that are not real libraries.

/// `FLAG_ELF_LIBC6 | FLAG_X8664_LIB64`: an x86-64 glibc library (what `ldconfig -p` shows as
/// `libc6,x86-64`).
pub const LDCACHE_FLAGS_X8664: i32 = 0x0303;

/// An ELF section header: name offset, type, flags, file offset, size, link, alignment,
/// entry size.
type SectionHeader = (u32, u32, u64, usize, usize, u32, u64, u64);

/// A 64-bit little-endian ELF shared object (x86-64) whose dynamic section holds only
/// `DT_SONAME` = `soname`: enough for `readelf -d`, Go's `debug/elf` and `objdump -p`.
pub fn elf_with_soname(soname: &str) -> Vec<u8> {
    const EHDR: usize = 64;
    const SHDR: usize = 64;
    let mut dynstr = vec![0u8];
    dynstr.extend_from_slice(soname.as_bytes());
    dynstr.push(0);
    let shstr = b"\0.dynstr\0.dynamic\0.shstrtab\0";
    let dynstr_off = EHDR;
    let dynamic_off = (dynstr_off + dynstr.len()).next_multiple_of(8);
    // DT_SONAME (14) -> offset 1 in .dynstr, DT_STRTAB (5) -> its address, DT_NULL.
    let dynamic: [(u64, u64); 3] = [(14, 1), (5, dynstr_off as u64), (0, 0)];
    let dynamic_len = dynamic.len() * 16;
    let shstr_off = dynamic_off + dynamic_len;
    let sh_off = (shstr_off + shstr.len()).next_multiple_of(8);

    let mut f = Vec::with_capacity(sh_off + 4 * SHDR);
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    f.extend_from_slice(&[0; 8]);
    f.extend_from_slice(&3u16.to_le_bytes()); // ET_DYN
    f.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    f.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    f.extend_from_slice(&0u64.to_le_bytes()); // e_entry
    f.extend_from_slice(&0u64.to_le_bytes()); // e_phoff
    f.extend_from_slice(&(sh_off as u64).to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    f.extend_from_slice(&(EHDR as u16).to_le_bytes());
    f.extend_from_slice(&56u16.to_le_bytes()); // e_phentsize
    f.extend_from_slice(&0u16.to_le_bytes()); // e_phnum
    f.extend_from_slice(&(SHDR as u16).to_le_bytes());
    f.extend_from_slice(&4u16.to_le_bytes()); // e_shnum
    f.extend_from_slice(&3u16.to_le_bytes()); // e_shstrndx
    f.extend_from_slice(&dynstr);
    f.resize(dynamic_off, 0);
    for (tag, val) in dynamic {
        f.extend_from_slice(&tag.to_le_bytes());
        f.extend_from_slice(&val.to_le_bytes());
    }
    f.extend_from_slice(shstr);
    f.resize(sh_off, 0);
    // (name, type, flags, offset, size, link, align, entsize)
    let sections: [SectionHeader; 4] = [
        (0, 0, 0, 0, 0, 0, 0, 0),
        (1, 3, 2, dynstr_off, dynstr.len(), 0, 1, 0), // .dynstr: SHT_STRTAB, SHF_ALLOC
        (9, 6, 3, dynamic_off, dynamic_len, 1, 8, 16), // .dynamic: SHT_DYNAMIC, WA, -> .dynstr
        (18, 3, 0, shstr_off, shstr.len(), 0, 1, 0),  // .shstrtab
    ];
    for (name, ty, flags, off, size, link, align, entsize) in sections {
        f.extend_from_slice(&name.to_le_bytes());
        f.extend_from_slice(&ty.to_le_bytes());
        f.extend_from_slice(&flags.to_le_bytes());
        f.extend_from_slice(&(off as u64).to_le_bytes()); // sh_addr = offset (not loaded)
        f.extend_from_slice(&(off as u64).to_le_bytes());
        f.extend_from_slice(&(size as u64).to_le_bytes());
        f.extend_from_slice(&link.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes()); // sh_info
        f.extend_from_slice(&align.to_le_bytes());
        f.extend_from_slice(&entsize.to_le_bytes());
    }
    f
}

/// A glibc `ld.so.cache` in the new format only (what glibc >= 2.32 `ldconfig` writes):
/// a 48-byte header (`glibc-ld.so.cache1.1`, entry count, string table length, endianness
/// flag 2 = little), 24-byte entries (`flags`, `key`, `value`, `osversion`, `hwcap`) with
/// string offsets from the start of the file, then the NUL-terminated strings. `entries` are
/// `(soname, full path)`, written in the given order.
pub fn ld_so_cache(entries: &[(String, String)]) -> Vec<u8> {
    const HEADER: usize = 48;
    const ENTRY: usize = 24;
    let strings_start = HEADER + entries.len() * ENTRY;
    let mut strings = Vec::new();
    let mut offsets = Vec::new();
    for (key, value) in entries {
        let k = strings_start + strings.len();
        strings.extend_from_slice(key.as_bytes());
        strings.push(0);
        let v = strings_start + strings.len();
        strings.extend_from_slice(value.as_bytes());
        strings.push(0);
        offsets.push((k as u32, v as u32));
    }
    let mut f = Vec::with_capacity(strings_start + strings.len());
    f.extend_from_slice(b"glibc-ld.so.cache1.1");
    f.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    f.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    f.push(2); // cache_file_new_flags_endian_little
    f.extend_from_slice(&[0; 3]);
    f.extend_from_slice(&0u32.to_le_bytes()); // extension_offset: none
    f.extend_from_slice(&[0; 12]);
    for (k, v) in offsets {
        f.extend_from_slice(&LDCACHE_FLAGS_X8664.to_le_bytes());
        f.extend_from_slice(&k.to_le_bytes());
        f.extend_from_slice(&v.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes()); // osversion
        f.extend_from_slice(&0u64.to_le_bytes()); // hwcap
    }
    f.extend_from_slice(&strings);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elf_stub_names_its_soname_where_readers_look() {
        let f = elf_with_soname("libcuda.so.1");
        assert_eq!(&f[..4], b"\x7fELF");
        let sh_off = u64::from_le_bytes(f[40..48].try_into().expect("8 bytes")) as usize;
        // Section 2 is .dynamic, linked to section 1 (.dynstr).
        let dynamic = &f[sh_off + 2 * 64..sh_off + 3 * 64];
        assert_eq!(u32::from_le_bytes(dynamic[4..8].try_into().expect("4")), 6);
        assert_eq!(
            u32::from_le_bytes(dynamic[40..44].try_into().expect("4")),
            1
        );
        assert_eq!(&f[65..77], b"libcuda.so.1");
    }

    #[test]
    fn ld_cache_is_the_new_glibc_format() {
        let c = ld_so_cache(&[("libcuda.so.1".into(), "/usr/lib64/libcuda.so.1".into())]);
        assert_eq!(&c[..20], b"glibc-ld.so.cache1.1");
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().expect("4")), 1);
        let key = u32::from_le_bytes(c[52..56].try_into().expect("4")) as usize;
        assert_eq!(&c[key..key + 13], b"libcuda.so.1\0");
    }
}
