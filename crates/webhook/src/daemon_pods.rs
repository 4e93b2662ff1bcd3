//! A bound on the pods one node's plugin credentials can create: at most
//! `--max-daemon-pods-per-node` pods of the release namespace bound to one node.
//!
//! The problem: the node-restriction policy (a ValidatingAdmissionPolicy) admits MPS daemon
//! pods from a node plugin's token only in the exact shape the plugin makes them, and bounds
//! the size of each, but CEL cannot count: with one node's leaked token an attacker could
//! create daemon pods until the namespace's quota stops them (the chart's quota is sized for
//! the whole cluster), filling etcd from one node.
//!
//! The fix: the chart registers this webhook for pod creations in the release namespace by
//! the plugin's service account only (matchConditions on the user, `failurePolicy: Fail`). The
//! webhook watches the namespace's pods (list, then watch; again after any error) and keeps, per
//! node, the names of the pods bound to it. A creation for a node that holds the limit already
//! is denied, with the node, the count and the value to raise. Every pod of the namespace on
//! that node counts, whatever its labels (an attacker chooses labels; the plugin's own pod
//! counts too), so the limit is a bound on what the namespace holds per node.
//!
//! Invariants:
//! - until the first complete list, every matched creation is denied as unavailable (the
//!   plugin retries a prepare; an unknown count must not admit);
//! - the count lags the API server by the watch's delay: creations answered in the same
//!   moment may each see the count before the others, so a node can pass the limit by the
//!   requests in flight at once (the API server sends them one at a time per connection; the
//!   plugin prepares claims one call at a time), never by an unbounded number;
//! - a review that is not a pod creation is allowed without looking at it, so a too-broad
//!   rule never blocks the cluster.
//!
//! Alternatives rejected: counting in the policy (CEL sees one object); pod names bounded per
//! node (slots the plugin would have to allocate and persist); a quota per node (quotas are per
//! namespace).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use serde::Deserialize;
use serde_json::Value;

use crate::admission::{BadReview, ReviewRequest, answer, parse_review};

/// The pods of the namespace per node, as the watch last showed them.
#[derive(Debug, Default)]
pub struct PodCounts {
    inner: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// Node -> pod names bound to it (complete once `synced`).
    nodes: BTreeMap<String, BTreeSet<String>>,
    /// Pod name -> its node, to move or drop a pod on update or delete.
    pods: BTreeMap<String, String>,
    /// A list begun and not yet complete: what it has seen so far.
    listing: Option<BTreeMap<String, String>>,
    synced: bool,
}

impl Counts {
    fn remove(&mut self, pod: &str) {
        if let Some(node) = self.pods.remove(pod)
            && let Some(names) = self.nodes.get_mut(&node)
        {
            names.remove(pod);
            if names.is_empty() {
                self.nodes.remove(&node);
            }
        }
    }

    fn insert(&mut self, pod: &str, node: &str) {
        self.remove(pod);
        if node.is_empty() {
            return;
        }
        self.pods.insert(pod.to_string(), node.to_string());
        self.nodes
            .entry(node.to_string())
            .or_default()
            .insert(pod.to_string());
    }
}

/// One event of the pod watch, reduced to what the count needs: a pod's name and the node it
/// is bound to (empty while unscheduled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// A list begins: what it finds replaces everything once it completes.
    ListStart,
    /// A pod found by the running list.
    Listed {
        /// The pod's name.
        pod: String,
        /// The node it is bound to.
        node: String,
    },
    /// The list is complete.
    ListDone,
    /// A pod was created or changed.
    Applied {
        /// The pod's name.
        pod: String,
        /// The node it is bound to.
        node: String,
    },
    /// A pod is gone.
    Deleted {
        /// The pod's name.
        pod: String,
    },
}

impl PodCounts {
    /// Takes one event of the watch.
    pub fn apply(&self, event: PodEvent) {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            PodEvent::ListStart => c.listing = Some(BTreeMap::new()),
            PodEvent::Listed { pod, node } => {
                if let Some(listing) = c.listing.as_mut() {
                    listing.insert(pod, node);
                }
            }
            PodEvent::ListDone => {
                let listed = c.listing.take().unwrap_or_default();
                c.nodes.clear();
                c.pods.clear();
                for (pod, node) in &listed {
                    c.insert(pod, node);
                }
                c.synced = true;
            }
            PodEvent::Applied { pod, node } => c.insert(&pod, &node),
            PodEvent::Deleted { pod } => c.remove(&pod),
        }
    }

    /// The pods bound to `node`; `None` until the first list completed.
    pub fn on(&self, node: &str) -> Option<usize> {
        let c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        c.synced.then(|| c.nodes.get(node).map_or(0, BTreeSet::len))
    }
}

