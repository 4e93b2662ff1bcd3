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

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::SimError;
use crate::health::{EventLog, GpuHealth};
use crate::mig;
use crate::profile::{GpuSpec, PciAddress, Profile};

/// Path of the state file relative to a simulated root.
pub const STATE_RELATIVE: &str = "etc/gpu-sim/state.json";

/// Environment variable naming the state file explicitly.
pub const ENV_STATE: &str = "GPU_SIM_STATE";

/// Environment variable naming the profile used to create a missing `GPU_SIM_STATE`.
pub const ENV_PROFILE: &str = "GPU_SIM_PROFILE";

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

/// Why a MIG layout change was refused. Each maps to the NVML return code and the
/// `nvidia-smi` wording of the real driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    /// The GPU has no MIG support (NVML `NOT_SUPPORTED`).
    #[error("Not Supported")]
    NotCapable,
    /// MIG mode is disabled on the GPU (NVML `NOT_SUPPORTED`).
    #[error("MIG mode is not enabled")]
    NotEnabled,
    /// The GPU does not offer this GI profile ID, or the GPU instance does not offer this
    /// CI profile (NVML `INVALID_ARGUMENT`).
    #[error("Invalid Argument")]
    UnknownProfile,
    /// The placement start is not valid for the profile (NVML `INVALID_ARGUMENT`).
    #[error("Invalid Argument")]
    BadPlacement,
    /// The slices are taken, or no instance ID is free (NVML `INSUFFICIENT_RESOURCES`).
    #[error("Insufficient Resources")]
    Insufficient,
    /// No such GPU, GPU instance or compute instance (NVML `NOT_FOUND`).
    #[error("Not Found")]
    NotFound,
    /// The instance still has compute instances, or MIG devices exist (NVML `IN_USE`).
    #[error("In use by another client")]
    InUse,
}

impl State {
    fn mig_gpu(
        &mut self,
        gpu: usize,
    ) -> Result<(&'static [mig::GiProfile], &mut GpuState), MigError> {
        let spec = self.profile.gpus.get(gpu).ok_or(MigError::NotFound)?;
        let table = spec.mig_profiles().ok_or(MigError::NotCapable)?;
        let st = self.gpus.get_mut(gpu).ok_or(MigError::NotFound)?;
        Ok((table, st))
    }

    /// Enables or disables MIG mode (immediately, like a reset-less Hopper toggle).
    /// Disabling while GPU instances exist is refused.
    pub fn set_mig_mode(&mut self, gpu: usize, enabled: bool) -> Result<(), MigError> {
        let (_, st) = self.mig_gpu(gpu)?;
        if !enabled && !st.gpu_instances.is_empty() {
            return Err(MigError::InUse);
        }
        st.mig_current = enabled;
        st.mig_pending = enabled;
        if enabled {
            // Compute mode is not applicable to a MIG-enabled GPU.
            st.compute_mode = ComputeMode::Default;
        }
        Ok(())
    }

    /// The table and state of a MIG-capable GPU (read only).
    fn mig_gpu_ref(&self, gpu: usize) -> Result<(&'static [mig::GiProfile], &GpuState), MigError> {
        let spec = self.profile.gpus.get(gpu).ok_or(MigError::NotFound)?;
        let table = spec.mig_profiles().ok_or(MigError::NotCapable)?;
        let st = self.gpus.get(gpu).ok_or(MigError::NotFound)?;
        Ok((table, st))
    }

    /// The starts of `p`'s placements that no existing GPU instance overlaps, ascending.
    fn free_gi_starts(table: &[mig::GiProfile], st: &GpuState, p: &mig::GiProfile) -> Vec<u32> {
        let used: Vec<(u32, u32)> = st
            .gpu_instances
            .iter()
            .filter_map(|gi| {
                mig::by_id(table, gi.profile_id).map(|q| (gi.placement_start, q.placement_size))
            })
            .collect();
        p.placement_starts
            .iter()
            .copied()
            .filter(|s| {
                !used
                    .iter()
                    .any(|(u, z)| mig::overlaps(*u, *z, *s, p.placement_size))
            })
            .collect()
    }

