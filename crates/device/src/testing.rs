//! Inventory fixtures for tests and benchmarks: one place that writes `Gpu` and `MigDevice`
//! values, so every crate's tests describe the same hardware the same way.
//!
//! Compiled only for this crate's own tests and behind the `testing` feature, which other
//! crates enable from `[dev-dependencies]` only: the fixtures never reach a release binary.
//!
//! Builders start from a real model ([`a100`], [`h100`], [`t4`]) and change only what a test
//! is about, e.g. `a100(2).mig(mig_1g5gb(0)).numa_node(None).build()`. Invariants the
//! defaults keep, so tests may rely on them:
//! - a GPU's UUID, PCI bus ID and device name follow from its minor number, so GPUs with
//!   distinct minors never collide (`GPU-<minor, 8 hex digits>-1111-2222-3333-444444444444`,
//!   PCI bus `0000:<(minor + 7) mod 256, 2 hex digits>:00.0`);
//! - a MIG device left without an explicit UUID gets one from its parent's minor and its
//!   placement start, unique on the node;
//! - adding a MIG device turns MIG on (current and pending) for that GPU, as a real GPU has
//!   MIG devices only with MIG enabled.

use crate::{ComputeCapability, Gpu, Inventory, MigDevice, MigMode, MigProfile, Placement};

/// Driver version of the fixture inventories.
pub const DRIVER_VERSION: &str = "580.95.05";
/// CUDA driver version of the fixture inventories.
pub const CUDA_DRIVER_VERSION: &str = "13.0";

const MIB: u64 = 1 << 20;

/// Builds a [`Gpu`]; start from [`a100`], [`h100`] or [`t4`].
#[derive(Debug, Clone)]
#[must_use]
pub struct GpuBuilder {
    gpu: Gpu,
    migs: Vec<MigBuilder>,
}

/// Builds a [`MigDevice`]; start from [`mig_1g5gb`] or [`MigBuilder::new`].
#[derive(Debug, Clone)]
#[must_use]
pub struct MigBuilder {
    mig: MigDevice,
    uuid_set: bool,
}

fn base(minor: u32, product: &str, architecture: &str, cc: (u32, u32), memory: u64) -> Gpu {
    Gpu {
        index: minor,
        minor,
        uuid: format!("GPU-{minor:08x}-1111-2222-3333-444444444444"),
        product_name: product.into(),
        brand: "Nvidia".into(),
        architecture: architecture.into(),
        cuda_compute_capability: ComputeCapability {
            major: cc.0,
            minor: cc.1,
        },
        memory_bytes: memory,
        pci_bus_id: format!("0000:{:02x}:00.0", (minor + 7) % 256),
        pcie_root: Some("pci0000:00".into()),
        numa_node: Some(0),
        addressing_mode: None,
        nvlink_peers: Vec::new(),
        mig: None,
        mig_devices: Vec::new(),
        mig_profiles: Vec::new(),
    }
}

/// An `NVIDIA A100-SXM4-40GB` (Ampere, 8.0, 40 GiB), MIG capable with MIG off.
pub fn a100(minor: u32) -> GpuBuilder {
    let mut gpu = base(
        minor,
        "NVIDIA A100-SXM4-40GB",
        "Ampere",
        (8, 0),
        40960 * MIB,
    );
    gpu.mig = Some(MigMode {
        current: false,
        pending: false,
    });
    GpuBuilder {
        gpu,
        migs: Vec::new(),
    }
}

/// An A100-40GB with MIG on, no MIG devices and every GPU-instance profile it offers, as
/// discovery fills [`Gpu::mig_profiles`]: a GPU ready for dynamic MIG.
pub fn a100_dynamic(minor: u32) -> GpuBuilder {
    a100(minor)
        .mig_enabled(true)
        .mig_profiles(a100_40gb_profiles())
}

