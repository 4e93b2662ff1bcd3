//! `gpu-kubelet-plugin run`: the node plugin itself. Its flags (every one with an env twin,
//! which the chart sets) and the wiring of inventory, claim source, driver, sockets and
//! endpoints, and the handover of the node between two instances during a rolling update.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use gpu_dra_core::consumable_shares::ConsumableShares;
use gpu_dra_core::health::{HealthPolicy, TaintEffect};
use gpu_dra_core::partitioning::{GpuSelection, Partitioning};
use gpu_dra_device::fixture::FixtureInventory;
use gpu_dra_device::{GpuInventory, HealthSource};
use gpu_dra_telemetry::LogArgs;
use tracing::{info, warn};

use crate::cdi_io::CdiHost;
use crate::claims::{ClaimSource, FileClaims, KubeClaims};
use crate::driver::{ClaimCleanup, CleanupPolicy, Driver, DriverParts, DriverSettings};
use crate::failpoint::Failpoints;
use crate::host::HostArgs;
use crate::inventory::LiveInventory;
use crate::kube_client::KubeArgs;
use crate::metrics::Metrics;
use crate::node_layout::NodeFolders;
use crate::sharing::{
    DaemonPodArgs, DriverRoot, FileStore, PodDaemons, PodSettings, SharingManager, SharingOptions,
};

