//! Per-claim GPU usage: what each prepared claim holds (its device, or its share of one) and
//! what its pods actually use, sampled every `--usage-interval-seconds` and exported as
//! `gpu_dra_claim_*` series on `/metrics`.
//!
//! The problem: NVML reports processes per device, by host PID; an admin asks per claim. The
//! chain is device UUID (the checkpoint's prepared devices) -> processes on it
//! (`UsageSource`, NVML on the GPU or MIG device handle) -> the pod of each process (its
//! `/proc/<pid>/cgroup` names the pod UID, and the container's ID under CRI runtimes or its
//! name under the e2e runtime; the plugin needs the host's PID namespace for that, which the
//! chart's `hostPID` gives) -> the
//! claim, through the claim's `status.reservedFor` (the pods the scheduler let use it), read
//! from the API server when a process of a pod no holder of its device knows shows up on its
//! device: once per claim that runs something (and once more per pod that turns out not to be
//! the claim's: it is remembered as a stranger), none for a claim whose device stays idle or
//! whose processes cannot be told by pod (reading its pods could not attribute anything).
//! Container names where cgroups give IDs only: the pod's `status.containerStatuses`, read
//! (GET by name) when a process of one of those pods shows a container ID not seen before:
//! once per pod and container start, never per sample (see [`pods`]).
//! A process on a device that one claim holds alone is that claim's even
//! when its pod cannot be told (no hostPID, a process outside any pod): whoever runs there
//! uses that claim's device.
//!
//! Figures, and where the driver has none: memory used per process everywhere (GPU, MIG
//! device, MPS client); SM utilisation per process on whole GPUs only (NVML has no
//! per-process or device utilisation on MIG devices; under MPS it is the client's as the
//! driver samples it); device utilisation only for a claim that holds a whole GPU alone (on a
//! shared GPU it is everyone's). A figure NVML does not expose is left out, never reported as
//! 0. Memory allocated is the claim's memory share, else the device's memory.
//!
//! Invariants: series exist only for claims completely prepared in the checkpoint: each
//! sample replaces the whole set, so an unprepared claim's series are gone at the next sample
//! (bounded cardinality); a claim is active at a sample when one of its processes has SM
//! activity (or, where SM activity is not exposed, when it has a process), and
//! `gpu_dra_claim_last_active_timestamp_seconds` keeps the last such time (the first sample
//! that saw the claim, until then), from which `gpu-dra usage` and dashboards tell idle time.
//! Sampling never blocks prepare or unprepare: it reads a copy of the checkpoint.
//!
//! History: each claim device's peak and 95th percentile of memory used and of SM
//! utilisation, its sample count and first and last sample time, over the claim's whole life
//! (`gpu_dra_claim_*_peak_*`, `*_p95_*`, `gpu_dra_claim_usage_samples`,
//! `gpu_dra_claim_{first,last}_sample_timestamp_seconds`), kept in a file across plugin
//! restarts and gone with the claim (see [`history`]). What sampling misses: memory used is
//! read at each sample, so an allocation that comes and goes between two samples (a burst
//! shorter than `--usage-interval-seconds`, 15 s by default: a short warm-up, a transient
//! workspace of one batch) is not in the peak; SM utilisation is NVML's average over the
//! interval, so a burst of full load for a few seconds in a quiet interval shows as a low
//! figure, and the percentile is of interval averages, not of instants. Advice built on these
//! figures therefore needs its margin, and a workload whose bursts matter must say so itself.
//!
//! Alternatives rejected: mapping pods by the kubelet's PodResources API (not every kubelet
//! reports DRA claims there, and it names containers only); a status the plugin writes into
//! each claim (an API write per claim per interval); reading every claim at every sample (API
//! load that grows with claims, for data that changes only when pods start).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpu_dra_core::checkpoint::{Checkpoint, PrepareState};
use gpu_dra_device::Inventory;
use gpu_dra_device::usage::{DeviceUsage, UsageSource};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use tracing::{debug, warn};

use crate::claims::ClaimSource;
use history::History;
use pods::PodSource;

pub mod history;
pub mod pods;

type Labels = Vec<(String, String)>;

/// One device of a completely prepared claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimDevice {
    /// Claim UID.
    pub claim_uid: String,
    /// Claim namespace (also its pods').
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// Device name in the pool.
    pub device: String,
    /// Pool (node) name.
    pub pool: String,
    /// Device UUID (`GPU-...`, `MIG-...`).
    pub uuid: String,
    /// Sharing strategy (`TimeSlicing`, `MPS`) or empty.
    pub strategy: String,
    /// The memory share, in bytes.
    pub share_bytes: Option<u64>,
    /// MIG profile (`1g.5gb`) or empty.
    pub mig_profile: String,
    /// Admin access: monitoring, overlapping other claims.
    pub admin_access: bool,
}