/// Name, profile ID, compute slices, memory (MiB), engines (SM, CE, DEC, ENC, JPEG, OFA),
/// placement starts, memory slices per placement.
type ProfileRow = (&'static str, u32, u32, u64, [u32; 6], &'static [u32], u32);

/// The GPU-instance profiles of an A100-SXM4-40GB as NVML reports them (profile IDs, memory,
/// engines and placements of the MIG user guide and NVIDIA's A100 NVML values), in NVML
/// profile-index order as discovery lists them.
pub fn a100_40gb_profiles() -> Vec<MigProfile> {
    #[rustfmt::skip]
    let table: [ProfileRow; 7] = [
        // name, ID, compute slices, MiB, [SM, CE, DEC, ENC, JPEG, OFA], starts, memory slices
        ("1g.5gb", 19, 1, 4864, [14, 1, 0, 0, 0, 0], &[0, 1, 2, 3, 4, 5, 6], 1),
        ("2g.10gb", 14, 2, 9856, [28, 2, 1, 0, 0, 0], &[0, 2, 4], 2),
        ("3g.20gb", 9, 3, 19968, [42, 3, 2, 0, 0, 0], &[0, 4], 4),
        ("4g.20gb", 5, 4, 19968, [56, 4, 2, 0, 0, 0], &[0], 4),
        ("7g.40gb", 0, 7, 40192, [98, 7, 5, 0, 1, 1], &[0], 8),
        ("1g.5gb+me", 20, 1, 4864, [14, 1, 1, 0, 1, 1], &[0, 1, 2, 3, 4, 5, 6], 1),
        ("1g.10gb", 15, 1, 9856, [14, 1, 1, 0, 0, 0], &[0, 2, 4, 6], 2),
    ];
    table
        .into_iter()
        .map(
            |(name, id, compute, mib, [sm, ce, dec, enc, jpeg, ofa], starts, size)| MigProfile {
                gi_profile_id: id,
                name: name.into(),
                memory_slices: size,
                compute_slices: compute,
                memory_bytes: mib * MIB,
                multiprocessors: sm,
                copy_engines: ce,
                decoders: dec,
                encoders: enc,
                jpeg_engines: jpeg,
                ofa_engines: ofa,
                placements: starts
                    .iter()
                    .map(|&start| Placement { start, size })
                    .collect(),
            },
        )
        .collect()
}

/// An `NVIDIA H100 80GB HBM3` (Hopper, 9.0, 81559 MiB) whose driver reports no MIG mode, as
/// the publishing tests want a plain whole-GPU node; `.mig_capable()` makes it MIG capable.
pub fn h100(minor: u32) -> GpuBuilder {
    GpuBuilder {
        gpu: base(
            minor,
            "NVIDIA H100 80GB HBM3",
            "Hopper",
            (9, 0),
            81559 * MIB,
        ),
        migs: Vec::new(),
    }
}

/// A `Tesla T4` (Turing, 7.5, 15 GiB), not MIG capable.
pub fn t4(minor: u32) -> GpuBuilder {
    GpuBuilder {
        gpu: base(minor, "Tesla T4", "Turing", (7, 5), 15360 * MIB),
        migs: Vec::new(),
    }
}

impl GpuBuilder {
    /// Sets the UUID.
    pub fn uuid(mut self, uuid: &str) -> Self {
        self.gpu.uuid = uuid.into();
        self
    }

    /// Sets the product name.
    pub fn product_name(mut self, name: &str) -> Self {
        self.gpu.product_name = name.into();
        self
    }

    /// Sets the framebuffer size in bytes.
    pub fn memory_bytes(mut self, bytes: u64) -> Self {
        self.gpu.memory_bytes = bytes;
        self
    }

    /// Sets the PCI bus ID.
    pub fn pci_bus_id(mut self, id: &str) -> Self {
        self.gpu.pci_bus_id = id.into();
        self
    }

    /// Sets (or clears) the PCIe root complex.
    pub fn pcie_root(mut self, root: Option<&str>) -> Self {
        self.gpu.pcie_root = root.map(Into::into);
        self
    }

