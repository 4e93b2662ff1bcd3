//! Daemon pods of an older shape: replaced by pods of the shape this version makes, once no
//! client would lose its work.
//!
//! The problem: a daemon pod is adopted as long as its daemon runs with the same container
//! (command, environment, mounts: the `mps-spec` digest), so an upgrade that changes only how
//! daemon pods are made (the chart's daemon service account, pull secrets, priority class,
//! a driver root mounted read-only by a newer version) leaves the pods of an earlier version
//! running until their claims go, for weeks with a long-lived claim: outside the shape the
//! node-restriction policy now admits, with whatever the earlier version gave them.
//!
//! The rule: replacing a daemon ends its MPS server, and with it every client's CUDA context,
//! so a pod of another shape is replaced only while its daemon serves no client (no MPS
//! server, or servers without clients: `get_server_list`, then `get_client_list` of each).
//! Such pods are found at start (the one list of the node's daemon pods recovery makes
//! anyway, compared with what this version would make through the `mps-pod-shape` digest of
//! the whole pod); the driver then tries each at start, at every periodic cleanup, and when
//! the kubelet prepares the claim again, holding the claim's lock as a prepare does. One with
//! clients is kept, counted in `gpu_dra_mps_daemon_pods_outdated` and reported once as a Node
//! Event naming what differs (an admin who prefers the new shape now deletes the pod: the
//! supervisor makes it anew, ending its clients' work); it is replaced at the first try
//! after its last client is gone. No API request is made for pods of the current shape:
//! steady state costs nothing.
//!
//! The window: a client that connects between the count and the `quit` (milliseconds) loses
//! its context as after a daemon crash; MPS gives no way to hold new clients off.
//!
//! Rejected: replacing at once (ends running jobs of every tenant on the device because of a
//! pull secret's name); never replacing (an earlier version's pod keeps a read-write driver
//! root or the namespace's default account as long as its claim lives); patching the running
//! pod (a pod's volumes, account and pull secrets cannot be changed in place).

use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER;
use k8s_openapi::api::core::v1::Pod;
use tracing::{info, warn};

use super::manager::{Inner, SharingManager, lock};
use super::mps;
use super::pods::{self, PodDaemons};
use super::state::{MpsPhase, MpsRecord};
use super::supervise::Proc;

/// What became of one daemon pod of an older shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reshaped {
    /// The daemon id (`<claimUID>-<group>`, or the shared device's).
    pub daemon: String,
    /// The pod's name.
    pub pod: String,
    /// What differs from the pod this version makes ([`pods::shape_differences`]).
    pub differences: Vec<String>,
    /// What was done.
    pub outcome: ReshapeOutcome,
}

/// What was done with a daemon pod of an older shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReshapeOutcome {
    /// Its daemon served no client: it now runs in a pod of the current shape.
    Replaced,
    /// Its daemon serves this many clients: kept until they are gone.
    Busy {
        /// Clients attached to its MPS servers.
        clients: usize,
    },
    /// The replacement failed; the supervisor starts the daemon again in a pod of the
    /// current shape.
    Failed(String),
}

impl Inner {
    /// Remembers `pod`, the running pod of daemon `id`, when its shape differs from what this
    /// version makes for `record`.
    pub(super) fn note_shape(&self, pods: &PodDaemons, id: &str, record: &MpsRecord, pod: &Pod) {
        let wanted = match pods::daemon_pod(pods.settings(), &self.opts.driver_root, id, record) {
            Ok(p) => p,
            Err(e) => {
                warn!(daemon = %id, error = %e, "cannot tell the shape of the daemon pod");
                return;
            }
        };
        if let Some(differences) = pods::shape_differences(pod, &wanted) {
            info!(
                daemon = %id,
                pod = %pods::pod_name(record),
                differences = %differences.join(", "),
                "MPS daemon pod of an older shape; replaced once it serves no client"
            );
            lock(&self.outdated).insert(id.to_owned(), differences);
        }
        self.count_outdated();
    }

