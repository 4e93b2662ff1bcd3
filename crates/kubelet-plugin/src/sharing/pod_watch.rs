//! One watch per node on its MPS daemon pods, shared by every daemon's supervisor.
//!
//! The problem: each supervisor of a daemon in a pod ([`super::pods`]) used to GET its pod
//! once a second for the daemon's whole life; 500 nodes with 8 MPS claims each make about
//! 4,000 GETs a second, forever.
//!
//! The fix: one watch (kube-runtime's watcher: list, then watch; listed again with backoff
//! after any error) on the pods of the plugin's namespace with the daemon label and
//! `spec.nodeName=<node>`, folded into a [`PodView`] that every supervisor reads. The API
//! requests of a node no longer grow with its daemons.
//!
//! A supervisor reacts exactly as it did to its GETs: its pod is gone when it is absent, being
//! deleted (`deletionTimestamp`), or ended (phase `Failed` or `Succeeded`). A crashed container
//! is restarted in place by the kubelet, with the claim's limits in its environment, and needs
//! nothing from the plugin. An API server that cannot answer is not a reason to act: while the
//! watch fails the view keeps what it last knew, and the next complete list decides.
//!
//! Invariants of [`PodView::gone`], since the watch lags behind the supervisor's own writes:
//! - a pod absent from the view counts as gone only once the supervisor saw it there, or a
//!   list that began after the supervisor started waiting has completed without it (a pod it
//!   created may not have reached the watch yet);
//! - a pod with the same name but another UID (the one it replaced, still in the view, or
//!   one that replaced it) is not the supervisor's pod.
//!
//! Alternatives rejected: a reflector store (it does not tell when a list began, which the
//! first invariant needs); a watch per daemon (one connection each, the same growth).

use std::collections::BTreeMap;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::pods::COMPONENT;

/// What the watch shows of one daemon pod.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodState {
    uid: Option<String>,
    /// Why the pod no longer runs its daemon, if it does not.
    ended: Option<String>,
}

impl PodState {
    fn of(name: &str, pod: &Pod) -> Self {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let ended = if pod.metadata.deletion_timestamp.is_some() {
            Some(format!("pod {name} being deleted"))
        } else if let Some(p @ ("Failed" | "Succeeded")) = phase {
            Some(format!("pod {name} {p}"))
        } else {
            None
        };
        Self {
            uid: pod.metadata.uid.clone(),
            ended,
        }
    }
}

/// The node's daemon pods as the watch last showed them (plain data: fed by [`Self::apply`]).
#[derive(Debug, Clone, Default)]
pub struct PodView {
    pods: BTreeMap<String, PodState>,
    /// The pods of a list under way (from its start to its end).
    listing: Option<BTreeMap<String, PodState>>,
    /// Lists begun so far (each numbered by this count when it begins).
    lists_begun: u64,
    /// The number of the last list completed.
    last_list: u64,
}

/// Where a supervisor is in watching one pod (see [`PodView::gone`]).
#[derive(Debug, Clone)]
pub struct PodWait {
    name: String,
    uid: Option<String>,
    /// Lists begun when the wait began.
    since: u64,
    seen: bool,
}

impl PodView {
    /// Applies one event of the watcher.
    pub fn apply(&mut self, event: Event<Pod>) {
        match event {
            Event::Init => {
                self.lists_begun += 1;
                self.listing = Some(BTreeMap::new());
            }
            Event::InitApply(pod) => {
                if let Some(name) = pod.metadata.name.clone() {
                    let state = PodState::of(&name, &pod);
                    self.listing.get_or_insert_default().insert(name, state);
                }
            }
            Event::InitDone => {
                self.pods = self.listing.take().unwrap_or_default();
                self.last_list = self.lists_begun;
            }
            Event::Apply(pod) => {
                if let Some(name) = pod.metadata.name.clone() {
                    let state = PodState::of(&name, &pod);
                    self.pods.insert(name, state);
                }
            }
            Event::Delete(pod) => {
                if let Some(name) = &pod.metadata.name {
                    let same =
                        |s: &PodState| pod.metadata.uid.is_none() || s.uid == pod.metadata.uid;
                    if self.pods.get(name).is_some_and(same) {
                        self.pods.remove(name);
                    }
                }
            }
        }
    }

    /// Starts waiting for pod `name` (with `uid` when known) to go.
    pub fn wait_for(&self, name: &str, uid: Option<&str>) -> PodWait {
        PodWait {
            name: name.to_owned(),
            uid: uid.map(str::to_owned),
            since: self.lists_begun,
            seen: false,
        }
    }

    /// Why the pod of `wait` is gone, or `None` while it runs or the view cannot tell yet.
    pub fn gone(&self, wait: &mut PodWait) -> Option<String> {
        let ours = self
            .pods
            .get(&wait.name)
            .filter(|p| wait.uid.is_none() || p.uid == wait.uid);
        match ours {
            Some(p) => {
                wait.seen = true;
                p.ended.clone()
            }
            None if wait.seen || self.last_list > wait.since => {
                Some(format!("pod {} gone", wait.name))
            }
            None => None,
        }
    }
}

/// The watch of one node's daemon pods; the task ends when this is dropped.
#[derive(Debug)]
pub struct PodWatch {
    view: watch::Receiver<PodView>,
    task: JoinHandle<()>,
}