/// Flags of `run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Name of this node (pool name of its devices).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// DRA driver name.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// The API server.
    #[command(flatten)]
    pub kube: KubeArgs,
    /// The node's folders: plugin, registration, CDI.
    #[command(flatten)]
    pub folders: NodeFolders,
    /// The host's driver, device nodes and sysfs.
    #[command(flatten)]
    pub host: HostArgs,
    /// Address of /metrics, /healthz, /readyz; empty = off. Loopback unless set: in a pod,
    /// set the pod's address or `0.0.0.0:<port>` so that the kubelet's probes reach it.
    #[arg(long, env = "HTTP_ADDRESS", default_value = "127.0.0.1:8080")]
    pub http_address: String,
    /// HTTP path of the metrics on `--http-address` (NVIDIA's chart value
    /// `kubeletPlugin.metrics.metricsPath`); empty: metrics are not served, the health
    /// endpoints still are.
    #[arg(long, env = "METRICS_PATH", default_value = crate::metrics::DEFAULT_PATH, value_parser = metrics_path)]
    pub metrics_path: String,
    /// Host path of NVIDIA's `nvidia-cdi-hook` (NVIDIA's chart value `nvidiaCDIHookPath`),
    /// named by the toolkit's hooks in our specs (driver library links, loader cache, CUDA
    /// compat, no device node creation). Unset: `--cdi-hook-source` is installed under the
    /// plugin folder and named instead (see `cdi_hook`).
    #[arg(
        long = "nvidia-cdi-hook-path",
        visible_alias = "cdi-hook-path",
        env = "NVIDIA_CDI_HOOK_PATH"
    )]
    pub cdi_hook_path: Option<PathBuf>,
    /// The `nvidia-cdi-hook` binary to install when `--nvidia-cdi-hook-path` is unset (the
    /// image's); when it does not exist, specs carry no hooks (logged). Empty: no hooks.
    #[arg(
        long,
        env = "CDI_HOOK_SOURCE",
        default_value = "/usr/local/bin/nvidia-cdi-hook",
        value_parser = super::path_or_empty()
    )]
    pub cdi_hook_source: PathBuf,
    /// Image of the pods MPS control daemons run in (the driver's own; the chart sets it).
    /// With it, each daemon runs in a pod of its own in `--namespace` on this node and outlives
    /// the plugin's container; without it (or without an API server) daemons are children of
    /// the plugin process.
    #[arg(long, env = "MPS_DAEMON_IMAGE", default_value = "")]
    pub mps_daemon_image: String,
    /// Namespace of the plugin's pod, where MPS daemon pods are created.
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pub namespace: String,
    /// Priority class of MPS daemon pods (empty: none).
    #[arg(
        long,
        env = "MPS_DAEMON_PRIORITY_CLASS",
        default_value = "system-node-critical"
    )]
    pub mps_daemon_priority_class: String,
    /// MPS daemon pods' service account and image pull settings.
    #[command(flatten)]
    pub mps_daemon_pod: DaemonPodArgs,
    /// UID of the plugin's pod (the chart passes it): enables rolling updates. The sockets
    /// are then named per pod (`<driver>-<uid>-reg.sock`, `dra-<uid>.sock`, as the kubelet's
    /// DRA plugin helper names them, see `node_layout`) so that a new instance registers while
    /// the old one still serves; see [`run`] for how the two hand over the node.
    #[arg(long, env = "POD_UID", default_value = "")]
    pub pod_uid: String,
    /// Watch GPU health through NVML (XID errors, uncorrectable ECC errors, GPUs fallen off
    /// the bus, the driver's recovery action): affected devices get taints in this node's
    /// ResourceSlices and are reported unhealthy to the kubelet.
    #[arg(long, env = "DEVICE_HEALTH", default_value_t = true, action = clap::ArgAction::Set)]
    pub device_health: bool,
    /// XIDs that do not make a device unhealthy, besides those NVIDIA's tools ignore as caused
    /// by applications (13, 31, 43, 45, 68, 109): comma-separated numbers, or `all`.
    #[arg(long, env = "IGNORED_XIDS", default_value = "")]
    pub ignored_xids: String,
    /// Seconds between probes of each GPU (reachable, recovery action). Formerly
    /// `--health-probe-interval` (`HEALTH_PROBE_INTERVAL`), still accepted.
    #[arg(
        long,
        alias = "health-probe-interval",
        env = "HEALTH_PROBE_INTERVAL_SECONDS",
        default_value_t = 10
    )]
    pub health_probe_interval_seconds: u64,
    /// Seconds an XID or ECC condition lasts when the driver asks for no recovery action.
    /// Formerly `--health-hold` (`HEALTH_HOLD`), still accepted.
    #[arg(
        long,
        alias = "health-hold",
        env = "HEALTH_HOLD_SECONDS",
        default_value_t = 300
    )]
    pub health_hold_seconds: u64,
    /// Taint effect for a GPU that fell off the bus or needs a node reboot: `NoExecute`
    /// (workloads are evicted by the device taint eviction controller) or `NoSchedule`.
    #[arg(long, env = "FATAL_TAINT_EFFECT", default_value = "NoExecute", value_parser = ["NoExecute", "NoSchedule"])]
    pub fatal_taint_effect: String,
    /// GPUs offered as dynamic MIG: every MIG profile placement published as a partitionable
    /// device, the instance created when a claim is prepared (`all`, or GPU indexes, `gpu-<minor>`
    /// names or UUIDs, comma-separated; MIG mode must be on). The Node annotation
    /// `gpu.nvidia.com/dynamic-mig-gpus` overrides it for one node.
    #[arg(long, env = "DYNAMIC_MIG_GPUS", default_value = "")]
    pub dynamic_mig_gpus: String,
    /// GPUs offered as memory shares: several claims each get an amount of the GPU's memory
    /// (same syntax; Node annotation `gpu.nvidia.com/memory-share-gpus`).
    #[arg(long, env = "MEMORY_SHARE_GPUS", default_value = "")]
    pub memory_share_gpus: String,
    /// NVIDIA's consumable shares for every whole GPU and MIG device of GPUs offered
    /// statically: `disabled`, `memory` (claims share a device by amounts of its memory),
    /// `unlimited` (no memory consumed unless asked for) or a positive integer N (a `shares`
    /// capacity of N, one per claim by default). GPUs selected for memory shares or dynamic
    /// MIG keep that form.
    #[arg(
        long,
        env = "CONSUMABLE_SHARES",
        default_value = "disabled",
        value_parser = ConsumableShares::parse
    )]
    pub consumable_shares: ConsumableShares,
    /// Publish the list-type forms of `nvlinkDomain` (every all-to-all NVLink set a GPU is in)
    /// and `resource.kubernetes.io/numaNode` (a one-element list). Needs the Kubernetes
    /// feature gate `DRAListTypeAttributes` (alpha) on the API server and scheduler: without
    /// it the API server refuses the slices.
    #[arg(long, env = "LIST_TYPE_ATTRIBUTES", default_value_t = false, action = clap::ArgAction::Set)]
    pub list_type_attributes: bool,
    /// Device metadata for workloads (Kubernetes KEP-5304): at prepare, write a JSON file per
    /// request of the claim naming its devices with the attributes the node publishes for
    /// them, and mount it read-only into the claim's containers under
    /// `/var/run/kubernetes.io/dra-device-attributes/`. Off by default, as in Kubernetes' Go
    /// helper library; needs no feature gate.
    #[arg(long, env = "DEVICE_METADATA", default_value_t = false, action = clap::ArgAction::Set)]
    pub device_metadata: bool,
    /// Seconds between rediscoveries of the GPUs (a MIG layout changed by hand); prepare also
    /// checks its claim's devices before every claim, and rediscovers when one changed.
    /// Formerly `--rediscover-interval`
    /// (`REDISCOVER_INTERVAL`), still accepted.
    #[arg(
        long,
        alias = "rediscover-interval",
        env = "REDISCOVER_INTERVAL_SECONDS",
        default_value_t = 60
    )]
    pub rediscover_interval_seconds: u64,
    /// Seconds between checks that the NVML library is still the file found last (a driver
    /// upgraded in place renames it): a changed one is rediscovered at once (see
    /// `driver_swap`).
    #[arg(long, env = "DRIVER_CHECK_INTERVAL_SECONDS", default_value_t = 5)]
    pub driver_check_interval_seconds: u64,
    /// Seconds NVML may be out of reach (the driver unloaded or being upgraded) before
    /// `/healthz` fails, so that the kubelet's liveness probe restarts the plugin.
    #[arg(long, env = "NVML_UNREACHABLE_GRACE_SECONDS", default_value_t = 30)]
    pub nvml_unreachable_grace_seconds: u64,
    /// Seconds between cleanups of claims gone from the API server. Formerly
    /// `--cleanup-interval` (`CLEANUP_INTERVAL`), still accepted.
    #[arg(
        long,
        alias = "cleanup-interval",
        env = "CLEANUP_INTERVAL_SECONDS",
        default_value_t = 60
    )]
    pub cleanup_interval_seconds: u64,
    /// The kubelet's PodResources socket (`<kubelet root>/pod-resources/kubelet.sock`): the
    /// cleanup asks it which prepared claims the node's containers use and reads only the
    /// others from the API server (see `driver::ClaimCleanup`). Empty, missing or not
    /// answering: every prepared claim is read, each less often while it exists.
    #[arg(
        long,
        env = "KUBELET_POD_RESOURCES_SOCKET",
        default_value = crate::pod_resources::DEFAULT_SOCKET,
        value_parser = super::path_or_empty()
    )]
    pub kubelet_pod_resources_socket: PathBuf,
    /// Write each prepared device's entry in its ResourceClaim's `status.devices` (UUID,
    /// product, MIG profile and parent, memory share, sharing strategy; condition `Ready`),
    /// removed at unprepare. Needs the chart's RBAC for `resourceclaims/status`; written in
    /// the background, never failing a prepare.
    #[arg(long, env = "CLAIM_DEVICE_STATUS", default_value_t = true, action = clap::ArgAction::Set)]
    pub claim_device_status: bool,
    /// Seconds between samples of what each prepared claim uses (processes, memory, SM
    /// utilisation through NVML; exported as `gpu_dra_claim_*` metrics); 0: off. Attributing
    /// processes to pods reads the host's `/proc` (`--proc-root`; the chart's `hostPID`).
    #[arg(long, env = "USAGE_INTERVAL_SECONDS", default_value_t = 15)]
    pub usage_interval_seconds: u64,
    /// The procfs whose `<pid>/cgroup` files name the pods of GPU processes: the host's, which
    /// is `/proc` in a pod with `hostPID`.
    #[arg(long, env = "PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// Threads that run the plugin's tasks (the async runtime's workers), at most the CPUs
    /// this process may use. Its work is mostly waiting on the API server, the kubelet, NVML
    /// and the disk (file and NVML calls run on a separate pool that grows on demand and
    /// shrinks when idle), so a few serve a node of any size; without a cap the runtime would
    /// start one per CPU, 128 on a 128-CPU host, each a thread with its own stack and
    /// allocator arena at rest.
    #[arg(long, env = "WORKER_THREADS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: u16,
    /// Test only: read claims from this JSON file (array of ResourceClaims), not the API server.
    #[arg(long, env = "CLAIM_SOURCE_FILE", hide = true)]
    pub claim_source_file: Option<PathBuf>,
    /// Test only: inventory from this JSON file (`Inventory`), not NVML.
    #[arg(long, env = "INVENTORY_FIXTURE", hide = true)]
    pub inventory_fixture: Option<PathBuf>,
    /// The kernel's boot ID: another ID than the one a claim was prepared under means the
    /// node rebooted.
    #[command(flatten)]
    pub boot_id: crate::host::BootId,
    /// Test only: failpoints, `step=error|kill|pause,...`.
    #[arg(long, env = "GPU_DRA_FAILPOINTS", hide = true, default_value = "")]
    pub failpoints: String,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

