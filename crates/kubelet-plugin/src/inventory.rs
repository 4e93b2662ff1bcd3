//! The node's one live inventory: what the publisher publishes, what prepare plans against,
//! and the health conditions of its devices.
//!
//! The problem it solves: prepare used to plan against the inventory found at start while the
//! publisher rediscovered on its own. After a MIG re-layout a device name
//! (`gpu-0-mig-1g5gb-19-0`: profile, profile ID, placement) can name a different GPU instance
//! than the one published, and the container would get another instance's capability nodes.
//!
//! Now there is one owner. [`LiveInventory::rediscover`] is the only discovery (the
//! publisher's periodic one, and one per prepare that finds a claim's device changed); every
//! discovery that finds a change replaces the snapshot, which wakes the publisher. Prepare
//! calls [`LiveInventory::resolve`]: it asks the backend whether the claim's devices are still
//! as the snapshot records them ([`GpuInventory::still_current`]: a few NVML calls per claimed
//! device, whatever the node's size) and else discovers live, so GI/CI IDs, UUIDs and
//! capability nodes are the hardware's now; then it refuses a device whose identity (UUID)
//! differs from what this node last published, or which is gone, with a message that says why. The refusal republishes at once (the discovery
//! changed the snapshot); the kubelet's retry then prepares the device as it is now, or keeps
//! failing for a device that no longer exists until the claim is allocated again.
//!
//! Discoveries are coalesced: a caller that waited while another discovery ran, one that
//! began after the caller asked, takes that result (NVML init and enumeration cost a few
//! milliseconds per GPU; concurrent prepares need not each pay it).
//!
//! Dynamic MIG GPUs ([`GpuMode::DynamicMig`]) are published as placements, not as the MIG
//! devices that exist on them: those are instances prepare created for claims, with a new UUID
//! each time. So they are never recorded as published identities, and [`LiveInventory::resolve`]
//! takes a device on a dynamic GPU as it is now (prepare has just created it). Which of them
//! are claims' dynamic devices, the driver tells ([`LiveInventory::set_dynamic_mig_devices`]);
//! the others (kept from before the GPU became dynamic) stay static devices in the rendering.
//!
//! A driver upgraded in place: every discovery loads NVML from a fresh lookup (the backend's
//! business), so the first one after the swap reads the new driver. While discoveries fail
//! because NVML as a whole is out of reach, the inventory keeps what it had (devices stay
//! published; prepares fail saying why) and records since when ([`LiveInventory::nvml_unreachable`],
//! which `/healthz` reports). A discovery that finds another driver version calls the
//! listeners registered with [`LiveInventory::on_driver_version`] (the CDI host files are
//! scanned again) before the new inventory becomes current, so no prepare that sees the new
//! version writes a spec naming the old files.
//!
//! Health: observations of a [`gpu_dra_device::HealthSource`] go into one
//! [`HealthBook`]; the snapshot carries its [`HealthView`] for the inventory of the moment
//! (taints for the publisher, health for the kubelet's health stream).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use gpu_dra_core::health::{HealthBook, HealthPolicy, HealthView};
use gpu_dra_core::partitioning::{GpuMode, Partitioning};
use gpu_dra_device::{DeviceError, GpuInventory, HealthObservation, Inventory};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// The inventory and device health of one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The GPUs and their allocatable devices.
    pub inventory: Arc<Inventory>,
    /// Taints and health of those devices.
    pub health: Arc<HealthView>,
    /// How each GPU is offered.
    pub partitioning: Arc<Partitioning>,
    /// Names of the dynamic MIG devices that claims' checkpoint records hold (set before their
    /// instances are created, cleared after they are destroyed): their instances are left to
    /// their placement devices when rendering; every other MIG device on a dynamic GPU stays
    /// a static device ([`gpu_dra_core::partitioning::render`]).
    pub dynamic_mig_devices: Arc<BTreeSet<String>>,
}

impl Snapshot {
    /// Whether two snapshots render the same ResourceSlices.
    pub fn same_slices(&self, other: &Snapshot) -> bool {
        self.inventory == other.inventory
            && self.health.taints == other.health.taints
            && self.partitioning == other.partitioning
            && self.dynamic_mig_devices == other.dynamic_mig_devices
    }
}

