//! AdmissionReview fixtures through the in-process HTTP handler.
//!
//! Each `tests/fixtures/<name>.review.json` is a review as the API server sends it; the
//! handler's answer must equal `<name>.response.json` (golden files, rewritten with
//! `UPDATE_GENERATED=1` and then reviewed by eye). Independently of the golden file, the name
//! says what must happen: `*-valid` and `*-skipped` are allowed without warnings, `*-warns`
//! allowed with warnings, anything else denied with reason Invalid and code 422.

use std::path::Path;
use std::sync::Arc;

use gpu_dra_webhook::metrics::Metrics;
use gpu_dra_webhook::server::App;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::Value;

async fn post(app: &App, body: Vec<u8>) -> (u16, Vec<u8>) {
    let req = Request::post("/validate")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request");
    let resp = app.handle(req).await;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("in-memory body")
        .to_bytes();
    (status, body.to_vec())
}

#[tokio::test]
async fn fixtures() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let update = std::env::var_os("UPDATE_GENERATED").is_some();
    let app = App::new("gpu.nvidia.com".into(), Arc::new(Metrics::new()));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".review.json").map(str::to_owned)
        })
        .collect();
    names.sort();
    assert!(names.len() >= 9, "fixtures missing: {names:?}");

    let mut stale = Vec::new();
    for name in &names {
        let input = std::fs::read(dir.join(format!("{name}.review.json"))).unwrap();
        let uid = serde_json::from_slice::<Value>(&input).unwrap()["request"]["uid"].clone();
        let (status, body) = post(&app, input).await;
        assert_eq!(status, 200, "{name}: {}", String::from_utf8_lossy(&body));
        let review: Value = serde_json::from_slice(&body).unwrap();
        let response = &review["response"];
        assert_eq!(response["uid"], uid, "{name}: uid echoed");

        let warnings = response["warnings"].as_array().map_or(0, Vec::len);
        if name.ends_with("-valid") || name.ends_with("-skipped") {
            assert_eq!(response["allowed"], true, "{name}: {response}");
            assert_eq!(warnings, 0, "{name}: {response}");
        } else if name.ends_with("-warns") {
            assert_eq!(response["allowed"], true, "{name}: {response}");
            assert!(warnings > 0, "{name}: {response}");
        } else {
            assert_eq!(response["allowed"], false, "{name}: {response}");
            assert_eq!(response["status"]["reason"], "Invalid");
            assert_eq!(response["status"]["code"], 422);
            // Every cause's full path appears in the message the user sees.
            let message = response["status"]["message"].as_str().unwrap();
            for cause in response["status"]["details"]["causes"].as_array().unwrap() {
                let field = cause["field"].as_str().unwrap();
                assert!(field.starts_with("spec."), "{name}: {field}");
                assert!(message.contains(field), "{name}: {field} not in {message}");
            }
        }

        let golden = dir.join(format!("{name}.response.json"));
        let mut pretty = serde_json::to_string_pretty(&review).unwrap();
        pretty.push('\n');
        if update {
            std::fs::write(&golden, &pretty).unwrap();
        } else if std::fs::read_to_string(&golden).ok().as_deref() != Some(pretty.as_str()) {
            stale.push(format!("{name}: got\n{pretty}"));
        }
    }
    assert!(
        stale.is_empty(),
        "responses differ from the golden files (UPDATE_GENERATED=1 rewrites them):\n{}",
        stale.join("\n")
    );
}

#[tokio::test]
async fn malformed_bodies_get_400_with_the_reason() {
    let app = App::new("gpu.nvidia.com".into(), Arc::new(Metrics::new()));
    for (body, want) in [
        (&b"null"[..], "request body is not an AdmissionReview"),
        (br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x"}}"#, "missing field `kind`"),
        (br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x","kind":{},"object":[1]}}"#, ""),
    ] {
        let (status, text) = post(&app, body.to_vec()).await;
        let text = String::from_utf8(text).unwrap();
        if want.is_empty() {
            // A non-object `object` is not ours to inspect: allowed, not an error.
            assert_eq!(status, 200, "{text}");
        } else {
            assert_eq!(status, 400, "{text}");
            assert!(text.contains(want), "{text}");
        }
    }
}
