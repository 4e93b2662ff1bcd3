//! Which ResourceClaims the node's containers use, as the kubelet's PodResources API
//! (`v1.PodResourcesLister/List` on `<kubelet root>/pod-resources/kubelet.sock`) reports them.
//!
//! The problem: the periodic cleanup ([`crate::driver::ClaimCleanup`]) finds prepared claims
//! deleted behind the kubelet's back. Asking the API server about every prepared claim every
//! interval costs one request per claim per minute at rest (800 prepared claims: 13 requests
//! a second from one node). A claim a container of the node uses cannot have been left behind:
//! the kubelet unprepares it when the last such pod is gone. The kubelet's PodResources API
//! names those claims (the `DynamicResource`s of each container; GA with
//! `KubeletPodResourcesDynamicResources` since 1.36, on by default since 1.34), locally and at
//! no cost to the API server, so only the claims it does not name are read.
//!
//! Invariants:
//! - a claim counts as used when any container of an active pod names it, whatever drivers
//!   its devices belong to; an error says nothing is known (never "nothing is used");
//! - a claim is keyed by namespace and name, which is all the kubelet reports (no UID): the
//!   cleanup does not trust a name that two prepared claims share;
//! - every call dials the socket afresh: the kubelet replaces its socket when it restarts.
//!
//! Alternatives rejected: watching the node's pods through the API server (a watch per node,
//! and the pods still say nothing about which claims the kubelet prepared); `Get` per pod
//! (needs the pod names first); keeping one connection (a restarted kubelet's new socket would
//! go unseen until the connection failed).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use gpu_dra_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use gpu_dra_proto::podresources::v1::{ListPodResourcesRequest, ListPodResourcesResponse};
use tonic::transport::Endpoint;

/// The kubelet's socket on a node with the default root dir.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// How long one `List` may take before the pass goes on without it.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest answer accepted: about 1 KiB per pod, so room for several thousand pods
/// (tonic's default of 4 MiB would do for most nodes, the kubelet sends up to 16 MiB).
const MAX_ANSWER: usize = 16 << 20;

/// A claim as the kubelet names it: `(namespace, name)`.
pub type ClaimName = (String, String);

/// Why the claims in use are not known.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket could not be dialled (no kubelet, an older one without the API, or the
    /// folder not mounted into the plugin's container).
    #[error("cannot connect to the kubelet's PodResources API at {socket}: {source}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered `List` with an error (or did not answer in time).
    #[error("the kubelet's PodResources List at {socket} failed: {status}")]
    List {
        /// The socket.
        socket: PathBuf,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
}

/// Tells which claims the node's containers use: the kubelet in production, a fixed set in
/// tests.
pub trait PodClaims: Send + Sync {
    /// The claims named by any container of an active pod of the node.
    fn claims_in_use(&self) -> BoxFuture<'_, Result<HashSet<ClaimName>, PodResourcesError>>;

    /// Where the answer comes from, for logs.
    fn source(&self) -> String;
}

/// The kubelet's PodResources API on a unix socket.
pub struct KubeletPodResources {
    socket: PathBuf,
}

impl KubeletPodResources {
    /// Asks the kubelet serving `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        KubeletPodResources {
            socket: socket.into(),
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn list(&self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        let endpoint = Endpoint::from_static("http://localhost")
            .connect_timeout(CALL_TIMEOUT)
            .timeout(CALL_TIMEOUT);
        let channel = crate::grpc::unix_channel(endpoint, self.socket.clone())
            .await
            .map_err(|source| PodResourcesError::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let mut client =
            PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_ANSWER);
        client
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| PodResourcesError::List {
                socket: self.socket.clone(),
                status: Box::new(status),
            })
    }
}

impl PodClaims for KubeletPodResources {
    fn claims_in_use(&self) -> BoxFuture<'_, Result<HashSet<ClaimName>, PodResourcesError>> {
        Box::pin(async move { Ok(claims_in_use(&self.list().await?)) })
    }

    fn source(&self) -> String {
        self.socket.display().to_string()
    }
}

/// The claims `answer` names for any container. A claim without a namespace (not sent by
/// any kubelet so far) is taken to be in its pod's namespace, where a pod's claims live.
pub fn claims_in_use(answer: &ListPodResourcesResponse) -> HashSet<ClaimName> {
    let mut used = HashSet::new();
    for pod in &answer.pod_resources {
        for container in &pod.containers {
            for claim in &container.dynamic_resources {
                let namespace = if claim.claim_namespace.is_empty() {
                    &pod.namespace
                } else {
                    &claim.claim_namespace
                };
                used.insert((namespace.clone(), claim.claim_name.clone()));
            }
        }
    }
    used
}

#[cfg(test)]
mod tests {
    use gpu_dra_proto::podresources::v1::{
        ClaimResource, ContainerResources, DynamicResource, PodResources,
    };

    use super::*;
    use crate::testing::FakePodResources;

    fn pod(namespace: &str, containers: &[&[(&str, &str)]]) -> PodResources {
        PodResources {
            name: "p".into(),
            namespace: namespace.into(),
            containers: containers
                .iter()
                .map(|claims| ContainerResources {
                    name: "c".into(),
                    dynamic_resources: claims
                        .iter()
                        .map(|(ns, name)| DynamicResource {
                            claim_name: (*name).into(),
                            claim_namespace: (*ns).into(),
                            claim_resources: vec![ClaimResource {
                                driver_name: "gpu.nvidia.com".into(),
                                pool_name: "node-a".into(),
                                device_name: "gpu-0".into(),
                                ..ClaimResource::default()
                            }],
                        })
                        .collect(),
                    ..ContainerResources::default()
                })
                .collect(),
            ..PodResources::default()
        }
    }

    fn names(pairs: &[(&str, &str)]) -> HashSet<ClaimName> {
        pairs
            .iter()
            .map(|(ns, n)| ((*ns).to_owned(), (*n).to_owned()))
            .collect()
    }

    #[test]
    fn every_claim_of_every_container_counts_and_a_missing_namespace_is_the_pods() {
        let answer = ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "team-a",
                    &[&[("team-a", "one")], &[("team-a", "two"), ("", "three")]],
                ),
                pod("team-b", &[&[], &[("team-b", "one")]]),
                pod("team-c", &[]),
            ],
        };
        assert_eq!(
            claims_in_use(&answer),
            names(&[
                ("team-a", "one"),
                ("team-a", "two"),
                ("team-a", "three"),
                ("team-b", "one")
            ])
        );
    }

    #[tokio::test]
    async fn the_kubelets_answer_comes_over_its_unix_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake = FakePodResources::serve(&dir.path().join("kubelet.sock")).await;
        fake.set(vec![pod("ns", &[&[("ns", "a")]])]);
        let kubelet = KubeletPodResources::new(fake.socket());
        assert_eq!(
            kubelet.claims_in_use().await.expect("answer"),
            names(&[("ns", "a")])
        );
        fake.set(vec![]);
        assert!(kubelet.claims_in_use().await.expect("answer").is_empty());
        assert_eq!(fake.calls(), 2);
    }

    #[tokio::test]
    async fn no_socket_is_an_error_naming_it_never_an_empty_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("pod-resources/kubelet.sock");
        let err = KubeletPodResources::new(&missing)
            .claims_in_use()
            .await
            .expect_err("no kubelet");
        assert!(
            matches!(err, PodResourcesError::Connect { .. })
                && err.to_string().contains(&missing.display().to_string()),
            "{err}"
        );
    }
}
