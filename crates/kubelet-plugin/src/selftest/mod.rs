//! `gpu-kubelet-plugin selftest`: the node path end to end on this host, without Kubernetes.
//!
//! It runs the production code, unchanged, where the kubelet and the container runtime would
//! call it: discovery through NVML (compared with what `nvidia-smi` reports), then for each claim
//! kind the host offers (a whole GPU; a MIG device where MIG is already on; MPS with a memory
//! limit and a thread percentage; time-slicing) a claim given in-process ([`MemoryClaims`]) is
//! prepared by the plugin's [`Driver`], a container is started from the CDI spec it wrote
//! ([`container`]), and what a workload sees is checked from inside: `nvidia-smi -L` lists
//! exactly the claim's device, and a CUDA program (`gpu-cuda-probe`: the driver API through
//! `libcuda.so.1`, a PTX kernel the driver compiles) starts, allocates, computes and verifies;
//! under MPS an allocation above the limit fails and the SM count reflects the percentage. Then
//! the claim is unprepared, and at the end the host must be as before: compute modes, no spec
//! left, no MPS daemon left.
//!
//! With `leave_settings` nothing changes a GPU setting: time-slicing (which sets the
//! time-slice) is skipped and said so, MPS runs without setting the compute mode (as NVIDIA's
//! MPS documentation allows; [`SharingOptions::leave_compute_mode`]), and MIG is used only as
//! it is (the self-test never changes MIG modes or instances in any case).
//!
//! Everything it writes lives under its work folder (checkpoint, sharing state, CDI specs, MPS
//! pipes, container bundles): the host's `/var/run/cdi` and kubelet folders are not touched.
//! The pure judgements are in [`observe`].

pub mod container;
pub mod observe;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpu_dra_core::cdi::Spec;
use gpu_dra_core::health::HealthPolicy;
use gpu_dra_device::{DeviceRef, Inventory};
use serde::Serialize;
use serde_json::json;

use self::container::{Finished, Runtime, edits_for};
use self::observe::{Listed, SmiGpu};
use crate::cdi_io::CdiHost;
use crate::claims::{MemoryClaims, allocated_claim};
use crate::driver::{ClaimRef, Driver, DriverParts, DriverSettings};
use crate::failpoint::Failpoints;
use crate::host::HostArgs;
use crate::inventory::LiveInventory;
use crate::metrics::Metrics;
use crate::sharing::{DriverRoot, FileStore, SharingManager, SharingOptions};

/// The claim kinds the self-test prepares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A whole GPU (MIG off).
    WholeGpu,
    /// A MIG device that exists already.
    Mig,
    /// A whole GPU shared through MPS, with a pinned memory limit and a thread percentage.
    Mps,
    /// A whole GPU time-sliced (sets the GPU's time-slice).
    TimeSlicing,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::WholeGpu => "whole-gpu",
            Kind::Mig => "mig",
            Kind::Mps => "mps",
            Kind::TimeSlicing => "time-slicing",
        }
    }
}

/// What the self-test is given.
#[derive(Debug, Clone)]
pub struct Options {
    /// The host (driver root, device root, sysfs, NVML library).
    pub host: HostArgs,
    /// Node (pool) name of the claims.
    pub node_name: String,
    /// Driver name of the claims.
    pub driver_name: String,
    /// Where everything is written (created; emptied first).
    pub work_dir: PathBuf,
    /// How containers run.
    pub runtime: Runtime,
    /// The CUDA probe's path inside the root file system.
    pub probe: String,
    /// The `nvidia-cdi-hook` the specs name (`None`: specs carry no hooks).
    pub hook: Option<PathBuf>,
    /// Change no GPU setting.
    pub leave_settings: bool,
    /// The kinds to try.
    pub kinds: Vec<Kind>,
    /// MPS claims' `defaultActiveThreadPercentage`.
    pub mps_percentage: u32,
    /// MPS claims' `defaultPinnedDeviceMemoryLimit`, in MiB.
    pub mps_memory_limit_mib: u64,
    /// Limit of one tool call (`nvidia-smi`).
    pub tool_timeout: Duration,
}

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It held.
    Pass,
    /// It did not.
    Fail,
    /// It was not run (the detail says why).
    Skip,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// `<kind>/<step>`, or `discovery`, `host/restored`.
    pub name: String,
    /// Outcome.
    pub status: Status,
    /// What was seen (on a failure: what was wrong).
    pub detail: String,
}

