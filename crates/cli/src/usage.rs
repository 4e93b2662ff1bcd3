//! `gpu-dra usage`: the admin's view of who holds what, per node and GPU: which claim holds a
//! whole GPU, which MIG partition (static or created on demand), which memory share.
//!
//! Built from what the API server already knows, so it needs no access to the nodes: our
//! ResourceSlices (devices, their parent GPU, memory) and every allocated ResourceClaim
//! (`status.allocation.devices.results`: device, pool, `consumedCapacity`, `shareID`; and the
//! node plugin's `status.devices` entries, which name the device's UUID: the only place a
//! dynamic MIG device's UUID is published). [`usage`] is pure over those objects; [`run`]
//! fetches them.
//!
//! What each claim uses comes from the node plugins' metrics (`gpu_dra_claim_*`, see the
//! plugin's `usage` module): by default read from every plugin pod through the API server's
//! pod proxy (`pods/proxy`; the port and path from the pod's `HTTP_ADDRESS` and
//! `METRICS_PATH`), or from `--metrics-url` endpoints (plugins run outside pods, a
//! port-forward). [`with_metrics`] joins them to the holders by pool, device and claim, and
//! marks a claim idle when its last activity is older than `--idle-threshold`; [`summary`]
//! adds up the cluster. No component of its own: a status written by the plugins would cost
//! an API write per claim per interval for what the metrics already say.

use std::collections::BTreeMap;
use std::io::Write;

use clap::Args;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use serde::Serialize;

use crate::{CliError, Outcome};

/// Output of `gpu-dra usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageFormat {
    /// For people: one line per GPU and holder (node, GPU UUID, device, claim, what it holds, UUID,
    /// and from the metrics memory allocated and used, SM, processes, idle time, a note when
    /// near its memory limit), then the cluster summary.
    Text,
    /// The same per GPU and the summary as one JSON object, for tools.
    Json,
}

/// Where the node plugins' metrics are read (`gpu-dra usage`, `gpu-dra advise`).
#[derive(Debug, Clone, Args)]
pub struct MetricsSource {
    /// Read the plugins' metrics from these URLs (`http://host:port/metrics`, comma-separated
    /// or repeated) instead of through the API server's pod proxy.
    #[arg(long, env = "USAGE_METRICS_URLS", value_delimiter = ',')]
    pub metrics_url: Vec<String>,
    /// Label selector of the node plugin pods whose metrics are read through the pod proxy.
    #[arg(
        long,
        env = "USAGE_PLUGIN_SELECTOR",
        default_value = "app.kubernetes.io/component=kubelet-plugin"
    )]
    pub plugin_selector: String,
}

/// `gpu-dra usage` arguments.
#[derive(Debug, Args)]
pub struct UsageArgs {
    /// Only this node.
    #[arg(long, env = "NODE_NAME")]
    pub node: Option<String>,
    /// Driver whose devices are shown.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(short, long, env = "OUTPUT_FORMAT", value_enum, default_value_t = UsageFormat::Text)]
    pub output: UsageFormat,
    /// Where the plugins' metrics are read.
    #[command(flatten)]
    pub metrics: MetricsSource,
    /// Do not read the plugins' metrics: holders only.
    #[arg(long, env = "USAGE_NO_METRICS")]
    pub no_metrics: bool,
    /// A claim is idle when it has had no process with SM activity (no process at all where
    /// the driver does not expose SM activity) for this long: `90s`, `30m`, `1h`, `2d`.
    #[arg(long, env = "USAGE_IDLE_THRESHOLD", default_value = "1h", value_parser = parse_duration)]
    pub idle_threshold: u64,
    /// Flag a claim whose processes use at least this percentage of the memory it was
    /// allocated (its share, MIG device or GPU): it is near the point where CUDA runs out of
    /// memory.
    #[arg(long, env = "USAGE_NEAR_LIMIT", default_value_t = 90, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub near_limit: u32,
}

/// A duration as `--idle-threshold` takes it, in seconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration; use e.g. 90s, 30m, 1h, 2d"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{s:?}: unknown unit {unit:?}; use s, m, h or d")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// One GPU and what is allocated on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuUsage {
    /// Node (pool) name.
    pub node: String,
    /// The GPU, named by its UUID on every row: a GPU with static MIG devices only has no
    /// whole-GPU device, one offered as dynamic MIG has both, so only the UUID names each GPU
    /// the same way.
    pub gpu: String,
    /// GPU UUID.
    pub uuid: String,
    /// The whole GPU's device name (`gpu-<minor>`), when one is published (not for a GPU with
    /// static MIG devices only).
    pub device: Option<String>,
    /// Memory of the GPU as published (e.g. `40Gi`), when known.
    pub memory: Option<String>,
    /// Allocations on it.
    pub holders: Vec<Holder>,
}

/// One allocation of a device of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// The allocated device.
    pub device: String,
    /// `gpu`, `mig` (with its profile) or `share` (with the memory consumed).
    pub kind: String,
    /// The MIG profile, or the memory share consumed.
    pub detail: String,
    /// Admin access (monitoring; may overlap other holders).
    pub admin_access: bool,
    /// UUID of the device (`MIG-...` for a MIG device) as the node plugin reported it in the
    /// claim's status, else the slice's `uuid` attribute; `None` before the claim is
    /// prepared for a device whose slice has none (a dynamic MIG device).
    pub uuid: Option<String>,
    /// Memory the allocation gives the claim, from the API: its memory share, else the
    /// device's published memory (`None` when the slice publishes none).
    pub memory_bytes: Option<u64>,
    /// What the claim uses of the device, from its node plugin's metrics (`None`: no metrics
    /// read, or the plugin reports none for it yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<ClaimUse>,
}

