//! Builders for tests and benchmarks: simulated host folders, claims, a [`Driver`] wired for
//! tests, and the real plugin binary started as a child process.
//!
//! The one home of these fixtures, so unit tests, `tests/` and `examples/` build the driver and
//! launch the plugin the same way. Compiled for this crate's unit tests and behind the
//! `testing` feature, which only `[dev-dependencies]` enable: the plugin binary never
//! contains it. Inventories themselves come from `gpu_dra_device::testing`.
//!
//! Both [`DriverBuilder`] and [`PluginCommand`] lay everything out under one root folder
//! (`host/` the simulated host, `cdi/`, `plugin/` with the checkpoint and socket), so a test
//! that restarts the driver or the process on the same root finds its previous state.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use gpu_dra_device::Placement;

use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

use crate::cdi_io::CdiHost;
use crate::claims::{ClaimSource, MemoryClaims};
use crate::driver::{Driver, DriverError, DriverParts, DriverSettings};
use crate::failpoint::Failpoints;
use crate::metrics::Metrics;
use crate::mig::{MigControl, MigError, MigInstance, NoMig};
use crate::sharing::{ExclusiveOnly, SharingExecutor};

/// DRA driver name the fixtures use.
pub const DRIVER_NAME: &str = "gpu.nvidia.com";
/// Node (and pool) name the fixtures use unless told otherwise.
pub const NODE_NAME: &str = "node-a";

/// Creates, under `root`, the device nodes, MIG capability files and a few driver files the
/// inventory implies, laid out like a real host (regular files stand in for device nodes).
pub fn simulate_host(root: &Path, inventory: &Inventory) -> std::io::Result<()> {
    let dev = root.join("dev");
    std::fs::create_dir_all(dev.join("nvidia-caps"))?;
    for n in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
        std::fs::write(dev.join(n), "")?;
    }
    let mut cap = 1u32;
    for gpu in &inventory.gpus {
        std::fs::write(dev.join(format!("nvidia{}", gpu.minor)), "")?;
        for mig in &gpu.mig_devices {
            let gi = root.join(format!(
                "proc/driver/nvidia/capabilities/gpu{}/mig/gi{}",
                gpu.minor, mig.gi_id
            ));
            std::fs::create_dir_all(gi.join(format!("ci{}", mig.ci_id)))?;
            for file in [
                gi.join("access"),
                gi.join(format!("ci{}/access", mig.ci_id)),
            ] {
                cap += 1;
                std::fs::write(
                    &file,
                    format!("DeviceFileMinor: {cap}\nDeviceFileMode: 292\n"),
                )?;
                std::fs::write(dev.join(format!("nvidia-caps/nvidia-cap{cap}")), "")?;
            }
        }
    }
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib)?;
    for l in [
        "libcuda.so.",
        "libnvidia-ml.so.",
        "libnvidia-ptxjitcompiler.so.",
    ] {
        let file = format!("{l}{}", inventory.driver_version);
        std::fs::write(lib.join(&file), "")?;
        // The soname link the driver's installer makes (no ld cache here: the fallback
        // search finds the folder by it).
        let soname = lib.join(format!("{l}1"));
        let _ = std::fs::remove_file(&soname);
        std::os::unix::fs::symlink(&file, soname)?;
    }
    std::fs::create_dir_all(root.join("usr/bin"))?;
    std::fs::write(root.join("usr/bin/nvidia-smi"), "")?;
    let fw = root.join(format!("lib/firmware/nvidia/{}", inventory.driver_version));
    std::fs::create_dir_all(&fw)?;
    std::fs::write(fw.join("gsp_ga10x.bin"), "")?;
    Ok(())
}

/// An allocated ResourceClaim with `devices` as `(request, device)` results of `driver` in
/// pool `pool`, plus the given opaque `configs` (`(source, requests, parameters)`).
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    devices: &[(&str, &str)],
    configs: &[(&str, &[&str], serde_json::Value)],
) -> ResourceClaim {
    let results: Vec<_> = devices
        .iter()
        .map(|(request, device)| {
            json!({"request": request, "driver": driver, "pool": pool, "device": device})
        })
        .collect();
    let config: Vec<_> = configs
        .iter()
        .map(|(source, requests, parameters)| {
            json!({"source": source, "requests": requests,
                   "opaque": {"driver": driver, "parameters": parameters}})
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap_or_default()
}

/// A child process (a plugin under test) that is killed and reaped when dropped, so a
/// failed assertion leaves no process behind.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Sends SIGKILL.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.0.kill()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.0.wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

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
}

impl DriverBuilder {
    /// A driver for `inventory` on node [`NODE_NAME`], with claims in memory (empty), CDI specs
    /// in `<root>/cdi`, the checkpoint in `<root>/plugin/gpu-dra-checkpoint.json`, sharing
    /// refused ([`ExclusiveOnly`]) and no boot ID. Call [`simulate_host`] on `<root>/host`
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
        }
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
        let host = self.root.join("host");
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
        })
    }
}

