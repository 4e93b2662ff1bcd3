//! `cuda-app`: the stand-in for a CUDA program, for checks inside containers; and the
//! simulator's model of what CUDA sees, which the simulated CUDA driver library
//! (`gpu-dra-sim-cuda`, installed as `libcuda.so.1`) shares: the devices of a process
//! ([`devices`]), joining MPS ([`attach`]) and the terms an MPS server gives ([`mps_terms`]).
//!
//! It does what matters to the driver of a CUDA program's start: it sees the GPUs whose
//! device nodes its `/dev` has (as the real driver does, through [`StateFile::load_visible`](crate::state::StateFile::load_visible)),
//! and it joins MPS the way the CUDA runtime does, only through the pipe directory
//! (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`): it connects to the control
//! daemon's `control` socket and sends [`mps::CLIENT_HELLO`] with its PID and user; the
//! daemon starts a server if none runs and answers with the server's settings, which it
//! prints. Nothing else is shared with the daemon: no `/dev/shm`, no IPC or PID namespace
//! (measured on an H100 with driver 580: a client needs only the pipe directory).
//!
//! Without a reachable daemon the CUDA runtime runs without MPS; on a GPU in
//! `EXCLUSIVE_PROCESS` compute mode (what an MPS claim's GPU is set to, owned by its MPS
//! server) it then fails with `cudaErrorDevicesUnavailable`, which is what this prints
//! (exit 1). On a GPU in `DEFAULT` mode it runs without MPS and says so.
//!
//! `--seconds <n>` (formerly `--hold-seconds`) keeps the program running that long after it
//! has printed (a program still computing; an MPS client stays attached).
//!
//! A load ([`Load`]: `--hold-memory <amount>`, `--sm-load <percent>`) makes it use its device
//! as a computing program does: it runs on the first device it sees (the first MIG device of
//! a GPU in MIG mode; its MPS server's device as an MPS client), holds that much device memory
//! and keeps that share of the SMs busy, registered with the node so that NVML reports it
//! ([`crate::processes`]), until it ends (after `--seconds`, or when killed if none is given).
//! Within its limits, as CUDA enforces them: memory beyond the device's, or beyond an MPS
//! client's pinned memory limit, fails with `cudaErrorMemoryAllocation` (exit 1); an MPS
//! client's SM load is capped at its active thread percentage. Then it prints
//! `running on <uuid>: holding <bytes> bytes, SM load <p>%`.
//!
//! Output, one fact per line: `GPU <i>: <uuid> (compute mode <mode>)` for each visible GPU,
//! then either the daemon's reply (`MPS server <pid>`, `active thread percentage <p>`,
//! `device <n> <uuid> pinned memory limit <limit|none>`: what this client got, its own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` applied over the
//! server's values, which they can only lower) or `MPS: not in use`.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use crate::mps;
use crate::state::{ComputeMode, State};

/// What CUDA prints for `cudaErrorDevicesUnavailable`.
pub const DEVICES_UNAVAILABLE: &str =
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable (cudaErrorDevicesUnavailable)";