/// What a claim uses of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClaimUse {
    /// Memory allocated (the share, or the device's memory), in bytes.
    pub memory_allocated_bytes: Option<u64>,
    /// Memory its processes hold, in bytes.
    pub memory_used_bytes: Option<u64>,
    /// SM utilisation of its processes, in percent (whole GPUs only).
    pub sm_utilization_percent: Option<u32>,
    /// The device's utilisation, for a claim holding a whole GPU alone.
    pub device_utilization_percent: Option<u32>,
    /// Processes on the device.
    pub processes: u32,
    /// Seconds since the claim was last active.
    pub idle_seconds: Option<u64>,
    /// Idle for longer than the threshold.
    pub idle: bool,
    /// Its processes use at least `--near-limit` percent of the memory allocated.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub near_limit: bool,
}

/// The cluster in a few numbers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// GPUs published.
    pub gpus: usize,
    /// GPUs with at least one claim (admin access aside).
    pub gpus_allocated: usize,
    /// GPUs with at least one claim that is not idle (from the metrics).
    pub gpus_busy: usize,
    /// Claim devices with usage figures that are idle.
    pub idle_claims: usize,
    /// Claim devices near their memory limit.
    pub near_limit_claims: usize,
    /// Memory allocated to claims, in bytes: the plugins' figure of each claim, else its
    /// allocation's memory from the slices (so it does not depend on the metrics being read).
    pub memory_allocated_bytes: u64,
    /// Memory their processes hold, in bytes.
    pub memory_used_bytes: u64,
    /// The idle threshold applied, in seconds.
    pub idle_threshold_seconds: u64,
    /// Metrics endpoints read, and those that could not be.
    pub metrics_read: usize,
    /// Endpoints that failed, with the reason.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub metrics_errors: Vec<String>,
}

/// The whole report (`-o json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Per GPU.
    pub gpus: Vec<GpuUsage>,
    /// The cluster.
    pub summary: Summary,
}

fn as_u64(v: f64) -> Option<u64> {
    (v.is_finite() && v >= 0.0).then_some(v as u64)
}

/// Joins the plugins' `gpu_dra_claim_*` samples to the holders (by pool, device and claim),
/// with `now` (Unix seconds) and `idle_threshold` (seconds) to tell idle claims.
pub fn with_metrics(
    rows: &mut [GpuUsage],
    samples: &[crate::metrics_text::Sample],
    now: u64,
    idle_threshold: u64,
) {
    type Key = (String, String, String);
    let mut uses: BTreeMap<Key, ClaimUse> = BTreeMap::new();
    for s in samples {
        let key = (
            s.label("pool").to_owned(),
            s.label("device").to_owned(),
            format!("{}/{}", s.label("claim_namespace"), s.label("claim")),
        );
        let u = uses.entry(key).or_default();
        let v = as_u64(s.value);
        match s.name.as_str() {
            "gpu_dra_claim_memory_allocated_bytes" => u.memory_allocated_bytes = v,
            "gpu_dra_claim_memory_used_bytes" => {
                u.memory_used_bytes = Some(u.memory_used_bytes.unwrap_or(0) + v.unwrap_or(0));
            }
            "gpu_dra_claim_sm_utilization_percent" => {
                let sm = u32::try_from(v.unwrap_or(0)).unwrap_or(u32::MAX);
                u.sm_utilization_percent = Some(
                    u.sm_utilization_percent
                        .unwrap_or(0)
                        .saturating_add(sm)
                        .min(100),
                );
            }
            "gpu_dra_claim_device_utilization_percent" => {
                u.device_utilization_percent = v.and_then(|v| u32::try_from(v).ok());
            }
            "gpu_dra_claim_processes" => {
                u.processes += v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
            }
            "gpu_dra_claim_last_active_timestamp_seconds" => {
                u.idle_seconds = v.map(|t| now.saturating_sub(t));
            }
            _ => {}
        }
    }
    for u in uses.values_mut() {
        u.idle = u.idle_seconds.is_some_and(|s| s >= idle_threshold);
    }
    for g in rows.iter_mut() {
        for h in &mut g.holders {
            h.usage = uses
                .get(&(g.node.clone(), h.device.clone(), h.claim.clone()))
                .cloned();
        }
    }
}

/// Marks the claims whose memory used is at least `percent` of their memory allocated.
pub fn mark_near_limit(rows: &mut [GpuUsage], percent: u32) {
    for u in rows
        .iter_mut()
        .flat_map(|g| &mut g.holders)
        .filter_map(|h| h.usage.as_mut())
    {
        u.near_limit = match (u.memory_used_bytes, u.memory_allocated_bytes) {
            (Some(used), Some(alloc)) if alloc > 0 => {
                u128::from(used) * 100 >= u128::from(alloc) * u128::from(percent)
            }
            _ => false,
        };
    }
}