impl RunArgs {
    /// The `nvidia-cdi-hook` binary to install; `None` when `--cdi-hook-source` is empty.
    pub fn cdi_hook_source(&self) -> Option<&Path> {
        Some(self.cdi_hook_source.as_path()).filter(|p| !p.as_os_str().is_empty())
    }
}

/// The hardware seams chosen from the flags.
pub struct Backends {
    /// Discovers the GPUs.
    pub inventory: Arc<dyn GpuInventory>,
    /// Watches their health (NVML only; none with a fixture).
    pub health: Option<Arc<dyn HealthSource>>,
    /// Creates and destroys dynamic MIG instances (NVML only; refused with a fixture).
    pub mig: Arc<dyn crate::mig::MigControl>,
    /// The NVML library as sessions look it up (none with a fixture): what
    /// [`crate::driver_swap::follow`] watches.
    pub library: Option<gpu_dra_nvml::NvmlLibrary>,
}

/// THE place where the hardware backends are chosen from the flags.
///
/// `--inventory-fixture` (hidden, tests) gives a fixture and no health source; otherwise NVML,
/// loaded from `--nvml-lib` or the first `libnvidia-ml.so.1` under `--driver-root`, for both.
pub fn backends_from_args(args: &RunArgs) -> anyhow::Result<Backends> {
    if let Some(path) = &args.inventory_fixture {
        let json = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read inventory fixture {}", path.display()))?;
        let source = path.display().to_string();
        return Ok(Backends {
            inventory: Arc::new(FixtureInventory::from_json_named(&json, &source)?),
            health: None,
            mig: Arc::new(crate::mig::NoMig(format!(
                "the inventory comes from the fixture {source}, not from NVML"
            ))),
            library: None,
        });
    }
    let (lib_path, backend) = args.host.nvml_inventory()?;
    info!(library = %lib_path.display(), "using NVML");
    let backend = Arc::new(backend);
    let mig: Arc<dyn crate::mig::MigControl> =
        Arc::new(crate::mig::NvmlMig::new(args.host.nvml_library()));
    Ok(Backends {
        inventory: backend.clone(),
        health: Some(backend),
        mig,
        library: Some(args.host.nvml_library()),
    })
}

