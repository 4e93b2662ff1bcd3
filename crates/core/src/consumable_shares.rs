//! Consumable shares as NVIDIA's driver spells them: `--consumable-shares` (chart
//! `consumableShares`) with `disabled`, `memory`, `unlimited` or a positive integer `<N>`,
//! applied to every eligible whole GPU and MIG device of the node at once.
//!
//! Facts carried over from NVIDIA's driver (`kubernetes-sigs/dra-driver-nvidia-gpu`,
//! `cmd/gpu-kubelet-plugin/consumable_shares.go` at commit `95932046`, August 2026): every
//! eligible device gets `allowMultipleAllocations: true`, its `memory` capacity is rounded
//! down to whole MiB and gets a `requestPolicy` (step 1Mi, max the rounded memory):
//! - `memory`: default all of it, min 1Mi. A claim that asks for no memory gets the device to
//!   itself; claims asking for amounts share it while the amounts fit;
//! - `unlimited`: default 0, min 0. A claim that asks for no memory consumes none, so any
//!   number of claims share the device;
//! - `<N>`: `memory` as in `unlimited`, plus a capacity `shares` of N with default 1, min 1,
//!   max N, step 1. Each claim consumes `capacity.requests.shares` (1 unless it asks for
//!   more), so at most N claims share the device.
//!
//! Where this differs from NVIDIA's driver, and why:
//! - the other capacities of a MIG device (`multiprocessors`, engines, `memorySlice<i>`) get
//!   a policy of default 0, min 0. NVIDIA's driver leaves them without one, and the scheduler
//!   then makes every allocation consume all of each (`calculateConsumedCapacity`: no request
//!   and no policy means the whole value), so there a MIG device takes one claim at a time
//!   unless every claim asks for 0 of each. A claim may still ask for them (e.g.
//!   `multiprocessors: 14`) to keep them to itself;
//! - with `<N>` = 1 the `shares` policy has no step: the API requires `min + step <= value`,
//!   which 1 + 1 is not, and NVIDIA's slice with N = 1 is refused by the API server;
//! - dynamic MIG GPUs are not eligible (NVIDIA's driver shares their placements and reuses
//!   the first claim's MIG instance): here a dynamic instance belongs to one claim
//!   (docs/STATUS.md), so their devices stay single-allocation;
//! - a GPU selected for our memory shares ([`crate::memory_shares`], by flag or Node
//!   annotation) keeps that policy (min 1Gi, no max): the per-GPU selection wins;
//! - NVIDIA needs its feature gate `ConsumableShares` as well; here the value alone enables it.
//!
//! Also not eligible: a device with less than 2Mi of memory (no `memory` policy the API
//! accepts: min + step must fit), with a warning.

use std::collections::BTreeMap;
use std::fmt;

use gpu_dra_device::{DeviceRef, Inventory};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceCapacity,
};

use crate::partitioning::{GpuMode, Partitioning};
use crate::slices::{RenderWarning, Rendered, cap, capacity_quantity};

/// Granularity of the `memory` policy (`validRange.step`): 1 MiB, as NVIDIA's driver.
pub const MEMORY_STEP_BYTES: u64 = 1 << 20;

/// The node-wide consumable-shares setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ConsumableShares {
    /// No device allows multiple allocations (besides memory-share GPUs).
    #[default]
    Disabled,
    /// Claims share a device by amounts of its memory; no amount: the whole device.
    Memory,
    /// Claims share a device without limit; no amount of memory: none consumed.
    Unlimited,
    /// At most N claims (N `shares`, one each by default) share a device.
    Count(u64),
}

/// Why a consumable-shares value is not one of NVIDIA's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a consumable-shares mode; use disabled, memory, unlimited or a positive integer (the number of shares of each device)"
)]
pub struct ParseError {
    /// The value given.
    pub value: String,
}

impl ConsumableShares {
    /// Parses NVIDIA's spelling: `disabled`, `memory`, `unlimited` or a positive integer.
    /// Empty is `disabled` (NVIDIA's chart default `""` leaves the flag at its default).
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let value = text.trim();
        match value {
            "" | "disabled" => Ok(Self::Disabled),
            "memory" => Ok(Self::Memory),
            "unlimited" => Ok(Self::Unlimited),
            n if n.bytes().all(|b| b.is_ascii_digit()) => match n.parse::<u64>() {
                Ok(n) if n > 0 && i64::try_from(n).is_ok() => Ok(Self::Count(n)),
                _ => Err(ParseError {
                    value: text.to_owned(),
                }),
            },
            _ => Err(ParseError {
                value: text.to_owned(),
            }),
        }
    }

    /// Whether devices are shared at all.
    pub fn enabled(self) -> bool {
        self != Self::Disabled
    }
}

