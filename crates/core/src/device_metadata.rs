//! Device metadata for workloads (Kubernetes KEP-5304): a JSON file per claim request that
//! tells the containers using the claim which devices they got, with the attributes this node
//! publishes for them.
//!
//! Kubernetes defines the file and where containers find it; DRA drivers written in Go get
//! both from the kubelet-plugin helper library (`k8s.io/dynamic-resource-allocation`), which
//! this driver does not use, so this module builds the same document and the plugin writes it
//! and mounts it through the claim's CDI spec. The facts of that format, as the upstream Go
//! types (`api/metadata/v1beta1` of that module, release 0.37) define them:
//! - one object of kind `DeviceMetadata`, group `metadata.resource.k8s.io`; the JSON field
//!   names are `kind`, `apiVersion`, `metadata` (an ObjectMeta: the claim's `name`,
//!   `namespace`, `uid`, and `generation`, 1 for a file written once), `podClaimName` (only
//!   for a claim made from a template: its name in the pod spec, from the claim's annotation
//!   `resource.kubernetes.io/pod-claim-name`) and `requests`; a request has `name` (the
//!   allocated request, `<request>/<subrequest>` for a subrequest) and `devices`; a device
//!   has `driver`, `pool`, `name`, `attributes` (qualified name -> attribute value, exactly
//!   as in a ResourceSlice: `string`, `int`, `bool`, `version`, or the list forms `strings`,
//!   `ints`, ...) and `networkData` (network devices only: never written here);
//! - a file is a stream of that object encoded once per API version, newest first, each
//!   followed by a newline, so that a consumer takes the first version it knows
//!   ([`VERSIONS`]: `v1beta1`, the version of Kubernetes 1.37, and `v1alpha1`, the only one
//!   Kubernetes 1.36's consumers read; the two have the same fields);
//! - one file per request of the claim, holding that request only, at
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`
//!   for a claim the pod names, and under `resourceclaimtemplates/<pod claim name>/...` for
//!   one made from a template (its own name is generated, the pod's name for it is not):
//!   [`container_path`]. The request folder is the request's name without a subrequest.
//!
//! What the attributes are: those the node's ResourceSlices publish for the device, rendered
//! by [`crate::slices`] (and [`crate::list_forms`] when the plugin publishes list forms), so a
//! workload reads the values the scheduler matched. One difference, on purpose: a dynamic MIG
//! device is published as a placement without a `uuid` (its instance does not exist before
//! the claim is prepared); its file carries the attributes of the instance created for the
//! claim, the placement's plus that `uuid`.
//!
//! Pure: the plugin decides where the files live on the host, writes them and mounts them.

use std::collections::BTreeMap;

use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::{DeviceAttribute, ResourceClaim};
use serde::{Deserialize, Serialize};

use crate::list_forms::{self, ListValue};
use crate::plan::{ClaimInput, base_request};
use crate::slices;
use crate::topology::NvlinkDomains;

/// API group of the document.
pub const GROUP: &str = "metadata.resource.k8s.io";
/// API versions written into every file, newest first.
pub const VERSIONS: &[&str] = &["v1beta1", "v1alpha1"];
/// Kind of the document.
pub const KIND: &str = "DeviceMetadata";
/// The folder in containers under which the files are mounted.
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// Sub-folder for claims the pod names (`resourceClaimName`), by claim name.
pub const RESOURCE_CLAIMS_DIR: &str = "resourceclaims";
/// Sub-folder for claims made from a template, by the pod's name for the claim.
pub const RESOURCE_CLAIM_TEMPLATES_DIR: &str = "resourceclaimtemplates";
/// Appended to the driver name to name a file.
pub const FILE_SUFFIX: &str = "-metadata.json";
/// Annotation the ResourceClaim controller sets on a claim it made from a template: the
/// pod's name for the claim (`spec.resourceClaims[].name`).
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// `metadata.generation` of a file: written once at prepare and never updated (updates are
/// for network data that becomes known after the pod's sandbox starts; GPUs have none).
pub const GENERATION: i64 = 1;

/// Why a claim's metadata cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// The claim's pod claim name annotation is not a name a container path can be made of.
    #[error(
        "metadata.annotations[{POD_CLAIM_NAME_ANNOTATION}]: {value:?} is not a DNS label (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit); it names the claim's device metadata folder in its containers, and the ResourceClaim controller always sets a valid one: remove or correct the annotation"
    )]
    PodClaimName {
        /// The annotation's value.
        value: String,
    },
}

/// One `DeviceMetadata` object (one API version of it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceMetadata {
    /// [`KIND`].
    pub kind: String,
    /// `metadata.resource.k8s.io/<version>`.
    pub api_version: String,
    /// The claim.
    pub metadata: ClaimMeta,
    /// The pod's name for a claim made from a template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_claim_name: Option<String>,
    /// The request of the file (one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<MetadataRequest>,
}

/// The part of an ObjectMeta the file carries: the claim's identity and the file's generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimMeta {
    /// Claim name.
    pub name: String,
    /// Claim namespace.
    pub namespace: String,
    /// Claim UID.
    pub uid: String,
    /// [`GENERATION`].
    pub generation: i64,
}

/// One request of the claim and its devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetadataRequest {
    /// The request as allocated (`<request>/<subrequest>` for a subrequest).
    pub name: String,
    /// Its devices on this node from this driver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<MetadataDevice>,
}

/// One allocated device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetadataDevice {
    /// DRA driver name.
    pub driver: String,
    /// Pool (the node name).
    pub pool: String,
    /// Device name in the pool.
    pub name: String,
    /// Attribute name (as published: unqualified names are the driver's) -> value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, AttributeValue>,
}

/// An attribute value as a ResourceSlice spells it: one scalar, or one list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AttributeValue {
    /// `{"strings": [...]}`, `{"ints": [...]}`.
    List(ListValue),
    /// `{"string": ...}`, `{"int": ...}`, `{"bool": ...}`, `{"version": ...}`.
    Scalar(DeviceAttribute),
}

/// How devices are rendered into a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rendering<'a> {
    /// DRA driver name (`gpu.nvidia.com`): each device's `driver` and the file name.
    pub driver: &'a str,
    /// Pool name (the node name).
    pub pool: &'a str,
    /// Whether the node publishes the list forms of attributes ([`crate::list_forms`]).
    pub list_forms: bool,
}

/// The file of one request of a claim.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFile {
    /// The request's name without a subrequest: the file's folder in containers.
    pub request: String,
    /// Where containers find the file ([`container_path`]).
    pub container_path: String,
    /// The document, in the newest version ([`encode`] writes every version).
    pub document: DeviceMetadata,
}

impl RequestFile {
    /// The file's content: [`encode`] of its document.
    pub fn content(&self) -> Vec<u8> {
        encode(&self.document)
    }
}

/// The file's content: `document` once per version of [`VERSIONS`], newest first, each
/// object indented and followed by a newline.
pub fn encode(document: &DeviceMetadata) -> Vec<u8> {
    let mut out = Vec::new();
    for version in VERSIONS {
        let mut doc = document.clone();
        doc.api_version = format!("{GROUP}/{version}");
        // Plain data with string keys: serializing cannot fail.
        out.extend(serde_json::to_vec_pretty(&doc).unwrap_or_default());
        out.push(b'\n');
    }
    out
}

/// Where containers find the file of request `request` (without subrequest) of claim
/// `claim_name`, by the pod's name for the claim when it was made from a template.
pub fn container_path(
    driver: &str,
    claim_name: &str,
    pod_claim_name: Option<&str>,
    request: &str,
) -> String {
    let (dir, name) = match pod_claim_name {
        Some(pod_name) => (RESOURCE_CLAIM_TEMPLATES_DIR, pod_name),
        None => (RESOURCE_CLAIMS_DIR, claim_name),
    };
    format!("{CONTAINER_DIR}/{dir}/{name}/{request}/{driver}{FILE_SUFFIX}")
}

/// The pod's name for a claim made from a template (its [`POD_CLAIM_NAME_ANNOTATION`]);
/// `None` for a claim without it (or with an empty one), which the pod names itself.
pub fn pod_claim_name(claim: &ResourceClaim) -> Result<Option<String>, MetadataError> {
    let Some(value) = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION))
        .filter(|v| !v.is_empty())
    else {
        return Ok(None);
    };
    if !is_dns_label(value) {
        return Err(MetadataError::PodClaimName {
            value: value.clone(),
        });
    }
    Ok(Some(value.clone()))
}

/// RFC 1123 label: what Kubernetes requires of a pod's claim names.
fn is_dns_label(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| alnum(c) || c == '-')
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

/// The attributes of device `device` of `inventory` as the node publishes them (see the module
/// doc); `None` when the inventory has no such device.
pub fn attributes(
    inventory: &Inventory,
    device: &str,
    list_forms: bool,
) -> Option<BTreeMap<String, AttributeValue>> {
    let found = inventory.device(device)?;
    // What is left out of a slice (with a warning the publisher logs) is left out here too.
    let mut ignored = Vec::new();
    let scalars = slices::render_device(inventory, found, &mut ignored)
        .attributes
        .unwrap_or_default();
    let lists = if list_forms {
        list_forms::device_lists(&scalars, &NvlinkDomains::of(inventory))
    } else {
        BTreeMap::new()
    };
    let mut out: BTreeMap<String, AttributeValue> = scalars
        .into_iter()
        .map(|(k, v)| (k, AttributeValue::Scalar(v)))
        .collect();
    out.extend(lists.into_iter().map(|(k, l)| (k, AttributeValue::List(l))));
    Some(out)
}

/// The files of a claim: one per request with devices of ours in `claim`, in allocation order,
/// each with that request's devices and their attributes in `inventory` (the one the claim is
/// prepared against).
pub fn request_files(
    claim: &ClaimInput,
    pod_claim_name: Option<&str>,
    inventory: &Inventory,
    rendering: Rendering<'_>,
) -> Vec<RequestFile> {
    let mut files: Vec<RequestFile> = Vec::new();
    for allocated in &claim.devices {
        let base = base_request(&allocated.request);
        let device = MetadataDevice {
            driver: rendering.driver.to_owned(),
            pool: rendering.pool.to_owned(),
            name: allocated.device.clone(),
            attributes: attributes(inventory, &allocated.device, rendering.list_forms)
                .unwrap_or_default(),
        };
        if let Some(file) = files.iter_mut().find(|f| f.request == base) {
            if let Some(request) = file.document.requests.first_mut() {
                request.devices.push(device);
            }
            continue;
        }
        files.push(RequestFile {
            request: base.to_owned(),
            container_path: container_path(rendering.driver, &claim.name, pod_claim_name, base),
            document: DeviceMetadata {
                kind: KIND.to_owned(),
                api_version: format!("{GROUP}/{}", VERSIONS[0]),
                metadata: ClaimMeta {
                    name: claim.name.clone(),
                    namespace: claim.namespace.clone(),
                    uid: claim.uid.clone(),
                    generation: GENERATION,
                },
                pod_claim_name: pod_claim_name.map(str::to_owned),
                requests: vec![MetadataRequest {
                    name: allocated.request.clone(),
                    devices: vec![device],
                }],
            },
        });
    }
    files
}

/// The objects of a file's content, in stream order (for readers and tests).
pub fn decode(content: &[u8]) -> Result<Vec<DeviceMetadata>, serde_json::Error> {
    serde_json::Deserializer::from_slice(content)
        .into_iter::<DeviceMetadata>()
        .collect()
}

#[cfg(test)]
mod tests {
    use gpu_dra_device::testing::{a100, a100_inventory, inventory};

    use super::*;
    use crate::plan::AllocatedDevice;

    const DRIVER: &str = "gpu.nvidia.com";
    const NODE: &str = "node-1";

    fn rendering(list_forms: bool) -> Rendering<'static> {
        Rendering {
            driver: DRIVER,
            pool: NODE,
            list_forms,
        }
    }

    fn claim(results: &[(&str, &str)]) -> ClaimInput {
        ClaimInput {
            uid: "uid-1".into(),
            namespace: "team-a".into(),
            name: "train".into(),
            devices: results
                .iter()
                .enumerate()
                .map(|(index, (request, device))| AllocatedDevice {
                    index,
                    request: (*request).into(),
                    device: (*device).into(),
                    admin_access: false,
                    share_id: None,
                    consumed_memory: None,
                    consumed_shares: None,
                })
                .collect(),
            configs: Vec::new(),
        }
    }

    fn string(s: &str) -> AttributeValue {
        AttributeValue::Scalar(DeviceAttribute {
            string: Some(s.into()),
            ..DeviceAttribute::default()
        })
    }

    /// The document the upstream encoder wrote into `testdata/device-metadata-upstream.json`
    /// (the Go metadata scheme of `k8s.io/dynamic-resource-allocation` 0.37, pretty JSON
    /// serializer, versions v1beta1 then v1alpha1), built with our types.
    fn upstream_sample() -> DeviceMetadata {
        let attrs = [
            (
                "driverVersion",
                AttributeValue::Scalar(DeviceAttribute {
                    version: Some("580.82.7".into()),
                    ..DeviceAttribute::default()
                }),
            ),
            (
                "nvlinkDomain",
                AttributeValue::List(ListValue::Strings(vec!["a".into(), "b".into()])),
            ),
            (
                "resource.kubernetes.io/numaNode",
                AttributeValue::Scalar(DeviceAttribute {
                    int: Some(0),
                    ..DeviceAttribute::default()
                }),
            ),
            ("uuid", string("GPU-0")),
        ];
        DeviceMetadata {
            kind: KIND.into(),
            api_version: String::new(),
            metadata: ClaimMeta {
                name: "train-gpu-x7k2p".into(),
                namespace: "team-a".into(),
                uid: "3f1c2a9e-7d4b-4c1e-9a2f-5b6c7d8e9f01".into(),
                generation: 1,
            },
            pod_claim_name: Some("gpu".into()),
            requests: vec![MetadataRequest {
                name: "gpus/a100".into(),
                devices: vec![MetadataDevice {
                    driver: DRIVER.into(),
                    pool: NODE.into(),
                    name: "gpu-0".into(),
                    attributes: attrs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
                }],
            }],
        }
    }

    #[test]
    fn the_stream_is_byte_for_byte_what_the_upstream_encoder_writes() {
        let upstream = include_bytes!("../testdata/device-metadata-upstream.json");
        let ours = encode(&upstream_sample());
        assert_eq!(
            String::from_utf8_lossy(&ours),
            String::from_utf8_lossy(upstream)
        );
        let objects = decode(upstream).expect("upstream stream decodes");
        assert_eq!(
            objects
                .iter()
                .map(|o| o.api_version.as_str())
                .collect::<Vec<_>>(),
            [
                "metadata.resource.k8s.io/v1beta1",
                "metadata.resource.k8s.io/v1alpha1"
            ]
        );
        for o in objects {
            assert_eq!(
                DeviceMetadata {
                    api_version: String::new(),
                    ..o
                },
                upstream_sample()
            );
        }
    }

    #[test]
    fn field_names_are_those_of_the_upstream_types() {
        let json = serde_json::to_value(upstream_sample()).expect("json");
        let keys = |v: &serde_json::Value| -> Vec<String> {
            v.as_object().expect("object").keys().cloned().collect()
        };
        let mut top = keys(&json);
        top.sort();
        assert_eq!(
            top,
            ["apiVersion", "kind", "metadata", "podClaimName", "requests"]
        );
        let mut meta = keys(&json["metadata"]);
        meta.sort();
        assert_eq!(meta, ["generation", "name", "namespace", "uid"]);
        assert_eq!(keys(&json["requests"][0]), ["name", "devices"]);
        assert_eq!(
            keys(&json["requests"][0]["devices"][0]),
            ["driver", "pool", "name", "attributes"]
        );
    }

    #[test]
    fn container_paths_follow_the_kubernetes_layout() {
        assert_eq!(
            container_path(DRIVER, "shared", None, "gpu"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/shared/gpu/gpu.nvidia.com-metadata.json"
        );
        assert_eq!(
            container_path(DRIVER, "pod-x-gpu-abcde", Some("gpu"), "gpus"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpus/gpu.nvidia.com-metadata.json"
        );
    }

    #[test]
    fn one_file_per_request_with_its_devices_and_their_published_attributes() {
        let inv = a100_inventory(2, 1);
        let c = claim(&[
            ("mig", "gpu-0-mig-1g5gb-19-0"),
            ("whole/a100", "gpu-1"),
            ("mig", "gpu-0-mig-1g5gb-19-1"),
        ]);
        let files = request_files(&c, None, &inv, rendering(false));
        assert_eq!(
            files.iter().map(|f| f.request.as_str()).collect::<Vec<_>>(),
            ["mig", "whole"]
        );
        let (published, _) = slices::render_devices(&inv);
        let published_attrs = |name: &str| -> BTreeMap<String, AttributeValue> {
            published
                .iter()
                .find(|d| d.name == name)
                .and_then(|d| d.attributes.clone())
                .expect("published")
                .into_iter()
                .map(|(k, v)| (k, AttributeValue::Scalar(v)))
                .collect()
        };
        let mig = &files[0].document;
        assert_eq!(mig.requests.len(), 1);
        assert_eq!(mig.requests[0].name, "mig");
        let names: Vec<&str> = mig.requests[0]
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names, ["gpu-0-mig-1g5gb-19-0", "gpu-0-mig-1g5gb-19-1"]);
        for d in &mig.requests[0].devices {
            assert_eq!((d.driver.as_str(), d.pool.as_str()), (DRIVER, NODE));
            assert_eq!(d.attributes, published_attrs(&d.name));
        }
        let first = &mig.requests[0].devices[0].attributes;
        assert_eq!(first["profile"], string("1g.5gb"));
        assert_eq!(
            first["uuid"],
            string(inv.device("gpu-0-mig-1g5gb-19-0").expect("mig").uuid())
        );
        // The subrequest stays in the content; the folder is the request's.
        let whole = &files[1];
        assert_eq!(whole.document.requests[0].name, "whole/a100");
        assert!(
            whole
                .container_path
                .ends_with("/resourceclaims/train/whole/gpu.nvidia.com-metadata.json"),
            "{}",
            whole.container_path
        );
        assert_eq!(
            whole.document.requests[0].devices[0].attributes,
            published_attrs("gpu-1")
        );
        assert_eq!(
            whole.document.metadata,
            ClaimMeta {
                name: "train".into(),
                namespace: "team-a".into(),
                uid: "uid-1".into(),
                generation: 1
            }
        );
        assert_eq!(whole.document.pod_claim_name, None);
    }

    #[test]
    fn list_forms_are_written_as_the_slices_publish_them() {
        let inv = inventory([
            a100(0)
                .uuid("GPU-a")
                .nvlink_peers(&["GPU-b"])
                .numa_node(Some(1))
                .build(),
            a100(1).uuid("GPU-b").nvlink_peers(&["GPU-a"]).build(),
        ]);
        let scalar = attributes(&inv, "gpu-0", false).expect("gpu-0");
        assert!(matches!(
            scalar["nvlinkDomain"],
            AttributeValue::Scalar(DeviceAttribute {
                string: Some(_),
                ..
            })
        ));
        let lists = attributes(&inv, "gpu-0", true).expect("gpu-0");
        assert_eq!(
            lists["resource.kubernetes.io/numaNode"],
            AttributeValue::List(ListValue::Ints(vec![1]))
        );
        let mut params_rendered = slices::render_slices(
            &inv,
            &slices::SliceParams {
                node_name: NODE,
                driver_name: DRIVER,
                generation: 1,
            },
        );
        list_forms::apply(
            &mut params_rendered,
            &inv,
            &slices::SliceParams {
                node_name: NODE,
                driver_name: DRIVER,
                generation: 1,
            },
        );
        let published = list_forms::lists_of(&params_rendered.slices[0]).expect("lists");
        for (name, list) in &published["gpu-0"] {
            assert_eq!(lists[name], AttributeValue::List(list.clone()), "{name}");
        }
        assert_eq!(lists.len(), scalar.len());
        // Every other attribute is the scalar one.
        for (name, value) in &scalar {
            if !published["gpu-0"].contains_key(name) {
                assert_eq!(&lists[name], value, "{name}");
            }
        }
        // And it round-trips through the file's encoding.
        let c = claim(&[("gpu", "gpu-0")]);
        let file = &request_files(&c, Some("gpu"), &inv, rendering(true))[0];
        let back = decode(&file.content()).expect("decodes");
        assert_eq!(back.len(), VERSIONS.len());
        assert_eq!(back[0].requests[0].devices[0].attributes, lists);
        assert_eq!(back[0].pod_claim_name.as_deref(), Some("gpu"));
    }

    #[test]
    fn the_pod_claim_name_comes_from_the_annotation_and_must_be_a_dns_label() {
        let with = |value: Option<&str>| {
            let mut rc = ResourceClaim::default();
            if let Some(v) = value {
                rc.metadata.annotations = Some(
                    [(POD_CLAIM_NAME_ANNOTATION.to_owned(), v.to_owned())]
                        .into_iter()
                        .collect(),
                );
            }
            pod_claim_name(&rc)
        };
        assert_eq!(with(None).expect("none"), None);
        assert_eq!(with(Some("")).expect("empty"), None);
        assert_eq!(
            with(Some("gpu-1")).expect("valid").as_deref(),
            Some("gpu-1")
        );
        for bad in ["../etc", "GPU", "a/b", "-a", &"a".repeat(64)] {
            let err = with(Some(bad)).expect_err(bad).to_string();
            assert!(
                err.starts_with("metadata.annotations[resource.kubernetes.io/pod-claim-name]: "),
                "{err}"
            );
        }
    }
}
