//! gRPC servers on unix sockets: plugin registration (for the kubelet's plugin watcher) and
//! the DRA service in versions v1 and v1beta1.
//!
//! The DRA service is implemented once, for v1; v1beta1 calls are converted to v1, served by
//! that code, and the answers converted back (as upstream's Go kubelet-plugin helper does),
//! so the two versions cannot drift apart.
//!
//! Claim UIDs from the kubelet are checked here ([`check_claim_uid`]) before the driver sees
//! them: the driver names files after them, so a UID that is not a UUID is answered with a
//! per-claim error and never reaches the disk.
//!
//! Invariants: sockets are created fresh (a stale file from a previous run is removed first),
//! the socket file is mode 0600 and its folder 0700 when we create it; every accepted
//! connection goes through [`AuthorityFix`] because grpc-go clients send a socket path as
//! `:authority` (see `authority`); `v1.DRAPlugin` is advertised before `v1beta1.DRAPlugin`
//! so kubelets that know v1 use it. Claims of one call are prepared concurrently; every
//! claim of the request gets an entry in the answer (a missing one fails the pod).
//!
//! The kubelet's requests are recorded here, per claim, in NVIDIA's metric family
//! ([`crate::metrics::NvidiaMetrics`]): that family counts requests, not the prepares and
//! unprepares the plugin runs on its own.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::join_all;
use gpu_dra_proto::dra::{v1, v1beta1};
use gpu_dra_proto::pluginregistration as reg;
use tokio::net::UnixListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::authority::AuthorityFix;
use crate::driver::{ClaimRef, Driver};
use crate::metrics::Operation;

/// Binds a unix socket at `path`, replacing a stale socket file, with owner-only access.
///
/// The socket is bound and listening under a hidden temporary name first and then renamed
/// into place, so the path never names a socket that refuses connections (between `bind` and
/// `listen`) or has the wrong mode. The kubelet's plugin watcher dials a registration socket
/// as soon as it appears, and ignores names starting with a dot.
pub fn bind_socket(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("socket path {} has no file name", path.display()),
        )
    })?;
    let staging = path.with_file_name(format!(
        ".{}.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&staging);
    let listener = UnixListener::bind(&staging)?;
    let placed = std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&staging, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    Ok(listener)
}

/// The accepted connections of `listener`, each wrapped in [`AuthorityFix`].
pub fn incoming(
    listener: UnixListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<AuthorityFix<tokio::net::UnixStream>>> {
    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityFix::new))
}

/// The Registration service.
pub struct Registration {
    driver_name: String,
    endpoint: PathBuf,
    registered: Arc<tokio::sync::watch::Sender<Option<bool>>>,
    health: bool,
}

impl Registration {
    /// Answers for `driver_name` with the DRA socket at `endpoint`; `registered` receives
    /// the kubelet's verdict.
    pub fn new(
        driver_name: String,
        endpoint: PathBuf,
        registered: Arc<tokio::sync::watch::Sender<Option<bool>>>,
    ) -> Self {
        Registration {
            driver_name,
            endpoint,
            registered,
            health: false,
        }
    }

    /// Also advertises the DRA health service (which the DRA socket must then serve).
    pub fn with_health(mut self) -> Self {
        self.health = true;
        self
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _request: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: gpu_dra_proto::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: [
                gpu_dra_proto::DRA_V1_SERVICE,
                gpu_dra_proto::DRA_V1BETA1_SERVICE,
            ]
            .into_iter()
            .chain(
                self.health
                    .then_some(gpu_dra_proto::HEALTH_V1ALPHA1_SERVICE),
            )
            .map(str::to_owned)
            .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!("registered with the kubelet");
        } else {
            warn!(error = %status.error, "kubelet refused the registration");
        }
        self.registered.send_replace(Some(status.plugin_registered));
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// The driver a DRA service answers with: set once this plugin instance holds the node (see
/// `cli::run`); until then calls wait.
pub type DriverCell = tokio::sync::watch::Receiver<Option<Arc<Driver>>>;

/// What calls get while no driver is set and none will be (the instance is stopping).
const STOPPING: &str = "the node plugin instance is stopping before it took over the node; the kubelet retries with the next instance";

/// The DRA service, both versions: v1 is implemented, v1beta1 converts to and from it.
#[derive(Clone)]
pub struct DraService {
    driver: DriverCell,
}

impl DraService {
    /// Serves the driver `cell` will hold; calls wait for it.
    pub fn deferred(cell: DriverCell) -> Self {
        DraService { driver: cell }
    }

