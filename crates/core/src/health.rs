//! Device health: from what NVML observed to device taints in our ResourceSlices and the
//! health the kubelet shows in pod status.
//!
//! Pure logic over plain data: [`HealthBook::observe`] takes the observations of a
//! [`gpu_dra_device::HealthSource`], [`HealthBook::view`] maps the conditions it holds onto the
//! devices of an inventory. The node plugin feeds one book and republishes when the view
//! changes.
//!
//! The rules:
//! - **Ignored XIDs.** XIDs caused by applications leave the GPU usable; the list is
//!   NVIDIA's (k8s-device-plugin): 13, 31, 43, 45, 68, 109. Operators add more (or `all`).
//! - **Scope.** An event NVML limits to a MIG instance (GPU- and compute-instance ID) affects
//!   that MIG device only; any other event, a lost GPU and a recovery action affect the GPU
//!   and every MIG device on it.
//! - **Severity -> taint effect.** A GPU that fell off the bus or asks for a node reboot is
//!   unusable: the taint's effect is the fatal effect (`NoExecute` by default, so that the
//!   device taint eviction controller moves workloads away). XID and ECC errors and a pending
//!   GPU reset are `NoSchedule`: running workloads stay (their pod status says the device is
//!   unhealthy), new claims go elsewhere.
//! - **Recovery.** A lost GPU is healthy again once a probe reaches it. An XID or ECC
//!   condition ends when the GPU's recovery action (NVML field 230) is back to none after the
//!   driver asked for one (the reset happened), or, when the driver never asked for one, once
//!   the hold time has passed with the recovery action at none. Drivers that do not report a
//!   recovery action keep the condition until the plugin restarts: nothing tells that the GPU
//!   recovered.

use std::collections::{BTreeMap, BTreeSet};

use gpu_dra_device::{DeviceRef, HealthEvent, HealthObservation, InstanceId, Inventory};
use serde::{Deserialize, Serialize};

/// XIDs NVIDIA's tools treat as caused by an application: the GPU stays healthy.
/// 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
/// 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// The XID NVIDIA's driver reports when a GPU has fallen off the bus.
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// A device taint's effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TaintEffect {
    /// New allocations avoid the device; running workloads stay.
    NoSchedule,
    /// Also evicts workloads using the device (device taint eviction controller).
    NoExecute,
}

impl TaintEffect {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// A taint on one device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Taint {
    /// `<driver>/<condition>`, e.g. `gpu.nvidia.com/xid`.
    pub key: String,
    /// e.g. the XID number.
    pub value: Option<String>,
    /// What it does to scheduling.
    pub effect: TaintEffect,
    /// When the condition began (Unix seconds): the taint's `timeAdded`.
    pub since: i64,
}

impl std::fmt::Display for Taint {
    /// `key=value:Effect`, as `kubectl` writes node taints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}={}:{}",
            self.key,
            self.value.as_deref().unwrap_or_default(),
            self.effect.as_str()
        )
    }
}

/// Operator settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Taint key domain (the driver name).
    pub driver_name: String,
    /// XIDs that do not make a device unhealthy, besides [`APPLICATION_XIDS`].
    pub ignored_xids: BTreeSet<u64>,
    /// No XID makes a device unhealthy (ECC errors, lost GPUs and recovery actions still do).
    pub ignore_all_xids: bool,
    /// How long an XID or ECC condition lasts when the driver asks for no recovery action.
    pub hold_secs: i64,
    /// Effect of fatal conditions (lost GPU, node reboot needed).
    pub fatal_effect: TaintEffect,
}

impl HealthPolicy {
    /// Defaults: NVIDIA's ignored XIDs only, conditions held 5 minutes, fatal = `NoExecute`.
    pub fn new(driver_name: impl Into<String>) -> Self {
        Self {
            driver_name: driver_name.into(),
            ignored_xids: BTreeSet::new(),
            ignore_all_xids: false,
            hold_secs: 300,
            fatal_effect: TaintEffect::NoExecute,
        }
    }

