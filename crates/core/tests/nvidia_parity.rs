//! Attribute and capacity parity with NVIDIA's DRA driver: every name NVIDIA's kubelet plugin
//! publishes per device type is in our schema (`slices::ATTRIBUTES` / `CAPACITIES`) with the
//! same type, or is listed below as a documented difference.
//!
//! Origin of the data: repository kubernetes-sigs/dra-driver-nvidia-gpu, files
//! `cmd/gpu-kubelet-plugin/deviceinfo.go` (`GpuInfo.Attributes`, `GpuInfo.GetDevice`,
//! `MigDeviceInfo.GetDevice`, `VfioDeviceInfo.GetDevice`), the MIG helpers next to it
//! (`CommonAttributesMig`, `CommonCapacitiesMig`), `fullGpuCapacity` and `nvlib.go`
//! (`getGpuInfo`: `addressingMode` is NVML's `HMM`, `ATS` or `None`, left out when the
//! platform reports none), as of commit 0545e9e5 (2026).

use gpu_dra_core::slices::{self, AttributeType, DeviceKind};

use AttributeType::{Int, String as Str, Version};

/// NVIDIA's attributes of a full GPU (`type == "gpu"`).
const NVIDIA_GPU_ATTRIBUTES: &[(&str, AttributeType)] = &[
    ("type", Str),
    ("uuid", Str),
    ("productName", Str),
    ("brand", Str),
    ("architecture", Str),
    ("cudaComputeCapability", Version),
    ("driverVersion", Version),
    ("cudaDriverVersion", Version),
    ("resource.kubernetes.io/pciBusID", Str),
    ("resource.kubernetes.io/pcieRoot", Str),
    ("resource.kubernetes.io/numaNode", Int),
    ("addressingMode", Str),
];

/// NVIDIA's capacities of a full GPU.
const NVIDIA_GPU_CAPACITIES: &[&str] = &["memory"];

/// NVIDIA's attributes of a MIG device (`type == "mig"`). It publishes no NUMA node on MIG
/// devices; we do (the parent's), a superset.
const NVIDIA_MIG_ATTRIBUTES: &[(&str, AttributeType)] = &[
    ("type", Str),
    ("uuid", Str),
    ("parentUUID", Str),
    ("profile", Str),
    ("productName", Str),
    ("brand", Str),
    ("architecture", Str),
    ("cudaComputeCapability", Version),
    ("driverVersion", Version),
    ("cudaDriverVersion", Version),
    ("resource.kubernetes.io/pciBusID", Str),
    ("resource.kubernetes.io/pcieRoot", Str),
    ("addressingMode", Str),
];

/// NVIDIA's capacities of a MIG device; `memorySlice<N>` for each occupied memory slice.
const NVIDIA_MIG_CAPACITIES: &[&str] = &[
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
    "memory",
    "memorySlice0",
    "memorySlice7",
];

/// Names NVIDIA publishes that we do not, each with the reason. All are behind NVIDIA feature
/// gates that are off by default, on device types we do not publish.
const DOCUMENTED_DIFFERENCES: &[(&str, &str)] = &[
    (
        "vfio: type=vfio, deviceID, vendorID, iommuFDEnabled; capacity addressableMemory",
        "`gpu-vfio-<n>` passthrough devices (feature gate PassthroughSupport): not implemented",
    ),
    (
        "vfio: gpuModuleId, partition1/2/4/8",
        "Fabric Manager partition attributes of passthrough devices (FabricManagerPartitioning)",
    ),
    (
        "gpu (DynamicMIG): multiprocessors, copyEngines, ... on full GPUs, shared counters",
        "partitionable full GPUs with counters (DynamicMIG): not implemented; full GPUs carry \
         `memory` only, as in NVIDIA's default mode",
    ),
];

fn check(kind: DeviceKind, attributes: &[(&str, AttributeType)], capacities: &[&str]) {
    for (name, ty) in attributes {
        let spec = slices::attribute_spec(name)
            .unwrap_or_else(|| panic!("NVIDIA publishes {name} on {kind:?} devices; we do not"));
        assert_eq!(spec.ty, *ty, "{name}: type differs from NVIDIA's");
        assert!(
            spec.kinds.contains(&kind),
            "{name}: NVIDIA has it on {kind:?} devices, we do not"
        );
    }
    for name in capacities {
        let spec = slices::capacity_spec(name)
            .unwrap_or_else(|| panic!("NVIDIA publishes capacity {name} on {kind:?}; we do not"));
        assert!(
            spec.kinds.contains(&kind),
            "capacity {name} not on our {kind:?} devices"
        );
    }
}

#[test]
fn our_gpu_devices_publish_a_superset_of_nvidias() {
    check(
        DeviceKind::Gpu,
        NVIDIA_GPU_ATTRIBUTES,
        NVIDIA_GPU_CAPACITIES,
    );
}

#[test]
fn our_mig_devices_publish_a_superset_of_nvidias() {
    check(
        DeviceKind::Mig,
        NVIDIA_MIG_ATTRIBUTES,
        NVIDIA_MIG_CAPACITIES,
    );
}

#[test]
fn what_we_publish_beyond_nvidia_is_known() {
    // Our extras: the NUMA node on MIG devices, and the NVLink domain of whole GPUs (NVIDIA's
    // driver publishes nothing about NVLink within a node). Anything else new must be added
    // to the lists above (if NVIDIA has it) or here, on purpose.
    let mut extras = Vec::new();
    for spec in slices::ATTRIBUTES {
        for kind in spec.kinds {
            let theirs = match kind {
                DeviceKind::Gpu => NVIDIA_GPU_ATTRIBUTES,
                DeviceKind::Mig => NVIDIA_MIG_ATTRIBUTES,
            };
            if !theirs.iter().any(|(n, _)| *n == spec.name) {
                extras.push(format!("{}:{}", kind.as_str(), spec.name));
            }
        }
    }
    assert_eq!(
        extras,
        ["mig:resource.kubernetes.io/numaNode", "gpu:nvlinkDomain"]
    );
}

#[test]
fn every_difference_names_a_reason() {
    for (theirs, why) in DOCUMENTED_DIFFERENCES {
        assert!(!theirs.is_empty() && why.len() > 20, "{theirs}: {why}");
    }
}