/// The MPS client variables a CUDA program reads (from its environment, by the binary).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientEnv {
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: Option<PathBuf>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`: this client's share of the threads (can only
    /// lower the server's).
    pub active_thread_percentage: Option<String>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`<dev>=<limit>[,...]`): this client's pinned
    /// memory limits (can only lower the server's).
    pub pinned_mem_limit: Option<String>,
    /// `CUDA_VISIBLE_DEVICES`: the devices CUDA may use, by GPU index or GPU or MIG UUID,
    /// comma-separated (unset: all it sees).
    pub visible_devices: Option<String>,
}

impl ClientEnv {
    /// Reads the variables from the process environment (empty values count as unset).
    pub fn from_process() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            pipe_dir: var("CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from),
            active_thread_percentage: var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            pinned_mem_limit: var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            visible_devices: var("CUDA_VISIBLE_DEVICES"),
        }
    }
}

/// What CUDA prints when an allocation does not fit.
pub const OUT_OF_MEMORY: &str = "CUDA error: out of memory (cudaErrorMemoryAllocation)";

/// The use a program makes of its device (`--hold-memory`, `--sm-load`); the default is none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Load {
    /// Device memory to hold, in bytes.
    pub memory_bytes: u64,
    /// Percentage of the device's SMs to keep busy (0 to 100).
    pub sm_percent: u32,
    /// Where to register ([`crate::processes::register`]): the state folder as this process
    /// sees it, and the process's `/dev/shm`.
    pub state_dir: PathBuf,
    /// The folder record files go to (`/dev/shm`).
    pub shm_dir: PathBuf,
}

impl Load {
    fn is_some(&self) -> bool {
        self.memory_bytes > 0 || self.sm_percent > 0
    }
}

const MIB: u64 = 1024 * 1024;

/// A device as CUDA enumerates it for a process: a whole GPU, or a MIG device of a GPU in
/// MIG mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// `GPU-...` or `MIG-...`.
    pub uuid: String,
    /// The name CUDA reports (`NVIDIA H100 80GB HBM3`; a MIG device's is
    /// `<GPU name> MIG <profile>`).
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Index of the GPU (or the MIG device's parent) in the state.
    pub gpu: usize,
    /// A MIG device.
    pub mig: bool,
}

/// The devices a program sees in `state` (a process's visible state, see
/// [`StateFile::load_visible`](crate::state::StateFile::load_visible)), in CUDA's order: each
/// GPU not in MIG mode, and the MIG devices of each GPU in MIG mode, among those
/// `CUDA_VISIBLE_DEVICES` names (`visible`: GPU indices, GPU UUIDs or MIG UUIDs; naming a GPU
/// names its MIG devices).
pub fn devices(state: &State, visible: Option<&str>) -> Vec<Device> {
    let allowed = |index: usize, uuid: &str| {
        visible.is_none_or(|list| {
            list.split(',')
                .map(str::trim)
                .any(|v| v == uuid || v.parse::<usize>().ok() == Some(index))
        })
    };
    let mut out = Vec::new();
    for (i, spec) in state.profile.gpus.iter().enumerate() {
        if state.gpus[i].mig_current {
            for m in state.mig_devices(i) {
                if allowed(usize::MAX, &m.ci.uuid) || allowed(i, &spec.uuid) {
                    out.push(Device {
                        uuid: m.ci.uuid.clone(),
                        name: format!("{} MIG {}", spec.name, m.name()),
                        memory_bytes: m.profile.memory_mib * MIB,
                        multiprocessors: m.multiprocessors(),
                        gpu: i,
                        mig: true,
                    });
                }
            }
        } else if allowed(i, &spec.uuid) {
            out.push(Device {
                uuid: spec.uuid.clone(),
                name: spec.name.clone(),
                memory_bytes: spec.memory_mib * MIB,
                multiprocessors: spec.multiprocessors(),
                gpu: i,
                mig: false,
            });
        }
    }
    out
}

/// The device a program runs on without MPS: the first of [`devices`]; its UUID and memory
/// in bytes.
fn first_device(state: &State, visible: Option<&str>) -> Option<(String, u64)> {
    devices(state, visible)
        .into_iter()
        .next()
        .map(|d| (d.uuid, d.memory_bytes))
}

/// The device of an MPS client from its server's reply (`device 0 <uuid> pinned memory limit
/// <limit>`) and that limit in bytes; the active thread percentage.
pub fn mps_terms(reply: &str) -> (Option<(String, Option<u64>)>, Option<f64>) {
    let mut device = None;
    let mut pct = None;
    for line in reply.lines() {
        if let Some(p) = line.strip_prefix("active thread percentage ") {
            pct = p.trim().parse::<f64>().ok();
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if device.is_none()
            && let ["device", _, uuid, "pinned", "memory", "limit", limit] = words.as_slice()
        {
            let limit = super::mps::limit_mib(limit).map(|mib| mib * MIB);
            device = Some(((*uuid).to_string(), limit));
        }
    }
    (device, pct)
}

/// Starts using the device with `load` (see the module documentation); the registration lasts
/// as long as the returned value. `Err` is the line CUDA would print.
fn start_load(
    state: &State,
    env: &ClientEnv,
    load: &Load,
    mps_reply: Option<&str>,
) -> Result<(crate::processes::Registration, String), String> {
    let (mut uuid, mut room) =
        first_device(state, env.visible_devices.as_deref()).ok_or_else(|| {
            "CUDA error: no CUDA-capable device is detected (cudaErrorNoDevice)".to_string()
        })?;
    let mut sm = load.sm_percent.min(100);
    if let Some(reply) = mps_reply {
        let (device, pct) = mps_terms(reply);
        if let Some((dev, limit)) = device {
            if let Some(i) = state.gpu_by_uuid(&dev) {
                room = state.profile.gpus[i].memory_mib * MIB;
            }
            if state.gpu_by_uuid(&dev).is_some() || state.mig_by_uuid(&dev).is_some() {
                uuid = dev;
            }
            if let Some(limit) = limit {
                room = room.min(limit);
            }
        }
        if let Some(pct) = pct {
            sm = sm.min(pct.ceil() as u32);
        }
    }
    if load.memory_bytes > room {
        return Err(OUT_OF_MEMORY.to_string());
    }
    let record = crate::processes::ProcessRecord {
        state_dir: load.state_dir.clone(),
        uuid: uuid.clone(),
        used_bytes: load.memory_bytes,
        sm_percent: sm,
        mps: mps_reply.is_some(),
    };
    let reg = crate::processes::register(&record, &load.shm_dir)
        .map_err(|e| format!("CUDA error: cannot create a context ({e})"))?;
    Ok((
        reg,
        format!(
            "running on {uuid}: holding {} bytes, SM load {sm}%\n",
            load.memory_bytes
        ),
    ))
}

/// Runs the program: `state` is the simulator state as this process sees it (`None`: no
/// simulated host, no GPUs), `env` its MPS client variables. With `hold`, it keeps running
/// that long after printing, as a program still computing does (`cuda-app --seconds <n>`);
/// with a `load` and no `hold`, until it is killed.
pub fn run(
    state: Option<&State>,
    env: &ClientEnv,
    load: &Load,
    hold: Option<std::time::Duration>,
    out: &mut dyn Write,
) -> i32 {
    let gpus: Vec<(String, ComputeMode)> = state
        .map(|s| {
            s.profile
                .gpus
                .iter()
                .zip(&s.gpus)
                .map(|(spec, st)| (spec.uuid.clone(), st.compute_mode))
                .collect()
        })
        .unwrap_or_default();
    if gpus.is_empty() {
        let _ = writeln!(
            out,
            "CUDA error: no CUDA-capable device is detected (cudaErrorNoDevice)"
        );
        return 1;
    }
    for (i, (uuid, mode)) in gpus.iter().enumerate() {
        let _ = writeln!(out, "GPU {i}: {uuid} (compute mode {})", mode.smi_name());
    }
    let attached = attach(env);
    let conn = match attached {
        Some((reply, conn)) => {
            let _ = out.write_all(reply.as_bytes());
            Some((reply, conn))
        }
        None if gpus
            .iter()
            .any(|(_, m)| *m == ComputeMode::ExclusiveProcess) =>
        {
            let _ = writeln!(out, "{DEVICES_UNAVAILABLE}");
            return 1;
        }
        None => {
            let _ = writeln!(out, "MPS: not in use");
            None
        }
    };
    let registration = match state.filter(|_| load.is_some()) {
        Some(state) => match start_load(state, env, load, conn.as_ref().map(|(r, _)| r.as_str())) {
            Ok((reg, line)) => {
                let _ = out.write_all(line.as_bytes());
                Some(reg)
            }
            Err(line) => {
                let _ = writeln!(out, "{line}");
                return 1;
            }
        },
        None => None,
    };
    let _ = out.flush();
    match (hold, &registration) {
        (Some(hold), _) => std::thread::sleep(hold),
        // A program under load computes until it is stopped.
        (None, Some(_)) => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        (None, None) => {}
    }
    drop(registration);
    drop(conn);
    0
}

/// What a CUDA program's first call does about MPS, for programs other than `cuda-app`'s own
/// report (the nbody sample, [`crate::nbody`]): the MPS connection when a daemon answers
/// (keep it while computing), none on GPUs in `DEFAULT` mode, and `Err` with CUDA's line
/// ([`DEVICES_UNAVAILABLE`]) when a GPU is in `EXCLUSIVE_PROCESS` mode and no daemon
/// answers.
pub fn join_mps(state: &State, env: &ClientEnv) -> Result<Option<UnixStream>, String> {
    if let Some((_, conn)) = attach(env) {
        return Ok(Some(conn));
    }
    if state
        .gpus
        .iter()
        .any(|g| g.compute_mode == ComputeMode::ExclusiveProcess)
    {
        return Err(DEVICES_UNAVAILABLE.to_string());
    }
    Ok(None)
}

/// Joins the daemon's server through `<pipe dir>/control`, sending the client's own limits;
/// `None` when no daemon answers.
/// The connection is returned with the reply: the client stays attached while it is open.
pub fn attach(env: &ClientEnv) -> Option<(String, UnixStream)> {
    let pipe_dir = env
        .pipe_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(mps::DEFAULT_PIPE_DIR));
    let mut conn = UnixStream::connect(pipe_dir.join("control")).ok()?;
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    let mut hello = format!("{} {} {uid}", mps::CLIENT_HELLO, std::process::id());
    // Values with blanks cannot be sent as words; MPS would refuse them too.
    for (key, value) in [
        ("pct", &env.active_thread_percentage),
        ("pinned", &env.pinned_mem_limit),
    ] {
        if let Some(v) = value {
            hello.push_str(&format!(" {key}={}", v.replace(char::is_whitespace, "")));
        }
    }
    hello.push('\n');
    conn.write_all(hello.as_bytes()).ok()?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    conn.read_exact(&mut body).ok()?;
    Some((String::from_utf8(body).ok()?, conn))
}