    /// Sets the NVLink peers (their UUIDs).
    pub fn nvlink_peers(mut self, peers: &[&str]) -> Self {
        self.gpu.nvlink_peers = peers.iter().map(|p| (*p).to_string()).collect();
        self
    }

    /// Sets (or clears) the NUMA node.
    pub fn numa_node(mut self, node: Option<i64>) -> Self {
        self.gpu.numa_node = node;
        self
    }

    /// Makes the GPU MIG capable with MIG off (kept on if MIG devices were added).
    pub fn mig_capable(mut self) -> Self {
        self.gpu.mig.get_or_insert(MigMode {
            current: false,
            pending: false,
        });
        self
    }

    /// Sets the memory addressing mode NVML reports (`HMM`, `ATS`, `None`).
    pub fn addressing_mode(mut self, mode: Option<&str>) -> Self {
        self.gpu.addressing_mode = mode.map(str::to_owned);
        self
    }

    /// Sets the MIG mode (current and pending) whatever MIG devices were added: for the odd
    /// states a driver can report, such as MIG devices listed on a GPU with MIG off.
    pub fn mig_enabled(mut self, on: bool) -> Self {
        self.gpu.mig = Some(MigMode {
            current: on,
            pending: on,
        });
        self
    }

    /// Sets the GPU-instance profiles dynamic MIG may create (see [`a100_40gb_profiles`]).
    pub fn mig_profiles(mut self, profiles: Vec<MigProfile>) -> Self {
        self.gpu.mig_profiles = profiles;
        self
    }

    /// Adds a MIG device and turns MIG on.
    pub fn mig(mut self, mig: MigBuilder) -> Self {
        self.gpu.mig = Some(MigMode {
            current: true,
            pending: true,
        });
        self.migs.push(mig);
        self
    }

    /// Adds several MIG devices and turns MIG on.
    pub fn migs(self, migs: impl IntoIterator<Item = MigBuilder>) -> Self {
        migs.into_iter().fold(self.mig_capable(), Self::mig)
    }

    /// The GPU.
    pub fn build(self) -> Gpu {
        let minor = self.gpu.minor;
        let mut gpu = self.gpu;
        gpu.mig_devices = self.migs.into_iter().map(|m| m.build(minor)).collect();
        gpu
    }
}

/// A `1g.5gb` MIG device of an A100-40GB (GPU instance profile 19) in memory slice `start`,
/// GPU instance ID `7 + start` as the driver numbers them.
pub fn mig_1g5gb(start: u32) -> MigBuilder {
    MigBuilder::new("1g.5gb", 19, start, 1).gi_id(7 + start)
}

impl MigBuilder {
    /// A MIG device of `profile` (GPU instance profile `gi_profile_id`) on memory slices
    /// `start..start + size`, with the engines of a `1g.5gb` until told otherwise.
    pub fn new(profile: &str, gi_profile_id: u32, start: u32, size: u32) -> Self {
        MigBuilder {
            mig: MigDevice {
                uuid: String::new(),
                gi_id: start + 1,
                ci_id: 0,
                profile: profile.into(),
                gi_profile_id,
                placement: Placement { start, size },
                memory_bytes: 4864 * MIB,
                multiprocessors: 14,
                copy_engines: 1,
                decoders: 0,
                encoders: 0,
                jpeg_engines: 0,
                ofa_engines: 0,
            },
            uuid_set: false,
        }
    }

    /// Sets the UUID (otherwise derived from the parent's minor and the placement).
    pub fn uuid(mut self, uuid: &str) -> Self {
        self.mig.uuid = uuid.into();
        self.uuid_set = true;
        self
    }

    /// Sets the GPU instance ID.
    pub fn gi_id(mut self, id: u32) -> Self {
        self.mig.gi_id = id;
        self
    }

    /// Sets the memory in bytes.
    pub fn memory_bytes(mut self, bytes: u64) -> Self {
        self.mig.memory_bytes = bytes;
        self
    }

