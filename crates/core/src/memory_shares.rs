//! GPU memory shares: one whole GPU allocated to several claims at once, each consuming an
//! amount of its memory (Kubernetes consumable capacity, feature gate `DRAConsumableCapacity`,
//! beta and on by default since 1.36).
//!
//! Publishing: a GPU in [`GpuMode::MemoryShares`](crate::partitioning::GpuMode) keeps its
//! whole-GPU device (`gpu-<minor>`, the same name and attributes a static GPU has, so selectors
//! written for NVIDIA's driver still match it), with `allowMultipleAllocations: true` and a
//! `requestPolicy` on its `memory` capacity. The scheduler then lets several claims hold the
//! device while the sum of their `capacity.requests.memory` fits, records each allocation's
//! `consumedCapacity` and gives it a `shareID`. Nothing else of the device is consumable: the
//! API makes every capacity of a multi-allocatable device consumable, and `memory` is the only
//! one a whole GPU publishes.
//!
//! The request policy ([`request_policy`]), and why:
//! - `validRange.min` 1Gi: a share smaller than that cannot hold a CUDA context and a useful
//!   working set; smaller requests are rounded up to it by the scheduler, never refused;
//! - `validRange.step` 1Mi: MPS takes pinned memory limits in whole MiB (`<n>M`), so every
//!   consumed amount is one MPS can enforce exactly; requests are rounded up to the next MiB;
//! - no `max` (the capacity is the implicit maximum). A `max` would have to be `min` plus a
//!   multiple of the step, which the capacity of most GPUs (e.g. 81559Mi) is not when counted
//!   in GiB, and it would add nothing;
//! - `default`: the whole memory (rounded down to the step). A claim that asks for the device
//!   without `capacity.requests.memory`, such as every claim written for NVIDIA's driver, gets
//!   the GPU to itself, as it would on a static GPU, instead of a small share it did not ask
//!   for.
//!
//! The API's rules these satisfy (`validateRequestPolicyRange`): `min` <= capacity,
//! `min + step` <= capacity, `default` >= `min` and `default - min` a multiple of `step`. A
//! GPU too small for them (below 1Gi + 1Mi) is published statically, with a warning, as is a
//! GPU with MIG enabled (memory shares need MIG off: its MIG devices are published instead).

use std::collections::BTreeSet;

use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, CapacityRequestPolicyRange, Device};

use crate::slices::{RenderWarning, Rendered, cap, capacity_quantity};

/// Smallest share (`validRange.min`): 1 GiB.
pub const MIN_SHARE_BYTES: u64 = 1 << 30;
/// Share granularity (`validRange.step`): 1 MiB, the unit of MPS pinned memory limits.
pub const SHARE_STEP_BYTES: u64 = 1 << 20;

/// The `requestPolicy` of the `memory` capacity of a GPU with `total_bytes` of memory, or
/// `None` when the GPU is too small to be shared under the policy's rules.
pub fn request_policy(total_bytes: u64) -> Option<CapacityRequestPolicy> {
    if total_bytes < MIN_SHARE_BYTES + SHARE_STEP_BYTES {
        return None;
    }
    let default = total_bytes - (total_bytes - MIN_SHARE_BYTES) % SHARE_STEP_BYTES;
    Some(CapacityRequestPolicy {
        default: Some(capacity_quantity(default)),
        valid_range: Some(CapacityRequestPolicyRange {
            min: capacity_quantity(MIN_SHARE_BYTES),
            max: None,
            step: Some(capacity_quantity(SHARE_STEP_BYTES)),
        }),
        valid_values: None,
    })
}

