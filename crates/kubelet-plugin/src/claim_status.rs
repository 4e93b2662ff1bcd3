//! Device data in ResourceClaim status: after a claim is prepared, each of its devices gets an
//! entry in the claim's `status.devices` (Kubernetes' `AllocatedDeviceStatus`, feature
//! `DRAResourceClaimDeviceStatus`, GA in 1.37) with the device's UUID, product name, MIG
//! profile and parent UUID, memory share and sharing strategy as `data`
//! ([`gpu_dra_api::device_status::DeviceStatusData`]) and a `Ready` condition; after the claim
//! is unprepared, the entries are removed.
//!
//! The problem: a ResourceSlice names devices, not physical GPUs. A dynamic MIG device has no
//! UUID until its instance is created at prepare, and a memory share's device is the whole GPU
//! several claims hold; users and monitoring (which reports metrics per GPU or MIG UUID) could
//! not tell which device a pod got without access to the node.
//!
//! How it is written:
//! - Server-side apply on the `status` subresource with one field manager per node
//!   ([`field_manager`], `<driver>/<node>`). The list is a map keyed by driver, pool, device
//!   and shareID, so an apply owns exactly the entries it sends: entries of other drivers, or
//!   of our driver's plugin on another node (a claim whose devices span nodes), are never
//!   touched. Removing means applying the claim with no entries: the server drops what this
//!   manager owned. The patch carries the claim's UID, so a claim deleted and recreated under
//!   the same name is never written to (the API server refuses the mismatch).
//! - Off the kubelet's path: the kubelet waits for our prepare answer, and a status is
//!   information, not a condition of running the pod. [`StatusWriter`] takes the desired
//!   entries without waiting and one background task writes them; a failed write never fails a
//!   prepare or unprepare. Transient failures (API server unreachable, throttled, 5xx) are
//!   retried with backoff (0.5 s doubling to 60 s) for as long as the claim's latest state is
//!   not written; a newer state of the same claim (its unprepare) replaces a pending one, so
//!   the last word always wins. Refusals that a retry cannot fix (the claim is gone or
//!   replaced, deallocated, or our RBAC does not allow the write) are logged and dropped.
//! - Repeats cost nothing: a repeat prepare whose entries equal the ones written (or pending)
//!   sends no request, and the `Ready` condition keeps its first transition time.
//! - A state pending when the plugin stops is lost; the kubelet's next prepare of the claim
//!   (after a kubelet restart) writes it again. A removal always goes out, even when this
//!   process did not write the entries (the previous plugin instance may have).
//!
//! What the API server checks, and why the entries always pass: every entry must name a
//! device of the claim's allocation (ours come from the prepared allocation results, with
//! their pool and shareID), at most 8 conditions (we send one) and `data` a JSON object of at
//! most 10 KiB (ours is a few hundred bytes: NVML's product names and UUIDs are at most 96
//! bytes each, see the test). On clusters with `DRAResourceClaimGranularStatusAuthorization`
//! (beta, on since 1.36) it also checks the verb `associated-node:patch` on the synthetic
//! `resourceclaims/driver` subresource named after the driver; the chart grants it, and its
//! node-restriction policy narrows the write to entries of this node's pool.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use gpu_dra_api::device_status::{DeviceStatusData, READY_CONDITION};
use gpu_dra_core::checkpoint::PreparedDevice;
use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::driver::ClaimRef;

/// The reason of the `Ready` condition of a prepared device.
pub const READY_REASON: &str = "Prepared";

/// The Kubernetes limit on a field manager's name.
const FIELD_MANAGER_MAX: usize = 128;

/// Receives the claims the driver prepared and unprepared. Calls never wait for the API
/// server and cannot fail: the status is reported on the side.
pub trait ClaimStatusSink: Send + Sync {
    /// `claim` is prepared with `devices`, found in `inventory` (the node's inventory of now).
    fn prepared(&self, claim: &ClaimRef, devices: &[PreparedDevice], inventory: &Inventory);
    /// `claim` is unprepared: its entries go.
    fn unprepared(&self, claim: &ClaimRef);
}

/// One device's entry as this plugin means it, before the API's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEntry {
    /// Pool (the node's name).
    pub pool: String,
    /// Device name in the pool.
    pub device: String,
    /// Share ID of the allocation, when allocated as a share.
    pub share_id: Option<String>,
    /// What the device is.
    pub data: DeviceStatusData,
}

