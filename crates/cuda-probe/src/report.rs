//! The probe's run and its report: each step in order, stopping at the first failure,
//! which the report names (see the crate doc for the JSON shape).

use std::ffi::{CStr, c_void};

use serde::Serialize;

use crate::Args;
use crate::cuda::{CudaError, Driver};
use crate::kernel;

/// What the probe found; serialised as the one JSON object it prints.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// `cuDriverGetVersion` (`12080` for CUDA 12.8); null if not reached.
    pub driver_version: Option<i32>,
    /// Every device CUDA sees, in ordinal order.
    pub devices: Vec<DeviceReport>,
    /// `cuMemGetInfo` in the context on the chosen device, before the kernel.
    pub memory: Option<MemoryReport>,
    /// The kernel run.
    pub kernel: Option<KernelReport>,
    /// The allocation, with `--alloc-bytes` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc: Option<AllocReport>,
    /// The first failed step before the allocation: `"<call>: <CUDA error name>"`.
    pub error: Option<String>,
}

/// One device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceReport {
    /// CUDA ordinal.
    pub index: i32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// The 16 UUID bytes as 8-4-4-4-12 hex (a MIG device's own UUID, without `MIG-`).
    pub uuid: String,
    /// `cuDeviceTotalMem`, bytes.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
    pub sm_count: i32,
}

/// Free and total device memory, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// Free.
    pub free: u64,
    /// Total.
    pub total: u64,
}

/// The kernel's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KernelReport {
    /// The device it ran on.
    pub device: i32,
    /// Vector length.
    pub elements: u32,
    /// Launched, completed and verified.
    pub ok: bool,
    /// Elements whose result differs from the host's.
    pub mismatches: u64,
}

/// The allocation's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AllocReport {
    /// Bytes asked for.
    pub bytes: u64,
    /// It succeeded (and was freed).
    pub ok: bool,
    /// CUDA's error name when it failed.
    pub error: Option<String>,
}

impl Report {
    /// 0 when everything up to the verified kernel succeeded, else 1.
    pub fn exit_code(&self) -> i32 {
        let ok = self.error.is_none() && self.kernel.is_some_and(|k| k.ok);
        i32::from(!ok)
    }

    /// The JSON text, one line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            format!("{{\"error\":{}}}", serde_json::Value::String(e.to_string()))
        })
    }
}

