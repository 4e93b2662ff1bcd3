//! The cleanup that brings the checkpoint, the CDI folder, the MIG instances and the API server
//! in line: run once at start, before the kubelet's calls are served, and then periodically.
//!
//! Its local part (half-prepared claims, temp files, MIG instances, specs naming the files of
//! a driver upgraded since ([`super::respec`]), stray specs) costs no request. Its API part finds prepared claims deleted behind the kubelet's back (a pod
//! force-deleted while the plugin was down, a kubelet that lost its own checkpoint): reading
//! every prepared claim every interval cost one request per claim per interval at rest (800
//! claims, 60 s: 13 requests a second from one node, 130 a second from 1,000 nodes busy like
//! it). So [`ClaimCleanup`] reads only what may have been left behind:
//! - a claim a container of the node uses is not (the kubelet unprepares it after the last such
//!   pod): the kubelet's PodResources API names those ([`crate::pod_resources`]), locally;
//! - a claim no container names is read once it has gone unnamed for a grace period (a claim
//!   just prepared may not be named yet), and a claim read and found still there waits twice
//!   as long before its next read, up to [`CleanupPolicy::max_backoff`], so a claim that stays
//!   prepared without a container (a pod stuck before its containers start) costs a few reads
//!   an hour, not one a minute;
//! - without the PodResources API (no socket configured or reachable: older kubelets, a chart
//!   without the mount, nodes without a kubelet) every claim goes by the second rule. The mode
//!   is logged when it changes.
//!
//! Invariants:
//! - it never races an operation: each claim is touched only with its lock, taken with
//!   `try_lock` (a claim the kubelet is working on is left to that call, which finishes or
//!   rolls back by itself);
//! - half-prepared claims are undone through the one unprepare path
//!   ([`Driver::unprepare_locked`]), before the MIG sweep, so the sweep sees only the
//!   instances of claims that stay;
//! - a spec file is removed only when no checkpoint entry names its claim;
//! - a completed claim is unprepared only when the API server answers that no claim of that
//!   UID exists any more; an error reading it keeps the claim. The PodResources API only ever
//!   spares a read, so whatever it answers, no claim in use is unprepared;
//! - the first pass (at start, before the kubelet's calls are served, so no prepare is in
//!   flight) reads every claim no container names at once: a claim deleted while the plugin
//!   was down goes without waiting for the grace period.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra_core::checkpoint::{ClaimEntry, PrepareState};
use gpu_dra_core::sharing::MEMORY_SHARE_DAEMON_OWNER;
use tracing::{debug, info, warn};

use super::unprepare::Keep;
use super::{ClaimRef, Driver};
use crate::pod_resources::{ClaimName, PodClaims};
use crate::sharing::{ReshapeOutcome, Reshaped};

/// How [`ClaimCleanup`] spaces the reads of a claim no container names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanupPolicy {
    /// How long a claim must have gone unnamed before its first read.
    pub grace: Duration,
    /// The wait after the first read that found the claim; each further such read doubles it.
    pub first_backoff: Duration,
    /// The longest wait between two reads of one claim.
    pub max_backoff: Duration,
}

impl CleanupPolicy {
    /// The longest wait between two reads of a claim, unless the interval is longer.
    pub const MAX_BACKOFF: Duration = Duration::from_secs(3600);
    /// The shortest grace period: a claim must stay unnamed at least this long.
    pub const MIN_GRACE: Duration = Duration::from_secs(10);

    /// The policy for passes `interval` apart: a claim unnamed over two passes (at least
    /// [`Self::MIN_GRACE`]) is read, then again after one interval, two, four, ... up to an
    /// hour.
    pub fn for_interval(interval: Duration) -> Self {
        CleanupPolicy {
            grace: interval.max(Self::MIN_GRACE),
            first_backoff: interval,
            max_backoff: Self::MAX_BACKOFF.max(interval),
        }
    }
}

