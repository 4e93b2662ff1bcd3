//! NVIDIA's metric family as a scraper sees it: the kubelet's requests go over the DRA socket,
//! `/metrics` is read over HTTP, and every `nvidia_dra_*` series is checked after prepares,
//! unprepares and failed ones, next to our `gpu_dra_*` series.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use gpu_dra_device::Inventory;
use gpu_dra_device::testing::a100_inventory;
use gpu_dra_kubelet_plugin::failpoint::Failpoints;
use gpu_dra_kubelet_plugin::grpc::{bind_socket, incoming};
use gpu_dra_kubelet_plugin::metrics::Metrics;
use gpu_dra_kubelet_plugin::testing::{
    DriverBuilder, MemoryClaims, allocated_claim, connect_dra, dra_service, simulate_host,
};
use gpu_dra_proto::dra::v1;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const UID_GPU: &str = "a0000000-0000-4000-8000-00000000000a";
const UID_MIG: &str = "b0000000-0000-4000-8000-00000000000b";
const UID_GONE: &str = "90000000-0000-4000-8000-000000000009";

/// A plugin on a simulated node `n1` (`inventory` under `<root>/host`) with `claims` allocated
/// and `failpoints` set: its DRA socket and the address of its HTTP endpoint.
async fn serve(
    root: &Path,
    inventory: Inventory,
    claims: &[(&str, &str, &str)],
    failpoints: &str,
) -> (PathBuf, std::net::SocketAddr) {
    simulate_host(&root.join("host"), &inventory).expect("host");
    let source = Arc::new(MemoryClaims::default());
    for (name, uid, device) in claims {
        source.insert(allocated_claim(
            "ns",
            name,
            uid,
            "gpu.nvidia.com",
            "n1",
            &[("req", device)],
            &[],
        ));
    }
    let metrics = Arc::new(Metrics::default());
    let driver = DriverBuilder::new(root, inventory)
        .node_name("n1")
        .claims(source)
        .metrics(metrics.clone())
        .failpoints(Failpoints::parse(failpoints, None).expect("failpoints"))
        .build()
        .expect("driver");
    let socket = root.join("plugin/dra.sock");
    let listener = bind_socket(&socket).expect("bind");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(dra_service(
                Arc::new(driver),
            )))
            .serve_with_incoming(incoming(listener)),
    );
    let http = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind http");
    let addr = http.local_addr().expect("addr");
    tokio::spawn(gpu_dra_kubelet_plugin::http::serve(
        http,
        metrics,
        Arc::new(AtomicBool::new(true)),
        Arc::new(gpu_dra_kubelet_plugin::http::Serving),
    ));
    (socket, addr)
}

/// GET /metrics as a scraper does; the body.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut got = String::new();
    conn.read_to_string(&mut got).await.expect("response");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    got
}

fn claims(pairs: &[(&str, &str)]) -> Vec<v1::Claim> {
    pairs
        .iter()
        .map(|(name, uid)| v1::Claim {
            namespace: "ns".into(),
            uid: (*uid).into(),
            name: (*name).into(),
        })
        .collect()
}

fn assert_series(text: &str, want: &[String]) {
    for series in want {
        assert!(
            text.lines().any(|l| l == series),
            "{series} missing:\n{text}"
        );
    }
}

