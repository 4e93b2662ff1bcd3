//! Events on the plugin's own Node, for what an admin must act on that belongs to no claim
//! (a claim's trouble goes to its pod, through the kubelet's prepare error): `kubectl describe
//! node` shows them with the node's other events.
//!
//! The problem: some findings of the plugin need a person (MIG instances it keeps on a GPU
//! that turned dynamic, whose memory slices stay taken until someone destroys them), and a log
//! line on one node among hundreds is read by nobody.
//!
//! How: [`NodeEvents::warning`] never waits and never fails: it queues the event (a bounded
//! queue; when full, the event is dropped with a log line) and one background task publishes
//! it with kube-runtime's recorder (`events.k8s.io/v1`, in the `default` namespace as for any
//! cluster-scoped object; a repeat of the same reason within minutes becomes a series, one
//! object). The chart's RBAC grants `create` and `patch` of events in `default` only.
//!
//! Alternatives rejected: a condition on the Node (the kubelet and the node problem detector
//! own its conditions); a status in a ResourceSlice (only devices and their attributes there).

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Where the plugin reports events about its node.
pub trait NodeEvents: Send + Sync {
    /// Reports a Warning with a `PascalCase` `reason` and a human `note` (cut to 1 KiB, the
    /// API's limit). Never blocks, never fails.
    fn warning(&self, reason: &'static str, note: String);
}

/// The most events waiting to be published; more are dropped (with a log line).
const QUEUE: usize = 64;

/// The API's limit on an event's note.
const NOTE_MAX: usize = 1024;

/// Publishes through the API server (see the module documentation).
pub struct KubeNodeEvents {
    tx: mpsc::Sender<(&'static str, String)>,
}

impl KubeNodeEvents {
    /// Starts the publishing task for node `node`, reported by `controller` (the plugin's
    /// name, e.g. `gpu.nvidia.com-kubelet-plugin`) and instance `node`.
    pub fn start(client: kube::Client, node: &str, controller: String) -> Arc<Self> {
        let (tx, mut rx) = mpsc::channel::<(&'static str, String)>(QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller,
                instance: Some(node.to_string()),
            },
        );
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            ..ObjectReference::default()
        };
        tokio::spawn(async move {
            while let Some((reason, note)) = rx.recv().await {
                let event = Event {
                    type_: EventType::Warning,
                    reason: reason.to_string(),
                    action: action(&note),
                    note: Some(note),
                    secondary: None,
                };
                match recorder.publish(&event, &reference).await {
                    Ok(()) => debug!(reason, "node event published"),
                    Err(error) => warn!(reason, %error, "cannot publish a node event"),
                }
            }
        });
        Arc::new(KubeNodeEvents { tx })
    }
}

impl NodeEvents for KubeNodeEvents {
    fn warning(&self, reason: &'static str, note: String) {
        if self.tx.try_send((reason, cut(note))).is_err() {
            warn!(
                reason,
                "node event dropped: too many waiting to be published"
            );
        }
    }
}

/// The event's `action`: the recorder folds events of one reason and action on one object
/// into a series (counting them, keeping the first note), so two findings of one reason
/// (two GPUs' kept instances, two feature gates off) would show as one. The action carries a
/// digest of the note: the same finding repeated is still one series.
fn action(note: &str) -> String {
    format!(
        "Reconcile-{}",
        &crate::digest::sha256_hex(note.as_bytes())[..12]
    )
}

/// `note` cut to [`NOTE_MAX`] bytes at a character boundary, marked with an ellipsis.
fn cut(mut note: String) -> String {
    if note.len() <= NOTE_MAX {
        return note;
    }
    let mut end = NOTE_MAX - '…'.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push('…');
    note
}

/// Events kept in memory, for tests (and for a plugin without an API server: none).
#[derive(Debug, Default)]
pub struct RecordedEvents(std::sync::Mutex<Vec<(String, String)>>);

impl RecordedEvents {
    /// The events reported so far: (reason, note).
    pub fn taken(&self) -> Vec<(String, String)> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl NodeEvents for RecordedEvents {
    fn warning(&self, reason: &'static str, note: String) {
        if let Ok(mut v) = self.0.lock() {
            v.push((reason.to_string(), cut(note)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_findings_of_one_reason_are_two_events_and_a_repeat_is_one() {
        let (a, b) = (action("gate A is off"), action("gate B is off"));
        assert_ne!(a, b);
        assert_eq!(a, action("gate A is off"));
        assert!(a.len() <= 128 && a.starts_with("Reconcile-"), "{a}");
    }

    #[test]
    fn notes_are_cut_to_the_apis_limit_at_a_character_boundary() {
        assert_eq!(cut("short".into()), "short");
        let long = "é".repeat(800);
        let got = cut(long);
        assert!(got.len() <= NOTE_MAX, "{}", got.len());
        assert!(got.ends_with('…'));
    }
}
