//! `nvidia-smi` stand-in: the options the driver and its operators use, with the real tool's
//! messages and exit codes (the `nvidia-smi(1)` manual page of driver 535, "Return Value" and
//! the option sections; the MIG commands as in NVIDIA's MIG User Guide, "Getting Started with
//! MIG").
//!
//! Supported: `-L`, `--version`, `-i <id[,id…]>` with `-c <mode>`, `-pm <0|1>`,
//! `-mig <0|1>`, `-r` (GPU reset: health only, see [`crate::health`]), `-q` (short summary)
//! and `--query-gpu=<fields> --format=csv[,noheader][,nounits]` (`query`),
//! `compute-policy [-i <ids>] (--set-timeslice <0..3> | -l)` (`policy`) and
//! `mig [-i <ids>] (-lgip | -lgipp | -lgi | -cgi <profiles>[-C] | -dci | -dgi)` (`mig`).
//! `<id>` is an index, a GPU UUID, a PCI bus ID in any of its forms, or a board serial. This
//! module parses the command line and carries out the rest.
//!
//! Invariant: every change goes to the simulator state file, so NVML reads through the
//! simulated library agree with what this tool set. Messages go to stdout, as the real tool
//! prints them there; exit codes follow the man page (2 invalid argument, 3 not supported,
//! 6 not found, 9 driver not loaded, 12 no NVML library, 15 GPU fallen off the bus, and 18
//! for a library of another version than the kernel module, as real hosts return it after
//! an upgrade in place). A lost GPU makes `-L` and
//! the summaries print the real "Unable to determine the device handle" line for it.

use std::io::Write;

mod mig;
mod policy;
mod query;

use crate::SimError;
use crate::state::{ComputeMode, State, StateFile};

/// Exit code: success.
pub const EXIT_OK: i32 = 0;
/// Exit code: invalid argument or flag.
pub const EXIT_INVALID: i32 = 2;
/// Exit code: operation not available on the target device.
pub const EXIT_NOT_SUPPORTED: i32 = 3;
/// Exit code: a query to find an object was unsuccessful.
pub const EXIT_NOT_FOUND: i32 = 6;
/// Exit code: the driver is not loaded.
pub const EXIT_NO_DRIVER: i32 = 9;
/// Exit code: the NVML library could not be found or loaded.
pub const EXIT_NO_LIBRARY: i32 = 12;
/// Exit code: the NVML library and the kernel module are of different versions
/// (`NVML_ERROR_LIB_RM_VERSION_MISMATCH`).
pub const EXIT_VERSION_MISMATCH: i32 = 18;
/// Exit code: a GPU has fallen off the bus.
pub const EXIT_GPU_LOST: i32 = 15;
/// Exit code: other error.
pub const EXIT_OTHER: i32 = 255;

pub(crate) const INVALID_COMBINATION: &str =
    "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.";

/// Runs `nvidia-smi <args>` against the state in `file` (or the error locating it).
pub fn run(file: Result<StateFile, SimError>, args: &[String], out: &mut dyn Write) -> i32 {
    match run_inner(file, args, out) {
        Ok(code) => code,
        // Output errors (closed stdout) leave nothing more to report.
        Err(_) => EXIT_OTHER,
    }
}

#[derive(Default)]
struct Opts {
    id: Option<String>,
    compute_mode: Option<String>,
    persistence: Option<String>,
    mig_mode: Option<String>,
    query_gpu: Option<String>,
    format: Option<String>,
    list: bool,
    version: bool,
    query: bool,
    reset: bool,
    help: bool,
}

/// One argument as `(name, inline value)`: `--name=value` and `-n=value` carry their value,
/// anything else (a flag whose value follows, or a plain word) carries none. Every
/// subcommand's parser splits its arguments with it.
fn split_flag(arg: &str) -> (&str, Option<String>) {
    match arg.split_once('=') {
        Some((n, v)) if n.starts_with('-') => (n, Some(v.to_string())),
        _ => (arg, None),
    }
}