impl PodWatch {
    /// Starts watching the daemon pods of `node` through `api` (the plugin's namespace). Call
    /// within a Tokio runtime.
    pub fn start(api: Api<Pod>, node: &str) -> Self {
        let config = watcher::Config::default()
            .labels(&format!("app.kubernetes.io/component={COMPONENT}"))
            .fields(&format!("spec.nodeName={node}"));
        let (tx, view) = watch::channel(PodView::default());
        let task = tokio::spawn(async move {
            // Every error (the API server unreachable, the watch expired) lists again, after a
            // backoff; the stream never ends on its own.
            let events = watcher::watcher(api, config).default_backoff();
            tokio::pin!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        if matches!(event, Event::InitDone) {
                            debug!("daemon pods listed");
                        }
                        tx.send_modify(|v| v.apply(event));
                    }
                    Err(e) => {
                        warn!(error = %e, "MPS daemon pod watch failed; listing again after a backoff")
                    }
                }
            }
        });
        Self { view, task }
    }

    /// Waits until pod `name` (with `uid` when known) is gone; returns how, in words. Waits
    /// forever once the watch was stopped (nothing to act on).
    pub async fn wait_gone(&self, name: &str, uid: Option<&str>) -> String {
        let mut view = self.view.clone();
        let mut wait = view.borrow().wait_for(name, uid);
        loop {
            if let Some(reason) = view.borrow_and_update().gone(&mut wait) {
                return reason;
            }
            if view.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops the watch.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn pod(name: &str, uid: &str, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(uid.into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    fn listed(pods: Vec<Pod>) -> PodView {
        let mut v = PodView::default();
        v.apply(Event::Init);
        for p in pods {
            v.apply(Event::InitApply(p));
        }
        v.apply(Event::InitDone);
        v
    }

    #[test]
    fn a_running_pod_is_not_gone_and_its_end_is_seen_in_every_form() {
        let mut v = listed(vec![pod("a", "u1", "Running")]);
        let mut w = v.wait_for("a", Some("u1"));
        assert_eq!(v.gone(&mut w), None);
        v.apply(Event::Apply(pod("a", "u1", "Failed")));
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a Failed"));
        v.apply(Event::Apply(pod("a", "u1", "Succeeded")));
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a Succeeded"));
        let mut deleting = pod("a", "u1", "Running");
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        v.apply(Event::Apply(deleting));
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a being deleted"));
        v.apply(Event::Delete(pod("a", "u1", "Running")));
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a gone"));
    }

    #[test]
    fn a_pod_not_yet_seen_is_gone_only_after_a_list_begun_later() {
        // Created by the supervisor's start, not yet in the view.
        let mut v = listed(vec![]);
        let mut w = v.wait_for("a", Some("u1"));
        assert_eq!(v.gone(&mut w), None, "the watch may lag behind the create");
        // A list that began before the wait does not decide.
        let mut old = v.clone();
        old.apply(Event::Init);
        let mut w_old = old.wait_for("a", Some("u1"));
        old.apply(Event::InitDone);
        assert_eq!(old.gone(&mut w_old), None);
        // A list begun after the wait, without the pod: it is gone.
        v.apply(Event::Init);
        assert_eq!(v.gone(&mut w), None, "a list under way shows nothing yet");
        v.apply(Event::InitDone);
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a gone"));
    }

    #[test]
    fn the_replaced_pod_of_the_same_name_is_not_the_supervisors() {
        // The old pod (u1) is still in the view when the new one's (u2) wait begins.
        let mut v = listed(vec![pod("a", "u1", "Failed")]);
        let mut w = v.wait_for("a", Some("u2"));
        assert_eq!(v.gone(&mut w), None);
        v.apply(Event::Delete(pod("a", "u1", "Failed")));
        assert_eq!(v.gone(&mut w), None);
        v.apply(Event::Apply(pod("a", "u2", "Pending")));
        v.apply(Event::Apply(pod("a", "u2", "Running")));
        assert_eq!(v.gone(&mut w), None);
        // A late delete of the old pod does not remove the new one.
        v.apply(Event::Delete(pod("a", "u1", "Failed")));
        assert_eq!(v.gone(&mut w), None);
        // Replaced by someone else's pod of that name: ours is gone.
        v.apply(Event::Apply(pod("a", "u3", "Running")));
        assert_eq!(v.gone(&mut w).as_deref(), Some("pod a gone"));
    }

    #[test]
    fn an_outage_keeps_the_last_view_and_the_next_list_decides() {
        let mut v = listed(vec![pod("a", "u1", "Running"), pod("b", "u2", "Running")]);
        let mut wa = v.wait_for("a", None);
        let mut wb = v.wait_for("b", None);
        assert_eq!(v.gone(&mut wa), None);
        // The watch fails (no events); a relist begins, then completes without `a`.
        v.apply(Event::Init);
        v.apply(Event::InitApply(pod("b", "u2", "Running")));
        assert_eq!(
            v.gone(&mut wa),
            None,
            "nothing decided before the list ends"
        );
        v.apply(Event::InitDone);
        assert_eq!(v.gone(&mut wa).as_deref(), Some("pod a gone"));
        assert_eq!(v.gone(&mut wb), None);
    }
}
