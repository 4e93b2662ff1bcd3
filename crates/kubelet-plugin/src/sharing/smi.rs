//! `nvidia-smi` calls for sharing: compute mode and the time-slice policy.
//!
//! Only whole GPUs are ever passed here (a MIG-enabled GPU rejects compute-mode changes, and
//! time-slicing on a MIG device needs no setting). Output parsing is limited to recognising
//! "not supported" answers so they become a clear prepare error; success is the exit status.

use std::time::Duration;

use gpu_dra_api::Interval;

use super::error::SharingError;
use super::tools::{DriverRoot, NVIDIA_SMI, ToolOutput};

/// A compute mode we set (`nvidia-smi -c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeMode {
    /// Any number of processes may use the GPU (time-slicing, no sharing).
    Default,
    /// One process (the MPS server) per GPU.
    ExclusiveProcess,
}

impl ComputeMode {
    /// The name `nvidia-smi -c` takes.
    pub fn as_arg(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

/// Sets the compute mode of one whole GPU.
pub async fn set_compute_mode(
    root: &DriverRoot,
    gpu_uuid: &str,
    mode: ComputeMode,
    timeout: Duration,
) -> Result<(), SharingError> {
    let out = root
        .run(
            NVIDIA_SMI,
            &["-i", gpu_uuid, "-c", mode.as_arg()],
            &[],
            None,
            timeout,
        )
        .await?;
    // "Compute mode is already set to ..." is the outcome we want, whatever the exit status.
    if out.success() || out.combined().contains("already set to") {
        return Ok(());
    }
    match not_supported_reason(&out) {
        Some(reason) => Err(SharingError::ComputeModeNotSupported {
            gpu: gpu_uuid.to_string(),
            mode: mode.as_arg(),
            reason,
        }),
        None => Err(out.into_error()),
    }
}

/// Sets the time-slice interval of one whole GPU.
pub async fn set_timeslice(
    root: &DriverRoot,
    gpu_uuid: &str,
    interval: Interval,
    timeout: Duration,
) -> Result<(), SharingError> {
    let value = interval.as_nvidia_smi_value().to_string();
    let out = root
        .run(
            NVIDIA_SMI,
            &["compute-policy", "-i", gpu_uuid, "--set-timeslice", &value],
            &[],
            None,
            timeout,
        )
        .await?;
    if out.success() {
        return Ok(());
    }
    match not_supported_reason(&out) {
        Some(reason) => Err(SharingError::TimeSliceNotSupported {
            gpu: gpu_uuid.to_string(),
            reason,
        }),
        None => Err(out.into_error()),
    }
}

/// The tool's reason when it says the operation is not supported on this device: exit status
/// 3 ("operation not available on target device") or a "Not Supported" / "not supported" line.
/// Returns the first such line, which names the setting and the GPU.
fn not_supported_reason(out: &ToolOutput) -> Option<String> {
    let text = out.combined();
    let line = text
        .lines()
        .find(|l| l.to_ascii_lowercase().contains("not supported"))
        .map(|l| l.trim().to_string());
    match (line, out.code) {
        (Some(l), _) => Some(l),
        (None, Some(3)) => Some(if text.is_empty() {
            "operation not available on this device (exit status 3)".to_string()
        } else {
            text
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(code: i32, stdout: &str) -> ToolOutput {
        ToolOutput {
            command: "nvidia-smi".into(),
            code: Some(code),
            stdout: stdout.into(),
            stderr: String::new(),
        }
    }

    #[test]
    fn recognises_the_real_unsupported_timeslice_answer() {
        let o = out(
            3,
            "Failed to set timeslice policy with value Default for GPU 0 : Not Supported\n\
             Failed to set timeslice for requested devices : Not Supported\n",
        );
        assert_eq!(
            not_supported_reason(&o).unwrap(),
            "Failed to set timeslice policy with value Default for GPU 0 : Not Supported"
        );
    }

    #[test]
    fn other_failures_are_not_unsupported() {
        assert_eq!(
            not_supported_reason(&out(4, "Insufficient Permissions")),
            None
        );
        assert!(not_supported_reason(&out(3, "")).is_some());
        assert!(
            not_supported_reason(&out(
                3,
                "Setting compute mode to EXCLUSIVE_PROCESS is not supported on a MIG-enabled device."
            ))
            .unwrap()
            .contains("MIG-enabled")
        );
    }
}
