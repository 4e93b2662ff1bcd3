//! The webhook over real TLS on loopback: routes, both HTTP versions, certificate rotation,
//! malformed bodies and graceful shutdown.

mod common;

use serde_json::Value;

fn claim_review(uid: &str) -> Vec<u8> {
    common::claim_review(uid, "c", None)
}

#[tokio::test]
async fn serves_reviews_probes_and_metrics_over_h2_and_http1() {
    let dir = tempfile::tempdir().unwrap();
    let a = common::pair();
    common::install(dir.path(), &a);
    let server = common::start(dir.path()).await;

    for alpn in [&b"h2"[..], &b"http/1.1"[..]] {
        let (mut c, _) = common::connect(server.addr, &[&a.der], alpn).await;
        assert_eq!(
            c.send("GET", "/healthz", vec![]).await,
            (200, "ok\n".into())
        );
        assert_eq!(c.send("GET", "/readyz", vec![]).await, (200, "ok\n".into()));

        let (status, body) = c
            .send("POST", "/validate?timeout=10s", claim_review("u-1"))
            .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["response"]["uid"], "u-1");
        assert_eq!(v["response"]["allowed"], true);

        let (status, body) = c.send("POST", "/validate", b"{\"kind\":".to_vec()).await;
        assert_eq!(status, 400);
        assert!(
            body.starts_with("request body is not an AdmissionReview"),
            "{body}"
        );

        assert_eq!(c.send("GET", "/validate", vec![]).await.0, 405);
        assert_eq!(c.send("GET", "/nope", vec![]).await.0, 404);
    }

    let (mut c, _) = common::connect(server.addr, &[&a.der], b"h2").await;
    let (status, text) = c.send("GET", "/metrics", vec![]).await;
    assert_eq!(status, 200);
    assert!(
        text.contains(
            r#"gpu_dra_webhook_admission_requests_total{kind="ResourceClaim",operation="CREATE",result="allowed"} 2"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"result="malformed"} 2"#), "{text}");
    server.stop().await;
}

#[tokio::test]
async fn a_rotated_certificate_is_served_to_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (common::pair(), common::pair());
    common::install(dir.path(), &a);
    let server = common::start(dir.path()).await;

    let (mut old, leaf) = common::connect(server.addr, &[&a.der, &b.der], b"h2").await;
    assert_eq!(leaf, a.der);

    common::install(dir.path(), &b);
    let (_, leaf) = common::connect(server.addr, &[&a.der, &b.der], b"h2").await;
    assert_eq!(leaf, b.der, "new connections get the rotated certificate");
    // The connection opened before the rotation keeps working.
    assert_eq!(old.send("GET", "/healthz", vec![]).await.0, 200);

    let (mut c, _) = common::connect(server.addr, &[&b.der], b"h2").await;
    let (_, text) = c.send("GET", "/metrics", vec![]).await;
    assert!(
        text.contains("gpu_dra_webhook_certificate_reloads_total 1"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_oversized_body_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = common::pair();
    common::install(dir.path(), &a);
    let server = common::start(dir.path()).await;
    let (mut c, _) = common::connect(server.addr, &[&a.der], b"h2").await;
    let big = vec![b' '; gpu_dra_webhook::server::MAX_BODY_BYTES + 1];
    let (status, body) = c.send("POST", "/validate", big).await;
    assert_eq!(status, 413, "{body}");
    server.stop().await;
}

async fn readyz(app: &gpu_dra_webhook::server::App) -> u16 {
    let req = http::Request::get("/readyz")
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .expect("a valid request");
    app.handle(req).await.status().as_u16()
}

#[tokio::test]
async fn ready_only_while_serving_with_a_certificate() {
    // Built but not serving (the certificate is loaded only on the way to `serve`): not ready.
    let idle = gpu_dra_webhook::server::App::new("gpu.nvidia.com".into(), Default::default());
    assert_eq!(readyz(&idle).await, 503);

    let dir = tempfile::tempdir().unwrap();
    let a = common::pair();
    common::install(dir.path(), &a);
    let server = common::start(dir.path()).await;
    let app = std::sync::Arc::clone(&server.app);
    let (mut c, _) = common::connect(server.addr, &[&a.der], b"h2").await;
    assert_eq!(c.send("GET", "/readyz", vec![]).await.0, 200);
    assert_eq!(readyz(&app).await, 200);
    server.stop().await;
    assert_eq!(readyz(&app).await, 503, "not ready once shutdown began");
}
