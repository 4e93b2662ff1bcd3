//! The DRA service over a real unix socket, both API versions: answers carry every claim of
//! the request, per-claim errors stay per claim, v1beta1 returns the same devices as v1.

use std::path::Path;
use std::sync::Arc;

use gpu_dra_device::testing::a100_inventory;
use gpu_dra_kubelet_plugin::grpc::{bind_socket, incoming};
use gpu_dra_kubelet_plugin::metrics::Metrics;
use gpu_dra_kubelet_plugin::testing::{
    DriverBuilder, MemoryClaims, allocated_claim, connect_dra, dra_service, simulate_host,
    unix_channel,
};
use gpu_dra_proto::dra::{v1, v1beta1};
use k8s_openapi::api::resource::v1::ResourceClaim;

/// A driver on a simulated two-GPU host with `claims` allocated, served over a unix socket
/// under `root` in both versions; returns the socket path and the metrics.
const UID_A: &str = "a0000000-0000-4000-8000-00000000000a";
const UID_B: &str = "b0000000-0000-4000-8000-00000000000b";
const UID_GONE: &str = "90000000-0000-4000-8000-000000000009";
const UID_NEVER: &str = "e0000000-0000-4000-8000-00000000000e";
const UID_S: &str = "50000000-0000-4000-8000-000000000005";

fn serve_driver(root: &Path, allocated: Vec<ResourceClaim>) -> (std::path::PathBuf, Arc<Metrics>) {
    let inventory = a100_inventory(2, 0);
    simulate_host(&root.join("host"), &inventory).expect("host");
    let claims = Arc::new(MemoryClaims::default());
    for claim in allocated {
        claims.insert(claim);
    }
    let metrics = Arc::new(Metrics::default());
    let driver = Arc::new(
        DriverBuilder::new(root, inventory)
            .node_name("n1")
            .claims(claims)
            .metrics(metrics.clone())
            .build()
            .expect("driver"),
    );
    let socket = root.join("plugin/dra.sock");
    let listener = bind_socket(&socket).expect("bind");
    let service = dra_service(driver);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service))
            .serve_with_incoming(incoming(listener)),
    );
    (socket, metrics)
}

/// A v1beta1 client on `socket` ([`connect_dra`] speaks v1 only).
async fn connect_v1beta1(
    socket: std::path::PathBuf,
) -> v1beta1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
    v1beta1::dra_plugin_client::DraPluginClient::new(
        unix_channel(socket).await.expect("connect v1beta1"),
    )
}

#[tokio::test]
async fn v1_and_v1beta1_prepare_and_unprepare_over_the_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let allocated = [("a", UID_A, "gpu-0"), ("b", UID_B, "gpu-1")]
        .into_iter()
        .map(|(name, uid, dev)| {
            allocated_claim(
                "ns",
                name,
                uid,
                "gpu.nvidia.com",
                "n1",
                &[("gpu/big", dev)],
                &[],
            )
        })
        .collect();
    let (socket, metrics) = serve_driver(root, allocated);

    let mut v1c = connect_dra(socket.clone()).await.expect("connect");
    let claim = |name: &str, uid: &str| v1::Claim {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    };
    let answer = v1c
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("a", UID_A), claim("gone", UID_GONE)],
        })
        .await
        .expect("call")
        .into_inner();
    assert_eq!(
        answer.claims.len(),
        2,
        "every claim of the request is answered"
    );
    let a = &answer.claims[UID_A];
    assert!(a.error.is_empty(), "{}", a.error);
    assert_eq!(a.devices[0].request_names, ["gpu"], "subrequest stripped");
    assert_eq!(a.devices[0].pool_name, "n1");
    assert_eq!(
        a.devices[0].cdi_device_ids,
        [format!("k8s.gpu.nvidia.com/claim={UID_A}-gpu-0")]
    );
    assert!(answer.claims[UID_GONE].error.contains("not found"));

    let mut beta = connect_v1beta1(socket.clone()).await;
    let b = beta
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "ns".into(),
                uid: UID_B.into(),
                name: "b".into(),
            }],
        })
        .await
        .expect("v1beta1 call")
        .into_inner();
    assert_eq!(
        b.claims[UID_B].devices[0].cdi_device_ids,
        [format!("k8s.gpu.nvidia.com/claim={UID_B}-gpu-1")]
    );
    assert!(metrics.render().contains("gpu_dra_prepared_devices 2"));

    let un = beta
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![
                v1beta1::Claim {
                    namespace: "ns".into(),
                    uid: UID_B.into(),
                    name: "b".into(),
                },
                v1beta1::Claim {
                    namespace: "ns".into(),
                    uid: UID_NEVER.into(),
                    name: "x".into(),
                },
            ],
        })
        .await
        .expect("unprepare")
        .into_inner();
    assert!(un.claims.values().all(|c| c.error.is_empty()));
    assert!(
        !root
            .join(format!("cdi/k8s.gpu.nvidia.com-claim_{UID_B}.json"))
            .exists()
    );
    assert!(metrics.render().contains("gpu_dra_prepared_devices 1"));
}

