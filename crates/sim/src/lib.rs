//! GPU simulator below NVML.