    /// How many more GPU instances of `profile_id` GPU `gpu` can take now
    /// (`nvmlDeviceGetGpuInstanceRemainingCapacity`, the "Free" of `nvidia-smi mig -lgip`):
    /// the free placements, capped by what the profile's `instanceCount` leaves. A profile's
    /// own placements never overlap each other, so each free one can be used.
    pub fn gpu_instance_capacity(&self, gpu: usize, profile_id: u32) -> Result<u32, MigError> {
        let (table, st) = self.mig_gpu_ref(gpu)?;
        if !st.mig_current {
            return Err(MigError::NotEnabled);
        }
        let p = mig::by_id(table, profile_id).ok_or(MigError::UnknownProfile)?;
        let existing = st
            .gpu_instances
            .iter()
            .filter(|gi| gi.profile_id == profile_id)
            .count() as u32;
        let free = State::free_gi_starts(table, st, p).len() as u32;
        Ok(free.min(p.instance_count.saturating_sub(existing)))
    }

    /// Creates a GPU instance of `profile_id`, at `start` or at the first free placement
    /// (tried from the highest start down, as drivers fill from the top). Returns its ID:
    /// the lowest free ID, deliberately unrelated to the placement.
    ///
    /// The one implementation of the placement rules: `nvidia-smi mig -cgi` and
    /// `nvmlDeviceCreateGpuInstance[WithPlacement]` both come here.
    pub fn create_gpu_instance(
        &mut self,
        gpu: usize,
        profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, MigError> {
        let (table, st) = self.mig_gpu(gpu)?;
        if !st.mig_current {
            return Err(MigError::NotEnabled);
        }
        let p = mig::by_id(table, profile_id).ok_or(MigError::UnknownProfile)?;
        let count = st
            .gpu_instances
            .iter()
            .filter(|gi| gi.profile_id == profile_id)
            .count();
        if let Some(s) = start
            && !p.is_valid_start(s)
        {
            return Err(MigError::BadPlacement);
        }
        if count >= p.instance_count as usize {
            return Err(MigError::Insufficient);
        }
        let free = State::free_gi_starts(table, st, p);
        let start = match start {
            Some(s) if !free.contains(&s) => return Err(MigError::Insufficient),
            Some(s) => s,
            None => *free.last().ok_or(MigError::Insufficient)?,
        };
        let first = if p.placement_size == mig::MEMORY_SLICES {
            0
        } else {
            1
        };
        let id = (first..mig::MAX_GPU_INSTANCES)
            .find(|id| st.gpu_instances.iter().all(|gi| gi.id != *id))
            .ok_or(MigError::Insufficient)?;
        st.gpu_instances.push(GpuInstance {
            id,
            profile_id,
            placement_start: start,
            compute_instances: Vec::new(),
        });
        st.gpu_instances.sort_by_key(|gi| gi.id);
        Ok(id)
    }

    /// GPU instance `gi` of a MIG-enabled GPU and its profile.
    fn gpu_instance_ref(
        &self,
        gpu: usize,
        gi: u32,
    ) -> Result<(&GpuInstance, &'static mig::GiProfile), MigError> {
        let (table, st) = self.mig_gpu_ref(gpu)?;
        if !st.mig_current {
            return Err(MigError::NotEnabled);
        }
        let inst = st
            .gpu_instances
            .iter()
            .find(|x| x.id == gi)
            .ok_or(MigError::NotFound)?;
        let p = mig::by_id(table, inst.profile_id).ok_or(MigError::UnknownProfile)?;
        Ok((inst, p))
    }

    /// Compute slices of CI profile `ci_profile` inside a GI of profile `p`, if it offers it.
    fn ci_slices_in(p: &mig::GiProfile, ci_profile: u32) -> Result<u32, MigError> {
        mig::ci_profile_slices(ci_profile)
            .filter(|c| *c <= p.slice_count)
            .ok_or(MigError::UnknownProfile)
    }

    /// The compute-slice starts for a `c`-slice CI that no compute instance of `inst` overlaps.
    fn free_ci_starts(inst: &GpuInstance, p: &mig::GiProfile, c: u32) -> Vec<u32> {
        mig::ci_placement_starts(c, p.slice_count)
            .into_iter()
            .filter(|s| {
                !inst
                    .compute_instances
                    .iter()
                    .any(|ci| mig::overlaps(ci.placement_start, ci.slice_count, *s, c))
            })
            .collect()
    }

    /// How many more compute instances of CI profile `ci_profile` GPU instance `gi` can
    /// take now (`nvmlGpuInstanceGetComputeInstanceRemainingCapacity`).
    pub fn compute_instance_capacity(
        &self,
        gpu: usize,
        gi: u32,
        ci_profile: u32,
    ) -> Result<u32, MigError> {
        let (inst, p) = self.gpu_instance_ref(gpu, gi)?;
        let c = State::ci_slices_in(p, ci_profile)?;
        Ok(State::free_ci_starts(inst, p, c).len() as u32)
    }

    /// Creates the full-size (default) compute instance in GPU instance `gi`; returns its ID.
    pub fn create_compute_instance(&mut self, gpu: usize, gi: u32) -> Result<u32, MigError> {
        let (_, p) = self.gpu_instance_ref(gpu, gi)?;
        self.create_compute_instance_with(gpu, gi, p.default_ci_profile(), None)
    }

    /// Creates a compute instance of CI profile `ci_profile` (the NVML constant, which is also
    /// its ID) in GPU instance `gi`, at compute slice `start` or the first free placement;
    /// returns its ID (the lowest free one). Refused: a profile the GI does not offer
    /// (`UnknownProfile`), a start that is not one of the profile's (`BadPlacement`), slices
    /// taken by another compute instance (`Insufficient`).
    pub fn create_compute_instance_with(
        &mut self,
        gpu: usize,
        gi: u32,
        ci_profile: u32,
        start: Option<u32>,
    ) -> Result<u32, MigError> {
        let (inst, p) = self.gpu_instance_ref(gpu, gi)?;
        let c = State::ci_slices_in(p, ci_profile)?;
        if let Some(s) = start
            && !mig::ci_placement_starts(c, p.slice_count).contains(&s)
        {
            return Err(MigError::BadPlacement);
        }
        let free = State::free_ci_starts(inst, p, c);
        let start = match start {
            Some(s) if !free.contains(&s) => return Err(MigError::Insufficient),
            Some(s) => s,
            None => *free.first().ok_or(MigError::Insufficient)?,
        };
        let id = (0..mig::MAX_COMPUTE_INSTANCES)
            .find(|id| inst.compute_instances.iter().all(|ci| ci.id != *id))
            .ok_or(MigError::Insufficient)?;
        let parent = self.profile.gpus[gpu].uuid.clone();
        self.generation += 1;
        let uuid = mig_uuid(&parent, gi, id, self.generation);
        let (_, st) = self.mig_gpu(gpu)?;
        let inst = st
            .gpu_instances
            .iter_mut()
            .find(|x| x.id == gi)
            .ok_or(MigError::NotFound)?;
        inst.compute_instances.push(ComputeInstance {
            id,
            profile_id: ci_profile,
            placement_start: start,
            slice_count: c,
            uuid,
        });
        inst.compute_instances.sort_by_key(|ci| ci.id);
        Ok(id)
    }

    /// Destroys compute instance `ci` of GPU instance `gi`.
    pub fn destroy_compute_instance(
        &mut self,
        gpu: usize,
        gi: u32,
        ci: u32,
    ) -> Result<(), MigError> {
        let (_, st) = self.mig_gpu(gpu)?;
        let inst = st
            .gpu_instances
            .iter_mut()
            .find(|x| x.id == gi)
            .ok_or(MigError::NotFound)?;
        let before = inst.compute_instances.len();
        inst.compute_instances.retain(|c| c.id != ci);
        if inst.compute_instances.len() == before {
            return Err(MigError::NotFound);
        }
        Ok(())
    }

    /// Destroys GPU instance `gi` (refused while it has compute instances).
    pub fn destroy_gpu_instance(&mut self, gpu: usize, gi: u32) -> Result<(), MigError> {
        let (_, st) = self.mig_gpu(gpu)?;
        let pos = st
            .gpu_instances
            .iter()
            .position(|x| x.id == gi)
            .ok_or(MigError::NotFound)?;
        if !st.gpu_instances[pos].compute_instances.is_empty() {
            return Err(MigError::InUse);
        }
        st.gpu_instances.remove(pos);
        Ok(())
    }
}

/// Deterministic MIG UUID with RFC-4122 version-5 shape, derived from the parent UUID, the
/// instance IDs and a creation counter (so a recreated device gets a new UUID, as on real
/// drivers).
pub fn mig_uuid(parent: &str, gi: u32, ci: u32, generation: u64) -> String {
    let seed = format!("{parent}/{gi}/{ci}/{generation}");
    let a = fnv1a(0xcbf2_9ce4_8422_2325, seed.as_bytes());
    let b = fnv1a(a ^ 0x9e37_79b9_7f4a_7c15, seed.as_bytes());
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&a.to_be_bytes());
    bytes[8..].copy_from_slice(&b.to_be_bytes());
    bytes[6] = (bytes[6] & 0x0f) | 0x50;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "MIG-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn fnv1a(mut hash: u64, data: &[u8]) -> u64 {
    for b in data {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Final avalanche so that close seeds differ in every byte.
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash
}

/// The state file of one simulated host.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// A handle on the state file at `path` (nothing is read yet).
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    /// The state file under a simulated root.
    pub fn under_root(root: &Path) -> StateFile {
        StateFile::new(root.join(STATE_RELATIVE))
    }

