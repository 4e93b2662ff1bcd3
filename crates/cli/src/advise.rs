//! `gpu-dra advise`: for each claim, the smallest offering on its GPU model that fits what the
//! claim was seen to use plus a margin, and what the cluster would need if every advice were
//! applied. The idea is the Vertical Pod Autoscaler recommender's (a percentile of observed
//! use plus a safety margin, per workload), applied to GPU shapes.
//!
//! Evidence: the node plugins' per-claim history (`gpu_dra_claim_memory_used_peak_bytes`,
//! `..._p95_bytes`, `gpu_dra_claim_sm_utilization_p95_percent`, `gpu_dra_claim_usage_samples`,
//! `gpu_dra_claim_{first,last}_sample_timestamp_seconds`), read as `gpu-dra usage` reads the
//! metrics, joined to the holders `gpu-dra usage` builds from slices and claims.
//!
//! The decision ([`decide`], pure): memory needed is the observed peak plus the margin (never
//! the percentile: a claim that ran out of memory once would again), compute needed is the
//! SM p95 plus the margin. Refused (too little history) below `--min-samples` or
//! `--min-history`; kept whole for a multi-GPU claim (splitting it changes how its GPUs talk),
//! an SM p95 at or above `--sm-threshold`, or a need no offering meets. Otherwise the first of
//! `--offerings` that fits, in that order: a MIG profile (the model's real table,
//! [`gpu_dra_device::mig_tables`]; hardware isolation), a memory share (consumable capacity,
//! enforced by MPS, threads in proportion to memory), an MPS share with its own active-thread
//! percentage (compute above its memory's proportion), time-slicing (the GPU's memory packed
//! by the scheduler but not enforced). Sizes: shares round the memory up to a GiB.
//!
//! The fleet ([`pack`], pure): per node and GPU model, whole GPUs one each; MIG devices placed
//! at the model's placement starts on the fewest GPUs; shares first-fit decreasing by memory
//! with their compute summing to at most 100 %. MIG and shares never mix on one GPU (shares
//! need MIG off). GPU-hours per month = GPUs freed x 730.
//!
//! `-o yaml` prints the ResourceClaimTemplate each claim came from (its
//! `resource.kubernetes.io/pod-claim-name` annotation, its owning pod's
//! `spec.resourceClaims[].resourceClaimTemplateName`) with the advised request and config; a
//! claim made without a template is printed itself. A template serves every claim made from
//! it, so it gets the largest of their advice ([`merge`]); it is left as it is (and a comment
//! says why) when one of them keeps its GPU, has no advice, or was advised another kind of
//! offering. The spec of a template (and of a claim) is immutable, so `kubectl apply` of a
//! changed one is refused: the output opens with a comment naming `kubectl replace --force`
//! (delete and create), after which the workloads' pods are recreated to get new claims.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

use clap::{Args, ValueEnum};
use gpu_dra_device::mig_tables::{self, GiProfile};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde::Serialize;
use serde_json::{Value, json};

use crate::usage::{GpuUsage, parse_duration};
use crate::{CliError, Outcome};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// Hours in an average month (8766 / 12).
const HOURS_PER_MONTH: f64 = 730.5;

/// Output of `gpu-dra advise`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AdviseFormat {
    /// For people: one line per claim (what it holds, the advice, the evidence or the
    /// reason), then the fleet summary.
    Text,
    /// The advice per claim and the fleet summary as one JSON object, for tools.
    Json,
    /// The ResourceClaimTemplates (or claims made without one) changed to apply the advice,
    /// for `kubectl replace --force -f` (their spec is immutable: `kubectl apply` is refused);
    /// comments name what was left unchanged and why.
    Yaml,
}

/// An offering advice may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum OfferingKind {
    /// A MIG device of the model's profile table.
    Mig,
    /// A memory share (consumable capacity), threads in proportion to its memory.
    Share,
    /// A memory share with its own MPS active-thread percentage.
    Mps,
    /// A memory share under time-slicing (memory not enforced).
    Timeslicing,
}

/// `gpu-dra advise` arguments.
#[derive(Debug, Args)]
pub struct AdviseArgs {
    /// Only this claim (`NAMESPACE/NAME`).
    #[arg(value_name = "NAMESPACE/NAME")]
    pub claim: Option<String>,
    /// Only claims of this namespace.
    #[arg(short, long, env = "ADVISE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Only this node.
    #[arg(long, env = "NODE_NAME")]
    pub node: Option<String>,
    /// Driver whose devices are advised on.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(short, long, env = "OUTPUT_FORMAT", value_enum, default_value_t = AdviseFormat::Text)]
    pub output: AdviseFormat,
    /// Safety margin over the observed peak memory and SM p95, in percent.
    #[arg(long, env = "ADVISE_MARGIN", default_value_t = 20, value_parser = clap::value_parser!(u32).range(0..=400))]
    pub margin: u32,
    /// Keep the whole GPU when the SM p95 is at or above this percentage.
    #[arg(long, env = "ADVISE_SM_THRESHOLD", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub sm_threshold: u32,
    /// Refuse to advise on fewer samples than this.
    #[arg(long, env = "ADVISE_MIN_SAMPLES", default_value_t = 100)]
    pub min_samples: u64,
    /// Refuse to advise on less history than this (`90s`, `30m`, `1h`, `2d`).
    #[arg(long, env = "ADVISE_MIN_HISTORY", default_value = "1h", value_parser = parse_duration)]
    pub min_history: u64,
    /// Offerings the cluster runs, in the order of preference (comma-separated).
    #[arg(
        long,
        env = "ADVISE_OFFERINGS",
        value_enum,
        value_delimiter = ',',
        default_value = "mig,share,mps,timeslicing"
    )]
    pub offerings: Vec<OfferingKind>,
    /// Advise only offerings the cluster publishes for the GPU's model (MIG devices of that
    /// model, or GPUs of that model allowing multiple allocations for shares, MPS and
    /// time-slicing); `--offered-only=false` also advises those that need GPUs set up first.
    #[arg(
        long,
        env = "ADVISE_OFFERED_ONLY",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub offered_only: bool,
    /// DeviceClass of MIG devices in the printed templates.
    #[arg(
        long,
        env = "ADVISE_MIG_DEVICE_CLASS",
        default_value = "mig.nvidia.com"
    )]
    pub mig_device_class: String,
    /// Where the plugins' metrics are read (as for `gpu-dra usage`).
    #[command(flatten)]
    pub metrics: crate::usage::MetricsSource,
}

