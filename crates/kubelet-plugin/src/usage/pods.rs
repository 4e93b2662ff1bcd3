//! Container names for the processes of claims' pods. On CRI runtimes (containerd, CRI-O) a
//! process's cgroup names its pod's UID and its container's ID, not the container's name; the
//! pod's `status.containerStatuses[].containerID` (`containerd://<id>`) maps one to the
//! other. The sampler reads a pod only for a container ID it has not seen, of a pod that a
//! claim on this node is reserved for (see the `usage` module documentation for the bound).
//!
//! [`PodSource`] is the seam: the API server in production ([`KubePods`], a GET by name, which
//! the chart's RBAC allows: `get` on pods, never `list`), plain data in tests.

use std::collections::HashMap;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;

/// Reads pods by namespace and name.
pub trait PodSource: Send + Sync {
    /// The pod, or `None` when it does not exist.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Pod>, kube::Error>>;
}

/// Pods from the API server.
pub struct KubePods {
    client: kube::Client,
}

impl KubePods {
    /// Uses the given client.
    pub fn new(client: kube::Client) -> Self {
        KubePods { client }
    }
}

impl PodSource for KubePods {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Pod>, kube::Error>> {
        Box::pin(async move {
            kube::Api::<Pod>::namespaced(self.client.clone(), namespace)
                .get_opt(name)
                .await
        })
    }
}

/// The container ID of a `containerID` status field: the part after `<runtime>://`.
pub fn bare_container_id(id: &str) -> &str {
    id.split_once("://").map_or(id, |(_, rest)| rest)
}

/// Container ID -> name for every container, init and ephemeral container of `pod` that has
/// an ID (a container that has not started yet has none).
pub fn container_names(pod: &Pod) -> HashMap<String, String> {
    let Some(status) = pod.status.as_ref() else {
        return HashMap::new();
    };
    [
        status.container_statuses.as_ref(),
        status.init_container_statuses.as_ref(),
        status.ephemeral_container_statuses.as_ref(),
    ]
    .into_iter()
    .flatten()
    .flatten()
    .filter_map(|c| {
        let id = bare_container_id(c.container_id.as_deref()?);
        (!id.is_empty()).then(|| (id.to_owned(), c.name.clone()))
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_every_kind_of_container_map_to_names() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {
                "containerStatuses": [
                    {"name": "trainer", "containerID": "containerd://4f9c0d", "image": "", "imageID": "", "ready": true, "restartCount": 0},
                    {"name": "waiting", "image": "", "imageID": "", "ready": false, "restartCount": 0}
                ],
                "initContainerStatuses": [
                    {"name": "setup", "containerID": "cri-o://77aa", "image": "", "imageID": "", "ready": false, "restartCount": 0}
                ]
            }
        }))
        .expect("pod");
        let names = container_names(&pod);
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(names["4f9c0d"], "trainer");
        assert_eq!(names["77aa"], "setup");
        assert!(container_names(&Pod::default()).is_empty());
    }
}
