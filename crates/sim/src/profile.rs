//! Fleet profiles: the immutable description of a simulated host's GPUs.
//!
//! Built-in profiles are JSON files under `profiles/` embedded at compile time; any other
//! profile is loaded from a path with the same schema. A profile is validated once when it
//! is loaded (MIG tables exist, initial MIG instances sit on valid, non-overlapping
//! placements with distinct GPU-instance IDs), so the rest of the simulator can trust it.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::SimError;
use crate::health;
use crate::mig;

/// Built-in profiles: (name, JSON text).
const BUILTIN: &[(&str, &str)] = &[
    ("t4", include_str!("../profiles/t4.json")),
    ("p4", include_str!("../profiles/p4.json")),
    ("rtx4090", include_str!("../profiles/rtx4090.json")),
    (
        "dgx-a100-40gb",
        include_str!("../profiles/dgx-a100-40gb.json"),
    ),
    ("dgx-h100", include_str!("../profiles/dgx-h100.json")),
    ("h200", include_str!("../profiles/h200.json")),
    (
        "h100-usr-local-nvidia",
        include_str!("../profiles/h100-usr-local-nvidia.json"),
    ),
    (
        "a100-pcie-x4-nvlink",
        include_str!("../profiles/a100-pcie-x4-nvlink.json"),
    ),
    (
        "h100-pcie-x8-nvlink",
        include_str!("../profiles/h100-pcie-x8-nvlink.json"),
    ),
    ("l40s-x8", include_str!("../profiles/l40s-x8.json")),
    ("dgx1-v100", include_str!("../profiles/dgx1-v100.json")),
    (
        "hgx-a100-80gb-x4",
        include_str!("../profiles/hgx-a100-80gb-x4.json"),
    ),
];

/// Names of the built-in profiles, in listing order.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// A simulated host: driver versions and GPUs in NVML index order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Profile {
    /// Profile name (`dgx-a100-40gb`).
    pub name: String,
    /// One-line description.
    #[serde(default)]
    pub description: String,
    /// Kernel driver version, e.g. `580.95.05`.
    pub driver_version: String,
    /// CUDA driver version as NVML encodes it (`13000` = 13.0).
    pub cuda_driver_version: u32,
    /// GPUs, in NVML index order.
    pub gpus: Vec<GpuSpec>,
    /// Where the driver's files are installed under the root.
    #[serde(default, skip_serializing_if = "DriverLayout::is_default")]
    pub driver_layout: DriverLayout,
    /// PCI bus IDs of the host's NVSwitches (HGX/DGX baseboards), which GPUs' `nvlinks`
    /// entries name by position; NVML reports them as the remote end of those links. Like on
    /// real nodes they are not NVML devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvswitches: Vec<String>,
}

/// How the driver's user-space files are laid out on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DriverLayout {
    /// A distribution package: libraries in `usr/lib/x86_64-linux-gnu`, tools in `usr/bin`,
    /// firmware in `lib/firmware`; the NVML library, `libcuda` and the PTX JIT compiler only.
    #[default]
    Distro,
    /// `/usr/local/nvidia/{lib64,bin,firmware}` with the 26 libraries and 5 tools of driver
    /// 580 (as on the H100 host of `real-hosts/h100-driver-580`, a cloud-installed driver).
    UsrLocalNvidia,
}

impl DriverLayout {
    fn is_default(&self) -> bool {
        *self == DriverLayout::Distro
    }