/// What the decision needs to know about the GPU model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuModel {
    /// NVML product name (`productName`), empty when not published.
    pub product: String,
    /// Memory of the whole GPU, in bytes.
    pub memory_bytes: u64,
    /// Its MIG profile table, when the model has MIG.
    pub mig: Option<&'static [GiProfile]>,
    /// The offering kinds the cluster publishes for this model (MIG: some GPU of the model
    /// offers MIG devices; shares, MPS and time-slicing shares: some GPU of the model allows
    /// multiple allocations); `None`: not known, every kind considered.
    pub offered: Option<BTreeSet<OfferingKind>>,
}

impl GpuModel {
    fn offers(&self, kind: OfferingKind) -> bool {
        self.offered.as_ref().is_none_or(|o| o.contains(&kind))
    }
}

/// What a GPU must be set up for before a claim can get `kind` (for the reason when the
/// cluster offers none).
fn setup_needed(kind: OfferingKind) -> &'static str {
    match kind {
        OfferingKind::Mig => "GPUs of this model in MIG mode (static or dynamic MIG)",
        OfferingKind::Share | OfferingKind::Mps | OfferingKind::Timeslicing => {
            "GPUs of this model offered as memory shares or consumable shares"
        }
    }
}

/// What a claim was seen to use on one device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Evidence {
    /// Most memory used at one sample.
    pub peak_used_bytes: u64,
    /// p95 of memory used.
    pub p95_used_bytes: Option<u64>,
    /// p95 of SM utilisation (`None`: the driver exposes none there, e.g. MIG).
    pub sm_p95_percent: Option<u32>,
    /// Samples.
    pub samples: u64,
    /// Seconds between the first and the last sample.
    pub covered_seconds: u64,
}

/// What a claim holds now, in the terms packing needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "kind"
)]
pub enum Holding {
    /// A whole GPU.
    Gpu,
    /// A MIG device of this profile.
    Mig {
        /// Profile name.
        profile: String,
    },
    /// A memory share of this size.
    Share {
        /// Bytes.
        bytes: u64,
    },
}

/// The advice for one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "kind"
)]
pub enum Offering {
    /// A MIG device.
    Mig {
        /// Profile name (`1g.10gb`).
        profile: String,
        /// Its memory.
        memory_bytes: u64,
        /// Its compute slices (of 7).
        compute_slices: u32,
    },
    /// A memory share, threads in proportion.
    Share {
        /// Memory requested.
        memory_bytes: u64,
    },
    /// A memory share with an MPS active-thread percentage.
    Mps {
        /// Memory requested (and the pinned memory limit).
        memory_bytes: u64,
        /// `defaultActiveThreadPercentage`.
        active_thread_percentage: u32,
    },
    /// A memory share under time-slicing.
    TimeSlicing {
        /// Memory requested (packing only: not enforced).
        memory_bytes: u64,
    },
    /// Keep the whole GPU.
    Keep {
        /// Why.
        reason: String,
    },
    /// No advice.
    Refused {
        /// Why.
        reason: String,
    },
}

impl Offering {
    /// The memory it grants, where it is a size.
    pub fn memory_bytes(&self) -> Option<u64> {
        match self {
            Offering::Mig { memory_bytes, .. }
            | Offering::Share { memory_bytes }
            | Offering::Mps { memory_bytes, .. }
            | Offering::TimeSlicing { memory_bytes } => Some(*memory_bytes),
            Offering::Keep { .. } | Offering::Refused { .. } => None,
        }
    }

    /// Whether applying it changes the claim.
    pub fn changes(&self) -> bool {
        self.memory_bytes().is_some()
    }
}

/// The thresholds of the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Margin in percent.
    pub margin: u32,
    /// SM p95 from which the whole GPU is kept.
    pub sm_threshold: u32,
    /// Fewest samples.
    pub min_samples: u64,
    /// Least history, in seconds.
    pub min_history: u64,
    /// Offerings in order of preference.
    pub offerings: Vec<OfferingKind>,
}

/// Memory that must fit: the peak plus the margin, rounded up.
pub fn memory_needed(peak: u64, margin: u32) -> u64 {
    let extra = (u128::from(peak) * u128::from(margin)).div_ceil(100);
    u64::try_from(u128::from(peak) + extra).unwrap_or(u64::MAX)
}

fn human(b: u64) -> String {
    if b >= GIB {
        format!("{:.1}Gi", b as f64 / GIB as f64)
    } else {
        format!("{}Mi", b.div_ceil(MIB))
    }
}

