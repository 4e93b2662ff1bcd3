//! Inventory -> ResourceSlices: the devices, attributes and capacities the scheduler sees.
//!
//! Pure: no I/O, no clock. The output is a function of the inventory, the node and driver names
//! and the pool generation only, so the publisher can compare it with what the API server holds.
//!
//! Compatibility contract (selectors written for the NVIDIA driver must select the same
//! devices): device names `gpu-<minor>` and
//! `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`, and the attribute and capacity
//! names below. A GPU with MIG enabled is published as its MIG devices only; a GPU the admin
//! marks for dynamic MIG is published as partitionable devices by
//! [`crate::dynamic_mig::render_pool`], which renders every other GPU through this module.
//!
//! API limits honoured here:
//! - at most [`MAX_DEVICES_PER_SLICE`] devices per slice: devices are split, in publication
//!   order, into slices named `<node>-<driver with dots as dashes>-<n>` (n from 0), every slice
//!   carrying the same pool generation and the pool's slice count;
//! - at most [`MAX_ATTRIBUTES_AND_CAPACITIES`] attributes plus capacities per device: the
//!   optional `memorySlice<i>` capacities are dropped first if a device would exceed it;
//! - string attributes at most [`MAX_STRING_LENGTH`] bytes: a longer value is **left out**
//!   (never truncated, so a selector can never match a value the hardware does not have) and a
//!   [`RenderWarning`] says so; a version that is not semver-compatible is left out likewise.

use std::collections::BTreeMap;

use gpu_dra_api::quantity::Format;
use gpu_dra_device::{DeviceRef, Gpu, Inventory, MigDevice};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// Most devices one ResourceSlice may hold (without taints, counters or list attributes).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most devices one ResourceSlice may hold when any of them has taints, counters or list
/// attributes.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS: usize = 64;
/// Most attributes plus capacities one device may have.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string attribute value the API accepts.
pub const MAX_STRING_LENGTH: usize = 64;
/// Longest object name (DNS subdomain).
pub const MAX_NAME_LENGTH: usize = 253;

/// Attribute names (unqualified ones are qualified with the driver name by the API).
pub mod attr {
    /// `gpu` or `mig`.
    pub const TYPE: &str = "type";
    /// Device UUID.
    pub const UUID: &str = "uuid";
    /// Parent GPU UUID of a MIG device.
    pub const PARENT_UUID: &str = "parentUUID";
    /// MIG profile, e.g. `1g.5gb`.
    pub const PROFILE: &str = "profile";
    /// Marketing name.
    pub const PRODUCT_NAME: &str = "productName";
    /// Brand.
    pub const BRAND: &str = "brand";
    /// Architecture.
    pub const ARCHITECTURE: &str = "architecture";
    /// CUDA compute capability (version).
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    /// Kernel driver version (version).
    pub const DRIVER_VERSION: &str = "driverVersion";
    /// CUDA driver version (version).
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// Standard PCI bus ID attribute.
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    /// Standard PCIe root attribute.
    pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    /// Standard NUMA node attribute.
    pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
    /// Memory addressing mode (`HMM`, `ATS`, `None`), where NVML reports one.
    pub const ADDRESSING_MODE: &str = "addressingMode";
    /// The whole GPU's NVLink domain: GPUs sharing a value are pairwise NVLink peers
    /// ([`crate::topology`]); absent without NVLink peers.
    pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
}

/// Capacity names.
pub mod cap {
    /// Memory in bytes.
    pub const MEMORY: &str = "memory";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    /// Copy engines.
    pub const COPY_ENGINES: &str = "copyEngines";
    /// Video decoders.
    pub const DECODERS: &str = "decoders";
    /// Video encoders.
    pub const ENCODERS: &str = "encoders";
    /// JPEG engines.
    pub const JPEG_ENGINES: &str = "jpegEngines";
    /// Optical flow accelerators.
    pub const OFA_ENGINES: &str = "ofaEngines";
    /// Prefix of the per-memory-slice capacities of a MIG device (`memorySlice0`...).
    pub const MEMORY_SLICE_PREFIX: &str = "memorySlice";
    /// Shares of a device in NVIDIA's `<N>` consumable-shares mode
    /// ([`crate::consumable_shares`]).
    pub const SHARES: &str = "shares";
}

/// The value type of an attribute, as the API stores it (`string`, `int`, `bool`, `version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttributeType {
    /// A string of at most [`MAX_STRING_LENGTH`] bytes.
    String,
    /// A 64-bit integer.
    Int,
    /// A boolean.
    Bool,
    /// A semantic version (`semver(...)` in CEL).
    Version,
}

impl AttributeType {
    /// The API's name for the type.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::String => "string",
            Self::Int => "int",
            Self::Bool => "bool",
            Self::Version => "version",
        }
    }
}

/// The two kinds of devices we publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceKind {
    /// A whole GPU (DeviceClass `gpu.nvidia.com`).
    Gpu,
    /// A MIG device (DeviceClass `mig.nvidia.com`).
    Mig,
}

impl DeviceKind {
    /// The value of the `type` attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Mig => "mig",
        }
    }
}

/// One attribute the renderer may publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttributeSpec {
    /// The name as published: unqualified (the driver's domain) or `domain/name`.
    pub name: &'static str,
    /// Its value type.
    pub ty: AttributeType,
    /// The device kinds that carry it.
    pub kinds: &'static [DeviceKind],
    /// False when a device may lack it (hardware or platform does not report it).
    pub always: bool,
}

