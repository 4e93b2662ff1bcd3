//! The DRA service over a real unix socket, both API versions: answers carry every claim of
//! the request, per-claim errors stay per claim, v1beta1 returns the same devices as v1.

use std::sync::Arc;

use gpu_dra_device::testing::a100_inventory;
use gpu_dra_kubelet_plugin::claims::MemoryClaims;
use gpu_dra_kubelet_plugin::client::connect_dra;
use gpu_dra_kubelet_plugin::grpc::{DraService, bind_socket, incoming};
use gpu_dra_kubelet_plugin::metrics::Metrics;
use gpu_dra_kubelet_plugin::testing::{DriverBuilder, allocated_claim, simulate_host};
use gpu_dra_proto::dra::{v1, v1beta1};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

#[tokio::test]
async fn v1_and_v1beta1_prepare_and_unprepare_over_the_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let inventory = a100_inventory(2, 0);
    simulate_host(&root.join("host"), &inventory).expect("host");
    let claims = Arc::new(MemoryClaims::default());
    for (name, uid, dev) in [("a", "uid-a", "gpu-0"), ("b", "uid-b", "gpu-1")] {
        claims.insert(allocated_claim(
            "ns",
            name,
            uid,
            "gpu.nvidia.com",
            "n1",
            &[("gpu/big", dev)],
            &[],
        ));
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
    let service = DraService::new(driver);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service))
            .serve_with_incoming(incoming(listener)),
    );

    let mut v1c = connect_dra(socket.clone()).await.expect("connect");
    let claim = |name: &str, uid: &str| v1::Claim {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    };
    let answer = v1c
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("a", "uid-a"), claim("gone", "uid-gone")],
        })
        .await
        .expect("call")
        .into_inner();
    assert_eq!(
        answer.claims.len(),
        2,
        "every claim of the request is answered"
    );
    let a = &answer.claims["uid-a"];
    assert!(a.error.is_empty(), "{}", a.error);
    assert_eq!(a.devices[0].request_names, ["gpu"], "subrequest stripped");
    assert_eq!(a.devices[0].pool_name, "n1");
    assert_eq!(
        a.devices[0].cdi_device_ids,
        ["k8s.gpu.nvidia.com/claim=uid-a-gpu-0"]
    );
    assert!(answer.claims["uid-gone"].error.contains("not found"));

    let sock = socket.clone();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let sock = sock.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(sock).await?)) }
        }))
        .await
        .expect("connect v1beta1");
    let mut beta = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
    let b = beta
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "ns".into(),
                uid: "uid-b".into(),
                name: "b".into(),
            }],
        })
        .await
        .expect("v1beta1 call")
        .into_inner();
    assert_eq!(
        b.claims["uid-b"].devices[0].cdi_device_ids,
        ["k8s.gpu.nvidia.com/claim=uid-b-gpu-1"]
    );
    assert!(metrics.render().contains("gpu_dra_prepared_devices 2"));

    let un = beta
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![
                v1beta1::Claim {
                    namespace: "ns".into(),
                    uid: "uid-b".into(),
                    name: "b".into(),
                },
                v1beta1::Claim {
                    namespace: "ns".into(),
                    uid: "uid-never".into(),
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
            .join("cdi/k8s.gpu.nvidia.com-claim_uid-b.json")
            .exists()
    );
    assert!(metrics.render().contains("gpu_dra_prepared_devices 1"));
}
