//! Where the plugin reads ResourceClaims: the API server in production, a file in process-level
//! tests (hidden `--claim-source-file`). The [`ClaimSource`] seam keeps prepare logic free of
//! the Kubernetes client, so unit tests use plain data instead of a fake API server
//! ([`MemoryClaims`], which `selftest` also uses: its claims are given in-process).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::RwLock;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

/// Errors reading claims.
#[derive(Debug, thiserror::Error)]
pub enum ClaimSourceError {
    /// The API server call failed.
    #[error("cannot get ResourceClaim {claim}: {source}")]
    Api {
        /// `namespace/name`.
        claim: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// The claims file could not be read.
    #[error("cannot read claims file {path}: {reason}")]
    File {
        /// Path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Reads ResourceClaims by namespace and name.
pub trait ClaimSource: Send + Sync {
    /// The claim, or `None` when it does not exist.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, ClaimSourceError>>;
}

/// Claims from the API server.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
}

impl KubeClaims {
    /// Uses the given client.
    pub fn new(client: kube::Client) -> Self {
        KubeClaims { client }
    }
}

impl ClaimSource for KubeClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, ClaimSourceError>> {
        Box::pin(async move {
            let api: kube::Api<ResourceClaim> =
                kube::Api::namespaced(self.client.clone(), namespace);
            api.get_opt(name)
                .await
                .map_err(|source| ClaimSourceError::Api {
                    claim: format!("{namespace}/{name}"),
                    source,
                })
        })
    }
}

/// Claims from a JSON file holding an array of ResourceClaims, re-read on every call, so a
/// test can change the "API server" between calls (hidden `--claim-source-file`).
pub struct FileClaims {
    path: PathBuf,
}

impl FileClaims {
    /// Reads from `path`.
    pub fn new(path: PathBuf) -> Self {
        FileClaims { path }
    }
}

impl ClaimSource for FileClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, ClaimSourceError>> {
        Box::pin(async move {
            let err = |reason: String| ClaimSourceError::File {
                path: self.path.clone(),
                reason,
            };
            let bytes = match tokio::fs::read(&self.path).await {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(err(e.to_string())),
            };
            let claims: Vec<ResourceClaim> =
                serde_json::from_slice(&bytes).map_err(|e| err(e.to_string()))?;
            Ok(claims.into_iter().find(|c| {
                c.metadata.namespace.as_deref() == Some(namespace)
                    && c.metadata.name.as_deref() == Some(name)
            }))
        })
    }
}

/// An allocated ResourceClaim with `devices` as `(request, device)` results of `driver` in
/// pool `pool`, plus the given opaque `configs` (`(source, requests, parameters)`).
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    devices: &[(&str, &str)],
    configs: &[(&str, &[&str], serde_json::Value)],
) -> ResourceClaim {
    let results: Vec<_> = devices
        .iter()
        .map(|(request, device)| {
            json!({"request": request, "driver": driver, "pool": pool, "device": device})
        })
        .collect();
    let config: Vec<_> = configs
        .iter()
        .map(|(source, requests, parameters)| {
            json!({"source": source, "requests": requests,
                   "opaque": {"driver": driver, "parameters": parameters}})
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap_or_default()
}

/// Claims held in memory: the [`ClaimSource`] of tests and benchmarks, changed between calls
/// as the API server would be.
#[derive(Default)]
pub struct MemoryClaims {
    claims: RwLock<HashMap<(String, String), ResourceClaim>>,
}

impl MemoryClaims {
    /// Adds or replaces a claim (keyed by its namespace and name).
    pub fn insert(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        if let Ok(mut map) = self.claims.write() {
            map.insert(key, claim);
        }
    }

    /// Removes a claim.
    pub fn remove(&self, namespace: &str, name: &str) {
        if let Ok(mut map) = self.claims.write() {
            map.remove(&(namespace.to_owned(), name.to_owned()));
        }
    }
}

impl ClaimSource for MemoryClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, ClaimSourceError>> {
        let found = self
            .claims
            .read()
            .ok()
            .and_then(|m| m.get(&(namespace.to_owned(), name.to_owned())).cloned());
        Box::pin(async move { Ok(found) })
    }
}