/// One capacity the renderer may publish (all capacities are quantities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacitySpec {
    /// The name, or for a numbered family (`memorySlice0`, `memorySlice1`...) its prefix.
    pub name: &'static str,
    /// True for a numbered family.
    pub numbered: bool,
    /// The device kinds that carry it.
    pub kinds: &'static [DeviceKind],
}

const BOTH: &[DeviceKind] = &[DeviceKind::Gpu, DeviceKind::Mig];
const GPU: &[DeviceKind] = &[DeviceKind::Gpu];
const MIG: &[DeviceKind] = &[DeviceKind::Mig];

/// Every attribute the renderer publishes, with its type and device kinds: the schema that
/// selector checks use. The renderer asserts each attribute it writes against this table (in
/// debug builds) and a test renders every kind of device and compares both ways, so the two
/// cannot drift.
#[rustfmt::skip]
pub const ATTRIBUTES: &[AttributeSpec] = &[
    AttributeSpec { name: attr::TYPE, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::UUID, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::PARENT_UUID, ty: AttributeType::String, kinds: MIG, always: true },
    AttributeSpec { name: attr::PROFILE, ty: AttributeType::String, kinds: MIG, always: true },
    AttributeSpec { name: attr::PRODUCT_NAME, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::BRAND, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::ARCHITECTURE, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::CUDA_COMPUTE_CAPABILITY, ty: AttributeType::Version, kinds: BOTH, always: true },
    AttributeSpec { name: attr::DRIVER_VERSION, ty: AttributeType::Version, kinds: BOTH, always: true },
    AttributeSpec { name: attr::CUDA_DRIVER_VERSION, ty: AttributeType::Version, kinds: BOTH, always: true },
    AttributeSpec { name: attr::PCI_BUS_ID, ty: AttributeType::String, kinds: BOTH, always: true },
    AttributeSpec { name: attr::PCIE_ROOT, ty: AttributeType::String, kinds: BOTH, always: false },
    AttributeSpec { name: attr::NUMA_NODE, ty: AttributeType::Int, kinds: BOTH, always: false },
    AttributeSpec { name: attr::ADDRESSING_MODE, ty: AttributeType::String, kinds: BOTH, always: false },
    AttributeSpec { name: attr::NVLINK_DOMAIN, ty: AttributeType::String, kinds: GPU, always: false },
];

/// Every capacity the renderer publishes (see [`ATTRIBUTES`]).
#[rustfmt::skip]
pub const CAPACITIES: &[CapacitySpec] = &[
    CapacitySpec { name: cap::MEMORY, numbered: false, kinds: BOTH },
    CapacitySpec { name: cap::MULTIPROCESSORS, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::COPY_ENGINES, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::DECODERS, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::ENCODERS, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::JPEG_ENGINES, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::OFA_ENGINES, numbered: false, kinds: MIG },
    CapacitySpec { name: cap::MEMORY_SLICE_PREFIX, numbered: true, kinds: MIG },
    CapacitySpec { name: cap::SHARES, numbered: false, kinds: BOTH },
];

/// The schema entry of attribute `name` (as published: unqualified or `domain/name`).
pub fn attribute_spec(name: &str) -> Option<&'static AttributeSpec> {
    ATTRIBUTES.iter().find(|a| a.name == name)
}

/// The schema entry of capacity `name`; `memorySlice7` finds the numbered family.
pub fn capacity_spec(name: &str) -> Option<&'static CapacitySpec> {
    CAPACITIES.iter().find(|c| {
        if c.numbered {
            name.strip_prefix(c.name)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        } else {
            c.name == name
        }
    })
}

/// Inputs besides the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceParams<'a> {
    /// Node name: the pool name and `spec.nodeName`.
    pub node_name: &'a str,
    /// Driver name, e.g. `gpu.nvidia.com`.
    pub driver_name: &'a str,
    /// Pool generation written to every slice.
    pub generation: i64,
}

/// Something left out of the slices, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderWarning {
    /// Device name.
    pub device: String,
    /// Attribute or capacity name.
    pub field: String,
    /// Why it was left out.
    pub reason: String,
}

impl std::fmt::Display for RenderWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "device {} {}: {}", self.device, self.field, self.reason)
    }
}

/// The slices of one pool and what had to be left out.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The slices, in name order (`-0`, `-1`, ...).
    pub slices: Vec<ResourceSlice>,
    /// Attributes or capacities left out because they violate an API limit.
    pub warnings: Vec<RenderWarning>,
}

/// Renders every allocatable device of `inventory`, in publication order.
pub fn render_devices(inventory: &Inventory) -> (Vec<Device>, Vec<RenderWarning>) {
    let mut warnings = Vec::new();
    let devices = inventory
        .devices()
        .map(|d| render_device(inventory, d, &mut warnings))
        .collect();
    (devices, warnings)
}

/// Renders the node's pool: devices split into slices of at most [`MAX_DEVICES_PER_SLICE`].
/// An inventory without devices still yields one (empty) slice, so the pool exists and its
/// generation keeps advancing.
pub fn render_slices(inventory: &Inventory, params: &SliceParams<'_>) -> Rendered {
    render_slices_tainted(inventory, params, &BTreeMap::new())
}

