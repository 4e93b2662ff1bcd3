//! MIG layout changes on the state: MIG mode, creating and destroying GPU and compute
//! instances, and the remaining capacity for each profile.
//!
//! This is the one implementation of the driver's placement rules: `nvidia-smi mig` and the
//! NVML create/destroy exports both come here, so the two can never disagree.
//!
//! Invariants: GPU and compute instances stay sorted by ID; an instance ID is the lowest free
//! one, unrelated to the placement (as on real drivers); every compute instance created gets
//! a new MIG UUID ([`mig_uuid`] of a fresh `generation`), so a recreated device is a new
//! device to its consumers.

use super::{ComputeInstance, ComputeMode, GpuInstance, GpuState, State};
use crate::mig;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;

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
    fn mig_uuid_changes_with_generation() {
        assert_ne!(mig_uuid("GPU-a", 1, 0, 1), mig_uuid("GPU-a", 1, 0, 2));
        assert_eq!(mig_uuid("GPU-a", 1, 0, 1), mig_uuid("GPU-a", 1, 0, 1));
    }
}