/// The advice for a claim holding `holding` on one GPU of `model` (`devices`: how many
/// devices the claim holds), from `evidence` (`None`: no history). Pure.
pub fn decide(
    evidence: Option<&Evidence>,
    model: &GpuModel,
    holding: &Holding,
    devices: usize,
    opts: &Options,
) -> Offering {
    if devices > 1 {
        return Offering::Keep {
            reason: format!(
                "multi-GPU claim ({devices} devices): its GPUs work together (NVLink, collectives); not split"
            ),
        };
    }
    let Some(e) = evidence else {
        return Offering::Refused {
            reason: "no usage history (the node plugin reports none for it)".into(),
        };
    };
    if e.samples < opts.min_samples {
        return Offering::Refused {
            reason: format!(
                "too little history: {} samples, --min-samples is {}",
                e.samples, opts.min_samples
            ),
        };
    }
    if e.covered_seconds < opts.min_history {
        return Offering::Refused {
            reason: format!(
                "too little history: {}s covered, --min-history is {}s",
                e.covered_seconds, opts.min_history
            ),
        };
    }
    let need_mem = memory_needed(e.peak_used_bytes, opts.margin);
    // Compute needed in percent of the GPU: the SM p95 plus the margin; where the driver gives
    // no SM figure (MIG), what the claim holds now.
    let need_sm: u32 = match (e.sm_p95_percent, holding) {
        (Some(sm), _) => {
            if sm >= opts.sm_threshold {
                return Offering::Keep {
                    reason: format!(
                        "SM p95 {sm}% is at or above the threshold {}%",
                        opts.sm_threshold
                    ),
                };
            }
            (sm * (100 + opts.margin)).div_ceil(100).clamp(1, 100)
        }
        (None, Holding::Mig { profile }) => model
            .mig
            .and_then(|t| t.iter().find(|p| p.name == profile))
            .map_or(100, |p| p.slice_count * 100 / 7),
        (None, Holding::Share { bytes }) if model.memory_bytes > 0 => {
            u32::try_from((u128::from(*bytes) * 100).div_ceil(u128::from(model.memory_bytes)))
                .unwrap_or(100)
                .min(100)
        }
        (None, _) => 100,
    };
    if need_mem >= model.memory_bytes {
        return Offering::Keep {
            reason: format!(
                "peak {} + {}% margin needs {} of the GPU's {}",
                human(e.peak_used_bytes),
                opts.margin,
                human(need_mem),
                human(model.memory_bytes)
            ),
        };
    }
    let share = need_mem.div_ceil(GIB).max(1) * GIB;
    let proportion = |bytes: u64| (u128::from(bytes) * 100 / u128::from(model.memory_bytes)) as u32;
    let mut not_offered: Vec<OfferingKind> = Vec::new();
    for kind in &opts.offerings {
        if !model.offers(*kind) {
            not_offered.push(*kind);
            continue;
        }
        match kind {
            OfferingKind::Mig => {
                let Some(table) = model.mig else { continue };
                let mut fits: Vec<&GiProfile> = table
                    .iter()
                    .filter(|p| !p.name.contains('+'))
                    .filter(|p| p.slice_count < 7)
                    .filter(|p| p.memory_mib * MIB >= need_mem)
                    .filter(|p| p.slice_count * 100 >= need_sm * 7)
                    .collect();
                fits.sort_by_key(|p| (p.placement_size, p.slice_count, p.memory_mib));
                if let Some(p) = fits.first() {
                    return Offering::Mig {
                        profile: p.name.to_owned(),
                        memory_bytes: p.memory_mib * MIB,
                        compute_slices: p.slice_count,
                    };
                }
            }
            OfferingKind::Share if share < model.memory_bytes && proportion(share) >= need_sm => {
                return Offering::Share {
                    memory_bytes: share,
                };
            }
            OfferingKind::Mps if share < model.memory_bytes && need_sm < 100 => {
                return Offering::Mps {
                    memory_bytes: share,
                    active_thread_percentage: need_sm.max(proportion(share)),
                };
            }
            OfferingKind::Timeslicing if share < model.memory_bytes => {
                return Offering::TimeSlicing {
                    memory_bytes: share,
                };
            }
            _ => {}
        }
    }
    let offered: Vec<OfferingKind> = opts
        .offerings
        .iter()
        .copied()
        .filter(|k| !not_offered.contains(k))
        .collect();
    let mut reason = format!(
        "no offering of {offered:?} fits {} and {}% SM on {}",
        human(need_mem),
        need_sm,
        if model.product.is_empty() {
            "this GPU"
        } else {
            &model.product
        }
    );
    if !not_offered.is_empty() {
        let mut needs: Vec<&str> = not_offered.iter().map(|k| setup_needed(*k)).collect();
        needs.dedup();
        reason.push_str(&format!(
            "; the cluster does not offer {not_offered:?} on this model (needs {}; --offered-only=false advises them anyway)",
            needs.join("; ")
        ));
    }
    Offering::Keep { reason }
}

/// What one claim needs of a GPU once advice is applied, for packing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    /// A whole GPU.
    Whole,
    /// A MIG device: its placement (memory slices) and compute slices.
    Mig {
        /// Placement size, in memory slices of 8.
        size: u32,
        /// Valid placement starts.
        starts: Vec<u32>,
        /// Compute slices, of 7.
        compute: u32,
    },
    /// A share of memory and compute.
    Share {
        /// Bytes.
        bytes: u64,
        /// Compute, in percent.
        sm: u32,
    },
}

