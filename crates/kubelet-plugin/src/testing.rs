//! Builders for tests and benchmarks: simulated host folders, fixture inventories and claims.
//!
//! Not used by the plugin itself; public so integration tests and `examples/` share them.

use std::path::Path;
use std::process::{Child, ExitStatus};

use gpu_dra_device::{ComputeCapability, Gpu, Inventory, MigDevice, MigMode, Placement};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

/// Driver version of the fixture inventories.
pub const DRIVER_VERSION: &str = "580.95.05";

/// An A100-40GB-like node: `gpus` GPUs; the first `mig_gpus` have MIG on with seven
/// `1g.5gb` devices each.
pub fn a100_inventory(gpus: u32, mig_gpus: u32) -> Inventory {
    let gpus = (0..gpus)
        .map(|minor| {
            let mig_on = minor < mig_gpus;
            let mig_devices = if mig_on {
                (0..7)
                    .map(|slot| MigDevice {
                        uuid: format!("MIG-{minor:04}{slot:04}-0000-4000-8000-000000000000"),
                        gi_id: 7 + slot,
                        ci_id: 0,
                        profile: "1g.5gb".into(),
                        gi_profile_id: 19,
                        placement: Placement {
                            start: slot,
                            size: 1,
                        },
                        memory_bytes: 4864 << 20,
                        multiprocessors: 14,
                        copy_engines: 1,
                        decoders: 0,
                        encoders: 0,
                        jpeg_engines: 0,
                        ofa_engines: 0,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            Gpu {
                index: minor,
                minor,
                uuid: format!("GPU-{minor:08}-0000-4000-8000-000000000000"),
                product_name: "NVIDIA A100-SXM4-40GB".into(),
                brand: "Nvidia".into(),
                architecture: "Ampere".into(),
                cuda_compute_capability: ComputeCapability { major: 8, minor: 0 },
                memory_bytes: 40960 << 20,
                pci_bus_id: format!("0000:{:02x}:00.0", minor + 7),
                pcie_root: Some("pci0000:00".into()),
                numa_node: Some(0),
                mig: Some(MigMode {
                    current: mig_on,
                    pending: mig_on,
                }),
                mig_devices,
            }
        })
        .collect();
    Inventory {
        driver_version: DRIVER_VERSION.into(),
        cuda_driver_version: "13.0".into(),
        gpus,
    }
}

/// Creates, under `root`, the device nodes, MIG capability files and a few driver files the
/// inventory implies, laid out like a real host (regular files stand in for device nodes).
pub fn simulate_host(root: &Path, inventory: &Inventory) -> std::io::Result<()> {
    let dev = root.join("dev");
    std::fs::create_dir_all(dev.join("nvidia-caps"))?;
    for n in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
        std::fs::write(dev.join(n), "")?;
    }
    let mut cap = 1u32;
    for gpu in &inventory.gpus {
        std::fs::write(dev.join(format!("nvidia{}", gpu.minor)), "")?;
        for mig in &gpu.mig_devices {
            let gi = root.join(format!(
                "proc/driver/nvidia/capabilities/gpu{}/mig/gi{}",
                gpu.minor, mig.gi_id
            ));
            std::fs::create_dir_all(gi.join(format!("ci{}", mig.ci_id)))?;
            for file in [
                gi.join("access"),
                gi.join(format!("ci{}/access", mig.ci_id)),
            ] {
                cap += 1;
                std::fs::write(
                    &file,
                    format!("DeviceFileMinor: {cap}\nDeviceFileMode: 292\n"),
                )?;
                std::fs::write(dev.join(format!("nvidia-caps/nvidia-cap{cap}")), "")?;
            }
        }
    }
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib)?;
    for l in [
        "libcuda.so.",
        "libnvidia-ml.so.",
        "libnvidia-ptxjitcompiler.so.",
    ] {
        std::fs::write(lib.join(format!("{l}{}", inventory.driver_version)), "")?;
    }
    std::fs::create_dir_all(root.join("usr/bin"))?;
    std::fs::write(root.join("usr/bin/nvidia-smi"), "")?;
    let fw = root.join(format!("lib/firmware/nvidia/{}", inventory.driver_version));
    std::fs::create_dir_all(&fw)?;
    std::fs::write(fw.join("gsp_ga10x.bin"), "")?;
    Ok(())
}

/// An allocated ResourceClaim with `devices` as `(request, device)` results of `driver` in
/// pool `pool`, plus the given opaque `configs` (`(source, requests, parameters)`).
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    devices: &[(&str, &str)],
    configs: &[(&str, &[&str], serde_json::Value)],
) -> ResourceClaim {
    let results: Vec<_> = devices
        .iter()
        .map(|(request, device)| {
            json!({"request": request, "driver": driver, "pool": pool, "device": device})
        })
        .collect();
    let config: Vec<_> = configs
        .iter()
        .map(|(source, requests, parameters)| {
            json!({"source": source, "requests": requests,
                   "opaque": {"driver": driver, "parameters": parameters}})
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap_or_default()
}

/// A child process (a plugin under test) that is killed and reaped when dropped, so a
/// failed assertion leaves no process behind.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Sends SIGKILL.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.0.kill()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.0.wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