/// What one pass did with the prepared claims (for tests and the pass's debug line).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupPass {
    /// Named by a container of the node: not read.
    pub in_use: usize,
    /// Not named, but not due for a read yet.
    pub waiting: usize,
    /// Read from the API server.
    pub read: usize,
    /// Found gone and unprepared (or tried to be).
    pub gone: usize,
}

/// When a claim no container names is read next.
#[derive(Debug, Clone, Copy)]
struct NextRead {
    at: Instant,
    /// The wait after that read, should it find the claim.
    backoff: Duration,
}

/// Where the claims in use came from in the last pass (logged when it changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    PodResources,
    ApiReads,
}

/// The periodic cleanup: one [`ClaimCleanup::pass`] per interval, remembering between passes
/// when each claim no container names is read next.
pub struct ClaimCleanup {
    pods: Option<Arc<dyn PodClaims>>,
    policy: CleanupPolicy,
    next_reads: HashMap<String, NextRead>,
    passes: u64,
    mode: Option<Mode>,
}

/// How the API server answered about one claim.
enum Checked {
    Exists,
    Gone,
    Unknown,
}

impl ClaimCleanup {
    /// A cleanup that asks `pods` (when given) which claims are in use, and spaces its reads
    /// by `policy`.
    pub fn new(pods: Option<Arc<dyn PodClaims>>, policy: CleanupPolicy) -> Self {
        ClaimCleanup {
            pods,
            policy,
            next_reads: HashMap::new(),
            passes: 0,
            mode: None,
        }
    }

    /// One pass at `now`: the local cleanup, then the API reads that are due.
    pub async fn pass(&mut self, driver: &Driver, now: Instant) -> CleanupPass {
        driver.reconcile_local().await;
        let first = self.passes == 0;
        self.passes += 1;
        let claims = driver.completed_claims();
        // Claims unprepared since (by the kubelet or this cleanup) are forgotten.
        let uids: HashSet<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
        self.next_reads.retain(|uid, _| uids.contains(uid.as_str()));
        let in_use = self.in_use(&claims).await;
        let mut pass = CleanupPass::default();
        for claim in claims {
            if in_use.contains(&(claim.namespace.clone(), claim.name.clone())) {
                self.next_reads.remove(&claim.uid);
                pass.in_use += 1;
                continue;
            }
            let policy = self.policy;
            let next = self
                .next_reads
                .entry(claim.uid.clone())
                .or_insert_with(|| NextRead {
                    at: if first { now } else { now + policy.grace },
                    backoff: policy.first_backoff,
                });
            if now < next.at {
                pass.waiting += 1;
                continue;
            }
            pass.read += 1;
            match driver.check_claim(&claim).await {
                Checked::Exists => {
                    next.at = now + next.backoff;
                    next.backoff = (next.backoff * 2).min(policy.max_backoff);
                }
                // An error is no news: read again after the same wait.
                Checked::Unknown => next.at = now + next.backoff,
                Checked::Gone => {
                    self.next_reads.remove(&claim.uid);
                    pass.gone += 1;
                }
            }
        }
        debug!(
            in_use = pass.in_use,
            waiting = pass.waiting,
            read = pass.read,
            gone = pass.gone,
            "cleanup pass"
        );
        pass
    }