impl fmt::Display for ConsumableShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Disabled => f.write_str("disabled"),
            Self::Memory => f.write_str("memory"),
            Self::Unlimited => f.write_str("unlimited"),
            Self::Count(n) => write!(f, "{n}"),
        }
    }
}

/// Whether `device` is offered with consumable shares under `partitioning`: its GPU is
/// offered statically (neither dynamic MIG nor our memory shares), the mode is enabled and
/// its memory fits a policy.
pub fn eligible(partitioning: &Partitioning, device: &DeviceRef<'_>) -> bool {
    partitioning.consumable_shares.enabled()
        && partitioning.mode(device.gpu()) == GpuMode::Static
        && memory_bytes(device) >= 2 * MEMORY_STEP_BYTES
}

fn memory_bytes(device: &DeviceRef<'_>) -> u64 {
    match device {
        DeviceRef::Gpu(g) => g.memory_bytes,
        DeviceRef::Mig { mig, .. } => mig.memory_bytes,
    }
}

fn range(
    default: u64,
    min: u64,
    max: Option<u64>,
    step: Option<u64>,
) -> Option<CapacityRequestPolicy> {
    Some(CapacityRequestPolicy {
        default: Some(capacity_quantity(default)),
        valid_range: Some(CapacityRequestPolicyRange {
            min: capacity_quantity(min),
            max: max.map(capacity_quantity),
            step: step.map(capacity_quantity),
        }),
        valid_values: None,
    })
}

/// The capacities of an eligible device with `memory_bytes` of memory under `mode`: the
/// `memory` capacity (rounded down to whole MiB) with its policy, and in `<N>` mode the
/// `shares` capacity. `None` when `mode` is disabled.
pub fn share_capacities(
    mode: ConsumableShares,
    memory_bytes: u64,
) -> Option<BTreeMap<String, DeviceCapacity>> {
    let max = memory_bytes - memory_bytes % MEMORY_STEP_BYTES;
    let step = Some(MEMORY_STEP_BYTES);
    let memory_policy = match mode {
        ConsumableShares::Disabled => return None,
        ConsumableShares::Memory => range(max, MEMORY_STEP_BYTES, Some(max), step),
        ConsumableShares::Unlimited | ConsumableShares::Count(_) => range(0, 0, Some(max), step),
    };
    let mut out = BTreeMap::from([(
        cap::MEMORY.to_owned(),
        DeviceCapacity {
            value: capacity_quantity(max),
            request_policy: memory_policy,
        },
    )]);
    if let ConsumableShares::Count(n) = mode {
        out.insert(
            cap::SHARES.to_owned(),
            DeviceCapacity {
                value: capacity_quantity(n),
                request_policy: range(1, 1, Some(n), (n > 1).then_some(1)),
            },
        );
    }
    Some(out)
}

/// Makes `device` (eligible, see [`eligible`]) one several claims may hold under `mode`.
fn share(device: &mut Device, mode: ConsumableShares, memory_bytes: u64) {
    let Some(shares) = share_capacities(mode, memory_bytes) else {
        return;
    };
    device.allow_multiple_allocations = Some(true);
    let capacity = device.capacity.get_or_insert_with(BTreeMap::new);
    // Every other capacity of a multi-allocatable device is consumable too: by default none
    // of it, so that claims are bounded by memory and shares only (see the module docs).
    for other in capacity.values_mut() {
        other.request_policy = range(0, 0, None, None);
    }
    capacity.extend(shares);
}

/// Applies `partitioning.consumable_shares` to the eligible devices rendered in `rendered`;
/// devices too small for a policy stay as rendered, with a warning each.
pub fn apply(rendered: &mut Rendered, inventory: &Inventory, partitioning: &Partitioning) {
    let mode = partitioning.consumable_shares;
    if !mode.enabled() {
        return;
    }
    let mut offered: BTreeMap<String, u64> = BTreeMap::new();
    for device in inventory.devices() {
        if partitioning.mode(device.gpu()) != GpuMode::Static {
            continue;
        }
        if eligible(partitioning, &device) {
            offered.insert(device.name(), memory_bytes(&device));
        } else {
            rendered.warnings.push(RenderWarning {
                device: device.name(),
                field: "consumableShares".into(),
                reason: format!(
                    "{} bytes of memory is less than 2Mi (a request policy's min plus one step); published for one claim at a time",
                    memory_bytes(&device)
                ),
            });
        }
    }
    for device in rendered
        .slices
        .iter_mut()
        .flat_map(|s| s.spec.devices.iter_mut().flatten())
    {
        if let Some(&bytes) = offered.get(&device.name) {
            share(device, mode, bytes);
        }
    }
}

