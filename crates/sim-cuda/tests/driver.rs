//! The simulated CUDA driver's model on a simulated host: PTX refused as the real JIT
//! refuses it, and a context's memory reported to the node as NVML's readers see it.

use std::path::PathBuf;

use gpu_dra_sim::cuda::ClientEnv;
use gpu_dra_sim::testing::SimHost;
use gpu_dra_sim_cuda::driver::{Driver, Environment};
use gpu_dra_sim_cuda::result;

const SAXPY_HEAD: &str = ".version 6.0\n.target sm_50\n.address_size 64\n";

fn env(host: &SimHost, pipe: &tempfile::TempDir, shm: PathBuf) -> Environment {
    Environment {
        library: Some(host.libcuda_path()),
        client: ClientEnv {
            pipe_dir: Some(pipe.path().to_path_buf()),
            ..ClientEnv::default()
        },
        shm_dir: shm,
    }
}

#[test]
fn broken_or_unsupported_ptx_is_invalid_ptx_with_a_reason() {
    let host = SimHost::new("t4");
    let pipe = tempfile::tempdir().expect("tmp");
    let shm = tempfile::tempdir().expect("shm");
    let mut d = Driver::init(&env(&host, &pipe, shm.path().to_path_buf())).expect("init");
    assert_eq!(d.version(), 13000);
    let ctx = d.create_context(0).expect("context");
    let cases = [
        ("garbage".to_string(), "not simulated"),
        (
            format!("{SAXPY_HEAD}.visible .entry k()\n{{\n\tbar.sync 0;\n\tret;\n}}\n"),
            "bar",
        ),
        (
            format!("{SAXPY_HEAD}.visible .entry k()\n{{\n\tmov.u32 %r1, 1;\n\tret;\n}}\n"),
            "undeclared register %r1",
        ),
        (
            format!("{SAXPY_HEAD}.visible .entry k()\n{{\n\tret;\n"),
            "missing `}`",
        ),
        (
            ".version 6.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"
                .to_string(),
            "higher than the device's sm_75",
        ),
    ];
    for (text, why) in cases {
        assert_eq!(
            d.load_module(ctx, &text),
            Err(result::INVALID_PTX),
            "{text}"
        );
        let reason = d.last_ptx_error.clone().unwrap_or_default();
        assert!(reason.contains(why), "{reason:?} should say {why:?}");
    }
    let newer =
        ".version 10.0\n.target sm_50\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n";
    assert_eq!(
        d.load_module(ctx, newer),
        Err(result::UNSUPPORTED_PTX_VERSION)
    );
    let ok = format!("{SAXPY_HEAD}.visible .entry k()\n{{\n\tret;\n}}\n");
    let m = d.load_module(ctx, &ok).expect("a valid module loads");
    assert_eq!(d.function(m, "nope"), Err(result::NOT_FOUND));
    assert!(d.function(m, "k").is_ok());
}

#[test]
fn a_context_reports_its_memory_to_the_node_until_it_ends() {
    let host = SimHost::new("t4");
    let pipe = tempfile::tempdir().expect("tmp");
    // NVML's readers look for records in the holder's /dev/shm.
    let mut d = Driver::init(&env(&host, &pipe, PathBuf::from("/dev/shm"))).expect("init");
    let state_dir = host
        .state_file()
        .path()
        .parent()
        .expect("dir")
        .to_path_buf();
    let gpu = host.profile().gpus[0].uuid.clone();
    let ctx = d.create_context(0).expect("context");
    let ptr = d.alloc(ctx, 1 << 30).expect("1 GiB");
    let mine = |procs: Vec<gpu_dra_sim::processes::RunningProcess>| {
        procs
            .into_iter()
            .find(|p| p.pid == std::process::id())
            .map(|p| p.record)
    };
    let rec = mine(gpu_dra_sim::processes::running(
        std::path::Path::new("/proc"),
        &state_dir,
    ))
    .expect("the process is listed while it holds memory");
    assert_eq!((rec.uuid.as_str(), rec.used_bytes), (gpu.as_str(), 1 << 30));
    let (free, total) = d.mem_info(ctx).expect("info");
    assert_eq!((total, total - free), (15360 << 20, 1 << 30));
    d.free(ctx, ptr).expect("free");
    assert_eq!(d.free(ctx, ptr), Err(result::INVALID_VALUE));
    let rec = mine(gpu_dra_sim::processes::running(
        std::path::Path::new("/proc"),
        &state_dir,
    ))
    .expect("still listed with its context");
    assert_eq!(rec.used_bytes, 0);
    let path = d.registration().expect("registered").to_path_buf();
    d.destroy_context(ctx).expect("destroy");
    assert!(d.registration().is_none() && !path.exists());
    assert_eq!(d.alloc(ctx, 1), Err(result::INVALID_CONTEXT));
}