/// [`render_slices`] with device taints (device name -> taints, from
/// [`crate::health::HealthView`]). A pool with any tainted device is split into slices of at
/// most [`MAX_DEVICES_PER_SLICE_WITH_TAINTS`], the API's limit for such slices.
pub fn render_slices_tainted(
    inventory: &Inventory,
    params: &SliceParams<'_>,
    taints: &BTreeMap<String, Vec<crate::health::Taint>>,
) -> Rendered {
    let (mut devices, warnings) = render_devices(inventory);
    let chunks = device_chunks(&mut devices, taints, true);
    let count = chunks.len() as i64;
    let slices = chunks
        .into_iter()
        .enumerate()
        .map(|(n, devices)| pool_slice(params, n, count, Some(devices), None))
        .collect();
    Rendered { slices, warnings }
}

/// Sets the taints of `devices` from `taints` and splits them into slice-sized chunks: at most
/// [`MAX_DEVICES_PER_SLICE_WITH_TAINTS`] when any device is tainted or `consumes_counters`,
/// else [`MAX_DEVICES_PER_SLICE`]. No devices give one empty chunk when `keep_empty`, none
/// otherwise.
pub(crate) fn device_chunks(
    devices: &mut [Device],
    taints: &BTreeMap<String, Vec<crate::health::Taint>>,
    keep_empty: bool,
) -> Vec<Vec<Device>> {
    let mut advanced = false;
    for device in devices.iter_mut() {
        if let Some(list) = taints.get(&device.name).filter(|l| !l.is_empty()) {
            advanced = true;
            device.taints = Some(list.iter().map(device_taint).collect());
        }
        advanced |= device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty());
    }
    let per_slice = if advanced {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    if devices.is_empty() {
        return if keep_empty {
            vec![Vec::new()]
        } else {
            Vec::new()
        };
    }
    devices.chunks(per_slice).map(<[Device]>::to_vec).collect()
}

/// Slice `n` of `count` of the node's pool, holding `devices` or `shared_counters` (the API
/// allows one of the two per slice).
pub(crate) fn pool_slice(
    params: &SliceParams<'_>,
    n: usize,
    count: i64,
    devices: Option<Vec<Device>>,
    shared_counters: Option<Vec<CounterSet>>,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(params.node_name, params.driver_name, n)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: params.driver_name.to_string(),
            node_name: Some(params.node_name.to_string()),
            pool: ResourcePool {
                name: params.node_name.to_string(),
                generation: params.generation,
                resource_slice_count: count,
            },
            devices,
            shared_counters,
            ..ResourceSliceSpec::default()
        },
    }
}

/// A taint as the API spells it; `timeAdded` is the condition's start (whole seconds), so an
/// unchanged condition renders identically on every pass.
fn device_taint(t: &crate::health::Taint) -> DeviceTaint {
    DeviceTaint {
        key: t.key.clone(),
        value: t.value.clone(),
        effect: t.effect.as_str().to_string(),
        time_added: k8s_openapi::jiff::Timestamp::from_second(t.since)
            .ok()
            .map(Time),
    }
}

