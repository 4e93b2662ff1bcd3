//! A kubelet's PodResources API served on a unix socket from memory, as the kubelet serves it
//! on `<kubelet root>/pod-resources/kubelet.sock`: the pods set last, and the count of `List`
//! calls.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use gpu_dra_proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpu_dra_proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerResources, DynamicResource,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

#[derive(Default)]
struct State {
    pods: Mutex<Vec<PodResources>>,
    calls: AtomicUsize,
    failing: AtomicBool,
}

/// The fake kubelet; its server stops when it is dropped.
pub struct FakePodResources {
    socket: PathBuf,
    state: Arc<State>,
    server: tokio::task::JoinHandle<()>,
}

impl FakePodResources {
    /// Serves an empty node on `socket` (its folder is created).
    pub async fn serve(socket: &Path) -> Self {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).expect("socket folder");
        }
        let listener = tokio::net::UnixListener::bind(socket).expect("bind the fake kubelet");
        let state = Arc::new(State::default());
        let service = Service(state.clone());
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(service))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        FakePodResources {
            socket: socket.to_path_buf(),
            state,
            server,
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The node's active pods from now on.
    pub fn set(&self, pods: Vec<PodResources>) {
        *self.state.pods.lock().expect("pods") = pods;
    }

    /// From now on the node runs one pod per claim `(namespace, name)`, each with one
    /// container naming it.
    pub fn set_claims(&self, claims: &[(&str, &str)]) {
        self.set(
            claims
                .iter()
                .map(|(ns, name)| claim_pod(ns, name))
                .collect(),
        );
    }

    /// Whether `List` answers `UNAVAILABLE` from now on (a kubelet restarting).
    pub fn fail(&self, failing: bool) {
        self.state.failing.store(failing, Ordering::Relaxed);
    }

    /// How many `List` calls came.
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::Relaxed)
    }
}

impl Drop for FakePodResources {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A pod `<name>-pod` in `namespace` whose one container uses claim `name`.
fn claim_pod(namespace: &str, name: &str) -> PodResources {
    PodResources {
        name: format!("{name}-pod"),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: "ctr".into(),
            dynamic_resources: vec![DynamicResource {
                claim_name: name.into(),
                claim_namespace: namespace.into(),
                claim_resources: vec![],
            }],
            ..ContainerResources::default()
        }],
        ..PodResources::default()
    }
}

struct Service(Arc<State>);

#[tonic::async_trait]
impl PodResourcesLister for Service {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.0.calls.fetch_add(1, Ordering::Relaxed);
        if self.0.failing.load(Ordering::Relaxed) {
            return Err(Status::unavailable("the kubelet is restarting"));
        }
        let pods = self.0.pods.lock().expect("pods").clone();
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: pods,
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("the fake kubelet answers List only"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("the fake kubelet answers List only"))
    }
}