/// Command line of the real plugin binary (`run`) for process-level tests, every path under
/// one root: `plugin/` (socket, checkpoint), `registry/`, `cdi/`, claims from
/// `claims.json`, stderr appended to `plugin.log`, the host in `host/` unless told otherwise.
///
/// The binary's path is an argument because only the test or example target knows it
/// (`env!("CARGO_BIN_EXE_gpu-kubelet-plugin")`).
#[derive(Debug, Clone)]
#[must_use]
pub struct PluginCommand {
    bin: PathBuf,
    root: PathBuf,
    node_name: String,
    host: PathBuf,
    sysfs_root: Option<PathBuf>,
    inventory_fixture: Option<PathBuf>,
    failpoints: String,
    log_level: String,
    boot_id_file: Option<PathBuf>,
}

impl PluginCommand {
    /// The plugin `bin` with everything under `root`, on node [`NODE_NAME`], no failpoints,
    /// log level `info`.
    pub fn new(bin: impl AsRef<Path>, root: &Path) -> Self {
        PluginCommand {
            bin: bin.as_ref().to_path_buf(),
            root: root.to_path_buf(),
            node_name: NODE_NAME.into(),
            host: root.join("host"),
            sysfs_root: None,
            inventory_fixture: None,
            failpoints: String::new(),
            log_level: "info".into(),
            boot_id_file: None,
        }
    }

    /// Sets the node name.
    pub fn node_name(mut self, name: &str) -> Self {
        self.node_name = name.into();
        self
    }

    /// Uses `host` as driver root and dev root (e.g. a simulator's root).
    pub fn host_root(mut self, host: &Path) -> Self {
        self.host = host.to_path_buf();
        self
    }

    /// Reads PCI topology from `sysfs` instead of `/sys`.
    pub fn sysfs_root(mut self, sysfs: &Path) -> Self {
        self.sysfs_root = Some(sysfs.to_path_buf());
        self
    }

    /// Reads the inventory from a JSON file instead of NVML.
    pub fn inventory_fixture(mut self, file: &Path) -> Self {
        self.inventory_fixture = Some(file.to_path_buf());
        self
    }

    /// Sets `GPU_DRA_FAILPOINTS` (empty: none, whatever the test's own environment says).
    pub fn failpoints(mut self, failpoints: &str) -> Self {
        self.failpoints = failpoints.into();
        self
    }

    /// Reads the boot ID from `file` instead of the kernel's (to simulate a reboot).
    pub fn boot_id_file(mut self, file: &Path) -> Self {
        self.boot_id_file = Some(file.to_path_buf());
        self
    }

    /// Sets `LOG_LEVEL`.
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.into();
        self
    }

    /// The plugin folder (`<root>/plugin`).
    pub fn plugin_dir(&self) -> PathBuf {
        self.root.join("plugin")
    }

    /// The file the plugin's log goes to (`<root>/plugin.log`).
    pub fn log_file(&self) -> PathBuf {
        self.root.join("plugin.log")
    }

    /// The command, ready to spawn; opens the log file.
    pub fn command(&self) -> std::io::Result<Command> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file())?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run")
            .args(["--node-name", &self.node_name])
            .args(["--http-address", ""])
            .args(["--cleanup-interval", "3600"])
            .arg("--plugin-dir")
            .arg(self.plugin_dir())
            .arg("--registrar-dir")
            .arg(self.root.join("registry"))
            .arg("--cdi-root")
            .arg(self.root.join("cdi"))
            .arg("--driver-root")
            .arg(&self.host)
            .arg("--dev-root")
            .arg(&self.host)
            .arg("--claim-source-file")
            .arg(self.root.join("claims.json"));
        if let Some(sysfs) = &self.sysfs_root {
            cmd.arg("--sysfs-root").arg(sysfs);
        }
        if let Some(file) = &self.inventory_fixture {
            cmd.arg("--inventory-fixture").arg(file);
        }
        if let Some(file) = &self.boot_id_file {
            cmd.arg("--boot-id-file").arg(file);
        }
        cmd.env("GPU_DRA_FAILPOINTS", &self.failpoints)
            .env("LOG_LEVEL", &self.log_level)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        Ok(cmd)
    }

    /// Starts the plugin; it is killed when the guard is dropped.
    pub fn spawn(&self) -> std::io::Result<ChildGuard> {
        self.command()?.spawn().map(ChildGuard)
    }
}

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
        self.lock()
            .instances
            .retain(|(gpu, m)| !(gpu == gpu_uuid && m.gi_id == gi_id && m.ci_id == ci_id));
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