    /// Parses an ignore list: comma-separated XIDs, or `all`. Returns what was wrong with an
    /// entry.
    pub fn with_ignored_xids(mut self, list: &str) -> Result<Self, String> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item.eq_ignore_ascii_case("all") {
                self.ignore_all_xids = true;
            } else {
                let xid = item.parse::<u64>().map_err(|_| {
                    format!("{item:?} is not an XID number (expected a comma-separated list of numbers, or all)")
                })?;
                self.ignored_xids.insert(xid);
            }
        }
        Ok(self)
    }

    /// Whether an XID is ignored.
    pub fn ignores(&self, xid: u64) -> bool {
        self.ignore_all_xids || APPLICATION_XIDS.contains(&xid) || self.ignored_xids.contains(&xid)
    }
}

/// Recovery action names (NVML field 230 values 1..=4).
fn recovery_name(action: u32) -> String {
    match action {
        1 => "reset".into(),
        2 => "reboot".into(),
        3 => "drain-p2p".into(),
        4 => "drain-and-reset".into(),
        n => format!("action-{n}"),
    }
}

fn recovery_advice(action: u32) -> &'static str {
    match action {
        1 => "stop its processes and reset the GPU (nvidia-smi -r)",
        2 => "reboot the node",
        3 => "stop peer-to-peer traffic on it",
        4 => "stop peer-to-peer traffic, then reset the GPU",
        _ => "see the GPU's recovery action in nvidia-smi -q",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
enum Cause {
    Xid(u64),
    Ecc,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Condition {
    cause: Cause,
    instance: Option<InstanceId>,
    since: i64,
    /// The driver asked for a recovery action after this condition began.
    escalated: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct GpuHealth {
    conditions: Vec<Condition>,
    lost_since: Option<i64>,
    /// Current recovery action other than none, and since when.
    recovery: Option<(u32, i64)>,
    /// The driver reports a recovery action (last probe).
    reports_recovery: bool,
}

/// What a device's health is, as the kubelet shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// False when any condition affects the device.
    pub healthy: bool,
    /// Why it is unhealthy (empty when healthy).
    pub message: String,
}

/// The health conditions of one inventory's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthView {
    /// Taints per device name (only devices with taints).
    pub taints: BTreeMap<String, Vec<Taint>>,
    /// Health per device name (every device of the inventory).
    pub devices: BTreeMap<String, DeviceHealth>,
}

/// The conditions known per GPU.
#[derive(Debug, Clone)]
pub struct HealthBook {
    policy: HealthPolicy,
    gpus: BTreeMap<String, GpuHealth>,
}

impl HealthBook {
    /// An empty book (every device healthy).
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            policy,
            gpus: BTreeMap::new(),
        }
    }

    /// The conditions as JSON, to keep them across plugin restarts (`{version, gpus}`; unknown
    /// fields are ignored when read back, so a newer plugin's file loads).
    pub fn to_json(&self) -> String {
        serde_json::json!({ "version": 1, "gpus": self.gpus }).to_string()
    }

    /// A book holding the conditions of [`HealthBook::to_json`]; what cannot be read is
    /// reported and an empty book returned.
    pub fn from_json(policy: HealthPolicy, json: &str) -> (Self, Option<String>) {
        #[derive(Deserialize)]
        struct Saved {
            #[serde(default)]
            gpus: BTreeMap<String, GpuHealth>,
        }
        match serde_json::from_str::<Saved>(json) {
            Ok(saved) => (
                Self {
                    policy,
                    gpus: saved.gpus,
                },
                None,
            ),
            Err(e) => (Self::new(policy), Some(e.to_string())),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Takes one observation at `now` (Unix seconds). Returns whether the book changed.
    pub fn observe(&mut self, observation: &HealthObservation, now: i64) -> bool {
        match observation {
            HealthObservation::Event {
                gpu_uuid,
                event,
                instance,
            } => {
                let cause = match *event {
                    HealthEvent::Xid(xid) if self.policy.ignores(xid) => return false,
                    HealthEvent::Xid(xid) => Cause::Xid(xid),
                    HealthEvent::UncorrectableEcc => Cause::Ecc,
                };
                let gpu = self.gpus.entry(gpu_uuid.clone()).or_default();
                if gpu
                    .conditions
                    .iter()
                    .any(|c| c.cause == cause && c.instance == *instance)
                {
                    return false;
                }
                gpu.conditions.push(Condition {
                    cause,
                    instance: *instance,
                    since: now,
                    escalated: false,
                });
                true
            }
            HealthObservation::Probe {
                gpu_uuid,
                reachable,
                recovery_action,
            } => {
                let before = self.gpus.get(gpu_uuid).cloned().unwrap_or_default();
                let gpu = self.gpus.entry(gpu_uuid.clone()).or_default();
                if !reachable {
                    gpu.lost_since.get_or_insert(now);
                    // Whatever happened before ends when the GPU is back (reset or reboot).
                    for c in &mut gpu.conditions {
                        c.escalated = true;
                    }
                } else {
                    gpu.lost_since = None;
                    gpu.reports_recovery = recovery_action.is_some();
                    match recovery_action {
                        Some(0) => {
                            gpu.recovery = None;
                            let hold = self.policy.hold_secs;
                            gpu.conditions
                                .retain(|c| !c.escalated && now - c.since < hold);
                        }
                        Some(action) => {
                            if gpu.recovery.map(|(a, _)| a) != Some(*action) {
                                gpu.recovery = Some((*action, now));
                            }
                            for c in &mut gpu.conditions {
                                c.escalated = true;
                            }
                        }
                        None => {}
                    }
                }
                let changed = *gpu != before;
                if *gpu == GpuHealth::default() {
                    self.gpus.remove(gpu_uuid);
                }
                changed
            }
        }
    }

    /// Ends XID and ECC conditions whose hold time has passed on GPUs that report no recovery
    /// action. Returns whether the book changed.
    pub fn expire(&mut self, now: i64) -> bool {
        let hold = self.policy.hold_secs;
        let mut changed = false;
        for gpu in self.gpus.values_mut() {
            if gpu.reports_recovery && gpu.recovery.is_none() && gpu.lost_since.is_none() {
                let before = gpu.conditions.len();
                gpu.conditions
                    .retain(|c| c.escalated || now - c.since < hold);
                changed |= gpu.conditions.len() != before;
            }
        }
        self.gpus.retain(|_, g| *g != GpuHealth::default());
        changed
    }

    /// The taints and health of every device of `inventory`.
    pub fn view(&self, inventory: &Inventory) -> HealthView {
        let mut view = HealthView::default();
        for device in inventory.devices() {
            let name = device.name();
            let (taints, reasons) = self.device_conditions(&device);
            let healthy = reasons.is_empty();
            if !taints.is_empty() {
                view.taints.insert(name.clone(), taints);
            }
            view.devices.insert(
                name,
                DeviceHealth {
                    healthy,
                    message: reasons.join("; "),
                },
            );
        }
        view
    }

    fn device_conditions(&self, device: &DeviceRef<'_>) -> (Vec<Taint>, Vec<String>) {
        let gpu = device.gpu();
        let Some(health) = self.gpus.get(&gpu.uuid) else {
            return (Vec::new(), Vec::new());
        };
        let instance = match device {
            DeviceRef::Gpu(_) => None,
            DeviceRef::Mig { mig, .. } => Some(InstanceId {
                gi: mig.gi_id,
                ci: mig.ci_id,
            }),
        };
        let key = |k: &str| format!("{}/{k}", self.policy.driver_name);
        let mut taints: Vec<Taint> = Vec::new();
        let mut reasons = Vec::new();
        if let Some(since) = health.lost_since {
            taints.push(Taint {
                key: key("gpu-lost"),
                value: None,
                effect: self.policy.fatal_effect,
                since,
            });
            reasons.push(format!(
                "GPU {} is unreachable (fallen off the bus); reboot the node",
                gpu.uuid
            ));
        }
        if let Some((action, since)) = health.recovery {
            let effect = if action == 2 {
                self.policy.fatal_effect
            } else {
                TaintEffect::NoSchedule
            };
            taints.push(Taint {
                key: key("recovery-action"),
                value: Some(recovery_name(action)),
                effect,
                since,
            });
            reasons.push(format!(
                "the driver asks for recovery action {}: {}",
                recovery_name(action),
                recovery_advice(action)
            ));
        }
        // One taint per kind (keys are unique per device); the newest XID is its value.
        let applies = |c: &&Condition| c.instance.is_none() || c.instance == instance;
        let xids: Vec<&Condition> = health
            .conditions
            .iter()
            .filter(applies)
            .filter(|c| matches!(c.cause, Cause::Xid(_)))
            .collect();
        if let Some(newest) = xids.iter().max_by_key(|c| c.since) {
            let Cause::Xid(xid) = newest.cause else {
                unreachable!("filtered to XIDs")
            };
            let effect = if xid == XID_FALLEN_OFF_BUS {
                self.policy.fatal_effect
            } else {
                TaintEffect::NoSchedule
            };
            taints.push(Taint {
                key: key("xid"),
                value: Some(xid.to_string()),
                effect,
                since: xids.iter().map(|c| c.since).min().unwrap_or(newest.since),
            });
            let list: Vec<String> = xids
                .iter()
                .map(|c| match c.cause {
                    Cause::Xid(x) => x.to_string(),
                    Cause::Ecc => String::new(),
                })
                .collect();
            reasons.push(format!("XID error {}", list.join(", ")));
        }
        if let Some(ecc) = health
            .conditions
            .iter()
            .filter(applies)
            .filter(|c| c.cause == Cause::Ecc)
            .min_by_key(|c| c.since)
        {
            taints.push(Taint {
                key: key("ecc"),
                value: Some("uncorrectable".into()),
                effect: TaintEffect::NoSchedule,
                since: ecc.since,
            });
            reasons.push("uncorrectable ECC error".into());
        }
        taints.sort();
        (taints, reasons)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::{a100, inventory, mig_1g5gb, t4};

    fn book() -> HealthBook {
        HealthBook::new(HealthPolicy::new("gpu.nvidia.com"))
    }

    fn xid(uuid: &str, xid: u64, instance: Option<InstanceId>) -> HealthObservation {
        HealthObservation::Event {
            gpu_uuid: uuid.into(),
            event: HealthEvent::Xid(xid),
            instance,
        }
    }

    fn probe(uuid: &str, reachable: bool, action: Option<u32>) -> HealthObservation {
        HealthObservation::Probe {
            gpu_uuid: uuid.into(),
            reachable,
            recovery_action: action,
        }
    }

    fn keys(view: &HealthView, device: &str) -> Vec<String> {
        view.taints
            .get(device)
            .map(|t| t.iter().map(Taint::to_string).collect())
            .unwrap_or_default()
    }

    #[test]
    fn application_xids_and_configured_ones_are_ignored() {
        let inv = inventory([t4(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut b = HealthBook::new(
            HealthPolicy::new("gpu.nvidia.com")
                .with_ignored_xids("92, 94")
                .expect("list"),
        );
        for x in APPLICATION_XIDS.into_iter().chain([92, 94]) {
            assert!(!b.observe(&xid(&uuid, x, None), 10), "XID {x}");
        }
        assert!(b.view(&inv).taints.is_empty());
        assert!(b.observe(&xid(&uuid, 48, None), 10));
        assert_eq!(
            keys(&b.view(&inv), "gpu-0"),
            ["gpu.nvidia.com/xid=48:NoSchedule"]
        );
        assert!(HealthPolicy::new("d").with_ignored_xids("12,x").is_err());
        let all = HealthPolicy::new("d")
            .with_ignored_xids("all")
            .expect("all");
        assert!(all.ignores(48));
    }

    #[test]
    fn a_mig_scoped_event_taints_that_mig_device_only_and_a_gpu_event_taints_all() {
        let inv = inventory([a100(0).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build()]);
        let gpu = &inv.gpus[0];
        let (first, second) = (&gpu.mig_devices[0], &gpu.mig_devices[1]);
        let (n1, n2) = (first.device_name(gpu), second.device_name(gpu));
        let mut b = book();
        let scoped = Some(InstanceId {
            gi: first.gi_id,
            ci: first.ci_id,
        });
        assert!(b.observe(&xid(&gpu.uuid, 94, scoped), 100));
        let view = b.view(&inv);
        assert_eq!(keys(&view, &n1), ["gpu.nvidia.com/xid=94:NoSchedule"]);
        assert!(keys(&view, &n2).is_empty());
        assert!(!view.devices[&n1].healthy);
        assert!(view.devices[&n2].healthy);
        assert!(b.observe(
            &HealthObservation::Event {
                gpu_uuid: gpu.uuid.clone(),
                event: HealthEvent::UncorrectableEcc,
                instance: None
            },
            101
        ));
        let view = b.view(&inv);
        assert_eq!(
            keys(&view, &n2),
            ["gpu.nvidia.com/ecc=uncorrectable:NoSchedule"]
        );
        assert_eq!(keys(&view, &n1).len(), 2);
    }

    #[test]
    fn a_lost_gpu_is_fatal_until_a_probe_reaches_it() {
        let inv = inventory([t4(0).build(), t4(1).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut b = book();
        assert!(b.observe(&probe(&uuid, false, None), 5));
        let view = b.view(&inv);
        assert_eq!(keys(&view, "gpu-0"), ["gpu.nvidia.com/gpu-lost=:NoExecute"]);
        assert!(view.devices["gpu-0"].message.contains("unreachable"));
        assert!(view.devices["gpu-1"].healthy);
        assert!(!b.observe(&probe(&uuid, false, None), 6), "same state");
        assert!(b.observe(&probe(&uuid, true, Some(0)), 7));
        assert!(b.view(&inv).taints.is_empty());
        // The fall arrives as XID 79, then the GPU is unreachable; back after a reset, both end.
        b.observe(&xid(&uuid, XID_FALLEN_OFF_BUS, None), 8);
        b.observe(&probe(&uuid, false, None), 8);
        assert_eq!(
            keys(&b.view(&inv), "gpu-0"),
            [
                "gpu.nvidia.com/gpu-lost=:NoExecute",
                "gpu.nvidia.com/xid=79:NoExecute"
            ]
        );
        b.observe(&probe(&uuid, true, Some(0)), 9);
        assert!(b.view(&inv).taints.is_empty());
    }

    #[test]
    fn a_recovery_action_holds_the_condition_until_it_is_done() {
        let inv = inventory([t4(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut b = book();
        b.observe(&xid(&uuid, 48, None), 10);
        assert!(b.observe(&probe(&uuid, true, Some(1)), 10));
        assert_eq!(
            keys(&b.view(&inv), "gpu-0"),
            [
                "gpu.nvidia.com/recovery-action=reset:NoSchedule",
                "gpu.nvidia.com/xid=48:NoSchedule"
            ]
        );
        // Long past the hold time, still asked for: kept.
        assert!(!b.expire(10_000));
        assert!(!b.observe(&probe(&uuid, true, Some(1)), 10_000));
        // The reset happened.
        assert!(b.observe(&probe(&uuid, true, Some(0)), 10_001));
        assert!(b.view(&inv).taints.is_empty());
        assert!(b.view(&inv).devices["gpu-0"].healthy);
    }

    #[test]
    fn without_a_recovery_action_the_condition_lasts_the_hold_time() {
        let inv = inventory([t4(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut b = book();
        b.observe(&xid(&uuid, 62, None), 100);
        b.observe(&probe(&uuid, true, Some(0)), 100);
        assert!(!b.expire(399));
        assert_eq!(keys(&b.view(&inv), "gpu-0").len(), 1);
        assert!(b.expire(400));
        assert!(b.view(&inv).taints.is_empty());
        // A driver that reports no recovery action: kept.
        b.observe(&xid(&uuid, 62, None), 500);
        b.observe(&probe(&uuid, true, None), 500);
        assert!(!b.expire(1_000_000));
        assert_eq!(keys(&b.view(&inv), "gpu-0").len(), 1);
    }

    #[test]
    fn conditions_survive_a_round_trip_through_json() {
        let inv = inventory([t4(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut b = book();
        b.observe(&xid(&uuid, 62, None), 100);
        b.observe(&probe(&uuid, true, Some(0)), 100);
        let (restored, problem) =
            HealthBook::from_json(HealthPolicy::new("gpu.nvidia.com"), &b.to_json());
        assert!(problem.is_none(), "{problem:?}");
        assert_eq!(restored.view(&inv), b.view(&inv));
        let (empty, problem) = HealthBook::from_json(HealthPolicy::new("gpu.nvidia.com"), "{");
        assert!(problem.is_some());
        assert!(empty.view(&inv).taints.is_empty());
    }

    #[test]
    fn reboot_is_fatal_and_the_fatal_effect_is_configurable() {
        let inv = inventory([t4(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let mut policy = HealthPolicy::new("example.com");
        policy.fatal_effect = TaintEffect::NoSchedule;
        let mut b = HealthBook::new(policy);
        b.observe(&probe(&uuid, true, Some(2)), 1);
        assert_eq!(
            keys(&b.view(&inv), "gpu-0"),
            ["example.com/recovery-action=reboot:NoSchedule"]
        );
        let mut b = book();
        b.observe(&probe(&uuid, true, Some(2)), 1);
        assert_eq!(
            keys(&b.view(&inv), "gpu-0"),
            ["gpu.nvidia.com/recovery-action=reboot:NoExecute"]
        );
    }
}