    /// Library folder under the root.
    pub fn lib_dir(self) -> &'static str {
        match self {
            DriverLayout::Distro => "usr/lib/x86_64-linux-gnu",
            DriverLayout::UsrLocalNvidia => "usr/local/nvidia/lib64",
        }
    }

    /// Tool folder under the root.
    pub fn bin_dir(self) -> &'static str {
        match self {
            DriverLayout::Distro => "usr/bin",
            DriverLayout::UsrLocalNvidia => "usr/local/nvidia/bin",
        }
    }

    /// Firmware folder under the root (the kernel's firmware search path).
    pub fn firmware_dir(self) -> &'static str {
        match self {
            DriverLayout::Distro => "lib/firmware",
            DriverLayout::UsrLocalNvidia => "usr/local/nvidia/firmware",
        }
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSpec {
    /// Product name (`NVIDIA A100-SXM4-40GB`).
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// Board serial; `null` where NVML reports "not supported" (GeForce boards).
    pub serial: Option<String>,
    /// Device minor number (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Brand name: `NVIDIA`, `GeForce`, `Tesla`, `Quadro`, `Titan`, `NvidiaRTX`.
    pub brand: String,
    /// Architecture: `Kepler` .. `Blackwell` (`Ada` for Ada Lovelace).
    pub architecture: String,
    /// CUDA compute capability `major.minor`.
    pub compute_capability: String,
    /// Total framebuffer memory in MiB (`nvidia-smi --query-gpu=memory.total`).
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// PCI bus ID with an 8-digit domain, upper-case hex: `00000000:07:00.0`.
    pub pci_bus_id: String,
    /// Combined device and vendor ID, hex string: `0x20B010DE`.
    pub pci_device_id: String,
    /// Combined subsystem ID, hex string.
    pub pci_sub_system_id: String,
    /// PCIe root complex directory name in sysfs: `pci0000:00`.
    pub pcie_root: String,
    /// NUMA node of the GPU.
    pub numa_node: u32,
    /// MIG table name (see [`mig::TABLE_NAMES`]); absent for GPUs without MIG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_table: Option<String>,
    /// Whether MIG mode is enabled at boot.
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG devices present at boot (only when `migEnabled`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<MigInstanceSpec>,
    /// Whether `nvidia-smi compute-policy --set-timeslice` is supported (false on Pascal
    /// boards such as the Tesla P4).
    #[serde(default = "yes")]
    pub timeslice_supported: bool,
    /// `nvmlDeviceGetSupportedEventTypes` (`nvmlEventType*` bits); default
    /// [`health::DEFAULT_SUPPORTED_EVENTS`] (ECC, P-state, XID, clock, power source).
    #[serde(default = "default_supported_events")]
    pub supported_event_types: u64,
    /// The GPU's NVLink links, grouped by remote end, in link-number order (see
    /// [`crate::topology`]); empty for a GPU without NVLink.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlinks: Vec<NvLinkSpec>,
    /// Name of the PCIe switch the GPU sits under, when it shares one with other GPUs (`PIX`
    /// between them); GPUs under one root complex but different switches are `PXB`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_switch: Option<String>,
    /// CPUs local to the GPU as `nvidia-smi topo -m` prints them (`0-23,48-71`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_affinity: Option<String>,
    /// `nvmlDeviceGetModuleId`: the GPU's module on its baseboard (1..); 0 for boards that
    /// are not on a baseboard, as NVML documents.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub module_id: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// A bonded set of NVLink links from a GPU to one remote end: a peer GPU (by PCI bus ID) or an
/// NVSwitch (by its position in the profile's `nvswitches`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NvLinkSpec {
    /// PCI bus ID of the peer GPU (an NVLink bridge or a direct link on the board).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// Index of the NVSwitch in the profile's `nvswitches`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch: Option<usize>,
    /// Number of links to that end.
    pub links: u32,
}

/// Most NVLink links per GPU: `NVML_NVLINK_MAX_LINKS` of the NVML headers the Rust bindings
/// carry (18; CUDA 13.3's header says 36).
pub const MAX_NVLINKS: u32 = 18;

fn yes() -> bool {
    true
}

fn default_supported_events() -> u64 {
    health::DEFAULT_SUPPORTED_EVENTS
}

/// A MIG device (a GPU instance with its full-size compute instance) present at boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigInstanceSpec {
    /// GPU-instance profile ID (19 = 1g, 14 = 2g, 9 = 3g, ...).
    pub profile_id: u32,
    /// Placement start in memory slices.
    pub placement_start: u32,
    /// GPU-instance ID (0..=14; real drivers assign these unrelated to placements).
    pub gpu_instance_id: u32,
    /// Compute-instance ID (0..=7).
    #[serde(default)]
    pub compute_instance_id: u32,
}