/// Why prepare refuses a device.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The live discovery failed.
    #[error("cannot read this node's GPUs to prepare the claim: {0}")]
    Discovery(#[from] DeviceError),
    /// The device is not allocatable on the node now.
    #[error(
        "device {device} is no longer on this node (published {published}; the MIG layout or MIG mode changed since): this node's ResourceSlices are being republished; delete the claim's pod (or the claim) so that it is allocated again"
    )]
    Gone {
        /// Device name.
        device: String,
        /// What was published under that name.
        published: String,
    },
    /// The device's GPU fell off the bus.
    #[error(
        "device {device} is on GPU {gpu}, which is lost (fallen off the bus); the device is tainted; delete the claim's pod (or the claim) so that it is allocated elsewhere"
    )]
    Lost {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
    },
    /// The device under that name is another one now.
    #[error(
        "device {device} changed since this node published it (published as {published}, now {now}: its MIG instance was destroyed and created again); refusing to prepare another device than the one the claim was allocated: this node's ResourceSlices are being republished; delete the claim's pod (or the claim) so that it is allocated again"
    )]
    Changed {
        /// Device name.
        device: String,
        /// UUID published.
        published: String,
        /// UUID now.
        now: String,
    },
}

/// Why a claim was refused, kept to refuse its retries alike.
#[derive(Debug, Clone)]
enum Refusal {
    Gone {
        device: String,
        published: String,
    },
    Changed {
        device: String,
        published: String,
        now: String,
    },
}

impl Refusal {
    fn error(self) -> ResolveError {
        match self {
            Refusal::Gone { device, published } => ResolveError::Gone { device, published },
            Refusal::Changed {
                device,
                published,
                now,
            } => ResolveError::Changed {
                device,
                published,
                now,
            },
        }
    }
}

/// The one owner of the node's inventory.
pub struct LiveInventory {
    backend: Arc<dyn GpuInventory>,
    tx: watch::Sender<Snapshot>,
    book: Mutex<HealthBook>,
    /// Device name -> UUID as last published (`None` until the first publication, or when no
    /// publisher runs).
    published: Mutex<Published>,
    /// The last discovery: when it started and what it found.
    last: tokio::sync::Mutex<Option<(Instant, Arc<Inventory>)>>,
    /// Claims refused because a device changed or went away under them: claim UID -> the
    /// refusal. Kept
    /// until the claim is unprepared: after the republication the device's name is valid
    /// again, but the claim was allocated for the old identity (its selector may have named
    /// it), so its retries are refused too.
    refused: Mutex<BTreeMap<String, Refusal>>,
    /// Where the health conditions are kept across restarts (none in tests).
    health_file: Mutex<Option<std::path::PathBuf>>,
    /// Since when, and why, discoveries fail because NVML as a whole cannot be reached.
    unreachable: Mutex<Option<(std::time::Instant, String)>>,
    /// Called with the new inventory when a discovery finds another driver version.
    version_listeners: Mutex<Vec<VersionListener>>,
}

/// What this node had published (device name -> UUID) when a kubelet call arrived: the
/// identities the claims of that call were allocated from, as far as the node can tell. A call's
/// claims are checked against the view taken when it arrived, not against a republication that
/// an earlier claim of the same call started (that claim's refusal republishes at once, and a
/// later claim of the call would otherwise be judged against the new identities and get the new
/// instance under the old name). `None` inside: nothing published yet.
#[derive(Clone, Debug, Default)]
pub struct Published(Option<Arc<BTreeMap<String, String>>>);

impl Published {
    /// The UUID published under the device name `device`, if any.
    pub fn uuid(&self, device: &str) -> Option<&String> {
        self.0.as_ref().and_then(|p| p.get(device))
    }
}

/// A callback for a changed driver version (see [`LiveInventory::on_driver_version`]).
pub type VersionListener = Arc<dyn Fn(&Inventory) + Send + Sync>;