/// The devices of the claims completely prepared in `checkpoint`; MIG profiles from
/// `inventory` by UUID.
pub fn claim_devices(checkpoint: &Checkpoint, inventory: &Inventory) -> Vec<ClaimDevice> {
    let profiles: HashMap<&str, &str> = inventory
        .gpus
        .iter()
        .flat_map(|g| &g.mig_devices)
        .map(|m| (m.uuid.as_str(), m.profile.as_str()))
        .collect();
    let mut out = Vec::new();
    for (uid, entry) in &checkpoint.claims {
        if entry.state != PrepareState::PrepareCompleted {
            continue;
        }
        for d in entry.devices.iter().filter(|d| !d.uuid.is_empty()) {
            out.push(ClaimDevice {
                claim_uid: uid.clone(),
                namespace: entry.namespace.clone(),
                name: entry.name.clone(),
                device: d.device.clone(),
                pool: d.pool.clone(),
                uuid: d.uuid.clone(),
                strategy: d.sharing_strategy.clone().unwrap_or_default(),
                share_bytes: d.memory_share_bytes,
                mig_profile: profiles
                    .get(d.uuid.as_str())
                    .map(|p| (*p).to_owned())
                    .unwrap_or_default(),
                admin_access: d.admin_access,
            });
        }
    }
    out
}

/// Whom a process belongs to, from its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Owner {
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's name, where the cgroup names it (the e2e runtime's) or once the pod's
    /// `containerStatuses` named its ID; empty until then.
    pub container: String,
    /// The container's ID, where the cgroup names it (CRI runtimes: containerd, CRI-O,
    /// Docker); empty otherwise.
    pub container_id: String,
}

/// The container ID in the cgroup segment below a pod's: `<id>` (cgroupfs) or
/// `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` (systemd).
fn container_id_of(segment: &str) -> String {
    let seg = segment.strip_suffix(".scope").unwrap_or(segment);
    ["cri-containerd-", "crio-", "docker-"]
        .iter()
        .find_map(|p| seg.strip_prefix(p))
        .unwrap_or(seg)
        .to_owned()
}

fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// The pod (and container, where named) of a process from its `/proc/<pid>/cgroup` text, in
/// the forms the kubelet's cgroup drivers and the e2e runtime write:
/// `.../pod<uid>/<container id>` (cgroupfs), `.../kubepods-<qos>-pod<uid with _>.slice/...`
/// (systemd), `/<pod uid>_<container name>` (runc with the container ID as its path).
/// `None` for a process outside any pod.
pub fn owner_from_cgroup(text: &str) -> Option<Owner> {
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or_default();
        let segments: Vec<&str> = path.split('/').collect();
        for (i, segment) in segments.iter().enumerate().rev() {
            // systemd: kubepods-burstable-pod<uid_with_underscores>.slice
            let seg = segment.strip_suffix(".slice").unwrap_or(segment);
            if let Some(at) = seg.rfind("pod") {
                let uid = seg[at + 3..].replace('_', "-");
                if is_uuid(&uid) {
                    return Some(Owner {
                        pod_uid: uid,
                        container: String::new(),
                        container_id: segments
                            .get(i + 1)
                            .map(|c| container_id_of(c))
                            .unwrap_or_default(),
                    });
                }
            }
            if let Some((uid, name)) = segment.split_once('_')
                && is_uuid(uid)
                && !name.is_empty()
            {
                return Some(Owner {
                    pod_uid: uid.to_owned(),
                    container: name.to_owned(),
                    container_id: String::new(),
                });
            }
        }
    }
    None
}

/// A pod a claim is reserved for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Pod name (in the claim's namespace).
    pub name: String,
    /// Pod UID.
    pub uid: String,
}

/// What one pod's container uses of one claim's device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUsage {
    /// Pod name; empty when the processes' pod is unknown.
    pub pod: String,
    /// Container name; empty when not known.
    pub container: String,
    /// Device memory its processes hold, in bytes (`None`: not exposed).
    pub used_bytes: Option<u64>,
    /// Their SM utilisation, in percent (`None`: not exposed here).
    pub sm_percent: Option<u32>,
    /// How many processes.
    pub processes: u32,
}

