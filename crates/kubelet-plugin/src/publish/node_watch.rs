//! One watch on the plugin's own Node object, for its partitioning annotations.
//!
//! The problem: the publisher read the annotations `gpu.nvidia.com/dynamic-mig-gpus` and
//! `gpu.nvidia.com/memory-share-gpus` only when it reconciled for another reason (its start, a
//! slice changed on the server, another inventory), so an annotation set on a running node, a
//! documented run-time switch, had no effect for as long as nothing else happened.
//!
//! The fix: kube-runtime's watcher on Node `<node>` (field selector `metadata.name=<node>`;
//! listed again with backoff after any error) yields the two annotations each time they
//! change, and the publisher reconciles at once: it reads the Node, applies the partitioning
//! to the live inventory (which prepare and the driver's reconcile read) and republishes. The
//! publisher stays the one place that turns annotations into partitioning (it also knows when
//! the API server dropped consumable capacity). Only a change of these two annotations counts:
//! the kubelet updates its Node's status all the time, and those updates cost nothing here.
//!
//! A GPU switched while claims are prepared on it keeps today's guards only: the driver's
//! periodic reconcile sweeps instances on dynamic MIG GPUs that no claim's dynamic record
//! owns (docs/STATUS.md lists what that means for a static MIG device in use); the switch now
//! reaches that sweep within one reconcile interval instead of whenever the publisher happened
//! to reconcile.

use futures::{Stream, StreamExt};
use gpu_dra_core::partitioning::{DYNAMIC_MIG_ANNOTATION, MEMORY_SHARE_ANNOTATION};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

/// The partitioning annotations of a Node, as they are written (absent: `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartitioningAnnotations {
    /// `gpu.nvidia.com/dynamic-mig-gpus`.
    pub dynamic_mig: Option<String>,
    /// `gpu.nvidia.com/memory-share-gpus`.
    pub memory_shares: Option<String>,
}

impl PartitioningAnnotations {
    /// The annotations of `node`.
    pub fn of(node: &Node) -> Self {
        let get = |key: &str| {
            node.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .cloned()
        };
        Self {
            dynamic_mig: get(DYNAMIC_MIG_ANNOTATION),
            memory_shares: get(MEMORY_SHARE_ANNOTATION),
        }
    }
}

/// Keeps the annotations of each event that differ from the last kept (the first always).
fn changes(events: impl Stream<Item = Event<Node>>) -> impl Stream<Item = PartitioningAnnotations> {
    let mut last: Option<PartitioningAnnotations> = None;
    events.filter_map(move |event| {
        let changed = match event {
            Event::Apply(node) | Event::InitApply(node) => {
                let now = PartitioningAnnotations::of(&node);
                (last.as_ref() != Some(&now)).then(|| {
                    last = Some(now.clone());
                    now
                })
            }
            Event::Init | Event::InitDone | Event::Delete(_) => None,
        };
        std::future::ready(changed)
    })
}

/// Watches Node `node_name`: yields its partitioning annotations at the first sight and each
/// time they change. Never ends; errors are logged and the watcher lists again after a
/// backoff.
pub fn watch(nodes: Api<Node>, node_name: &str) -> impl Stream<Item = PartitioningAnnotations> {
    let config = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let events = watcher::watcher(nodes, config)
        .default_backoff()
        .filter_map(|event| {
            std::future::ready(match event {
                Ok(event) => Some(event),
                Err(e) => {
                    tracing::warn!(error = %e, "Node watch failed; listing again after a backoff");
                    None
                }
            })
        });
    changes(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    fn node(annotations: &[(&str, &str)], labels: &[(&str, &str)]) -> Node {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        Node {
            metadata: ObjectMeta {
                name: Some("node-a".into()),
                annotations: map(annotations),
                labels: map(labels),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    #[test]
    fn only_changes_of_the_partitioning_annotations_are_yielded() {
        let events = vec![
            Event::Init,
            Event::InitApply(node(&[], &[])),
            Event::InitDone,
            // The kubelet's status and label updates: nothing to do.
            Event::Apply(node(&[], &[("x", "1")])),
            Event::Apply(node(&[("other", "a")], &[])),
            Event::Apply(node(&[(MEMORY_SHARE_ANNOTATION, "gpu-1")], &[])),
            Event::Apply(node(&[(MEMORY_SHARE_ANNOTATION, "gpu-1")], &[("x", "2")])),
            // A relist after an error finds the same annotations.
            Event::Init,
            Event::InitApply(node(&[(MEMORY_SHARE_ANNOTATION, "gpu-1")], &[])),
            Event::InitDone,
            Event::Apply(node(
                &[
                    (MEMORY_SHARE_ANNOTATION, "gpu-1"),
                    (DYNAMIC_MIG_ANNOTATION, "0"),
                ],
                &[],
            )),
            Event::Apply(node(&[(DYNAMIC_MIG_ANNOTATION, "0")], &[])),
        ];
        let got: Vec<PartitioningAnnotations> =
            block_on(changes(futures::stream::iter(events)).collect());
        let ann = |dm: Option<&str>, ms: Option<&str>| PartitioningAnnotations {
            dynamic_mig: dm.map(str::to_owned),
            memory_shares: ms.map(str::to_owned),
        };
        assert_eq!(
            got,
            [
                ann(None, None),
                ann(None, Some("gpu-1")),
                ann(Some("0"), Some("gpu-1")),
                ann(Some("0"), None),
            ]
        );
    }
}