/// The deterministic name of slice `n` of a node's pool: `<node>-<driver, dots as dashes>-<n>`.
/// When that exceeds [`MAX_NAME_LENGTH`], the `<node>-<driver>` prefix is cut and an 8-hex-digit
/// hash of the full prefix is inserted so names stay unique and valid DNS subdomains.
pub fn slice_name(node_name: &str, driver_name: &str, n: usize) -> String {
    let prefix = format!("{node_name}-{}", driver_name.replace('.', "-"));
    let name = format!("{prefix}-{n}");
    if name.len() <= MAX_NAME_LENGTH {
        return name;
    }
    let tail = format!("-{:08x}-{n}", fnv1a(prefix.as_bytes()));
    let keep = MAX_NAME_LENGTH - tail.len();
    // Names are ASCII (DNS subdomains), so byte slicing is on char boundaries; a label must not
    // end with `-` or `.`.
    let cut = prefix[..keep.min(prefix.len())].trim_end_matches(['-', '.']);
    format!("{cut}{tail}")
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

pub(crate) fn render_device(
    inventory: &Inventory,
    device: DeviceRef<'_>,
    warnings: &mut Vec<RenderWarning>,
) -> Device {
    let name = device.name();
    let kind = match device {
        DeviceRef::Gpu(_) => DeviceKind::Gpu,
        DeviceRef::Mig { .. } => DeviceKind::Mig,
    };
    let mut b = DeviceBuilder {
        name: &name,
        kind,
        attributes: BTreeMap::new(),
        capacity: BTreeMap::new(),
        warnings,
    };
    let gpu = device.gpu();
    match device {
        DeviceRef::Gpu(gpu) => {
            b.string(attr::TYPE, DeviceKind::Gpu.as_str());
            b.string(attr::UUID, &gpu.uuid);
            b.capacity(cap::MEMORY, gpu.memory_bytes);
            if !gpu.nvlink_peers.is_empty()
                && let Some(domain) =
                    crate::topology::NvlinkDomains::of(inventory).domain_of(&gpu.uuid)
            {
                b.string(attr::NVLINK_DOMAIN, domain);
            }
        }
        DeviceRef::Mig { parent, mig } => {
            b.string(attr::TYPE, DeviceKind::Mig.as_str());
            b.string(attr::UUID, &mig.uuid);
            b.string(attr::PARENT_UUID, &parent.uuid);
            b.string(attr::PROFILE, &mig.profile);
            mig_capacities(&mut b, mig);
        }
    }
    product_attributes(&mut b, inventory, gpu);
    let DeviceBuilder {
        mut attributes,
        mut capacity,
        ..
    } = b;
    enforce_entry_limit(&name, &mut attributes, &mut capacity, warnings);
    Device {
        name,
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Device::default()
    }
}

fn mig_capacities(b: &mut DeviceBuilder<'_>, mig: &MigDevice) {
    b.capacity(cap::MULTIPROCESSORS, u64::from(mig.multiprocessors));
    b.capacity(cap::COPY_ENGINES, u64::from(mig.copy_engines));
    b.capacity(cap::DECODERS, u64::from(mig.decoders));
    b.capacity(cap::ENCODERS, u64::from(mig.encoders));
    b.capacity(cap::JPEG_ENGINES, u64::from(mig.jpeg_engines));
    b.capacity(cap::OFA_ENGINES, u64::from(mig.ofa_engines));
    b.capacity(cap::MEMORY, mig.memory_bytes);
    // The NVIDIA driver publishes one capacity per occupied memory slice; selectors may use
    // them to ask for a placement.
    let end = mig.placement.start.saturating_add(mig.placement.size);
    for slice in mig.placement.start..end {
        b.capacity(&format!("{}{slice}", cap::MEMORY_SLICE_PREFIX), 1);
    }
}

fn product_attributes(b: &mut DeviceBuilder<'_>, inventory: &Inventory, gpu: &Gpu) {
    b.string(attr::PRODUCT_NAME, &gpu.product_name);
    b.string(attr::BRAND, &gpu.brand);
    b.string(attr::ARCHITECTURE, &gpu.architecture);
    let cc = gpu.cuda_compute_capability;
    b.version(
        attr::CUDA_COMPUTE_CAPABILITY,
        &format!("{}.{}", cc.major, cc.minor),
    );
    b.version(attr::DRIVER_VERSION, &inventory.driver_version);
    b.version(attr::CUDA_DRIVER_VERSION, &inventory.cuda_driver_version);
    b.string(attr::PCI_BUS_ID, &gpu.pci_bus_id);
    if let Some(root) = &gpu.pcie_root {
        b.string(attr::PCIE_ROOT, root);
    }
    if let Some(numa) = gpu.numa_node {
        b.int(attr::NUMA_NODE, numa);
    }
    if let Some(mode) = &gpu.addressing_mode {
        b.string(attr::ADDRESSING_MODE, mode);
    }
}

/// Drops `memorySlice<i>` capacities (highest first) until the device is within the limit.
/// Devices rendered from real inventories never need it (a MIG device has at most 28 entries);
/// this keeps a future attribute from producing a slice the API server rejects.
fn enforce_entry_limit(
    name: &str,
    attributes: &mut BTreeMap<String, DeviceAttribute>,
    capacity: &mut BTreeMap<String, DeviceCapacity>,
    warnings: &mut Vec<RenderWarning>,
) {
    while attributes.len() + capacity.len() > MAX_ATTRIBUTES_AND_CAPACITIES {
        let Some(key) = capacity
            .keys()
            .rev()
            .find(|k| k.starts_with(cap::MEMORY_SLICE_PREFIX))
            .cloned()
        else {
            warnings.push(RenderWarning {
                device: name.to_string(),
                field: "attributes".into(),
                reason: format!(
                    "{} attributes and capacities exceed the API limit of {MAX_ATTRIBUTES_AND_CAPACITIES}",
                    attributes.len() + capacity.len()
                ),
            });
            return;
        };
        capacity.remove(&key);
        warnings.push(RenderWarning {
            device: name.to_string(),
            field: key,
            reason: format!(
                "left out to stay within {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities"
            ),
        });
    }
}

struct DeviceBuilder<'a> {
    name: &'a str,
    kind: DeviceKind,
    attributes: BTreeMap<String, DeviceAttribute>,
    capacity: BTreeMap<String, DeviceCapacity>,
    warnings: &'a mut Vec<RenderWarning>,
}

impl DeviceBuilder<'_> {
    fn warn(&mut self, field: &str, reason: String) {
        self.warnings.push(RenderWarning {
            device: self.name.to_string(),
            field: field.to_string(),
            reason,
        });
    }

    /// Every attribute written goes through here: it must be in [`ATTRIBUTES`] with this type
    /// for this kind of device.
    fn check_attribute(&self, key: &str, ty: AttributeType) {
        debug_assert!(
            attribute_spec(key).is_some_and(|a| a.ty == ty && a.kinds.contains(&self.kind)),
            "attribute {key} ({ty:?}) on a {:?} device is not in slices::ATTRIBUTES",
            self.kind
        );
    }

    fn int(&mut self, key: &str, value: i64) {
        self.check_attribute(key, AttributeType::Int);
        self.attributes.insert(
            key.to_string(),
            DeviceAttribute {
                int: Some(value),
                ..DeviceAttribute::default()
            },
        );
    }

    fn string(&mut self, key: &str, value: &str) {
        self.check_attribute(key, AttributeType::String);
        if value.len() > MAX_STRING_LENGTH {
            self.warn(
                key,
                format!(
                    "value {value:?} is {} bytes, over the API limit of {MAX_STRING_LENGTH}; left out",
                    value.len()
                ),
            );
            return;
        }
        self.attributes.insert(
            key.to_string(),
            DeviceAttribute {
                string: Some(value.to_string()),
                ..DeviceAttribute::default()
            },
        );
    }

    fn version(&mut self, key: &str, value: &str) {
        self.check_attribute(key, AttributeType::Version);
        match semver_normalize(value) {
            Some(v) if v.len() <= MAX_STRING_LENGTH => {
                self.attributes.insert(
                    key.to_string(),
                    DeviceAttribute {
                        version: Some(v),
                        ..DeviceAttribute::default()
                    },
                );
            }
            _ => self.warn(
                key,
                format!("{value:?} is not a version (major[.minor[.patch]]); left out"),
            ),
        }
    }

    fn capacity(&mut self, key: &str, value: u64) {
        debug_assert!(
            capacity_spec(key).is_some_and(|c| c.kinds.contains(&self.kind)),
            "capacity {key} on a {:?} device is not in slices::CAPACITIES",
            self.kind
        );
        self.capacity.insert(
            key.to_string(),
            DeviceCapacity {
                value: capacity_quantity(value),
                request_policy: None,
            },
        );
    }
}