/// The partitioning settings from the flags.
pub fn partitioning(args: &RunArgs) -> anyhow::Result<Partitioning> {
    Ok(Partitioning {
        dynamic_mig: GpuSelection::parse(&args.dynamic_mig_gpus)
            .map_err(|p| anyhow::anyhow!("--dynamic-mig-gpus (DYNAMIC_MIG_GPUS): {p}"))?,
        memory_shares: GpuSelection::parse(&args.memory_share_gpus)
            .map_err(|p| anyhow::anyhow!("--memory-share-gpus (MEMORY_SHARE_GPUS): {p}"))?,
        consumable_shares: args.consumable_shares,
    })
}

/// The health policy from the flags.
pub fn health_policy(args: &RunArgs) -> anyhow::Result<HealthPolicy> {
    let mut policy = HealthPolicy::new(&args.driver_name)
        .with_ignored_xids(&args.ignored_xids)
        .map_err(|problem| anyhow::anyhow!("--ignored-xids (IGNORED_XIDS): {problem}"))?;
    policy.hold_secs = i64::try_from(args.health_hold_seconds).unwrap_or(i64::MAX);
    policy.fatal_effect = match args.fatal_taint_effect.as_str() {
        "NoSchedule" => TaintEffect::NoSchedule,
        _ => TaintEffect::NoExecute,
    };
    Ok(policy)
}

/// The claim source and, when claims come from the API server, the client that also
/// publishes this node's ResourceSlices. A claim file (tests) means no API server at all.
async fn claim_source(
    args: &RunArgs,
) -> anyhow::Result<(Arc<dyn ClaimSource>, Option<kube::Client>)> {
    if let Some(path) = &args.claim_source_file {
        return Ok((Arc::new(FileClaims::new(path.clone())), None));
    }
    let client = args.kube.client("run", Some(&args.node_name)).await?;
    Ok((Arc::new(KubeClaims::new(client.clone())), Some(client)))
}

/// The host path of the `nvidia-cdi-hook` our specs name: `--nvidia-cdi-hook-path`, else the
/// copy of `--cdi-hook-source` installed under the plugin folder; `None` (logged) when
/// neither is available, and specs then carry no hooks.
pub fn cdi_hook_path(args: &RunArgs) -> Option<PathBuf> {
    if let Some(path) = &args.cdi_hook_path {
        info!(path = %path.display(), "CDI hooks name the configured nvidia-cdi-hook");
        return Some(path.clone());
    }
    let Some(source) = args.cdi_hook_source() else {
        info!("no nvidia-cdi-hook configured: CDI specs carry no hooks");
        return None;
    };
    if !source.exists() {
        warn!(
            source = %source.display(),
            "nvidia-cdi-hook not found: CDI specs carry no hooks (containers get no libcuda.so.1 link and no loader cache entry); set --nvidia-cdi-hook-path (NVIDIA_CDI_HOOK_PATH) to its path on the host"
        );
        return None;
    }
    match crate::cdi_hook::install(source, &args.folders.hook_dir()) {
        Ok(path) => {
            info!(path = %path.display(), "installed nvidia-cdi-hook for CDI hooks");
            Some(path)
        }
        Err(e) => {
            warn!(error = %e, "CDI specs carry no hooks");
            None
        }
    }
}

/// Takes the node's instance lock (`path`, see [`run`]): waits while an older instance holds
/// it (it releases the lock when its process ends). `None` when `stop` fired first.
async fn take_instance_lock(
    path: PathBuf,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Option<std::fs::File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => return Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
    }
    let started = std::time::Instant::now();
    info!(lock = %path.display(), "another plugin instance holds the node; waiting for it to stop");
    let locking = tokio::task::spawn_blocking(move || file.lock().map(|()| file));
    tokio::select! {
        locked = locking => {
            let file = locked
                .context("lock task")?
                .with_context(|| format!("locking {}", path.display()))?;
            info!(waited_ms = started.elapsed().as_millis() as u64, "took over the node from the previous plugin instance");
            Ok(Some(file))
        }
        _ = stop.wait_for(|s| *s) => Ok(None),
    }
}