    /// The claims the node's containers use, as far as the kubelet tells: none when it is not
    /// asked or cannot answer (every claim then waits its turn for a read). A name two
    /// prepared claims share (a claim deleted and created again under its name) is left out:
    /// only a read tells which of them still exists.
    async fn in_use(&mut self, claims: &[ClaimRef]) -> HashSet<ClaimName> {
        let answer = match &self.pods {
            Some(pods) => Some(pods.claims_in_use().await.map_err(|e| (pods.source(), e))),
            None => None,
        };
        let (mode, mut used) = match answer {
            Some(Ok(used)) => (Mode::PodResources, used),
            Some(Err((source, e))) => {
                if self.mode != Some(Mode::ApiReads) {
                    warn!(socket = %source, error = %e, "the kubelet's PodResources API does not answer; prepared claims are read from the API server, each less and less often while it exists");
                }
                (Mode::ApiReads, HashSet::new())
            }
            None => {
                if self.mode.is_none() {
                    info!(
                        "no kubelet PodResources socket configured; prepared claims are read from the API server, each less and less often while it exists"
                    );
                }
                (Mode::ApiReads, HashSet::new())
            }
        };
        if mode == Mode::PodResources && self.mode != Some(Mode::PodResources) {
            let source = self.pods.as_ref().map(|p| p.source()).unwrap_or_default();
            info!(socket = %source, "the kubelet's PodResources API tells which prepared claims are in use; only the others are read from the API server");
        }
        self.mode = Some(mode);
        let mut seen = HashSet::new();
        for c in claims {
            let name = (c.namespace.clone(), c.name.clone());
            if !seen.insert(name.clone()) {
                used.remove(&name);
            }
        }
        used
    }
}

impl Driver {
    /// Brings checkpoint, CDI files and the API server in line: rolls back half-prepared
    /// claims, removes spec files of claims the checkpoint does not know, and unprepares
    /// claims that no longer exist (by UID) in the API server, reading every prepared claim.
    /// The plugin runs [`ClaimCleanup`] instead, which reads fewer; this is its first pass
    /// without the kubelet's PodResources API.
    pub async fn reconcile(&self) {
        let policy = CleanupPolicy::for_interval(Duration::from_secs(60));
        ClaimCleanup::new(None, policy)
            .pass(self, Instant::now())
            .await;
    }

    /// The local part of the cleanup: half-prepared claims, temp files, MIG instances, stray
    /// CDI specs and device metadata files.
    async fn reconcile_local(&self) {
        let entries: Vec<(String, ClaimEntry)> = self.journal.read(|doc| {
            doc.claims
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        });
        for (uid, entry) in &entries {
            if entry.state == PrepareState::PrepareStarted {
                let user = self.claim_locks.join(uid);
                // A prepare in flight holds the lock; it finishes or rolls back by itself.
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self
                    .journal
                    .entry(uid)
                    .is_some_and(|e| e.state == PrepareState::PrepareStarted)
                {
                    info!(claim.uid = %uid, "rolling back half-prepared claim");
                    if let Err(e) = self.unprepare_locked(uid, Keep::Nothing).await {
                        warn!(claim.uid = %uid, error = %e, "rollback failed");
                    }
                }
            }
        }
        let temps = self.cdi.remove_stale_temps()
            + self.metadata.remove_stale_temps()
            + self
                .settings
                .checkpoint_path
                .parent()
                .zip(self.settings.checkpoint_path.file_name())
                .map_or(0, |(dir, name)| {
                    gpu_dra_fsutil::remove_stale_temps(dir, &name.to_string_lossy())
                });
        if temps > 0 {
            info!(files = temps, "removed temp files of interrupted writes");
        }
        self.sweep_instances().await;
        self.follow_driver_version().await;
        self.reshape_daemon_pods().await;
        for uid in self.cdi.list() {
            if self.journal.entry(&uid).is_none() {
                let user = self.claim_locks.join(&uid);
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self.journal.entry(&uid).is_none() {
                    info!(claim.uid = %uid, "removing CDI spec of unknown claim");
                    if let Err(e) = self.cdi.remove(&uid) {
                        warn!(claim.uid = %uid, error = %e, "cannot remove stale CDI spec");
                    }
                }
            }
        }
        // After the specs, which may mount them.
        for uid in self.metadata.claims() {
            if self.journal.entry(&uid).is_none() {
                let user = self.claim_locks.join(&uid);
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                if self.journal.entry(&uid).is_none() && !self.cdi.spec_path(&uid).exists() {
                    info!(claim.uid = %uid, "removing device metadata files of unknown claim");
                    if let Err(e) = self.metadata.remove(&uid) {
                        warn!(claim.uid = %uid, error = %e, "cannot remove stale device metadata files");
                    }
                }
            }
        }
    }