    fn count_outdated(&self) {
        let n = lock(&self.outdated).len();
        self.metrics
            .mps_daemon_pods_outdated
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Clients attached to the daemon's MPS servers; `None` when the daemon does not answer.
    async fn clients(&self, record: &MpsRecord) -> Option<usize> {
        let root = &self.opts.driver_root;
        let timeout = self.opts.tool_timeout;
        let servers = mps::client(root, record, "get_server_list\n", timeout)
            .await
            .ok()
            .filter(|o| o.success())?;
        let mut clients = 0;
        for pid in servers.stdout.split_whitespace() {
            if pid.parse::<u32>().is_err() {
                // Not a list of PIDs: an answer this code does not understand counts as busy.
                return Some(usize::MAX);
            }
            let out = mps::client(root, record, &format!("get_client_list {pid}\n"), timeout)
                .await
                .ok()
                .filter(|o| o.success())?;
            clients += out
                .stdout
                .split_whitespace()
                .filter(|c| c.parse::<u32>().is_ok())
                .count();
        }
        Some(clients)
    }
}

impl SharingManager {
    /// The owners (claim UIDs, or the shared devices' owner) of daemons whose pods have an
    /// older shape.
    pub fn outdated_daemon_owners(&self) -> Vec<String> {
        let ids: Vec<String> = lock(&self.inner.outdated).keys().cloned().collect();
        let state = lock(&self.inner.state);
        let mut owners: Vec<String> = ids
            .iter()
            .filter_map(|id| state.mps.get(id).map(|r| r.claim_uid.clone()))
            .collect();
        owners.sort();
        owners.dedup();
        owners
    }

    /// Replaces the daemon pods of an older shape of `owner` (a claim UID, or
    /// [`MEMORY_SHARE_DAEMON_OWNER`]) whose daemons serve no client; see the module
    /// documentation. The caller holds the claim's lock (the shared devices' lock is taken
    /// here).
    pub async fn reshape(&self, owner: &str) -> Vec<Reshaped> {
        let inner = &self.inner;
        let _shared = if owner == MEMORY_SHARE_DAEMON_OWNER {
            Some(inner.share_lock.lock().await)
        } else {
            None
        };
        let Some(pods) = inner.pods.get().cloned() else {
            return Vec::new();
        };
        let candidates: Vec<(String, Vec<String>)> = lock(&inner.outdated)
            .iter()
            .map(|(id, d)| (id.clone(), d.clone()))
            .collect();
        let mut out = Vec::new();
        for (id, differences) in candidates {
            let record = lock(&inner.state).mps.get(&id).cloned();
            let Some(record) = record else {
                // Its claim went: nothing left to replace.
                lock(&inner.outdated).remove(&id);
                continue;
            };
            if record.claim_uid != owner || record.phase != MpsPhase::Ready {
                continue;
            }
            let name = pods::pod_name(&record);
            let outcome = match inner.clients(&record).await {
                // Not answering: the supervisor restarts it, in a pod of the current shape.
                None => continue,
                Some(clients) if clients > 0 => ReshapeOutcome::Busy { clients },
                Some(_) => match inner.replace_daemon(&pods, &id, &record).await {
                    Ok(()) => ReshapeOutcome::Replaced,
                    Err(e) => ReshapeOutcome::Failed(e),
                },
            };
            if !matches!(outcome, ReshapeOutcome::Busy { .. }) {
                lock(&inner.outdated).remove(&id);
            }
            out.push(Reshaped {
                daemon: id,
                pod: name,
                differences,
                outcome,
            });
        }
        inner.count_outdated();
        out
    }
}

impl Inner {
    /// Stops the idle daemon `id` and starts it again in a pod of the current shape, with its
    /// directories kept (the claim's containers have them mounted); on error the supervisor
    /// takes over (it restarts the daemon, in a pod of the current shape).
    async fn replace_daemon(
        self: &std::sync::Arc<Self>,
        pods: &PodDaemons,
        id: &str,
        record: &MpsRecord,
    ) -> Result<(), String> {
        let supervised = lock(&self.supervised).remove(id);
        if let Some(s) = supervised {
            let _ = s.stop.send(true);
            let _ = s.task.await;
        }
        let name = pods::pod_name(record);
        // `quit` ends the idle servers; the pod is deleted and waited for.
        self.stop_daemon(record).await;
        if let Ok(Some(_)) = pods.get(&name).await {
            self.supervise(id, Proc::Dead);
            return Err(format!("pod {name} still there after its deletion"));
        }
        match self.start_daemon(id, record, false).await {
            Ok(proc) => {
                self.supervise(id, proc);
                info!(daemon = %id, pod = %name, "MPS daemon pod replaced by one of the current shape");
                Ok(())
            }
            Err(e) => {
                warn!(daemon = %id, error = %e, "starting the daemon in a pod of the current shape failed; the supervisor retries");
                self.supervise(id, Proc::Dead);
                Err(e.to_string())
            }
        }
    }
}
