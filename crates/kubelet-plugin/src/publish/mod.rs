//! The ResourceSlice publisher: keeps the node's pool on the API server equal to the inventory.
//!
//! A thin async shell around [`diff::diff`]: it takes the inventory and device taints from the
//! node's [`LiveInventory`], lists the node's slices, applies the operations of the diff, and
//! repeats whenever
//! - the live inventory has a snapshot that renders other slices (a prepare or the periodic
//!   rediscovery found another layout, a device's health changed);
//! - one of our slices changes on the server (a watch with the field selector
//!   `spec.nodeName=<node>,spec.driver=<driver>`): someone deleted or edited one, so restore it;
//! - the Node's partitioning annotations change ([`node_watch`]: one watch on the Node);
//! - the periodic rediscovery (default 60 s) or an on-demand refresh ([`PublisherConfig::refresh`])
//!   finds a different inventory.
//!
//! Failures (discovery, API errors, conflicts) are retried with exponential backoff
//! ([`PublisherConfig::backoff_initial`] doubling up to [`PublisherConfig::backoff_max`]),
//! reset after a success. Slices are owned by the Node object so they go away with it, and are
//! deliberately *not* deleted on shutdown: a restarting or upgrading plugin keeps the devices
//! schedulable, and the kubelet removes a driver's slices itself once no plugin is left.

pub mod diff;
pub mod features;
pub mod node_watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpu_dra_device::DeviceError;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions,
};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use self::diff::{DiffParams, Op};
use crate::inventory::{LiveInventory, Snapshot};
use gpu_dra_core::partitioning::Partitioning;

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// This node's name (pool name, `spec.nodeName`, owner).
    pub node_name: String,
    /// Driver name, e.g. `gpu.nvidia.com`.
    pub driver_name: String,
    /// How often the inventory is rediscovered.
    pub rediscover_interval: Duration,
    /// First retry delay after a failure.
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// Notified to rediscover now (e.g. after a MIG reconfiguration).
    pub refresh: Option<Arc<Notify>>,
    /// Receives the publication status after every reconcile (for readiness and metrics).
    pub status: Option<watch::Sender<PublishStatus>>,
    /// How GPUs are offered unless the Node's annotations say otherwise (the plugin's flags).
    pub partitioning: Partitioning,
    /// Publish list-type forms of attributes (`--list-type-attributes`; the cluster needs
    /// `DRAListTypeAttributes`).
    pub list_attributes: bool,
    /// Where findings about the API server's DRA features go ([`features`]).
    pub features: features::Reporter,
}

impl PublisherConfig {
    /// Defaults: rediscovery every 60 s, backoff 500 ms doubling up to 60 s.
    pub fn new(node_name: impl Into<String>, driver_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            driver_name: driver_name.into(),
            rediscover_interval: Duration::from_secs(60),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(60),
            refresh: None,
            status: None,
            partitioning: Partitioning::default(),
            list_attributes: false,
            features: features::Reporter::default(),
        }
    }

    fn selector(&self) -> String {
        format!(
            "spec.nodeName={},spec.driver={}",
            self.node_name, self.driver_name
        )
    }
}

/// What the publisher last achieved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishStatus {
    /// The pool on the server matches the inventory.
    pub in_sync: bool,
    /// Pool generation last written or confirmed.
    pub generation: i64,
    /// Devices published.
    pub devices: usize,
    /// Consecutive failures since the last success.
    pub failures: u32,
    /// The last error, if the last attempt failed.
    pub last_error: Option<String>,
}

