//! The seam between prepare and the MIG hardware: create, destroy and list the MIG instances
//! of dynamic MIG GPUs.
//!
//! [`MigControl`] is the one small trait the driver calls; [`NvmlMig`] carries it out over
//! [`gpu_dra_nvml::MigOps`] (raw NVML), [`NoMig`] refuses with a message saying why (an
//! inventory fixture has no hardware); `testing::FakeMig` keeps instances in memory for the
//! driver's tests. The calls block (NVML); the driver runs them on the blocking pool.
//!
//! Instances are named by (GPU UUID, GI ID, CI ID) as in `MigOps`: IDs survive a restart of
//! the plugin, handles do not. The MIG device UUID is new on every creation, so it is what
//! tells an instance from a later one that reuses its IDs.

/// A MIG instance (GPU instance and its compute instance) that exists on a GPU: the NVML
/// backend's own type, so listings pass through unchanged.
pub use gpu_dra_nvml::MigInstance;

/// Why a MIG operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}")]
pub struct MigError {
    /// What went wrong, with the NVML call and return code when NVML said it.
    pub reason: String,
}

impl From<gpu_dra_nvml::MigOpsError> for MigError {
    fn from(e: gpu_dra_nvml::MigOpsError) -> Self {
        MigError {
            reason: e.to_string(),
        }
    }
}

/// Creates, destroys and lists MIG instances. Blocking.
pub trait MigControl: Send + Sync {
    /// Creates a GPU instance of `gi_profile_id` at memory slice `start` on `gpu_uuid` and its
    /// full-size compute instance; leaves nothing behind when it fails.
    fn create(
        &self,
        gpu_uuid: &str,
        gi_profile_id: u32,
        start: u32,
    ) -> Result<MigInstance, MigError>;
    /// Destroys compute instance `ci_id` of GPU instance `gi_id`, then the GPU instance; what
    /// is gone already is success.
    fn destroy(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), MigError>;
    /// The instances that exist on `gpu_uuid`.
    fn list(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, MigError>;
}

/// [`MigControl`] over NVML. Every operation opens its own NVML session from a fresh lookup of
/// the library and closes it when done: no handle is held between claims, so a driver upgraded
/// in place is reached through its new library, and a session never spans the swap.
#[derive(Debug)]
pub struct NvmlMig {
    library: gpu_dra_nvml::NvmlLibrary,
}

impl NvmlMig {
    /// MIG operations through the NVML library `library` names at each call.
    pub fn new(library: gpu_dra_nvml::NvmlLibrary) -> Self {
        NvmlMig { library }
    }

    /// MIG operations through the library at `lib_path`, checked to initialise now.
    pub fn open(lib_path: &std::path::Path) -> Result<Self, MigError> {
        drop(gpu_dra_nvml::MigOps::open(lib_path)?);
        Ok(NvmlMig::new(gpu_dra_nvml::NvmlLibrary::Path(
            lib_path.to_path_buf(),
        )))
    }

    /// A session for one operation.
    fn ops(&self) -> Result<gpu_dra_nvml::MigOps, MigError> {
        let path = self.library.locate().map_err(|e| MigError {
            reason: e.to_string(),
        })?;
        Ok(gpu_dra_nvml::MigOps::open(&path)?)
    }
}

impl MigControl for NvmlMig {
    fn create(
        &self,
        gpu_uuid: &str,
        gi_profile_id: u32,
        start: u32,
    ) -> Result<MigInstance, MigError> {
        let created = self
            .ops()?
            .create_mig_device(gpu_uuid, gi_profile_id, start)?;
        // The placement's size is what the driver made: read it back with the instance.
        self.list(gpu_uuid)?
            .into_iter()
            .find(|m| m.gi_id == created.gi_id && m.ci_id == created.ci_id)
            .ok_or_else(|| MigError {
                reason: format!(
                    "GPU instance {} of GPU {gpu_uuid} was created but is not listed",
                    created.gi_id
                ),
            })
    }

    fn destroy(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), MigError> {
        Ok(self.ops()?.destroy_mig_device(gpu_uuid, gi_id, ci_id)?)
    }

    fn list(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, MigError> {
        Ok(self.ops()?.list_mig_instances(gpu_uuid)?)
    }
}

/// [`MigControl`] where no MIG hardware is reachable: every call fails, saying why.
#[derive(Debug, Clone)]
pub struct NoMig(pub String);

impl MigControl for NoMig {
    fn create(&self, gpu_uuid: &str, _: u32, _: u32) -> Result<MigInstance, MigError> {
        Err(MigError {
            reason: format!("cannot create a MIG instance on GPU {gpu_uuid}: {}", self.0),
        })
    }

    fn destroy(&self, gpu_uuid: &str, _: u32, _: u32) -> Result<(), MigError> {
        Err(MigError {
            reason: format!(
                "cannot destroy a MIG instance on GPU {gpu_uuid}: {}",
                self.0
            ),
        })
    }

    fn list(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, MigError> {
        Err(MigError {
            reason: format!(
                "cannot list the MIG instances of GPU {gpu_uuid}: {}",
                self.0
            ),
        })
    }
}