/// Turns the whole-GPU devices of the GPUs in `uuids` into memory-share devices in
/// `rendered`; GPUs that cannot be shared (unknown, MIG enabled, too small) stay as rendered,
/// with a warning each.
pub fn apply(rendered: &mut Rendered, inventory: &Inventory, uuids: &BTreeSet<String>) {
    for uuid in uuids {
        let Some(gpu) = inventory.gpus.iter().find(|g| &g.uuid == uuid) else {
            rendered
                .warnings
                .push(warning(uuid, "no GPU with this UUID".into()));
            continue;
        };
        let name = gpu.device_name();
        if gpu.mig_enabled() {
            rendered.warnings.push(warning(
                &name,
                "MIG is enabled: memory shares need MIG off (nvidia-smi -i <gpu> -mig 0); its MIG devices are published instead".into(),
            ));
            continue;
        }
        let Some(policy) = request_policy(gpu.memory_bytes) else {
            rendered.warnings.push(warning(
                &name,
                format!(
                    "{} bytes of memory is less than the smallest share (1Gi) plus one step (1Mi); published as a whole GPU",
                    gpu.memory_bytes
                ),
            ));
            continue;
        };
        let device = rendered
            .slices
            .iter_mut()
            .flat_map(|s| s.spec.devices.iter_mut().flatten())
            .find(|d| d.name == name);
        match device {
            Some(device) => share(device, policy),
            None => rendered
                .warnings
                .push(warning(&name, "the GPU is not published".into())),
        }
    }
}

fn share(device: &mut Device, policy: CapacityRequestPolicy) {
    device.allow_multiple_allocations = Some(true);
    if let Some(memory) = device
        .capacity
        .as_mut()
        .and_then(|c| c.get_mut(cap::MEMORY))
    {
        memory.request_policy = Some(policy);
    }
}

fn warning(device: &str, reason: String) -> RenderWarning {
    RenderWarning {
        device: device.to_string(),
        field: "memoryShares".into(),
        reason,
    }
}

/// One claim's share of a memory-share GPU, as prepare uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryShare {
    /// Memory the allocation consumes (`consumedCapacity.memory`), in bytes.
    pub bytes: u64,
    /// The GPU's memory, in bytes.
    pub total_bytes: u64,
    /// The GPU's CUDA compute capability (major, minor): whether its one MPS daemon can run
    /// multi-user ([`MemoryShare::multi_user_mps`]).
    pub compute_capability: (u32, u32),
}

impl MemoryShare {
    /// Whether the GPU's MPS control daemon can run multi-user (`-M`, compute capability
    /// 7.0 and newer), so that claims' pods of different users share its one server.
    pub fn multi_user_mps(&self) -> bool {
        self.compute_capability >= gpu_dra_api::MULTI_USER_MIN_COMPUTE_CAPABILITY
    }

    /// The share in whole MiB (rounded down), at least 1: the unit of MPS limits.
    pub fn mib(&self) -> u64 {
        (self.bytes / SHARE_STEP_BYTES).max(1)
    }

    /// The share of the GPU's compute an MPS client gets when its config sets none: the
    /// share of the memory in percent, rounded down, at least 1 (MPS refuses 0), at most 100.
    pub fn thread_percentage(&self) -> u8 {
        if self.total_bytes == 0 {
            return 100;
        }
        let pct = u128::from(self.bytes) * 100 / u128::from(self.total_bytes);
        pct.clamp(1, 100) as u8
    }
}

/// Environment variable telling a container its share of a memory-share GPU, in bytes (for
/// every sharing strategy; only MPS enforces it).
pub const SHARE_ENV: &str = "GPU_DRA_MEMORY_SHARE";

/// `GPU_DRA_MEMORY_SHARE=<bytes>`.
pub fn share_env(share: &MemoryShare) -> String {
    format!("{SHARE_ENV}={}", share.bytes)
}