/// The fewest GPUs of `memory_bytes` each that hold `needs` (see the module documentation).
/// Pure.
pub fn pack(needs: &[Need], memory_bytes: u64) -> usize {
    let whole = needs.iter().filter(|n| matches!(n, Need::Whole)).count();
    // MIG: largest first, each at the first free valid start of the first GPU it fits.
    let mut migs: Vec<(u32, &[u32], u32)> = needs
        .iter()
        .filter_map(|n| match n {
            Need::Mig {
                size,
                starts,
                compute,
            } => Some((*size, starts.as_slice(), *compute)),
            _ => None,
        })
        .collect();
    migs.sort_by(|a, b| b.0.cmp(&a.0).then(b.2.cmp(&a.2)));
    let mut mig_gpus: Vec<(u8, u32)> = Vec::new();
    for (size, starts, compute) in migs {
        let mask_at = |s: u32| -> Option<u8> {
            (s + size <= mig_tables::MEMORY_SLICES).then(|| (((1u16 << size) - 1) << s) as u8)
        };
        let placed = mig_gpus.iter_mut().any(|(used, cpu)| {
            if *cpu + compute > 7 {
                return false;
            }
            for s in starts {
                if let Some(m) = mask_at(*s)
                    && *used & m == 0
                {
                    *used |= m;
                    *cpu += compute;
                    return true;
                }
            }
            false
        });
        if !placed {
            let m = starts.iter().find_map(|s| mask_at(*s)).unwrap_or(0xff);
            mig_gpus.push((m, compute));
        }
    }
    // Shares: first fit, largest first.
    let mut shares: Vec<(u64, u32)> = needs
        .iter()
        .filter_map(|n| match n {
            Need::Share { bytes, sm } => Some((*bytes, *sm)),
            _ => None,
        })
        .collect();
    shares.sort_by(|a, b| b.cmp(a));
    let mut share_gpus: Vec<(u64, u32)> = Vec::new();
    for (bytes, sm) in shares {
        match share_gpus
            .iter_mut()
            .find(|(m, s)| *m + bytes <= memory_bytes && *s + sm <= 100)
        {
            Some(g) => {
                g.0 += bytes;
                g.1 += sm;
            }
            None => share_gpus.push((bytes, sm)),
        }
    }
    whole + mig_gpus.len() + share_gpus.len()
}

/// What `offering` (or, when it changes nothing, `holding`) needs of a GPU of `model`;
/// `sm` the claim's compute need in percent where a share does not say.
pub fn need_of(offering: &Offering, holding: &Holding, model: &GpuModel, sm: u32) -> Need {
    let mig = |profile: &str| {
        model
            .mig
            .and_then(|t| t.iter().find(|p| p.name == profile))
            .map_or(Need::Whole, |p| Need::Mig {
                size: p.placement_size,
                starts: p.placement_starts.to_vec(),
                compute: p.slice_count,
            })
    };
    match offering {
        Offering::Mig { profile, .. } => mig(profile),
        Offering::Share { memory_bytes } | Offering::TimeSlicing { memory_bytes } => Need::Share {
            bytes: *memory_bytes,
            sm: sm.min(100),
        },
        Offering::Mps {
            memory_bytes,
            active_thread_percentage,
        } => Need::Share {
            bytes: *memory_bytes,
            sm: sm.min(*active_thread_percentage),
        },
        Offering::Keep { .. } | Offering::Refused { .. } => match holding {
            Holding::Gpu => Need::Whole,
            Holding::Mig { profile } => mig(profile),
            Holding::Share { bytes } => Need::Share {
                bytes: *bytes,
                sm: sm.min(100),
            },
        },
    }
}

/// The advice for one claim, with what it is based on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimAdvice {
    /// `namespace/name`.
    pub claim: String,
    /// Node.
    pub node: String,
    /// Device allocated.
    pub device: String,
    /// The request that got it.
    pub request: String,
    /// GPU model.
    pub model: String,
    /// What it holds now.
    pub holding: Holding,
    /// What it was seen to use.
    pub evidence: Option<Evidence>,
    /// The advice.
    pub advice: Offering,
}

/// The fleet in a few numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Fleet {
    /// GPUs the advised claims hold now.
    pub gpus_held: usize,
    /// GPUs they would need with every advice applied.
    pub gpus_needed: usize,
    /// GPU-hours per month freed.
    pub gpu_hours_per_month_freed: f64,
}

/// The whole report (`-o json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Per claim device.
    pub claims: Vec<ClaimAdvice>,
    /// The fleet.
    pub fleet: Fleet,
    /// Metrics endpoints that could not be read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub metrics_errors: Vec<String>,
}

fn attr<'a>(d: &'a k8s_openapi::api::resource::v1::Device, name: &str) -> Option<&'a str> {
    d.attributes
        .as_ref()?
        .get(name)
        .and_then(|a| a.string.as_deref())
}

