//! Stand-ins for the driver's user-space files, and for the host's own system libraries
//! beside them, in the shape NVIDIA's tools and glibc's loader inspect them.
//!
//! The container toolkit reads each driver library's ELF `SONAME` to decide which links to
//! create in a container, and finds the libraries through the driver root's
//! `etc/ld.so.cache`. So the simulated libraries are minimal ELF shared objects that carry
//! only a `SONAME` (loadable, so a tool may preload them, but exporting nothing), and the
//! cache is a glibc `ld.so.cache` in the new format (`glibc-ld.so.cache1.1`) written here,
//! because `ldconfig` would skip files that are not real libraries.
//!
//! A real host's library folder also holds its distribution's `libc.so.6`, `libpthread`,
//! `libdl`, `libm` and `librt`, of another glibc than the one of the process that runs a
//! driver tool from a container; a loader that picks them up (`LD_LIBRARY_PATH` naming that
//! folder) fails with glibc version or relocation errors. [`host_system_library`] makes
//! stand-ins that fail the same way for any loader: they require a glibc version that none
//! defines. They are built here, byte by byte, so that setting up a host needs no compiler
//! and no copy of a real glibc.

/// `FLAG_ELF_LIBC6 | FLAG_X8664_LIB64`: an x86-64 glibc library (what `ldconfig -p` shows as
/// `libc6,x86-64`).
pub const LDCACHE_FLAGS_X8664: i32 = 0x0303;

/// An ELF section header: name offset, type, flags, file offset, size, link, info,
/// alignment, entry size.
type SectionHeader = (u32, u32, u64, usize, usize, u32, u32, u64, u64);

/// The loader's name on x86-64, which every glibc library needs.
pub const LOADER_SONAME: &str = "ld-linux-x86-64.so.2";
/// The glibc version a host's system library stand-in requires of the loader: one no glibc
/// defines, so no loader can use the stand-in.
pub const MISSING_GLIBC_VERSION: &str = "GLIBC_9.99";

/// The SysV ELF hash (`vna_hash` of a version requirement).
fn elf_hash(name: &str) -> u32 {
    let mut h: u32 = 0;
    for b in name.bytes() {
        h = (h << 4).wrapping_add(u32::from(b));
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
        }
        h &= !g;
    }
    h
}