    async fn driver(&self) -> Result<Arc<Driver>, String> {
        let mut cell = self.driver.clone();
        let ready = cell.wait_for(Option::is_some).await;
        match ready.as_deref() {
            Ok(Some(driver)) => Ok(driver.clone()),
            _ => Err(STOPPING.to_string()),
        }
    }

    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(String, Result<Vec<v1::Device>, String>)> {
        let driver = self.driver().await;
        // Taken once for the whole call: a refusal of one of its claims republishes at once,
        // and the others must still be judged by what their allocation was made from.
        let published = driver.as_ref().map(|d| d.published()).unwrap_or_default();
        join_all(claims.into_iter().map(|c| {
            let driver = driver.clone();
            let published = &published;
            async move {
            if let Err(error) = check_claim_uid(&c.uid) {
                warn!(claim = %format!("{}/{}", c.namespace, c.name), %error, "prepare refused");
                return (c.uid, Err(error));
            }
            let driver = match driver {
                Ok(d) => d,
                Err(e) => return (c.uid, Err(e)),
            };
            let request = driver.metrics().nvidia.begin(Operation::Prepare);
            let result = driver.prepare_as_published(&c, published).await;
            request.finish(result.is_ok());
            let result = result.map(|devices| {
                devices
                    .into_iter()
                    .map(|d| v1::Device {
                        request_names: d.request_names,
                        pool_name: d.pool,
                        device_name: d.device,
                        cdi_device_ids: d.cdi_device_ids,
                        share_id: d.share_id,
                    })
                    .collect()
            });
            (c.uid, result.map_err(|e| e.to_string()))
            }
        }))
        .await
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, String)> {
        let driver = self.driver().await;
        join_all(claims.into_iter().map(|c| {
            let driver = driver.clone();
            async move {
            if let Err(error) = check_claim_uid(&c.uid) {
                warn!(claim = %format!("{}/{}", c.namespace, c.name), %error, "unprepare refused");
                return (c.uid, error);
            }
            let driver = match driver {
                Ok(d) => d,
                Err(e) => return (c.uid, e),
            };
            let request = driver.metrics().nvidia.begin(Operation::Unprepare);
            let result = driver.unprepare(&c).await;
            request.finish(result.is_ok());
            let error = result
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            (c.uid, error)
            }
        }))
        .await
    }
}

/// A gRPC channel over the unix socket `socket` (the kubelet's PodResources API; the
/// kubelet's side of ours in tests), with `endpoint`'s settings (timeouts). Connects now.
pub async fn unix_channel(
    endpoint: tonic::transport::Endpoint,
    socket: PathBuf,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    // The endpoint's URI is required by the API but unused: the connector dials the socket.
    endpoint
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

/// Checks that a claim UID from the kubelet is a UUID as the API server writes it: 8-4-4-4-12
/// lowercase hex digits (RFC 4122's textual form). The plugin names files after claim UIDs
/// (CDI specs, MPS folders), so anything else (a path, an empty or overlong string) is
/// refused before it can reach the disk. Uppercase is refused too: the API server never
/// generates it, and one spelling per claim keeps its files and checkpoint entry unique.
pub fn check_claim_uid(uid: &str) -> Result<(), String> {
    check_uuid(uid).map_err(|problem| {
        format!(
            "claim UID {problem}; refused before touching any file: check what sent this request"
        )
    })
}

/// Checks that `uid` is a UUID in the API server's form (see [`check_claim_uid`]); the error
/// quotes it (at most 64 characters) and says what form is expected.
pub fn check_uuid(uid: &str) -> Result<(), String> {
    let b = uid.as_bytes();
    let well_formed = b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => matches!(c, b'0'..=b'9' | b'a'..=b'f'),
        });
    if well_formed {
        return Ok(());
    }
    const SHOWN: usize = 64;
    let shown: String = uid.chars().take(SHOWN).collect();
    let cut = if uid.chars().count() > SHOWN {
        format!(" (first {SHOWN} of {} bytes)", uid.len())
    } else {
        String::new()
    };
    Err(format!(
        "{shown:?}{cut} is not a UUID in the API server's form \
         (8-4-4-4-12 lowercase hex digits, e.g. 0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e8f)"
    ))
}

