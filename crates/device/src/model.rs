//! The inventory model: plain data describing the GPUs of one node.
//!
//! Every backend (NVML, fixtures) produces this model and every consumer (slice rendering,
//! prepare planning, `discover`) reads it, so it carries no behaviour beyond lookups and the
//! device naming rules. Device names are part of the compatibility contract with the NVIDIA
//! driver: `gpu-<minor>` for a whole GPU and
//! `gpu-<minor>-mig-<profile without dots>-<giProfileId>-<placementStart>` for a MIG device.

use serde::{Deserialize, Serialize};

/// Everything discovered on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    /// Kernel driver version, e.g. `580.95.05`.
    pub driver_version: String,
    /// Highest CUDA version the driver supports, e.g. `13.0`.
    pub cuda_driver_version: String,
    /// GPUs ordered by NVML index.
    pub gpus: Vec<Gpu>,
    /// NVML indexes of GPUs that answered `NVML_ERROR_GPU_IS_LOST` (fallen off the bus):
    /// counted by the driver, not readable, so not in `gpus`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_gpus: Vec<u32>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    /// NVML index (enumeration order, not stable across reboots).
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`; stable, used in device names.
    pub minor: u32,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA A100-SXM4-40GB`.
    pub product_name: String,
    /// Brand, e.g. `Nvidia`, `Tesla`, `GeForce`.
    pub brand: String,
    /// Architecture name, e.g. `Ampere`, `Hopper`.
    pub architecture: String,
    /// CUDA compute capability.
    pub cuda_compute_capability: ComputeCapability,
    /// Total framebuffer memory in bytes.
    pub memory_bytes: u64,
    /// PCI bus ID in the canonical sysfs form `0000:3b:00.0` (lower case, 4-digit domain).
    pub pci_bus_id: String,
    /// PCIe root complex, e.g. `pci0000:00`, when sysfs tells.
    pub pcie_root: Option<String>,
    /// NUMA node, when the platform reports one (sysfs `-1` means none).
    pub numa_node: Option<i64>,
    /// Memory addressing mode as NVML names it (`HMM`, `ATS` or `None` on coherent-memory
    /// platforms that support it but have it off); `None` where the platform does not report
    /// one. Published as the `addressingMode` attribute of the GPU and its MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addressing_mode: Option<String>,
    /// UUIDs of the GPUs this one reaches over NVLink peer-to-peer, directly or through
    /// NVSwitches (NVML's P2P status for the NVLink capability), in NVML index order. Empty
    /// without NVLink, and in MIG mode (MIG has no GPU-to-GPU peer-to-peer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink_peers: Vec<String>,
    /// MIG mode, `None` when the GPU is not MIG capable.
    pub mig: Option<MigMode>,
    /// MIG devices that currently exist on this GPU (empty unless MIG is enabled).
    pub mig_devices: Vec<MigDevice>,
    /// Filled when the GPU is MIG capable: what dynamic MIG can create, every GPU-instance
    /// profile the GPU offers with its placements. Discovery fills it only while MIG mode is
    /// enabled (on an A100 with MIG disabled the profile queries fail, and NVIDIA's driver does
    /// not offer dynamic MIG there either); empty otherwise, and then left out of the JSON.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_profiles: Vec<MigProfile>,
}

/// CUDA compute capability `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComputeCapability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// Current and pending MIG mode of a MIG-capable GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMode {
    /// MIG is enabled now.
    pub current: bool,
    /// MIG will be enabled after the next GPU reset.
    pub pending: bool,
}

/// One MIG device: a compute instance inside a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// GPU instance ID (no relation to the placement).
    pub gi_id: u32,
    /// Compute instance ID within the GPU instance.
    pub ci_id: u32,
    /// Profile name without the `MIG ` prefix, e.g. `1g.5gb`, `1g.10gb+me`.
    pub profile: String,
    /// GPU instance profile ID as `nvidia-smi -lgip` shows it (19 for `1g.*`, 0 for `7g.*`).
    pub gi_profile_id: u32,
    /// Placement of the GPU instance in memory slices.
    pub placement: Placement,
    /// Memory of the MIG device in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical flow accelerators.
    pub ofa_engines: u32,
}

/// A GPU-instance profile a MIG-capable GPU offers, as NVML describes it
/// (`nvmlDeviceGetGpuInstanceProfileInfo` and `nvmlDeviceGetGpuInstancePossiblePlacements_v2`):
/// what a GPU instance of this profile, with its full-size compute instance, provides, and where
/// it may sit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// GPU instance profile ID as `nvidia-smi -lgip` shows it (19 for `1g.*`, 0 for `7g.*`);
    /// the ID NVML's create call takes.
    pub gi_profile_id: u32,
    /// Profile name without the `MIG ` prefix, named as discovery names MIG devices, e.g.
    /// `3g.20gb`, `1g.5gb+me`.
    pub name: String,
    /// Memory slices one instance occupies (the placements' size; 8 per GPU).
    pub memory_slices: u32,
    /// Compute slices (`sliceCount`; 7 per GPU).
    pub compute_slices: u32,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical flow accelerators.
    pub ofa_engines: u32,
    /// Every placement an instance of this profile may have, in memory slices.
    pub placements: Vec<Placement>,
}

impl MigProfile {
    /// A MIG device of this profile at `placement`, with the identity the driver gave it
    /// (`uuid`, GPU and compute instance IDs; empty and 0 for one not created yet).
    pub fn device(&self, placement: Placement, uuid: String, gi_id: u32, ci_id: u32) -> MigDevice {
        MigDevice {
            uuid,
            gi_id,
            ci_id,
            profile: self.name.clone(),
            gi_profile_id: self.gi_profile_id,
            placement,
            memory_bytes: self.memory_bytes,
            multiprocessors: self.multiprocessors,
            copy_engines: self.copy_engines,
            decoders: self.decoders,
            encoders: self.encoders,
            jpeg_engines: self.jpeg_engines,
            ofa_engines: self.ofa_engines,
        }
    }
}