/// A GPU that fell off the bus cannot be read, but its devices stay published (tainted by the
/// health view, refused by prepare) instead of vanishing: the last record of the GPU at that
/// NVML index is kept.
fn keep_lost_gpus(previous: &Inventory, found: &Inventory) -> Inventory {
    let mut merged = found.clone();
    for index in &found.lost_gpus {
        if let Some(gpu) = previous.gpus.iter().find(|g| g.index == *index) {
            merged.gpus.push(gpu.clone());
        }
    }
    merged.gpus.sort_by_key(|g| g.index);
    merged
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

impl LiveInventory {
    /// Starts from a first discovery by `backend` (blocking).
    pub fn discover(
        backend: Arc<dyn GpuInventory>,
        policy: HealthPolicy,
    ) -> Result<Arc<Self>, DeviceError> {
        let inventory = backend.discover()?;
        Ok(Self::with_inventory(backend, inventory, policy))
    }

    /// Starts from an inventory discovered already.
    pub fn with_inventory(
        backend: Arc<dyn GpuInventory>,
        inventory: Inventory,
        policy: HealthPolicy,
    ) -> Arc<Self> {
        let book = HealthBook::new(policy);
        let inventory = Arc::new(inventory);
        let health = Arc::new(book.view(&inventory));
        let (tx, _) = watch::channel(Snapshot {
            inventory,
            health,
            partitioning: Arc::default(),
            dynamic_mig_devices: Arc::default(),
        });
        Arc::new(Self {
            backend,
            tx,
            book: Mutex::new(book),
            published: Mutex::new(Published::default()),
            last: tokio::sync::Mutex::new(None),
            refused: Mutex::new(BTreeMap::new()),
            health_file: Mutex::new(None),
            unreachable: Mutex::new(None),
            version_listeners: Mutex::new(Vec::new()),
        })
    }

    /// The snapshot of now.
    pub fn snapshot(&self) -> Snapshot {
        self.tx.borrow().clone()
    }

    /// The inventory of now.
    pub fn current(&self) -> Arc<Inventory> {
        self.tx.borrow().inventory.clone()
    }

    /// Notified on every new snapshot.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.tx.subscribe()
    }

    /// Discovers the GPUs now (or takes a discovery that began after this call) and makes it
    /// the current inventory.
    pub async fn rediscover(&self) -> Result<Arc<Inventory>, DeviceError> {
        let asked = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((started, inventory)) = last.as_ref()
            && *started >= asked
        {
            return Ok(inventory.clone());
        }
        let started = Instant::now();
        let backend = Arc::clone(&self.backend);
        let version = self.current().driver_version.clone();
        let listeners: Vec<VersionListener> = lock(&self.version_listeners).clone();
        // The listeners do file I/O: on the blocking pool with the discovery.
        let found = tokio::task::spawn_blocking(move || {
            let found = backend.discover()?;
            if found.driver_version != version {
                info!(from = %version, to = %found.driver_version, "the NVIDIA driver's version changed");
                for listener in &listeners {
                    listener(&found);
                }
            }
            Ok::<_, DeviceError>(found)
        })
        .await
        .map_err(|join| DeviceError::Query {
            call: "discover",
            target: "the inventory backend".into(),
            reason: format!("discovery task failed: {join}"),
        })?;
        let found = match found {
            Ok(found) => {
                if let Some((since, _)) = lock(&self.unreachable).take() {
                    info!(
                        after_ms = since.elapsed().as_millis() as u64,
                        "NVML answers again"
                    );
                }
                found
            }
            Err(e) => {
                if matches!(e, DeviceError::Init { .. }) {
                    let mut unreachable = lock(&self.unreachable);
                    if unreachable.is_none() {
                        warn!(error = %e, "NVML cannot be reached; keeping the inventory found last");
                    }
                    let since = unreachable
                        .as_ref()
                        .map_or_else(std::time::Instant::now, |(since, _)| *since);
                    *unreachable = Some((since, e.to_string()));
                }
                return Err(e);
            }
        };
        self.replace_inventory(Arc::new(found));
        let current = self.current();
        *last = Some((started, current.clone()));
        Ok(current)
    }

    fn replace_inventory(&self, found: Arc<Inventory>) {
        let inventory = {
            let current = self.tx.borrow();
            let merged = keep_lost_gpus(&current.inventory, &found);
            if *current.inventory == merged {
                return;
            }
            Arc::new(merged)
        };
        info!(
            gpus = inventory.gpus.len(),
            devices = inventory.devices().count(),
            "inventory changed"
        );
        let health = Arc::new(lock(&self.book).view(&inventory));
        self.tx.send_modify(|snap| {
            snap.inventory = inventory;
            snap.health = health;
        });
    }

    /// Registers `listener`, called (on the blocking pool) with the inventory of every
    /// discovery that finds another driver version than the current inventory's, before that
    /// inventory becomes current.
    pub fn on_driver_version(&self, listener: VersionListener) {
        lock(&self.version_listeners).push(listener);
    }

    /// Since how long, and why, discoveries have failed because NVML as a whole cannot be
    /// reached (no library, no kernel module, library and module of different versions);
    /// `None` while the last discovery succeeded or failed otherwise.
    pub fn nvml_unreachable(&self) -> Option<(std::time::Duration, String)> {
        lock(&self.unreachable)
            .as_ref()
            .map(|(since, why)| (since.elapsed(), why.clone()))
    }

    /// Sets how each GPU is offered (flags, then the node's annotations); wakes the publisher
    /// when it changed.
    pub fn set_partitioning(&self, partitioning: Partitioning) {
        self.tx.send_if_modified(|snap| {
            if *snap.partitioning == partitioning {
                return false;
            }
            info!(?partitioning, "GPU partitioning changed");
            snap.partitioning = Arc::new(partitioning);
            true
        });
    }

    /// Sets the names of the dynamic MIG devices that claims' records hold (see
    /// [`Snapshot::dynamic_mig_devices`]); wakes the publisher when they changed.
    pub fn set_dynamic_mig_devices(&self, names: BTreeSet<String>) {
        self.tx.send_if_modified(|snap| {
            if *snap.dynamic_mig_devices == names {
                return false;
            }
            snap.dynamic_mig_devices = Arc::new(names);
            true
        });
    }

    /// How each GPU is offered now.
    pub fn partitioning(&self) -> Arc<Partitioning> {
        self.tx.borrow().partitioning.clone()
    }

    /// Recomputes the health view of the current inventory; sends a snapshot if it changed.
    fn refresh_health(&self) {
        let book = lock(&self.book);
        self.tx.send_if_modified(|snap| {
            let view = book.view(&snap.inventory);
            if *snap.health == view {
                return false;
            }
            snap.health = Arc::new(view);
            true
        });
    }

    /// Keeps the health conditions in `path` (written on every change, crash-safe) and takes
    /// the conditions a previous plugin instance left there: an XID seen before a restart or
    /// an upgrade still taints its device.
    pub fn keep_health_in(&self, path: std::path::PathBuf) {
        match std::fs::read_to_string(&path) {
            Ok(json) => {
                let policy = lock(&self.book).policy().clone();
                let (book, problem) = HealthBook::from_json(policy, &json);
                if let Some(problem) = problem {
                    warn!(file = %path.display(), %problem, "cannot read the saved device health; starting without it");
                }
                *lock(&self.book) = book;
                self.refresh_health();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(file = %path.display(), error = %e, "cannot read the saved device health")
            }
        }
        *lock(&self.health_file) = Some(path);
    }

    fn save_health(&self) {
        let Some(path) = lock(&self.health_file).clone() else {
            return;
        };
        let json = lock(&self.book).to_json();
        if let Err(e) = gpu_dra_fsutil::write_atomic(&path, json.as_bytes(), 0o644) {
            warn!(file = %path.display(), error = %e, "cannot save the device health");
        }
    }

    /// Takes one health observation.
    pub fn observe(&self, observation: &HealthObservation) {
        let changed = lock(&self.book).observe(observation, now_secs());
        if changed {
            info!(?observation, "device health changed");
            self.save_health();
            self.refresh_health();
        }
    }

    /// Ends health conditions whose time is over.
    pub fn expire_health(&self) {
        if lock(&self.book).expire(now_secs()) {
            info!("device health conditions expired");
            self.save_health();
            self.refresh_health();
        }
    }

    /// The publisher published `inventory`: the identities prepare checks against. MIG devices
    /// on dynamic MIG GPUs (per the partitioning of now) are claims' instances, not published
    /// devices, and are left out.
    pub fn mark_published(&self, inventory: &Inventory) {
        let partitioning = self.partitioning();
        let map = inventory
            .devices()
            .filter(|d| {
                !(matches!(d, gpu_dra_device::DeviceRef::Mig { .. })
                    && partitioning.mode(d.gpu()) == GpuMode::DynamicMig)
            })
            .map(|d| (d.name(), d.uuid().to_string()))
            .collect();
        *lock(&self.published) = Published(Some(Arc::new(map)));
    }

    /// What is published now; a kubelet call takes it when it arrives (see [`Published`]).
    pub fn published(&self) -> Published {
        lock(&self.published).clone()
    }

    /// The live inventory for preparing `devices` of claim `claim_uid`, after checking that
    /// each is still the device this node had published under its name when the call arrived
    /// (`published`, from [`LiveInventory::published`]).
    pub async fn resolve(
        &self,
        claim_uid: &str,
        devices: &[&str],
        published: &Published,
    ) -> Result<Arc<Inventory>, ResolveError> {
        if let Some(refusal) = lock(&self.refused).get(claim_uid).cloned() {
            return Err(refusal.error());
        }
        let live = match self.confirmed(devices).await {
            Some(current) => current,
            None => self.rediscover().await?,
        };
        let partitioning = self.partitioning();
        for &name in devices {
            let was = published.uuid(name);
            if let Some(d) = live.device(name)
                && live.lost_gpus.contains(&d.gpu().index)
            {
                return Err(ResolveError::Lost {
                    device: name.to_string(),
                    gpu: d.gpu().uuid.clone(),
                });
            }
            let Some(now) = live.device(name) else {
                // Unknown names are the planner's to refuse (with the list of known devices);
                // a published one that is gone is ours.
                if let Some(uuid) = was {
                    warn!(claim.uid = %claim_uid, device = %name, published = %uuid, "allocated device is gone");
                    return Err(self.refuse(
                        claim_uid,
                        Refusal::Gone {
                            device: name.to_string(),
                            published: format!("as {uuid}"),
                        },
                    ));
                }
                continue;
            };
            if partitioning.mode(now.gpu()) == GpuMode::DynamicMig {
                // Created by this prepare (or kept from its earlier try): nothing published
                // to compare with.
                continue;
            }
            if let Some(uuid) = was
                && uuid != now.uuid()
            {
                warn!(claim.uid = %claim_uid, device = %name, published = %uuid, now = %now.uuid(), "allocated device changed identity");
                return Err(self.refuse(
                    claim_uid,
                    Refusal::Changed {
                        device: name.to_string(),
                        published: uuid.clone(),
                        now: now.uuid().to_string(),
                    },
                ));
            }
        }
        Ok(live)
    }

    /// The current inventory, when the backend confirms that `devices` are still as it
    /// records them; `None` when it cannot (a device changed, or the check failed), and the
    /// caller discovers.
    async fn confirmed(&self, devices: &[&str]) -> Option<Arc<Inventory>> {
        let current = self.current();
        let (backend, known) = (Arc::clone(&self.backend), Arc::clone(&current));
        let names: Vec<String> = devices.iter().map(|d| (*d).to_owned()).collect();
        let checked = tokio::task::spawn_blocking(move || {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            backend.still_current(&known, &names)
        })
        .await;
        match checked {
            Ok(Ok(true)) => Some(current),
            Ok(Ok(false)) => None,
            Ok(Err(e)) => {
                debug!(error = %e, "cannot check the claim's devices; discovering");
                None
            }
            Err(e) => {
                debug!(error = %e, "device check task failed; discovering");
                None
            }
        }
    }

    /// Keeps `refusal` for the claim's retries: after the republication its device is no longer
    /// (or differently) published, but the claim's allocation still names it.
    fn refuse(&self, claim_uid: &str, refusal: Refusal) -> ResolveError {
        lock(&self.refused).insert(claim_uid.to_string(), refusal.clone());
        refusal.error()
    }

    /// The claim was unprepared: its refusal (if any) is over.
    pub fn forget(&self, claim_uid: &str) {
        lock(&self.refused).remove(claim_uid);
    }
}

