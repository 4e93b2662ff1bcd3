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

async fn fetch(ns: &str, name: &str) -> Result<Fetched, CliError> {
    let cluster = |what: String| move |source| CliError::Cluster { what, source };
    let client = kube::Client::try_default().await.map_err(cluster(
        "no cluster configuration (KUBECONFIG, ~/.kube/config or in-cluster)".into(),
    ))?;
    let claim = Api::<ResourceClaim>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(cluster(format!("cannot read ResourceClaim {ns}/{name}")))?;
    let lp = ListParams::default();
    let classes = Api::<DeviceClass>::all(client.clone())
        .list(&lp)
        .await
        .map_err(cluster("cannot list DeviceClasses".into()))?;
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&lp)
        .await
        .map_err(cluster("cannot list ResourceSlices".into()))?;
    let claims = Api::<ResourceClaim>::all(client)
        .list(&lp)
        .await
        .map_err(cluster("cannot list ResourceClaims".into()))?;
    Ok((
        serde_json::to_value(claim)?,
        to_values(classes.items)?,
        to_values(slices.items)?,
        to_values(claims.items)?,
    ))
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