/// The cluster summary of `rows`.
pub fn summary(rows: &[GpuUsage], idle_threshold: u64) -> Summary {
    let mut s = Summary {
        gpus: rows.len(),
        idle_threshold_seconds: idle_threshold,
        ..Summary::default()
    };
    for g in rows {
        let users: Vec<&Holder> = g.holders.iter().filter(|h| !h.admin_access).collect();
        if !users.is_empty() {
            s.gpus_allocated += 1;
        }
        if users
            .iter()
            .any(|h| h.usage.as_ref().is_some_and(|u| !u.idle))
        {
            s.gpus_busy += 1;
        }
        for h in &users {
            s.memory_allocated_bytes += h.allocated_bytes().unwrap_or(0);
        }
        for u in users.iter().filter_map(|h| h.usage.as_ref()) {
            s.idle_claims += usize::from(u.idle);
            s.near_limit_claims += usize::from(u.near_limit);
            s.memory_used_bytes += u.memory_used_bytes.unwrap_or(0);
        }
    }
    s
}

impl Holder {
    /// Memory allocated to the claim: its plugin's figure, else the allocation's.
    fn allocated_bytes(&self) -> Option<u64> {
        self.usage
            .as_ref()
            .and_then(|u| u.memory_allocated_bytes)
            .or(self.memory_bytes)
    }
}

/// Bytes of a quantity (`40Gi`, `4864Mi`); `None` for one that is not a byte count.
fn quantity_bytes(q: &str) -> Option<u64> {
    q.parse::<gpu_dra_api::quantity::Quantity>()
        .ok()?
        .to_bytes_ceil()
        .ok()
}

/// Bytes as a person reads them: `10.0Gi`, `512Mi`.
fn human_bytes(b: u64) -> String {
    const GI: f64 = (1u64 << 30) as f64;
    const MI: f64 = (1u64 << 20) as f64;
    if b >= 1 << 30 {
        format!("{:.1}Gi", b as f64 / GI)
    } else {
        format!("{:.0}Mi", b as f64 / MI)
    }
}

/// Seconds as `2d3h`, `4h10m`, `12m`, `40s`.
fn human_seconds(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

fn attr<'a>(d: &'a Device, name: &str) -> Option<&'a str> {
    d.attributes
        .as_ref()?
        .get(name)
        .and_then(|a| a.string.as_deref())
}

/// Who holds what, per node and GPU, sorted by node and GPU name.
pub fn usage(
    slices: &[ResourceSlice],
    claims: &[ResourceClaim],
    driver: &str,
    node: Option<&str>,
) -> Vec<GpuUsage> {
    // Devices by (pool, name); GPUs by (pool, uuid).
    let mut devices: BTreeMap<(String, String), &Device> = BTreeMap::new();
    let mut gpus: BTreeMap<(String, String), GpuUsage> = BTreeMap::new();
    // Each GPU's first device name in natural order (`gpu-2` before `gpu-10`, a MIG device
    // `gpu-3-mig-...` with GPU 3): the rows follow the GPUs' order on the node, not their UUIDs'.
    let mut order: BTreeMap<(String, String), Vec<NamePart>> = BTreeMap::new();
    for s in slices.iter().filter(|s| s.spec.driver == driver) {
        let pool = &s.spec.pool.name;
        if node.is_some_and(|n| n != pool) {
            continue;
        }
        for d in s.spec.devices.iter().flatten() {
            devices.insert((pool.clone(), d.name.clone()), d);
            let mig = attr(d, "type") == Some("mig");
            let gpu_uuid = if mig {
                attr(d, "parentUUID")
            } else {
                attr(d, "uuid")
            };
            let Some(gpu_uuid) = gpu_uuid else { continue };
            let key = natural_key(&d.name);
            order
                .entry((pool.clone(), gpu_uuid.to_string()))
                .and_modify(|k| {
                    if key < *k {
                        k.clone_from(&key);
                    }
                })
                .or_insert_with(|| key.clone());
            let entry = gpus
                .entry((pool.clone(), gpu_uuid.to_string()))
                .or_insert_with(|| GpuUsage {
                    node: pool.clone(),
                    gpu: gpu_uuid.to_string(),
                    uuid: gpu_uuid.to_string(),
                    device: None,
                    memory: None,
                    holders: Vec::new(),
                });
            if !mig {
                entry.device = Some(d.name.clone());
                entry.memory = d
                    .capacity
                    .as_ref()
                    .and_then(|c| c.get("memory"))
                    .map(|c| c.value.0.clone());
            }
        }
    }
    for claim in claims {
        let Some(alloc) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        let prepared = crate::explain::prepared_devices(claim, driver);
        let name = format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            claim.metadata.name.as_deref().unwrap_or_default()
        );
        for r in alloc
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
        {
            if r.driver != driver {
                continue;
            }
            let Some(d) = devices.get(&(r.pool.clone(), r.device.clone())) else {
                continue;
            };
            let mig = attr(d, "type") == Some("mig");
            let gpu_uuid = if mig {
                attr(d, "parentUUID")
            } else {
                attr(d, "uuid")
            };
            let Some(gpu) = gpu_uuid.and_then(|u| gpus.get_mut(&(r.pool.clone(), u.to_string())))
            else {
                continue;
            };
            let share = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|q| q.0.clone());
            let device_memory = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|c| c.value.0.as_str());
            let memory_bytes = share.as_deref().or(device_memory).and_then(quantity_bytes);
            let (kind, detail) = match (mig, share) {
                (true, _) => ("mig", attr(d, "profile").unwrap_or_default().to_string()),
                (false, Some(mem)) => (
                    "share",
                    match &gpu.memory {
                        Some(total) => format!("{mem} of {total}"),
                        None => mem,
                    },
                ),
                (false, None) => ("gpu", "whole GPU".to_string()),
            };
            let reported = prepared
                .iter()
                .find(|p| p.pool == r.pool && p.device == r.device && p.share_id == r.share_id)
                .and_then(|p| p.data.as_ref())
                .map(|data| data.uuid.clone());
            gpu.holders.push(Holder {
                claim: name.clone(),
                device: r.device.clone(),
                kind: kind.into(),
                detail,
                admin_access: r.admin_access == Some(true),
                uuid: reported.or_else(|| attr(d, "uuid").map(str::to_owned)),
                memory_bytes,
                usage: None,
            });
        }
    }
    let mut out: Vec<(Vec<NamePart>, GpuUsage)> = gpus
        .into_iter()
        .map(|(k, g)| (order.remove(&k).unwrap_or_default(), g))
        .collect();
    for (_, g) in &mut out {
        g.holders
            .sort_by(|a, b| (&a.device, &a.claim).cmp(&(&b.device, &b.claim)));
    }
    out.sort_by(|(ka, a), (kb, b)| (&a.node, ka, &a.gpu).cmp(&(&b.node, kb, &b.gpu)));
    out.into_iter().map(|(_, g)| g).collect()
}