/// Why a publication attempt failed (all are retried; only the end of a watch,
/// [`PublishError::WatchEnded`] or [`PublishError::NodeWatchEnded`], ends [`run`]).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Discovering the inventory failed.
    #[error("discovering GPUs: {0}")]
    Discovery(#[from] DeviceError),
    /// An API call failed.
    #[error("{action}: {source}")]
    Api {
        /// What was attempted, e.g. `creating ResourceSlice node-a-gpu-nvidia-com-0`.
        action: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// The Node object has no UID (cannot own the slices).
    #[error("node {0} has no metadata.uid")]
    NodeWithoutUid(String),
    /// The watch stream ended, which the watcher never does on its own.
    #[error("the ResourceSlice watch ended")]
    WatchEnded,
    /// The Node watch ended, which the watcher never does on its own.
    #[error("the Node watch ended")]
    NodeWatchEnded,
    /// A slice with list-type attributes could not be written as JSON.
    #[error(transparent)]
    ListForm(#[from] gpu_dra_core::list_forms::ListFormError),
    /// The API server dropped a feature's fields from a real write (what the dry run did not
    /// show): the slices are rendered again without it at the retry.
    #[error("the API server dropped fields of a ResourceSlice write; rendering again without them")]
    FeaturesUnsettled,
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> PublishError {
    let action = action.into();
    move |source| PublishError::Api { action, source }
}

/// Exponential backoff state.
#[derive(Debug, Clone)]
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    failures: u32,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial,
            failures: 0,
        }
    }

    fn fail(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        self.failures += 1;
        d
    }

    fn reset(&mut self) {
        self.next = self.initial;
        self.failures = 0;
    }
}