/// The entries of `devices` (one per prepared device, in order), described from `inventory`.
/// A device the inventory no longer has (a GPU that fell off the bus since) is described by
/// what the checkpoint recorded: its UUID and memory share.
pub fn device_entries(devices: &[PreparedDevice], inventory: &Inventory) -> Vec<DeviceEntry> {
    devices
        .iter()
        .map(|d| DeviceEntry {
            pool: d.pool.clone(),
            device: d.device.clone(),
            share_id: d.share_id.clone(),
            data: describe(d, inventory),
        })
        .collect()
}

fn describe(d: &PreparedDevice, inventory: &Inventory) -> DeviceStatusData {
    let mut data = DeviceStatusData {
        uuid: d.uuid.clone(),
        memory_share_bytes: d.memory_share_bytes,
        sharing_strategy: d.sharing_strategy.clone(),
        ..DeviceStatusData::default()
    };
    for gpu in &inventory.gpus {
        if gpu.uuid == d.uuid || (d.uuid.is_empty() && gpu.device_name() == d.device) {
            data.uuid.clone_from(&gpu.uuid);
            data.kind = "gpu".into();
            data.product_name.clone_from(&gpu.product_name);
            return data;
        }
        if let Some(mig) = gpu
            .mig_devices
            .iter()
            .find(|m| m.uuid == d.uuid || (d.uuid.is_empty() && m.device_name(gpu) == d.device))
        {
            data.uuid.clone_from(&mig.uuid);
            data.kind = "mig".into();
            data.product_name.clone_from(&gpu.product_name);
            data.profile = Some(mig.profile.clone());
            data.parent_uuid = Some(gpu.uuid.clone());
            return data;
        }
    }
    data
}

/// The `status.devices` entries of `entries` for driver `driver`, each `Ready` since `since`,
/// prepared on `node`.
pub fn api_entries(
    driver: &str,
    node: &str,
    entries: &[DeviceEntry],
    since: Timestamp,
) -> Vec<AllocatedDeviceStatus> {
    entries
        .iter()
        .map(|e| AllocatedDeviceStatus {
            driver: driver.to_owned(),
            pool: e.pool.clone(),
            device: e.device.clone(),
            share_id: e.share_id.clone(),
            conditions: Some(vec![Condition {
                type_: READY_CONDITION.to_owned(),
                status: "True".to_owned(),
                reason: READY_REASON.to_owned(),
                message: format!("prepared by the node plugin on {node}"),
                last_transition_time: Time(since),
                observed_generation: None,
            }]),
            data: Some(RawExtension(
                serde_json::to_value(&e.data).unwrap_or_else(|_| json!({"uuid": e.data.uuid})),
            )),
            network_data: None,
        })
        .collect()
}

/// The server-side apply patch that makes `claim`'s entries of this field manager exactly
/// `devices` (none: the claim without status, which removes what the manager owned).
pub fn apply_patch(claim: &ClaimRef, devices: &[AllocatedDeviceStatus]) -> Value {
    let mut patch = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
    });
    if !devices.is_empty() {
        patch["status"] = json!({ "devices": devices });
    }
    patch
}

/// The field manager of the plugin on `node`: `<driver>/<node>`, shortened with a hash of the
/// whole name when it would pass Kubernetes' 128-byte limit (so two long node names never
/// share a manager, which would let one node's apply drop the other's entries).
pub fn field_manager(driver: &str, node: &str) -> String {
    let name = format!("{driver}/{node}");
    if name.len() <= FIELD_MANAGER_MAX {
        return name;
    }
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut cut = FIELD_MANAGER_MAX - 17;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{hash:016x}", &name[..cut])
}

/// Why a status write failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// A retry cannot help: the claim is gone, replaced or deallocated, or the write is not
    /// allowed.
    #[error("refused: {0}")]
    Refused(String),
    /// The API server was not reached or asked to come back later.
    #[error("{0}")]
    Transient(String),
}

/// Where the patches go: the API server in the plugin, a recording double in tests.
pub trait StatusApi: Send + Sync {
    /// Applies `patch` to the status of claim `namespace/name`.
    fn apply<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        patch: &'a Value,
    ) -> BoxFuture<'a, Result<(), WriteError>>;
}

/// Server-side apply through the API server.
pub struct KubeStatusApi {
    client: kube::Client,
    field_manager: String,
}

impl KubeStatusApi {
    /// Applies with `client` as `field_manager`.
    pub fn new(client: kube::Client, field_manager: String) -> Self {
        KubeStatusApi {
            client,
            field_manager,
        }
    }
}

