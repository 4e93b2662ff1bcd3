//! `gpu-dra explain`: fetches a claim, the DeviceClasses, the ResourceSlices and every claim,
//! and hands them to the pure [`gpu_dra_selectors::explain`]; prints its answer for people or
//! as JSON for tools. Only reads from the API server.

use std::io::Write;

use clap::{Args, ValueEnum};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;
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
    match args.output {
        Format::Text => write!(out, "{}", explanation.to_text())?,
        Format::Json => {
            serde_json::to_writer_pretty(&mut *out, &explanation)?;
            writeln!(out)?;
        }
    }
    Ok(Outcome::Valid)
}

type Fetched = (Value, Vec<Value>, Vec<Value>, Vec<Value>);

/// A client from the usual places (`KUBECONFIG`, `~/.kube/config`, in-cluster).
pub(crate) async fn cluster_client() -> Result<kube::Client, CliError> {
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

    #[test]
    fn claims_are_named_with_or_without_a_namespace() {
        assert_eq!(claim_ref("ns/c", "default"), ("ns", "c"));
        assert_eq!(claim_ref("c", "other"), ("other", "c"));
    }
}
