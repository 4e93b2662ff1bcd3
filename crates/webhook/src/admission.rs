//! AdmissionReview `admission.k8s.io/v1`: request bytes in, response bytes out.
//!
//! Pure and synchronous so that every decision is testable with JSON fixtures and no server.
//! Invariants:
//! - only `resource.k8s.io` ResourceClaim, ResourceClaimTemplate and DeviceClass objects
//!   (versions `v1`, `v1beta1`, `v1beta2`) on CREATE/UPDATE are inspected; every other
//!   request is allowed without looking at its object, so a too-broad webhook rule never
//!   blocks the cluster;
//! - a denial lists every problem the one validation of the `api` crate found, each with its
//!   full field path, in the message and in `status.details.causes`;
//! - a body that is not an AdmissionReview is a [`BadReview`] (the server answers 400), never
//!   a panic and never a silent allow.

use gpu_dra_api::objects::ObjectKind;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The only AdmissionReview version this webhook speaks (the chart registers just this one).
pub const ADMISSION_API_VERSION: &str = "admission.k8s.io/v1";
/// The API group of the objects we validate.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";
/// Versions of [`RESOURCE_GROUP`] whose objects we understand.
pub const RESOURCE_VERSIONS: [&str; 3] = ["v1", "v1beta1", "v1beta2"];

/// Why a request body could not be answered with an AdmissionReview response.
#[derive(Debug, thiserror::Error)]
pub enum BadReview {
    /// The body is not JSON of the AdmissionReview shape.
    #[error("request body is not an AdmissionReview: {0}")]
    NotJson(#[from] serde_json::Error),
    /// `apiVersion` is not `admission.k8s.io/v1`.
    #[error(
        "apiVersion is {found:?}, expected \"admission.k8s.io/v1\" (register the webhook with admissionReviewVersions: [v1])"
    )]
    ApiVersion {
        /// The apiVersion found in the body.
        found: String,
    },
    /// `kind` is not `AdmissionReview`.
    #[error("kind is {found:?}, expected \"AdmissionReview\"")]
    Kind {
        /// The kind found in the body.
        found: String,
    },
    /// The review has no `request`.
    #[error("request: missing, an AdmissionReview sent to a webhook must carry a request")]
    MissingRequest,
    /// The request has an empty `uid`, which the response must echo.
    #[error("request.uid: must not be empty")]
    MissingUid,
}

/// The kind of object a review was about: one of ours (the api crate's kinds, served in
/// `resource.k8s.io` at a version we know) or `None`, allowed without inspection.
pub type ReviewedKind = Option<ObjectKind>;

/// The bounded metrics label of a [`ReviewedKind`].
pub fn kind_label(kind: ReviewedKind) -> &'static str {
    kind.map_or("other", ObjectKind::as_str)
}

fn classify(gvk: &GroupVersionKind) -> ReviewedKind {
    if gvk.group != RESOURCE_GROUP || !RESOURCE_VERSIONS.contains(&gvk.version.as_str()) {
        return None;
    }
    ObjectKind::from_kind(&gvk.kind)
}

/// What the webhook decided, as a bounded metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Inspected and allowed (possibly with warnings).
    Allowed,
    /// Inspected and denied.
    Denied,
    /// Not ours to inspect (other kind, operation or subresource): allowed untouched.
    Skipped,
}

impl Outcome {
    /// The label value used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
            Self::Skipped => "skipped",
        }
    }
}

/// One answered review: the serialized response plus what to count and log.
#[derive(Debug)]
pub struct Decision {
    /// The AdmissionReview response, serialized.
    pub body: Vec<u8>,
    /// The kind of the object under review.
    pub kind: ReviewedKind,
    /// The decision.
    pub outcome: Outcome,
    /// The request operation (`CREATE`, `UPDATE`, ...), for logs and metrics.
    pub operation: Operation,
    /// How many problems were found (0 unless denied).
    pub problems: usize,
    /// How many warnings were returned.
    pub warnings: usize,
}