/// Keeps `counts` up to date with the pods of `api`'s namespace until the stream ends (never:
/// the watcher lists again, with backoff, after any error).
pub async fn watch(
    api: kube::Api<k8s_openapi::api::core::v1::Pod>,
    counts: std::sync::Arc<PodCounts>,
) {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    use kube::runtime::watcher::{self, Event};
    let of = |p: &k8s_openapi::api::core::v1::Pod| {
        (
            p.metadata.name.clone().unwrap_or_default(),
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
        )
    };
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Init) => counts.apply(PodEvent::ListStart),
            Ok(Event::InitApply(p)) => {
                let (pod, node) = of(&p);
                counts.apply(PodEvent::Listed { pod, node });
            }
            Ok(Event::InitDone) => {
                counts.apply(PodEvent::ListDone);
                tracing::debug!("pods per node listed");
            }
            Ok(Event::Apply(p)) => {
                let (pod, node) = of(&p);
                counts.apply(PodEvent::Applied { pod, node });
            }
            Ok(Event::Delete(p)) => counts.apply(PodEvent::Deleted { pod: of(&p).0 }),
            Err(error) => {
                tracing::warn!(%error, "watching the namespace's pods failed; listing again")
            }
        }
    }
}

/// What [`review`] decided, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not a pod creation, or one within the limit.
    Allowed,
    /// The node holds the limit already.
    Denied {
        /// The node.
        node: String,
        /// The pods it holds.
        pods: usize,
    },
    /// The count is not known yet.
    Unavailable,
}

#[derive(Deserialize)]
struct Request {
    #[serde(default)]
    uid: String,
    #[serde(default)]
    operation: String,
    #[serde(default, rename = "subResource")]
    sub_resource: String,
    #[serde(default)]
    object: Option<Value>,
}

impl ReviewRequest for Request {
    fn uid(&self) -> &str {
        &self.uid
    }
}