/// A capacity of `value` units in the canonical form the API server returns for it (binary
/// SI: `40Gi`, `4864Mi`, `14`), written by the api crate's one quantity implementation.
pub fn capacity_quantity(value: u64) -> Quantity {
    Quantity(gpu_dra_api::quantity::Quantity::from_u64(value, Format::BinarySi).to_string())
}

/// Normalises a loose version the way the NVIDIA driver does (Masterminds semver, lenient): an
/// optional `v`, one to three numeric parts (missing ones are 0, leading zeros dropped: `13.0` ->
/// `13.0.0`, `580.95.05` -> `580.95.5`), then an optional `-prerelease` and `+build` kept as
/// they are. `None` when it is not of that form.
pub fn semver_normalize(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let raw = raw.strip_prefix('v').unwrap_or(raw);
    let (rest, build) = match raw.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (raw, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let parts: Vec<&str> = core.split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut nums = [0u64; 3];
    for (slot, part) in nums.iter_mut().zip(&parts) {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *slot = part.parse().ok()?;
    }
    let ident_ok = |s: &str| {
        !s.is_empty()
            && s.split('.').all(|id| {
                !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
    };
    let mut out = format!("{}.{}.{}", nums[0], nums[1], nums[2]);
    if let Some(pre) = pre {
        if !ident_ok(pre) {
            return None;
        }
        out.push('-');
        out.push_str(pre);
    }
    if let Some(build) = build {
        if !ident_ok(build) {
            return None;
        }
        out.push('+');
        out.push_str(build);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::{MigBuilder, a100, inventory};

    const MIB: u64 = 1 << 20;

    fn params() -> SliceParams<'static> {
        SliceParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            generation: 3,
        }
    }

    fn attr_str<'a>(d: &'a Device, k: &str) -> Option<&'a str> {
        d.attributes.as_ref()?.get(k)?.string.as_deref()
    }
    fn attr_ver<'a>(d: &'a Device, k: &str) -> Option<&'a str> {
        d.attributes.as_ref()?.get(k)?.version.as_deref()
    }
    fn capacity<'a>(d: &'a Device, k: &str) -> Option<&'a str> {
        Some(d.capacity.as_ref()?.get(k)?.value.0.as_str())
    }

    /// Devices of every kind with every optional field set: a whole GPU, MIG devices of two
    /// profiles, and a GPU without the optional topology attributes.
    fn representative() -> Inventory {
        let gpu3 = a100(3).build().uuid;
        let gpu0 = a100(0).build().uuid;
        inventory([
            a100(0)
                .addressing_mode(Some("HMM"))
                .nvlink_peers(&[&gpu3])
                .build(),
            a100(1)
                .addressing_mode(Some("ATS"))
                .migs([
                    MigBuilder::new("1g.5gb", 19, 0, 1),
                    MigBuilder::new("3g.20gb", 9, 4, 4),
                ])
                .build(),
            gpu_dra_device::testing::t4(2)
                .pcie_root(None)
                .numa_node(None)
                .build(),
            a100(3).nvlink_peers(&[&gpu0]).build(),
        ])
    }

    #[test]
    fn the_renderer_publishes_exactly_the_schema() {
        let inv = representative();
        let (mut devices, warnings) = render_devices(&inv);
        assert!(warnings.is_empty(), "{warnings:?}");
        // The same devices with NVIDIA's `<N>` consumable shares: their `shares` capacity.
        let partitioning = crate::partitioning::Partitioning {
            consumable_shares: crate::consumable_shares::ConsumableShares::Count(2),
            ..Default::default()
        };
        let shared = crate::partitioning::render(
            &inv,
            &SliceParams {
                node_name: "n",
                driver_name: "gpu.nvidia.com",
                generation: 1,
            },
            &BTreeMap::new(),
            &partitioning,
            &std::collections::BTreeSet::new(),
        );
        devices.extend(
            shared
                .slices
                .into_iter()
                .flat_map(|s| s.spec.devices.into_iter().flatten()),
        );
        let mut seen_attrs = std::collections::BTreeSet::new();
        let mut seen_caps = std::collections::BTreeSet::new();
        for d in &devices {
            let kind = match attr_str(d, attr::TYPE) {
                Some("gpu") => DeviceKind::Gpu,
                Some("mig") => DeviceKind::Mig,
                other => panic!("{}: type {other:?}", d.name),
            };
            for (name, value) in d.attributes.iter().flatten() {
                let spec = attribute_spec(name)
                    .unwrap_or_else(|| panic!("{}: attribute {name} not in ATTRIBUTES", d.name));
                let ty = match value {
                    DeviceAttribute {
                        string: Some(_), ..
                    } => AttributeType::String,
                    DeviceAttribute { int: Some(_), .. } => AttributeType::Int,
                    DeviceAttribute { bool: Some(_), .. } => AttributeType::Bool,
                    DeviceAttribute {
                        version: Some(_), ..
                    } => AttributeType::Version,
                    _ => panic!("{}: attribute {name} has no value", d.name),
                };
                assert_eq!(spec.ty, ty, "{}: {name}", d.name);
                assert!(spec.kinds.contains(&kind), "{}: {name} on {kind:?}", d.name);
                seen_attrs.insert((spec.name, kind));
            }
            for name in d.capacity.iter().flatten().map(|(n, _)| n) {
                let spec = capacity_spec(name)
                    .unwrap_or_else(|| panic!("{}: capacity {name} not in CAPACITIES", d.name));
                assert!(spec.kinds.contains(&kind), "{}: {name} on {kind:?}", d.name);
                seen_caps.insert((spec.name, kind));
            }
            // Attributes marked `always` are on every device of their kinds.
            for spec in ATTRIBUTES
                .iter()
                .filter(|a| a.always && a.kinds.contains(&kind))
            {
                assert!(
                    d.attributes
                        .as_ref()
                        .is_some_and(|a| a.contains_key(spec.name)),
                    "{}: lacks {}",
                    d.name,
                    spec.name
                );
            }
        }
        // And every schema entry is rendered for every kind it names: no stale entries.
        for spec in ATTRIBUTES {
            for kind in spec.kinds {
                assert!(
                    seen_attrs.contains(&(spec.name, *kind)),
                    "{} on {kind:?} never rendered",
                    spec.name
                );
            }
        }
        for spec in CAPACITIES {
            for kind in spec.kinds {
                assert!(
                    seen_caps.contains(&(spec.name, *kind)),
                    "{} on {kind:?} never rendered",
                    spec.name
                );
            }
        }
    }

    #[test]
    fn addressing_mode_is_published_on_gpus_and_their_mig_devices_when_known() {
        let (devices, _) = render_devices(&representative());
        let mode = |name: &str| {
            let d = devices.iter().find(|d| d.name == name).unwrap();
            attr_str(d, attr::ADDRESSING_MODE).map(str::to_owned)
        };
        assert_eq!(mode("gpu-0").as_deref(), Some("HMM"));
        assert_eq!(mode("gpu-1-mig-1g5gb-19-0").as_deref(), Some("ATS"));
        assert_eq!(mode("gpu-2"), None);
    }

    #[test]
    fn nvlink_domain_is_on_linked_whole_gpus_only() {
        let (devices, _) = render_devices(&representative());
        let domain = |name: &str| {
            let d = devices.iter().find(|d| d.name == name).unwrap();
            attr_str(d, attr::NVLINK_DOMAIN).map(str::to_owned)
        };
        let d0 = domain("gpu-0").expect("gpu-0 is linked to gpu-3");
        assert_eq!(domain("gpu-3"), Some(d0));
        assert_eq!(domain("gpu-2"), None);
        assert_eq!(domain("gpu-1-mig-1g5gb-19-0"), None);
    }

    #[test]
    fn capacity_families_match_by_number_only() {
        assert!(capacity_spec("memorySlice7").is_some());
        assert!(capacity_spec("memorySlice").is_none());
        assert!(capacity_spec("memorySliceX").is_none());
        assert!(capacity_spec("memory").is_some());
    }

    #[test]
    fn whole_gpu_has_the_nvidia_attributes_and_memory() {
        let (devices, warnings) = render_devices(&inventory([a100(0).build()]));
        assert!(warnings.is_empty(), "{warnings:?}");
        let d = &devices[0];
        assert_eq!(d.name, "gpu-0");
        assert_eq!(attr_str(d, "type"), Some("gpu"));
        assert_eq!(
            attr_str(d, "uuid"),
            Some("GPU-00000000-1111-2222-3333-444444444444")
        );
        assert_eq!(attr_str(d, "productName"), Some("NVIDIA A100-SXM4-40GB"));
        assert_eq!(attr_str(d, "brand"), Some("Nvidia"));
        assert_eq!(attr_str(d, "architecture"), Some("Ampere"));
        assert_eq!(attr_ver(d, "cudaComputeCapability"), Some("8.0.0"));
        assert_eq!(attr_ver(d, "driverVersion"), Some("580.95.5"));
        assert_eq!(attr_ver(d, "cudaDriverVersion"), Some("13.0.0"));
        assert_eq!(
            attr_str(d, "resource.kubernetes.io/pciBusID"),
            Some("0000:07:00.0")
        );
        assert_eq!(
            attr_str(d, "resource.kubernetes.io/pcieRoot"),
            Some("pci0000:00")
        );
        let numa = &d.attributes.as_ref().unwrap()["resource.kubernetes.io/numaNode"];
        assert_eq!(numa.int, Some(0));
        assert_eq!(capacity(d, "memory"), Some("40Gi"));
        assert_eq!(d.attributes.as_ref().unwrap().len(), 11);
        assert_eq!(d.capacity.as_ref().unwrap().len(), 1);
    }

    #[test]
    fn mig_gpu_is_published_as_mig_devices_with_parent_attributes() {
        let g = a100(2)
            .pcie_root(None)
            .numa_node(None)
            .mig(MigBuilder::new("1g.5gb", 19, 0, 1))
            .mig(
                MigBuilder::new("3g.20gb", 9, 4, 4)
                    .multiprocessors(42)
                    .copy_engines(3)
                    .decoders(2)
                    .memory_bytes(19968 * MIB),
            )
            .build();
        let (devices, _) = render_devices(&inventory([g, a100(3).build()]));
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            ["gpu-2-mig-1g5gb-19-0", "gpu-2-mig-3g20gb-9-4", "gpu-3"]
        );
        let d = &devices[1];
        assert_eq!(attr_str(d, "type"), Some("mig"));
        assert_eq!(attr_str(d, "profile"), Some("3g.20gb"));
        assert_eq!(
            attr_str(d, "parentUUID"),
            Some("GPU-00000002-1111-2222-3333-444444444444")
        );
        assert!(attr_str(d, "uuid").unwrap().starts_with("MIG-"));
        assert_eq!(attr_str(d, "productName"), Some("NVIDIA A100-SXM4-40GB"));
        assert_eq!(attr_ver(d, "driverVersion"), Some("580.95.5"));
        assert_eq!(
            attr_str(d, "resource.kubernetes.io/pciBusID"),
            Some("0000:09:00.0")
        );
        assert_eq!(attr_str(d, "resource.kubernetes.io/pcieRoot"), None);
        assert_eq!(capacity(d, "multiprocessors"), Some("42"));
        assert_eq!(capacity(d, "copyEngines"), Some("3"));
        assert_eq!(capacity(d, "decoders"), Some("2"));
        assert_eq!(capacity(d, "encoders"), Some("0"));
        assert_eq!(capacity(d, "jpegEngines"), Some("0"));
        assert_eq!(capacity(d, "ofaEngines"), Some("0"));
        assert_eq!(capacity(d, "memory"), Some("19968Mi"));
        let slices: Vec<&String> = d
            .capacity
            .as_ref()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with("memorySlice"))
            .collect();
        assert_eq!(
            slices,
            [
                "memorySlice4",
                "memorySlice5",
                "memorySlice6",
                "memorySlice7"
            ]
        );
    }

    #[test]
    fn every_device_stays_within_the_entry_limit() {
        let g = a100(0).mig(MigBuilder::new("7g.40gb", 0, 0, 8)).build();
        let (devices, warnings) = render_devices(&inventory([g]));
        assert!(warnings.is_empty());
        let d = &devices[0];
        let n = d.attributes.as_ref().unwrap().len() + d.capacity.as_ref().unwrap().len();
        assert_eq!(n, 13 + 7 + 8);
        assert!(n <= MAX_ATTRIBUTES_AND_CAPACITIES);
    }

    #[test]
    fn entry_limit_drops_memory_slices_first() {
        let mut attributes = BTreeMap::new();
        for i in 0..30 {
            attributes.insert(format!("a{i}"), DeviceAttribute::default());
        }
        let mut capacity = BTreeMap::new();
        for i in 0..4 {
            capacity.insert(format!("memorySlice{i}"), DeviceCapacity::default());
        }
        let mut warnings = vec![];
        enforce_entry_limit("d", &mut attributes, &mut capacity, &mut warnings);
        assert_eq!(
            capacity.keys().collect::<Vec<_>>(),
            ["memorySlice0", "memorySlice1"]
        );
        assert_eq!(warnings.len(), 2);
        assert_eq!(warnings[0].field, "memorySlice3");
    }

    #[test]
    fn overlong_strings_and_bad_versions_are_left_out_with_a_warning() {
        let g = a100(0).product_name(&"X".repeat(65)).build();
        let mut inv = inventory([g]);
        inv.driver_version = "not-a-version".into();
        let (devices, warnings) = render_devices(&inv);
        let d = &devices[0];
        assert_eq!(attr_str(d, "productName"), None);
        assert_eq!(attr_ver(d, "driverVersion"), None);
        let fields: Vec<&str> = warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["productName", "driverVersion"]);
        assert!(warnings[0].to_string().contains("gpu-0"));
        // Exactly 64 bytes is accepted.
        let g = a100(0).product_name(&"Y".repeat(64)).build();
        let (devices, warnings) = render_devices(&inventory([g]));
        assert!(warnings.is_empty());
        assert_eq!(attr_str(&devices[0], "productName").map(str::len), Some(64));
    }

    #[test]
    fn slices_are_split_at_128_devices_with_one_generation_and_count() {
        let gpus = (0..300).map(|minor| a100(minor).build());
        let r = render_slices(&inventory(gpus), &params());
        assert_eq!(r.slices.len(), 3);
        let sizes: Vec<usize> = r
            .slices
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [128, 128, 44]);
        for (n, s) in r.slices.iter().enumerate() {
            assert_eq!(
                s.metadata.name.as_deref(),
                Some(format!("node-a-gpu-nvidia-com-{n}").as_str())
            );
            assert_eq!(s.spec.pool.name, "node-a");
            assert_eq!(s.spec.pool.generation, 3);
            assert_eq!(s.spec.pool.resource_slice_count, 3);
            assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
            assert_eq!(s.spec.driver, "gpu.nvidia.com");
        }
        assert_eq!(
            r.slices[2].spec.devices.as_ref().unwrap()[0].name,
            "gpu-256"
        );
    }

    #[test]
    fn an_empty_inventory_still_has_one_empty_slice() {
        let r = render_slices(&inventory([]), &params());
        assert_eq!(r.slices.len(), 1);
        assert_eq!(r.slices[0].spec.pool.resource_slice_count, 1);
        assert_eq!(r.slices[0].spec.devices.as_deref(), Some(&[][..]));
    }

    #[test]
    fn rendering_is_deterministic() {
        let inv = inventory((0..8).map(|minor| a100(minor).build()));
        assert_eq!(
            render_slices(&inv, &params()),
            render_slices(&inv, &params())
        );
    }

    #[test]
    fn long_node_names_give_valid_unique_slice_names() {
        let node = format!("{}.example", "n".repeat(240));
        let a = slice_name(&node, "gpu.nvidia.com", 0);
        let b = slice_name(&node, "gpu.nvidia.com", 1);
        let other = slice_name(&format!("{}.exampla", "n".repeat(240)), "gpu.nvidia.com", 0);
        for n in [&a, &b, &other] {
            assert!(n.len() <= MAX_NAME_LENGTH, "{n}");
            assert!(!n.contains(".-") && !n.contains("-."), "{n}");
        }
        assert_ne!(a, b);
        assert_ne!(a, other);
        assert_eq!(slice_name("n1", "gpu.nvidia.com", 2), "n1-gpu-nvidia-com-2");
    }

    #[test]
    fn versions_normalise_like_the_nvidia_driver() {
        assert_eq!(semver_normalize("13.0").as_deref(), Some("13.0.0"));
        assert_eq!(semver_normalize("580.95.05").as_deref(), Some("580.95.5"));
        assert_eq!(semver_normalize("8.0").as_deref(), Some("8.0.0"));
        assert_eq!(semver_normalize("v12").as_deref(), Some("12.0.0"));
        assert_eq!(
            semver_normalize("1.2.3-rc.1+b7").as_deref(),
            Some("1.2.3-rc.1+b7")
        );
        assert_eq!(semver_normalize("1.2.3.4"), None);
        assert_eq!(semver_normalize(""), None);
        assert_eq!(semver_normalize("1..2"), None);
        assert_eq!(semver_normalize("abc"), None);
        assert_eq!(semver_normalize("1.2-"), None);
    }

    #[test]
    fn capacities_are_written_as_the_api_server_returns_them() {
        for (v, s) in [
            (14, "14"),
            (1000, "1k"),
            (4864 * MIB, "4864Mi"),
            (40960 * MIB, "40Gi"),
            (143771 * MIB, "143771Mi"),
        ] {
            assert_eq!(capacity_quantity(v).0, s);
        }
    }
}