#[tokio::test]
async fn nvidias_series_count_the_kubelets_requests_by_outcome_and_devices_by_type() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // GPU 0 is in MIG mode (seven 1g.5gb devices), GPU 1 is whole.
    let inventory = a100_inventory(2, 1);
    let mig = inventory.gpus[0].mig_devices[0].device_name(&inventory.gpus[0]);
    let (socket, addr) = serve(
        root,
        inventory,
        &[("g", UID_GPU, "gpu-1"), ("m", UID_MIG, &mig)],
        "",
    )
    .await;

    // Before any request: the request series exist at zero, no device is prepared.
    let l = |op: &str| format!(r#"{{driver="gpu.nvidia.com",operation="{op}"}}"#);
    let prepared = |ty: &str, n: u32| {
        format!(
            r#"nvidia_dra_prepared_devices{{node="n1",driver="gpu.nvidia.com",device_type="{ty}"}} {n}"#
        )
    };
    let text = scrape(addr).await;
    assert_series(
        &text,
        &[
            format!("nvidia_dra_requests_total{} 0", l("prepare")),
            format!("nvidia_dra_requests_total{} 0", l("unprepare")),
            format!(
                "nvidia_dra_request_duration_seconds_count{} 0",
                l("prepare")
            ),
            format!("nvidia_dra_requests_inflight{} 0", l("unprepare")),
            prepared("gpu", 0),
            prepared("mig", 0),
        ],
    );

    let mut dra = connect_dra(socket).await.expect("connect");
    let answer = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims(&[("g", UID_GPU), ("m", UID_MIG), ("gone", UID_GONE)]),
        })
        .await
        .expect("prepare")
        .into_inner();
    assert!(answer.claims[UID_GPU].error.is_empty());
    assert!(answer.claims[UID_MIG].error.is_empty());
    assert!(answer.claims[UID_GONE].error.contains("not found"));

    let text = scrape(addr).await;
    assert_series(
        &text,
        &[
            // Successful requests only; the failed one is an error of type prepare_devices.
            format!("nvidia_dra_requests_total{} 2", l("prepare")),
            format!("nvidia_dra_request_duration_seconds_count{} 2", l("prepare")),
            format!("nvidia_dra_requests_inflight{} 0", l("prepare")),
            r#"nvidia_dra_node_prepare_errors_total{driver="gpu.nvidia.com",error_type="prepare_devices"} 1"#.into(),
            prepared("gpu", 1),
            prepared("mig", 1),
            prepared("vfio", 0),
            prepared("unknown", 0),
            // Ours, next to them: every claim, failed ones included.
            r#"gpu_dra_requests_total{op="prepare"} 3"#.into(),
            r#"gpu_dra_request_errors_total{op="prepare"} 1"#.into(),
            "gpu_dra_prepared_devices 2".into(),
        ],
    );

    dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
        claims: claims(&[("m", UID_MIG)]),
    })
    .await
    .expect("unprepare");
    let text = scrape(addr).await;
    assert_series(
        &text,
        &[
            format!("nvidia_dra_requests_total{} 1", l("unprepare")),
            format!(
                "nvidia_dra_request_duration_seconds_count{} 1",
                l("unprepare")
            ),
            format!("nvidia_dra_requests_inflight{} 0", l("unprepare")),
            prepared("gpu", 1),
            prepared("mig", 0),
        ],
    );
    assert!(
        !text.contains("nvidia_dra_node_unprepare_errors_total{"),
        "no unprepare failed yet:\n{text}"
    );
}

#[tokio::test]
async fn a_failed_unprepare_counts_as_an_unprepare_error_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let (socket, addr) = serve(
        root,
        a100_inventory(1, 0),
        &[("g", UID_GPU, "gpu-0")],
        "unprepare.after_sharing=error",
    )
    .await;
    let mut dra = connect_dra(socket).await.expect("connect");
    dra.node_prepare_resources(v1::NodePrepareResourcesRequest {
        claims: claims(&[("g", UID_GPU)]),
    })
    .await
    .expect("prepare");
    let answer = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: claims(&[("g", UID_GPU)]),
        })
        .await
        .expect("unprepare")
        .into_inner();
    assert!(answer.claims[UID_GPU].error.contains("failpoint"));
    let text = scrape(addr).await;
    assert_series(
        &text,
        &[
            r#"nvidia_dra_node_unprepare_errors_total{driver="gpu.nvidia.com",error_type="unprepare_devices"} 1"#.into(),
            r#"nvidia_dra_requests_total{driver="gpu.nvidia.com",operation="unprepare"} 0"#.into(),
            r#"nvidia_dra_requests_total{driver="gpu.nvidia.com",operation="prepare"} 1"#.into(),
            // The claim is still prepared: its device still counts.
            r#"nvidia_dra_prepared_devices{node="n1",driver="gpu.nvidia.com",device_type="gpu"} 1"#.into(),
        ],
    );
}