    /// MPS daemon pods of an older shape ([`crate::sharing::reshape`]): each claim's under its
    /// lock (skipped while a prepare or unprepare holds it: the next pass tries again), the
    /// shared devices' under theirs. Nothing to do, no request made, when there are none.
    async fn reshape_daemon_pods(&self) {
        for owner in self.sharing.outdated_daemon_owners() {
            let found = if owner == MEMORY_SHARE_DAEMON_OWNER {
                self.sharing.reshape(&owner).await
            } else {
                let user = self.claim_locks.join(&owner);
                let Some(_guard) = user.try_lock() else {
                    continue;
                };
                self.sharing.reshape(&owner).await
            };
            self.report_reshaped(found);
        }
    }

    /// [`Self::reshape_daemon_pods`] for claim `uid` alone, whose lock the caller holds.
    pub(super) async fn reshape_claim_daemons(&self, uid: &str) {
        if self
            .sharing
            .outdated_daemon_owners()
            .iter()
            .any(|o| o == uid)
        {
            let found = self.sharing.reshape(uid).await;
            self.report_reshaped(found);
        }
    }

    /// A pod kept for its clients is reported once, as is a failed replacement (the
    /// supervisor then starts the daemon again in a pod of the current shape).
    fn report_reshaped(&self, found: Vec<Reshaped>) {
        for r in found {
            let note = match &r.outcome {
                ReshapeOutcome::Replaced => continue,
                ReshapeOutcome::Busy { clients } => {
                    if !super::lock(&self.reshape_reported).insert(r.pod.clone()) {
                        continue;
                    }
                    (
                        "MPSDaemonPodOutdated",
                        format!(
                            "MPS daemon pod {} differs from what this plugin version makes ({}); kept while its daemon serves {} client(s), replaced once it serves none. Deleting the pod replaces it now and ends its clients' work.",
                            r.pod,
                            r.differences.join(", "),
                            if *clients == usize::MAX {
                                "an unknown number of".to_string()
                            } else {
                                clients.to_string()
                            }
                        ),
                    )
                }
                ReshapeOutcome::Failed(e) => (
                    "MPSDaemonPodReplaceFailed",
                    format!(
                        "replacing MPS daemon pod {} ({}) failed: {e}; the plugin starts its daemon again",
                        r.pod,
                        r.differences.join(", ")
                    ),
                ),
            };
            warn!(pod = %r.pod, daemon = %r.daemon, reason = note.0, "{}", note.1);
            if let Some(events) = &self.node_events {
                events.warning(note.0, note.1);
            }
        }
    }

    /// The completed claims the API server can be asked about: every one but those imported
    /// from NVIDIA's v1 layout, which records no name to look up (kept until the kubelet
    /// unprepares them).
    fn completed_claims(&self) -> Vec<ClaimRef> {
        self.journal.read(|doc| {
            doc.claims
                .iter()
                .filter(|(_, e)| e.state == PrepareState::PrepareCompleted && !e.name.is_empty())
                .map(|(uid, e)| ClaimRef {
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    uid: uid.clone(),
                })
                .collect()
        })
    }