/// The admission operation, as a bounded metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// CREATE.
    Create,
    /// UPDATE.
    Update,
    /// DELETE, CONNECT or anything unexpected.
    Other,
}

impl Operation {
    /// The label value used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
            Self::Other => "other",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "CREATE" => Self::Create,
            "UPDATE" => Self::Update,
            _ => Self::Other,
        }
    }
}

/// One problem of an object, with the full path of the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Field path from the object root, e.g. `spec.devices.config[0].opaque.parameters`.
    pub path: String,
    /// What is wrong and what would be valid.
    pub message: String,
}

/// What the validation found in one object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    /// Problems that make the object invalid.
    pub problems: Vec<Problem>,
    /// Legal but suspicious things, returned as admission warnings.
    pub warnings: Vec<String>,
    /// A short human name of the object (`ResourceClaim ns/name`), for the denial message.
    pub label: String,
}

/// An AdmissionReview around a request of shape `R` (each endpoint reads what it needs).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review<R> {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    request: Option<R>,
}

/// A request shape of an AdmissionReview: its `uid`, which the response must echo.
pub(crate) trait ReviewRequest: serde::de::DeserializeOwned {
    /// `request.uid`.
    fn uid(&self) -> &str;
}

impl ReviewRequest for Request {
    fn uid(&self) -> &str {
        &self.uid
    }
}

/// The request of an AdmissionReview `body`, after checking its envelope: `admission.k8s.io/v1`,
/// kind `AdmissionReview`, a request with a `uid`.
pub(crate) fn parse_review<R: ReviewRequest>(body: &[u8]) -> Result<R, BadReview> {
    let review: Review<R> = serde_json::from_slice(body)?;
    if review.api_version != ADMISSION_API_VERSION {
        return Err(BadReview::ApiVersion {
            found: review.api_version,
        });
    }
    if review.kind != "AdmissionReview" {
        return Err(BadReview::Kind { found: review.kind });
    }
    let request = review.request.ok_or(BadReview::MissingRequest)?;
    if request.uid().is_empty() {
        return Err(BadReview::MissingUid);
    }
    Ok(request)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    #[serde(default)]
    uid: String,
    kind: GroupVersionKind,
    #[serde(default)]
    sub_resource: String,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    object: Option<Value>,
}

#[derive(Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    kind: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResponseReview<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: Response<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Response<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status<'a>>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

/// A `meta/v1` Status, the shape the API server turns into the client's error.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Status<'a> {
    status: &'static str,
    message: String,
    reason: &'static str,
    code: u16,
    details: StatusDetails<'a>,
}

#[derive(Serialize)]
struct StatusDetails<'a> {
    causes: Vec<StatusCause<'a>>,
}

#[derive(Serialize)]
struct StatusCause<'a> {
    reason: &'static str,
    message: &'a str,
    field: &'a str,
}

/// Answers one AdmissionReview.
///
/// `check` is the validation applied to an inspected object (the server passes the `api`
/// crate's one validation; tests may pass their own).
pub fn review(body: &[u8], check: impl FnOnce(&Value) -> Findings) -> Result<Decision, BadReview> {
    let request: Request = parse_review(body)?;
    let kind = classify(&request.kind);
    let operation = Operation::parse(&request.operation);

    // Status updates (`resourceclaims/status`) are written by the scheduler and the kubelet
    // and carry no user config change worth re-validating.
    let inspect =
        kind.is_some() && operation != Operation::Other && request.sub_resource.is_empty();
    let object = match request.object {
        Some(mut object) if inspect && object.is_object() => {
            fill_type_meta(&mut object, &request.kind);
            Some(object)
        }
        _ => None,
    };
    let Some(object) = object else {
        return Ok(Decision {
            body: encode(&request.uid, true, None, &[]),
            kind,
            outcome: Outcome::Skipped,
            operation,
            problems: 0,
            warnings: 0,
        });
    };

    let findings = check(&object);
    let allowed = findings.problems.is_empty();
    let status = (!allowed).then(|| denial(&findings));
    Ok(Decision {
        body: encode(&request.uid, allowed, status, &findings.warnings),
        kind,
        outcome: if allowed {
            Outcome::Allowed
        } else {
            Outcome::Denied
        },
        operation,
        problems: findings.problems.len(),
        warnings: findings.warnings.len(),
    })
}