/// Splits `--name=value` / `-n=value` / `-n value` style arguments.
fn parse_opts(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (name, inline) = split_flag(arg);
        let mut value = |inline: Option<String>| -> Result<String, String> {
            match inline {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| INVALID_COMBINATION.to_string()),
            }
        };
        match name {
            "-i" | "--id" => o.id = Some(value(inline)?),
            "-c" | "--compute-mode" => o.compute_mode = Some(value(inline)?),
            "-pm" | "--persistence-mode" => o.persistence = Some(value(inline)?),
            "-mig" | "--multi-instance-gpu" => o.mig_mode = Some(value(inline)?),
            "--query-gpu" => o.query_gpu = Some(value(inline)?),
            "--format" => o.format = Some(value(inline)?),
            "-L" | "--list-gpus" => o.list = true,
            "--version" => o.version = true,
            "-q" | "--query" => o.query = true,
            "-r" | "--gpu-reset" => o.reset = true,
            "-h" | "--help" => o.help = true,
            _ => return Err(INVALID_COMBINATION.to_string()),
        }
    }
    Ok(o)
}

fn run_inner(
    file: Result<StateFile, SimError>,
    args: &[String],
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    if args.first().map(String::as_str) == Some("mig") {
        let Ok(file) = file else {
            return no_driver(out);
        };
        if let Some(code) = driver_refusal(&file, out)? {
            return Ok(code);
        }
        return mig::run(&file, &args[1..], out);
    }
    if args.first().map(String::as_str) == Some("topo") {
        let Ok(file) = file else {
            return no_driver(out);
        };
        if let Some(code) = driver_refusal(&file, out)? {
            return Ok(code);
        }
        return topo(&file, &args[1..], out);
    }
    if args.first().map(String::as_str) == Some("compute-policy") {
        let Ok(file) = file else {
            return no_driver(out);
        };
        if let Some(code) = driver_refusal(&file, out)? {
            return Ok(code);
        }
        return policy::compute_policy(&file, &args[1..], out);
    }
    let o = match parse_opts(args) {
        Ok(o) => o,
        Err(msg) => {
            writeln!(out, "{msg}")?;
            return Ok(EXIT_INVALID);
        }
    };
    if o.help {
        writeln!(out, "{HELP}")?;
        return Ok(EXIT_OK);
    }
    let Ok(file) = file else {
        return no_driver(out);
    };
    let Ok(state) = file.load_visible() else {
        return no_driver(out);
    };
    if let Some(code) = driver_refusal(&file, out)? {
        return Ok(code);
    }
    if o.version {
        let ver = &state.profile.driver_version;
        let nvml = ver.split('.').take(2).collect::<Vec<_>>().join(".");
        let cuda = state.profile.cuda_driver_version;
        writeln!(out, "NVIDIA-SMI version  : {ver}")?;
        writeln!(out, "NVML version        : {nvml}")?;
        writeln!(out, "DRIVER version      : {ver}")?;
        writeln!(
            out,
            "CUDA Version        : {}.{}",
            cuda / 1000,
            cuda % 1000 / 10
        )?;
        return Ok(EXIT_OK);
    }
    let targets = match &o.id {
        None => (0..state.gpus.len()).collect(),
        Some(ids) => match resolve_ids(&state, ids) {
            Some(t) => t,
            None => {
                writeln!(out, "No devices were found")?;
                return Ok(EXIT_NOT_FOUND);
            }
        },
    };
    if o.reset {
        return reset(&file, &targets, out);
    }
    if o.list {
        return list(&state, &targets, out);
    }
    if let Some(mode) = &o.compute_mode {
        return set_compute_mode(&file, &targets, mode, out);
    }
    if let Some(m) = &o.mig_mode {
        return mig::set_mode(&file, &targets, m, out);
    }
    if let Some(pm) = &o.persistence {
        return set_persistence(&file, &targets, pm, out);
    }
    if let Some(fields) = &o.query_gpu {
        return query::query_gpu(&state, &targets, fields, o.format.as_deref(), out);
    }
    if o.format.is_some() {
        writeln!(out, "{INVALID_COMBINATION}")?;
        return Ok(EXIT_INVALID);
    }
    query::summary(&state, &targets, o.query, out)
}