/// What one claim holds on one device, and what it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimDeviceUsage {
    /// The claim's device.
    pub device: ClaimDevice,
    /// Memory allocated: the share, else the device's memory.
    pub allocated_bytes: Option<u64>,
    /// The device's utilisation, for a claim holding the device alone.
    pub device_utilization_percent: Option<u32>,
    /// Use per pod and container; one entry with no processes when nothing runs.
    pub pods: Vec<PodUsage>,
    /// Whether the claim was active (see the module documentation).
    pub active: bool,
}

/// Attributes the `samples` of the devices to the claims holding them (the rules are in the
/// module documentation): `owners` by PID, `pods` the pods each claim is reserved for, by
/// claim UID. Pure, so it is tested with plain data.
pub fn attribute(
    devices: &[ClaimDevice],
    samples: &[DeviceUsage],
    owners: &HashMap<u32, Owner>,
    pods: &HashMap<String, Vec<PodRef>>,
) -> Vec<ClaimDeviceUsage> {
    let by_uuid: HashMap<&str, &DeviceUsage> =
        samples.iter().map(|s| (s.uuid.as_str(), s)).collect();
    let mut holders: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, d) in devices.iter().enumerate() {
        holders.entry(d.uuid.as_str()).or_default().push(i);
    }
    // (device index, pod, container) -> usage
    let mut rows: BTreeMap<(usize, String, String), PodUsage> = BTreeMap::new();
    for (uuid, idx) in &holders {
        let Some(sample) = by_uuid.get(uuid) else {
            continue;
        };
        let users: Vec<usize> = idx
            .iter()
            .copied()
            .filter(|i| !devices[*i].admin_access)
            .collect();
        for p in &sample.processes {
            let owner = owners.get(&p.pid);
            let reserved = |i: &usize| -> Option<String> {
                let owner = owner?;
                pods.get(&devices[*i].claim_uid)?
                    .iter()
                    .find(|r| r.uid == owner.pod_uid)
                    .map(|r| r.name.clone())
            };
            let found = idx.iter().find_map(|i| reserved(i).map(|pod| (*i, pod)));
            let (holder, pod) = match (found, users.as_slice()) {
                (Some(found), _) => found,
                (None, [only]) => (*only, String::new()),
                (None, _) => {
                    debug!(pid = p.pid, device = %uuid, "process of no known claim on a shared device");
                    continue;
                }
            };
            let container = owner.map(|o| o.container.clone()).unwrap_or_default();
            let row = rows
                .entry((holder, pod.clone(), container.clone()))
                .or_insert(PodUsage {
                    pod,
                    container,
                    used_bytes: None,
                    sm_percent: None,
                    processes: 0,
                });
            row.processes += 1;
            if let Some(b) = p.used_bytes {
                row.used_bytes = Some(row.used_bytes.unwrap_or(0) + b);
            }
            if let Some(s) = p.sm_percent {
                row.sm_percent = Some((row.sm_percent.unwrap_or(0) + s).min(100));
            }
        }
    }
    let mut out = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let sample = by_uuid.get(d.uuid.as_str());
        let mut pods: Vec<PodUsage> = rows
            .range((i, String::new(), String::new())..)
            .take_while(|((j, _, _), _)| *j == i)
            .map(|(_, u)| u.clone())
            .collect();
        // Per-process SM activity is exposed where the device's utilisation is (whole GPUs).
        let sm_exposed = sample.is_some_and(|s| s.utilization_percent.is_some());
        let active = pods.iter().any(|u| match u.sm_percent {
            Some(sm) => sm > 0,
            None => u.processes > 0,
        });
        if pods.is_empty() && sample.is_some() {
            pods.push(PodUsage {
                pod: String::new(),
                container: String::new(),
                used_bytes: Some(0),
                sm_percent: sm_exposed.then_some(0),
                processes: 0,
            });
        }
        let alone = holders
            .get(d.uuid.as_str())
            .is_some_and(|h| h.iter().filter(|j| !devices[**j].admin_access).count() == 1)
            && !d.admin_access;
        out.push(ClaimDeviceUsage {
            allocated_bytes: d.share_bytes.or(sample.and_then(|s| s.memory_total)),
            device_utilization_percent: if alone {
                sample.and_then(|s| s.utilization_percent)
            } else {
                None
            },
            pods,
            active,
            device: d.clone(),
        });
    }
    out
}