/// Environment variable telling a container how many `shares` its claim consumes of a
/// device in `<N>` mode (nothing enforces it; NVIDIA's driver tells nothing).
pub const SHARES_ENV: &str = "GPU_DRA_SHARES";

/// The environment a container gets for its claim's share of a device: its memory share
/// (when the allocation consumes memory, [`crate::memory_shares::share_env`]) and its
/// `shares` (when it consumes any).
pub fn share_env(
    memory: Option<&crate::memory_shares::MemoryShare>,
    shares: Option<u64>,
) -> Vec<String> {
    let mut env = Vec::new();
    if let Some(m) = memory.filter(|m| m.bytes > 0) {
        env.push(crate::memory_shares::share_env(m));
    }
    if let Some(n) = shares.filter(|n| *n > 0) {
        env.push(format!("{SHARES_ENV}={n}"));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partitioning::{GpuSelection, render};
    use crate::slices::SliceParams;
    use gpu_dra_device::testing::{a100, a100_dynamic, inventory, mig_1g5gb};
    use std::collections::BTreeSet;

    fn params() -> SliceParams<'static> {
        SliceParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        }
    }

    fn render_with(inv: &Inventory, partitioning: &Partitioning) -> Rendered {
        render(
            inv,
            &params(),
            &BTreeMap::new(),
            partitioning,
            &BTreeSet::new(),
        )
    }

    fn devices(r: &Rendered) -> BTreeMap<String, Device> {
        r.slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.clone(), d.clone()))
            .collect()
    }

    /// (default, min, max, step) of a capacity's policy, as quantities.
    fn policy(d: &Device, capacity: &str) -> (String, String, Option<String>, Option<String>) {
        let c = &d.capacity.as_ref().expect("capacity")[capacity];
        let p = c.request_policy.as_ref().expect("policy");
        let r = p.valid_range.as_ref().expect("range");
        (
            p.default.as_ref().expect("default").0.clone(),
            r.min.0.clone(),
            r.max.as_ref().map(|q| q.0.clone()),
            r.step.as_ref().map(|q| q.0.clone()),
        )
    }

    fn q(s: &str) -> String {
        s.to_owned()
    }

    #[test]
    fn values_parse_as_nvidia_spells_them_and_others_are_refused() {
        for (text, want) in [
            ("disabled", ConsumableShares::Disabled),
            ("", ConsumableShares::Disabled),
            ("memory", ConsumableShares::Memory),
            ("unlimited", ConsumableShares::Unlimited),
            ("4", ConsumableShares::Count(4)),
            (" 10 ", ConsumableShares::Count(10)),
        ] {
            assert_eq!(ConsumableShares::parse(text), Ok(want), "{text:?}");
        }
        for bad in ["0", "-1", "Memory", "4.5", "all", "99999999999999999999"] {
            let err = ConsumableShares::parse(bad).expect_err(bad).to_string();
            assert!(
                err.contains("disabled, memory, unlimited or a positive integer"),
                "{err}"
            );
        }
        assert_eq!(ConsumableShares::Count(4).to_string(), "4");
        assert_eq!(ConsumableShares::Unlimited.to_string(), "unlimited");
    }

    fn node() -> Inventory {
        inventory([
            a100(0).build(),
            a100(1).build(),
            a100(2).mig(mig_1g5gb(0)).build(),
        ])
    }

    fn with(mode: ConsumableShares) -> Partitioning {
        Partitioning {
            consumable_shares: mode,
            ..Partitioning::default()
        }
    }

    #[test]
    fn disabled_renders_exactly_as_before() {
        let inv = node();
        assert_eq!(
            render_with(&inv, &with(ConsumableShares::Disabled)),
            render_with(&inv, &Partitioning::default())
        );
        for d in devices(&render_with(&inv, &Partitioning::default())).values() {
            assert_eq!(d.allow_multiple_allocations, None, "{}", d.name);
        }
    }

    #[test]
    fn memory_mode_defaults_to_the_whole_memory_on_gpus_and_mig_devices() {
        let r = render_with(&node(), &with(ConsumableShares::Memory));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let d = devices(&r);
        for name in ["gpu-0", "gpu-1", "gpu-2-mig-1g5gb-19-0"] {
            assert_eq!(d[name].allow_multiple_allocations, Some(true), "{name}");
            assert!(!d[name].capacity.as_ref().unwrap().contains_key("shares"));
        }
        assert_eq!(
            policy(&d["gpu-0"], "memory"),
            (q("40Gi"), q("1Mi"), Some(q("40Gi")), Some(q("1Mi")))
        );
        assert_eq!(
            policy(&d["gpu-2-mig-1g5gb-19-0"], "memory"),
            (q("4864Mi"), q("1Mi"), Some(q("4864Mi")), Some(q("1Mi")))
        );
        // The MIG device's other capacities: none consumed unless asked for.
        assert_eq!(
            policy(&d["gpu-2-mig-1g5gb-19-0"], "multiprocessors"),
            (q("0"), q("0"), None, None)
        );
    }

    #[test]
    fn unlimited_mode_consumes_no_memory_by_default() {
        let d = devices(&render_with(&node(), &with(ConsumableShares::Unlimited)));
        assert_eq!(
            policy(&d["gpu-1"], "memory"),
            (q("0"), q("0"), Some(q("40Gi")), Some(q("1Mi")))
        );
        assert!(!d["gpu-1"].capacity.as_ref().unwrap().contains_key("shares"));
    }

    #[test]
    fn count_mode_adds_n_shares_of_one_each_by_default() {
        let d = devices(&render_with(&node(), &with(ConsumableShares::Count(4))));
        for name in ["gpu-0", "gpu-2-mig-1g5gb-19-0"] {
            let shares = &d[name].capacity.as_ref().unwrap()["shares"];
            assert_eq!(shares.value.0, "4");
            assert_eq!(
                policy(&d[name], "shares"),
                (q("1"), q("1"), Some(q("4")), Some(q("1")))
            );
            assert_eq!(policy(&d[name], "memory").0, "0", "{name}");
        }
        // N = 1: no step (min + step would exceed the value, which the API refuses).
        let d = devices(&render_with(&node(), &with(ConsumableShares::Count(1))));
        assert_eq!(
            policy(&d["gpu-0"], "shares"),
            (q("1"), q("1"), Some(q("1")), None)
        );
    }

    #[test]
    fn memory_is_rounded_down_to_whole_mib() {
        let caps = share_capacities(ConsumableShares::Memory, (10 << 20) + 500).expect("caps");
        assert_eq!(caps["memory"].value.0, "10Mi");
        assert!(share_capacities(ConsumableShares::Disabled, 10 << 20).is_none());
    }

    #[test]
    fn memory_share_and_dynamic_mig_gpus_keep_their_own_form() {
        let inv = inventory([a100(0).build(), a100(1).build(), a100_dynamic(2).build()]);
        let partitioning = Partitioning {
            memory_shares: GpuSelection::parse("1").expect("selection"),
            dynamic_mig: GpuSelection::parse("2").expect("selection"),
            consumable_shares: ConsumableShares::Count(3),
        };
        let r = render_with(&inv, &partitioning);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let d = devices(&r);
        assert!(d["gpu-0"].capacity.as_ref().unwrap().contains_key("shares"));
        // Our memory shares win on gpu-1: their policy, no shares capacity.
        assert_eq!(
            policy(&d["gpu-1"], "memory"),
            (q("40Gi"), q("1Gi"), None, Some(q("1Mi")))
        );
        assert!(!d["gpu-1"].capacity.as_ref().unwrap().contains_key("shares"));
        // Dynamic MIG placements stay single-allocation.
        let dynamic: Vec<&Device> = d.values().filter(|d| d.name.starts_with("gpu-2")).collect();
        assert!(!dynamic.is_empty());
        assert!(
            dynamic
                .iter()
                .all(|d| d.allow_multiple_allocations.is_none())
        );
        assert_eq!(
            partitioning.shareable_devices(&inv),
            BTreeSet::from(["gpu-0".to_owned(), "gpu-1".to_owned()])
        );
    }

    #[test]
    fn a_device_too_small_for_a_policy_is_published_whole_with_a_warning() {
        let inv = inventory([a100(0).memory_bytes(MEMORY_STEP_BYTES).build()]);
        let r = render_with(&inv, &with(ConsumableShares::Unlimited));
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        assert_eq!(r.warnings[0].field, "consumableShares");
        assert_eq!(devices(&r)["gpu-0"].allow_multiple_allocations, None);
    }

    #[test]
    fn containers_are_told_what_they_consume() {
        use crate::memory_shares::{MemoryShare, SHARE_ENV};
        let share = |bytes| MemoryShare {
            bytes,
            total_bytes: 40 << 30,
            compute_capability: (8, 0),
        };
        assert_eq!(
            share_env(Some(&share(2 << 30)), Some(0)),
            [format!("{SHARE_ENV}={}", 2u64 << 30)]
        );
        assert_eq!(
            share_env(Some(&share(0)), Some(2)),
            [format!("{SHARES_ENV}=2")]
        );
        assert!(share_env(None, None).is_empty());
    }
}