fn claim_refs(claims: Vec<v1::Claim>) -> Vec<ClaimRef> {
    claims
        .into_iter()
        .map(|c| ClaimRef {
            namespace: c.namespace,
            name: c.name,
            uid: c.uid,
        })
        .collect()
}

/// The DRA service proper: v1 is the one implementation.
#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let results = self.prepare(claim_refs(request.into_inner().claims)).await;
        Ok(Response::new(v1::NodePrepareResourcesResponse {
            claims: results
                .into_iter()
                .map(|(uid, r)| {
                    let resp = match r {
                        Ok(devices) => v1::NodePrepareResourceResponse {
                            devices,
                            error: String::new(),
                        },
                        Err(error) => v1::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        },
                    };
                    (uid, resp)
                })
                .collect(),
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let results = self
            .unprepare(claim_refs(request.into_inner().claims))
            .await;
        Ok(Response::new(v1::NodeUnprepareResourcesResponse {
            claims: results
                .into_iter()
                .map(|(uid, error)| (uid, v1::NodeUnprepareResourceResponse { error }))
                .collect(),
        }))
    }
}

/// v1beta1 is served by the v1 implementation: the request is converted up, the answer down
/// (dropping `share_id`, which v1beta1 lacks); see the conversions in `gpu_dra_proto::dra`.
#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let answer =
            v1::dra_plugin_server::DraPlugin::node_prepare_resources(self, request.map(Into::into))
                .await?;
        Ok(answer.map(Into::into))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let answer = v1::dra_plugin_server::DraPlugin::node_unprepare_resources(
            self,
            request.map(Into::into),
        )
        .await?;
        Ok(answer.map(Into::into))
    }
}

/// Serves registration on `reg_listener` and DRA on `dra_listener` until `shutdown` resolves:
/// DRA with the driver `cell` will hold (calls wait until it does) and, when given, the health
/// service (advertised through `registration`).
pub async fn serve_deferred(
    cell: DriverCell,
    health: Option<crate::health::HealthService>,
    registration: Registration,
    reg_listener: UnixListener,
    dra_listener: UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let registration = if health.is_some() {
        registration.with_health()
    } else {
        registration
    };
    serve_service(
        DraService::deferred(cell),
        health,
        registration,
        reg_listener,
        dra_listener,
        shutdown,
    )
    .await
}

async fn serve_service(
    dra: DraService,
    health: Option<crate::health::HealthService>,
    registration: Registration,
    reg_listener: UnixListener,
    dra_listener: UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let reg_server = tonic::transport::Server::builder()
        .add_service(reg::registration_server::RegistrationServer::new(
            registration,
        ))
        .serve_with_incoming_shutdown(incoming(reg_listener), wait_true(rx.clone()));
    let dra_server = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(dra.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(dra))
        .add_optional_service(health.map(
            gpu_dra_proto::health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new,
        ))
        .serve_with_incoming_shutdown(incoming(dra_listener), wait_true(rx));
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let (a, b) = tokio::join!(reg_server, dra_server);
    a.and(b)
}