/// The canonical 8-4-4-4-12 lower-case hex form of 16 UUID bytes.
pub fn uuid_string(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Runs the probe.
pub fn run(args: &Args) -> Report {
    let mut report = Report::default();
    if let Err(e) = steps(args, &mut report) {
        report.error = Some(e.to_string());
    }
    report
}

fn steps(args: &Args, report: &mut Report) -> Result<(), CudaError> {
    let driver = Driver::load(&args.libcuda).map_err(|e| CudaError {
        call: format!("dlopen {}", args.libcuda),
        name: e.name,
    })?;
    driver.init()?;
    report.driver_version = Some(driver.version()?);
    for index in 0..driver.device_count()? {
        let info = driver.device_info(driver.device(index)?)?;
        report.devices.push(DeviceReport {
            index,
            name: info.name,
            uuid: uuid_string(&info.uuid),
            total_memory: info.total_memory,
            sm_count: info.sm_count,
        });
    }
    let dev = driver.device(args.device)?;
    let ctx = driver.create_context(dev)?;
    let (free, total) = ctx.mem_info()?;
    report.memory = Some(MemoryReport { free, total });

    let n = args.elements;
    let (x, y) = kernel::inputs(n);
    let bytes = u64::from(n) * 4;
    let mut out = vec![0f32; n as usize];
    {
        let dx = ctx.alloc(bytes)?;
        let dy = ctx.alloc(bytes)?;
        ctx.copy_to(&dx, &x)?;
        ctx.copy_to(&dy, &y)?;
        let ptx = CStr::from_bytes_with_nul(kernel::PTX.as_bytes()).map_err(|_| CudaError {
            call: "probe".into(),
            name: "PTX text is not NUL-terminated".into(),
        })?;
        let module = ctx.load_module(ptx)?;
        let (mut px, mut py, mut a, mut count) = (dx.ptr, dy.ptr, kernel::A, n);
        let mut params: [*mut c_void; 4] = [
            (&raw mut px).cast(),
            (&raw mut py).cast(),
            (&raw mut a).cast(),
            (&raw mut count).cast(),
        ];
        let entry = c"saxpy";
        ctx.launch(&module, entry, kernel::grid(n), kernel::BLOCK, &mut params)?;
        ctx.copy_from(&dy, &mut out)?;
    }
    let mismatches = kernel::mismatches(&x, &y, &out);
    report.kernel = Some(KernelReport {
        device: args.device,
        elements: n,
        ok: mismatches == 0,
        mismatches,
    });
    if let Some(bytes) = args.alloc_bytes {
        let outcome = ctx.alloc(bytes);
        report.alloc = Some(AllocReport {
            bytes,
            ok: outcome.is_ok(),
            error: outcome.err().map(|e| e.name),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_canonical_hex() {
        let b = [
            0x5d, 0x5b, 0xa0, 0xd6, 0xd3, 0x3d, 0x2b, 0x2c, 0x52, 0x4d, 0x9e, 0x3d, 0x8d, 0x2b,
            0x8a, 0x77,
        ];
        assert_eq!(uuid_string(&b), "5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77");
    }

    #[test]
    fn json_shape_and_exit_code() {
        let mut r = Report {
            driver_version: Some(12080),
            devices: vec![DeviceReport {
                index: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                uuid: "5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77".into(),
                total_memory: 85520809984,
                sm_count: 132,
            }],
            memory: Some(MemoryReport { free: 1, total: 2 }),
            kernel: Some(KernelReport {
                device: 0,
                elements: 10,
                ok: true,
                mismatches: 0,
            }),
            alloc: None,
            error: None,
        };
        assert_eq!(r.exit_code(), 0);
        assert_eq!(
            r.to_json(),
            r#"{"driver_version":12080,"devices":[{"index":0,"name":"NVIDIA H100 80GB HBM3","uuid":"5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77","total_memory":85520809984,"sm_count":132}],"memory":{"free":1,"total":2},"kernel":{"device":0,"elements":10,"ok":true,"mismatches":0},"error":null}"#
        );
        r.alloc = Some(AllocReport {
            bytes: 5,
            ok: false,
            error: Some("CUDA_ERROR_OUT_OF_MEMORY".into()),
        });
        assert_eq!(r.exit_code(), 0, "the allocation is not judged");
        assert!(r.to_json().contains(
            r#""alloc":{"bytes":5,"ok":false,"error":"CUDA_ERROR_OUT_OF_MEMORY"},"error":null}"#
        ));
        r.kernel = Some(KernelReport {
            mismatches: 3,
            ok: false,
            ..r.kernel.expect("kernel")
        });
        assert_eq!(r.exit_code(), 1);
        let failed = Report {
            error: Some("cuInit: CUDA_ERROR_NO_DEVICE".into()),
            ..Report::default()
        };
        assert_eq!(failed.exit_code(), 1);
        assert_eq!(
            failed.to_json(),
            r#"{"driver_version":null,"devices":[],"memory":null,"kernel":null,"error":"cuInit: CUDA_ERROR_NO_DEVICE"}"#
        );
    }

    #[test]
    fn a_missing_library_is_reported_with_the_loaders_message() {
        let r = run(&Args {
            elements: 1,
            alloc_bytes: None,
            device: 0,
            libcuda: "/nonexistent/libcuda.so.1".into(),
        });
        let err = r.error.clone().expect("error");
        assert!(
            err.starts_with("dlopen /nonexistent/libcuda.so.1: "),
            "{err}"
        );
        assert_eq!(r.exit_code(), 1);
    }
}
