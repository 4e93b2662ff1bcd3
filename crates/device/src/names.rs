//! Pure naming rules shared by every backend: MIG profile names, PCI bus IDs, and the brand and
//! architecture strings.
//!
//! These strings are part of the compatibility contract: CEL selectors written for the NVIDIA
//! driver compare them literally, so they follow what the NVIDIA driver (through go-nvlib)
//! publishes, not NVML's own spelling.

/// NVML GPU-instance profile index constants that carry a name suffix.
const GI_1_SLICE_REV1: u32 = 0x7;
const GI_2_SLICE_REV1: u32 = 0x8;
const GI_1_SLICE_GFX: u32 = 0xA;
const GI_2_SLICE_GFX: u32 = 0xB;
const GI_4_SLICE_GFX: u32 = 0xC;
const GI_1_SLICE_NO_ME: u32 = 0xD;
const GI_2_SLICE_NO_ME: u32 = 0xE;
const GI_1_SLICE_ALL_ME: u32 = 0xF;
const GI_2_SLICE_ALL_ME: u32 = 0x10;

/// The profile-name suffix for a GPU-instance profile *index* (the NVML constant, not the
/// profile ID): `+me` for the media-extension profiles, `+me.all`, `-me`, `+gfx`, else none.
pub fn profile_suffix(gi_profile_index: u32) -> &'static str {
    match gi_profile_index {
        GI_1_SLICE_REV1 | GI_2_SLICE_REV1 => "+me",
        GI_1_SLICE_ALL_ME | GI_2_SLICE_ALL_ME => "+me.all",
        GI_1_SLICE_NO_ME | GI_2_SLICE_NO_ME => "-me",
        GI_1_SLICE_GFX | GI_2_SLICE_GFX | GI_4_SLICE_GFX => "+gfx",
        _ => "",
    }
}

/// Memory of a MIG profile in marketed GB, derived as go-nvlib does: the fraction of the parent's
/// memory rounded up to eighths, times the parent's memory rounded up to whole GiB, rounded half
/// away from zero. `mig_memory_mib` is NVML's `memorySizeMB` (MiB); `parent_total_bytes` is the
/// parent's `nvmlDeviceGetMemoryInfo().total`. Returns 0 when the parent reports no memory.
pub fn profile_memory_gb(mig_memory_mib: u64, parent_total_bytes: u64) -> u64 {
    if parent_total_bytes == 0 {
        return 0;
    }
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: f64 = (1u64 << 30) as f64;
    let total = parent_total_bytes as f64;
    let eighths = (mig_memory_mib as f64 * MIB / total * 8.0).ceil();
    let total_gib = (total / GIB).ceil();
    // f64::round rounds half away from zero, like Go's math.Round.
    (eighths / 8.0 * total_gib).round() as u64
}

/// The MIG profile name: `<G>g.<GB>gb` when the compute instance spans the whole GPU instance,
/// else `<C>c.<G>g.<GB>gb`, followed by the suffix of the GPU-instance profile.
pub fn profile_name(
    gi_slices: u32,
    ci_slices: u32,
    mig_memory_mib: u64,
    parent_total_bytes: u64,
    gi_profile_index: u32,
) -> String {
    let gb = profile_memory_gb(mig_memory_mib, parent_total_bytes);
    let suffix = profile_suffix(gi_profile_index);
    if ci_slices == gi_slices || ci_slices == 0 {
        format!("{gi_slices}g.{gb}gb{suffix}")
    } else {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb{suffix}")
    }
}

