//! Claims for tests: an allocated ResourceClaim in one call, and a claim source in memory.

use std::collections::HashMap;
use std::sync::RwLock;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

use crate::claims::{ClaimSource, ClaimSourceError};

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