/// Fails as the real tool does when it cannot use NVML on the node now (see
/// [`crate::upgrade`]): no NVML library where the loader looks (exit 12), no kernel module
/// (exit 9), or a library of another version than the module (exit 18). `None`: go on.
fn driver_refusal(file: &StateFile, out: &mut dyn Write) -> std::io::Result<Option<i32>> {
    let Ok(state) = file.load() else {
        return no_driver(out).map(Some);
    };
    let preload = std::env::var("LD_PRELOAD").ok();
    let library = match crate::upgrade::tool_library(
        file.root().as_deref(),
        state.profile.driver_layout,
        preload.as_deref(),
    ) {
        Ok(v) => v,
        Err(_) => {
            writeln!(
                out,
                "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA Display Driver is properly installed and present in your system.\nPlease also try adding directory that contains libnvidia-ml.so to your system PATH."
            )?;
            return Ok(Some(EXIT_NO_LIBRARY));
        }
    };
    match crate::upgrade::nvml_access(&state, library.as_deref()) {
        Ok(()) => Ok(None),
        Err(crate::upgrade::NvmlRefusal::DriverNotLoaded) => no_driver(out).map(Some),
        Err(crate::upgrade::NvmlRefusal::VersionMismatch) => {
            // The library's major.minor, as the real message prints it.
            let ver = library.unwrap_or_default();
            let short = ver.split('.').take(2).collect::<Vec<_>>().join(".");
            writeln!(
                out,
                "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {short}"
            )?;
            Ok(Some(EXIT_VERSION_MISMATCH))
        }
    }
}

/// `nvidia-smi topo -m` (`--matrix`): the GPUs this process sees, with their NVLink and PCIe
/// connections, CPU and NUMA affinity, and the legend ([`crate::topology::matrix`]).
fn topo(file: &StateFile, args: &[String], out: &mut dyn Write) -> std::io::Result<i32> {
    if !matches!(args, [a] if a == "-m" || a == "--matrix") {
        writeln!(
            out,
            "topo: only -m/--matrix is simulated\n\nTopology options:\n    -m, --matrix    Display the GPUDirect communication matrix for the system."
        )?;
        return Ok(EXIT_INVALID);
    }
    let Ok(state) = file.load_visible() else {
        return no_driver(out);
    };
    write!(out, "{}", crate::topology::matrix(&state.profile))?;
    Ok(EXIT_OK)
}

pub(crate) fn no_driver(out: &mut dyn Write) -> std::io::Result<i32> {
    writeln!(
        out,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. \
         Make sure that the latest NVIDIA driver is installed and running."
    )?;
    Ok(EXIT_NO_DRIVER)
}

