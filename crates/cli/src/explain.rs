//! `gpu-dra explain`: fetches a claim, the DeviceClasses, the ResourceSlices and every claim,
//! and hands them to the pure [`gpu_dra_selectors::explain`]; prints its answer for people or
//! as JSON for tools, followed by the devices the node plugin prepared for the claim as its
//! `status.devices` tells ([`prepared_devices`]: UUID, MIG profile, memory share). Only reads
//! from the API server.

use std::io::Write;

use clap::{Args, ValueEnum};
use gpu_dra_api::device_status::{DeviceStatusData, READY_CONDITION};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;
use serde::Serialize;
use serde_json::Value;

use crate::{CliError, Outcome};

/// `gpu-dra explain` arguments.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The ResourceClaim: `namespace/name`, or `name` in `--namespace`.
    #[arg(value_name = "CLAIM")]
    pub claim: String,
    /// Namespace of a claim given without one.
    #[arg(short, long, env = "CLAIM_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Driver whose devices are considered.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(short, long, env = "OUTPUT_FORMAT", value_enum, default_value_t = Format::Text)]
    pub output: Format,
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// For people: per request its selectors, then per node each device's verdict.
    Text,
    /// The same as one JSON object, for tools.
    Json,
}

/// A device of a claim as the node plugin reported it in the claim's `status.devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// Pool (node) of the device.
    pub pool: String,
    /// Device name in the pool.
    pub device: String,
    /// Share ID of the allocation, for a shared device.
    #[serde(rename = "shareID", skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// What the device is; `None` when the entry carries no data of ours.
    pub data: Option<DeviceStatusData>,
    /// The `Ready` condition is `True`.
    pub ready: bool,
}

/// The entries of `driver` in `claim`'s `status.devices`, in their order.
pub fn prepared_devices(claim: &ResourceClaim, driver: &str) -> Vec<PreparedDevice> {
    claim
        .status
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .filter(|d| d.driver == driver)
        .map(|d| PreparedDevice {
            pool: d.pool.clone(),
            device: d.device.clone(),
            share_id: d.share_id.clone(),
            data: d
                .data
                .as_ref()
                .and_then(|raw| DeviceStatusData::from_value(&raw.0)),
            ready: d
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == READY_CONDITION && c.status == "True"),
        })
        .collect()
}

/// The lines people read for `devices` (nothing when there are none).
pub fn prepared_devices_text(devices: &[PreparedDevice]) -> String {
    if devices.is_empty() {
        return String::new();
    }
    let mut text = String::from("Prepared devices (the claim's status.devices):\n");
    for d in devices {
        let what = d
            .data
            .as_ref()
            .map_or_else(|| "no device data".to_owned(), DeviceStatusData::summary);
        let ready = if d.ready { "Ready" } else { "not Ready" };
        text.push_str(&format!("  {}/{}: {what}, {ready}\n", d.pool, d.device));
    }
    text
}

/// `(namespace, name)` of `claim` (`ns/name` or `name`).
pub fn claim_ref<'a>(claim: &'a str, namespace: &'a str) -> (&'a str, &'a str) {
    claim.split_once('/').unwrap_or((namespace, claim))
}

/// Runs `gpu-dra explain`.
pub fn run(args: &ExplainArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let (ns, name) = claim_ref(&args.claim, &args.namespace);
    let (claim, classes, slices, claims) = runtime.block_on(fetch(ns, name))?;
    let explanation =
        gpu_dra_selectors::explain(&claim, &classes, &slices, &claims, &args.driver_name);
    let prepared = serde_json::from_value::<ResourceClaim>(claim.clone())
        .map(|c| prepared_devices(&c, &args.driver_name))
        .unwrap_or_default();
    match args.output {
        Format::Text => write!(
            out,
            "{}{}",
            explanation.to_text(),
            prepared_devices_text(&prepared)
        )?,
        Format::Json => {
            let mut value = serde_json::to_value(&explanation)?;
            if let Value::Object(map) = &mut value {
                map.insert("preparedDevices".into(), serde_json::to_value(&prepared)?);
            }
            serde_json::to_writer_pretty(&mut *out, &value)?;
            writeln!(out)?;
        }
    }
    Ok(Outcome::Valid)
}

