//! Opaque configuration API of the GPU DRA driver: `GpuConfig` and `MigDeviceConfig`.
//!
//! This crate is the one validation used everywhere: the admission webhook, the node plugin
//! and the `gpu-dra` CLI all call [`decode`] (and the node also [`validate_for_devices`]), so
//! a configuration the webhook admits is one the node can apply. It does no I/O.
//!
//! - [`decode`] / [`decode_yaml`]: strict decoding of `opaque.parameters`, defaults,
//!   normalization and every static rule, reporting all problems with field paths.
//! - [`validate_for_devices`]: the rules that depend on the allocated devices.
//! - [`objects`]: finds and checks our configs inside ResourceClaims, ResourceClaimTemplates
//!   and DeviceClasses of any `resource.k8s.io` version.
//! - [`quantity`]: exact Kubernetes quantities.
//! - [`yaml`]: YAML documents with one-line positioned errors.
//! - [`json_schema`]: the JSON Schema of both kinds (committed under `api/schema/`).
//! - [`device_status`]: the `data` the node plugin writes into a claim's `status.devices`.
//!
//! Private modules behind those: `config` (the two kinds and their decoding walk), `error`
//! (field-path errors, collected all at once), `allocation` (the rules that need the
//! allocated devices), `schema` (schema-only mirror types for [`json_schema`]).

mod allocation;
mod config;
pub mod device_status;
mod error;
pub mod objects;
pub mod quantity;
mod schema;
pub mod yaml;

pub use allocation::{
    ClaimDevice, MULTI_USER_MIN_COMPUTE_CAPABILITY, admin_access_sharing, two_mps_configs_message,
    validate_for_devices,
};
pub use config::{
    API_VERSIONS, ApiVersion, Config, ConfigKind, DeviceKey, GpuConfig, INTERVALS, Interval, KINDS,
    MIN_PINNED_MEMORY_BYTES, MigDeviceConfig, MpsConfig, STRATEGIES, Sharing,
    pinned_memory_limit_mib, sorted_uuids,
};
pub use error::{Errors, FieldError, did_you_mean, suggest};
pub use schema::json_schema;

/// Decodes, defaults and validates the `opaque.parameters` of one configuration.
///
/// Unknown fields, wrong types, a missing or unknown `apiVersion`/`kind` and every broken
/// rule are reported together; paths in the errors are relative to `parameters`.
pub fn decode(parameters: &serde_json::Value) -> Result<Config, Errors> {
    config::decode_value(parameters)
}

/// [`decode`] for a configuration written as a single YAML (or JSON) document.
pub fn decode_yaml(text: &str) -> Result<Config, Errors> {
    let value = yaml::from_str(text)
        .map_err(|e| Errors::from(FieldError::new("", format!("invalid YAML: {e}"))))?;
    decode(&value)
}

#[cfg(test)]
mod tests;