/// The API server serializes the object with its type meta, but a hand-written review may
/// not: fill it from `request.kind` so the validation always knows what it looks at.
fn fill_type_meta(object: &mut Value, gvk: &GroupVersionKind) {
    if let Some(map) = object.as_object_mut() {
        if !map.contains_key("apiVersion") {
            map.insert(
                "apiVersion".into(),
                Value::String(format!("{}/{}", gvk.group, gvk.version)),
            );
        }
        if !map.contains_key("kind") {
            map.insert("kind".into(), Value::String(gvk.kind.clone()));
        }
    }
}

fn denial(findings: &Findings) -> Status<'_> {
    let n = findings.problems.len();
    let mut message = format!(
        "{} is invalid ({n} problem{}): ",
        if findings.label.is_empty() {
            "object"
        } else {
            &findings.label
        },
        if n == 1 { "" } else { "s" }
    );
    for (i, p) in findings.problems.iter().enumerate() {
        if i > 0 {
            message.push_str("; ");
        }
        message.push_str(&p.path);
        message.push_str(": ");
        message.push_str(&p.message);
    }
    Status {
        status: "Failure",
        message,
        reason: "Invalid",
        code: 422,
        details: StatusDetails {
            causes: findings
                .problems
                .iter()
                .map(|p| StatusCause {
                    reason: "FieldValueInvalid",
                    message: &p.message,
                    field: &p.path,
                })
                .collect(),
        },
    }
}