    /// The state file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".lock");
        PathBuf::from(p)
    }

    fn io(&self, path: &Path) -> impl FnOnce(std::io::Error) -> SimError {
        let path = path.to_path_buf();
        move |source| SimError::Io { path, source }
    }

    fn open_lock(&self) -> Result<File, SimError> {
        let lock = self.lock_path();
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock)
            .map_err(self.io(&lock))
    }

    /// The simulated root this file belongs to, when it sits at `<root>/etc/gpu-sim/state.json`
    /// (`/` inside a container, where the node's `etc/gpu-sim` is mounted at `/etc/gpu-sim`).
    pub fn root(&self) -> Option<PathBuf> {
        let mut p = self.path.clone();
        if !p.ends_with(STATE_RELATIVE) {
            return None;
        }
        for _ in 0..3 {
            p.pop();
        }
        Some(p)
    }

    /// The `dev/` folder whose nodes decide what this process sees (see the module doc), if
    /// there is one; without it (a bare state file) every device is visible.
    pub fn dev_dir(&self) -> Option<PathBuf> {
        self.root().map(|r| r.join("dev")).filter(|d| d.is_dir())
    }

    /// Reads the state as this process sees it: [`State::visible`] through [`Self::dev_dir`].
    pub fn load_visible(&self) -> Result<State, SimError> {
        let state = self.load()?;
        Ok(match self.dev_dir() {
            Some(dev) => state.visible(|name| dev.join(name).exists()),
            None => state,
        })
    }

    /// Opens the lock file for a shared lock: read-only when it exists, so that a state
    /// folder mounted read-only (as in containers) can still be read.
    fn open_lock_shared(&self) -> Result<File, SimError> {
        match File::open(self.lock_path()) {
            Ok(f) => Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.open_lock(),
            Err(e) => Err(SimError::Io {
                path: self.lock_path(),
                source: e,
            }),
        }
    }

    /// Reads the state under a shared lock.
    pub fn load(&self) -> Result<State, SimError> {
        let lock = self.open_lock_shared()?;
        lock.lock_shared().map_err(self.io(&self.lock_path()))?;
        let text = std::fs::read_to_string(&self.path).map_err(self.io(&self.path));
        // The lock is released when `lock` is dropped.
        let text = text?;
        self.parse(&text)
    }

    fn parse(&self, text: &str) -> Result<State, SimError> {
        serde_json::from_str(text).map_err(|e| SimError::InvalidState {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// Writes `state` as the new content (creating parent directories), under the
    /// exclusive lock.
    pub fn create(&self, state: &State) -> Result<(), SimError> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(self.io(dir))?;
        }
        let lock = self.open_lock()?;
        lock.lock().map_err(self.io(&self.lock_path()))?;
        self.write_atomic(state)
    }

    /// Applies `f` to the state under the exclusive lock and writes the result back if `f`
    /// succeeds. Returns what `f` returned.
    pub fn update<T, E>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T, E>,
    ) -> Result<Result<T, E>, SimError> {
        let lock = self.open_lock()?;
        lock.lock().map_err(self.io(&self.lock_path()))?;
        let text = std::fs::read_to_string(&self.path).map_err(self.io(&self.path))?;
        let mut state = self.parse(&text)?;
        if let Some(dev) = self.dev_dir()
            && state.visible(|name| dev.join(name).exists()) != state
        {
            return Err(SimError::NotPermitted {
                path: self.path.clone(),
                dev,
            });
        }
        let before = state.clone();
        let out = f(&mut state);
        if out.is_ok() && state != before {
            self.write_atomic(&state)?;
        }
        Ok(out)
    }

    /// Replaces the file with `state`; the caller holds the exclusive lock. The lock is on
    /// the sibling lock file, not on the state file, so replacing the state file by a rename
    /// keeps every other process's lock meaningful.
    fn write_atomic(&self, state: &State) -> Result<(), SimError> {
        let mut text = serde_json::to_vec_pretty(state).map_err(|e| SimError::InvalidState {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        text.push(b'\n');
        if let (Some(dir), Some(name)) = (self.path.parent(), self.path.file_name()) {
            // Temps of processes killed mid-write go (no writer holds them any more).
            gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy());
        }
        // 0o666 less the umask: the mode `File::create` gave the file before.
        gpu_dra_fsutil::write_atomic(&self.path, &text, 0o666).map_err(self.io(&self.path))
    }
}