/// Resolves a comma-separated `-i` value to GPU indices (None if any is unknown).
pub(crate) fn resolve_ids(state: &State, ids: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for id in ids.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let i = state.gpu_by_id(id)?;
        if !out.contains(&i) {
            out.push(i);
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The line nvidia-smi prints for a GPU NVML answers `GPU_IS_LOST` for.
fn lost_line(state: &State, i: usize) -> String {
    format!(
        "Unable to determine the device handle for GPU {}: GPU is lost. Reboot the system to recover this GPU",
        state.profile.gpus[i].pci().legacy()
    )
}

/// `-r`: resets the health of each target GPU ([`State::reset_gpu`]).
fn reset(file: &StateFile, targets: &[usize], out: &mut dyn Write) -> std::io::Result<i32> {
    let mut lines = Vec::new();
    let res = file.update(|s| {
        for &i in targets {
            s.reset_gpu(i)?;
            lines.push(format!(
                "GPU {} was successfully reset.",
                s.profile.gpus[i].pci().long()
            ));
        }
        Ok::<(), crate::health::HealthError>(())
    });
    if !matches!(res, Ok(Ok(()))) {
        return no_driver(out);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    writeln!(out, "All done.")?;
    Ok(EXIT_OK)
}

fn list(state: &State, targets: &[usize], out: &mut dyn Write) -> std::io::Result<i32> {
    let mut code = EXIT_OK;
    for &i in targets {
        let g = &state.profile.gpus[i];
        if state.gpus[i].health.lost {
            writeln!(out, "{}", lost_line(state, i))?;
            code = EXIT_GPU_LOST;
            continue;
        }
        writeln!(out, "GPU {i}: {} (UUID: {})", g.name, g.uuid)?;
        for (k, m) in state.mig_devices(i).iter().enumerate() {
            let name = format!("MIG {}", m.name());
            writeln!(out, "  {name:<15} Device {k:>2}: (UUID: {})", m.ci.uuid)?;
        }
    }
    Ok(code)
}

fn parse_mode(s: &str) -> Option<ComputeMode> {
    match s.to_ascii_uppercase().as_str() {
        "0" | "DEFAULT" => Some(ComputeMode::Default),
        "1" | "EXCLUSIVE_THREAD" => Some(ComputeMode::ExclusiveThread),
        "2" | "PROHIBITED" => Some(ComputeMode::Prohibited),
        "3" | "EXCLUSIVE_PROCESS" => Some(ComputeMode::ExclusiveProcess),
        _ => None,
    }
}

fn set_compute_mode(
    file: &StateFile,
    targets: &[usize],
    mode: &str,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let mode = match parse_mode(mode) {
        Some(ComputeMode::ExclusiveThread) => {
            writeln!(
                out,
                "Exclusive_Thread was deprecated! Use value 3:Exclusive_Process instead."
            )?;
            return Ok(EXIT_INVALID);
        }
        Some(m) => m,
        None => {
            writeln!(out, "Invalid compute mode: {mode}")?;
            return Ok(EXIT_INVALID);
        }
    };
    let mut lines = Vec::new();
    let mut failed = false;
    let res = file.update(|s| {
        for &i in targets {
            let bus = s.profile.gpus[i].pci().long();
            let g = &mut s.gpus[i];
            if g.mig_current {
                lines.push(format!(
                    "Setting compute mode to {} is not supported on a MIG-enabled device.",
                    mode.smi_name()
                ));
                failed = true;
            } else if g.compute_mode == mode {
                lines.push(format!(
                    "Compute mode is already set to {} for GPU {bus}.",
                    mode.smi_name()
                ));
            } else {
                g.compute_mode = mode;
                lines.push(format!(
                    "Set compute mode to {} for GPU {bus}.",
                    mode.smi_name()
                ));
            }
        }
        Ok::<(), ()>(())
    });
    if res.is_err() {
        return no_driver(out);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    if failed {
        return Ok(EXIT_NOT_SUPPORTED);
    }
    writeln!(out, "All done.")?;
    Ok(EXIT_OK)
}

/// An on/off argument as nvidia-smi takes it (`0`/`1`, `DISABLED`/`ENABLED`, any case);
/// `None` for anything else.
fn switch_value(value: &str) -> Option<bool> {
    match value.to_ascii_uppercase().as_str() {
        "0" | "DISABLED" => Some(false),
        "1" | "ENABLED" => Some(true),
        _ => None,
    }
}

fn set_persistence(
    file: &StateFile,
    targets: &[usize],
    value: &str,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(on) = switch_value(value) else {
        writeln!(out, "{INVALID_COMBINATION}")?;
        return Ok(EXIT_INVALID);
    };
    let word = if on { "Enabled" } else { "Disabled" };
    let mut lines = Vec::new();
    let res = file.update(|s| {
        for &i in targets {
            let bus = s.profile.gpus[i].pci().long();
            let g = &mut s.gpus[i];
            if g.persistence == on {
                lines.push(format!("Persistence mode is already {word} for GPU {bus}."));
            } else {
                g.persistence = on;
                lines.push(format!("{word} persistence mode for GPU {bus}."));
            }
        }
        Ok::<(), ()>(())
    });
    if res.is_err() {
        return no_driver(out);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    writeln!(out, "All done.")?;
    Ok(EXIT_OK)
}

const HELP: &str = "NVIDIA System Management Interface -- v580.95.05 (GPU simulator)

    -h,   --help                Print usage information and exit.
    -L,   --list-gpus           Display a list of GPUs connected to the system.
    -q,   --query               Display GPU or Unit info.
    -r,   --gpu-reset           Trigger reset of the GPU.
    -i,   --id=                 Target a specific GPU.
          --query-gpu=          Information about GPU (index, uuid, name, pci.bus_id,
                                memory.total, compute_mode, mig.mode.current, ...).
          --format=             csv[,noheader][,nounits]
    -pm,  --persistence-mode=   Set persistence mode: 0/DISABLED, 1/ENABLED
    -c,   --compute-mode=       Set MODE for compute applications:
                                0/DEFAULT, 1/EXCLUSIVE_THREAD (DEPRECATED),
                                2/PROHIBITED, 3/EXCLUSIVE_PROCESS
          --version             Print the version and exit.

    compute-policy              Control and list compute policies.
    topo                        Display topological information about the system
                                (-m: the GPUDirect communication matrix).";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;

    pub(super) struct Host {
        _dir: tempfile::TempDir,
        pub(super) file: StateFile,
    }

    pub(super) fn host(profile: &str) -> Host {
        let dir = tempfile::tempdir().expect("tmp");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(
            Profile::load(profile).expect("profile"),
        ))
        .expect("create");
        Host { _dir: dir, file }
    }

    pub(super) fn smi(h: &Host, args: &str) -> (i32, String) {
        let args: Vec<String> = args.split_whitespace().map(String::from).collect();
        let mut out = Vec::new();
        let code = run(Ok(h.file.clone()), &args, &mut out);
        (code, String::from_utf8(out).expect("utf8"))
    }

    #[test]
    fn topo_matrix_shows_the_visible_gpus() {
        let h = host("h100-pcie-x8-nvlink");
        let (code, text) = smi(&h, "topo -m");
        assert_eq!(code, EXIT_OK, "{text}");
        assert!(
            text.starts_with("\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity"),
            "{text}"
        );
        assert!(
            text.contains("GPU0\t X \tNODE\tNODE\tSYS\tSYS\tNV12\tSYS\tSYS\t0-31,64-95\t0\t\tN/A"),
            "{text}"
        );
        assert!(text.contains("Legend:"), "{text}");
        assert_eq!(smi(&h, "topo -p2p r").0, EXIT_INVALID);
    }

    #[test]
    fn version_matches_the_r580_format() {
        let h = host("t4");
        let (code, out) = smi(&h, "--version");
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "NVIDIA-SMI version  : 580.95.05\nNVML version        : 580.95\n\
             DRIVER version      : 580.95.05\nCUDA Version        : 13.0\n"
        );
    }

    #[test]
    fn list_shows_mig_devices_under_their_gpu() {
        let h = host("dgx-a100-40gb");
        let (code, out) = smi(&h, "-L -i 0,4");
        assert_eq!(code, 0);
        let st = h.file.load().expect("state");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 6, "{out}");
        assert_eq!(
            lines[0],
            format!(
                "GPU 0: NVIDIA A100-SXM4-40GB (UUID: {})",
                st.profile.gpus[0].uuid
            )
        );
        let mig = &st.gpus[0].gpu_instances[0].compute_instances[0].uuid;
        assert_eq!(
            lines[1],
            format!("  MIG 3g.20gb     Device  0: (UUID: {mig})")
        );
        assert!(lines[3].starts_with("  MIG 1g.5gb      Device  2: (UUID: MIG-"));
        assert!(lines[5].starts_with("GPU 4: "));
    }

    #[test]
    fn a_lost_gpu_is_reported_until_reset() {
        let h = host("dgx-a100-40gb");
        h.file
            .update(|s| s.fall_off_bus(4).map(|_| ()))
            .expect("update")
            .expect("fall");
        let lost = "Unable to determine the device handle for GPU 0000:87:00.0: GPU is lost. \
                    Reboot the system to recover this GPU";
        let (code, out) = smi(&h, "-L -i 3,4");
        assert_eq!(code, EXIT_GPU_LOST, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("GPU 3: "), "{out}");
        assert_eq!(
            lines.len(),
            6,
            "GPU 3, its 4 MIG devices, the lost GPU 4: {out}"
        );
        assert_eq!(lines[5], lost);
        let (code, out) = smi(&h, "-q");
        assert_eq!(
            (code, out.as_str()),
            (EXIT_GPU_LOST, format!("{lost}\n").as_str())
        );
        let (code, out) = smi(&h, "-q -i 3");
        assert_eq!(code, EXIT_OK, "other GPUs answer: {out}");
        h.file
            .update(|s| s.inject_ecc(2, None).map(|_| ()))
            .expect("update")
            .expect("ecc");
        let (code, out) = smi(&h, "-r -i 4,2");
        assert_eq!(code, EXIT_OK, "{out}");
        assert_eq!(
            out,
            "GPU 00000000:87:00.0 was successfully reset.\n\
             GPU 00000000:47:00.0 was successfully reset.\nAll done.\n"
        );
        let st = h.file.load().expect("state");
        assert_eq!(st.gpus[4].health, crate::health::GpuHealth::default());
        assert_eq!(st.gpus[2].health, crate::health::GpuHealth::default());
        assert_eq!(smi(&h, "-L").0, EXIT_OK);
    }

    #[test]
    fn compute_mode_is_set_persisted_and_reported() {
        let h = host("dgx-h100");
        let uuid = h.file.load().expect("state").profile.gpus[1].uuid.clone();
        let (code, out) = smi(&h, &format!("-i {uuid} -c EXCLUSIVE_PROCESS"));
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "Set compute mode to EXCLUSIVE_PROCESS for GPU 00000000:0F:00.0.\nAll done.\n"
        );
        assert_eq!(
            h.file.load().expect("state").gpus[1].compute_mode,
            ComputeMode::ExclusiveProcess
        );
        let (code, out) = smi(&h, "--id=00000000:0F:00.0 --compute-mode=3");
        assert_eq!(code, 0);
        assert!(out.starts_with(
            "Compute mode is already set to EXCLUSIVE_PROCESS for GPU 00000000:0F:00.0."
        ));
        let (code, out) = smi(&h, "-i 1 -c 1");
        assert_eq!(code, EXIT_INVALID);
        assert!(out.contains("Exclusive_Thread was deprecated!"));
        let (code, out) = smi(&h, "-i 1 -c 7");
        assert_eq!(code, EXIT_INVALID);
        assert_eq!(out, "Invalid compute mode: 7\n");
        let (code, out) = smi(&h, "-i 9 -c 0");
        assert_eq!(
            (code, out.as_str()),
            (EXIT_NOT_FOUND, "No devices were found\n")
        );
    }

    #[test]
    fn compute_mode_on_a_mig_enabled_gpu_fails() {
        let h = host("dgx-a100-40gb");
        let (code, out) = smi(&h, "-i 0 -c DEFAULT");
        assert_eq!(code, EXIT_NOT_SUPPORTED);
        assert_eq!(
            out,
            "Setting compute mode to DEFAULT is not supported on a MIG-enabled device.\n"
        );
    }

    #[test]
    fn missing_state_is_a_driver_not_loaded_error() {
        let mut out = Vec::new();
        let err = SimError::NoState {
            searched: "x".into(),
        };
        let code = run(Err(err), &["-L".to_string()], &mut out);
        assert_eq!(code, EXIT_NO_DRIVER);
        assert!(String::from_utf8_lossy(&out).starts_with("NVIDIA-SMI has failed"));
    }

    #[test]
    fn query_summary_and_persistence() {
        let h = host("dgx-a100-40gb");
        let (code, out) = smi(&h, "-q -i 0");
        assert_eq!(code, 0);
        assert!(
            out.contains("    Product Name                          : NVIDIA A100-SXM4-40GB\n"),
            "{out}"
        );
        assert!(
            out.contains("        Current                           : Enabled\n"),
            "{out}"
        );
        assert!(
            out.contains("    Compute Mode                          : Default\n"),
            "{out}"
        );
        let (code, out) = smi(&h, "-i 00000000:07:00.0 -pm 0");
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "Persistence mode is already Disabled for GPU 00000000:07:00.0.\nAll done.\n"
        );
        let (_, out) = smi(&h, "-i 0 -pm 1");
        assert!(out.starts_with("Enabled persistence mode for GPU 00000000:07:00.0."));
        assert!(h.file.load().expect("state").gpus[0].persistence);
    }

    #[test]
    fn unknown_options_are_invalid() {
        let h = host("t4");
        let (code, out) = smi(&h, "--bogus");
        assert_eq!(code, EXIT_INVALID);
        assert!(out.starts_with("Invalid combination of input arguments"));
    }
}