/// The `run` subcommand: serves until SIGTERM/SIGINT.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    // The pod UID names socket files: the same form as the API server writes it, or nothing.
    if !args.pod_uid.is_empty() {
        crate::grpc::check_uuid(&args.pod_uid).map_err(|problem| {
            anyhow::anyhow!(
                "--pod-uid (POD_UID) {problem}: set it from the pod's metadata.uid (the chart's DaemonSet does), or leave it empty for fixed socket names"
            )
        })?;
    }
    let backends = backends_from_args(&args)?;
    let live = LiveInventory::discover(backends.inventory.clone(), health_policy(&args)?)
        .context("discovering GPUs")?;
    let partitioning_flags = partitioning(&args)?;
    live.set_partitioning(partitioning_flags.clone());
    let inventory = live.current();
    info!(
        gpus = inventory.gpus.len(),
        devices = inventory.devices().count(),
        "inventory"
    );
    let (claims, client) = claim_source(&args).await?;
    std::fs::create_dir_all(&args.folders.plugin_dir)
        .with_context(|| format!("creating {}", args.folders.plugin_dir.display()))?;

    // Serve first, then take over the node: during a rolling update the kubelet reaches this
    // instance (registered under per-pod socket names) while the old one still finishes its
    // calls; ours wait until this instance holds the node's instance lock, which the old one
    // releases when its process ends, and has loaded the node's state (checkpoint, sharing)
    // from disk. So two instances never prepare or unprepare at once, and none answers from
    // state the other changed.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let metrics = Arc::new(Metrics::served_at(
        Some(args.metrics_path.clone()).filter(|p| !p.is_empty()),
    ));
    let ready = Arc::new(AtomicBool::new(false));
    if !args.http_address.is_empty() {
        let listener = tokio::net::TcpListener::bind(&args.http_address)
            .await
            .with_context(|| format!("binding --http-address {}", args.http_address))?;
        info!(address = %args.http_address, metrics = %args.metrics_path, "serving metrics, /healthz and /readyz");
        let liveness = crate::driver_swap::NvmlLiveness::new(
            live.clone(),
            Duration::from_secs(args.nvml_unreachable_grace_seconds),
        );
        tokio::spawn(crate::http::serve(
            listener,
            metrics.clone(),
            ready.clone(),
            Arc::new(liveness),
        ));
    }
    let sockets = args.folders.sockets(&args.driver_name, &args.pod_uid);
    let (reg_path, dra_path) = (sockets.registration, sockets.dra);
    let dra_listener = crate::grpc::bind_socket(&dra_path)
        .with_context(|| format!("binding {}", dra_path.display()))?;
    let reg_listener = crate::grpc::bind_socket(&reg_path)
        .with_context(|| format!("binding {}", reg_path.display()))?;
    let (status_tx, mut status_rx) = tokio::sync::watch::channel(None);
    let registration = crate::grpc::Registration::new(
        args.driver_name.clone(),
        dra_path.clone(),
        Arc::new(status_tx),
    );
    let (driver_tx, driver_rx) = tokio::sync::watch::channel(None);
    let health = crate::health::HealthService::new(
        args.node_name.clone(),
        live.subscribe(),
        stop_rx.clone(),
    );
    let server = tokio::spawn(crate::grpc::serve_deferred(
        driver_rx,
        Some(health),
        registration,
        reg_listener,
        dra_listener,
        {
            let mut stop = stop_rx.clone();
            async move {
                let _ = stop.wait_for(|s| *s).await;
            }
        },
    ));
    info!(registration = %reg_path.display(), dra = %dra_path.display(), "serving");
    if !args.pod_uid.is_empty() {
        // Ready once the kubelet registered this instance, even while it waits for the node:
        // a surge rollout stops the old instance only when this one is ready, the old one
        // holds the node until it stops, and from registration on the kubelet sends its
        // calls here (the newest connected instance), where they wait for the handover.
        let ready = ready.clone();
        tokio::spawn(async move {
            if status_rx.wait_for(|s| *s == Some(true)).await.is_ok() {
                ready.store(true, Ordering::Relaxed);
            }
        });
    }
    let Some(_instance) = take_instance_lock(args.folders.instance_lock(), stop_rx.clone()).await?
    else {
        info!("stopped before taking over the node");
        drop(driver_tx);
        let _ = server.await;
        remove_quietly(&reg_path);
        remove_quietly(&dra_path);
        return Ok(());
    };
    let failpoints = Failpoints::parse(&args.failpoints, Some(args.folders.failpoint_marker()))
        .map_err(anyhow::Error::msg)?;
    let hook = cdi_hook_path(&args);
    let cdi = Arc::new(CdiHost::discover(
        args.folders.cdi_root.clone(),
        &args.host.driver_roots(),
        &args.host.dev_root,
        &inventory.driver_version,
        hook.as_deref(),
    ));
    // A driver upgraded in place: its new files are scanned before a prepare sees the new
    // version (and now, should it have changed since the first discovery).
    live.on_driver_version({
        let cdi = cdi.clone();
        Arc::new(move |found: &gpu_dra_device::Inventory| cdi.refresh(&found.driver_version))
    });
    cdi.refresh(&live.current().driver_version);
    let boot_id = args.boot_id.read();
    let mut sharing_options = SharingOptions::new(
        DriverRoot::new(args.host.driver_root_here(), args.host.nvml_lib.clone()),
        &args.folders.plugin_dir,
    );
    sharing_options.boot_id.clone_from(&boot_id);
    let sharing = SharingManager::new(
        sharing_options,
        Arc::new(FileStore::new(args.folders.sharing_state())),
        metrics.sharing.clone(),
    )
    .context("loading the sharing state")?;
    if let Some(client) = &client
        && !args.mps_daemon_image.is_empty()
    {
        anyhow::ensure!(
            !args.namespace.is_empty(),
            "--mps-daemon-image is set but --namespace (POD_NAMESPACE) is empty: MPS daemon pods need the plugin's namespace"
        );
        info!(image = %args.mps_daemon_image, namespace = %args.namespace, "MPS control daemons run in pods of their own");
        sharing.use_pod_daemons(PodDaemons::new(
            client.clone(),
            args.mps_daemon_pod.apply(PodSettings {
                namespace: args.namespace.clone(),
                node: args.node_name.clone(),
                image: args.mps_daemon_image.clone(),
                host_driver_root: args.host.driver_root.clone(),
                priority_class: args.mps_daemon_priority_class.clone(),
                ..PodSettings::default()
            }),
        ));
    }
    let claim_status = claim_status_writer(&args, client.as_ref());
    let node_events = client.as_ref().map(|c| {
        crate::node_events::KubeNodeEvents::start(
            c.clone(),
            &args.node_name,
            format!("{}-kubelet-plugin", args.driver_name),
        ) as Arc<dyn crate::node_events::NodeEvents>
    });
    // The driver loads (migrates, imports) its checkpoint before sharing recovers, so that
    // recovery knows which MPS directories NVIDIA's driver owns.
    let driver = Arc::new(Driver::new(DriverParts {
        settings: DriverSettings {
            driver_name: args.driver_name.clone(),
            node_name: args.node_name.clone(),
            checkpoint_path: args.folders.checkpoint(),
            boot_id,
            device_metadata: crate::driver::DeviceMetadataSettings {
                dir: args.folders.device_metadata_dir(),
                enabled: args.device_metadata,
                list_forms: args.list_type_attributes,
            },
        },
        inventory: live.clone(),
        claims: claims.clone(),
        sharing: Arc::new(sharing.clone()),
        decoder: Arc::new(gpu_dra_core::plan::ApiDecoder),
        cdi,
        failpoints,
        metrics: metrics.clone(),
        mig: backends.mig.clone(),
        claim_status,
        node_events: node_events.clone(),
    })?);
    // Sharing state is recovered before the driver reconciles: live MPS daemons of prepared
    // claims are re-adopted (or restarted), interrupted starts and stops are cleaned up, and
    // after a reboot everything recorded is forgotten; then the driver rolls back
    // half-prepared claims through the same manager.
    sharing.keep_foreign_dirs(driver.imported_mps_daemons());
    // Sharing of claims the checkpoint does not know is undone (nothing would unprepare it).
    sharing.keep_claims(driver.checkpoint().claims.keys().cloned().collect());
    if let Err(e) = sharing.recover().await {
        warn!(error = %e, "sharing recovery incomplete; retried by the next unprepare or restart");
    }
    if let Some(client) = &client {
        // The startup reconcile destroys stray MIG instances on dynamic MIG GPUs: it must know
        // the GPUs a Node annotation makes dynamic before anything is published.
        apply_node_annotations(client, &args.node_name, &partitioning_flags, &live).await;
    }
    let every = Duration::from_secs(args.cleanup_interval_seconds.max(1));
    let mut claim_cleanup =
        ClaimCleanup::new(pod_claims(&args), CleanupPolicy::for_interval(every));
    claim_cleanup.pass(&driver, std::time::Instant::now()).await;

    let _ = driver_tx.send(Some(driver.clone()));
    // The periodic reconcile, and one as soon as the GPUs' partitioning changes (the Node's
    // annotations are watched): a GPU that became dynamic MIG gets its instances recorded as
    // kept (or swept) within seconds rather than at the next tick. Likewise for a new driver
    // version: prepared claims' specs name its files before their containers restart.
    let cleanup = {
        let driver = driver.clone();
        let mut snapshots = Some(live.subscribe());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            let mut partitioning = snapshots.as_mut().map(|s| {
                let snap = s.borrow_and_update();
                (
                    snap.partitioning.clone(),
                    snap.inventory.driver_version.clone(),
                )
            });
            loop {
                match snapshots.as_mut() {
                    Some(rx) => tokio::select! {
                        _ = tick.tick() => {}
                        changed = rx.changed() => {
                            if changed.is_err() {
                                snapshots = None;
                                continue;
                            }
                            let now = Some({
                                let snap = rx.borrow_and_update();
                                (
                                    snap.partitioning.clone(),
                                    snap.inventory.driver_version.clone(),
                                )
                            });
                            if now == partitioning {
                                continue;
                            }
                            partitioning = now;
                        }
                    },
                    None => {
                        tick.tick().await;
                    }
                }
                claim_cleanup.pass(&driver, std::time::Instant::now()).await;
            }
        })
    };
    // Health is watched by the instance that holds the node only; the conditions a previous
    // instance saw are taken over.
    live.keep_health_in(args.folders.health_state());
    let health_watch = match (&backends.health, args.device_health) {
        (Some(source), true) => Some(tokio::spawn(crate::health::watch(
            source.clone(),
            live.clone(),
            Duration::from_secs(args.health_probe_interval_seconds.max(1)),
            stop_rx.clone(),
        ))),
        (None, true) => {
            info!("no NVML health source (inventory fixture): devices are reported healthy");
            None
        }
        (_, false) => {
            info!("device health watching is off (--device-health=false)");
            None
        }
    };
    let driver_follower = backends.library.clone().map(|library| {
        let identity: crate::driver_swap::DriverIdentity = Box::new(move || {
            library
                .identity()
                .map(|(path, dev, ino)| format!("{} ({dev}:{ino})", path.display()))
        });
        tokio::spawn(crate::driver_swap::follow(
            live.clone(),
            identity,
            Duration::from_secs(args.driver_check_interval_seconds.max(1)),
            stop_rx.clone(),
        ))
    });
    let (publisher_stop, publisher_stopped) = tokio::sync::watch::channel(false);
    let publisher = client.clone().map(|client| {
        let mut config = crate::publish::PublisherConfig::new(&args.node_name, &args.driver_name);
        config.rediscover_interval = Duration::from_secs(args.rediscover_interval_seconds.max(1));
        config.partitioning = partitioning_flags.clone();
        config.list_attributes = args.list_type_attributes;
        config.features = crate::publish::features::Reporter::new(
            node_events.clone(),
            metrics.api_feature_missing.clone(),
        );
        let live = live.clone();
        let mut stop = publisher_stopped.clone();
        tokio::spawn(async move {
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            if let Err(e) = crate::publish::run(client, config, live, stopped).await {
                warn!(error = %e, "ResourceSlice publisher ended");
            }
        })
    });
    let usage_sampler = usage_sampler(
        &args,
        &backends,
        (claims, client.as_ref()),
        &driver,
        &live,
        &metrics,
        &stop_rx,
    );
    ready.store(true, Ordering::Relaxed);
    server.await.context("gRPC servers")??;
    cleanup.abort();
    // The checkpoint alone is exact after a graceful stop (an older version reads only it).
    if let Err(e) = driver.compact_checkpoint().await {
        warn!(error = %e, "cannot fold the checkpoint journal into the checkpoint at stop; the next start does");
    }
    // The sampler writes its usage history when it sees the stop; a sample in flight (NVML
    // out of reach) is not waited for long.
    if let Some(mut sampler) = usage_sampler
        && tokio::time::timeout(Duration::from_secs(5), &mut sampler)
            .await
            .is_err()
    {
        sampler.abort();
    }
    let _ = publisher_stop.send(true);
    if let Some(publisher) = publisher {
        let _ = publisher.await;
    }
    if let Some(watcher) = health_watch {
        let _ = watcher.await;
    }
    if let Some(follower) = driver_follower {
        let _ = follower.await;
    }
    // MPS daemons keep serving their claims across a plugin restart.
    sharing.detach();
    remove_quietly(&reg_path);
    remove_quietly(&dra_path);
    info!("stopped");
    Ok(())
}

