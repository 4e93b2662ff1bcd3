//! Pure driver logic: no I/O, no async runtime, no Kubernetes client, no NVML.

pub mod slices;