/// A 64-bit little-endian ELF shared object (x86-64) named `soname` that exports nothing:
/// loadable by glibc's loader (one read-write `PT_LOAD` covering the file, `PT_DYNAMIC`,
/// `PT_GNU_STACK`), with the section headers `readelf -d`, Go's `debug/elf` and `objdump -p`
/// read. `defines` are symbol versions it defines (`DT_VERDEF`, after the base version named
/// by the soname); with `needs = Some((file, version))` it also requires symbol version
/// `version` of `file` (a `DT_NEEDED` entry and a `DT_VERNEED` record). The loader checks
/// both before a process starts.
pub fn elf_library(soname: &str, defines: &[&str], needs: Option<(&str, &str)>) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    const SHDR: usize = 64;
    const PHNUM: usize = 3;
    const VERDEF: usize = 20 + 8; // Elf64_Verdef and one Elf64_Verdaux
    // .dynstr: "", the soname, the defined versions, the needed file and version.
    let mut dynstr = vec![0u8];
    let mut add = |text: &str| {
        let at = dynstr.len();
        dynstr.extend_from_slice(text.as_bytes());
        dynstr.push(0);
        at
    };
    let soname_at = add(soname);
    // (name offset, hash); the first is the base version: the file itself.
    let defs: Vec<(usize, u32)> = if defines.is_empty() {
        Vec::new()
    } else {
        std::iter::once((soname_at, elf_hash(soname)))
            .chain(defines.iter().map(|v| (add(v), elf_hash(v))))
            .collect()
    };
    let needed = needs.map(|(file, version)| (add(file), add(version), elf_hash(version)));
    let versioned = !defs.is_empty() || needed.is_some();
    let shstr: &[u8] = b"\0.dynsym\0.hash\0.gnu.version\0.gnu.version_d\0.gnu.version_r\0.dynstr\0.dynamic\0.shstrtab\0";
    let name = |n: &str| -> u32 {
        let pat = format!("\0{n}\0");
        shstr
            .windows(pat.len())
            .position(|w| w == pat.as_bytes())
            .map_or(0, |p| (p + 1) as u32)
    };

    // Offsets (virtual addresses are the same: one segment loaded at 0).
    let dynsym_off = EHDR + PHNUM * PHDR; // one null symbol, 24 bytes
    let hash_off = dynsym_off + 24; // nbucket 1, nchain 1, bucket[0] 0, chain[0] 0
    let versym_off = hash_off + 16; // one entry, 2 bytes
    let verdef_off = (versym_off + 2).next_multiple_of(8);
    let verdef_len = defs.len() * VERDEF;
    let verneed_off = (verdef_off + verdef_len).next_multiple_of(8);
    let verneed_len = if needed.is_some() { 32 } else { 0 };
    let dynstr_off = verneed_off + verneed_len;
    let dynamic_off = (dynstr_off + dynstr.len()).next_multiple_of(8);
    let mut dynamic: Vec<(u64, u64)> = Vec::new();
    if let Some((file_at, _, _)) = needed {
        dynamic.push((1, file_at as u64)); // DT_NEEDED
    }
    dynamic.extend([
        (14, soname_at as u64),    // DT_SONAME
        (4, hash_off as u64),      // DT_HASH
        (5, dynstr_off as u64),    // DT_STRTAB
        (6, dynsym_off as u64),    // DT_SYMTAB
        (10, dynstr.len() as u64), // DT_STRSZ
        (11, 24),                  // DT_SYMENT
    ]);
    if versioned {
        dynamic.push((0x6fff_fff0, versym_off as u64)); // DT_VERSYM
    }
    if !defs.is_empty() {
        dynamic.push((0x6fff_fffc, verdef_off as u64)); // DT_VERDEF
        dynamic.push((0x6fff_fffd, defs.len() as u64)); // DT_VERDEFNUM
    }
    if needed.is_some() {
        dynamic.push((0x6fff_fffe, verneed_off as u64)); // DT_VERNEED
        dynamic.push((0x6fff_ffff, 1)); // DT_VERNEEDNUM
    }
    dynamic.push((0, 0)); // DT_NULL
    let dynamic_len = dynamic.len() * 16;
    let shstr_off = dynamic_off + dynamic_len;
    let sh_off = (shstr_off + shstr.len()).next_multiple_of(8);

    // Section indices: null, .dynsym, .hash, then the version sections present, .dynstr,
    // .dynamic, .shstrtab.
    let dynstr_ndx =
        3 + u32::from(versioned) + u32::from(!defs.is_empty()) + u32::from(needed.is_some());
    // (name, type, flags, offset, size, link, info, align, entsize); flags: A = 2, WA = 3.
    let mut sections: Vec<SectionHeader> = vec![(0, 0, 0, 0, 0, 0, 0, 0, 0)];
    sections.push((name(".dynsym"), 11, 2, dynsym_off, 24, dynstr_ndx, 1, 8, 24));
    sections.push((name(".hash"), 5, 2, hash_off, 16, 1, 0, 8, 4));
    if versioned {
        sections.push((
            name(".gnu.version"),
            0x6fff_ffff,
            2,
            versym_off,
            2,
            1,
            0,
            2,
            2,
        ));
    }
    if !defs.is_empty() {
        sections.push((
            name(".gnu.version_d"),
            0x6fff_fffd,
            2,
            verdef_off,
            verdef_len,
            dynstr_ndx,
            defs.len() as u32,
            8,
            0,
        ));
    }
    if needed.is_some() {
        sections.push((
            name(".gnu.version_r"),
            0x6fff_fffe,
            2,
            verneed_off,
            verneed_len,
            dynstr_ndx,
            1,
            8,
            0,
        ));
    }
    sections.push((name(".dynstr"), 3, 2, dynstr_off, dynstr.len(), 0, 0, 1, 0));
    sections.push((
        name(".dynamic"),
        6,
        3,
        dynamic_off,
        dynamic_len,
        dynstr_ndx,
        0,
        8,
        16,
    ));
    sections.push((name(".shstrtab"), 3, 0, shstr_off, shstr.len(), 0, 0, 1, 0));
    let file_len = sh_off + sections.len() * SHDR;

    let mut f = Vec::with_capacity(file_len);
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    f.extend_from_slice(&[0; 8]);
    f.extend_from_slice(&3u16.to_le_bytes()); // ET_DYN
    f.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    f.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    f.extend_from_slice(&0u64.to_le_bytes()); // e_entry
    f.extend_from_slice(&(EHDR as u64).to_le_bytes()); // e_phoff
    f.extend_from_slice(&(sh_off as u64).to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    f.extend_from_slice(&(EHDR as u16).to_le_bytes());
    f.extend_from_slice(&(PHDR as u16).to_le_bytes());
    f.extend_from_slice(&(PHNUM as u16).to_le_bytes());
    f.extend_from_slice(&(SHDR as u16).to_le_bytes());
    f.extend_from_slice(&(sections.len() as u16).to_le_bytes());
    f.extend_from_slice(&((sections.len() - 1) as u16).to_le_bytes()); // e_shstrndx
    // (type, flags, offset, size, align): PT_LOAD RW over the whole file (the loader
    // writes to .dynamic), PT_DYNAMIC, PT_GNU_STACK RW (no executable stack wanted).
    for (ty, flags, off, size, align) in [
        (1u32, 6u32, 0usize, file_len, 0x1000u64),
        (2, 6, dynamic_off, dynamic_len, 8),
        (0x6474_e551, 6, 0, 0, 16),
    ] {
        f.extend_from_slice(&ty.to_le_bytes());
        f.extend_from_slice(&flags.to_le_bytes());
        f.extend_from_slice(&(off as u64).to_le_bytes()); // p_offset
        f.extend_from_slice(&(off as u64).to_le_bytes()); // p_vaddr
        f.extend_from_slice(&(off as u64).to_le_bytes()); // p_paddr
        f.extend_from_slice(&(size as u64).to_le_bytes()); // p_filesz
        f.extend_from_slice(&(size as u64).to_le_bytes()); // p_memsz
        f.extend_from_slice(&align.to_le_bytes());
    }
    f.resize(hash_off, 0); // the null symbol
    for v in [1u32, 1, 0, 0] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(&0u16.to_le_bytes()); // versym of the null symbol: local
    f.resize(verdef_off, 0);
    for (i, (name_at, hash)) in defs.iter().enumerate() {
        // Elf64_Verdef: version 1, flags (VER_FLG_BASE for the file itself), index from 1,
        // one aux entry at +20, the next definition right after its aux entry.
        let last = i + 1 == defs.len();
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&u16::from(i == 0).to_le_bytes());
        f.extend_from_slice(&((i + 1) as u16).to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&hash.to_le_bytes());
        f.extend_from_slice(&20u32.to_le_bytes());
        f.extend_from_slice(&(if last { 0 } else { VERDEF as u32 }).to_le_bytes());
        // Elf64_Verdaux: name, no next.
        f.extend_from_slice(&(*name_at as u32).to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
    }
    f.resize(verneed_off, 0);
    if let Some((file_at, version_at, hash)) = needed {
        // Elf64_Verneed: version 1, one aux entry, file, aux at +16, no next.
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&(file_at as u32).to_le_bytes());
        f.extend_from_slice(&16u32.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        // Elf64_Vernaux: hash, flags 0, version index after the defined ones, name, no next.
        f.extend_from_slice(&hash.to_le_bytes());
        f.extend_from_slice(&0u16.to_le_bytes());
        f.extend_from_slice(&((defs.len() + 1).max(2) as u16).to_le_bytes());
        f.extend_from_slice(&(version_at as u32).to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
    }
    f.extend_from_slice(&dynstr);
    f.resize(dynamic_off, 0);
    for (tag, val) in dynamic {
        f.extend_from_slice(&tag.to_le_bytes());
        f.extend_from_slice(&val.to_le_bytes());
    }
    f.extend_from_slice(shstr);
    f.resize(sh_off, 0);
    for (name, ty, flags, off, size, link, info, align, entsize) in sections {
        f.extend_from_slice(&name.to_le_bytes());
        f.extend_from_slice(&ty.to_le_bytes());
        f.extend_from_slice(&flags.to_le_bytes());
        let addr = if flags & 2 != 0 { off as u64 } else { 0 };
        f.extend_from_slice(&addr.to_le_bytes());
        f.extend_from_slice(&(off as u64).to_le_bytes());
        f.extend_from_slice(&(size as u64).to_le_bytes());
        f.extend_from_slice(&link.to_le_bytes());
        f.extend_from_slice(&info.to_le_bytes());
        f.extend_from_slice(&align.to_le_bytes());
        f.extend_from_slice(&entsize.to_le_bytes());
    }
    f
}

/// Every symbol version of glibc on x86-64 up to 2.45, and `GLIBC_PRIVATE`: what a host
/// library stand-in defines, so that a program's own requirements pass the loader's check
/// and the one failure it reports is the stand-in's.
fn glibc_versions() -> Vec<String> {
    ["2.2.5", "2.2.6", "2.3", "2.3.2", "2.3.3", "2.3.4"]
        .iter()
        .map(|v| format!("GLIBC_{v}"))
        .chain((4..=45).map(|minor| format!("GLIBC_2.{minor}")))
        .chain(std::iter::once("GLIBC_PRIVATE".to_string()))
        .collect()
}

/// Replaces the `DT_SONAME` of a 64-bit little-endian ELF shared object in place, writing
/// `soname` over the old name in its string table (NUL-padded). The new name must not be
/// longer than the old one, and no other dynamic entry may point into the old name (a string
/// table can share a name's tail). Used for the simulated CUDA library, whose link gives it
/// gpu-dra-sim's soname (see the build script of `gpu-dra-sim-cuda`).
pub fn set_soname(elf: &mut [u8], soname: &str) -> Result<(), String> {
    let u16_at = |b: &[u8], at: usize| -> Option<u64> {
        Some(u64::from(u16::from_le_bytes(
            b.get(at..at + 2)?.try_into().ok()?,
        )))
    };
    let u32_at = |b: &[u8], at: usize| -> Option<u64> {
        Some(u64::from(u32::from_le_bytes(
            b.get(at..at + 4)?.try_into().ok()?,
        )))
    };
    let u64_at = |b: &[u8], at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
    };
    if !elf.starts_with(&[0x7f, b'E', b'L', b'F', 2, 1]) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let bad = || "truncated ELF file".to_string();
    let phoff = u64_at(elf, 0x20).ok_or_else(bad)? as usize;
    let phentsize = u16_at(elf, 0x36).ok_or_else(bad)? as usize;
    let phnum = u16_at(elf, 0x38).ok_or_else(bad)? as usize;
    // (type, offset, vaddr, filesz) of each program header.
    let mut segments = Vec::new();
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        segments.push((
            u32_at(elf, at).ok_or_else(bad)?,
            u64_at(elf, at + 8).ok_or_else(bad)?,
            u64_at(elf, at + 16).ok_or_else(bad)?,
            u64_at(elf, at + 32).ok_or_else(bad)?,
        ));
    }
    let &(_, dyn_off, _, dyn_size) = segments
        .iter()
        .find(|s| s.0 == 2)
        .ok_or("no PT_DYNAMIC segment")?;
    let mut strtab = None;
    let mut name_at = None;
    let mut others = Vec::new();
    for i in 0..(dyn_size / 16) as usize {
        let at = dyn_off as usize + i * 16;
        let (tag, val) = (
            u64_at(elf, at).ok_or_else(bad)?,
            u64_at(elf, at + 8).ok_or_else(bad)?,
        );
        match tag {
            0 => break,
            5 => strtab = Some(val),
            14 => name_at = Some(val),
            // DT_NEEDED, DT_RPATH, DT_RUNPATH: other names in the string table.
            1 | 15 | 29 => others.push(val),
            _ => {}
        }
    }
    let strtab = strtab.ok_or("no DT_STRTAB")?;
    let name_at = name_at.ok_or("no DT_SONAME")?;
    // The string table's file offset, through the loadable segment holding its address.
    let &(_, off, vaddr, _) = segments
        .iter()
        .find(|s| s.0 == 1 && s.2 <= strtab && strtab < s.2 + s.3)
        .ok_or("DT_STRTAB outside every PT_LOAD segment")?;
    let start = (strtab - vaddr + off + name_at) as usize;
    let old_len = elf
        .get(start..)
        .and_then(|rest| rest.iter().position(|b| *b == 0))
        .ok_or_else(bad)?;
    if soname.len() > old_len {
        return Err(format!(
            "soname {soname:?} is longer than the one in the file ({old_len} bytes)"
        ));
    }
    if others
        .iter()
        .any(|o| *o > name_at && *o <= name_at + old_len as u64)
    {
        return Err("another name shares the soname's bytes".into());
    }
    let field = &mut elf[start..start + old_len];
    field.fill(0);
    field[..soname.len()].copy_from_slice(soname.as_bytes());
    Ok(())
}