/// The profile as it appears inside a device name: lower case, dots removed, every character
/// outside `[a-z0-9-]` replaced by `-` (`1g.5gb+me` -> `1g5gb-me`), as the NVIDIA driver does.
pub fn profile_for_device_name(profile: &str) -> String {
    profile
        .to_ascii_lowercase()
        .chars()
        .filter(|c| *c != '.')
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// Canonical PCI bus ID as sysfs spells it (`0000:07:00.0`): lower case, domain with at least 4
/// hex digits, from NVML's `00000000:07:00.0`. Returns `None` when the input is not
/// `domain:bus:device.function` in hex.
pub fn canonical_pci_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim().trim_end_matches('\0');
    let mut parts = raw.split(':');
    let (domain, bus, devfn) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (dev, func) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The brand string the NVIDIA driver publishes for an NVML `nvmlBrandType_t` value.
pub fn brand_name(brand: u32) -> String {
    let name = match brand {
        0 => "Unknown",
        1 => "Quadro",
        2 => "Tesla",
        3 => "NVS",
        4 => "Grid",
        5 => "GeForce",
        6 => "Titan",
        7 => "NvidiaVApps",
        8 => "NvidiaVPC",
        9 => "NvidiaVCS",
        10 => "NvidiaVWS",
        11 => "NvidiaCloudGaming",
        12 => "QuadroRTX",
        13 => "NvidiaRTX",
        14 => "Nvidia",
        15 => "GeForceRTX",
        16 => "TitanRTX",
        other => return format!("Unknown({other})"),
    };
    name.to_string()
}

/// The architecture string the NVIDIA driver publishes for an NVML `nvmlDeviceArchitecture_t`.
pub fn architecture_name(arch: u32) -> String {
    let name = match arch {
        2 => "Kepler",
        3 => "Maxwell",
        4 => "Pascal",
        5 => "Volta",
        6 => "Turing",
        7 => "Ampere",
        8 => "Ada Lovelace",
        9 => "Hopper",
        10 => "Blackwell",
        u32::MAX => "Unknown",
        other => return format!("Unknown({other})"),
    };
    name.to_string()
}

/// CUDA driver version string from NVML's integer form: `13000` -> `13.0`, `12080` -> `12.8`.
pub fn cuda_driver_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a100_40gb_profile_names_match_the_marketed_ones() {
        let total = 40960 * MIB;
        assert_eq!(profile_name(1, 1, 4864, total, 0x0), "1g.5gb");
        assert_eq!(profile_name(1, 1, 4864, total, 0x7), "1g.5gb+me");
        assert_eq!(profile_name(1, 1, 9856, total, 0x9), "1g.10gb");
        assert_eq!(profile_name(2, 2, 9856, total, 0x1), "2g.10gb");
        assert_eq!(profile_name(3, 3, 19968, total, 0x2), "3g.20gb");
        assert_eq!(profile_name(4, 4, 19968, total, 0x3), "4g.20gb");
        assert_eq!(profile_name(7, 7, 40192, total, 0x4), "7g.40gb");
        assert_eq!(profile_name(3, 1, 19968, total, 0x2), "1c.3g.20gb");
    }

    #[test]
    fn hopper_profile_names_match_the_marketed_ones() {
        let h100 = 81559 * MIB;
        assert_eq!(profile_name(1, 1, 9984, h100, 0x0), "1g.10gb");
        assert_eq!(profile_name(1, 1, 20096, h100, 0x9), "1g.20gb");
        assert_eq!(profile_name(3, 3, 40448, h100, 0x2), "3g.40gb");
        assert_eq!(profile_name(7, 7, 81152, h100, 0x4), "7g.80gb");
        let h200 = 143771 * MIB;
        assert_eq!(profile_name(1, 1, 16384, h200, 0x0), "1g.18gb");
        assert_eq!(profile_name(2, 2, 33024, h200, 0x1), "2g.35gb");
        assert_eq!(profile_name(3, 3, 71168, h200, 0x2), "3g.71gb");
        assert_eq!(profile_name(7, 7, 143104, h200, 0x4), "7g.141gb");
    }

    #[test]
    fn zero_parent_memory_does_not_divide_by_zero() {
        assert_eq!(profile_memory_gb(4864, 0), 0);
    }

    #[test]
    fn suffixes_follow_the_profile_index() {
        assert_eq!(profile_suffix(0x7), "+me");
        assert_eq!(profile_suffix(0x8), "+me");
        assert_eq!(profile_suffix(0xF), "+me.all");
        assert_eq!(profile_suffix(0xD), "-me");
        assert_eq!(profile_suffix(0xA), "+gfx");
        assert_eq!(profile_suffix(0x9), "");
    }

    #[test]
    fn device_name_form_of_profiles() {
        assert_eq!(profile_for_device_name("1g.5gb"), "1g5gb");
        assert_eq!(profile_for_device_name("1g.5gb+me"), "1g5gb-me");
        assert_eq!(profile_for_device_name("1g.10gb+me.all"), "1g10gb-meall");
        assert_eq!(profile_for_device_name("1c.3g.20gb"), "1c3g20gb");
    }

    #[test]
    fn pci_bus_ids_are_canonicalised() {
        assert_eq!(
            canonical_pci_bus_id("00000000:07:00.0").as_deref(),
            Some("0000:07:00.0")
        );
        assert_eq!(
            canonical_pci_bus_id("0000:B7:1F.7").as_deref(),
            Some("0000:b7:1f.7")
        );
        assert_eq!(
            canonical_pci_bus_id("00010000:07:00.0").as_deref(),
            Some("10000:07:00.0")
        );
        assert_eq!(canonical_pci_bus_id("07:00.0"), None);
        assert_eq!(canonical_pci_bus_id("0000:07:00.9"), None);
        assert_eq!(canonical_pci_bus_id("zz:07:00.0"), None);
    }

    #[test]
    fn brand_architecture_and_cuda_strings() {
        assert_eq!(brand_name(14), "Nvidia");
        assert_eq!(brand_name(2), "Tesla");
        assert_eq!(brand_name(15), "GeForceRTX");
        assert_eq!(brand_name(99), "Unknown(99)");
        assert_eq!(architecture_name(7), "Ampere");
        assert_eq!(architecture_name(8), "Ada Lovelace");
        assert_eq!(architecture_name(9), "Hopper");
        assert_eq!(architecture_name(6), "Turing");
        assert_eq!(architecture_name(42), "Unknown(42)");
        assert_eq!(cuda_driver_version(13000), "13.0");
        assert_eq!(cuda_driver_version(12080), "12.8");
    }
}