/// Decoded PCI location of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddress {
    /// PCI domain.
    pub domain: u32,
    /// Bus number.
    pub bus: u32,
    /// Device number.
    pub device: u32,
    /// Function number.
    pub function: u32,
}

impl PciAddress {
    /// Parses `DDDDDDDD:BB:DD.F`, `DDDD:BB:DD.F` or `BB:DD.F` (hex, any case).
    pub fn parse(s: &str) -> Option<PciAddress> {
        let (rest, function) = s.rsplit_once('.')?;
        let mut parts: Vec<&str> = rest.split(':').collect();
        let domain = if parts.len() == 3 {
            parts.remove(0)
        } else {
            "0"
        };
        if parts.len() != 2 {
            return None;
        }
        let hex = |v: &str| u32::from_str_radix(v, 16).ok();
        Some(PciAddress {
            domain: hex(domain)?,
            bus: hex(parts[0])?,
            device: hex(parts[1])?,
            function: hex(function)?,
        })
    }

    /// `00000000:07:00.0` (the NVML `busId` and nvidia-smi form).
    pub fn long(&self) -> String {
        format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }

    /// `0000:07:00.0` (the NVML `busIdLegacy` form).
    pub fn legacy(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }

    /// `0000:07:00.0` in lower case, as sysfs names devices.
    pub fn sysfs(&self) -> String {
        self.legacy().to_ascii_lowercase()
    }
}

impl GpuSpec {
    /// Parsed PCI address (validated at load).
    pub fn pci(&self) -> PciAddress {
        PciAddress::parse(&self.pci_bus_id).unwrap_or(PciAddress {
            domain: 0,
            bus: 0,
            device: 0,
            function: 0,
        })
    }

    /// Compute capability as (major, minor) (validated at load).
    pub fn cc(&self) -> (i32, i32) {
        parse_cc(&self.compute_capability).unwrap_or((0, 0))
    }

