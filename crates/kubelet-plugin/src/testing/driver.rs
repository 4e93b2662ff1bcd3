//! The driver in-process: built from its real parts for a simulated host, with test doubles
//! where the node's hardware or the API server would be.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_dra_device::Inventory;

use super::{DRIVER_NAME, ExclusiveOnly, MemoryClaims, NODE_NAME};
use crate::cdi_io::CdiHost;
use crate::claims::ClaimSource;
use crate::driver::{Driver, DriverError, DriverParts, DriverSettings};
use crate::failpoint::Failpoints;
use crate::grpc::DraService;
use crate::metrics::Metrics;
use crate::mig::{MigControl, NoMig};
use crate::sharing::SharingExecutor;

/// Builds a [`Driver`] for tests: exclusive sharing only, the api crate's config decoder, no
/// failpoints, CDI specs for the simulated host under `<root>/host`.
#[must_use]
pub struct DriverBuilder {
    root: PathBuf,
    inventory: Inventory,
    claims: Arc<dyn ClaimSource>,
    node_name: String,
    checkpoint_path: PathBuf,
    metrics: Arc<Metrics>,
    sharing: Arc<dyn SharingExecutor>,
    boot_id: Option<String>,
    mig: Arc<dyn MigControl>,
    backend: Option<Arc<dyn gpu_dra_device::GpuInventory>>,
    partitioning: gpu_dra_core::partitioning::Partitioning,
    failpoints: Failpoints,
    claim_status: Option<Arc<dyn crate::claim_status::ClaimStatusSink>>,
    node_events: Option<Arc<dyn crate::node_events::NodeEvents>>,
    host: Option<PathBuf>,
    device_metadata: crate::device_metadata::DeviceMetadataSettings,
}

impl DriverBuilder {
    /// A driver for `inventory` on node [`NODE_NAME`], with claims in memory (empty), CDI specs
    /// in `<root>/cdi`, the checkpoint in `<root>/plugin/gpu-dra-checkpoint.json`, sharing
    /// refused ([`ExclusiveOnly`]), no boot ID and no device metadata files (their folder is
    /// `<root>/plugin/device-metadata`). Call [`simulate_host`] on `<root>/host`
    /// first for specs that point at existing files.
    pub fn new(root: &Path, inventory: Inventory) -> Self {
        DriverBuilder {
            root: root.to_path_buf(),
            inventory,
            claims: Arc::new(MemoryClaims::default()),
            node_name: NODE_NAME.into(),
            checkpoint_path: root
                .join("plugin")
                .join(gpu_dra_core::checkpoint::FILE_NAME),
            metrics: Arc::new(Metrics::default()),
            sharing: Arc::new(ExclusiveOnly),
            boot_id: None,
            mig: Arc::new(NoMig("no MIG hardware in this test".into())),
            backend: None,
            partitioning: Default::default(),
            failpoints: Failpoints::default(),
            claim_status: None,
            node_events: None,
            host: None,
            device_metadata: crate::device_metadata::DeviceMetadataSettings {
                dir: crate::node_layout::device_metadata_dir_in(&root.join("plugin")),
                enabled: false,
                list_forms: false,
            },
        }
    }

    /// Writes device metadata files at prepare (`--device-metadata`), with the list forms of
    /// attributes when `list_forms` (`--list-type-attributes`).
    pub fn device_metadata(mut self, list_forms: bool) -> Self {
        self.device_metadata.enabled = true;
        self.device_metadata.list_forms = list_forms;
        self
    }