/// The `gpu_dra_claim_*` series and the sampler's own (`gpu_dra_usage_*`).
#[derive(Default)]
pub struct UsageMetrics {
    info: Family<Labels, Gauge>,
    allocated: Family<Labels, Gauge>,
    used: Family<Labels, Gauge>,
    sm: Family<Labels, Gauge>,
    processes: Family<Labels, Gauge>,
    device_util: Family<Labels, Gauge>,
    last_active: Family<Labels, Gauge>,
    peak_used: Family<Labels, Gauge>,
    p95_used: Family<Labels, Gauge>,
    peak_sm: Family<Labels, Gauge>,
    p95_sm: Family<Labels, Gauge>,
    history_samples: Family<Labels, Gauge>,
    first_sample: Family<Labels, Gauge>,
    last_sample: Family<Labels, Gauge>,
    samples: Counter,
    errors: Counter,
    cpu: Gauge<f64, AtomicU64>,
    duration: Gauge<f64, AtomicU64>,
    published: Mutex<BTreeMap<&'static str, BTreeSet<Labels>>>,
}

/// The names of the `gpu_dra_claim_*` series, as exported (the dashboard's test checks its
/// queries against what is registered).
pub const CLAIM_SERIES: [&str; 14] = [
    "gpu_dra_claim_info",
    "gpu_dra_claim_memory_allocated_bytes",
    "gpu_dra_claim_memory_used_bytes",
    "gpu_dra_claim_sm_utilization_percent",
    "gpu_dra_claim_processes",
    "gpu_dra_claim_device_utilization_percent",
    "gpu_dra_claim_last_active_timestamp_seconds",
    "gpu_dra_claim_memory_used_peak_bytes",
    "gpu_dra_claim_memory_used_p95_bytes",
    "gpu_dra_claim_sm_utilization_peak_percent",
    "gpu_dra_claim_sm_utilization_p95_percent",
    "gpu_dra_claim_usage_samples",
    "gpu_dra_claim_first_sample_timestamp_seconds",
    "gpu_dra_claim_last_sample_timestamp_seconds",
];