/// Publishes the node's ResourceSlices until `shutdown` completes. Returns `Ok(())` on
/// shutdown; errors are logged and retried, so the only error is the end of a watch stream.
///
/// The inventory and the device taints come from `live`: the publisher asks it to rediscover
/// on its interval and on [`PublisherConfig::refresh`], and republishes whenever a snapshot
/// renders other slices (a discovery by prepare, a health change).
pub async fn run(
    client: kube::Client,
    config: PublisherConfig,
    live: Arc<LiveInventory>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PublishError> {
    // For messages only: which release drops what (a server that cannot say is fine).
    let server_version = match client.apiserver_version().await {
        Ok(v) => Some(v.git_version),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the API server's version");
            None
        }
    };
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    let events = watcher::watcher(
        slices.clone(),
        watcher::Config::default().fields(&config.selector()),
    )
    .default_backoff();
    tokio::pin!(events);
    let annotations = node_watch::watch(nodes.clone(), &config.node_name);
    tokio::pin!(annotations);
    tokio::pin!(shutdown);

    let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
    let mut rediscover = tokio::time::interval(config.rediscover_interval);
    rediscover.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut snapshots = live.subscribe();
    let mut rendered: Option<Snapshot> = None;
    let mut last_generation = 0i64;
    // What the API server keeps of our slices ([`features`]), forgotten every RECHECK.
    let mut served = features::ServedFeatures::default();
    let mut learnt_since = Instant::now();
    let mut need_discovery = true;
    let mut dirty = false;
    let mut retry_at: Option<Instant> = None;

    loop {
        let retry = async {
            match retry_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let refresh = async {
            match &config.refresh {
                Some(n) => n.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut shutdown => {
                tracing::info!("publisher stopping");
                return Ok(());
            }
            _ = rediscover.tick() => need_discovery = true,
            () = refresh => need_discovery = true,
            () = retry => retry_at = None,
            changed = snapshots.changed() => {
                if changed.is_err() {
                    // The owner is gone: the plugin is stopping.
                    return Ok(());
                }
            }
            event = events.next() => match event {
                Some(Ok(Event::Apply(_) | Event::Delete(_) | Event::InitDone)) => dirty = true,
                Some(Ok(Event::Init | Event::InitApply(_))) => {}
                Some(Err(e)) => tracing::warn!(error = %e, "ResourceSlice watch error; the watcher retries"),
                None => return Err(PublishError::WatchEnded),
            },
            // The reconcile reads the Node again and applies its partitioning.
            changed = annotations.next() => match changed {
                Some(a) => {
                    tracing::debug!(?a, "Node partitioning annotations");
                    dirty = true;
                }
                None => return Err(PublishError::NodeWatchEnded),
            },
        }
        if retry_at.is_some() {
            continue;
        }
        if learnt_since.elapsed() >= features::RECHECK {
            // A gate turned on since is found by the next write's dry run.
            learnt_since = Instant::now();
            if served.forget() {
                dirty = true;
            }
        }

        let result: Result<Option<(i64, usize)>, PublishError> = async {
            if need_discovery {
                live.rediscover().await?;
                need_discovery = false;
            }
            let snapshot = snapshots.borrow_and_update().clone();
            if !rendered.as_ref().is_some_and(|r| r.same_slices(&snapshot)) {
                dirty = true;
            }
            if !dirty {
                return Ok(None);
            }
            let generation = reconcile(
                &slices,
                &nodes,
                &config,
                &live,
                &snapshot,
                last_generation,
                &mut Learning {
                    served: &mut served,
                    server_version: server_version.as_deref(),
                },
            )
            .await?;
            last_generation = last_generation.max(generation);
            dirty = false;
            live.mark_published(&snapshot.inventory);
            let devices = snapshot.inventory.devices().count();
            rendered = Some(snapshot);
            Ok(Some((generation, devices)))
        }
        .await;

        match result {
            Ok(Some((generation, devices))) => {
                backoff.reset();
                send_status(&config, |s| {
                    *s = PublishStatus {
                        in_sync: true,
                        generation,
                        devices,
                        failures: 0,
                        last_error: None,
                    }
                });
            }
            Ok(None) => {}
            Err(e) => {
                let delay = backoff.fail();
                tracing::warn!(error = %e, retry_in = ?delay, failures = backoff.failures, "publishing ResourceSlices failed");
                retry_at = Some(Instant::now() + delay);
                // Retry the whole reconcile: the server state may be anything now.
                dirty = true;
                let failures = backoff.failures;
                send_status(&config, |s| {
                    s.in_sync = false;
                    s.failures = failures;
                    s.last_error = Some(e.to_string());
                });
            }
        }
    }
}

/// The flags' partitioning with `node`'s annotations applied over it (an admin marks one
/// node); annotations that cannot be read are logged and ignored.
pub(crate) fn node_partitioning(flags: &Partitioning, node: &Node) -> Partitioning {
    let (partitioning, problems) = flags.with_node_annotations(|key| {
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    });
    for problem in &problems {
        tracing::warn!(%problem, "ignoring a partitioning annotation");
    }
    partitioning
}

fn send_status(config: &PublisherConfig, f: impl FnOnce(&mut PublishStatus)) {
    if let Some(tx) = &config.status {
        tx.send_modify(f);
    }
}

/// What the publisher knows of the API server's features, and its version for messages.
struct Learning<'a> {
    served: &'a mut features::ServedFeatures,
    server_version: Option<&'a str>,
}

/// One reconcile: read the Node and our slices, diff, apply. Returns the pool generation.
///
/// A write that carries a feature's fields the server has not been seen to keep or drop is
/// made as a dry run first ([`features`]); when the server drops a feature, the slices are
/// rendered again with its fallback before anything is written.
async fn reconcile(
    slices: &Api<ResourceSlice>,
    nodes: &Api<Node>,
    config: &PublisherConfig,
    live: &LiveInventory,
    snapshot: &Snapshot,
    last_generation: i64,
    learning: &mut Learning<'_>,
) -> Result<i64, PublishError> {
    let node = nodes
        .get(&config.node_name)
        .await
        .map_err(api_err(format!("reading node {}", config.node_name)))?;
    let uid = node
        .metadata
        .uid
        .clone()
        .ok_or_else(|| PublishError::NodeWithoutUid(config.node_name.clone()))?;
    let wanted = node_partitioning(&config.partitioning, &node);
    for gpu in wanted.conflicts(&snapshot.inventory) {
        tracing::warn!(gpu = %gpu.uuid, "GPU selected for both dynamic MIG and memory shares; offered statically");
    }
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: config.node_name.clone(),
        uid,
        controller: Some(true),
        block_owner_deletion: None,
    };
    let observed: Vec<ResourceSlice> = slices
        .list(&ListParams::default().fields(&config.selector()))
        .await
        .map_err(api_err("listing ResourceSlices"))?
        .items
        .into_iter()
        // The field selector cannot match the pool name; other pools are not ours to touch.
        .filter(|s| s.spec.pool.name == config.node_name)
        .collect();
    // At most once per feature: each round either learns a feature or writes.
    for _ in 0..=features::Feature::ALL.len() {
        let served = &*learning.served;
        let mut partitioning = wanted.clone();
        if served.is_missing(features::Feature::ConsumableCapacity) {
            partitioning = partitioning.without_consumable_capacity();
        }
        if served.is_missing(features::Feature::PartitionableDevices) {
            partitioning = partitioning.without_partitionable_devices();
        }
        live.set_partitioning(partitioning.clone());
        let diff = diff::diff(
            &snapshot.inventory,
            &DiffParams {
                node_name: &config.node_name,
                driver_name: &config.driver_name,
                owner: &owner,
                last_generation,
                taints: &snapshot.health.taints,
                partitioning: &partitioning,
                dynamic_mig_devices: &snapshot.dynamic_mig_devices,
                list_attributes: config.list_attributes,
                withhold_tainted: served.is_missing(features::Feature::DeviceTaints),
            },
            &observed,
        );
        if diff.ops.is_empty() {
            return Ok(diff.generation);
        }
        if dry_run(slices, &diff.ops, config, learning).await? {
            continue;
        }
        apply(slices, &diff, config, learning).await?;
        return Ok(diff.generation);
    }
    // Every feature learnt and still dropped: cannot happen, since a missing feature's fields
    // are no longer sent; said rather than looped on.
    Err(PublishError::FeaturesUnsettled)
}