impl StatusApi for KubeStatusApi {
    fn apply<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        patch: &'a Value,
    ) -> BoxFuture<'a, Result<(), WriteError>> {
        Box::pin(async move {
            let api: kube::Api<ResourceClaim> =
                kube::Api::namespaced(self.client.clone(), namespace);
            let params = kube::api::PatchParams::apply(&self.field_manager).force();
            match api
                .patch_status(name, &params, &kube::api::Patch::Apply(patch))
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) => Err(classify(status.code, &status.message)),
                Err(e) => Err(WriteError::Transient(e.to_string())),
            }
        })
    }
}

/// Refused for what a retry cannot change: gone (404), replaced (409, the UID differs),
/// forbidden (403: RBAC or the node-restriction policy) or invalid (422: e.g. the claim was
/// deallocated meanwhile); everything else (429, 5xx) is retried.
fn classify(code: u16, message: &str) -> WriteError {
    match code {
        403 => WriteError::Refused(format!(
            "forbidden ({message}); the plugin's service account needs patch on resourceclaims/status and associated-node:patch on resourceclaims/driver (the chart's RBAC), or turn the status off with --claim-device-status=false"
        )),
        404 | 409 | 410 | 422 => WriteError::Refused(format!("{code}: {message}")),
        _ => WriteError::Transient(format!("{code}: {message}")),
    }
}

/// One claim's desired state: its entries, or none after its unprepare.
#[derive(Debug, Clone)]
struct Desired {
    claim: ClaimRef,
    entries: Vec<DeviceEntry>,
    since: Timestamp,
}

/// Takes the claims' desired status from the driver and hands them to the background writer
/// ([`StatusWriter::start`]).
pub struct StatusWriter {
    driver: String,
    node: String,
    tx: mpsc::UnboundedSender<Desired>,
}

/// Retry delays of the background writer.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// First retry delay.
    pub initial: Duration,
    /// Longest retry delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(60),
        }
    }
}

impl StatusWriter {
    /// Starts the background writer over `api` for driver `driver` on `node`; it ends when the
    /// returned writer is dropped.
    pub fn start(
        driver: &str,
        node: &str,
        api: Arc<dyn StatusApi>,
        backoff: Backoff,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(write_loop(
            driver.to_owned(),
            node.to_owned(),
            api,
            rx,
            backoff,
        ));
        (
            StatusWriter {
                driver: driver.to_owned(),
                node: node.to_owned(),
                tx,
            },
            task,
        )
    }

    fn send(&self, desired: Desired) {
        if self.tx.send(desired).is_err() {
            debug!(driver = %self.driver, node = %self.node, "claim status writer stopped; status not written");
        }
    }
}

impl ClaimStatusSink for StatusWriter {
    fn prepared(&self, claim: &ClaimRef, devices: &[PreparedDevice], inventory: &Inventory) {
        self.send(Desired {
            claim: claim.clone(),
            entries: device_entries(devices, inventory),
            since: Timestamp::now(),
        });
    }

    fn unprepared(&self, claim: &ClaimRef) {
        self.send(Desired {
            claim: claim.clone(),
            entries: Vec::new(),
            since: Timestamp::now(),
        });
    }
}

/// A state waiting to be written.
struct Pending {
    desired: Desired,
    due: Instant,
    delay: Duration,
}