/// v1beta1 is served by the v1 code: the same claims give the same answers in both versions,
/// minus `share_id`, for prepare (including a per-claim error) and unprepare.
#[tokio::test]
async fn v1beta1_answers_are_the_v1_answers_without_share_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let mut shared = allocated_claim(
        "ns",
        "s",
        UID_S,
        "gpu.nvidia.com",
        "n1",
        &[("gpu", "gpu-0")],
        &[],
    );
    if let Some(result) = shared
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
        .and_then(|r| r.first_mut())
    {
        result.share_id = Some("share-1".into());
    }
    let (socket, _metrics) = serve_driver(root, vec![shared]);
    let mut v1c = connect_dra(socket.clone()).await.expect("connect");
    let mut beta = connect_v1beta1(socket).await;
    let v1_claims = || {
        [("s", UID_S), ("gone", UID_GONE)]
            .map(|(name, uid)| v1::Claim {
                namespace: "ns".into(),
                uid: uid.into(),
                name: name.into(),
            })
            .to_vec()
    };
    let beta_claims = || {
        [("s", UID_S), ("gone", UID_GONE)]
            .map(|(name, uid)| v1beta1::Claim {
                namespace: "ns".into(),
                uid: uid.into(),
                name: name.into(),
            })
            .to_vec()
    };

    // Prepare is idempotent, so asking twice must give the same devices.
    let one = v1c
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: v1_claims(),
        })
        .await
        .expect("v1 prepare")
        .into_inner();
    let two = beta
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: beta_claims(),
        })
        .await
        .expect("v1beta1 prepare")
        .into_inner();
    assert_eq!(
        one.claims[UID_S].devices[0].share_id.as_deref(),
        Some("share-1")
    );
    assert!(one.claims[UID_GONE].error.contains("not found"));
    assert_eq!(one.claims.len(), two.claims.len());
    for (uid, want) in &one.claims {
        let got = &two.claims[uid];
        assert_eq!(got.error, want.error, "{uid}");
        let want: Vec<_> = want
            .devices
            .iter()
            .map(|d| {
                (
                    &d.request_names,
                    &d.pool_name,
                    &d.device_name,
                    &d.cdi_device_ids,
                )
            })
            .collect();
        let got: Vec<_> = got
            .devices
            .iter()
            .map(|d| {
                (
                    &d.request_names,
                    &d.pool_name,
                    &d.device_name,
                    &d.cdi_device_ids,
                )
            })
            .collect();
        assert_eq!(got, want, "{uid}");
    }
    assert!(!two.claims[UID_S].devices.is_empty());

    // Unprepare twice (also idempotent): same per-claim answers, and the spec is gone.
    let un_beta = beta
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: beta_claims(),
        })
        .await
        .expect("v1beta1 unprepare")
        .into_inner();
    let un_v1 = v1c
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: v1_claims(),
        })
        .await
        .expect("v1 unprepare")
        .into_inner();
    assert_eq!(un_beta.claims.len(), 2);
    for (uid, want) in &un_v1.claims {
        assert_eq!(un_beta.claims[uid].error, want.error, "{uid}");
    }
    assert!(
        !root
            .join(format!("cdi/k8s.gpu.nvidia.com-claim_{UID_S}.json"))
            .exists()
    );
}