async fn wait_true(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{
        DRIVER_NAME, DriverBuilder, MemoryClaims, NODE_NAME, allocated_claim, dra_service,
        simulate_host,
    };
    use gpu_dra_device::testing::a100_inventory;

    const VALID: &str = "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e8f";

    #[tokio::test]
    async fn claim_uids_that_are_not_uuids_are_refused_per_claim_before_any_file_is_touched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        simulate_host(&root.join("host"), &a100_inventory(4, 1)).expect("host");
        let claims = Arc::new(MemoryClaims::default());
        let traversal = "../../etc/x";
        let long = "a".repeat(300);
        let upper = VALID.to_uppercase();
        for (name, uid, device) in [
            ("evil", traversal, "gpu-1"),
            ("empty", "", "gpu-2"),
            ("long", long.as_str(), "gpu-3"),
            ("upper", upper.as_str(), "gpu-3"),
            ("good", VALID, "gpu-2"),
        ] {
            claims.insert(allocated_claim(
                "ns",
                name,
                uid,
                DRIVER_NAME,
                NODE_NAME,
                &[("gpu", device)],
                &[],
            ));
        }
        let driver = DriverBuilder::new(root, a100_inventory(4, 1))
            .claims(claims)
            .build()
            .expect("driver");
        let dra = dra_service(Arc::new(driver));
        std::fs::create_dir_all(root.join("plugin")).expect("plugin dir");
        // A file the traversal would reach from the CDI folder if it were taken as a name.
        let cdi = root.join("cdi");
        std::fs::create_dir_all(cdi.join("k8s.gpu.nvidia.com-claim_..")).expect("dir");
        std::fs::create_dir_all(cdi.join("etc")).expect("etc");
        std::fs::write(cdi.join("etc/x.json"), "keep").expect("bait");

        let refs = |pairs: &[(&str, &str)]| -> Vec<ClaimRef> {
            pairs
                .iter()
                .map(|(name, uid)| ClaimRef {
                    namespace: "ns".into(),
                    name: (*name).into(),
                    uid: (*uid).into(),
                })
                .collect()
        };
        let all = [
            ("evil", traversal),
            ("empty", ""),
            ("long", long.as_str()),
            ("upper", upper.as_str()),
            ("good", VALID),
        ];
        let prepared = dra.prepare(refs(&all)).await;
        assert_eq!(prepared.len(), all.len(), "every claim is answered");
        for (uid, result) in &prepared {
            if uid == VALID {
                result.as_ref().expect("a UUID prepares");
                continue;
            }
            let err = result.as_ref().expect_err("refused");
            assert!(
                err.contains("is not a UUID") && err.contains("lowercase"),
                "{uid:?}: {err}"
            );
            assert!(err.len() < 400, "overlong UIDs are cut in messages: {err}");
        }
        let unprepared = dra.unprepare(refs(&all)).await;
        for (uid, err) in &unprepared {
            assert_eq!(err.is_empty(), uid == VALID, "{uid:?}: {err}");
        }
        assert_eq!(
            std::fs::read_to_string(cdi.join("etc/x.json")).expect("untouched"),
            "keep"
        );
        let mut left: Vec<String> = std::fs::read_dir(&cdi)
            .expect("cdi")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["etc", "k8s.gpu.nvidia.com-claim_.."]);
    }

    /// Claims in memory; reading claim `held` waits until `open` is told true.
    struct GatedClaims {
        inner: MemoryClaims,
        held: &'static str,
        open: tokio::sync::watch::Receiver<bool>,
    }

    impl crate::claims::ClaimSource for GatedClaims {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> futures::future::BoxFuture<
            'a,
            Result<
                Option<k8s_openapi::api::resource::v1::ResourceClaim>,
                crate::claims::ClaimSourceError,
            >,
        > {
            Box::pin(async move {
                if name == self.held {
                    let mut open = self.open.clone();
                    let _ = open.wait_for(|o| *o).await;
                }
                self.inner.get(namespace, name).await
            })
        }
    }

    /// One kubelet call with two claims allocated from the node's slices before a MIG
    /// re-layout: the first claim's device is gone, so its refusal rediscovers and the
    /// publisher republishes the new layout before the second claim (whose device was
    /// recreated under the same name, with a new UUID) is resolved. The second must still be
    /// refused: its allocation was made from what was published when the call arrived. Judged
    /// by the publication of the moment it is resolved, it would be prepared with the new
    /// instance under the old name.
    #[tokio::test]
    async fn the_claims_of_one_call_are_judged_by_what_was_published_when_it_arrived() {
        use gpu_dra_device::fixture::FixtureInventory;
        use gpu_dra_device::testing::{a100, inventory, mig_1g5gb};
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let first = inventory([a100(0).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build()]);
        let mut second = first.clone();
        second.gpus[0].mig_devices[0].gi_id = 9;
        second.gpus[0].mig_devices[0].uuid = "MIG-00000000-0000-5000-8000-000000000099".into();
        second.gpus[0].mig_devices.remove(1);
        simulate_host(&root.join("host"), &first).expect("host");
        let gpu = &first.gpus[0];
        let (n0, n1) = (
            gpu.mig_devices[0].device_name(gpu),
            gpu.mig_devices[1].device_name(gpu),
        );
        let (open_tx, open) = tokio::sync::watch::channel(false);
        let claims = GatedClaims {
            inner: MemoryClaims::default(),
            held: "recreated",
            open,
        };
        const GONE: &str = "1b0d6a52-6a1b-4c7d-9e2f-3a4b5c6d7e01";
        const RECREATED: &str = "1b0d6a52-6a1b-4c7d-9e2f-3a4b5c6d7e02";
        for (name, uid, device) in [("gone", GONE, &n1), ("recreated", RECREATED, &n0)] {
            claims.inner.insert(allocated_claim(
                "ns",
                name,
                uid,
                DRIVER_NAME,
                NODE_NAME,
                &[("mig", device.as_str())],
                &[],
            ));
        }
        let fixture = Arc::new(FixtureInventory::new(first.clone()));
        let driver = Arc::new(
            DriverBuilder::new(root, first.clone())
                .claims(Arc::new(claims))
                .backend(fixture.clone())
                .build()
                .expect("driver"),
        );
        let live = driver.live_inventory().clone();
        live.mark_published(&first);
        fixture.set(second.clone());
        // The publisher: republishes whatever a rediscovery found, then lets the second
        // claim's read through.
        let mut changes = live.subscribe();
        changes.borrow_and_update();
        let publisher = {
            let live = live.clone();
            tokio::spawn(async move {
                if changes.changed().await.is_ok() {
                    live.mark_published(&live.current());
                    let _ = open_tx.send(true);
                }
            })
        };
        let dra = dra_service(driver);
        let refs = [("gone", GONE), ("recreated", RECREATED)]
            .map(|(name, uid)| ClaimRef {
                namespace: "ns".into(),
                name: name.into(),
                uid: uid.into(),
            })
            .to_vec();
        let results = tokio::time::timeout(std::time::Duration::from_secs(20), dra.prepare(refs))
            .await
            .expect("the call ends");
        publisher.await.expect("publisher");
        assert_eq!(
            live.published().uuid(&n0).map(String::as_str),
            Some("MIG-00000000-0000-5000-8000-000000000099"),
            "the new layout was published during the call"
        );
        for (uid, result) in &results {
            let err = result.as_ref().expect_err("refused");
            if uid == RECREATED {
                assert!(
                    err.contains("MIG-00000000-0000-5000-8000-000000000099"),
                    "the recreated device is refused as changed: {err}"
                );
            }
        }
    }

    #[test]
    fn uid_syntax() {
        assert!(check_claim_uid(VALID).is_ok());
        for bad in [
            "",
            "../../etc/x",
            "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e8",
            "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e8f0",
            "0f8e3c52x6a1b-4c7d-9e2f-3a4b5c6d7e8f",
            "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e8g",
            "0F8E3C52-6A1B-4C7D-9E2F-3A4B5C6D7E8F",
            "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7e/f",
            "0f8e3c52-6a1b-4c7d-9e2f-3a4b5c6d7é",
        ] {
            assert!(check_claim_uid(bad).is_err(), "{bad:?}");
        }
    }
}