/// An AdmissionReview response for `uid`: allowed, or denied with `message` under the HTTP
/// status `code` and Kubernetes `reason` (`Forbidden`, `ServiceUnavailable`, ...).
pub fn answer(uid: &str, denial: Option<(&str, u16, &'static str)>) -> Vec<u8> {
    let status = denial.map(|(message, code, reason)| Status {
        status: "Failure",
        message: message.to_string(),
        reason,
        code,
        details: StatusDetails { causes: Vec::new() },
    });
    encode(uid, status.is_none(), status, &[])
}

fn encode(uid: &str, allowed: bool, status: Option<Status<'_>>, warnings: &[String]) -> Vec<u8> {
    let review = ResponseReview {
        api_version: ADMISSION_API_VERSION,
        kind: "AdmissionReview",
        response: Response {
            uid,
            allowed,
            status,
            warnings,
        },
    };
    // Serializing plain structs of strings, bools and integers into a Vec cannot fail.
    serde_json::to_vec(&review).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(kind: &str, version: &str, operation: &str, object: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "resource.k8s.io", "version": version, "kind": kind},
                "resource": {"group": "resource.k8s.io", "version": version, "resource": "resourceclaims"},
                "operation": operation,
                "object": object,
            }
        }))
        .unwrap()
    }

    fn problem(path: &str, message: &str) -> Problem {
        Problem {
            path: path.into(),
            message: message.into(),
        }
    }

    fn response(d: &Decision) -> Value {
        let v: Value = serde_json::from_slice(&d.body).unwrap();
        assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(v["kind"], "AdmissionReview");
        assert_eq!(v["response"]["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        v["response"].clone()
    }

    #[test]
    fn denial_lists_every_problem_with_its_path() {
        let b = body("ResourceClaim", "v1", "CREATE", json!({"spec": {}}));
        let d = review(&b, |_| Findings {
            problems: vec![
                problem(
                    "spec.devices.config[0].opaque.parameters.sharing.strategy",
                    "bad",
                ),
                problem("spec.devices.config[1].opaque.parameters.kind", "worse"),
            ],
            warnings: vec![],
            label: "ResourceClaim default/c".into(),
        })
        .unwrap();
        assert_eq!(d.outcome, Outcome::Denied);
        assert_eq!(d.problems, 2);
        let r = response(&d);
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 422);
        assert_eq!(r["status"]["reason"], "Invalid");
        assert_eq!(
            r["status"]["message"],
            "ResourceClaim default/c is invalid (2 problems): \
             spec.devices.config[0].opaque.parameters.sharing.strategy: bad; \
             spec.devices.config[1].opaque.parameters.kind: worse"
        );
        assert_eq!(
            r["status"]["details"]["causes"][1]["field"],
            "spec.devices.config[1].opaque.parameters.kind"
        );
        assert!(r.get("warnings").is_none());
    }

    #[test]
    fn warnings_ride_on_an_allowed_response() {
        let b = body("DeviceClass", "v1beta2", "UPDATE", json!({"spec": {}}));
        let d = review(&b, |_| Findings {
            warnings: vec!["spec.config[0].requests[0]: names no request".into()],
            ..Findings::default()
        })
        .unwrap();
        assert_eq!(
            (d.kind, d.outcome, d.operation),
            (
                Some(ObjectKind::DeviceClass),
                Outcome::Allowed,
                Operation::Update
            )
        );
        let r = response(&d);
        assert_eq!(r["allowed"], true);
        assert!(r.get("status").is_none());
        assert_eq!(
            r["warnings"][0],
            "spec.config[0].requests[0]: names no request"
        );
    }

    #[test]
    fn type_meta_is_filled_from_the_request_kind() {
        let b = body(
            "ResourceClaimTemplate",
            "v1beta1",
            "CREATE",
            json!({"spec": {}}),
        );
        let mut seen = Value::Null;
        review(&b, |o| {
            seen = o.clone();
            Findings::default()
        })
        .unwrap();
        assert_eq!(seen["apiVersion"], "resource.k8s.io/v1beta1");
        assert_eq!(seen["kind"], "ResourceClaimTemplate");
    }

    #[test]
    fn other_kinds_operations_and_subresources_are_skipped_without_a_check() {
        let never = |_: &Value| -> Findings { panic!("must not be inspected") };
        for b in [
            body("Pod", "v1", "CREATE", json!({})),
            body("ResourceSlice", "v1", "CREATE", json!({})),
            body("ResourceClaim", "v1alpha3", "CREATE", json!({})),
            body("ResourceClaim", "v1", "DELETE", Value::Null),
            body("ResourceClaim", "v1", "CONNECT", json!({})),
        ] {
            let d = review(&b, never).unwrap();
            assert_eq!(d.outcome, Outcome::Skipped);
            assert_eq!(response(&d)["allowed"], true);
        }
        let mut v: Value =
            serde_json::from_slice(&body("ResourceClaim", "v1", "UPDATE", json!({}))).unwrap();
        v["request"]["subResource"] = json!("status");
        let d = review(&serde_json::to_vec(&v).unwrap(), never).unwrap();
        assert_eq!(d.outcome, Outcome::Skipped);
    }

    #[test]
    fn malformed_reviews_are_errors_with_clear_messages() {
        let cases: [(&[u8], &str); 6] = [
            (b"", "request body is not an AdmissionReview"),
            (b"{not json", "request body is not an AdmissionReview"),
            (
                br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview"}"#,
                "apiVersion is \"admission.k8s.io/v1beta1\"",
            ),
            (
                br#"{"apiVersion":"admission.k8s.io/v1","kind":"Pod"}"#,
                "kind is \"Pod\"",
            ),
            (
                br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
                "request: missing",
            ),
            (
                br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"","kind":{}}}"#,
                "request.uid: must not be empty",
            ),
        ];
        for (input, want) in cases {
            let err = review(input, |_| Findings::default()).unwrap_err();
            assert!(
                err.to_string().starts_with(want),
                "{input:?}: got {err}, want {want}"
            );
        }
    }
}