/// A run of a name for [`natural_key`]: digits compare as numbers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum NamePart {
    Number(u64),
    Text(String),
}

/// `name` split into runs of digits and of other characters, so that `gpu-2` sorts before
/// `gpu-10`.
fn natural_key(name: &str) -> Vec<NamePart> {
    let mut parts = Vec::new();
    let mut rest = name;
    while let Some(c) = rest.chars().next() {
        let digit = c.is_ascii_digit();
        let end = rest
            .find(|c: char| c.is_ascii_digit() != digit)
            .unwrap_or(rest.len());
        let (run, tail) = rest.split_at(end);
        parts.push(match run.parse() {
            Ok(n) if digit => NamePart::Number(n),
            _ => NamePart::Text(run.to_owned()),
        });
        rest = tail;
    }
    parts
}

/// The table people read.
pub fn to_text(rows: &[GpuUsage]) -> String {
    let with_use = rows
        .iter()
        .flat_map(|g| &g.holders)
        .any(|h| h.usage.is_some());
    let mut lines = vec![[
        "NODE".to_string(),
        "GPU".into(),
        "DEVICE".into(),
        "CLAIM".into(),
        "HOLDS".into(),
        "UUID".into(),
        "ALLOCATED".into(),
        "USED".into(),
        "SM".into(),
        "PROCS".into(),
        "IDLE".into(),
        "NOTE".into(),
    ]];
    for g in rows {
        if g.holders.is_empty() {
            lines.push([
                g.node.clone(),
                g.gpu.clone(),
                g.device.clone().unwrap_or_else(|| "-".into()),
                "-".into(),
                "free".into(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        for h in &g.holders {
            let holds = match h.kind.as_str() {
                "mig" => format!("MIG {}", h.detail),
                "share" => format!("memory {}", h.detail),
                _ => h.detail.clone(),
            };
            let holds = if h.admin_access {
                format!("{holds} (admin access)")
            } else {
                holds
            };
            let dash = || "-".to_string();
            let u = h.usage.as_ref();
            lines.push([
                g.node.clone(),
                g.gpu.clone(),
                h.device.clone(),
                h.claim.clone(),
                holds,
                h.uuid.clone().unwrap_or_else(dash),
                h.allocated_bytes().map_or_else(dash, human_bytes),
                u.and_then(|u| u.memory_used_bytes)
                    .map_or_else(dash, human_bytes),
                u.and_then(|u| u.sm_utilization_percent)
                    .map_or_else(dash, |p| format!("{p}%")),
                u.map_or_else(dash, |u| u.processes.to_string()),
                u.map_or_else(dash, |u| match (u.idle, u.idle_seconds) {
                    (true, Some(s)) => format!("idle {}", human_seconds(s)),
                    (false, _) => "no".into(),
                    (true, None) => "idle".into(),
                }),
                match u {
                    Some(u) if u.near_limit => format!(
                        "near memory limit ({}%)",
                        u.memory_used_bytes.unwrap_or(0) * 100
                            / u.memory_allocated_bytes.unwrap_or(1).max(1)
                    ),
                    _ => String::new(),
                },
            ]);
        }
    }
    let columns = if with_use { 12 } else { 6 };
    let lines: Vec<Vec<String>> = lines.into_iter().map(|l| l[..columns].to_vec()).collect();
    let widths: Vec<usize> = (0..columns)
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut text = String::new();
    for l in &lines {
        let row: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        text.push_str(row.join("  ").trim_end());
        text.push('\n');
    }
    text
}

/// The summary line of the text output.
pub fn summary_text(s: &Summary) -> String {
    let mut text = format!(
        "cluster: {} GPUs, {} allocated, {} busy; memory allocated {}, used {}; {} idle claims (idle after {})\n",
        s.gpus,
        s.gpus_allocated,
        s.gpus_busy,
        human_bytes(s.memory_allocated_bytes),
        human_bytes(s.memory_used_bytes),
        s.idle_claims,
        human_seconds(s.idle_threshold_seconds)
    );
    if s.near_limit_claims > 0 {
        text.push_str(&format!(
            "{} claims near their memory limit: past it CUDA runs out of memory\n",
            s.near_limit_claims
        ));
    }
    for e in &s.metrics_errors {
        text.push_str(&format!("metrics not read: {e}\n"));
    }
    text
}

/// Runs `gpu-dra usage`.
pub fn run(args: &UsageArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let (slices, claims, metrics) = runtime.block_on(fetch(args))?;
    let mut rows = usage(&slices, &claims, &args.driver_name, args.node.as_deref());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    let mut read = 0;
    for m in metrics {
        match m {
            Ok(text) => {
                read += 1;
                samples.extend(crate::metrics_text::parse(&text, "gpu_dra_claim_"));
            }
            Err(e) => errors.push(e),
        }
    }
    with_metrics(&mut rows, &samples, now, args.idle_threshold);
    mark_near_limit(&mut rows, args.near_limit);
    let mut sum = summary(&rows, args.idle_threshold);
    sum.metrics_read = read;
    sum.metrics_errors = errors;
    match args.output {
        UsageFormat::Text => write!(out, "{}{}", to_text(&rows), summary_text(&sum))?,
        UsageFormat::Json => {
            serde_json::to_writer_pretty(
                &mut *out,
                &Report {
                    gpus: rows,
                    summary: sum,
                },
            )?;
            writeln!(out)?;
        }
    }
    Ok(Outcome::Valid)
}

/// Slices, claims and the text of every plugin's metrics endpoint (or why one could not be
/// read).
async fn fetch(
    args: &UsageArgs,
) -> Result<
    (
        Vec<ResourceSlice>,
        Vec<ResourceClaim>,
        Vec<Result<String, String>>,
    ),
    CliError,
> {
    let client = crate::explain::cluster_client().await?;
    let (slices, claims) = crate::explain::slices_and_claims(&client).await?;
    let metrics = if args.no_metrics {
        Vec::new()
    } else {
        read_metrics(&client, &args.metrics, args.node.as_deref()).await
    };
    Ok((slices, claims, metrics))
}

/// The text of every plugin's metrics endpoint (or why one could not be read): from `urls`
/// when given, else through the API server's pod proxy for the pods `selector` names.
pub async fn read_metrics(
    client: &kube::Client,
    source: &MetricsSource,
    node: Option<&str>,
) -> Vec<Result<String, String>> {
    if source.metrics_url.is_empty() {
        return through_pod_proxy(client, &source.plugin_selector, node).await;
    }
    let mut out = Vec::new();
    for url in &source.metrics_url {
        out.push(http_get(url).await.map_err(|e| format!("{url}: {e}")));
    }
    out
}

/// How long one plugin pod's metrics may take through the API server's pod proxy.
const PROXY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The metrics of every running plugin pod, through the API server's pod proxy.
async fn through_pod_proxy(
    client: &kube::Client,
    selector: &str,
    node: Option<&str>,
) -> Vec<Result<String, String>> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: kube::Api<Pod> = kube::Api::all(client.clone());
    let list = match pods
        .list(&kube::api::ListParams::default().labels(selector))
        .await
    {
        Ok(l) => l,
        Err(e) => return vec![Err(format!("listing plugin pods ({selector}): {e}"))],
    };
    let mut out = Vec::new();
    for pod in list.items {
        let spec = pod.spec.as_ref();
        if node.is_some_and(|n| spec.and_then(|s| s.node_name.as_deref()) != Some(n)) {
            continue;
        }
        if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
            continue;
        }
        let env = |name: &str| {
            spec.and_then(|s| s.containers.first())
                .and_then(|c| c.env.as_ref())
                .and_then(|env| env.iter().find(|e| e.name == name))
                .and_then(|e| e.value.clone())
        };
        let port = env("HTTP_ADDRESS")
            .and_then(|a| a.rsplit_once(':').map(|(_, p)| p.to_owned()))
            .unwrap_or_else(|| "8080".into());
        let path = env("METRICS_PATH").unwrap_or_else(|| "/metrics".into());
        if path.is_empty() {
            continue;
        }
        let (ns, name) = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        let url = format!("/api/v1/namespaces/{ns}/pods/{name}:{port}/proxy{path}");
        let req = http::Request::get(&url).body(Vec::new());
        // The client retries an unavailable answer (503 from the proxy when the pod serves
        // nothing there) for minutes; one plugin that cannot answer must not stall the report.
        out.push(match req {
            Ok(req) => match tokio::time::timeout(PROXY_TIMEOUT, client.request_text(req)).await {
                Ok(answer) => answer.map_err(|e| format!("{ns}/{name}: {e}")),
                Err(_) => Err(format!(
                    "{ns}/{name}: no metrics through the API server's pod proxy within {}s (is the pod's {path} served on port {port}?)",
                    PROXY_TIMEOUT.as_secs()
                )),
            },
            Err(e) => Err(format!("{ns}/{name}: {e}")),
        });
    }
    out
}

/// A plain HTTP/1.0 GET of `url` (`http://host:port/path`): the body of a 200 answer.
async fn http_get(url: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are read (the plugin serves plain HTTP)")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut conn = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::TcpStream::connect(host),
    )
    .await
    .map_err(|_| "connect timed out".to_string())?
    .map_err(|e| e.to_string())?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut body),
    )
    .await
    .map_err(|_| "read timed out".to_string())?
    .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&body);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP answer")?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        return Err(format!("HTTP {status}"));
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test(start_paused = true)]
    async fn a_plugin_pod_the_proxy_never_answers_for_is_given_up_after_the_timeout() {
        // The API server lists one running plugin pod; its proxied metrics never come.
        let service = tower::service_fn(|req: http::Request<kube::client::Body>| async move {
            if req.uri().path().contains("/proxy") {
                std::future::pending::<()>().await;
            }
            let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                "metadata": {"name": "plugin-x", "namespace": "gpu-dra"},
                "spec": {"nodeName": "node-a", "containers": [{"name": "plugin"}]},
                "status": {"phase": "Running"}
            }]});
            Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(
                serde_json::to_vec(&pods).expect("json"),
            )))
        });
        let client = kube::Client::new(service, "default");
        let started = tokio::time::Instant::now();
        let answers = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            through_pod_proxy(&client, "app=plugin", None),
        )
        .await
        .expect("the report goes on without the pod that does not answer");
        assert_eq!(started.elapsed(), PROXY_TIMEOUT);
        assert_eq!(answers.len(), 1);
        let err = answers[0].as_ref().expect_err("no answer");
        assert!(
            err.starts_with(
                "gpu-dra/plugin-x: no metrics through the API server's pod proxy within 10s"
            ),
            "{err}"
        );
    }

    fn slice() -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "node-a-gpu-nvidia-com-0"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-0"}},
                     "capacity": {"memory": {"value": "40Gi"}}},
                    {"name": "gpu-0-mig-1g5gb-0", "attributes": {"type": {"string": "mig"},
                     "parentUUID": {"string": "GPU-0"}, "profile": {"string": "1g.5gb"}},
                     "capacity": {"memory": {"value": "4864Mi"}}},
                    {"name": "gpu-1", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-1"}},
                     "capacity": {"memory": {"value": "40Gi"}}, "allowMultipleAllocations": true},
                    {"name": "gpu-2-mig-3g20gb-9-4", "attributes": {"type": {"string": "mig"},
                     "parentUUID": {"string": "GPU-2"}, "profile": {"string": "3g.20gb"}}},
                    {"name": "gpu-3", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-3"}}}
                ]}
        }))
        .expect("slice")
    }

    fn claim(name: &str, device: &str, memory: Option<&str>, admin: bool) -> ResourceClaim {
        let mut result = json!({"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device});
        if let Some(m) = memory {
            result["consumedCapacity"] = json!({"memory": m});
            result["shareID"] = json!("0d1c3a0e-0000-4000-8000-000000000001");
        }
        if admin {
            result["adminAccess"] = json!(true);
        }
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}}
        }))
        .expect("claim")
    }

    #[test]
    fn shows_whole_gpus_partitions_shares_and_free_gpus() {
        let claims = [
            claim("train", "gpu-0", None, false),
            claim("a", "gpu-1", Some("10Gi"), false),
            claim("b", "gpu-1", Some("20Gi"), false),
            claim("part", "gpu-2-mig-3g20gb-9-4", None, false),
            claim("watch", "gpu-0", None, true),
            claim("unallocated", "gpu-3", None, false),
        ];
        let mut claims = claims.to_vec();
        claims[5].status = None;
        // The MIG device's slice has no UUID (dynamic MIG): the plugin's status entry names it.
        claims[3].status.as_mut().expect("status").devices = Some(vec![
            serde_json::from_value(json!({"driver": "gpu.nvidia.com", "pool": "node-a",
                "device": "gpu-2-mig-3g20gb-9-4", "data": {"uuid": "MIG-P", "type": "mig"}}))
            .expect("entry"),
        ]);
        let rows = usage(&[slice()], &claims, "gpu.nvidia.com", None);
        let text = to_text(&rows);
        let expect = [
            "node-a  GPU-0  gpu-0                 ns/train  whole GPU",
            "node-a  GPU-0  gpu-0                 ns/watch  whole GPU (admin access)",
            "node-a  GPU-1  gpu-1                 ns/a      memory 10Gi of 40Gi",
            "node-a  GPU-1  gpu-1                 ns/b      memory 20Gi of 40Gi",
            "node-a  GPU-2  gpu-2-mig-3g20gb-9-4  ns/part   MIG 3g.20gb",
            "node-a  GPU-3  gpu-3                 -         free",
        ];
        for line in expect {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        let uuid_of = |claim: &str| {
            rows.iter()
                .flat_map(|g| &g.holders)
                .find(|h| h.claim == claim)
                .and_then(|h| h.uuid.clone())
        };
        assert_eq!(uuid_of("ns/part").as_deref(), Some("MIG-P"));
        assert_eq!(uuid_of("ns/train").as_deref(), Some("GPU-0"));
        assert!(
            text.lines()
                .any(|l| l.contains("ns/part") && l.ends_with("MIG-P")),
            "{text}"
        );
        assert!(usage(&[slice()], &claims, "gpu.nvidia.com", Some("node-b")).is_empty());
        assert!(usage(&[slice()], &claims, "other.example.com", None).is_empty());
    }

    #[test]
    fn every_gpu_is_named_by_its_uuid_with_static_or_dynamic_mig() {
        // GPU-0 is offered as dynamic MIG (its whole device and its partitions published),
        // GPU-2 has static MIG devices only.
        let claims = [
            claim("dyn", "gpu-0-mig-1g5gb-0", None, false),
            claim("part", "gpu-2-mig-3g20gb-9-4", None, false),
        ];
        let rows = usage(&[slice()], &claims, "gpu.nvidia.com", None);
        let names: Vec<(&str, Option<&str>)> = rows
            .iter()
            .map(|g| (g.gpu.as_str(), g.device.as_deref()))
            .collect();
        assert_eq!(
            names,
            [
                ("GPU-0", Some("gpu-0")),
                ("GPU-1", Some("gpu-1")),
                ("GPU-2", None),
                ("GPU-3", Some("gpu-3"))
            ]
        );
        let text = to_text(&rows);
        for line in [
            "node-a  GPU-0  gpu-0-mig-1g5gb-0     ns/dyn   MIG 1g.5gb",
            "node-a  GPU-2  gpu-2-mig-3g20gb-9-4  ns/part  MIG 3g.20gb",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn rows_follow_the_gpus_device_names_not_their_uuids() {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "node-a-gpu-nvidia-com-0"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-10", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-a"}}},
                    {"name": "gpu-2", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-z"}}},
                    {"name": "gpu-1-mig-1g5gb-19-0", "attributes": {"type": {"string": "mig"},
                     "parentUUID": {"string": "GPU-m"}, "profile": {"string": "1g.5gb"}}}
                ]}
        }))
        .expect("slice");
        let rows = usage(&[slice], &[], "gpu.nvidia.com", None);
        let gpus: Vec<&str> = rows.iter().map(|g| g.gpu.as_str()).collect();
        assert_eq!(gpus, ["GPU-m", "GPU-z", "GPU-a"]);
    }

    #[test]
    fn without_metrics_memory_allocated_is_each_allocation_s_memory() {
        // A whole GPU, a memory share, a dynamic MIG device, and an admin's access (not
        // counted); no plugin's metrics read.
        let claims = [
            claim("train", "gpu-3", None, false),
            claim("a", "gpu-1", Some("10Gi"), false),
            claim("dyn", "gpu-0-mig-1g5gb-0", None, false),
            claim("watch", "gpu-3", None, true),
        ];
        let mut slice = slice();
        let gpu3 = &mut slice.spec.devices.as_mut().expect("devices")[4];
        assert_eq!(gpu3.name, "gpu-3");
        gpu3.capacity = serde_json::from_value(json!({"memory": {"value": "16Gi"}})).ok();
        let rows = usage(&[slice], &claims, "gpu.nvidia.com", None);
        let memory_of = |claim: &str| {
            rows.iter()
                .flat_map(|g| &g.holders)
                .find(|h| h.claim == claim)
                .and_then(|h| h.memory_bytes)
        };
        assert_eq!(memory_of("ns/train"), Some(16 << 30));
        assert_eq!(memory_of("ns/a"), Some(10 << 30));
        assert_eq!(memory_of("ns/dyn"), Some(4864 << 20));
        let s = summary(&rows, 3600);
        assert_eq!(
            s.memory_allocated_bytes,
            (16 << 30) + (10 << 30) + (4864 << 20)
        );
        assert!(
            summary_text(&s).contains("memory allocated 30.8Gi, used 0Mi"),
            "{}",
            summary_text(&s)
        );
    }

    /// The series a plugin serves for claim `ns/name` on `device`.
    fn series(
        name: &str,
        device: &str,
        allocated: u64,
        used: u64,
        sm: Option<u32>,
        last: u64,
    ) -> String {
        let l = format!(
            r#"namespace="ns",claim="{name}",claim_namespace="ns",device="{device}",pool="node-a",uuid="U""#
        );
        let mut text = format!(
            "gpu_dra_claim_memory_allocated_bytes{{{l}}} {allocated}\n\
             gpu_dra_claim_memory_used_bytes{{{l},pod=\"p\",container=\"c\"}} {used}\n\
             gpu_dra_claim_processes{{{l},pod=\"p\",container=\"c\"}} 1\n\
             gpu_dra_claim_last_active_timestamp_seconds{{{l}}} {last}\n"
        );
        if let Some(sm) = sm {
            text.push_str(&format!(
                "gpu_dra_claim_sm_utilization_percent{{{l},pod=\"p\",container=\"c\"}} {sm}\n"
            ));
        }
        text
    }

    #[test]
    fn metrics_give_each_claim_its_use_and_the_cluster_its_summary() {
        let claims = [
            claim("train", "gpu-0", None, false),
            claim("a", "gpu-1", Some("10Gi"), false),
            claim("b", "gpu-1", Some("20Gi"), false),
            claim("part", "gpu-2-mig-3g20gb-9-4", None, false),
        ];
        let mut rows = usage(&[slice()], &claims, "gpu.nvidia.com", None);
        let now = 1_000_000;
        let text = [
            series("train", "gpu-0", 40 << 30, 30 << 30, Some(80), now - 5),
            series("a", "gpu-1", 10 << 30, 2 << 30, Some(0), now - 7200),
            series("b", "gpu-1", 20 << 30, 0, Some(0), now - 60),
            // MIG: no SM figure.
            series(
                "part",
                "gpu-2-mig-3g20gb-9-4",
                20 << 30,
                1 << 30,
                None,
                now - 10,
            ),
        ]
        .concat();
        let samples = crate::metrics_text::parse(&text, "gpu_dra_claim_");
        with_metrics(&mut rows, &samples, now, 3600);
        let use_of = |claim: &str| {
            rows.iter()
                .flat_map(|g| &g.holders)
                .find(|h| h.claim == claim)
                .and_then(|h| h.usage.clone())
                .expect(claim)
        };
        let train = use_of("ns/train");
        assert_eq!(
            (
                train.memory_allocated_bytes,
                train.memory_used_bytes,
                train.sm_utilization_percent,
                train.processes,
                train.idle
            ),
            (Some(40 << 30), Some(30 << 30), Some(80), 1, false)
        );
        let a = use_of("ns/a");
        assert_eq!((a.idle, a.idle_seconds), (true, Some(7200)));
        assert!(!use_of("ns/b").idle, "idle for less than the threshold");
        assert_eq!(use_of("ns/part").sm_utilization_percent, None);

        let s = summary(&rows, 3600);
        assert_eq!(
            (s.gpus, s.gpus_allocated, s.gpus_busy, s.idle_claims),
            (4, 3, 3, 1)
        );
        assert_eq!(s.memory_allocated_bytes, (40 + 10 + 20 + 20) << 30);
        assert_eq!(s.memory_used_bytes, (30 + 2 + 1) << 30);
        let table = to_text(&rows);
        assert!(
            table.lines().any(|l| l.contains("ns/a")
                && l.contains("10.0Gi")
                && l.contains("2.0Gi")
                && l.ends_with("idle 2h0m")),
            "{table}"
        );
        assert!(
            table
                .lines()
                .any(|l| l.contains("ns/train") && l.contains("80%") && l.ends_with("no")),
            "{table}"
        );
        assert!(
            summary_text(&s).starts_with("cluster: 4 GPUs, 3 allocated, 3 busy; memory allocated 90.0Gi, used 33.0Gi; 1 idle claims (idle after 1h0m)"),
            "{}",
            summary_text(&s)
        );
    }

    #[test]
    fn claims_near_their_memory_limit_are_flagged() {
        let claims = [
            claim("train", "gpu-0", None, false),
            claim("a", "gpu-1", Some("10Gi"), false),
            claim("b", "gpu-1", Some("20Gi"), false),
        ];
        let mut rows = usage(&[slice()], &claims, "gpu.nvidia.com", None);
        let now = 1_000_000;
        let text = [
            series("train", "gpu-0", 40 << 30, 30 << 30, Some(80), now),
            // 9.5 of 10 GiB: 95 %.
            series("a", "gpu-1", 10 << 30, 19 << 29, Some(10), now),
            // 18 of 20 GiB: exactly 90 %.
            series("b", "gpu-1", 20 << 30, 18 << 30, Some(10), now),
        ]
        .concat();
        with_metrics(
            &mut rows,
            &crate::metrics_text::parse(&text, "gpu_dra_claim_"),
            now,
            3600,
        );
        mark_near_limit(&mut rows, 90);
        let near: Vec<(&str, bool)> = rows
            .iter()
            .flat_map(|g| &g.holders)
            .map(|h| {
                (
                    h.claim.as_str(),
                    h.usage.as_ref().is_some_and(|u| u.near_limit),
                )
            })
            .collect();
        assert_eq!(near, [("ns/train", false), ("ns/a", true), ("ns/b", true)]);
        let table = to_text(&rows);
        assert!(
            table
                .lines()
                .any(|l| l.contains("ns/a") && l.ends_with("near memory limit (95%)")),
            "{table}"
        );
        let s = summary(&rows, 3600);
        assert_eq!(s.near_limit_claims, 2);
        assert!(summary_text(&s).contains("2 claims near their memory limit"));
        mark_near_limit(&mut rows, 96);
        assert_eq!(summary(&rows, 3600).near_limit_claims, 0);
    }

    #[test]
    fn each_subcommand_help_describes_its_own_output() {
        use clap::Parser;
        let help = |cmd: &str| {
            crate::Cli::try_parse_from(["gpu-dra", cmd, "--help"])
                .expect_err("help")
                .to_string()
        };
        let usage = help("usage");
        assert!(usage.contains("one line per GPU and holder"), "{usage}");
        assert!(!usage.contains("per request its selectors"), "{usage}");
        let explain = help("explain");
        assert!(explain.contains("per request its selectors"), "{explain}");
        let advise = help("advise");
        assert!(advise.contains("one line per claim"), "{advise}");
        assert!(advise.contains("ResourceClaimTemplates"), "{advise}");
    }

    #[test]
    fn idle_thresholds_take_units() {
        assert_eq!(parse_duration("90s"), Ok(90));
        assert_eq!(parse_duration("30m"), Ok(1800));
        assert_eq!(parse_duration("2d"), Ok(172_800));
        assert_eq!(parse_duration("45"), Ok(45));
        assert!(parse_duration("1w").is_err_and(|e| e.contains("use s, m, h or d")));
        assert!(parse_duration("soon").is_err());
    }
}