    /// Reads `claim` from the API server and unprepares it when no claim of its UID exists.
    async fn check_claim(&self, claim: &ClaimRef) -> Checked {
        match self.claims.get(&claim.namespace, &claim.name).await {
            Ok(Some(c)) if c.metadata.uid.as_deref() == Some(claim.uid.as_str()) => Checked::Exists,
            Ok(_) => {
                info!(claim.uid = %claim.uid, "claim is gone from the API server; unpreparing");
                if let Err(e) = self.unprepare(claim).await {
                    warn!(claim.uid = %claim.uid, error = %e, "cleanup unprepare failed");
                }
                Checked::Gone
            }
            Err(e) => {
                warn!(claim.uid = %claim.uid, error = %e, "cannot check claim; keeping it");
                Checked::Unknown
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use futures::future::BoxFuture;
    use gpu_dra_core::checkpoint::PrepareState;
    use gpu_dra_device::testing::a100_inventory;
    use k8s_openapi::api::resource::v1::ResourceClaim;

    use super::{ClaimCleanup, CleanupPass, CleanupPolicy};
    use crate::claims::{ClaimSource, ClaimSourceError};
    use crate::driver::fixtures::*;
    use crate::driver::{ClaimRef, Driver};
    use crate::pod_resources::{KubeletPodResources, PodClaims};
    use crate::testing::{DriverBuilder, FakePodResources, MemoryClaims, allocated_claim};

    /// The API server's claims, counting the reads.
    #[derive(Default)]
    struct CountedClaims {
        claims: Arc<MemoryClaims>,
        reads: AtomicUsize,
    }

    impl ClaimSource for CountedClaims {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<ResourceClaim>, ClaimSourceError>> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.claims.get(namespace, name)
        }
    }

    const EVERY: Duration = Duration::from_secs(60);

    /// A driver with claims `names` (namespace `ns`, UID `uid-<name>`) prepared, one GPU
    /// each, the API server's reads counted, and a fake kubelet on a unix socket that
    /// names no claim yet.
    struct Node {
        _dir: tempfile::TempDir,
        api: Arc<CountedClaims>,
        driver: Driver,
        kubelet: FakePodResources,
    }

    impl Node {
        async fn with_prepared(names: &[&str]) -> Node {
            let dir = tempfile::tempdir().expect("tempdir");
            let inventory = a100_inventory(4, 1);
            crate::testing::simulate_host(&dir.path().join("host"), &inventory).expect("host");
            let api = Arc::new(CountedClaims::default());
            let driver = DriverBuilder::new(dir.path(), inventory)
                .node_name(NODE)
                .claims(api.clone())
                .checkpoint_path(dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
                .build()
                .expect("driver");
            for (i, name) in names.iter().enumerate() {
                let claim = claim_ref(name);
                api.claims.insert(allocated_claim(
                    "ns",
                    name,
                    &claim.uid,
                    DRIVER,
                    NODE,
                    &[("gpu", &format!("gpu-{}", i + 1))],
                    &[],
                ));
                driver.prepare(&claim).await.expect("prepared");
            }
            let kubelet =
                FakePodResources::serve(&dir.path().join("pod-resources/kubelet.sock")).await;
            let node = Node {
                _dir: dir,
                api,
                driver,
                kubelet,
            };
            node.api.reads.store(0, Ordering::Relaxed);
            node
        }

        /// A cleanup that asks the fake kubelet over its socket.
        fn cleanup(&self) -> ClaimCleanup {
            let pods: Arc<dyn PodClaims> =
                Arc::new(KubeletPodResources::new(self.kubelet.socket()));
            ClaimCleanup::new(Some(pods), CleanupPolicy::for_interval(EVERY))
        }

        fn reads(&self) -> usize {
            self.api.reads.load(Ordering::Relaxed)
        }

        fn prepared(&self, name: &str) -> bool {
            self.driver
                .checkpoint()
                .claims
                .contains_key(&claim_ref(name).uid)
        }
    }

    fn claim_ref(name: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    /// Runs a pass at `start + k * EVERY` for each `k` in `ticks`; the passes' reads.
    async fn passes(
        cleanup: &mut ClaimCleanup,
        node: &Node,
        start: Instant,
        ticks: std::ops::Range<u32>,
    ) -> Vec<CleanupPass> {
        let mut out = Vec::new();
        for k in ticks {
            out.push(cleanup.pass(&node.driver, start + EVERY * k).await);
        }
        out
    }

    #[tokio::test]
    async fn claims_the_kubelet_names_cost_no_read_at_all() {
        let node = Node::with_prepared(&["a", "b", "c"]).await;
        node.kubelet
            .set_claims(&[("ns", "a"), ("ns", "b"), ("ns", "c"), ("other", "x")]);
        let mut cleanup = node.cleanup();
        let start = Instant::now();
        let all = passes(&mut cleanup, &node, start, 0..100).await;
        assert_eq!(node.reads(), 0, "{:?}", all.last());
        assert!(all.iter().all(|p| p.in_use == 3 && p.read == 0));
        assert_eq!(node.kubelet.calls(), 100, "one List per pass");
        assert!(["a", "b", "c"].iter().all(|n| node.prepared(n)));
    }

    #[tokio::test]
    async fn a_deleted_claim_no_container_names_is_unprepared_and_the_others_are_not_read() {
        let node = Node::with_prepared(&["used", "left"]).await;
        node.kubelet.set_claims(&[("ns", "used")]);
        node.api.claims.remove("ns", "left");
        let mut cleanup = node.cleanup();
        // The first pass (at start: nothing in flight) reads the unnamed claim at once.
        let pass = cleanup.pass(&node.driver, Instant::now()).await;
        assert_eq!(
            pass,
            CleanupPass {
                in_use: 1,
                waiting: 0,
                read: 1,
                gone: 1
            }
        );
        assert!(!node.prepared("left"));
        assert!(node.prepared("used"));
        assert_eq!(node.reads(), 1);
    }

    #[tokio::test]
    async fn a_claim_unnamed_after_start_is_read_after_the_grace_period_and_unprepared_when_gone() {
        let node = Node::with_prepared(&["a", "b"]).await;
        node.kubelet.set_claims(&[("ns", "a"), ("ns", "b")]);
        let mut cleanup = node.cleanup();
        let start = Instant::now();
        passes(&mut cleanup, &node, start, 0..3).await;
        // b's pod is gone from the kubelet's view, and b from the API server: the kubelet
        // never unprepared it.
        node.kubelet.set_claims(&[("ns", "a")]);
        node.api.claims.remove("ns", "b");
        let pass = cleanup.pass(&node.driver, start + EVERY * 3).await;
        assert_eq!((pass.waiting, pass.read), (1, 0), "within the grace period");
        assert!(node.prepared("b"));
        let pass = cleanup.pass(&node.driver, start + EVERY * 4).await;
        assert_eq!((pass.read, pass.gone), (1, 1));
        assert!(!node.prepared("b") && node.prepared("a"));
        assert_eq!(node.reads(), 1);
    }

    #[tokio::test]
    async fn a_claim_found_still_there_is_read_again_after_twice_the_wait_up_to_the_cap() {
        let node = Node::with_prepared(&["idle"]).await;
        let policy = CleanupPolicy {
            grace: EVERY,
            first_backoff: EVERY,
            max_backoff: EVERY * 8,
        };
        let pods: Arc<dyn PodClaims> = Arc::new(KubeletPodResources::new(node.kubelet.socket()));
        let mut cleanup = ClaimCleanup::new(Some(pods), policy);
        let start = Instant::now();
        let all = passes(&mut cleanup, &node, start, 0..40).await;
        let read_at: Vec<u32> = (0..40u32).filter(|k| all[*k as usize].read == 1).collect();
        // Waits of 1, 2, 4, 8 intervals, then 8 (the cap).
        assert_eq!(read_at, [0, 1, 3, 7, 15, 23, 31, 39]);
        assert_eq!(node.reads(), read_at.len());
        assert!(node.prepared("idle"));
        // Named again: no read, and the wait starts over once it is unnamed again.
        node.kubelet.set_claims(&[("ns", "idle")]);
        assert_eq!(
            cleanup.pass(&node.driver, start + EVERY * 40).await.in_use,
            1
        );
        node.kubelet.set_claims(&[]);
        let again = passes(&mut cleanup, &node, start, 41..44).await;
        assert_eq!(again.iter().map(|p| p.read).collect::<Vec<_>>(), [0, 1, 1]);
    }

    #[tokio::test]
    async fn without_the_kubelet_every_claim_is_read_with_the_same_backoff() {
        let node = Node::with_prepared(&["a", "b"]).await;
        node.kubelet.set_claims(&[("ns", "a"), ("ns", "b")]);
        node.kubelet.fail(true);
        let mut cleanup = node.cleanup();
        let start = Instant::now();
        passes(&mut cleanup, &node, start, 0..8).await;
        // Read at start and after 1 and 3 intervals, then next at 7: 4 reads each.
        assert_eq!(node.reads(), 8);
        // The kubelet answers again: no more reads.
        node.kubelet.fail(false);
        passes(&mut cleanup, &node, start, 8..40).await;
        assert_eq!(node.reads(), 8);

        // No socket configured at all: the same reads.
        let mut unasked = ClaimCleanup::new(None, CleanupPolicy::for_interval(EVERY));
        let before = node.reads();
        for k in 0..8 {
            unasked.pass(&node.driver, start + EVERY * k).await;
        }
        assert_eq!(node.reads() - before, 8);
    }

    #[tokio::test]
    async fn a_name_two_prepared_claims_share_is_not_trusted() {
        let node = Node::with_prepared(&["a"]).await;
        // "a" deleted and created again under its name; both prepared (the old one left
        // behind), the kubelet names "a".
        let again = ClaimRef {
            uid: "uid-a-again".into(),
            ..claim_ref("a")
        };
        node.api.claims.insert(allocated_claim(
            "ns",
            "a",
            &again.uid,
            DRIVER,
            NODE,
            &[("gpu", "gpu-3")],
            &[],
        ));
        node.driver.prepare(&again).await.expect("prepared");
        node.api.reads.store(0, Ordering::Relaxed);
        node.kubelet.set_claims(&[("ns", "a")]);
        let pass = node.cleanup().pass(&node.driver, Instant::now()).await;
        assert_eq!((pass.in_use, pass.read, pass.gone), (0, 2, 1));
        let left = node.driver.checkpoint();
        assert!(left.claims.contains_key("uid-a-again") && !left.claims.contains_key("uid-a"));
    }

    #[tokio::test]
    async fn restart_rolls_back_half_prepared_claims_and_drops_stale_specs_and_gone_claims() {
        let env = env();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        let b = add(&env, "b", "uid-b", &[("gpu", "gpu-2")]);
        env.driver.prepare(&a).await.expect("a");
        env.driver.prepare(&b).await.expect("b");
        // Fake a crash between CDI write and completion for b, a stale spec, and a deleted a.
        let mut cp = on_disk(&env);
        cp.claims.get_mut("uid-b").expect("b").state = PrepareState::PrepareStarted;
        std::fs::write(
            env.dir.path().join(gpu_dra_core::checkpoint::FILE_NAME),
            cp.to_json(),
        )
        .expect("write");
        std::fs::write(spec_path(&env, "uid-stale"), "{}").expect("stale");
        env.claims.remove("ns", "a");

        let restarted = driver_in(env.dir.path(), env.claims.clone());
        restarted.reconcile().await;
        assert!(!spec_path(&env, "uid-b").exists());
        assert!(!spec_path(&env, "uid-stale").exists());
        assert!(!spec_path(&env, "uid-a").exists());
        assert!(on_disk(&env).claims.is_empty());
        // b prepares again on retry.
        restarted.prepare(&b).await.expect("b again");
        assert!(spec_path(&env, "uid-b").exists());
    }

    #[tokio::test]
    async fn an_imported_half_prepared_claim_is_rolled_back_and_prepared_by_us() {
        let (env, sharing, driver) = nvidia_node();
        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "starting".into(),
            uid: NV_STARTED.into(),
        };
        env.claims.insert(allocated_claim(
            "team-a",
            "starting",
            NV_STARTED,
            DRIVER,
            NODE,
            &[("gpu", "gpu-3")],
            &[],
        ));
        driver.reconcile().await;
        assert!(!nvidia_spec(&env, NV_STARTED).exists());
        assert!(!driver.checkpoint().claims.contains_key(NV_STARTED));
        let devices = driver.prepare(&c).await.expect("prepared by us");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_STARTED}-gpu-3")]
        );
        assert!(spec_path(&env, NV_STARTED).exists());
        assert!(sharing.calls().contains(&format!("apply {NV_STARTED}")));
    }

    /// Claims `uid-a` and the shared devices have daemon pods of an older shape, kept for
    /// their clients; every reshape is recorded.
    #[derive(Default)]
    struct OutdatedPods {
        calls: std::sync::Mutex<Vec<String>>,
    }

    impl crate::sharing::SharingExecutor for OutdatedPods {
        fn apply<'a>(
            &'a self,
            plan: &'a gpu_dra_core::plan::Plan,
            group: &'a gpu_dra_core::plan::SharingGroup,
        ) -> BoxFuture<'a, Result<crate::sharing::Applied, crate::sharing::SharingError>> {
            crate::testing::ExclusiveOnly.apply(plan, group)
        }