async fn write_loop(
    driver: String,
    node: String,
    api: Arc<dyn StatusApi>,
    mut rx: mpsc::UnboundedReceiver<Desired>,
    backoff: Backoff,
) {
    // By claim UID: what waits to be written, and what was written (entries only, for the
    // repeats that change nothing; removed once the claim's entries are removed).
    let mut pending: BTreeMap<String, Pending> = BTreeMap::new();
    let mut written: HashMap<String, Vec<DeviceEntry>> = HashMap::new();
    loop {
        let next = pending.values().map(|p| p.due).min();
        tokio::select! {
            message = rx.recv() => {
                let Some(desired) = message else { return };
                let uid = desired.claim.uid.clone();
                let same = |entries: &Vec<DeviceEntry>| {
                    !desired.entries.is_empty() && *entries == desired.entries
                };
                if pending.get(&uid).is_some_and(|p| same(&p.desired.entries))
                    || (!pending.contains_key(&uid) && written.get(&uid).is_some_and(same))
                {
                    continue;
                }
                pending.insert(uid, Pending { desired, due: Instant::now(), delay: backoff.initial });
            }
            () = sleep_until(next), if next.is_some() => {
                let now = Instant::now();
                let due: Vec<String> = pending
                    .iter()
                    .filter(|(_, p)| p.due <= now)
                    .map(|(uid, _)| uid.clone())
                    .collect();
                for uid in due {
                    let Some(mut p) = pending.remove(&uid) else { continue };
                    let d = &p.desired;
                    let entries = api_entries(&driver, &node, &d.entries, d.since);
                    let patch = apply_patch(&d.claim, &entries);
                    let claim = format!("{}/{}", d.claim.namespace, d.claim.name);
                    match api.apply(&d.claim.namespace, &d.claim.name, &patch).await {
                        Ok(()) => {
                            debug!(claim.uid = %uid, %claim, devices = entries.len(), "claim status written");
                            if d.entries.is_empty() {
                                written.remove(&uid);
                            } else {
                                written.insert(uid, p.desired.entries);
                            }
                        }
                        Err(WriteError::Refused(reason)) => {
                            warn!(claim.uid = %uid, %claim, %reason, "claim status not written");
                            written.remove(&uid);
                        }
                        Err(WriteError::Transient(reason)) => {
                            info!(claim.uid = %uid, %claim, %reason, retry_in = ?p.delay, "claim status write failed; retrying");
                            p.due = Instant::now() + p.delay;
                            p.delay = (p.delay * 2).min(backoff.max);
                            pending.insert(uid, p);
                        }
                    }
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use gpu_dra_device::testing::a100_inventory;

    use super::*;

    const DRIVER: &str = "gpu.nvidia.com";
    const NODE: &str = "node-a";

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
        }
    }

    fn prepared(device: &str, uuid: &str) -> PreparedDevice {
        PreparedDevice {
            device: device.into(),
            pool: NODE.into(),
            request_names: vec!["gpu".into()],
            cdi_device_ids: Vec::new(),
            uuid: uuid.into(),
            admin_access: false,
            share_id: None,
            memory_share_bytes: None,
            sharing_strategy: None,
            extra: Default::default(),
        }
    }

    #[test]
    fn whole_gpus_mig_devices_and_shares_are_described_from_the_inventory() {
        let inventory = a100_inventory(2, 1);
        let gpu = &inventory.gpus[1];
        let parent = &inventory.gpus[0];
        let mig = &parent.mig_devices[0];
        let mut share = prepared(&gpu.device_name(), &gpu.uuid);
        share.share_id = Some("0d1c3a0e-0000-4000-8000-000000000001".into());
        share.memory_share_bytes = Some(2 << 30);
        share.sharing_strategy = Some("MPS".into());
        let entries = device_entries(
            &[
                prepared(&mig.device_name(parent), &mig.uuid),
                share,
                prepared("gpu-7", "GPU-gone"),
            ],
            &inventory,
        );
        assert_eq!(
            entries[0].data,
            DeviceStatusData {
                uuid: mig.uuid.clone(),
                kind: "mig".into(),
                product_name: parent.product_name.clone(),
                profile: Some(mig.profile.clone()),
                parent_uuid: Some(parent.uuid.clone()),
                memory_share_bytes: None,
                sharing_strategy: None,
            }
        );
        assert!(!parent.product_name.is_empty() && !mig.profile.is_empty());
        assert_eq!(entries[1].data.kind, "gpu");
        assert_eq!(entries[1].data.memory_share_bytes, Some(2 << 30));
        assert_eq!(entries[1].data.sharing_strategy.as_deref(), Some("MPS"));
        assert_eq!(
            entries[1].share_id.as_deref(),
            Some("0d1c3a0e-0000-4000-8000-000000000001")
        );
        // A GPU gone from the inventory keeps what the checkpoint knows.
        assert_eq!(entries[2].data.uuid, "GPU-gone");
        assert_eq!(entries[2].data.kind, "");
    }

    #[test]
    fn entries_pass_the_api_servers_rules_even_with_the_longest_nvml_strings() {
        let entry = DeviceEntry {
            pool: NODE.into(),
            device: "gpu-0-mig-1g5gb-19-0".into(),
            share_id: Some("0d1c3a0e-0000-4000-8000-000000000001".into()),
            data: DeviceStatusData {
                // NVML's buffers: 96 bytes for names and UUIDs.
                uuid: "M".repeat(96),
                kind: "mig".into(),
                product_name: "P".repeat(96),
                profile: Some("7g.80gb+me".into()),
                parent_uuid: Some("G".repeat(96)),
                memory_share_bytes: Some(u64::MAX),
                sharing_strategy: Some("TimeSlicing".into()),
            },
        };
        let since = Timestamp::from_second(1_800_000_000).expect("time");
        let api = api_entries(DRIVER, NODE, &[entry], since);
        let data = serde_json::to_vec(&api[0].data.as_ref().expect("data").0).expect("json");
        assert!(
            data.len() <= gpu_dra_api::device_status::DEVICE_STATUS_DATA_MAX_BYTES,
            "{} bytes",
            data.len()
        );
        let conditions = api[0].conditions.as_ref().expect("conditions");
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].type_, "Ready");
        assert_eq!(conditions[0].status, "True");
        // The API's pattern for reasons: ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$
        assert!(
            READY_REASON
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        );
        assert_eq!(
            api[0].share_id.as_deref(),
            Some("0d1c3a0e-0000-4000-8000-000000000001")
        );
    }

    #[test]
    fn the_patch_names_the_claims_uid_and_a_removal_sends_no_status() {
        let c = claim("uid-1");
        let since = Timestamp::from_second(1_800_000_000).expect("time");
        let entries = api_entries(
            DRIVER,
            NODE,
            &device_entries(&[prepared("gpu-1", "GPU-1")], &a100_inventory(2, 1)),
            since,
        );
        let patch = apply_patch(&c, &entries);
        assert_eq!(patch["metadata"]["uid"], "uid-1");
        assert_eq!(patch["kind"], "ResourceClaim");
        assert_eq!(patch["status"]["devices"][0]["driver"], DRIVER);
        assert_eq!(patch["status"]["devices"][0]["pool"], NODE);
        assert_eq!(patch["status"]["devices"][0]["device"], "gpu-1");
        assert_eq!(
            patch["status"]["devices"][0]["conditions"][0]["lastTransitionTime"],
            "2027-01-15T08:00:00Z"
        );
        assert!(patch.get("spec").is_none(), "no field outside the status");
        let removal = apply_patch(&c, &[]);
        assert!(removal.get("status").is_none(), "{removal}");
    }

    #[test]
    fn field_managers_are_per_node_and_fit_the_limit() {
        assert_eq!(field_manager(DRIVER, NODE), "gpu.nvidia.com/node-a");
        let long_a = format!("{}a", "n".repeat(200));
        let long_b = format!("{}b", "n".repeat(200));
        let (a, b) = (
            field_manager(DRIVER, &long_a),
            field_manager(DRIVER, &long_b),
        );
        assert!(a.len() <= 128 && b.len() <= 128, "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn api_errors_are_retried_only_when_a_retry_can_help() {
        for code in [403, 404, 409, 422] {
            assert!(
                matches!(classify(code, "x"), WriteError::Refused(_)),
                "{code}"
            );
        }
        for code in [429, 500, 503, 504] {
            assert!(
                matches!(classify(code, "x"), WriteError::Transient(_)),
                "{code}"
            );
        }
        assert!(
            classify(403, "no")
                .to_string()
                .contains("--claim-device-status")
        );
    }

    /// What the driver told the sink, in order.
    #[derive(Default)]
    struct Told(Mutex<Vec<String>>);

    impl ClaimStatusSink for Told {
        fn prepared(&self, claim: &ClaimRef, devices: &[PreparedDevice], inventory: &Inventory) {
            let entries = device_entries(devices, inventory);
            let uuids: Vec<&str> = entries.iter().map(|e| e.data.uuid.as_str()).collect();
            self.0.lock().expect("lock").push(format!(
                "prepared {} {}",
                claim.uid,
                uuids.join(",")
            ));
        }

        fn unprepared(&self, claim: &ClaimRef) {
            self.0
                .lock()
                .expect("lock")
                .push(format!("unprepared {}", claim.uid));
        }
    }

    #[tokio::test]
    async fn the_driver_reports_prepares_repeats_and_unprepares_but_no_failed_prepare() {
        use crate::testing::{DriverBuilder, MemoryClaims, allocated_claim, simulate_host};
        let dir = tempfile::tempdir().expect("tempdir");
        let inventory = a100_inventory(2, 1);
        simulate_host(&dir.path().join("host"), &inventory).expect("host");
        let claims = Arc::new(MemoryClaims::default());
        let told = Arc::new(Told::default());
        let driver = DriverBuilder::new(dir.path(), inventory.clone())
            .node_name(NODE)
            .claims(claims.clone())
            .claim_status(told.clone())
            .checkpoint_path(dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
            .build()
            .expect("driver");
        let parent = &inventory.gpus[0];
        let mig = &parent.mig_devices[0];
        claims.insert(allocated_claim(
            "ns",
            "claim-uid-1",
            "uid-1",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1"), ("mig", &mig.device_name(parent))],
            &[],
        ));
        let c = claim("uid-1");
        driver.prepare(&c).await.expect("prepares");
        driver.prepare(&c).await.expect("repeat");
        driver
            .prepare(&claim("uid-missing"))
            .await
            .expect_err("no such claim");
        driver.unprepare(&c).await.expect("unprepares");
        let want = format!("prepared uid-1 {},{}", inventory.gpus[1].uuid, mig.uuid);
        assert_eq!(
            *told.0.lock().expect("lock"),
            [want.clone(), want, "unprepared uid-1".to_owned()]
        );
    }

    /// Records every patch; fails the first `fail` calls with a transient error.
    #[derive(Default)]
    struct Recording {
        calls: Mutex<Vec<(String, Value)>>,
        fail: Mutex<u32>,
        refuse: Mutex<bool>,
        seen: tokio::sync::Notify,
    }

    impl StatusApi for Recording {
        fn apply<'a>(
            &'a self,
            _namespace: &'a str,
            name: &'a str,
            patch: &'a Value,
        ) -> BoxFuture<'a, Result<(), WriteError>> {
            Box::pin(async move {
                self.calls
                    .lock()
                    .expect("lock")
                    .push((name.to_owned(), patch.clone()));
                self.seen.notify_one();
                if *self.refuse.lock().expect("lock") {
                    return Err(WriteError::Refused("404: gone".into()));
                }
                let mut fail = self.fail.lock().expect("lock");
                if *fail > 0 {
                    *fail -= 1;
                    return Err(WriteError::Transient("503: unavailable".into()));
                }
                Ok(())
            })
        }
    }

    impl Recording {
        fn calls(&self) -> Vec<(String, Value)> {
            self.calls.lock().expect("lock").clone()
        }

        async fn wait_calls(&self, n: usize) {
            while self.calls().len() < n {
                self.seen.notified().await;
            }
        }
    }

    fn fast() -> Backoff {
        Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(4),
        }
    }

    #[tokio::test]
    async fn writes_retry_until_they_land_and_repeats_send_nothing() {
        let api = Arc::new(Recording::default());
        *api.fail.lock().expect("lock") = 3;
        let (writer, _task) = StatusWriter::start(DRIVER, NODE, api.clone(), fast());
        let inventory = a100_inventory(2, 1);
        let c = claim("uid-1");
        let devices = [prepared("gpu-1", &inventory.gpus[1].uuid)];
        writer.prepared(&c, &devices, &inventory);
        api.wait_calls(4).await;
        // Landed on the fourth try; a repeat with the same devices changes nothing.
        writer.prepared(&c, &devices, &inventory);
        writer.unprepared(&c);
        api.wait_calls(5).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let calls = api.calls();
        assert_eq!(calls.len(), 5, "{calls:#?}");
        assert_eq!(calls[3].1, calls[0].1, "the retries send the same patch");
        assert_eq!(
            calls[3].1["status"]["devices"][0]["data"]["uuid"],
            inventory.gpus[1].uuid
        );
        assert!(calls[4].1.get("status").is_none(), "the removal");
    }

    #[tokio::test]
    async fn the_latest_state_of_a_claim_wins_and_refusals_are_not_retried() {
        let api = Arc::new(Recording::default());
        *api.fail.lock().expect("lock") = 1;
        let (writer, _task) = StatusWriter::start(
            DRIVER,
            NODE,
            api.clone(),
            Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(50),
            },
        );
        let inventory = a100_inventory(2, 1);
        let c = claim("uid-1");
        writer.prepared(&c, &[prepared("gpu-1", "GPU-1")], &inventory);
        api.wait_calls(1).await;
        // The first write failed and waits for its retry: the unprepare replaces it.
        writer.unprepared(&c);
        api.wait_calls(2).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
        let calls = api.calls();
        assert_eq!(calls.len(), 2, "{calls:#?}");
        assert!(calls[1].1.get("status").is_none(), "the removal won");

        *api.refuse.lock().expect("lock") = true;
        let gone = claim("uid-2");
        writer.prepared(&gone, &[prepared("gpu-1", "GPU-1")], &inventory);
        api.wait_calls(3).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(api.calls().len(), 3, "a refusal is not retried");
    }
}