    /// Sets the number of streaming multiprocessors.
    pub fn multiprocessors(mut self, n: u32) -> Self {
        self.mig.multiprocessors = n;
        self
    }

    /// Sets the number of copy engines.
    pub fn copy_engines(mut self, n: u32) -> Self {
        self.mig.copy_engines = n;
        self
    }

    /// Sets the number of video decoders.
    pub fn decoders(mut self, n: u32) -> Self {
        self.mig.decoders = n;
        self
    }

    /// Sets the number of video encoders.
    pub fn encoders(mut self, n: u32) -> Self {
        self.mig.encoders = n;
        self
    }

    /// Sets the number of JPEG engines.
    pub fn jpeg_engines(mut self, n: u32) -> Self {
        self.mig.jpeg_engines = n;
        self
    }

    /// Sets the number of optical flow accelerators.
    pub fn ofa_engines(mut self, n: u32) -> Self {
        self.mig.ofa_engines = n;
        self
    }

    /// The MIG device as it appears on the GPU with minor number `parent_minor`.
    pub fn build(self, parent_minor: u32) -> MigDevice {
        let mut mig = self.mig;
        if !self.uuid_set {
            let start = mig.placement.start;
            mig.uuid = format!("MIG-{parent_minor:04x}{start:04x}-aaaa-5bbb-8ccc-000000000000");
        }
        mig
    }
}

/// An inventory of `gpus` with the fixture driver versions.
pub fn inventory(gpus: impl IntoIterator<Item = Gpu>) -> Inventory {
    Inventory {
        driver_version: DRIVER_VERSION.into(),
        cuda_driver_version: CUDA_DRIVER_VERSION.into(),
        gpus: gpus.into_iter().collect(),
        lost_gpus: Vec::new(),
    }
}

/// A DGX-A100-40GB-like node: `gpus` A100s; the first `mig_gpus` have MIG on with seven
/// `1g.5gb` devices each, the others MIG off.
pub fn a100_inventory(gpus: u32, mig_gpus: u32) -> Inventory {
    inventory((0..gpus).map(|minor| {
        let gpu = a100(minor);
        if minor < mig_gpus {
            gpu.migs((0..7).map(mig_1g5gb)).build()
        } else {
            gpu.build()
        }
    }))
}

/// `n` H100s without MIG.
pub fn h100_inventory(n: u32) -> Inventory {
    inventory((0..n).map(|minor| h100(minor).build()))
}

/// `n` T4s.
pub fn t4_inventory(n: u32) -> Inventory {
    inventory((0..n).map(|minor| t4(minor).build()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_follow_the_minor_and_never_collide() {
        let inv = a100_inventory(3, 2);
        let mut uuids: Vec<&str> = inv.devices().map(|d| d.uuid()).collect();
        let n = uuids.len();
        assert_eq!(n, 7 + 7 + 1);
        uuids.sort_unstable();
        uuids.dedup();
        assert_eq!(uuids.len(), n, "unique UUIDs");
        assert_eq!(inv.gpus[2].uuid, "GPU-00000002-1111-2222-3333-444444444444");
        assert_eq!(inv.gpus[0].pci_bus_id, "0000:07:00.0");
        assert!(inv.gpus[0].mig_enabled() && !inv.gpus[2].mig_enabled());
        assert_eq!(inv.gpus[1].mig_devices[3].gi_id, 10);
    }

    #[test]
    fn adding_a_mig_device_turns_mig_on_and_an_explicit_uuid_stays() {
        let gpu = t4(0).mig(mig_1g5gb(0).uuid("MIG-x")).build();
        assert!(gpu.mig_enabled());
        assert_eq!(gpu.mig_devices[0].uuid, "MIG-x");
        assert_eq!(h100(0).build().mig, None);
        assert_eq!(
            h100(0).mig_capable().build().mig,
            Some(MigMode {
                current: false,
                pending: false
            })
        );
    }
}