    /// The GPU's MIG table, if MIG capable.
    pub fn mig_profiles(&self) -> Option<&'static [mig::GiProfile]> {
        self.mig_table.as_deref().and_then(mig::table)
    }

    /// Streaming multiprocessors of the whole GPU, as CUDA's
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT` reports them: the product's count for the
    /// boards of the built-in profiles (by PCI device ID), else the largest MIG profile's,
    /// else [`DEFAULT_MULTIPROCESSORS`].
    pub fn multiprocessors(&self) -> u32 {
        let id = pci_id(&self.pci_device_id);
        if let Some((_, sms)) = MULTIPROCESSORS.iter().find(|(pci, _)| *pci == id) {
            return *sms;
        }
        self.mig_profiles()
            .and_then(|t| t.iter().map(|p| p.multiprocessors).max())
            .unwrap_or(DEFAULT_MULTIPROCESSORS)
    }

    /// NVML brand enum value (`nvmlBrandType_t`).
    pub fn brand_value(&self) -> u32 {
        brand_value(&self.brand).unwrap_or(0)
    }

    /// NVML architecture enum value (`nvmlDeviceArchitecture_t`).
    pub fn architecture_value(&self) -> u32 {
        architecture_value(&self.architecture).unwrap_or(0xffff_ffff)
    }
}

/// SM counts of whole GPUs by combined PCI device ID: Tesla P4 (20), T4 (40), A100 SXM4
/// (108; 98 usable in MIG mode), H100 SXM5 (132), H100 PCIe (114), H200 (132), GeForce RTX
/// 4090 (128), L40S (142), Tesla V100 SXM2 (80).
const MULTIPROCESSORS: &[(u32, u32)] = &[
    (0x1BB3_10DE, 20),
    (0x1DB1_10DE, 80),
    (0x2331_10DE, 114),
    (0x26B9_10DE, 142),
    (0x1EB8_10DE, 40),
    (0x20B0_10DE, 108),
    (0x20B2_10DE, 108),
    (0x20F1_10DE, 108),
    (0x2330_10DE, 132),
    (0x2335_10DE, 132),
    (0x2684_10DE, 128),
];

/// SMs of a GPU in a profile file whose board is in neither table.
pub const DEFAULT_MULTIPROCESSORS: u32 = 80;

fn parse_cc(s: &str) -> Option<(i32, i32)> {
    let (a, b) = s.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.strip_prefix("0x")?, 16).ok()
}

/// Parses a `0x`-prefixed hex PCI ID.
pub fn pci_id(s: &str) -> u32 {
    parse_hex(s).unwrap_or(0)
}

const BRANDS: &[(&str, u32)] = &[
    ("Quadro", 1),
    ("Tesla", 2),
    ("NVS", 3),
    ("GeForce", 5),
    ("Titan", 6),
    ("NvidiaRTX", 13),
    ("NVIDIA", 14),
];

const ARCHITECTURES: &[(&str, u32)] = &[
    ("Kepler", 2),
    ("Maxwell", 3),
    ("Pascal", 4),
    ("Volta", 5),
    ("Turing", 6),
    ("Ampere", 7),
    ("Ada", 8),
    ("Hopper", 9),
    ("Blackwell", 10),
];

fn brand_value(s: &str) -> Option<u32> {
    BRANDS.iter().find(|(n, _)| *n == s).map(|(_, v)| *v)
}

fn architecture_value(s: &str) -> Option<u32> {
    ARCHITECTURES.iter().find(|(n, _)| *n == s).map(|(_, v)| *v)
}

impl Profile {
    /// Loads a built-in profile by name, or a JSON file when `name_or_path` names one
    /// (contains a `/` or ends in `.json`).
    pub fn load(name_or_path: &str) -> Result<Profile, SimError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return Profile::from_json(text, name_or_path);
        }
        if name_or_path.contains('/') || name_or_path.ends_with(".json") {
            let path = Path::new(name_or_path);
            let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            return Profile::from_json(&text, name_or_path);
        }
        Err(SimError::UnknownProfile {
            name: name_or_path.to_string(),
            known: builtin_names().join(", "),
        })
    }

    /// Parses and validates a profile; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Profile, SimError> {
        let profile: Profile =
            serde_json::from_str(text).map_err(|e| SimError::InvalidProfile {
                origin: origin.to_string(),
                field: "$".to_string(),
                message: e.to_string(),
            })?;
        profile.validate(origin)?;
        Ok(profile)
    }

    /// Checks the invariants the rest of the simulator relies on.
    pub fn validate(&self, origin: &str) -> Result<(), SimError> {
        let bad = |field: String, message: String| SimError::InvalidProfile {
            origin: origin.to_string(),
            field,
            message,
        };
        if self.gpus.is_empty() {
            return Err(bad("gpus".into(), "at least one GPU is required".into()));
        }
        for (k, bus) in self.nvswitches.iter().enumerate() {
            if PciAddress::parse(bus).is_none() {
                return Err(bad(
                    format!("nvswitches[{k}]"),
                    format!("{bus:?} is not a PCI address like 00000000:C4:00.0"),
                ));
            }
        }
        let mut uuids = BTreeSet::new();
        let mut minors = BTreeSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            let f = |name: &str| format!("gpus[{i}].{name}");
            if !is_gpu_uuid(&g.uuid) {
                return Err(bad(
                    f("uuid"),
                    format!(
                        "{:?} is not of the form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                        g.uuid
                    ),
                ));
            }
            if !uuids.insert(g.uuid.clone()) {
                return Err(bad(f("uuid"), format!("{} is used twice", g.uuid)));
            }
            if !minors.insert(g.minor) {
                return Err(bad(f("minor"), format!("minor {} is used twice", g.minor)));
            }
            if g.minor > 31 {
                return Err(bad(f("minor"), "must be at most 31".into()));
            }
            if PciAddress::parse(&g.pci_bus_id).is_none() {
                return Err(bad(
                    f("pciBusId"),
                    format!(
                        "{:?} is not a PCI address like 00000000:07:00.0",
                        g.pci_bus_id
                    ),
                ));
            }
            for (name, v) in [
                ("pciDeviceId", &g.pci_device_id),
                ("pciSubSystemId", &g.pci_sub_system_id),
            ] {
                if parse_hex(v).is_none() {
                    return Err(bad(
                        f(name),
                        format!("{v:?} is not a hex ID like 0x20B010DE"),
                    ));
                }
            }
            if !g.pcie_root.starts_with("pci") || g.pcie_root.contains('/') {
                return Err(bad(
                    f("pcieRoot"),
                    format!("{:?} is not a sysfs root name like pci0000:00", g.pcie_root),
                ));
            }
            if parse_cc(&g.compute_capability).is_none() {
                return Err(bad(f("computeCapability"), "must look like 8.0".into()));
            }
            if brand_value(&g.brand).is_none() {
                let names: Vec<&str> = BRANDS.iter().map(|(n, _)| *n).collect();
                return Err(bad(
                    f("brand"),
                    format!("must be one of {}", names.join(", ")),
                ));
            }
            if g.supported_event_types & !health::event_type::ALL != 0 {
                return Err(bad(
                    f("supportedEventTypes"),
                    format!(
                        "{:#x} has bits no NVML event type uses (valid bits: {:#x})",
                        g.supported_event_types,
                        health::event_type::ALL
                    ),
                ));
            }
            if architecture_value(&g.architecture).is_none() {
                let names: Vec<&str> = ARCHITECTURES.iter().map(|(n, _)| *n).collect();
                return Err(bad(
                    f("architecture"),
                    format!("must be one of {}", names.join(", ")),
                ));
            }
            self.validate_nvlinks(i, g)
                .map_err(|(field, message)| bad(field, message))?;
            let table = match &g.mig_table {
                None => {
                    if g.mig_enabled || !g.mig_instances.is_empty() {
                        return Err(bad(
                            f("migEnabled"),
                            "MIG needs a migTable (the GPU is not MIG capable)".into(),
                        ));
                    }
                    continue;
                }
                Some(t) => mig::table(t).ok_or_else(|| {
                    bad(
                        f("migTable"),
                        format!(
                            "unknown table {t:?}; known: {}",
                            mig::TABLE_NAMES.join(", ")
                        ),
                    )
                })?,
            };
            if !g.mig_enabled && !g.mig_instances.is_empty() {
                return Err(bad(
                    f("migInstances"),
                    "MIG instances need migEnabled: true".into(),
                ));
            }
            let mut used: Vec<(u32, u32)> = Vec::new();
            let mut gi_ids = BTreeSet::new();
            for (j, m) in g.mig_instances.iter().enumerate() {
                let mf = |name: &str| format!("gpus[{i}].migInstances[{j}].{name}");
                let p = mig::by_id(table, m.profile_id).ok_or_else(|| {
                    let ids: Vec<String> = table.iter().map(|p| p.id.to_string()).collect();
                    bad(
                        mf("profileId"),
                        format!(
                            "unknown profile ID {}; valid: {}",
                            m.profile_id,
                            ids.join(", ")
                        ),
                    )
                })?;
                if !p.is_valid_start(m.placement_start) {
                    return Err(bad(
                        mf("placementStart"),
                        format!(
                            "{} is not a placement of {}; valid: {:?}",
                            m.placement_start, p.name, p.placement_starts
                        ),
                    ));
                }
                if used
                    .iter()
                    .any(|(s, z)| mig::overlaps(*s, *z, m.placement_start, p.placement_size))
                {
                    return Err(bad(
                        mf("placementStart"),
                        "overlaps another MIG instance".into(),
                    ));
                }
                used.push((m.placement_start, p.placement_size));
                if m.gpu_instance_id > 14 || !gi_ids.insert(m.gpu_instance_id) {
                    return Err(bad(
                        mf("gpuInstanceId"),
                        "must be unique on the GPU and at most 14".into(),
                    ));
                }
                if m.compute_instance_id > 7 {
                    return Err(bad(mf("computeInstanceId"), "must be at most 7".into()));
                }
            }
        }
        Ok(())
    }
}

impl Profile {
    /// NVLink entries of GPU `i`: each names one existing end, peers list each other with the
    /// same link count, and the GPU has at most [`MAX_NVLINKS`] links. Errors are
    /// (field path, message).
    fn validate_nvlinks(&self, i: usize, g: &GpuSpec) -> Result<(), (String, String)> {
        let mut total = 0u32;
        for (j, l) in g.nvlinks.iter().enumerate() {
            let f = |name: &str| format!("gpus[{i}].nvlinks[{j}].{name}");
            if l.links == 0 {
                return Err((f("links"), "must be at least 1".into()));
            }
            total += l.links;
            match (&l.gpu, l.switch) {
                (Some(bus), None) => {
                    let want = PciAddress::parse(bus);
                    let Some(peer) = self.gpus.iter().find(|p| Some(p.pci()) == want) else {
                        return Err((f("gpu"), format!("no GPU of the profile has bus ID {bus}")));
                    };
                    if peer.pci() == g.pci() {
                        return Err((f("gpu"), "a GPU has no NVLink to itself".into()));
                    }
                    let back: u32 = peer
                        .nvlinks
                        .iter()
                        .filter(|b| b.gpu.as_deref().and_then(PciAddress::parse) == Some(g.pci()))
                        .map(|b| b.links)
                        .sum();
                    let here: u32 = g
                        .nvlinks
                        .iter()
                        .filter(|b| b.gpu.as_deref().and_then(PciAddress::parse) == want)
                        .map(|b| b.links)
                        .sum();
                    if back != here {
                        return Err((
                            f("gpu"),
                            format!("{bus} lists {back} links back, this GPU {here}"),
                        ));
                    }
                }
                (None, Some(n)) if n < self.nvswitches.len() => {}
                (None, Some(n)) => {
                    return Err((
                        f("switch"),
                        format!(
                            "the profile has {} nvswitches, not {}",
                            self.nvswitches.len(),
                            n + 1
                        ),
                    ));
                }
                _ => return Err((f("gpu"), "exactly one of gpu and switch is required".into())),
            }
        }
        if total > MAX_NVLINKS {
            return Err((
                format!("gpus[{i}].nvlinks"),
                format!("{total} links; NVML reports at most {MAX_NVLINKS}"),
            ));
        }
        Ok(())
    }
}

/// Whether `s` is `GPU-` followed by an 8-4-4-4-12 hex UUID.
pub fn is_gpu_uuid(s: &str) -> bool {
    s.strip_prefix("GPU-").is_some_and(is_uuid_body)
}

/// Whether `s` is an 8-4-4-4-12 lower- or upper-case hex string.
pub fn is_uuid_body(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_loads() {
        for name in builtin_names() {
            let p = Profile::load(name).expect(name);
            assert_eq!(p.name, name);
            let want = if p.driver_layout == DriverLayout::UsrLocalNvidia {
                "580.159.04"
            } else {
                "580.95.05"
            };
            assert_eq!(p.driver_version, want);
            assert_eq!(p.cuda_driver_version, 13000);
        }
    }

    #[test]
    fn dgx_a100_has_the_bus_ids_and_numa_layout_of_a_real_one() {
        let p = Profile::load("dgx-a100-40gb").expect("profile");
        assert_eq!(p.gpus.len(), 8);
        let buses: Vec<String> = p.gpus.iter().map(|g| g.pci().sysfs()).collect();
        assert_eq!(
            buses,
            [
                "0000:07:00.0",
                "0000:0f:00.0",
                "0000:47:00.0",
                "0000:4e:00.0",
                "0000:87:00.0",
                "0000:90:00.0",
                "0000:b7:00.0",
                "0000:bd:00.0"
            ]
        );
        let numa: Vec<u32> = p.gpus.iter().map(|g| g.numa_node).collect();
        // NPS4: four NUMA nodes, two GPUs each, numbered as the real host's `topo -m` shows.
        assert_eq!(numa, [3, 3, 1, 1, 7, 7, 5, 5]);
        // Two GPUs per PCIe root.
        for pair in p.gpus.chunks(2) {
            assert_eq!(pair[0].pcie_root, pair[1].pcie_root);
        }
        assert_ne!(p.gpus[0].pcie_root, p.gpus[2].pcie_root);
        for (i, g) in p.gpus.iter().enumerate() {
            assert_eq!(g.mig_enabled, i < 4);
            assert_eq!(g.mig_instances.len(), if i < 4 { 4 } else { 0 });
            // GI IDs are not placements.
            for m in &g.mig_instances {
                assert_ne!(m.gpu_instance_id, m.placement_start);
            }
        }
    }

    #[test]
    fn overlapping_instances_are_rejected_with_a_field_path() {
        let mut p = Profile::load("dgx-a100-40gb").expect("profile");
        p.gpus[1].mig_instances[3].placement_start = 4;
        let text = serde_json::to_string(&p).expect("json");
        let err = Profile::from_json(&text, "x.json").expect_err("overlap");
        let msg = err.to_string();
        assert!(
            msg.contains("gpus[1].migInstances[3].placementStart"),
            "{msg}"
        );
        assert!(msg.contains("overlaps"), "{msg}");
    }

    #[test]
    fn supported_event_types_default_and_are_checked() {
        for name in builtin_names() {
            let p = Profile::load(name).expect(name);
            assert!(
                p.gpus.iter().all(|g| g.supported_event_types == 0x9F),
                "{name}"
            );
        }
        let mut p = Profile::load("t4").expect("t4");
        p.gpus[0].supported_event_types = 0x20;
        let text = serde_json::to_string(&p).expect("json");
        let err = Profile::from_json(&text, "x.json").expect_err("bit 0x20");
        assert!(
            err.to_string().contains("gpus[0].supportedEventTypes"),
            "{err}"
        );
    }

    #[test]
    fn nvlinks_must_name_an_existing_end_and_agree_both_ways() {
        let mut p = Profile::load("a100-pcie-x4-nvlink").expect("profile");
        p.gpus[0].nvlinks[0].links = 4;
        let err = Profile::from_json(&serde_json::to_string(&p).expect("json"), "x.json")
            .expect_err("asymmetric");
        assert!(err.to_string().contains("gpus[0].nvlinks[0].gpu"), "{err}");
        let mut p = Profile::load("dgx-h100").expect("profile");
        p.gpus[2].nvlinks[1].switch = Some(9);
        let err = Profile::from_json(&serde_json::to_string(&p).expect("json"), "x.json")
            .expect_err("no such switch");
        assert!(
            err.to_string().contains("gpus[2].nvlinks[1].switch"),
            "{err}"
        );
        p.gpus[2].nvlinks[1].switch = Some(1);
        p.gpus[2].nvlinks[1].links = 15;
        let err = Profile::from_json(&serde_json::to_string(&p).expect("json"), "x.json")
            .expect_err("too many links");
        assert!(err.to_string().contains("at most 18"), "{err}");
    }

    #[test]
    fn unknown_profile_lists_the_known_ones() {
        let err = Profile::load("a100").expect_err("unknown");
        assert!(err.to_string().contains("dgx-a100-40gb"), "{err}");
    }

    #[test]
    fn pci_addresses_parse_in_every_form() {
        let want = PciAddress {
            domain: 0,
            bus: 0xb7,
            device: 0,
            function: 0,
        };
        for s in ["00000000:B7:00.0", "0000:b7:00.0", "b7:00.0"] {
            assert_eq!(PciAddress::parse(s), Some(want), "{s}");
        }
        assert_eq!(want.long(), "00000000:B7:00.0");
        assert_eq!(want.legacy(), "0000:B7:00.0");
        assert_eq!(want.sysfs(), "0000:b7:00.0");
        assert_eq!(PciAddress::parse("zz:00.0"), None);
        assert_eq!(PciAddress::parse("07:00"), None);
    }
}