fn claim_labels(d: &ClaimDevice) -> Labels {
    [
        ("namespace", d.namespace.as_str()),
        ("claim", d.name.as_str()),
        ("claim_namespace", d.namespace.as_str()),
        ("device", d.device.as_str()),
        ("pool", d.pool.as_str()),
        ("uuid", d.uuid.as_str()),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect()
}

fn with(mut labels: Labels, extra: &[(&str, &str)]) -> Labels {
    labels.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    labels
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl UsageMetrics {
    /// Registers the series under `registry` (the `gpu_dra` prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "claim_info",
            "Devices of prepared claims: sharing strategy, MIG profile and memory share (always 1)",
            self.info.clone(),
        );
        registry.register(
            "claim_memory_allocated_bytes",
            "Device memory a claim holds: its memory share, else the device's memory",
            self.allocated.clone(),
        );
        registry.register(
            "claim_memory_used_bytes",
            "Device memory held by a claim's processes, per pod and container",
            self.used.clone(),
        );
        registry.register(
            "claim_sm_utilization_percent",
            "SM utilisation of a claim's processes, per pod and container (whole GPUs only)",
            self.sm.clone(),
        );
        registry.register(
            "claim_processes",
            "Processes using a claim's device, per pod and container",
            self.processes.clone(),
        );
        registry.register(
            "claim_device_utilization_percent",
            "Utilisation of a whole GPU that one claim holds alone",
            self.device_util.clone(),
        );
        registry.register(
            "claim_last_active_timestamp_seconds",
            "Last sample at which a claim's processes were active (Unix time)",
            self.last_active.clone(),
        );
        registry.register(
            "claim_memory_used_peak_bytes",
            "Most device memory a claim's processes held at one sample, over the claim's life",
            self.peak_used.clone(),
        );
        registry.register(
            "claim_memory_used_p95_bytes",
            "95th percentile of a claim's memory used over its life (rounded up, at most 6.25 %)",
            self.p95_used.clone(),
        );
        registry.register(
            "claim_sm_utilization_peak_percent",
            "Highest SM utilisation of a claim's processes at one sample, over its life (whole GPUs only)",
            self.peak_sm.clone(),
        );
        registry.register(
            "claim_sm_utilization_p95_percent",
            "95th percentile of a claim's SM utilisation over its life (whole GPUs only)",
            self.p95_sm.clone(),
        );
        registry.register(
            "claim_usage_samples",
            "Samples behind a claim's peak and percentiles",
            self.history_samples.clone(),
        );
        registry.register(
            "claim_first_sample_timestamp_seconds",
            "First sample of a claim's history (Unix time)",
            self.first_sample.clone(),
        );
        registry.register(
            "claim_last_sample_timestamp_seconds",
            "Last sample of a claim's history (Unix time)",
            self.last_sample.clone(),
        );
        registry.register("usage_samples", "Usage samples taken", self.samples.clone());
        registry.register(
            "usage_sample_errors",
            "Usage samples that failed (NVML out of reach)",
            self.errors.clone(),
        );
        registry.register(
            "usage_sample_cpu_seconds",
            "CPU time of the last usage sample's NVML and /proc reads",
            self.cpu.clone(),
        );
        registry.register(
            "usage_sample_duration_seconds",
            "Wall time of the last usage sample",
            self.duration.clone(),
        );
    }

    /// Replaces one family's series by `values`, removing those of the last call not set now.
    fn replace(
        &self,
        key: &'static str,
        family: &Family<Labels, Gauge>,
        values: Vec<(Labels, i64)>,
    ) {
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let now: BTreeSet<Labels> = values.iter().map(|(l, _)| l.clone()).collect();
        for stale in published.get(key).into_iter().flatten() {
            if !now.contains(stale) {
                family.remove(stale);
            }
        }
        for (l, v) in values {
            family.get_or_create(&l).set(v);
        }
        published.insert(key, now);
    }

    /// Publishes one sample's figures; `last_active` by (claim UID, device UUID), in Unix
    /// seconds; each claim device's life so far from `history`.
    pub fn publish(
        &self,
        usage: &[ClaimDeviceUsage],
        last_active: &HashMap<(String, String), i64>,
        history: &History,
    ) {
        let (mut info, mut allocated, mut used, mut sm, mut procs, mut util, mut active) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let (mut peak, mut p95, mut peak_sm, mut p95_sm, mut count, mut first, mut last) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        for u in usage {
            let d = &u.device;
            let base = claim_labels(d);
            if let Some(h) = history.get(&d.claim_uid, &d.uuid) {
                peak.push((base.clone(), clamp_i64(h.peak_used_bytes)));
                if let Some(b) = h.memory_p95_bytes() {
                    p95.push((base.clone(), clamp_i64(b)));
                }
                if let Some(s) = h.peak_sm_percent {
                    peak_sm.push((base.clone(), i64::from(s)));
                }
                if let Some(s) = h.sm_p95_percent() {
                    p95_sm.push((base.clone(), i64::from(s)));
                }
                count.push((base.clone(), clamp_i64(h.samples)));
                first.push((base.clone(), h.first_sample));
                last.push((base.clone(), h.last_sample));
            }
            let share = d.share_bytes.map(|b| b.to_string()).unwrap_or_default();
            info.push((
                with(
                    base.clone(),
                    &[
                        ("strategy", &d.strategy),
                        ("mig_profile", &d.mig_profile),
                        ("share", &share),
                    ],
                ),
                1,
            ));
            if let Some(b) = u.allocated_bytes {
                allocated.push((base.clone(), clamp_i64(b)));
            }
            if let Some(p) = u.device_utilization_percent {
                util.push((base.clone(), i64::from(p)));
            }
            if let Some(t) = last_active.get(&(d.claim_uid.clone(), d.uuid.clone())) {
                active.push((base.clone(), *t));
            }
            for p in &u.pods {
                let l = with(
                    base.clone(),
                    &[("pod", &p.pod), ("container", &p.container)],
                );
                if let Some(b) = p.used_bytes {
                    used.push((l.clone(), clamp_i64(b)));
                }
                if let Some(s) = p.sm_percent {
                    sm.push((l.clone(), i64::from(s)));
                }
                procs.push((l, i64::from(p.processes)));
            }
        }
        self.replace("info", &self.info, info);
        self.replace("allocated", &self.allocated, allocated);
        self.replace("used", &self.used, used);
        self.replace("sm", &self.sm, sm);
        self.replace("processes", &self.processes, procs);
        self.replace("device_util", &self.device_util, util);
        self.replace("last_active", &self.last_active, active);
        self.replace("peak_used", &self.peak_used, peak);
        self.replace("p95_used", &self.p95_used, p95);
        self.replace("peak_sm", &self.peak_sm, peak_sm);
        self.replace("p95_sm", &self.p95_sm, p95_sm);
        self.replace("history_samples", &self.history_samples, count);
        self.replace("first_sample", &self.first_sample, first);
        self.replace("last_sample", &self.last_sample, last);
    }
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (nanoseconds, first
/// field); `None` where the kernel does not keep it.
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// What one sample read from the node.
struct Reading {
    samples: Vec<DeviceUsage>,
    owners: HashMap<u32, Owner>,
    cpu: Option<Duration>,
}

/// Reads the devices and the owners of their processes (blocking: NVML and `/proc`).
fn read_node(
    source: &dyn UsageSource,
    uuids: &[String],
    window: Duration,
    proc_root: &Path,
) -> Result<Reading, gpu_dra_device::DeviceError> {
    let started = thread_cpu();
    let samples = source.sample(uuids, window)?;
    let owners = samples
        .iter()
        .flat_map(|s| &s.processes)
        .filter_map(|p| {
            let text =
                std::fs::read_to_string(proc_root.join(p.pid.to_string()).join("cgroup")).ok()?;
            Some((p.pid, owner_from_cgroup(&text)?))
        })
        .collect();
    let cpu = thread_cpu().zip(started).map(|(b, a)| b.saturating_sub(a));
    Ok(Reading {
        samples,
        owners,
        cpu,
    })
}

/// The pods of a claim from its `status.reservedFor`.
fn reserved_pods(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> Vec<PodRef> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| PodRef {
            name: r.name.clone(),
            uid: r.uid.clone(),
        })
        .collect()
}

/// The sampler: the I/O shell around [`attribute`].
pub struct Sampler {
    source: Arc<dyn UsageSource>,
    claims: Arc<dyn ClaimSource>,
    proc_root: PathBuf,
    window: Duration,
    pods: HashMap<String, Vec<PodRef>>,
    /// Per claim UID, the pods a read of that claim did not name although a process of theirs
    /// ran on its device (a pod outside `reservedFor`): not read again for them, so a pod
    /// that is no holder cannot make the sampler read a claim at every sample. Bounded by
    /// [`MAX_STRANGERS`] per claim; gone with the claim.
    strangers: HashMap<String, BTreeSet<String>>,
    last_active: HashMap<(String, String), i64>,
    pod_source: Option<Arc<dyn PodSource>>,
    /// Per pod UID (of the pods in `pods`), container ID -> name from its last read.
    names: HashMap<String, HashMap<String, String>>,
    /// Per pod UID, container IDs a read of the pod did not name (not read again for them);
    /// bounded by [`MAX_STRANGERS`] per pod.
    unnamed: HashMap<String, BTreeSet<String>>,
    history: History,
    history_file: Option<PathBuf>,
    since_write: u64,
}

/// The most pods outside a claim's `reservedFor` remembered per claim; past it, further
/// strangers on its device are not read for at all (the claim's own pods are known already
/// from the reads before).
const MAX_STRANGERS: usize = 256;

impl Sampler {
    /// A sampler reading devices from `source`, claims from `claims`, processes' cgroups
    /// under `proc_root` (`/proc`, the host's with hostPID); per-process utilisation covers
    /// `window` (the interval).
    pub fn new(
        source: Arc<dyn UsageSource>,
        claims: Arc<dyn ClaimSource>,
        proc_root: PathBuf,
        window: Duration,
    ) -> Self {
        Sampler {
            source,
            claims,
            proc_root,
            window,
            pods: HashMap::new(),
            strangers: HashMap::new(),
            last_active: HashMap::new(),
            pod_source: None,
            names: HashMap::new(),
            unnamed: HashMap::new(),
            history: History::default(),
            history_file: None,
            since_write: 0,
        }
    }

    /// Names containers that cgroups name by ID only, from the pods read through `source`
    /// (see [`pods`]).
    pub fn with_pods(mut self, source: Arc<dyn PodSource>) -> Self {
        self.pod_source = Some(source);
        self
    }

    /// Keeps the usage history in `path` (see [`history`]): reads what it holds now (a file
    /// that cannot be read is reported and history starts empty) and writes it every
    /// [`history::WRITE_EVERY`] samples and from [`Sampler::save`].
    pub fn with_history_file(mut self, path: PathBuf) -> Self {
        match std::fs::read(&path) {
            Ok(bytes) => match History::from_bytes(&bytes) {
                Ok(h) => {
                    debug!(path = %path.display(), entries = h.len(), "usage history loaded");
                    self.history = h;
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "usage history not loaded; it starts empty");
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(path = %path.display(), error = %e, "usage history not read; it starts empty");
            }
        }
        self.history_file = Some(path);
        self
    }

    /// The usage history so far.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Writes the usage history to its file now (when one is set); a failure is reported,
    /// and the next write tries again.
    pub async fn save(&mut self) {
        self.since_write = 0;
        let Some(path) = self.history_file.clone() else {
            return;
        };
        let bytes = self.history.to_bytes();
        let written = tokio::task::spawn_blocking(move || {
            gpu_dra_fsutil::replace_atomic(&path, &bytes, 0o600).map_err(|e| (path, e))
        })
        .await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err((path, e))) => {
                warn!(path = %path.display(), error = %e, "cannot write the usage history");
            }
            Err(e) => warn!(error = %e, "cannot write the usage history"),
        }
    }

    /// Takes one sample of the claims in `checkpoint` and publishes it into `metrics`.
    pub async fn sample(
        &mut self,
        checkpoint: &Checkpoint,
        inventory: &Inventory,
        metrics: &UsageMetrics,
    ) -> Vec<ClaimDeviceUsage> {
        let started = Instant::now();
        let devices = claim_devices(checkpoint, inventory);
        let uuids: Vec<String> = devices
            .iter()
            .map(|d| d.uuid.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let reading = if uuids.is_empty() {
            Ok(Reading {
                samples: Vec::new(),
                owners: HashMap::new(),
                cpu: Some(Duration::ZERO),
            })
        } else {
            let (source, proc_root, window) =
                (self.source.clone(), self.proc_root.clone(), self.window);
            tokio::task::spawn_blocking(move || {
                read_node(source.as_ref(), &uuids, window, &proc_root)
            })
            .await
            .unwrap_or_else(|e| {
                Err(gpu_dra_device::DeviceError::Init {
                    path: "usage sampler".into(),
                    reason: e.to_string(),
                })
            })
        };
        metrics.samples.inc();
        let mut reading = match reading {
            Ok(r) => r,
            Err(e) => {
                metrics.errors.inc();
                warn!(error = %e, "usage sample failed; claims keep their last figures");
                return Vec::new();
            }
        };
        self.refresh_pods(&devices, &reading).await;
        self.name_containers(&devices, &mut reading.owners).await;
        let usage = attribute(&devices, &reading.samples, &reading.owners, &self.pods);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| clamp_i64(d.as_secs()));
        let keep: BTreeSet<(String, String)> = usage
            .iter()
            .map(|u| (u.device.claim_uid.clone(), u.device.uuid.clone()))
            .collect();
        self.last_active.retain(|k, _| keep.contains(k));
        for u in &usage {
            let key = (u.device.claim_uid.clone(), u.device.uuid.clone());
            if u.active {
                self.last_active.insert(key, now);
            } else {
                self.last_active.entry(key).or_insert(now);
            }
        }
        self.history.record(&usage, now);
        metrics.publish(&usage, &self.last_active, &self.history);
        self.since_write += 1;
        if self.since_write >= history::WRITE_EVERY {
            self.save().await;
        }
        if let Some(cpu) = reading.cpu {
            metrics.cpu.set(cpu.as_secs_f64());
        }
        metrics.duration.set(started.elapsed().as_secs_f64());
        debug!(
            claims = usage.len(),
            cpu_us = reading.cpu.map_or(0, |c| c.as_micros() as u64),
            "usage sampled"
        );
        usage
    }

    /// Names the containers of `owners` whose cgroup gave an ID only, from their pods'
    /// `containerStatuses`: a pod is read when one of its processes shows a container ID not
    /// seen before (one read per pod and new container, e.g. after a restart), and only pods
    /// that a claim prepared here is reserved for (known from [`Sampler::refresh_pods`]).
    async fn name_containers(&mut self, devices: &[ClaimDevice], owners: &mut HashMap<u32, Owner>) {
        // Pod UID -> (namespace, name) of the pods the prepared claims are reserved for.
        let mut known: HashMap<String, (String, String)> = HashMap::new();
        for d in devices {
            for p in self.pods.get(&d.claim_uid).into_iter().flatten() {
                known.insert(p.uid.clone(), (d.namespace.clone(), p.name.clone()));
            }
        }
        self.names.retain(|uid, _| known.contains_key(uid));
        self.unnamed.retain(|uid, _| known.contains_key(uid));
        if let Some(source) = self.pod_source.clone() {
            let mut to_read: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for o in owners.values() {
                if !o.container.is_empty() || o.container_id.is_empty() {
                    continue;
                }
                let named = self
                    .names
                    .get(&o.pod_uid)
                    .is_some_and(|n| n.contains_key(&o.container_id));
                let tried = self
                    .unnamed
                    .get(&o.pod_uid)
                    .is_some_and(|n| n.contains(&o.container_id) || n.len() >= MAX_STRANGERS);
                if known.contains_key(&o.pod_uid) && !named && !tried {
                    to_read
                        .entry(o.pod_uid.clone())
                        .or_default()
                        .insert(o.container_id.clone());
                }
            }
            for (uid, ids) in to_read {
                let Some((namespace, name)) = known.get(&uid) else {
                    continue;
                };
                let names = match source.get(namespace, name).await {
                    Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(uid.as_str()) => {
                        pods::container_names(&pod)
                    }
                    Ok(_) => HashMap::new(),
                    Err(e) => {
                        debug!(pod = %format!("{namespace}/{name}"), error = %e, "cannot read the pod's containers");
                        continue;
                    }
                };
                let unnamed = self.unnamed.entry(uid.clone()).or_default();
                for id in ids {
                    if !names.contains_key(&id) && unnamed.len() < MAX_STRANGERS {
                        unnamed.insert(id);
                    }
                }
                self.names.insert(uid, names);
            }
        }
        for o in owners.values_mut() {
            if o.container.is_empty()
                && let Some(name) = self
                    .names
                    .get(&o.pod_uid)
                    .and_then(|n| n.get(&o.container_id))
            {
                o.container = name.clone();
            }
        }
    }

    /// Reads `status.reservedFor` of the claims on whose device a process of a pod none of
    /// the claims read so far knows runs; forgets claims no longer prepared. A claim whose
    /// device has no process of a known pod is not read: on a node of idle claims (or of
    /// processes outside pods) sampling sends no request. A pod a read of the claim did not
    /// name is remembered as a stranger to that claim and makes no further read of it: one
    /// read per claim and pod, not one per sample.
    async fn refresh_pods(&mut self, devices: &[ClaimDevice], reading: &Reading) {
        let prepared: BTreeSet<&str> = devices.iter().map(|d| d.claim_uid.as_str()).collect();
        self.pods.retain(|uid, _| prepared.contains(uid.as_str()));
        self.strangers
            .retain(|uid, _| prepared.contains(uid.as_str()));
        let known = |pods: &HashMap<String, Vec<PodRef>>, pod: &str| {
            pods.values().flatten().any(|p| p.uid == pod)
        };
        let mut stale: BTreeMap<&str, (&str, &str, BTreeSet<&str>)> = BTreeMap::new();
        for d in devices {
            let strangers = self.strangers.get(&d.claim_uid);
            let unknown: BTreeSet<&str> = reading
                .samples
                .iter()
                .filter(|s| s.uuid == d.uuid)
                .flat_map(|s| &s.processes)
                .filter_map(|p| reading.owners.get(&p.pid))
                .map(|o| o.pod_uid.as_str())
                .filter(|pod| !known(&self.pods, pod))
                .filter(|pod| {
                    strangers.is_none_or(|s| !s.contains(*pod) && s.len() < MAX_STRANGERS)
                })
                .collect();
            if !unknown.is_empty() {
                stale
                    .entry(&d.claim_uid)
                    .or_insert((&d.namespace, &d.name, BTreeSet::new()))
                    .2
                    .extend(unknown);
            }
        }
        for (uid, (namespace, name, unknown)) in stale {
            let pods = match self.claims.get(namespace, name).await {
                Ok(Some(claim)) if claim.metadata.uid.as_deref() == Some(uid) => {
                    reserved_pods(&claim)
                }
                Ok(_) => Vec::new(),
                Err(e) => {
                    debug!(claim = %format!("{namespace}/{name}"), error = %e, "cannot read the claim's pods");
                    continue;
                }
            };
            let strangers = self.strangers.entry(uid.to_owned()).or_default();
            for pod in unknown {
                if !pods.iter().any(|p| p.uid == pod) && strangers.len() < MAX_STRANGERS {
                    strangers.insert(pod.to_owned());
                }
            }
            self.pods.insert(uid.to_owned(), pods);
        }
    }
}

/// Samples every `every` until `stop` fires: the claims of `checkpoint()` on the devices of
/// `inventory()`.
pub async fn run(
    mut sampler: Sampler,
    every: Duration,
    checkpoint: impl Fn() -> Checkpoint + Send,
    inventory: impl Fn() -> Arc<Inventory> + Send,
    metrics: Arc<crate::metrics::Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopped = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        if stopped {
            sampler.save().await;
            return;
        }
        let cp = checkpoint();
        let inv = inventory();
        sampler.sample(&cp, &inv, &metrics.usage).await;
    }
}

#[cfg(test)]
mod tests;