/// A pinned memory limit in MPS syntax: `<n>G` when a whole number of GiB, else `<n>M`.
pub fn mps_limit(mib: u64) -> String {
    if mib.is_multiple_of(1024) {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partitioning::{GpuSelection, Partitioning, render};
    use crate::slices::SliceParams;
    use gpu_dra_device::testing::{a100, inventory, mig_1g5gb};
    use std::collections::BTreeMap;

    fn params() -> SliceParams<'static> {
        SliceParams {
            node_name: "node-a",
            driver_name: "gpu.nvidia.com",
            generation: 1,
        }
    }

    fn device<'a>(r: &'a Rendered, name: &str) -> &'a Device {
        r.slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("{name} not rendered"))
    }

    #[test]
    fn policy_follows_the_api_rules_for_aligned_and_unaligned_memory() {
        let policy = request_policy(40 << 30).expect("40Gi shares");
        assert_eq!(policy.default.as_ref().map(|q| q.0.as_str()), Some("40Gi"));
        let range = policy.valid_range.as_ref().expect("range");
        assert_eq!(range.min.0, "1Gi");
        assert_eq!(range.step.as_ref().map(|q| q.0.as_str()), Some("1Mi"));
        assert!(range.max.is_none());
        // 81559 MiB (an H100 80GB): the default stays a whole number of steps above min.
        let total = 81559 * SHARE_STEP_BYTES + 12345;
        let policy = request_policy(total).expect("shares");
        assert_eq!(
            policy.default.as_ref().map(|q| q.0.as_str()),
            Some("81559Mi")
        );
        assert!(request_policy(MIN_SHARE_BYTES).is_none());
        assert!(request_policy(MIN_SHARE_BYTES + SHARE_STEP_BYTES).is_some());
    }

    #[test]
    fn memory_share_gpus_allow_multiple_allocations_and_others_do_not() {
        let inv = inventory([
            a100(0).build(),
            a100(1).build(),
            a100(2).mig(mig_1g5gb(0)).build(),
        ]);
        let partitioning = Partitioning {
            memory_shares: GpuSelection::parse("0,2").expect("selection"),
            ..Partitioning::default()
        };
        let r = render(
            &inv,
            &params(),
            &BTreeMap::new(),
            &partitioning,
            &BTreeSet::new(),
        );
        let shared = device(&r, "gpu-0");
        assert_eq!(shared.allow_multiple_allocations, Some(true));
        let memory = &shared.capacity.as_ref().expect("capacity")["memory"];
        assert_eq!(memory.value.0, "40Gi");
        assert!(memory.request_policy.is_some());
        let whole = device(&r, "gpu-1");
        assert_eq!(whole.allow_multiple_allocations, None);
        assert!(
            whole.capacity.as_ref().expect("capacity")["memory"]
                .request_policy
                .is_none()
        );
        // MIG on: its MIG devices as usual, and a warning naming the fix.
        assert_eq!(
            device(&r, "gpu-2-mig-1g5gb-19-0").allow_multiple_allocations,
            None
        );
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        assert_eq!(r.warnings[0].device, "gpu-2");
        assert!(r.warnings[0].reason.contains("-mig 0"), "{}", r.warnings[0]);
    }

    #[test]
    fn shares_give_mps_limits_and_thread_percentages() {
        let total = 40 << 30;
        let quarter = MemoryShare {
            bytes: 10 << 30,
            total_bytes: total,
            compute_capability: (8, 0),
        };
        assert_eq!(quarter.mib(), 10240);
        assert_eq!(mps_limit(quarter.mib()), "10G");
        assert_eq!(quarter.thread_percentage(), 25);
        let half = MemoryShare {
            bytes: 20 << 30,
            total_bytes: total,
            compute_capability: (8, 0),
        };
        assert_eq!(half.thread_percentage(), 50);
        let odd = MemoryShare {
            bytes: 1500 << 20,
            total_bytes: total,
            compute_capability: (8, 0),
        };
        assert_eq!(mps_limit(odd.mib()), "1500M");
        assert_eq!(odd.thread_percentage(), 3);
        let tiny = MemoryShare {
            bytes: 1 << 20,
            total_bytes: total,
            compute_capability: (8, 0),
        };
        assert_eq!(tiny.thread_percentage(), 1);
    }

    #[test]
    fn the_daemon_of_a_volta_or_newer_gpu_runs_multi_user() {
        let on = |major, minor| MemoryShare {
            bytes: 1 << 30,
            total_bytes: 16 << 30,
            compute_capability: (major, minor),
        };
        assert!(on(7, 0).multi_user_mps());
        assert!(on(9, 0).multi_user_mps());
        assert!(!on(6, 1).multi_user_mps());
    }
}