/// Answers one AdmissionReview of a pod creation against `limit` pods per node.
pub fn review(
    body: &[u8],
    counts: &PodCounts,
    limit: usize,
) -> Result<(Vec<u8>, Verdict), BadReview> {
    let request: Request = parse_review(body)?;
    let object = request.object.unwrap_or_default();
    let is_pod = object
        .get("kind")
        .and_then(Value::as_str)
        .is_none_or(|k| k == "Pod");
    if request.operation != "CREATE" || !request.sub_resource.is_empty() || !is_pod {
        return Ok((answer(&request.uid, None), Verdict::Allowed));
    }
    let node = object
        .pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .unwrap_or_default();
    // Unbound pods are the node policy's to refuse: a node's credentials create only pods
    // bound to their node.
    if node.is_empty() {
        return Ok((answer(&request.uid, None), Verdict::Allowed));
    }
    let Some(pods) = counts.on(node) else {
        let message = "the count of pods per node is not known yet (the webhook has not listed \
                       the namespace's pods since it started); try again in a few seconds";
        return Ok((
            answer(&request.uid, Some((message, 503, "ServiceUnavailable"))),
            Verdict::Unavailable,
        ));
    };
    if pods < limit {
        return Ok((answer(&request.uid, None), Verdict::Allowed));
    }
    let message = format!(
        "node {node} has {pods} pods of this namespace already, the most one node's plugin may \
         create (kubeletPlugin.nodeRestriction.maxPodsPerNode={limit}); each claim the node prepares with \
         MPS has one daemon pod: unprepare claims, or raise the value if the node runs more"
    );
    Ok((
        answer(&request.uid, Some((&message, 403, "Forbidden"))),
        Verdict::Denied {
            node: node.to_string(),
            pods,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn applied(pod: &str, node: &str) -> PodEvent {
        PodEvent::Applied {
            pod: pod.into(),
            node: node.into(),
        }
    }

    fn listed(pod: &str, node: &str) -> PodEvent {
        PodEvent::Listed {
            pod: pod.into(),
            node: node.into(),
        }
    }

    fn creation(node: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "operation": "CREATE",
                "object": {"kind": "Pod", "metadata": {"name": "mps-x"}, "spec": {"nodeName": node}},
            },
        }))
        .expect("json")
    }

    fn response(body: &[u8]) -> Value {
        serde_json::from_slice::<Value>(body).expect("json")["response"].clone()
    }

    #[test]
    fn the_count_follows_lists_and_changes_per_node() {
        let counts = PodCounts::default();
        assert_eq!(counts.on("a"), None, "unknown before the first list");
        counts.apply(PodEvent::ListStart);
        counts.apply(listed("p1", "a"));
        counts.apply(listed("p2", "a"));
        counts.apply(listed("p3", "b"));
        counts.apply(listed("pending", ""));
        assert_eq!(counts.on("a"), None, "a list counts once complete");
        counts.apply(PodEvent::ListDone);
        assert_eq!(
            (counts.on("a"), counts.on("b"), counts.on("c")),
            (Some(2), Some(1), Some(0))
        );
        counts.apply(applied("p4", "a"));
        counts.apply(applied("p4", "a"));
        counts.apply(applied("pending", "b"));
        assert_eq!((counts.on("a"), counts.on("b")), (Some(3), Some(2)));
        counts.apply(PodEvent::Deleted { pod: "p1".into() });
        counts.apply(PodEvent::Deleted {
            pod: "never".into(),
        });
        assert_eq!(counts.on("a"), Some(2));
        // A relist replaces what the watch missed while it was down.
        counts.apply(PodEvent::ListStart);
        counts.apply(listed("p9", "c"));
        assert_eq!(
            counts.on("a"),
            Some(2),
            "the old count holds while a list runs"
        );
        counts.apply(PodEvent::ListDone);
        assert_eq!(
            (counts.on("a"), counts.on("b"), counts.on("c")),
            (Some(0), Some(0), Some(1))
        );
    }

    #[test]
    fn creations_past_the_limit_are_denied_with_the_node_and_the_value_to_raise() {
        let counts = PodCounts::default();
        let (body, verdict) = review(&creation("a"), &counts, 2).expect("review");
        assert_eq!(verdict, Verdict::Unavailable);
        let r = response(&body);
        assert_eq!(
            (r["allowed"].as_bool(), r["status"]["code"].as_u64()),
            (Some(false), Some(503))
        );

        counts.apply(PodEvent::ListStart);
        counts.apply(listed("p1", "a"));
        counts.apply(PodEvent::ListDone);
        let (body, verdict) = review(&creation("a"), &counts, 2).expect("review");
        assert_eq!(verdict, Verdict::Allowed);
        assert_eq!(response(&body)["allowed"], json!(true));
        assert_eq!(response(&body)["uid"], json!("u1"));

        counts.apply(applied("p2", "a"));
        let (body, verdict) = review(&creation("a"), &counts, 2).expect("review");
        assert_eq!(
            verdict,
            Verdict::Denied {
                node: "a".into(),
                pods: 2
            }
        );
        let r = response(&body);
        assert_eq!(r["allowed"], json!(false));
        assert_eq!(r["status"]["code"], json!(403));
        let message = r["status"]["message"].as_str().expect("message");
        assert!(
            message.contains("node a has 2 pods")
                && message.contains("kubeletPlugin.nodeRestriction.maxPodsPerNode=2"),
            "{message}"
        );
        // Another node has its own count.
        let (_, verdict) = review(&creation("b"), &counts, 2).expect("review");
        assert_eq!(verdict, Verdict::Allowed);
    }

    #[test]
    fn anything_but_a_bound_pod_creation_is_allowed_unseen() {
        let counts = PodCounts::default();
        for request in [
            json!({"uid": "u", "operation": "DELETE", "object": null}),
            json!({"uid": "u", "operation": "CREATE", "subResource": "binding", "object": {"kind": "Binding"}}),
            json!({"uid": "u", "operation": "CREATE", "object": {"kind": "Pod", "spec": {}}}),
            json!({"uid": "u", "operation": "UPDATE", "object": {"kind": "Pod", "spec": {"nodeName": "a"}}}),
        ] {
            let body = serde_json::to_vec(&json!({
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request,
            }))
            .expect("json");
            let (body, verdict) = review(&body, &counts, 0).expect("review");
            assert_eq!(verdict, Verdict::Allowed, "{request}");
            assert_eq!(response(&body)["allowed"], json!(true));
        }
        assert!(matches!(
            review(b"{}", &counts, 1),
            Err(BadReview::ApiVersion { .. })
        ));
        assert!(review(b"not json", &counts, 1).is_err());
    }
}