/// The kubelet's PodResources API the cleanup asks, unless `--kubelet-pod-resources-socket` is
/// empty or claims come from a file (no kubelet either).
fn pod_claims(args: &RunArgs) -> Option<Arc<dyn crate::pod_resources::PodClaims>> {
    let socket = &args.kubelet_pod_resources_socket;
    if socket.as_os_str().is_empty() || args.claim_source_file.is_some() {
        return None;
    }
    Some(Arc::new(crate::pod_resources::KubeletPodResources::new(
        socket.clone(),
    )))
}

/// The usage sampler (see [`crate::usage`]): none when `--usage-interval-seconds` is 0 or
/// without NVML (an inventory fixture).
fn usage_sampler(
    args: &RunArgs,
    backends: &Backends,
    (claims, client): (Arc<dyn ClaimSource>, Option<&kube::Client>),
    driver: &Arc<Driver>,
    live: &Arc<LiveInventory>,
    metrics: &Arc<Metrics>,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if args.usage_interval_seconds == 0 {
        info!("per-claim usage sampling is off (--usage-interval-seconds=0)");
        return None;
    }
    let Some(library) = backends.library.clone() else {
        info!("no NVML (inventory fixture): per-claim usage is not sampled");
        return None;
    };
    let every = Duration::from_secs(args.usage_interval_seconds);
    let mut sampler = crate::usage::Sampler::new(
        Arc::new(gpu_dra_nvml::usage::NvmlUsage::new(library)),
        claims,
        args.proc_root.clone(),
        every,
    )
    .with_history_file(args.folders.usage_history());
    if let Some(client) = client {
        sampler = sampler.with_pods(Arc::new(crate::usage::pods::KubePods::new(client.clone())));
    }
    info!(interval_s = args.usage_interval_seconds, proc_root = %args.proc_root.display(), "sampling per-claim GPU usage");
    let (driver, live) = (driver.clone(), live.clone());
    Some(tokio::spawn(crate::usage::run(
        sampler,
        every,
        move || driver.checkpoint(),
        move || live.current(),
        metrics.clone(),
        stop.clone(),
    )))
}