fn post_params(dry_run: bool) -> PostParams {
    PostParams {
        field_manager: Some("gpu-kubelet-plugin".into()),
        dry_run,
    }
}

/// Writes `op` (a create or an update; `None` for a delete), as a dry run or for real, and
/// returns what was sent and what the server answered, as JSON.
async fn write(
    slices: &Api<ResourceSlice>,
    op: &Op,
    dry_run: bool,
) -> Result<Option<(serde_json::Value, serde_json::Value)>, PublishError> {
    let pp = post_params(dry_run);
    let (slice, create) = match op {
        Op::Create(s) => (s, true),
        Op::Update(s) => (s, false),
        Op::Delete { .. } => return Ok(None),
    };
    let verb = if create { "creating" } else { "updating" };
    let action = format!(
        "{}{verb} ResourceSlice {}",
        if dry_run { "dry run of " } else { "" },
        op.name()
    );
    let to_json = |e| PublishError::Api {
        action: action.clone(),
        source: kube::Error::SerdeError(e),
    };
    if has_lists(slice) {
        let sent = as_dynamic(slice)?;
        let raw = raw_slices(slices);
        let got = if create {
            raw.create(&pp, &sent).await
        } else {
            raw.replace(op.name(), &pp, &sent).await
        }
        .map_err(api_err(action.clone()))?;
        let sent = serde_json::to_value(&sent).map_err(to_json)?;
        let got = serde_json::to_value(&got).map_err(to_json)?;
        return Ok(Some((sent, got)));
    }
    let got = if create {
        slices.create(&pp, slice).await
    } else {
        slices.replace(op.name(), &pp, slice).await
    }
    .map_err(api_err(action.clone()))?;
    let sent = serde_json::to_value(slice).map_err(to_json)?;
    let got = serde_json::to_value(&got).map_err(to_json)?;
    Ok(Some((sent, got)))
}

