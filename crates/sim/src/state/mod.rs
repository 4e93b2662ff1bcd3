//! The simulated host's mutable state and the file that shares it between processes.
//!
//! `etc/gpu-sim/state.json` holds the profile plus what tools and NVML calls change:
//! compute mode, time-slice policy, MIG mode, the GPU/compute instances and GPU health
//! (lost GPUs, recovery actions, the event log of [`crate::health`]). Every process
//! that touches the fleet (the NVML library, the `nvidia-smi` stand-in, tests) goes through
//! [`StateFile`]: reads take a shared `flock` on a sibling lock file, updates an exclusive
//! one and replace the file atomically with `gpu_dra_fsutil::write_atomic` (write temp, fsync,
//! rename, fsync dir), so a reader never sees a torn file and concurrent updates never lose
//! each other. The lock is on a separate file because the rename replaces the state file's
//! inode: a lock on the data file itself would be lost with every write.
//!
//! Device visibility: like the real NVML, a process only sees the devices it can open. The
//! state file stands for the kernel driver, which every process of a node shares (the e2e
//! runtime bind-mounts a node's `etc/gpu-sim` at `/etc/gpu-sim` in every container); the
//! `dev/` folder next to it is the process's own view: `<root>/dev` on the simulated host,
//! the container's `/dev` inside a container. [`StateFile::load_visible`] leaves out GPUs
//! whose `nvidia<minor>` node is missing there and MIG devices whose GPU- or
//! compute-instance capability node (`nvidia-caps/nvidia-cap<N>`, minors as in
//! `/proc/driver/nvidia/capabilities`) is missing, and renumbers what is left from 0, as a
//! container's `nvidia-smi -L` does. A process that does not see every device may not change
//! the node ([`StateFile::update`] refuses), as an unprivileged container may not.
//!
//! Split by role: this module holds the state's types and its read-only lookups;
//! `layout` the MIG layout changes (one implementation of the driver's placement rules for
//! NVML and `nvidia-smi`), `faults` the injection of GPU faults (XID, ECC, fall off the
//! bus, reset) into the health records of [`crate::health`], `file` the state file and
//! how a process finds it, and `notify` the change counter that wakes NVML's event waiters
//! when a writer replaced the state.

use serde::{Deserialize, Serialize};

use crate::health::{EventLog, GpuHealth};
use crate::mig;
use crate::profile::{GpuSpec, PciAddress, Profile};

mod faults;
mod file;
mod layout;
mod notify;

pub use file::{StateFile, locate};
pub use layout::{MigError, mig_uuid};
pub use notify::{ChangeCounter, Waited};

/// Path of the state file relative to a simulated root.
pub const STATE_RELATIVE: &str = "etc/gpu-sim/state.json";

/// Environment variable naming the state file explicitly.
pub const ENV_STATE: &str = "GPU_SIM_STATE";

/// Environment variable naming the profile used to create a missing `GPU_SIM_STATE`.
pub const ENV_PROFILE: &str = "GPU_SIM_PROFILE";

/// Environment variable giving every NVML call of the simulated library a cost, in
/// microseconds (busy-waited, read once per process), so that benchmarks weigh NVML calls as
/// a real driver does; unset or 0: none.
pub const ENV_CALL_DELAY_US: &str = "GPU_SIM_CALL_DELAY_US";

/// NVML compute modes (`nvmlComputeMode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ComputeMode {
    /// Several contexts per device (0).
    #[default]
    Default,
    /// Deprecated one-context-per-thread mode (1); never set by the simulator.
    ExclusiveThread,
    /// No contexts allowed (2).
    Prohibited,
    /// One context per device, usable by several threads (3).
    ExclusiveProcess,
}

impl ComputeMode {
    /// The NVML enum value.
    pub fn value(self) -> u32 {
        match self {
            ComputeMode::Default => 0,
            ComputeMode::ExclusiveThread => 1,
            ComputeMode::Prohibited => 2,
            ComputeMode::ExclusiveProcess => 3,
        }
    }

    /// The mode with NVML enum value `v`.
    pub fn from_value(v: u32) -> Option<ComputeMode> {
        match v {
            0 => Some(ComputeMode::Default),
            1 => Some(ComputeMode::ExclusiveThread),
            2 => Some(ComputeMode::Prohibited),
            3 => Some(ComputeMode::ExclusiveProcess),
            _ => None,
        }
    }

    /// Name as `nvidia-smi -c` prints it (`EXCLUSIVE_PROCESS`).
    pub fn smi_name(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveThread => "EXCLUSIVE_THREAD",
            ComputeMode::Prohibited => "PROHIBITED",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }

    /// Name as `nvidia-smi -q` and `--query-gpu=compute_mode` print it (`Exclusive_Process`).
    pub fn query_name(self) -> &'static str {
        match self {
            ComputeMode::Default => "Default",
            ComputeMode::ExclusiveThread => "Exclusive_Thread",
            ComputeMode::Prohibited => "Prohibited",
            ComputeMode::ExclusiveProcess => "Exclusive_Process",
        }
    }
}

/// The whole simulated host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct State {
    /// The immutable description.
    pub profile: Profile,
    /// Mutable per-GPU state, same order as `profile.gpus`.
    pub gpus: Vec<GpuState>,
    /// Incremented on every MIG device creation so a recreated device gets a new UUID.
    #[serde(default)]
    pub generation: u64,
    /// Recent health events of the node's GPUs ([`crate::health`]).
    #[serde(default)]
    pub events: EventLog,
    /// The kernel module is unloaded (a driver upgrade in place is under way, see
    /// [`crate::upgrade`]): NVML answers `NVML_ERROR_DRIVER_NOT_LOADED` and `nvidia-smi` fails
    /// as on a host without the driver. Loaded, the module's version is
    /// `profile.driverVersion`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub driver_unloaded: bool,
}

/// Mutable state of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuState {
    /// Current compute mode.
    pub compute_mode: ComputeMode,
    /// Time-slice policy value 0..=3 (Default, Short, Medium, Long).
    pub timeslice: u32,
    /// MIG mode now in effect.
    pub mig_current: bool,
    /// MIG mode after the next reset.
    pub mig_pending: bool,
    /// Persistence mode (`nvidia-smi -pm`).
    #[serde(default)]
    pub persistence: bool,
    /// GPU instances, sorted by ID.
    pub gpu_instances: Vec<GpuInstance>,
    /// XID/ECC/bus health ([`crate::health`]).
    #[serde(default)]
    pub health: GpuHealth,
}

/// A GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInstance {
    /// GPU-instance ID.
    pub id: u32,
    /// GI profile ID (19, 14, ...).
    pub profile_id: u32,
    /// Placement start in memory slices.
    pub placement_start: u32,
    /// Compute instances, sorted by ID.
    pub compute_instances: Vec<ComputeInstance>,
}

/// A compute instance, which NVML exposes as one MIG device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeInstance {
    /// Compute-instance ID.
    pub id: u32,
    /// CI profile ID (equal to the NVML CI profile constant).
    pub profile_id: u32,
    /// Placement start in compute slices.
    pub placement_start: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// `MIG-xxxxxxxx-xxxx-5xxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
}

/// A MIG device as NVML enumerates it: index order is ascending (GI ID, CI ID).
#[derive(Debug, Clone, Copy)]
pub struct MigDeviceRef<'a> {
    /// The GPU instance.
    pub gi: &'a GpuInstance,
    /// The compute instance.
    pub ci: &'a ComputeInstance,
    /// The GI profile.
    pub profile: &'static mig::GiProfile,
}

impl MigDeviceRef<'_> {
    /// The name nvidia-smi prints (`1g.5gb`, or `1c.3g.20gb` for a smaller CI).
    pub fn name(&self) -> String {
        if self.ci.slice_count == self.profile.slice_count {
            self.profile.name.to_string()
        } else {
            format!("{}c.{}", self.ci.slice_count, self.profile.name)
        }
    }

    /// Its SMs: the GPU instance's, or for a compute instance smaller than its GPU instance
    /// its share of them.
    pub fn multiprocessors(&self) -> u32 {
        let p = self.profile;
        if self.ci.slice_count == p.slice_count {
            p.multiprocessors
        } else {
            p.multiprocessors / p.slice_count * self.ci.slice_count
        }
    }
}

impl State {
    /// The boot state of `profile`: default compute mode and time-slice, MIG as described.
    pub fn from_profile(profile: Profile) -> State {
        let mut generation = 0;
        let gpus = profile
            .gpus
            .iter()
            .map(|g| {
                let table = g.mig_profiles().unwrap_or(&[]);
                let mut gis: Vec<GpuInstance> = g
                    .mig_instances
                    .iter()
                    .filter_map(|m| {
                        let p = mig::by_id(table, m.profile_id)?;
                        generation += 1;
                        Some(GpuInstance {
                            id: m.gpu_instance_id,
                            profile_id: m.profile_id,
                            placement_start: m.placement_start,
                            compute_instances: vec![ComputeInstance {
                                id: m.compute_instance_id,
                                profile_id: p.default_ci_profile(),
                                placement_start: 0,
                                slice_count: p.slice_count,
                                uuid: mig_uuid(
                                    &g.uuid,
                                    m.gpu_instance_id,
                                    m.compute_instance_id,
                                    generation,
                                ),
                            }],
                        })
                    })
                    .collect();
                gis.sort_by_key(|gi| gi.id);
                GpuState {
                    compute_mode: ComputeMode::Default,
                    timeslice: 0,
                    mig_current: g.mig_enabled,
                    mig_pending: g.mig_enabled,
                    persistence: false,
                    gpu_instances: gis,
                    health: GpuHealth::default(),
                }
            })
            .collect();
        State {
            profile,
            gpus,
            generation,
            events: EventLog::default(),
            driver_unloaded: false,
        }
    }

