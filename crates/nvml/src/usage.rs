//! The NVML backend of the [`UsageSource`] seam: per device (GPU or MIG device, by UUID) the
//! processes with a compute context and their memory (`nvmlDeviceGetComputeRunningProcesses_v3`),
//! their SM utilisation (`nvmlDeviceGetProcessUtilization`, whole GPUs only), the device's
//! utilisation (`nvmlDeviceGetUtilizationRates`, whole GPUs only) and memory
//! (`nvmlDeviceGetMemoryInfo_v2`).
//!
//! Invariants: one NVML session per sample, shut down when it ends (as discovery does, so no
//! handle outlives a MIG layout change); `NOT_SUPPORTED` (MIG devices, GPUs in MIG mode) and
//! `NOT_FOUND` (no utilisation sample in the window) are "not exposed", never errors; a device
//! that cannot be found (a MIG device destroyed since the claim was prepared) is left out.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_dra_device::DeviceError;
use gpu_dra_device::usage::{DeviceUsage, ProcessUsage, UsageSource};
use nvml_wrapper::Device;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use tracing::debug;

use crate::NvmlLibrary;

/// Usage figures read from NVML, loading the library anew for each sample.
#[derive(Debug, Clone)]
pub struct NvmlUsage {
    library: NvmlLibrary,
}

impl NvmlUsage {
    /// Reads through `library`.
    pub fn new(library: NvmlLibrary) -> Self {
        NvmlUsage { library }
    }
}

/// `Some` unless the driver does not expose the figure here.
fn exposed<T>(r: Result<T, NvmlError>, what: &str, uuid: &str) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(NvmlError::NotSupported | NvmlError::NotFound) => None,
        Err(e) => {
            debug!(device = %uuid, error = %e, call = what, "usage figure unavailable");
            None
        }
    }
}

fn device_usage(d: &Device<'_>, uuid: &str, since_micros: u64) -> DeviceUsage {
    let processes = exposed(
        d.running_compute_processes(),
        "nvmlDeviceGetComputeRunningProcesses_v3",
        uuid,
    )
    .unwrap_or_default();
    // Several samples of one process in the window: their mean.
    let mut sm: HashMap<u32, (u64, u64)> = HashMap::new();
    for s in exposed(
        d.process_utilization_stats(since_micros),
        "nvmlDeviceGetProcessUtilization",
        uuid,
    )
    .unwrap_or_default()
    {
        let e = sm.entry(s.pid).or_default();
        e.0 += u64::from(s.sm_util);
        e.1 += 1;
    }
    let per_process_sm = !sm.is_empty() || uuid.starts_with("GPU-");
    let memory = exposed(d.memory_info(), "nvmlDeviceGetMemoryInfo_v2", uuid);
    DeviceUsage {
        uuid: uuid.to_owned(),
        processes: processes
            .iter()
            .map(|p| ProcessUsage {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
                sm_percent: match sm.get(&p.pid) {
                    Some((sum, n)) => u32::try_from(sum / n).ok(),
                    // A whole GPU reports only processes that were active: none is 0 %.
                    None if per_process_sm => Some(0),
                    None => None,
                },
            })
            .collect(),
        memory_total: memory.as_ref().map(|m| m.total),
        memory_used: memory.as_ref().map(|m| m.used),
        utilization_percent: exposed(d.utilization_rates(), "nvmlDeviceGetUtilizationRates", uuid)
            .map(|u| u.gpu),
    }
}

impl UsageSource for NvmlUsage {
    fn sample(&self, uuids: &[String], window: Duration) -> Result<Vec<DeviceUsage>, DeviceError> {
        let nvml = self.library.open()?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .saturating_sub(window);
        let since = u64::try_from(now.as_micros()).unwrap_or(u64::MAX);
        Ok(uuids
            .iter()
            .filter_map(|uuid| match nvml.device_by_uuid(uuid.as_str()) {
                Ok(d) => Some(device_usage(&d, uuid, since)),
                Err(e) => {
                    debug!(device = %uuid, error = %e, "device not found for usage");
                    None
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_sim::testing::SimHost;

    #[test]
    fn an_idle_node_reports_its_devices_with_no_processes() {
        let host = SimHost::new("dgx-a100-40gb");
        let st = host.state();
        let whole = st.profile.gpus[4].uuid.clone();
        let mig = st.mig_devices(0)[0].ci.uuid.clone();
        let usage = NvmlUsage::new(NvmlLibrary::Path(host.lib_path()));
        let got = usage
            .sample(
                &[whole.clone(), mig.clone(), "GPU-gone".into()],
                Duration::from_secs(15),
            )
            .expect("sample");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].uuid, whole);
        assert_eq!(got[0].utilization_percent, Some(0));
        assert_eq!(got[0].memory_used, Some(0));
        assert!(got[0].processes.is_empty());
        // MIG: no device utilisation in NVML.
        assert_eq!(got[1].uuid, mig);
        assert_eq!(got[1].utilization_percent, None);
        assert_eq!(
            got[1].memory_total,
            Some(st.mig_devices(0)[0].profile.memory_mib * 1024 * 1024)
        );
    }
}