/// The self-test's report: one line per check.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The checks, in the order run.
    pub checks: Vec<Check>,
}

impl Report {
    fn add(&mut self, name: impl Into<String>, status: Status, detail: impl Into<String>) {
        let check = Check {
            name: name.into(),
            status,
            detail: detail.into(),
        };
        match status {
            Status::Fail => tracing::warn!(check = %check.name, detail = %check.detail, "failed"),
            _ => tracing::info!(check = %check.name, status = ?status, "check"),
        }
        self.checks.push(check);
    }

    fn judge(&mut self, name: impl Into<String>, result: Result<String, String>) -> bool {
        match result {
            Ok(detail) => {
                self.add(name, Status::Pass, detail);
                true
            }
            Err(detail) => {
                self.add(name, Status::Fail, detail);
                false
            }
        }
    }

    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    /// The report as text, one line per check, then a summary line.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let status = match c.status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::Skip => "SKIP",
            };
            out.push_str(&format!("{status}  {}: {}\n", c.name, c.detail));
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        out.push_str(&format!(
            "{} passed, {} failed, {} skipped\n",
            count(Status::Pass),
            count(Status::Fail),
            count(Status::Skip)
        ));
        out
    }

    /// The report as JSON: `{"checks": [...], "passed": n, "failed": n, "skipped": n}`.
    pub fn json(&self) -> serde_json::Value {
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        json!({
            "checks": self.checks,
            "passed": count(Status::Pass),
            "failed": count(Status::Fail),
            "skipped": count(Status::Skip),
        })
    }
}

/// The claim a kind prepares: a device of the inventory and the opaque config.
struct Case {
    kind: Kind,
    device: String,
    uuid: String,
    config: Option<serde_json::Value>,
}

/// Picks the device of each kind, or says why there is none.
fn plan_cases(inventory: &Inventory, opts: &Options) -> Vec<Result<Case, (Kind, String)>> {
    let whole = inventory
        .devices()
        .find(|d| matches!(d, DeviceRef::Gpu(_)))
        .map(|d| (d.name(), d.uuid().to_string()));
    let mig = inventory
        .devices()
        .find(|d| matches!(d, DeviceRef::Mig { .. }))
        .map(|d| (d.name(), d.uuid().to_string()));
    let no_whole = "every GPU has MIG on: no whole GPU to claim".to_string();
    let mut kinds = opts.kinds.clone();
    kinds.sort();
    kinds.dedup();
    kinds
        .into_iter()
        .map(|kind| {
            let (found, config) = match kind {
                Kind::WholeGpu => (whole.clone().ok_or(no_whole.clone()), None),
                Kind::Mig => (
                    mig.clone().ok_or_else(|| {
                        "no MIG device: MIG is off on every GPU or has no instances (the self-test never changes MIG settings)".to_string()
                    }),
                    None,
                ),
                Kind::Mps => (
                    whole.clone().ok_or(no_whole.clone()),
                    Some(json!({
                        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "MPS", "mpsConfig": {
                            "defaultActiveThreadPercentage": opts.mps_percentage,
                            "defaultPinnedDeviceMemoryLimit": format!("{}Mi", opts.mps_memory_limit_mib),
                        }},
                    })),
                ),
                Kind::TimeSlicing if opts.leave_settings => (
                    Err("it sets the GPU's time-slice (--leave-settings)".to_string()),
                    None,
                ),
                Kind::TimeSlicing => (
                    whole.clone().ok_or(no_whole.clone()),
                    Some(json!({
                        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
                    })),
                ),
            };
            found
                .map(|(device, uuid)| Case {
                    kind,
                    device,
                    uuid,
                    config,
                })
                .map_err(|why| (kind, why))
        })
        .collect()
}