/// The writer of the claims' device status: none when `--claim-device-status=false` or
/// without an API server (claims from a file).
fn claim_status_writer(
    args: &RunArgs,
    client: Option<&kube::Client>,
) -> Option<Arc<dyn crate::claim_status::ClaimStatusSink>> {
    use crate::claim_status::{Backoff, KubeStatusApi, StatusWriter, field_manager};
    let client = client?;
    if !args.claim_device_status {
        info!("device data in claim status is off (--claim-device-status=false)");
        return None;
    }
    let manager = field_manager(&args.driver_name, &args.node_name);
    info!(field_manager = %manager, "writing device data into the status of prepared claims");
    let api = Arc::new(KubeStatusApi::new(client.clone(), manager));
    // The task ends with the writer, which the driver holds until the process ends.
    let (writer, _task) =
        StatusWriter::start(&args.driver_name, &args.node_name, api, Backoff::default());
    Some(Arc::new(writer))
}

/// Applies the Node's partitioning annotations over the flags once (the publisher keeps them
/// current afterwards); a Node that cannot be read leaves the flags, with a warning.
async fn apply_node_annotations(
    client: &kube::Client,
    node_name: &str,
    flags: &Partitioning,
    live: &LiveInventory,
) {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    match nodes.get(node_name).await {
        Ok(node) => live.set_partitioning(crate::publish::node_partitioning(flags, &node)),
        Err(e) => {
            warn!(node = %node_name, error = %e, "cannot read the Node's partitioning annotations at start; using the flags until the publisher reads them");
        }
    }
}