/// Finds the state file for a process: `GPU_SIM_STATE` (created from `GPU_SIM_PROFILE`
/// when missing), else the first `etc/gpu-sim/state.json` found walking up from `anchor`
/// (the library's or executable's own path).
pub fn locate(anchor: Option<&Path>) -> Result<StateFile, SimError> {
    if let Some(path) = std::env::var_os(ENV_STATE).filter(|p| !p.is_empty()) {
        let file = StateFile::new(PathBuf::from(path));
        if !file.path().exists() {
            match std::env::var(ENV_PROFILE) {
                Ok(profile) if !profile.is_empty() => {
                    let state = State::from_profile(Profile::load(&profile)?);
                    file.create(&state)?;
                }
                _ => {
                    return Err(SimError::NoState {
                        searched: file.path().display().to_string(),
                    });
                }
            }
        }
        return Ok(file);
    }
    let Some(anchor) = anchor else {
        return Err(SimError::NoState {
            searched: format!("${ENV_STATE} (unset)"),
        });
    };
    let mut dir = anchor.parent();
    while let Some(d) = dir {
        let candidate = d.join(STATE_RELATIVE);
        if candidate.is_file() {
            return Ok(StateFile::new(candidate));
        }
        dir = d.parent();
    }
    Err(SimError::NoState {
        searched: format!(
            "${ENV_STATE} (unset) and {STATE_RELATIVE} above {}",
            anchor.display()
        ),
    })
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
    fn mig_layout_changes_follow_driver_rules() {
        let mut s = State::from_profile(Profile::load("dgx-a100-40gb").expect("profile"));
        // GPU 0: 1g@0, 1g@1, 2g@2, 3g@4 taken: nothing fits any more.
        assert_eq!(
            s.create_gpu_instance(0, 19, None),
            Err(MigError::Insufficient)
        );
        // GPU 5: MIG off.
        assert_eq!(
            s.create_gpu_instance(5, 19, None),
            Err(MigError::NotEnabled)
        );
        s.set_mig_mode(5, true).expect("enable");
        let a = s.create_gpu_instance(5, 9, Some(4)).expect("3g at 4");
        assert_eq!(
            s.create_gpu_instance(5, 9, Some(4)),
            Err(MigError::Insufficient)
        );
        assert_eq!(
            s.create_gpu_instance(5, 14, Some(1)),
            Err(MigError::BadPlacement)
        );
        assert_eq!(
            s.create_gpu_instance(5, 99, None),
            Err(MigError::UnknownProfile)
        );
        let b = s.create_gpu_instance(5, 19, None).expect("1g");
        assert_ne!(a, b);
        // Automatic placement fills from the top of the free range.
        let gi = s.gpus[5]
            .gpu_instances
            .iter()
            .find(|g| g.id == b)
            .expect("gi");
        assert_eq!(gi.placement_start, 3);
        assert!(s.mig_devices(5).is_empty(), "no CI yet, no MIG device");
        s.create_compute_instance(5, a).expect("ci");
        let uuid = s.mig_devices(5)[0].ci.uuid.clone();
        assert_eq!(s.destroy_gpu_instance(5, a), Err(MigError::InUse));
        assert_eq!(s.set_mig_mode(5, false), Err(MigError::InUse));
        s.destroy_compute_instance(5, a, 0).expect("destroy ci");
        s.destroy_gpu_instance(5, a).expect("destroy gi");
        // Recreated in the same place: new UUID.
        let a2 = s.create_gpu_instance(5, 9, Some(4)).expect("again");
        s.create_compute_instance(5, a2).expect("ci");
        let m = s.mig_devices(5);
        assert_ne!(m[0].ci.uuid, uuid);
        assert_eq!(
            s.create_gpu_instance(0, 0, None).err(),
            Some(MigError::Insufficient)
        );
        let mut t4 = State::from_profile(Profile::load("t4").expect("t4"));
        assert_eq!(t4.set_mig_mode(0, true), Err(MigError::NotCapable));
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

    #[test]
    fn mig_uuid_changes_with_generation() {
        assert_ne!(mig_uuid("GPU-a", 1, 0, 1), mig_uuid("GPU-a", 1, 0, 2));
        assert_eq!(mig_uuid("GPU-a", 1, 0, 1), mig_uuid("GPU-a", 1, 0, 1));
    }

    #[test]
    fn update_is_persisted_and_failed_update_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let r: Result<(), ()> = file
            .update(|s| {
                s.gpus[0].timeslice = 2;
                Ok(())
            })
            .expect("update");
        assert!(r.is_ok());
        assert_eq!(file.load().expect("load").gpus[0].timeslice, 2);
        let r: Result<(), &str> = file
            .update(|s| {
                s.gpus[0].timeslice = 3;
                Err("no")
            })
            .expect("update");
        assert_eq!(r, Err("no"));
        assert_eq!(file.load().expect("load").gpus[0].timeslice, 2);
    }

    #[test]
    fn concurrent_updates_are_not_lost() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                // Each thread opens its own lock file description, like separate processes.
                let file = file.clone();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        file.update(|s| {
                            s.generation += 1;
                            Ok::<(), ()>(())
                        })
                        .expect("update")
                        .expect("ok");
                        let _ = file.load().expect("readers never see a torn file");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        assert_eq!(file.load().expect("load").generation, 100);
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

    #[test]
    fn load_visible_follows_the_dev_folder_and_update_refuses_a_partial_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(
            Profile::load("dgx-h100").expect("h100"),
        ))
        .expect("create");
        // No dev folder: a bare state file shows everything.
        assert_eq!(file.load_visible().expect("load").gpus.len(), 8);
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).expect("dev");
        for m in [1, 3] {
            std::fs::write(dev.join(format!("nvidia{m}")), b"").expect("node");
        }
        let v = file.load_visible().expect("load");
        assert_eq!(
            v.profile.gpus.iter().map(|g| g.minor).collect::<Vec<_>>(),
            [1, 3]
        );
        assert_eq!(file.load().expect("raw").gpus.len(), 8, "load stays raw");
        let err = file
            .update(|s| {
                s.gpus[0].timeslice = 1;
                Ok::<(), ()>(())
            })
            .expect_err("partial view");
        assert!(matches!(err, SimError::NotPermitted { .. }), "{err}");
        assert_eq!(file.load().expect("raw").gpus[0].timeslice, 0);
        for m in 0..8 {
            std::fs::write(dev.join(format!("nvidia{m}")), b"").expect("node");
        }
        file.update(|s| {
            s.gpus[0].timeslice = 1;
            Ok::<(), ()>(())
        })
        .expect("whole view")
        .expect("applied");
        assert_eq!(file.load_visible().expect("load").gpus[0].timeslice, 1);
    }

    #[test]
    fn load_works_on_a_read_only_state_folder() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let folder = file.path().parent().expect("folder").to_path_buf();
        let lock = folder.join("state.json.lock");
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o444)).expect("chmod");
        // Root ignores file modes, so this checks that the lock is opened read-only: a
        // read-write open of a read-only file fails for everyone else.
        let f = File::open(&lock).expect("read-only open");
        drop(f);
        assert_eq!(file.load().expect("load").profile.name, "t4");
        assert_eq!(file.root().as_deref(), Some(dir.path()));
        assert_eq!(StateFile::new("/x/state.json").root(), None);
    }

    #[test]
    fn locate_walks_up_from_the_anchor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = StateFile::under_root(dir.path());
        file.create(&State::from_profile(Profile::load("t4").expect("t4")))
            .expect("create");
        let lib = dir
            .path()
            .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        // Only meaningful when GPU_SIM_STATE is not set in the test environment.
        if std::env::var_os(ENV_STATE).is_none() {
            let found = locate(Some(&lib)).expect("found");
            assert_eq!(found.path(), file.path());
            let err = locate(Some(Path::new("/nonexistent/lib.so"))).expect_err("none");
            assert!(err.to_string().contains("state.json"), "{err}");
        }
    }
}