/// A driver library stand-in: an ELF shared object carrying only its `SONAME`, loadable
/// (a tool may preload it) but exporting nothing.
pub fn elf_with_soname(soname: &str) -> Vec<u8> {
    elf_library(soname, &[], None)
}

/// A stand-in for one of a host distribution's system libraries (`libc.so.6`, ...): an ELF
/// shared object named `soname` that defines glibc's symbol versions but requires
/// [`MISSING_GLIBC_VERSION`] of the loader, so that a process whose loader finds it (through
/// `LD_LIBRARY_PATH` naming its folder) dies at start with one line of glibc's own,
/// ``version `GLIBC_9.99' not found (required by <folder>/libc.so.6)``, as a process of our
/// image dies on a real host when its loader loads the host's libc (there a `GLIBC_PRIVATE`
/// symbol of the loader the host's libc needs, or a `GLIBC_2.x` version it lacks).
pub fn host_system_library(soname: &str) -> Vec<u8> {
    let versions = glibc_versions();
    let defines: Vec<&str> = versions.iter().map(String::as_str).collect();
    elf_library(
        soname,
        &defines,
        Some((LOADER_SONAME, MISSING_GLIBC_VERSION)),
    )
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
    fn set_soname_rewrites_a_longer_name_and_refuses_a_longer_one() {
        let mut elf = elf_with_soname("libnvidia-ml.so.1");
        set_soname(&mut elf, "libcuda.so.1").expect("shorter name");
        assert_eq!(soname_of(&elf).as_deref(), Some("libcuda.so.1"));
        let err = set_soname(&mut elf, "libnvidia-ml.so.1").expect_err("longer");
        assert!(err.contains("longer"), "{err}");
        assert!(set_soname(&mut b"not elf".to_vec(), "x").is_err());
    }

    fn u32_at(f: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(f[at..at + 4].try_into().expect("4 bytes"))
    }

    fn u64_at(f: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(f[at..at + 8].try_into().expect("8 bytes"))
    }

    /// `(type, offset, size, link)` of every section.
    fn sections(f: &[u8]) -> Vec<(u32, usize, usize, u32)> {
        let sh_off = u64_at(f, 40) as usize;
        let n = u16::from_le_bytes(f[60..62].try_into().expect("2 bytes")) as usize;
        (0..n)
            .map(|i| {
                let h = sh_off + i * 64;
                (
                    u32_at(f, h + 4),
                    u64_at(f, h + 24) as usize,
                    u64_at(f, h + 32) as usize,
                    u32_at(f, h + 40),
                )
            })
            .collect()
    }

    /// The soname, read through the section headers as `readelf -d` does.
    fn soname_of(f: &[u8]) -> Option<String> {
        let sections = sections(f);
        let (_, dyn_off, dyn_len, link) = *sections.iter().find(|s| s.0 == 6)?;
        let (_, str_off, _, _) = sections[link as usize];
        let at = (dyn_off..dyn_off + dyn_len)
            .step_by(16)
            .find(|&e| u64_at(f, e) == 14)
            .map(|e| str_off + u64_at(f, e + 8) as usize)?;
        let end = at + f[at..].iter().position(|b| *b == 0)?;
        String::from_utf8(f[at..end].to_vec()).ok()
    }

    #[test]
    fn elf_stub_names_its_soname_where_readers_look() {
        let f = elf_with_soname("libcuda.so.1");
        assert_eq!(&f[..4], b"\x7fELF");
        let sections = sections(&f);
        // The dynamic section (SHT_DYNAMIC) links to its string table; DT_SONAME points in it.
        let (_, dyn_off, dyn_len, link) = *sections
            .iter()
            .find(|s| s.0 == 6)
            .expect("a .dynamic section");
        let (_, str_off, _, _) = sections[link as usize];
        let soname = (dyn_off..dyn_off + dyn_len)
            .step_by(16)
            .find(|&e| u64_at(&f, e) == 14)
            .map(|e| str_off + u64_at(&f, e + 8) as usize)
            .expect("DT_SONAME");
        assert_eq!(&f[soname..soname + 13], b"libcuda.so.1\0");
        // Loadable: program headers, the first a PT_LOAD over the whole file.
        assert_eq!(u32_at(&f, 64), 1);
        assert_eq!(u64_at(&f, 64 + 32), f.len() as u64);
    }

    #[test]
    fn version_requirement_is_hashed_as_elf_does() {
        // Values from glibc's own `readelf -V` output.
        assert_eq!(elf_hash("GLIBC_2.2.5"), 0x09691a75);
        assert_eq!(elf_hash("GLIBC_PRIVATE"), 0x0963cf85);
    }

    /// Runs this test executable (a glibc program, like our tools) with `var=value`, listing
    /// its tests, and returns whether it started and its stderr.
    fn run_self_with(var: &str, value: &std::path::Path) -> (bool, String) {
        let exe = std::env::current_exe().expect("test executable");
        let out = std::process::Command::new(exe)
            .args(["--list", "--exact", "no-such-test"])
            .env(var, value)
            .output()
            .expect("spawn");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn a_loader_that_finds_the_host_libc_stand_in_refuses_to_start_the_process() {
        let dir = tempfile::tempdir().expect("tmp");
        for so in ["libc.so.6", "libm.so.6"] {
            std::fs::write(dir.path().join(so), host_system_library(so)).expect("write");
        }
        let (ok, err) = run_self_with("LD_LIBRARY_PATH", dir.path());
        assert!(!ok, "started with the stand-in libc: {err}");
        assert!(
            err.contains(&format!("version `{MISSING_GLIBC_VERSION}' not found")),
            "{err}"
        );
        // The program's own glibc versions are all defined: the stand-in's is the one failure.
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }

    #[test]
    fn a_driver_library_stand_in_can_be_preloaded() {
        let dir = tempfile::tempdir().expect("tmp");
        let lib = dir.path().join("libcuda.so.1");
        std::fs::write(&lib, elf_with_soname("libcuda.so.1")).expect("write");
        let (ok, err) = run_self_with("LD_PRELOAD", &lib);
        assert!(ok && err.is_empty(), "{err}");
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