    /// GPU `index`'s spec and state.
    pub fn gpu(&self, index: usize) -> Option<(&GpuSpec, &GpuState)> {
        Some((self.profile.gpus.get(index)?, self.gpus.get(index)?))
    }

    /// The MIG devices of GPU `index` in NVML index order (empty when MIG is off).
    pub fn mig_devices(&self, index: usize) -> Vec<MigDeviceRef<'_>> {
        let Some((spec, st)) = self.gpu(index) else {
            return Vec::new();
        };
        let table = spec.mig_profiles().unwrap_or(&[]);
        if !st.mig_current {
            return Vec::new();
        }
        let mut out = Vec::new();
        for gi in &st.gpu_instances {
            let Some(profile) = mig::by_id(table, gi.profile_id) else {
                continue;
            };
            for ci in &gi.compute_instances {
                out.push(MigDeviceRef { gi, ci, profile });
            }
        }
        out.sort_by_key(|m| (m.gi.id, m.ci.id));
        out
    }

    /// Finds a GPU by UUID; returns its index.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<usize> {
        self.profile.gpus.iter().position(|g| g.uuid == uuid)
    }

    /// Finds a GPU the way `nvidia-smi -i` names one: an index, a `GPU-` UUID (any case), a
    /// PCI bus ID in any of its forms, or a board serial. Returns its index.
    pub fn gpu_by_id(&self, id: &str) -> Option<usize> {
        let gpus = &self.profile.gpus;
        if let Ok(n) = id.parse::<usize>() {
            // A long all-digit string is a serial number, not an index.
            (n < gpus.len() && id.len() < 6)
                .then_some(n)
                .or_else(|| gpus.iter().position(|g| g.serial.as_deref() == Some(id)))
        } else if id.starts_with("GPU-") {
            gpus.iter().position(|g| g.uuid.eq_ignore_ascii_case(id))
        } else if let Some(addr) = PciAddress::parse(id) {
            gpus.iter().position(|g| g.pci() == addr)
        } else {
            None
        }
    }

    /// Finds a MIG device by UUID; returns (GPU index, GI ID, CI ID).
    pub fn mig_by_uuid(&self, uuid: &str) -> Option<(usize, u32, u32)> {
        (0..self.gpus.len()).find_map(|i| {
            self.mig_devices(i)
                .iter()
                .find(|m| m.ci.uuid == uuid)
                .map(|m| (i, m.gi.id, m.ci.id))
        })
    }

    /// The node as seen by a process for which `present(name)` says whether the device node
    /// `/dev/<name>` exists: GPUs without `nvidia<minor>` are left out (the rest keep their
    /// order and are renumbered from 0), and so are GPU instances without their
    /// `nvidia-caps/nvidia-cap<N>` access node and compute instances without theirs.
    pub fn visible(&self, present: impl Fn(&str) -> bool) -> State {
        let mut out = State {
            profile: Profile {
                gpus: Vec::new(),
                ..self.profile.clone()
            },
            gpus: Vec::new(),
            generation: self.generation,
            // Events name GPUs by UUID, so the log needs no renumbering.
            events: self.events.clone(),
            driver_unloaded: self.driver_unloaded,
        };
        for (spec, st) in self.profile.gpus.iter().zip(&self.gpus) {
            if !present(&format!("nvidia{}", spec.minor)) {
                continue;
            }
            let cap = |minor: u32| present(&format!("nvidia-caps/nvidia-cap{minor}"));
            let mut st = st.clone();
            st.gpu_instances
                .retain(|gi| cap(mig::gi_cap_minor(spec.minor, gi.id)));
            for gi in &mut st.gpu_instances {
                gi.compute_instances
                    .retain(|ci| cap(mig::ci_cap_minor(spec.minor, gi.id, ci.id)));
            }
            out.profile.gpus.push(spec.clone());
            out.gpus.push(st);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_state_of_dgx_a100_has_sixteen_mig_devices() {
        let s = State::from_profile(Profile::load("dgx-a100-40gb").expect("profile"));
        let counts: Vec<usize> = (0..8).map(|i| s.mig_devices(i).len()).collect();
        assert_eq!(counts, [4, 4, 4, 4, 0, 0, 0, 0]);
        let names: Vec<String> = s.mig_devices(0).iter().map(|m| m.name()).collect();
        // Ascending GI ID: 3g (1), 2g (6), 1g (11), 1g (12).
        assert_eq!(names, ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]);
        let mut uuids: Vec<&str> = (0..4)
            .flat_map(|i| s.gpus[i].gpu_instances.iter())
            .map(|gi| gi.compute_instances[0].uuid.as_str())
            .collect();
        uuids.sort_unstable();
        uuids.dedup();
        assert_eq!(uuids.len(), 16, "MIG UUIDs are unique");
        let u = &s.gpus[0].gpu_instances[0].compute_instances[0].uuid;
        assert!(crate::profile::is_uuid_body(&u[4..]), "{u}");
        assert_eq!(&u[18..19], "5", "version nibble in {u}");
        assert!("89ab".contains(&u[23..24]), "variant in {u}");
        assert_eq!(s.mig_by_uuid(u), Some((0, 1, 0)));
    }

    #[test]
    fn state_files_without_health_load_healthy() {
        let mut s = State::from_profile(Profile::load("dgx-h100").expect("profile"));
        s.inject_xid(1, 48, None, None).expect("xid");
        let mut json = serde_json::to_value(&s).expect("json");
        let obj = json.as_object_mut().expect("object");
        assert!(obj.remove("events").is_some());
        for g in obj["gpus"].as_array_mut().expect("gpus") {
            assert!(g.as_object_mut().expect("gpu").remove("health").is_some());
        }
        for g in obj["profile"]["gpus"].as_array_mut().expect("spec") {
            let g = g.as_object_mut().expect("spec");
            assert!(g.remove("supportedEventTypes").is_some());
        }
        let old: State = serde_json::from_value(json).expect("old format");
        assert_eq!(old.events, crate::health::EventLog::default());
        assert!(old.gpus.iter().all(|g| g.health == GpuHealth::default()));
        assert_eq!(old.profile, s.profile);
    }

    /// A device-node set: `nvidia<minor>` for `gpus`, the GI and CI access nodes of `migs`
    /// (GPU minor, GI ID, CI ID).
    fn nodes(gpus: &[u32], migs: &[(u32, u32, u32)]) -> impl Fn(&str) -> bool {
        let mut names: Vec<String> = gpus.iter().map(|m| format!("nvidia{m}")).collect();
        for &(g, gi, ci) in migs {
            names.push(format!(
                "nvidia-caps/nvidia-cap{}",
                mig::gi_cap_minor(g, gi)
            ));
            names.push(format!(
                "nvidia-caps/nvidia-cap{}",
                mig::ci_cap_minor(g, gi, ci)
            ));
        }
        move |name: &str| names.iter().any(|n| n == name)
    }

    #[test]
    fn visible_keeps_only_gpus_whose_node_exists_renumbered() {
        let s = State::from_profile(Profile::load("dgx-h100").expect("profile"));
        let v = s.visible(nodes(&[5, 2], &[]));
        let minors: Vec<u32> = v.profile.gpus.iter().map(|g| g.minor).collect();
        assert_eq!(minors, [2, 5], "host order kept");
        assert_eq!(v.gpus.len(), 2);
        assert_eq!(v.profile.gpus[0].uuid, s.profile.gpus[2].uuid);
        assert_eq!(v.gpu_by_uuid(&s.profile.gpus[5].uuid), Some(1));
        assert_eq!(v.gpu_by_uuid(&s.profile.gpus[0].uuid), None);
        assert!(s.visible(nodes(&[], &[])).gpus.is_empty());
        assert_eq!(s.visible(|_| true), s, "every node present: the whole node");
    }

    #[test]
    fn visible_mig_devices_need_both_capability_nodes() {
        let s = State::from_profile(Profile::load("dgx-a100-40gb").expect("profile"));
        // GPU 0 boots with GIs 1, 6, 11, 12 (one CI 0 each).
        let v = s.visible(nodes(&[0], &[(0, 11, 0)]));
        assert_eq!(v.gpus.len(), 1);
        let migs = v.mig_devices(0);
        assert_eq!(migs.len(), 1);
        assert_eq!(migs[0].gi.id, 11);
        assert_eq!(
            v.mig_by_uuid(&migs[0].ci.uuid),
            s.mig_by_uuid(&migs[0].ci.uuid)
                .map(|(_, gi, ci)| (0, gi, ci))
        );
        // The GI node without the CI node shows no MIG device.
        let gi_only = s.visible(|n| {
            n == "nvidia0" || n == format!("nvidia-caps/nvidia-cap{}", mig::gi_cap_minor(0, 6))
        });
        assert!(gi_only.mig_devices(0).is_empty());
        // MIG nodes without the parent's node show nothing of that GPU.
        assert!(s.visible(nodes(&[], &[(0, 11, 0)])).gpus.is_empty());
    }
}
