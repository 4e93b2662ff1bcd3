//! A MIG backend in memory, for the driver's dynamic MIG paths without hardware.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpu_dra_device::{Inventory, Placement};

use super::simulate_host;
use crate::mig::{MigControl, MigError, MigInstance};

/// In-memory [`MigControl`] for tests: sizes from a table of (profile ID, memory slices),
/// overlap refused as the driver refuses it, IDs counted up, UUIDs never reused.
#[derive(Debug, Clone, Default)]
pub struct FakeMig {
    state: Arc<Mutex<FakeState>>,
}

#[derive(Debug, Default)]
struct FakeState {
    sizes: Vec<(u32, u32)>,
    instances: Vec<(String, MigInstance)>,
    created: u32,
    fail_create: Option<String>,
    fail_destroy: Option<String>,
}

impl FakeMig {
    /// A fake whose profiles have the given (GI profile ID, memory slices).
    pub fn new(sizes: &[(u32, u32)]) -> Self {
        let fake = FakeMig::default();
        fake.lock().sizes = sizes.to_vec();
        fake
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every instance, as (GPU UUID, instance).
    pub fn instances(&self) -> Vec<(String, MigInstance)> {
        self.lock().instances.clone()
    }

    /// An inventory backend that discovers `base` with this fake's instances as the MIG
    /// devices of their GPUs (engines from the GPU's profile), and lays out their capability
    /// files and device nodes under `host` as [`simulate_host`] does.
    pub fn inventory(&self, base: Inventory, host: &Path) -> Arc<dyn gpu_dra_device::GpuInventory> {
        Arc::new(FakeMigInventory {
            fake: self.clone(),
            base,
            host: host.to_path_buf(),
        })
    }

    /// Makes the next creations fail with `reason` (`None`: succeed again).
    pub fn fail_create(&self, reason: Option<&str>) {
        self.lock().fail_create = reason.map(str::to_owned);
    }

    /// Makes the next destructions of existing instances fail with `reason`, as NVML refuses
    /// an instance in use (`None`: succeed again).
    pub fn fail_destroy(&self, reason: Option<&str>) {
        self.lock().fail_destroy = reason.map(str::to_owned);
    }
}

impl MigControl for FakeMig {
    fn create(
        &self,
        gpu_uuid: &str,
        gi_profile_id: u32,
        start: u32,
    ) -> Result<MigInstance, MigError> {
        let mut st = self.lock();
        if let Some(reason) = &st.fail_create {
            return Err(MigError {
                reason: reason.clone(),
            });
        }
        let size = st
            .sizes
            .iter()
            .find(|(id, _)| *id == gi_profile_id)
            .map(|(_, size)| *size)
            .ok_or_else(|| MigError {
                reason: format!("profile {gi_profile_id} unknown (NVML return code 2)"),
            })?;
        let taken = st.instances.iter().any(|(gpu, m)| {
            gpu == gpu_uuid
                && m.placement.start < start + size
                && start < m.placement.start + m.placement.size
        });
        if taken {
            return Err(MigError {
                reason: format!(
                    "profile {gi_profile_id} at {start} on {gpu_uuid}: Insufficient Resources (NVML return code 23)"
                ),
            });
        }
        st.created += 1;
        let gi_id = (1..)
            .find(|id| {
                !st.instances
                    .iter()
                    .any(|(gpu, m)| gpu == gpu_uuid && m.gi_id == *id)
            })
            .unwrap_or(1);
        let made = MigInstance {
            gi_id,
            ci_id: 0,
            gi_profile_id,
            placement: Placement { start, size },
            uuid: format!("MIG-00000000-0000-5000-8000-{:012}", st.created),
        };
        st.instances.push((gpu_uuid.to_owned(), made.clone()));
        Ok(made)
    }

    fn destroy(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), MigError> {
        let mut st = self.lock();
        let at = |(gpu, m): &(String, MigInstance)| {
            gpu == gpu_uuid && m.gi_id == gi_id && m.ci_id == ci_id
        };
        if let Some(reason) = &st.fail_destroy
            && st.instances.iter().any(at)
        {
            return Err(MigError {
                reason: reason.clone(),
            });
        }
        st.instances.retain(|i| !at(i));
        Ok(())
    }

    fn list(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, MigError> {
        Ok(self
            .lock()
            .instances
            .iter()
            .filter(|(gpu, _)| gpu == gpu_uuid)
            .map(|(_, m)| m.clone())
            .collect())
    }
}

/// See [`FakeMig::inventory`].
struct FakeMigInventory {
    fake: FakeMig,
    base: Inventory,
    host: PathBuf,
}

impl gpu_dra_device::GpuInventory for FakeMigInventory {
    fn discover(&self) -> Result<Inventory, gpu_dra_device::DeviceError> {
        let mut inv = self.base.clone();
        for (uuid, m) in self.fake.instances() {
            let Some(gpu) = inv.gpus.iter_mut().find(|g| g.uuid == uuid) else {
                continue;
            };
            let Some(p) = gpu
                .mig_profiles
                .iter()
                .find(|p| p.gi_profile_id == m.gi_profile_id)
            else {
                continue;
            };
            gpu.mig_devices
                .push(p.device(m.placement, m.uuid.clone(), m.gi_id, m.ci_id));
        }
        simulate_host(&self.host, &inv).map_err(|e| gpu_dra_device::DeviceError::Query {
            call: "simulate_host",
            target: self.host.display().to_string(),
            reason: e.to_string(),
        })?;
        Ok(inv)
    }
}