/// What the driver root's `nvidia-smi` reports of the GPUs: its XML report (`-q -x`), or where
/// the tool has none (the simulator's stand-in), `--query-gpu` of the same facts. `Ok(None)`
/// when the driver root has no `nvidia-smi`.
async fn smi_gpus(root: &DriverRoot, timeout: Duration) -> Result<Option<Vec<SmiGpu>>, String> {
    if root.find_tool("nvidia-smi").is_err() {
        return Ok(None);
    }
    let xml = root
        .run("nvidia-smi", &["-q", "-x"], &[], None, timeout)
        .await
        .map_err(|e| e.to_string())?;
    if xml.success() && xml.stdout.contains("<nvidia_smi_log>") {
        return observe::parse_q_xml(&xml.stdout).map(Some);
    }
    let query = format!("--query-gpu={}", observe::QUERY_FIELDS);
    let out = root
        .run(
            "nvidia-smi",
            &[&query, "--format=csv,noheader"],
            &[],
            None,
            timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
    if !out.success() {
        return Err(format!("{}: {}", out.status(), out.combined().trim()));
    }
    observe::parse_query(&out.stdout).map(Some)
}

/// NVML's view against `nvidia-smi`'s: the same GPUs, names, driver version and MIG modes.
fn compare_with_smi(inventory: &Inventory, smi: &[SmiGpu]) -> Result<String, String> {
    let mut problems = Vec::new();
    if smi.len() != inventory.gpus.len() {
        problems.push(format!(
            "NVML found {} GPUs, nvidia-smi lists {}",
            inventory.gpus.len(),
            smi.len()
        ));
    }
    for gpu in &inventory.gpus {
        let Some(s) = smi.iter().find(|s| s.uuid == gpu.uuid) else {
            problems.push(format!("{} is not listed by nvidia-smi", gpu.uuid));
            continue;
        };
        if s.name != gpu.product_name {
            problems.push(format!(
                "{}: NVML names it {:?}, nvidia-smi {:?}",
                gpu.uuid, gpu.product_name, s.name
            ));
        }
        if s.driver_version != inventory.driver_version {
            problems.push(format!(
                "{}: driver {} in nvidia-smi, {} through NVML",
                gpu.uuid, s.driver_version, inventory.driver_version
            ));
        }
        let mig_on = gpu.mig.as_ref().is_some_and(|m| m.current);
        if mig_on != (s.mig_mode == "Enabled") {
            problems.push(format!(
                "{}: MIG {} through NVML, {:?} in nvidia-smi",
                gpu.uuid,
                if mig_on { "on" } else { "off" },
                s.mig_mode
            ));
        }
    }
    if problems.is_empty() {
        Ok(format!(
            "nvidia-smi lists the same {} GPUs, names, driver and MIG modes",
            smi.len()
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// A fresh claim UID (the kernel's random UUID).
fn new_uid(n: usize) -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/uuid")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| {
            format!(
                "00000000-0000-4000-8000-{:012x}",
                std::process::id() as usize * 16 + n
            )
        })
}

/// The parts of the plugin the self-test drives.
struct Plugin {
    driver: Driver,
    claims: Arc<MemoryClaims>,
    cdi: Arc<CdiHost>,
    sharing: SharingManager,
}

fn build_plugin(opts: &Options, live: &Arc<LiveInventory>) -> anyhow::Result<Plugin> {
    let plugin_dir = opts.work_dir.join("plugin");
    let cdi_root = opts.work_dir.join("cdi");
    for dir in [&plugin_dir, &cdi_root] {
        std::fs::create_dir_all(dir)?;
    }
    let inventory = live.current();
    let cdi = Arc::new(CdiHost::discover(
        cdi_root,
        &opts.host.driver_roots(),
        &opts.host.dev_root,
        &inventory.driver_version,
        opts.hook.as_deref(),
    ));
    let mut sharing_options = SharingOptions::new(
        DriverRoot::new(opts.host.driver_root_here(), opts.host.nvml_lib.clone()),
        &plugin_dir,
    );
    sharing_options.leave_compute_mode = opts.leave_settings;
    let metrics = Arc::new(Metrics::served_at(None));
    let sharing = SharingManager::new(
        sharing_options,
        Arc::new(FileStore::new(crate::node_layout::sharing_state_in(
            &plugin_dir,
        ))),
        metrics.sharing.clone(),
    )?;
    let claims = Arc::new(MemoryClaims::default());
    let driver = Driver::new(DriverParts {
        settings: DriverSettings {
            driver_name: opts.driver_name.clone(),
            node_name: opts.node_name.clone(),
            checkpoint_path: crate::node_layout::checkpoint_in(&plugin_dir),
            boot_id: None,
            device_metadata: crate::device_metadata::DeviceMetadataSettings {
                dir: crate::node_layout::device_metadata_dir_in(&plugin_dir),
                enabled: false,
                list_forms: false,
            },
        },
        inventory: live.clone(),
        claims: claims.clone(),
        sharing: Arc::new(sharing.clone()),
        decoder: Arc::new(gpu_dra_core::plan::ApiDecoder),
        cdi: cdi.clone(),
        failpoints: Failpoints::parse("", None).map_err(anyhow::Error::msg)?,
        metrics,
        mig: Arc::new(crate::mig::NoMig(
            "the self-test creates no MIG instances".into(),
        )),
        claim_status: None,
        node_events: None,
    })?;
    Ok(Plugin {
        driver,
        claims,
        cdi,
        sharing,
    })
}

/// Runs the self-test.
pub async fn run(opts: &Options) -> Report {
    let mut report = Report::default();
    let _ = std::fs::remove_dir_all(&opts.work_dir);
    if let Err(e) = std::fs::create_dir_all(&opts.work_dir) {
        report.add(
            "setup",
            Status::Fail,
            format!("{}: {e}", opts.work_dir.display()),
        );
        return report;
    }
    // Discovery, as `run` does it.
    let live = match opts.host.nvml_inventory().and_then(|(lib, backend)| {
        let live =
            LiveInventory::discover(Arc::new(backend), HealthPolicy::new(&opts.driver_name))?;
        Ok((lib, live))
    }) {
        Ok((lib, live)) => {
            let inv = live.current();
            let names: Vec<String> = inv
                .gpus
                .iter()
                .map(|g| format!("{} {}", g.product_name, g.uuid))
                .collect();
            report.add(
                "discovery",
                Status::Pass,
                format!(
                    "{} GPUs through {} (driver {}, CUDA {}): {}",
                    inv.gpus.len(),
                    lib.display(),
                    inv.driver_version,
                    inv.cuda_driver_version,
                    names.join(", ")
                ),
            );
            live
        }
        Err(e) => {
            report.add("discovery", Status::Fail, format!("{e:#}"));
            return report;
        }
    };
    let inventory = live.current();
    // What the scheduler would allocate from: the devices as published.
    live.mark_published(&inventory);
    let root = DriverRoot::new(opts.host.driver_root_here(), opts.host.nvml_lib.clone());
    let smi_before = smi_gpus(&root, opts.tool_timeout).await;
    match &smi_before {
        Ok(Some(gpus)) => {
            report.judge("discovery/nvidia-smi", compare_with_smi(&inventory, gpus));
        }
        Ok(None) => report.add(
            "discovery/nvidia-smi",
            Status::Skip,
            "no nvidia-smi under the driver root",
        ),
        Err(e) => report.add("discovery/nvidia-smi", Status::Fail, e.clone()),
    }
    let plugin = match build_plugin(opts, &live) {
        Ok(p) => p,
        Err(e) => {
            report.add("setup", Status::Fail, format!("{e:#}"));
            return report;
        }
    };
    let mut whole_sm: Option<u32> = None;
    for (n, case) in plan_cases(&inventory, opts).into_iter().enumerate() {
        match case {
            Err((kind, why)) => report.add(kind.name(), Status::Skip, why),
            Ok(case) => run_case(opts, &plugin, &case, n, &mut whole_sm, &mut report).await,
        }
    }
    // The host as before.
    let mut problems = Vec::new();
    if let Ok(Some(before)) = &smi_before {
        match smi_gpus(&root, opts.tool_timeout).await {
            Ok(Some(after)) => {
                for (b, a) in before.iter().zip(&after) {
                    if b.compute_mode != a.compute_mode {
                        problems.push(format!(
                            "{} compute mode {} (was {})",
                            a.uuid, a.compute_mode, b.compute_mode
                        ));
                    }
                }
            }
            Ok(None) => problems.push("nvidia-smi is gone".into()),
            Err(e) => problems.push(format!("nvidia-smi: {e}")),
        }
    }
    let specs = plugin.cdi.list();
    if !specs.is_empty() {
        problems.push(format!("CDI specs left: {}", specs.join(", ")));
    }
    let state = plugin.sharing.state();
    if !state.mps.is_empty() {
        problems.push(format!("{} MPS daemons recorded", state.mps.len()));
    }
    let left: Vec<String> = crate::sharing::mps::find_daemons_under(&opts.work_dir)
        .iter()
        .map(ToString::to_string)
        .collect();
    if !left.is_empty() {
        problems.push(format!(
            "MPS control daemons still running: pids {}",
            left.join(", ")
        ));
    }
    report.judge(
        "host/restored",
        if problems.is_empty() {
            Ok("compute modes as before, no CDI spec and no MPS daemon left".into())
        } else {
            Err(problems.join("; "))
        },
    );
    report
}

/// Prepares the claim of `case`, checks its containers, unprepares it.
async fn run_case(
    opts: &Options,
    plugin: &Plugin,
    case: &Case,
    n: usize,
    whole_sm: &mut Option<u32>,
    report: &mut Report,
) {
    let kind = case.kind.name();
    let uid = new_uid(n);
    let name = format!("selftest-{kind}");
    let configs: Vec<(&str, &[&str], serde_json::Value)> = case
        .config
        .iter()
        .map(|c| ("FromClaim", &["gpu"][..], c.clone()))
        .collect();
    plugin.claims.insert(allocated_claim(
        "gpu-dra-selftest",
        &name,
        &uid,
        &opts.driver_name,
        &opts.node_name,
        &[("gpu", &case.device)],
        &configs,
    ));
    let claim = ClaimRef {
        namespace: "gpu-dra-selftest".into(),
        name,
        uid: uid.clone(),
    };
    let prepared = plugin.driver.prepare(&claim).await;
    if let Err(crate::driver::DriverError::Sharing(
        e @ crate::sharing::SharingError::TimeSliceNotSupported { .. },
    )) = &prepared
    {
        // Pre-Volta GPUs have no time-slice setting: the plugin refuses such claims with its
        // advice, which is all there is to check on them.
        report.add(
            format!("{kind}/prepare"),
            Status::Skip,
            format!("refused as on any such GPU: {e}"),
        );
    }
    let unsupported = matches!(
        &prepared,
        Err(crate::driver::DriverError::Sharing(
            crate::sharing::SharingError::TimeSliceNotSupported { .. }
        ))
    );
    let ok = !unsupported
        && report.judge(
            format!("{kind}/prepare"),
            match &prepared {
                Ok(devices) => Ok(format!(
                    "{} ({}) -> {}",
                    case.device,
                    case.uuid,
                    devices
                        .iter()
                        .flat_map(|d| d.cdi_device_ids.iter().cloned())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                Err(e) => Err(e.to_string()),
            },
        );
    if let (true, Ok(devices)) = (ok, &prepared) {
        let ids: Vec<String> = devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.iter().cloned())
            .collect();
        check_containers(opts, plugin, case, &uid, &ids, n, whole_sm, report).await;
    }
    let unprepared = plugin.driver.unprepare(&claim).await;
    let spec_left = plugin.cdi.spec_path(&uid).exists();
    report.judge(
        format!("{kind}/unprepare"),
        match unprepared {
            Err(e) => Err(e.to_string()),
            Ok(()) if spec_left => Err(format!(
                "the spec {} is still there",
                plugin.cdi.spec_path(&uid).display()
            )),
            Ok(()) => Ok("claim unprepared, spec removed".into()),
        },
    );
    plugin.claims.remove("gpu-dra-selftest", &claim.name);
}

/// A container's failure as a report detail.
fn container_failure(what: &str, f: &Finished) -> String {
    if f.timed_out {
        return format!("{what} did not end: {}", f.stderr_tail());
    }
    let code = f
        .code
        .map_or("a signal".to_string(), |c| format!("exit {c}"));
    let tail = f.stderr_tail();
    let out = f.stdout.trim();
    let mut detail = format!("{what} ended with {code}");
    if !tail.is_empty() {
        detail.push_str(&format!(": {tail}"));
    }
    if !out.is_empty() && tail.is_empty() {
        detail.push_str(&format!(": {}", out.lines().last().unwrap_or_default()));
    }
    detail
}

#[allow(clippy::too_many_arguments)]
async fn check_containers(
    opts: &Options,
    plugin: &Plugin,
    case: &Case,
    uid: &str,
    ids: &[String],
    n: usize,
    whole_sm: &mut Option<u32>,
    report: &mut Report,
) {
    let kind = case.kind.name();
    let spec_path = plugin.cdi.spec_path(uid);
    let spec: Result<Spec, String> = std::fs::read(&spec_path)
        .map_err(|e| format!("{}: {e}", spec_path.display()))
        .and_then(|b| {
            serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", spec_path.display()))
        });
    let edits = match spec.and_then(|s| edits_for(&s, ids).map_err(|e| e.to_string())) {
        Ok(e) => e,
        Err(e) => {
            report.add(format!("{kind}/spec"), Status::Fail, e);
            return;
        }
    };
    let bundles = opts.work_dir.join("bundles");
    let id = |step: &str| format!("gpu-dra-selftest-{}-{n}-{step}", std::process::id());
    // `nvidia-smi -L` from the spec's own mount of the tool.
    match edits
        .mounts
        .iter()
        .find(|m| m.container_path.ends_with("/nvidia-smi"))
    {
        None => report.add(
            format!("{kind}/nvidia-smi"),
            Status::Fail,
            "the spec mounts no nvidia-smi",
        ),
        Some(m) => {
            let args = vec![m.container_path.clone(), "-L".to_string()];
            let result = opts
                .runtime
                .run(&id("smi"), &bundles.join(id("smi")), &edits, &args)
                .await;
            report.judge(
                format!("{kind}/nvidia-smi"),
                match result {
                    Err(e) => Err(e.to_string()),
                    Ok(f) if f.code != Some(0) => Err(container_failure("nvidia-smi -L", &f)),
                    Ok(f) => {
                        let listed = observe::parse_list(&f.stdout);
                        observe::lists_exactly(&listed, &case.uuid).map(|()| {
                            let shown: Vec<&str> = listed
                                .iter()
                                .map(|l| match l {
                                    Listed::Gpu { uuid } | Listed::Mig { uuid } => uuid.as_str(),
                                })
                                .collect();
                            format!("lists {}", shown.join(" > "))
                        })
                    }
                },
            );
        }
    }
    // The CUDA probe; under MPS with an allocation past the limit.
    let limit = opts.mps_memory_limit_mib << 20;
    let over = limit + (512 << 20);
    let mut args = vec![opts.probe.clone(), "--elements".into(), "65536".into()];
    if case.kind == Kind::Mps {
        args.extend(["--alloc-bytes".into(), over.to_string()]);
    }
    let result = opts
        .runtime
        .run(&id("cuda"), &bundles.join(id("cuda")), &edits, &args)
        .await;
    let probe = match result {
        Err(e) => Err(e.to_string()),
        Ok(f) => match observe::parse_probe(&f.stdout) {
            Ok(r) => Ok(r),
            Err(e) if f.code == Some(0) => Err(e),
            Err(_) => Err(container_failure("the CUDA probe", &f)),
        },
    };
    let probe = match probe {
        Ok(r) => r,
        Err(e) => {
            report.add(format!("{kind}/cuda"), Status::Fail, e);
            return;
        }
    };
    let seen = observe::probe_saw_exactly(&probe, &case.uuid);
    let sm = probe.devices.first().map(|d| d.sm_count);
    report.judge(
        format!("{kind}/cuda"),
        seen.map(|()| {
            let d = &probe.devices[0];
            format!(
                "{} ({} SMs, {} MiB): kernel verified over {} elements",
                d.name,
                d.sm_count,
                d.total_memory >> 20,
                probe.kernel.as_ref().map_or(0, |k| k.elements)
            )
        }),
    );
    if case.kind == Kind::WholeGpu {
        *whole_sm = sm;
    }
    if case.kind != Kind::Mps {
        return;
    }
    report.judge(
        "mps/memory-limit",
        match &probe.alloc {
            Some(a) if !a.ok && a.error.as_deref() == Some("CUDA_ERROR_OUT_OF_MEMORY") => {
                Ok(format!(
                    "{} MiB refused (out of memory) under a {} MiB limit",
                    a.bytes >> 20,
                    opts.mps_memory_limit_mib
                ))
            }
            Some(a) if a.ok => Err(format!(
                "{} MiB allocated under a {} MiB limit",
                a.bytes >> 20,
                opts.mps_memory_limit_mib
            )),
            Some(a) => Err(format!(
                "{} MiB failed with {:?}, not CUDA_ERROR_OUT_OF_MEMORY",
                a.bytes >> 20,
                a.error
            )),
            None => Err("the probe made no allocation past the limit".into()),
        },
    );
    match (*whole_sm, sm) {
        (Some(full), Some(got)) => {
            let (low, high) = observe::mps_sm_range(full, opts.mps_percentage);
            report.judge(
                "mps/thread-percentage",
                if (low..=high).contains(&got) {
                    Ok(format!("{got} of {full} SMs at {}%", opts.mps_percentage))
                } else {
                    Err(format!(
                        "{got} SMs at {}% of {full}, expected {low}-{high}",
                        opts.mps_percentage
                    ))
                },
            );
        }
        _ => report.add(
            "mps/thread-percentage",
            Status::Skip,
            "no whole-GPU SM count to compare with (whole-gpu did not run)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_text_and_json_count_each_status() {
        let mut r = Report::default();
        r.add("discovery", Status::Pass, "8 GPUs");
        r.add(
            "time-slicing",
            Status::Skip,
            "it sets the GPU's time-slice (--leave-settings)",
        );
        r.judge(
            "whole-gpu/cuda",
            Err("CUDA enumerated [], expected only GPU-a".into()),
        );
        assert!(r.failed());
        let text = r.text();
        assert!(
            text.contains("FAIL  whole-gpu/cuda: CUDA enumerated"),
            "{text}"
        );
        assert!(text.ends_with("1 passed, 1 failed, 1 skipped\n"), "{text}");
        let j = r.json();
        assert_eq!(
            (j["passed"].as_u64(), j["failed"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(j["checks"][1]["status"], "skip");
    }
}
