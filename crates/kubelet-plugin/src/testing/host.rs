//! A simulated host: the files a real node has for its GPUs, under a folder of a test.

use std::path::Path;

use gpu_dra_device::Inventory;

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
        let file = format!("{l}{}", inventory.driver_version);
        std::fs::write(lib.join(&file), "")?;
        // The soname link the driver's installer makes (no ld cache here: the fallback
        // search finds the folder by it).
        let soname = lib.join(format!("{l}1"));
        let _ = std::fs::remove_file(&soname);
        std::os::unix::fs::symlink(&file, soname)?;
    }
    std::fs::create_dir_all(root.join("usr/bin"))?;
    std::fs::write(root.join("usr/bin/nvidia-smi"), "")?;
    let fw = root.join(format!("lib/firmware/nvidia/{}", inventory.driver_version));
    std::fs::create_dir_all(&fw)?;
    std::fs::write(fw.join("gsp_ga10x.bin"), "")?;
    Ok(())
}