impl std::fmt::Debug for LiveInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveInventory")
            .field("snapshot", &*self.tx.borrow())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::fixture::FixtureInventory;
    use gpu_dra_device::testing::{a100, inventory, mig_1g5gb};
    use gpu_dra_device::{HealthEvent, MigDevice};

    fn relayout(mut inv: Inventory, f: impl FnOnce(&mut Vec<MigDevice>)) -> Inventory {
        f(&mut inv.gpus[0].mig_devices);
        inv
    }

    /// A GPU with two 1g.5gb instances, its live inventory over a fixture, and the two
    /// instances' device names.
    struct TwoMig {
        first: Inventory,
        fixture: Arc<FixtureInventory>,
        live: Arc<LiveInventory>,
        n0: String,
        n1: String,
    }

    fn two_mig() -> TwoMig {
        let first = inventory([a100(0).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build()]);
        let fixture = Arc::new(FixtureInventory::new(first.clone()));
        let live = LiveInventory::with_inventory(
            fixture.clone(),
            first.clone(),
            HealthPolicy::new("gpu.nvidia.com"),
        );
        let gpu = &first.gpus[0];
        let (n0, n1) = (
            gpu.mig_devices[0].device_name(gpu),
            gpu.mig_devices[1].device_name(gpu),
        );
        TwoMig {
            first,
            fixture,
            live,
            n0,
            n1,
        }
    }

    /// `first` re-partitioned: placement 0 recreated (new GI ID and UUID), placement 1
    /// destroyed.
    fn recreate_0_remove_1(first: &Inventory) -> Inventory {
        relayout(first.clone(), |migs| {
            migs[0].gi_id = 9;
            migs[0].uuid = "MIG-00000000-0000-5000-8000-000000000099".into();
            migs.remove(1);
        })
    }

    #[tokio::test]
    async fn prepare_sees_the_layout_of_now_and_refuses_changed_or_gone_devices() {
        let TwoMig {
            first,
            fixture,
            live,
            n0,
            n1,
        } = two_mig();
        // Nothing published yet (no publisher): the live device is taken as it is.
        assert!(live.resolve("c0", &[&n0], &live.published()).await.is_ok());
        live.mark_published(&first);
        let mut changes = live.subscribe();
        changes.borrow_and_update();

        // Placement 0 recreated (new GI ID and UUID), placement 1 destroyed.
        let second = recreate_0_remove_1(&first);
        fixture.set(second.clone());
        let err = live
            .resolve("c1", &[&n0], &live.published())
            .await
            .expect_err("changed");
        assert!(matches!(err, ResolveError::Changed { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("MIG-00000000-0000-5000-8000-000000000099")
        );
        assert!(
            changes.has_changed().expect("sender alive"),
            "republish wakes"
        );
        let err = live
            .resolve("c2", &[&n1], &live.published())
            .await
            .expect_err("gone");
        assert!(matches!(err, ResolveError::Gone { .. }), "{err}");

        // Republished: the claim allocated for the old identity stays refused until it is
        // unprepared; a claim allocated now gets the new identity, with its own GI ID.
        live.mark_published(&second);
        let err = live
            .resolve("c1", &[&n0], &live.published())
            .await
            .expect_err("still the old allocation");
        assert!(matches!(err, ResolveError::Changed { .. }), "{err}");
        live.forget("c1");
        assert!(live.resolve("c1", &[&n0], &live.published()).await.is_ok());
        let err = live
            .resolve("c2", &[&n1], &live.published())
            .await
            .expect_err("still gone");
        assert!(matches!(err, ResolveError::Gone { .. }), "{err}");
        let inv = live
            .resolve("c3", &[&n0], &live.published())
            .await
            .expect("republished");
        assert_eq!(
            inv.device(&n0).map(|d| d.uuid()),
            second.device(&n0).map(|d| d.uuid())
        );
        assert_eq!(*live.current(), second);
    }

    #[tokio::test]
    async fn claims_of_one_call_are_judged_by_what_was_published_when_the_call_arrived() {
        let TwoMig {
            first,
            fixture,
            live,
            n0,
            n1,
        } = two_mig();
        live.mark_published(&first);
        let second = recreate_0_remove_1(&first);
        fixture.set(second.clone());
        // One kubelet call with two claims allocated from the first slices: the first claim's
        // refusal republishes before the second is checked (the publisher marks the new
        // identities), but the second is still judged by the call's view.
        let call = live.published();
        let err = live.resolve("c1", &[&n1], &call).await.expect_err("gone");
        assert!(matches!(err, ResolveError::Gone { .. }), "{err}");
        live.mark_published(&second);
        let err = live
            .resolve("c2", &[&n0], &call)
            .await
            .expect_err("recreated under the call's old identity");
        assert!(matches!(err, ResolveError::Changed { .. }), "{err}");
        // A call that arrives after the republication gets the new identity.
        assert!(live.resolve("c3", &[&n0], &live.published()).await.is_ok());
    }

    #[tokio::test]
    async fn instances_on_dynamic_gpus_are_never_published_identities() {
        use gpu_dra_core::partitioning::GpuSelection;
        use gpu_dra_device::testing::a100_dynamic;
        let with = |uuid: &str| inventory([a100_dynamic(0).mig(mig_1g5gb(0).uuid(uuid)).build()]);
        let first = with("MIG-00000000-0000-5000-8000-000000000001");
        let fixture = Arc::new(FixtureInventory::new(first.clone()));
        let live = LiveInventory::with_inventory(
            fixture.clone(),
            first.clone(),
            HealthPolicy::new("gpu.nvidia.com"),
        );
        live.set_partitioning(Partitioning {
            dynamic_mig: GpuSelection::All,
            ..Partitioning::default()
        });
        let gpu = &first.gpus[0];
        let name = gpu.mig_devices[0].device_name(gpu);
        live.mark_published(&first);
        // Destroyed and created again for the next claim: a new UUID, not a changed device.
        fixture.set(with("MIG-00000000-0000-5000-8000-000000000002"));
        assert!(
            live.resolve("c1", &[&name], &live.published())
                .await
                .is_ok()
        );
        // The same instance on a static GPU is refused.
        live.set_partitioning(Partitioning::default());
        live.mark_published(&first);
        let err = live
            .resolve("c2", &[&name], &live.published())
            .await
            .expect_err("static");
        assert!(matches!(err, ResolveError::Changed { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_lost_gpu_stays_published_and_is_refused() {
        let first = inventory([a100(0).build(), a100(1).build()]);
        let fixture = Arc::new(FixtureInventory::new(first.clone()));
        let live = LiveInventory::with_inventory(
            fixture.clone(),
            first.clone(),
            HealthPolicy::new("gpu.nvidia.com"),
        );
        let mut lost = first.clone();
        lost.gpus.remove(1);
        lost.lost_gpus = vec![first.gpus[1].index];
        fixture.set(lost);
        let err = live
            .resolve("c", &["gpu-1"], &live.published())
            .await
            .expect_err("lost");
        assert!(matches!(err, ResolveError::Lost { .. }), "{err}");
        assert_eq!(live.current().gpus.len(), 2, "still published");
        assert!(
            live.resolve("c", &["gpu-0"], &live.published())
                .await
                .is_ok()
        );
        fixture.set(first.clone());
        assert!(
            live.resolve("c", &["gpu-1"], &live.published())
                .await
                .is_ok()
        );
        assert!(live.current().lost_gpus.is_empty());
    }

    /// A fixture backend that counts whole-node discoveries.
    struct Counting {
        fixture: FixtureInventory,
        discoveries: std::sync::atomic::AtomicUsize,
    }

    impl GpuInventory for Counting {
        fn discover(&self) -> Result<Inventory, DeviceError> {
            self.discoveries
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.fixture.discover()
        }
        fn still_current(&self, known: &Inventory, names: &[&str]) -> Result<bool, DeviceError> {
            // The fixture's answer, without counting it as a discovery.
            self.fixture.still_current(known, names)
        }
    }

    #[tokio::test]
    async fn a_prepare_of_unchanged_devices_does_not_discover_the_node() {
        let first = inventory([
            a100(0).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build(),
            a100(1).build(),
        ]);
        let backend = Arc::new(Counting {
            fixture: FixtureInventory::new(first.clone()),
            discoveries: Default::default(),
        });
        let discoveries = || {
            backend
                .discoveries
                .load(std::sync::atomic::Ordering::SeqCst)
        };
        let live = LiveInventory::with_inventory(
            backend.clone(),
            first.clone(),
            HealthPolicy::new("gpu.nvidia.com"),
        );
        live.mark_published(&first);
        let gpu = &first.gpus[0];
        let n0 = gpu.mig_devices[0].device_name(gpu);
        live.resolve("c0", &["gpu-1", &n0], &live.published())
            .await
            .expect("unchanged");
        assert_eq!(discoveries(), 0);
        // Another device's change is the periodic rediscovery's, not this claim's.
        let other = relayout(first.clone(), |migs| migs[1].uuid = "MIG-other".into());
        backend.fixture.set(other);
        live.resolve("c1", &["gpu-1"], &live.published())
            .await
            .expect("unchanged");
        assert_eq!(discoveries(), 0);
        // The claim's own device changed: discovered, and refused as before.
        let changed = relayout(first.clone(), |migs| migs[0].uuid = "MIG-new".into());
        backend.fixture.set(changed.clone());
        let err = live
            .resolve("c2", &[&n0], &live.published())
            .await
            .expect_err("changed");
        assert!(matches!(err, ResolveError::Changed { .. }), "{err}");
        assert_eq!(discoveries(), 1);
        assert_eq!(*live.current(), changed);
    }

    #[tokio::test]
    async fn discoveries_are_coalesced_and_failures_reported() {
        let first = inventory([a100(0).build()]);
        let fixture = Arc::new(FixtureInventory::new(first.clone()));
        let live = LiveInventory::with_inventory(
            fixture.clone(),
            first,
            HealthPolicy::new("gpu.nvidia.com"),
        );
        let (a, b) = tokio::join!(live.rediscover(), live.rediscover());
        assert!(a.is_ok() && b.is_ok());
        fixture.fail("driver unloaded");
        let err = live
            .resolve("c", &["gpu-0"], &live.published())
            .await
            .expect_err("discovery fails");
        assert!(err.to_string().contains("driver unloaded"), "{err}");
    }

    #[tokio::test]
    async fn health_observations_change_the_snapshot() {
        let inv = inventory([a100(0).build()]);
        let uuid = inv.gpus[0].uuid.clone();
        let live = LiveInventory::with_inventory(
            Arc::new(FixtureInventory::new(inv.clone())),
            inv,
            HealthPolicy::new("gpu.nvidia.com"),
        );
        let mut changes = live.subscribe();
        changes.borrow_and_update();
        live.observe(&HealthObservation::Event {
            gpu_uuid: uuid.clone(),
            event: HealthEvent::Xid(13),
            instance: None,
        });
        assert!(
            !changes.has_changed().expect("alive"),
            "application XID ignored"
        );
        live.observe(&HealthObservation::Event {
            gpu_uuid: uuid.clone(),
            event: HealthEvent::Xid(48),
            instance: None,
        });
        assert!(changes.has_changed().expect("alive"));
        let snap = live.snapshot();
        assert_eq!(snap.health.taints["gpu-0"][0].key, "gpu.nvidia.com/xid");
        assert!(!snap.health.devices["gpu-0"].healthy);
        live.observe(&HealthObservation::Probe {
            gpu_uuid: uuid,
            reachable: true,
            recovery_action: Some(1),
        });
        live.observe(&HealthObservation::Probe {
            gpu_uuid: inv_uuid(&live),
            reachable: true,
            recovery_action: Some(0),
        });
        assert!(live.snapshot().health.taints.is_empty());
    }

    fn inv_uuid(live: &LiveInventory) -> String {
        live.current().gpus[0].uuid.clone()
    }
}