/// Dry runs of the writes that carry a feature this server has not been seen to keep or
/// drop; returns whether a feature was found missing (then nothing is written and the
/// slices are rendered again).
async fn dry_run(
    slices: &Api<ResourceSlice>,
    ops: &[Op],
    config: &PublisherConfig,
    learning: &mut Learning<'_>,
) -> Result<bool, PublishError> {
    let before: Vec<features::Feature> = learning.served.missing.keys().copied().collect();
    for op in ops {
        let used = match op {
            Op::Create(s) | Op::Update(s) => {
                let json = serde_json::to_value(s).unwrap_or_default();
                features::compare(&json, &json).used
            }
            Op::Delete { .. } => continue,
        };
        if !learning.served.needs_dry_run(&used) {
            continue;
        }
        if let Some((sent, got)) = write(slices, op, true).await? {
            learning.served.learn(&features::compare(&sent, &got));
        }
    }
    config
        .features
        .changed(learning.served, learning.server_version);
    Ok(learning.served.missing.keys().any(|f| !before.contains(f)))
}

/// Applies the operations of `diff`; what each real write kept is learnt as well.
async fn apply(
    slices: &Api<ResourceSlice>,
    diff: &diff::SliceDiff,
    config: &PublisherConfig,
    learning: &mut Learning<'_>,
) -> Result<(), PublishError> {
    for w in &diff.warnings {
        tracing::warn!(device = %w.device, field = %w.field, reason = %w.reason, "attribute left out of the ResourceSlice");
    }
    tracing::info!(
        generation = diff.generation,
        ops = diff.ops.len(),
        "updating ResourceSlices"
    );
    let before: Vec<features::Feature> = learning.served.missing.keys().copied().collect();
    for op in &diff.ops {
        match op {
            Op::Create(_) | Op::Update(_) => {
                if let Some((sent, got)) = write(slices, op, false).await? {
                    let kept = features::compare(&sent, &got);
                    for (feature, paths) in &kept.dropped {
                        if feature.is_none() {
                            tracing::warn!(slice = %op.name(), fields = %paths.join(", "), "the API server dropped fields of the ResourceSlice");
                        }
                    }
                    learning.served.learn(&kept);
                }
            }
            Op::Delete {
                name,
                resource_version,
            } => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        resource_version: resource_version.clone(),
                        uid: None,
                    }),
                    ..DeleteParams::default()
                };
                match slices.delete(name, &dp).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(e) => return Err(api_err(format!("deleting ResourceSlice {name}"))(e)),
                }
            }
        }
        tracing::debug!(slice = %op.name(), "applied");
    }
    config
        .features
        .changed(learning.served, learning.server_version);
    if learning.served.missing.keys().any(|f| !before.contains(f)) {
        // Found only now (another server answered the dry run): written as it was; the next
        // reconcile renders without it.
        return Err(PublishError::FeaturesUnsettled);
    }
    Ok(())
}

/// Whether `slice` carries list-type attributes, which the typed client cannot send.
fn has_lists(slice: &ResourceSlice) -> bool {
    slice
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(gpu_dra_core::list_forms::ANNOTATION))
}

/// The ResourceSlice API without types, for slices whose JSON carries list values.
fn raw_slices(slices: &Api<ResourceSlice>) -> Api<DynamicObject> {
    Api::all_with(
        slices.clone().into_client(),
        &ApiResource::erase::<ResourceSlice>(&()),
    )
}

/// `slice` with its list values written in ([`gpu_dra_core::list_forms::wire`]).
fn as_dynamic(slice: &ResourceSlice) -> Result<DynamicObject, PublishError> {
    let json = gpu_dra_core::list_forms::wire(slice)?;
    serde_json::from_value(json).map_err(|source| {
        PublishError::ListForm(gpu_dra_core::list_forms::ListFormError::Serialize {
            slice: slice.metadata.name.clone().unwrap_or_default(),
            source,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(3));
        let delays: Vec<Duration> = (0..5).map(|_| b.fail()).collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 3000, 3000].map(Duration::from_millis)
        );
        assert_eq!(b.failures, 5);
        b.reset();
        assert_eq!(b.fail(), Duration::from_millis(500));
    }

    #[test]
    fn selector_names_node_and_driver() {
        let c = PublisherConfig::new("node-a", "gpu.nvidia.com");
        assert_eq!(
            c.selector(),
            "spec.nodeName=node-a,spec.driver=gpu.nvidia.com"
        );
        assert_eq!(c.rediscover_interval, Duration::from_secs(60));
    }
}