#[cfg(test)]
mod limits {
    //! Property: whatever the inventory, the slices respect the API limits.
    use super::*;
    use gpu_dra_device::testing::{MigBuilder, h100, inventory};
    use proptest::prelude::*;

    fn arb_mig() -> impl Strategy<Value = MigBuilder> {
        (
            "[0-9]c?\\.?[0-9]g\\.[0-9]{1,3}gb(\\+me)?",
            0u32..30,
            0u32..8,
            1u32..9,
            any::<u32>(),
        )
            .prop_map(|(profile, id, start, size, n)| {
                MigBuilder::new(&profile, id, start, size)
                    .uuid(&format!("MIG-{n:08x}-0000-5000-8000-000000000000"))
                    .gi_id(id)
                    .memory_bytes(u64::from(n) << 10)
                    .multiprocessors(n % 200)
                    .copy_engines(n % 8)
                    .decoders(n % 7)
                    .encoders(0)
                    .jpeg_engines(n % 3)
                    .ofa_engines(n % 2)
            })
    }

    fn arb_gpu() -> impl Strategy<Value = Gpu> {
        (
            0u32..1000,
            ".{0,80}",
            any::<bool>(),
            proptest::collection::vec(arb_mig(), 0..8),
            proptest::option::of(-1i64..8),
        )
            .prop_map(|(minor, name, mig_on, migs, numa)| {
                // MIG devices listed while MIG is off too: the renderer must cope.
                h100(minor)
                    .product_name(&name)
                    .memory_bytes(u64::from(minor) << 30)
                    .pci_bus_id(&format!("0000:{:02x}:00.0", minor % 256))
                    .numa_node(numa)
                    .migs(migs)
                    .mig_enabled(mig_on)
                    .build()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn slices_respect_api_limits(
            gpus in proptest::collection::vec(arb_gpu(), 0..60),
            driver in "[0-9]{1,3}\\.[0-9]{1,2}(\\.[0-9]{1,2})?",
            generation in 1i64..1000,
        ) {
            let inventory = Inventory { driver_version: driver, ..inventory(gpus) };
            let expected = inventory.devices().count();
            let r = render_slices(&inventory, &SliceParams { node_name: "n", driver_name: "gpu.nvidia.com", generation });
            let count = r.slices.len() as i64;
            let mut total = 0;
            for s in &r.slices {
                prop_assert_eq!(s.spec.pool.generation, generation);
                prop_assert_eq!(s.spec.pool.resource_slice_count, count);
                let devices = s.spec.devices.as_deref().unwrap_or_default();
                prop_assert!(devices.len() <= MAX_DEVICES_PER_SLICE);
                total += devices.len();
                for d in devices {
                    prop_assert!(d.name.len() <= 63 && !d.name.is_empty());
                    prop_assert!(d.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'), "{}", d.name);
                    prop_assert!(!d.name.ends_with('-'));
                    let attrs = d.attributes.as_ref().map_or(0, BTreeMap::len);
                    let caps = d.capacity.as_ref().map_or(0, BTreeMap::len);
                    prop_assert!(attrs + caps <= MAX_ATTRIBUTES_AND_CAPACITIES);
                    for a in d.attributes.iter().flat_map(BTreeMap::values) {
                        for v in [&a.string, &a.version].into_iter().flatten() {
                            prop_assert!(v.len() <= MAX_STRING_LENGTH);
                        }
                    }
                }
            }
            prop_assert_eq!(total, expected);
        }
    }
}