        fn release<'a>(
            &'a self,
            _claim_uid: &'a str,
            _state: Option<&'a serde_json::Value>,
        ) -> BoxFuture<'a, Result<(), crate::sharing::SharingError>> {
            Box::pin(async { Ok(()) })
        }

        fn release_imported<'a>(
            &'a self,
            _claim_uid: &'a str,
            _imported: &'a gpu_dra_core::checkpoint::Imported,
        ) -> BoxFuture<'a, Result<(), crate::sharing::SharingError>> {
            Box::pin(async { Ok(()) })
        }

        fn outdated_daemon_owners(&self) -> Vec<String> {
            vec!["uid-a".into(), "memory-shares".into()]
        }

        fn reshape<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<crate::sharing::Reshaped>> {
            self.calls.lock().unwrap().push(owner.to_string());
            Box::pin(async move {
                vec![crate::sharing::Reshaped {
                    daemon: format!("{owner}-0"),
                    pod: format!("mps-{owner}"),
                    differences: vec!["serviceAccountName".into()],
                    outcome: crate::sharing::ReshapeOutcome::Busy { clients: 2 },
                }]
            })
        }
    }

    #[tokio::test]
    async fn daemon_pods_of_an_older_shape_are_tried_under_their_claims_lock_and_reported_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sharing = Arc::new(OutdatedPods::default());
        let events = Arc::new(crate::node_events::RecordedEvents::default());
        let driver = DriverBuilder::new(dir.path(), a100_inventory(1, 1))
            .sharing(sharing.clone())
            .node_events(events.clone())
            .build()
            .expect("driver");

        // A prepare or unprepare of uid-a holds its lock: not touched by this pass.
        let user = driver.claim_locks.join("uid-a");
        let guard = user.lock().await;
        driver.reconcile_local().await;
        assert_eq!(*sharing.calls.lock().unwrap(), vec!["memory-shares"]);
        drop(guard);

        driver.reconcile_local().await;
        driver.reconcile_local().await;
        assert_eq!(
            *sharing.calls.lock().unwrap(),
            vec![
                "memory-shares",
                "uid-a",
                "memory-shares",
                "uid-a",
                "memory-shares"
            ]
        );
        let events = events.taken();
        let reasons: Vec<&str> = events.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(
            reasons,
            vec!["MPSDaemonPodOutdated", "MPSDaemonPodOutdated"],
            "once per pod: {events:?}"
        );
        assert!(
            events.iter().any(|(_, note)| note.contains("mps-uid-a")
                && note.contains("serviceAccountName")
                && note.contains("2 client(s)")),
            "{events:?}"
        );
    }
}