    /// Sets the inventory backend that prepare checks and rediscovers through (e.g. the NVML
    /// backend over a simulated host); default: a fixture serving the inventory.
    pub fn backend(mut self, backend: Arc<dyn gpu_dra_device::GpuInventory>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Sets the host root (driver root and dev root) CDI specs are made for, e.g. a
    /// simulator's root; default `<root>/host`.
    pub fn host(mut self, host: &Path) -> Self {
        self.host = Some(host.to_path_buf());
        self
    }

    /// Sets the MIG control and the inventory backend that rediscovery reads (e.g. a
    /// [`FakeMig`] and its [`FakeMig::inventory`]), and how each GPU is offered.
    pub fn dynamic_mig(
        mut self,
        mig: Arc<dyn MigControl>,
        backend: Arc<dyn gpu_dra_device::GpuInventory>,
        partitioning: gpu_dra_core::partitioning::Partitioning,
    ) -> Self {
        self.mig = mig;
        self.backend = Some(backend);
        self.partitioning = partitioning;
        self
    }

    /// Sets where the claims' device status goes (none by default).
    pub fn claim_status(mut self, sink: Arc<dyn crate::claim_status::ClaimStatusSink>) -> Self {
        self.claim_status = Some(sink);
        self
    }

    /// Sets where events about the node go (the log only by default).
    pub fn node_events(mut self, events: Arc<dyn crate::node_events::NodeEvents>) -> Self {
        self.node_events = Some(events);
        self
    }

    /// Sets the failpoints.
    pub fn failpoints(mut self, failpoints: Failpoints) -> Self {
        self.failpoints = failpoints;
        self
    }

    /// Sets the sharing executor (e.g. a recording fake).
    pub fn sharing(mut self, sharing: Arc<dyn SharingExecutor>) -> Self {
        self.sharing = sharing;
        self
    }

    /// Sets the node's current boot ID.
    pub fn boot_id(mut self, boot_id: &str) -> Self {
        self.boot_id = Some(boot_id.into());
        self
    }

    /// Sets the node (and pool) name.
    pub fn node_name(mut self, name: &str) -> Self {
        self.node_name = name.into();
        self
    }

    /// Sets where claims come from (keep a handle to a [`MemoryClaims`] to add claims later).
    pub fn claims(mut self, claims: Arc<dyn ClaimSource>) -> Self {
        self.claims = claims;
        self
    }

    /// Sets the checkpoint file.
    pub fn checkpoint_path(mut self, path: PathBuf) -> Self {
        self.checkpoint_path = path;
        self
    }

    /// Sets the metrics (keep a handle to read them).
    pub fn metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Builds the driver, loading the checkpoint if one exists.
    pub fn build(self) -> Result<Driver, DriverError> {
        let host = self.host.unwrap_or_else(|| self.root.join("host"));
        let cdi = CdiHost::discover(
            self.root.join("cdi"),
            &crate::host::DriverRoots::same(&host),
            &host,
            &self.inventory.driver_version,
            None,
        );
        Driver::new(DriverParts {
            settings: DriverSettings {
                driver_name: DRIVER_NAME.into(),
                node_name: self.node_name,
                checkpoint_path: self.checkpoint_path,
                boot_id: self.boot_id,
                device_metadata: self.device_metadata,
            },
            inventory: {
                let backend = self.backend.unwrap_or_else(|| {
                    Arc::new(gpu_dra_device::fixture::FixtureInventory::new(
                        self.inventory.clone(),
                    ))
                });
                let live = crate::inventory::LiveInventory::with_inventory(
                    backend,
                    self.inventory,
                    gpu_dra_core::health::HealthPolicy::new(DRIVER_NAME),
                );
                live.set_partitioning(self.partitioning);
                live
            },
            claims: self.claims,
            sharing: self.sharing,
            decoder: Arc::new(gpu_dra_core::plan::ApiDecoder),
            cdi: Arc::new(cdi),
            failpoints: self.failpoints,
            metrics: self.metrics,
            mig: self.mig,
            claim_status: self.claim_status,
            node_events: self.node_events,
        })
    }
}

/// The DRA gRPC service answering with `driver` at once (the plugin's own service waits until
/// its instance holds the node: [`DraService::deferred`]).
pub fn dra_service(driver: Arc<Driver>) -> DraService {
    let (_set, cell) = tokio::sync::watch::channel(Some(driver));
    DraService::deferred(cell)
}