/// Placement of a GPU instance: first memory slice and number of slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

impl Gpu {
    /// The ResourceSlice device name of the whole GPU: `gpu-<minor>`.
    pub fn device_name(&self) -> String {
        format!("gpu-{}", self.minor)
    }

    /// True when MIG is enabled now; such a GPU is published as its MIG devices only.
    pub fn mig_enabled(&self) -> bool {
        self.mig.is_some_and(|m| m.current)
    }
}

impl MigDevice {
    /// The ResourceSlice device name:
    /// `gpu-<parent minor>-mig-<profile without dots>-<giProfileId>-<placementStart>`, where the
    /// profile is lower-cased and characters outside `[a-z0-9-]` become `-` as in the NVIDIA
    /// driver (`1g.5gb+me` -> `1g5gb-me`), keeping the name a valid DNS label.
    pub fn device_name(&self, parent: &Gpu) -> String {
        format!(
            "gpu-{}-mig-{}-{}-{}",
            parent.minor,
            crate::names::profile_for_device_name(&self.profile),
            self.gi_profile_id,
            self.placement.start
        )
    }
}

/// A device as the scheduler sees it: a whole GPU or one MIG device with its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRef<'a> {
    /// A whole GPU (MIG disabled).
    Gpu(&'a Gpu),
    /// A MIG device and the GPU it lives on.
    Mig {
        /// The parent GPU.
        parent: &'a Gpu,
        /// The MIG device.
        mig: &'a MigDevice,
    },
}

impl<'a> DeviceRef<'a> {
    /// The ResourceSlice device name.
    pub fn name(&self) -> String {
        match self {
            DeviceRef::Gpu(gpu) => gpu.device_name(),
            DeviceRef::Mig { parent, mig } => mig.device_name(parent),
        }
    }

    /// The device's UUID (`GPU-...` or `MIG-...`).
    pub fn uuid(&self) -> &'a str {
        match self {
            DeviceRef::Gpu(gpu) => &gpu.uuid,
            DeviceRef::Mig { mig, .. } => &mig.uuid,
        }
    }

    /// The physical GPU (the device itself, or a MIG device's parent).
    pub fn gpu(&self) -> &'a Gpu {
        match self {
            DeviceRef::Gpu(gpu) => gpu,
            DeviceRef::Mig { parent, .. } => parent,
        }
    }
}

impl Inventory {
    /// Every allocatable device in publication order: for each GPU, either the whole GPU (MIG
    /// disabled) or its MIG devices (MIG enabled), never both.
    pub fn devices(&self) -> impl Iterator<Item = DeviceRef<'_>> {
        self.gpus.iter().flat_map(|gpu| {
            let whole = (!gpu.mig_enabled()).then_some(DeviceRef::Gpu(gpu));
            let migs = gpu
                .mig_devices
                .iter()
                .filter(|_| gpu.mig_enabled())
                .map(move |mig| DeviceRef::Mig { parent: gpu, mig });
            whole.into_iter().chain(migs)
        })
    }

    /// Finds an allocatable device by its ResourceSlice name.
    pub fn device(&self, name: &str) -> Option<DeviceRef<'_>> {
        self.devices().find(|d| d.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::{MigProfile, Placement};
    use crate::testing::{MigBuilder, a100, inventory, mig_1g5gb, t4};

    #[test]
    fn mig_profiles_are_optional_in_json_and_left_out_when_empty() {
        let mut gpu = a100(0).build();
        let json = serde_json::to_value(&gpu).expect("serialise");
        assert!(json.get("migProfiles").is_none(), "{json}");
        // Inventories written before the field existed still read.
        let back: super::Gpu = serde_json::from_value(json).expect("parse");
        assert_eq!(back, gpu);
        gpu.mig_profiles.push(MigProfile {
            gi_profile_id: 9,
            name: "3g.20gb".into(),
            memory_slices: 4,
            compute_slices: 3,
            memory_bytes: 19968 << 20,
            multiprocessors: 42,
            copy_engines: 3,
            decoders: 2,
            encoders: 0,
            jpeg_engines: 0,
            ofa_engines: 0,
            placements: vec![
                Placement { start: 0, size: 4 },
                Placement { start: 4, size: 4 },
            ],
        });
        let json = serde_json::to_value(&gpu).expect("serialise");
        assert_eq!(json["migProfiles"][0]["giProfileId"], 9);
        assert_eq!(json["migProfiles"][0]["placements"][1]["start"], 4);
        let back: super::Gpu = serde_json::from_value(json).expect("parse");
        assert_eq!(back, gpu);
    }

    #[test]
    fn mig_enabled_gpu_is_published_as_its_mig_devices_only() {
        let inv = inventory([
            a100(0)
                .mig(mig_1g5gb(0))
                .mig(mig_1g5gb(1))
                .mig(MigBuilder::new("1g.5gb+me", 20, 2, 1))
                .build(),
            t4(1).build(),
        ]);
        let names: Vec<String> = inv.devices().map(|d| d.name()).collect();
        assert_eq!(
            names,
            [
                "gpu-0-mig-1g5gb-19-0",
                "gpu-0-mig-1g5gb-19-1",
                "gpu-0-mig-1g5gb-me-20-2",
                "gpu-1"
            ]
        );
        let found = inv.device("gpu-0-mig-1g5gb-19-1").expect("present");
        assert_eq!(found.gpu().minor, 0);
        assert!(found.uuid().starts_with("MIG-"));
        assert!(inv.device("gpu-0").is_none());
    }
}