/// GPU models by (pool, GPU UUID), from the slices.
pub fn models(slices: &[ResourceSlice], driver: &str) -> BTreeMap<(String, String), GpuModel> {
    // What the cluster offers per product: MIG devices (static or dynamic placements), and
    // GPUs several claims may hold (memory or consumable shares).
    let mut offered: BTreeMap<String, BTreeSet<OfferingKind>> = BTreeMap::new();
    for d in slices
        .iter()
        .filter(|s| s.spec.driver == driver)
        .flat_map(|s| s.spec.devices.iter().flatten())
    {
        let product = attr(d, "productName").unwrap_or_default().to_owned();
        let kinds = offered.entry(product).or_default();
        match attr(d, "type") {
            Some("mig") => {
                kinds.insert(OfferingKind::Mig);
            }
            Some("gpu") if d.allow_multiple_allocations == Some(true) => {
                kinds.extend([
                    OfferingKind::Share,
                    OfferingKind::Mps,
                    OfferingKind::Timeslicing,
                ]);
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    for s in slices.iter().filter(|s| s.spec.driver == driver) {
        for d in s.spec.devices.iter().flatten() {
            if attr(d, "type") != Some("gpu") {
                continue;
            }
            let Some(uuid) = attr(d, "uuid") else {
                continue;
            };
            let product = attr(d, "productName").unwrap_or_default().to_owned();
            let memory_bytes = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|q| gpu_dra_api::quantity::Quantity::parse(&q.value.0).ok())
                .and_then(|q| q.to_bytes_ceil().ok())
                .unwrap_or(0);
            out.insert(
                (s.spec.pool.name.clone(), uuid.to_owned()),
                GpuModel {
                    mig: mig_tables::table_for_product(&product),
                    offered: Some(offered.get(&product).cloned().unwrap_or_default()),
                    product,
                    memory_bytes,
                },
            );
        }
    }
    out
}

/// The history series of the plugins by (pool, device, `namespace/claim`).
pub fn evidence(
    samples: &[crate::metrics_text::Sample],
) -> BTreeMap<(String, String, String), Evidence> {
    let mut out: BTreeMap<_, Evidence> = BTreeMap::new();
    let mut times: BTreeMap<(String, String, String), (u64, u64)> = BTreeMap::new();
    for s in samples {
        let key = (
            s.label("pool").to_owned(),
            s.label("device").to_owned(),
            format!("{}/{}", s.label("claim_namespace"), s.label("claim")),
        );
        let v = (s.value.is_finite() && s.value >= 0.0).then_some(s.value as u64);
        let Some(v) = v else { continue };
        match s.name.as_str() {
            "gpu_dra_claim_memory_used_peak_bytes" => {
                out.entry(key).or_default().peak_used_bytes = v;
            }
            "gpu_dra_claim_memory_used_p95_bytes" => {
                out.entry(key).or_default().p95_used_bytes = Some(v);
            }
            "gpu_dra_claim_sm_utilization_p95_percent" => {
                out.entry(key).or_default().sm_p95_percent = u32::try_from(v).ok();
            }
            "gpu_dra_claim_usage_samples" => out.entry(key).or_default().samples = v,
            "gpu_dra_claim_first_sample_timestamp_seconds" => times.entry(key).or_default().0 = v,
            "gpu_dra_claim_last_sample_timestamp_seconds" => times.entry(key).or_default().1 = v,
            _ => {}
        }
    }
    for (key, (first, last)) in times {
        if let Some(e) = out.get_mut(&key) {
            e.covered_seconds = last.saturating_sub(first);
        }
    }
    out
}

/// The advice for every claim of `rows` (selected by `keep`), and the fleet. Pure.
pub fn advise(
    rows: &[GpuUsage],
    models: &BTreeMap<(String, String), GpuModel>,
    evidence: &BTreeMap<(String, String, String), Evidence>,
    requests: &BTreeMap<(String, String, String), String>,
    opts: &Options,
    keep: &dyn Fn(&str, &str) -> bool,
) -> (Vec<ClaimAdvice>, Fleet) {
    let mut devices_per_claim: BTreeMap<&str, usize> = BTreeMap::new();
    for h in rows
        .iter()
        .flat_map(|g| &g.holders)
        .filter(|h| !h.admin_access)
    {
        *devices_per_claim.entry(h.claim.as_str()).or_default() += 1;
    }
    let unknown = GpuModel {
        product: String::new(),
        memory_bytes: 0,
        mig: None,
        offered: None,
    };
    let mut out = Vec::new();
    let mut held: BTreeSet<(String, String)> = BTreeSet::new();
    let mut needs: BTreeMap<(String, String, u64), Vec<Need>> = BTreeMap::new();
    for g in rows {
        let model = models
            .get(&(g.node.clone(), g.uuid.clone()))
            .unwrap_or(&unknown);
        for h in g
            .holders
            .iter()
            .filter(|h| !h.admin_access && keep(&h.claim, &g.node))
        {
            held.insert((g.node.clone(), g.uuid.clone()));
            let holding = match h.kind.as_str() {
                "mig" => Holding::Mig {
                    profile: h.detail.clone(),
                },
                "share" => Holding::Share {
                    bytes: h
                        .usage
                        .as_ref()
                        .and_then(|u| u.memory_allocated_bytes)
                        .unwrap_or(model.memory_bytes),
                },
                _ => Holding::Gpu,
            };
            let key = (g.node.clone(), h.device.clone(), h.claim.clone());
            let ev = evidence.get(&key);
            let advice = decide(
                ev,
                model,
                &holding,
                devices_per_claim
                    .get(h.claim.as_str())
                    .copied()
                    .unwrap_or(1),
                opts,
            );
            let sm = ev
                .and_then(|e| e.sm_p95_percent)
                .map_or(100, |s| (s * (100 + opts.margin)).div_ceil(100));
            needs
                .entry((g.node.clone(), model.product.clone(), model.memory_bytes))
                .or_default()
                .push(need_of(&advice, &holding, model, sm));
            out.push(ClaimAdvice {
                claim: h.claim.clone(),
                node: g.node.clone(),
                device: h.device.clone(),
                request: requests.get(&key).cloned().unwrap_or_default(),
                model: model.product.clone(),
                holding,
                evidence: ev.cloned(),
                advice,
            });
        }
    }
    let needed: usize = needs
        .iter()
        .map(|((_, _, memory), n)| pack(n, *memory))
        .sum();
    let freed = held.len() as f64 - needed as f64;
    (
        out,
        Fleet {
            gpus_held: held.len(),
            gpus_needed: needed,
            gpu_hours_per_month_freed: (freed * HOURS_PER_MONTH * 10.0).round() / 10.0,
        },
    )
}

fn seconds(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

/// An offering, as people read it.
pub fn offering_text(o: &Offering) -> String {
    match o {
        Offering::Mig { profile, .. } => format!("MIG {profile}"),
        Offering::Share { memory_bytes } => format!("memory share {}", human(*memory_bytes)),
        Offering::Mps {
            memory_bytes,
            active_thread_percentage,
        } => format!(
            "MPS {} pinned, {active_thread_percentage}% threads",
            human(*memory_bytes)
        ),
        Offering::TimeSlicing { memory_bytes } => {
            format!("time-slicing, {} (not enforced)", human(*memory_bytes))
        }
        Offering::Keep { reason } => format!("keep: {reason}"),
        Offering::Refused { reason } => format!("no advice: {reason}"),
    }
}

/// One line of advice, as people read it.
pub fn advice_text(a: &ClaimAdvice, margin: u32) -> String {
    let holds = match &a.holding {
        Holding::Gpu => "whole GPU".to_owned(),
        Holding::Mig { profile } => format!("MIG {profile}"),
        Holding::Share { bytes } => format!("memory {}", human(*bytes)),
    };
    let advice = offering_text(&a.advice);
    let evidence = a.evidence.as_ref().map_or_else(String::new, |e| {
        format!(
            " [peak {} (+{margin}%), p95 {}, SM p95 {}, {} samples over {}]",
            human(e.peak_used_bytes),
            e.p95_used_bytes.map_or("-".into(), human),
            e.sm_p95_percent.map_or("-".into(), |s| format!("{s}%")),
            e.samples,
            seconds(e.covered_seconds)
        )
    });
    format!(
        "{}  {}/{}  {}  holds {holds} -> {advice}{evidence}",
        a.claim,
        a.node,
        a.device,
        if a.model.is_empty() { "-" } else { &a.model }
    )
}

/// The fleet line.
pub fn fleet_text(f: &Fleet) -> String {
    format!(
        "fleet: {} GPUs held, {} needed with this advice; {:.1} GPU-hours per month freed\n",
        f.gpus_held, f.gpus_needed, f.gpu_hours_per_month_freed
    )
}

/// The device request of a claim spec (`spec` of a claim, `spec.spec` of a template) that
/// `request` names, changed to apply `offering`; its driver configs for that request replaced
/// by the advised one. `None` when no request of that name exists. Pure.
pub fn apply(
    spec: &Value,
    request: &str,
    offering: &Offering,
    mig_class: &str,
    driver: &str,
) -> Option<Value> {
    let mut spec = spec.clone();
    let requests = spec.pointer_mut("/devices/requests")?.as_array_mut()?;
    let req = requests
        .iter_mut()
        .find(|r| r.get("name").and_then(Value::as_str) == Some(request))?;
    let exactly = req.get_mut("exactly")?.as_object_mut()?;
    exactly.remove("capacity");
    let mut config = None;
    match offering {
        Offering::Mig { profile, .. } => {
            exactly.insert("deviceClassName".into(), json!(mig_class));
            exactly.insert(
                "selectors".into(),
                json!([{"cel": {"expression": format!("device.attributes['{driver}'].profile == '{profile}'")}}]),
            );
        }
        Offering::Share { memory_bytes }
        | Offering::Mps { memory_bytes, .. }
        | Offering::TimeSlicing { memory_bytes } => {
            exactly.insert(
                "capacity".into(),
                json!({"requests": {"memory": format!("{}Gi", memory_bytes / GIB)}}),
            );
            let sharing = match offering {
                Offering::Mps {
                    active_thread_percentage,
                    ..
                } => json!({"strategy": "MPS", "mpsConfig": {
                    "defaultActiveThreadPercentage": active_thread_percentage,
                    "defaultPinnedDeviceMemoryLimit": format!("{}Gi", memory_bytes / GIB)}}),
                Offering::TimeSlicing { .. } => json!({"strategy": "TimeSlicing"}),
                _ => json!({"strategy": "MPS", "mpsConfig": {
                    "defaultPinnedDeviceMemoryLimit": format!("{}Gi", memory_bytes / GIB)}}),
            };
            config = Some(
                json!({"requests": [request], "opaque": {"driver": driver, "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}}}),
            );
        }
        Offering::Keep { .. } | Offering::Refused { .. } => return None,
    }
    let devices = spec.pointer_mut("/devices")?.as_object_mut()?;
    let configs = devices
        .entry("config")
        .or_insert_with(|| json!([]))
        .as_array_mut()?;
    // A config of this driver for only this request is replaced; others stay.
    configs.retain(|c| {
        let only_this = c
            .get("requests")
            .and_then(Value::as_array)
            .is_some_and(|r| r.len() == 1 && r[0].as_str() == Some(request));
        let ours = c.pointer("/opaque/driver").and_then(Value::as_str) == Some(driver);
        !(only_this && ours)
    });
    if let Some(c) = config {
        configs.push(c);
    }
    if configs.is_empty() {
        devices.remove("config");
    }
    Some(spec)
}

/// Runs `gpu-dra advise`.
pub fn run(args: &AdviseArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime.block_on(run_async(args, out))
}

async fn run_async(args: &AdviseArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let client = crate::explain::cluster_client().await?;
    let (slices, claims) = crate::explain::slices_and_claims(&client).await?;
    let metrics = crate::usage::read_metrics(&client, &args.metrics, args.node.as_deref()).await;
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    for m in metrics {
        match m {
            Ok(text) => samples.extend(crate::metrics_text::parse(&text, "gpu_dra_claim_")),
            Err(e) => errors.push(e),
        }
    }
    let mut rows = crate::usage::usage(&slices, &claims, &args.driver_name, args.node.as_deref());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    crate::usage::with_metrics(&mut rows, &samples, now, u64::MAX);
    let requests = request_names(&claims, &args.driver_name);
    let opts = Options {
        margin: args.margin,
        sm_threshold: args.sm_threshold,
        min_samples: args.min_samples,
        min_history: args.min_history,
        offerings: args.offerings.clone(),
    };
    let keep = |claim: &str, _node: &str| {
        args.claim.as_deref().is_none_or(|c| c == claim)
            && args
                .namespace
                .as_deref()
                .is_none_or(|ns| claim.split_once('/').is_some_and(|(n, _)| n == ns))
    };
    let (advice, fleet) = advise(
        &rows,
        &models(&slices, &args.driver_name)
            .into_iter()
            .map(|(k, mut m)| {
                if !args.offered_only {
                    m.offered = None;
                }
                (k, m)
            })
            .collect(),
        &evidence(&samples),
        &requests,
        &opts,
        &keep,
    );
    if let Some(c) = &args.claim
        && advice.is_empty()
    {
        writeln!(
            out,
            "gpu-dra: claim {c} holds no device of driver {} (or is not allocated)",
            args.driver_name
        )?;
        return Ok(Outcome::Usage);
    }
    match args.output {
        AdviseFormat::Text => {
            for a in &advice {
                writeln!(out, "{}", advice_text(a, args.margin))?;
            }
            write!(out, "{}", fleet_text(&fleet))?;
            for e in &errors {
                writeln!(out, "metrics not read: {e}")?;
            }
        }
        AdviseFormat::Json => {
            serde_json::to_writer_pretty(
                &mut *out,
                &Report {
                    claims: advice,
                    fleet,
                    metrics_errors: errors,
                },
            )?;
            writeln!(out)?;
        }
        AdviseFormat::Yaml => {
            let (docs, notes) = templates(&client, &claims, &advice, args).await?;
            write!(out, "{}", yaml_output(&docs, &notes)?)?;
        }
    }
    Ok(Outcome::Valid)
}

/// The request each (pool, device, claim) was allocated for.
fn request_names(
    claims: &[ResourceClaim],
    driver: &str,
) -> BTreeMap<(String, String, String), String> {
    let mut out = BTreeMap::new();
    for c in claims {
        let name = format!(
            "{}/{}",
            c.metadata.namespace.as_deref().unwrap_or_default(),
            c.metadata.name.as_deref().unwrap_or_default()
        );
        let results = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        for r in results.into_iter().flatten().filter(|r| r.driver == driver) {
            out.insert(
                (r.pool.clone(), r.device.clone(), name.clone()),
                r.request.clone(),
            );
        }
    }
    out
}

/// The advice a template (or a claim made without one) gets from the claims made from it,
/// for one request: the largest of theirs, so that none gets less than its own peak plus the
/// margin. `Err` says why it is left unchanged: a claim keeps its GPU or has no advice (the
/// template serves it too), or the claims were advised different kinds of offering. Pure.
pub fn merge(advice: &[&ClaimAdvice]) -> Result<Offering, String> {
    let Some(first) = advice.first() else {
        return Err("no claim made from it holds a device".into());
    };
    if let Some(a) = advice.iter().find(|a| !a.advice.changes()) {
        let why = match &a.advice {
            Offering::Keep { reason } => format!("keeps its GPU: {reason}"),
            Offering::Refused { reason } => format!("has no advice: {reason}"),
            _ => String::new(),
        };
        return Err(format!("claim {} made from it {why}", a.claim));
    }
    let kind = |o: &Offering| std::mem::discriminant(o);
    if let Some(a) = advice
        .iter()
        .find(|a| kind(&a.advice) != kind(&first.advice))
    {
        return Err(format!(
            "claims made from it were advised different offerings ({} and {}); apply one by hand",
            offering_text(&first.advice),
            offering_text(&a.advice)
        ));
    }
    let mut merged = first.advice.clone();
    for a in &advice[1..] {
        merged = match (merged, &a.advice) {
            (
                Offering::Mig {
                    profile,
                    memory_bytes,
                    compute_slices,
                },
                Offering::Mig {
                    profile: p,
                    memory_bytes: m,
                    compute_slices: c,
                },
            ) => {
                if *m >= memory_bytes && *c >= compute_slices {
                    a.advice.clone()
                } else if memory_bytes >= *m && compute_slices >= *c {
                    Offering::Mig {
                        profile,
                        memory_bytes,
                        compute_slices,
                    }
                } else {
                    // Neither holds both needs (1g.20gb's memory, 2g.10gb's compute).
                    return Err(format!(
                        "claims made from it were advised MIG {profile} and MIG {p}, neither holds both"
                    ));
                }
            }
            (Offering::Share { memory_bytes }, Offering::Share { memory_bytes: m }) => {
                Offering::Share {
                    memory_bytes: memory_bytes.max(*m),
                }
            }
            (Offering::TimeSlicing { memory_bytes }, Offering::TimeSlicing { memory_bytes: m }) => {
                Offering::TimeSlicing {
                    memory_bytes: memory_bytes.max(*m),
                }
            }
            (
                Offering::Mps {
                    memory_bytes,
                    active_thread_percentage,
                },
                Offering::Mps {
                    memory_bytes: m,
                    active_thread_percentage: t,
                },
            ) => Offering::Mps {
                memory_bytes: memory_bytes.max(*m),
                active_thread_percentage: active_thread_percentage.max(*t),
            },
            (other, _) => other,
        };
    }
    Ok(merged)
}

/// Where the claims of one printed document come from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    /// A ResourceClaimTemplate (namespace, name).
    Template(String, String),
    /// A claim made without a template (namespace, name).
    Claim(String, String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Template(ns, name) => write!(f, "ResourceClaimTemplate {ns}/{name}"),
            Source::Claim(ns, name) => write!(f, "ResourceClaim {ns}/{name}"),
        }
    }
}

/// The templates (or claims) changed by the advice, one document each, each request changed by
/// the [`merge`] of the advice of every claim made from it; and a note for each one left as it
/// is.
async fn templates(
    client: &kube::Client,
    claims: &[ResourceClaim],
    advice: &[ClaimAdvice],
    args: &AdviseArgs,
) -> Result<(Vec<Value>, Vec<String>), CliError> {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
    // Every advised claim's source, so that a template whose other claim keeps its GPU is
    // seen as such.
    let mut groups: BTreeMap<Source, BTreeMap<String, Vec<&ClaimAdvice>>> = BTreeMap::new();
    let mut claim_of: BTreeMap<Source, &ResourceClaim> = BTreeMap::new();
    for a in advice {
        let Some(claim) = claims.iter().find(|c| {
            format!(
                "{}/{}",
                c.metadata.namespace.as_deref().unwrap_or_default(),
                c.metadata.name.as_deref().unwrap_or_default()
            ) == a.claim
        }) else {
            continue;
        };
        let ns = claim.metadata.namespace.clone().unwrap_or_default();
        let template = match template_of(claim) {
            Some((pod, pod_claim)) => {
                let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &ns);
                let pod = pods
                    .get_opt(&pod)
                    .await
                    .map_err(|source| CliError::Cluster {
                        what: format!("reading pod {ns}/{pod}"),
                        source,
                    })?;
                pod.and_then(|p| p.spec)
                    .and_then(|s| s.resource_claims)
                    .into_iter()
                    .flatten()
                    .find(|r| r.name == pod_claim)
                    .and_then(|r| r.resource_claim_template_name)
            }
            None => None,
        };
        let source = match template {
            Some(name) => Source::Template(ns, name),
            None => {
                let s = Source::Claim(ns, claim.metadata.name.clone().unwrap_or_default());
                claim_of.insert(s.clone(), claim);
                s
            }
        };
        groups
            .entry(source)
            .or_default()
            .entry(a.request.clone())
            .or_default()
            .push(a);
    }
    let mut docs = Vec::new();
    let mut notes = Vec::new();
    for (source, requests) in groups {
        let mut changes = Vec::new();
        for (request, advice) in &requests {
            match merge(advice) {
                Ok(o) => changes.push((request, o)),
                Err(why) => {
                    // A template none of whose claims is advised a change is not worth a note.
                    if advice.iter().any(|a| a.advice.changes()) {
                        notes.push(format!("{source} request {request} not changed: {why}"));
                    }
                }
            }
        }
        if changes.is_empty() {
            continue;
        }
        let (mut doc, pointer) = match &source {
            Source::Template(ns, name) => {
                let api: kube::Api<ResourceClaimTemplate> =
                    kube::Api::namespaced(client.clone(), ns);
                let Some(t) = api
                    .get_opt(name)
                    .await
                    .map_err(|source| CliError::Cluster {
                        what: format!("reading ResourceClaimTemplate {ns}/{name}"),
                        source,
                    })?
                else {
                    notes.push(format!("{source} not changed: it no longer exists"));
                    continue;
                };
                let mut v = serde_json::to_value(&t)?;
                v["apiVersion"] = json!("resource.k8s.io/v1");
                v["kind"] = json!("ResourceClaimTemplate");
                (v, "/spec/spec")
            }
            Source::Claim(..) => {
                let Some(claim) = claim_of.get(&source) else {
                    continue;
                };
                let mut v = serde_json::to_value(claim)?;
                v["apiVersion"] = json!("resource.k8s.io/v1");
                v["kind"] = json!("ResourceClaim");
                if let Some(o) = v.as_object_mut() {
                    o.remove("status");
                }
                (v, "/spec")
            }
        };
        if let Some(meta) = doc.get_mut("metadata").and_then(Value::as_object_mut) {
            for k in [
                "resourceVersion",
                "uid",
                "creationTimestamp",
                "managedFields",
                "generation",
                "finalizers",
            ] {
                meta.remove(k);
            }
        }
        let mut changed = 0;
        for (request, offering) in &changes {
            let Some(spec) = doc.pointer(pointer) else {
                break;
            };
            match apply(
                spec,
                request,
                offering,
                &args.mig_device_class,
                &args.driver_name,
            ) {
                Some(spec) => {
                    if let Some(slot) = doc.pointer_mut(pointer) {
                        *slot = spec;
                        changed += 1;
                    }
                }
                None => notes.push(format!(
                    "{source} request {request} not changed: it has no such exact request"
                )),
            }
        }
        if changed > 0 {
            docs.push(doc);
        }
    }
    Ok((docs, notes))
}

/// What `-o yaml` prints: how to apply it, the notes as comments, then the documents. Pure.
pub fn yaml_output(docs: &[Value], notes: &[String]) -> Result<String, CliError> {
    let mut out = String::from(
        "# gpu-dra advise: the ResourceClaimTemplates (and claims made without one) that apply the\n\
         # advice. Their spec is immutable, so `kubectl apply` is refused: use\n\
         #   kubectl replace --force -f <this file>\n\
         # then recreate the workloads' pods (claims already made keep their devices).\n",
    );
    for n in notes {
        out.push_str(&format!("# {n}\n"));
    }
    if docs.is_empty() {
        out.push_str("# nothing to change\n");
    }
    for doc in docs {
        let text = serde_saphyr::to_string(doc).map_err(|e| CliError::Yaml(e.to_string()))?;
        out.push_str("---\n");
        out.push_str(&text);
    }
    Ok(out)
}

/// The pod and its claim entry a claim was generated for: the pod from the claim's owner
/// references, the entry from its `resource.kubernetes.io/pod-claim-name` annotation.
pub fn template_of(claim: &ResourceClaim) -> Option<(String, String)> {
    let entry = claim
        .metadata
        .annotations
        .as_ref()?
        .get("resource.kubernetes.io/pod-claim-name")?
        .clone();
    let pod = claim
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.kind == "Pod" && o.api_version == "v1")?
        .name
        .clone();
    Some((pod, entry))
}

#[cfg(test)]
mod tests;