type Fetched = (Value, Vec<Value>, Vec<Value>, Vec<Value>);

/// Makes ring the process's TLS provider, whatever features other crates of a build turn on in
/// rustls: with two providers compiled in (a workspace build unifies them) rustls cannot pick
/// one, and building the first TLS client panics.
pub(crate) fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A client from the usual places (`KUBECONFIG`, `~/.kube/config`, in-cluster).
pub(crate) async fn cluster_client() -> Result<kube::Client, CliError> {
    install_tls_provider();
    kube::Client::try_default()
        .await
        .map_err(|source| CliError::Cluster {
            what: "no cluster configuration (KUBECONFIG, ~/.kube/config or in-cluster)".into(),
            source,
        })
}

async fn fetch(ns: &str, name: &str) -> Result<Fetched, CliError> {
    let cluster = |what: String| move |source| CliError::Cluster { what, source };
    let client = cluster_client().await?;
    let claim = Api::<ResourceClaim>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(cluster(format!("cannot read ResourceClaim {ns}/{name}")))?;
    let classes = list_all::<DeviceClass>(&client, "DeviceClasses").await?;
    let (slices, claims) = slices_and_claims(&client).await?;
    Ok((
        serde_json::to_value(claim)?,
        to_values(classes)?,
        to_values(slices)?,
        to_values(claims)?,
    ))
}

/// Every object of a cluster-wide kind (`what` names it in errors).
async fn list_all<K>(client: &kube::Client, what: &str) -> Result<Vec<K>, CliError>
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    Ok(Api::<K>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| CliError::Cluster {
            what: format!("cannot list {what}"),
            source,
        })?
        .items)
}

/// Every ResourceSlice and every ResourceClaim of the cluster.
pub(crate) async fn slices_and_claims(
    client: &kube::Client,
) -> Result<(Vec<ResourceSlice>, Vec<ResourceClaim>), CliError> {
    let slices = list_all::<ResourceSlice>(client, "ResourceSlices").await?;
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| CliError::Cluster {
            what: "cannot list ResourceClaims".into(),
            source,
        })?
        .items;
    Ok((slices, claims))
}

fn to_values<T: serde::Serialize>(items: Vec<T>) -> Result<Vec<Value>, serde_json::Error> {
    items.iter().map(serde_json::to_value).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tls_client_is_built_whatever_providers_the_build_compiled_in() {
        // A workspace build compiles rustls with ring and aws-lc-rs (another member's
        // dependency asks for it): without a provider chosen, this panics there.
        install_tls_provider();
        let config = kube::Config::new("https://127.0.0.1:1".parse().expect("uri"));
        assert!(kube::Client::try_from(config).is_ok());
    }

    #[test]
    fn prepared_devices_are_read_from_our_drivers_status_entries() {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "c"},
            "spec": {},
            "status": {"devices": [
                {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0-mig-1g5gb-19-0",
                 "data": {"uuid": "MIG-1", "type": "mig", "profile": "1g.5gb", "parentUUID": "GPU-0"},
                 "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                                 "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
                {"driver": "net.example.com", "pool": "node-a", "device": "nic-0",
                 "data": {"uuid": "not ours"}},
                {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"}
            ]}
        }))
        .expect("claim");
        let devices = prepared_devices(&claim, "gpu.nvidia.com");
        assert_eq!(devices.len(), 2);
        assert!(devices[0].ready && !devices[1].ready);
        assert_eq!(devices[1].data, None);
        assert_eq!(
            prepared_devices_text(&devices),
            "Prepared devices (the claim's status.devices):\n  \
             node-a/gpu-0-mig-1g5gb-19-0: MIG-1 (1g.5gb of GPU-0), Ready\n  \
             node-a/gpu-1: no device data, not Ready\n"
        );
        assert_eq!(prepared_devices_text(&[]), "");
    }

    #[test]
    fn claims_are_named_with_or_without_a_namespace() {
        assert_eq!(claim_ref("ns/c", "default"), ("ns", "c"));
        assert_eq!(claim_ref("c", "other"), ("other", "c"));
    }
}