fn remove_quietly(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %e, "cannot remove socket");
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    info!("shutting down");
}

/// Parses `--metrics-path`: empty (off), or an absolute path other than the health endpoints';
/// a relative one is taken from the root (`metrics` is `/metrics`), as NVIDIA's driver does.
fn metrics_path(raw: &str) -> Result<String, String> {
    if raw.is_empty() {
        return Ok(String::new());
    }
    let path = if raw.starts_with('/') {
        raw.to_owned()
    } else {
        format!("/{raw}")
    };
    if path == "/healthz" || path == "/readyz" {
        return Err(format!(
            "{path} is the health endpoint; pick another path for the metrics (e.g. /metrics)"
        ));
    }
    if path
        .chars()
        .any(|c| c.is_whitespace() || c == '?' || c == '#')
    {
        return Err(format!(
            "{raw:?} is not a URL path (no spaces, '?' or '#'); e.g. /metrics"
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::tests::run_args;

    #[test]
    fn an_empty_cdi_hook_source_means_no_hooks() {
        assert_eq!(
            run_args(&[]).cdi_hook_source(),
            Some(Path::new("/usr/local/bin/nvidia-cdi-hook"))
        );
        assert_eq!(run_args(&["--cdi-hook-source="]).cdi_hook_source(), None);
        assert_eq!(run_args(&["--cdi-hook-source", ""]).cdi_hook_source(), None);
        let args = run_args(&["--cdi-hook-source=", "--http-address="]);
        assert_eq!(cdi_hook_path(&args), None);
        assert_eq!(
            run_args(&["--cdi-hook-source=/opt/hook"]).cdi_hook_source(),
            Some(Path::new("/opt/hook"))
        );
    }

    #[test]
    fn seconds_flags_say_so_and_take_their_former_names() {
        let args = run_args(&[
            "--health-probe-interval-seconds=1",
            "--health-hold-seconds=2",
            "--rediscover-interval-seconds=3",
            "--cleanup-interval-seconds=4",
        ]);
        assert_eq!(
            (
                args.health_probe_interval_seconds,
                args.health_hold_seconds,
                args.rediscover_interval_seconds,
                args.cleanup_interval_seconds
            ),
            (1, 2, 3, 4)
        );
        let former = run_args(&[
            "--health-probe-interval=5",
            "--health-hold=6",
            "--rediscover-interval=7",
            "--cleanup-interval=8",
        ]);
        assert_eq!(
            (
                former.health_probe_interval_seconds,
                former.health_hold_seconds,
                former.rediscover_interval_seconds,
                former.cleanup_interval_seconds
            ),
            (5, 6, 7, 8)
        );
        assert_eq!(health_policy(&former).expect("policy").hold_secs, 6);
    }

    #[test]
    fn metrics_path_is_rooted_and_keeps_off_the_health_endpoints() {
        assert_eq!(metrics_path("/metrics").as_deref(), Ok("/metrics"));
        assert_eq!(metrics_path("custom").as_deref(), Ok("/custom"));
        assert_eq!(metrics_path("").as_deref(), Ok(""));
        for bad in ["/healthz", "readyz", "/a b", "/m?x=1"] {
            assert!(metrics_path(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn consumable_shares_take_nvidias_values_and_refuse_others_saying_which() {
        assert_eq!(
            partitioning(&run_args(&[]))
                .expect("flags")
                .consumable_shares,
            ConsumableShares::Disabled
        );
        assert_eq!(
            partitioning(&run_args(&["--consumable-shares=4"]))
                .expect("flags")
                .consumable_shares,
            ConsumableShares::Count(4)
        );
        assert_eq!(
            run_args(&["--consumable-shares", "unlimited"]).consumable_shares,
            ConsumableShares::Unlimited
        );
        let line = ["gpu-kubelet-plugin", "run", "--node-name=n"];
        let err = crate::cmd::command()
            .try_get_matches_from(line.iter().chain(&["--consumable-shares=0"]))
            .expect_err("0 shares")
            .to_string();
        assert!(
            err.contains("--consumable-shares")
                && err.contains("use disabled, memory, unlimited or a positive integer"),
            "{err}"
        );
    }
}
