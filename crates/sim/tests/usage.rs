//! A CUDA program under load, as NVML reports it: `cuda-app --hold-memory --sm-load` on a
//! whole GPU and on a MIG device of the simulated DGX A100, read back through nvml-wrapper
//! (processes, per-process and device utilisation, memory), and gone once the program exits.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

/// A running `cuda-app` with `args` on the device `visible`, once it has printed that it runs.
fn start(host: &SimHost, visible: &str, args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cuda-app"))
        .env("GPU_SIM_STATE", host.state_file().path())
        .env("CUDA_VISIBLE_DEVICES", visible)
        .env("CUDA_MPS_PIPE_DIRECTORY", host.root().join("no-mps"))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn cuda-app");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.expect("line");
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("running on") || line.starts_with("CUDA error") {
            break;
        }
    }
    (child, seen)
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

const GIB: u64 = 1 << 30;

#[test]
fn programs_under_load_are_reported_per_process_and_vanish_when_they_exit() {
    let host = SimHost::new("dgx-a100-40gb");
    let st = host.state();
    // GPUs 0-3 boot in MIG mode, 4-7 whole.
    let whole = st.profile.gpus[4].uuid.clone();
    let mig = st.mig_devices(0)[2].ci.uuid.clone();
    let mig_ids = (st.mig_devices(0)[2].gi.id, st.mig_devices(0)[2].ci.id);

    let (a, out) = start(&host, &whole, &["--hold-memory", "2Gi", "--sm-load", "40"]);
    assert!(
        out.contains(&format!(
            "running on {whole}: holding {} bytes, SM load 40%",
            2 * GIB
        )),
        "{out}"
    );
    let (b, out) = start(
        &host,
        &mig,
        &["--hold-memory", "1Gi", "--sm-load", "70", "--seconds", "60"],
    );
    assert!(out.contains(&format!("running on {mig}")), "{out}");
    // More than the MIG device's memory (1g.5gb): refused as CUDA refuses it.
    let (c, out) = start(&host, &mig, &["--hold-memory", "6Gi"]);
    assert!(out.contains("cudaErrorMemoryAllocation"), "{out}");
    stop(c);

    let nvml = Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("init");
    let gpu = nvml.device_by_uuid(whole.as_str()).expect("gpu");
    let procs = gpu.running_compute_processes().expect("processes");
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].pid, a.id());
    assert_eq!(procs[0].used_gpu_memory, UsedGpuMemory::Used(2 * GIB));
    assert_eq!(
        (procs[0].gpu_instance_id, procs[0].compute_instance_id),
        (None, None)
    );
    let samples = gpu.process_utilization_stats(None).expect("samples");
    assert_eq!(
        samples
            .iter()
            .map(|s| (s.pid, s.sm_util))
            .collect::<Vec<_>>(),
        [(a.id(), 40)]
    );
    assert_eq!(gpu.utilization_rates().expect("rates").gpu, 40);
    let mem = gpu.memory_info().expect("memory");
    assert_eq!((mem.used, mem.free + mem.used), (2 * GIB, mem.total));

    let dev = nvml.device_by_uuid(mig.as_str()).expect("mig device");
    let procs = dev.running_compute_processes().expect("processes");
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].pid, b.id());
    assert_eq!(
        (procs[0].gpu_instance_id, procs[0].compute_instance_id),
        (Some(mig_ids.0), Some(mig_ids.1))
    );
    assert_eq!(dev.memory_info().expect("memory").used, GIB);
    // NVML has no per-process or device utilisation on MIG.
    assert!(matches!(
        dev.process_utilization_stats(None),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        dev.utilization_rates(),
        Err(NvmlError::NotSupported)
    ));
    // The parent GPU lists the processes of its MIG devices.
    let parent = nvml.device_by_index(0).expect("gpu 0");
    let pids: Vec<u32> = parent
        .running_compute_processes()
        .expect("processes")
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(pids, [b.id()]);
    assert!(
        nvml.device_by_index(5)
            .expect("gpu 5")
            .running_compute_processes()
            .expect("processes")
            .is_empty()
    );

    stop(a);
    stop(b);
    assert!(
        gpu.running_compute_processes()
            .expect("processes")
            .is_empty()
    );
    assert!(
        dev.running_compute_processes()
            .expect("processes")
            .is_empty()
    );
    assert_eq!(gpu.memory_info().expect("memory").used, 0);
    assert!(matches!(
        gpu.process_utilization_stats(None),
        Err(NvmlError::NotFound)
    ));
}
