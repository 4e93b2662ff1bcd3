//! JSON Schema of the two configuration kinds.
//!
//! Generated with schemars from schema-only mirror types of the wire shape (decoding itself
//! is the hand-written walk in `config`, which can say more than a schema can). Rules a schema
//! cannot express (`timeSlicingConfig` only with `TimeSlicing`, limits of at least 1Mi) are
//! stated in the descriptions. The committed copy lives in `api/schema/` and a test keeps it
//! fresh.

use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, generate::SchemaSettings, json_schema};
use serde_json::{Value, json};

/// Kubernetes quantity syntax with no negative sign (limits must be positive); exponents are
/// integers.
const QUANTITY_PATTERN: &str =
    r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$";

const UUID: &str = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";

fn device_key_pattern() -> String {
    format!(
        "^(0|[1-9][0-9]*|GPU-{UUID}|MIG-{UUID}|MIG-GPU-{UUID}/(0|[1-9][0-9]{{0,8}})/(0|[1-9][0-9]{{0,8}}))$"
    )
}

/// Memory limit as MPS takes it.
fn memory_limit(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "Kubernetes quantity (e.g. \"5Gi\", \"512Mi\", \"1e9\"). Must be positive \
            and at least 1Mi. The value is rounded up to whole bytes, then DOWN to whole MiB, \
            which is the unit MPS takes (set_default_device_pinned_mem_limit <uuid> <N>M).",
        "x-kubernetes-int-or-string": true,
        "anyOf": [
            {"type": "integer", "minimum": 1_048_576},
            {"type": "string", "pattern": QUANTITY_PATTERN}
        ]
    })
}

/// [`memory_limit`] for an optional field: `null` means not set.
fn optional_memory_limit(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = memory_limit(generator);
    if let Some(Value::Array(any_of)) = schema.get_mut("anyOf") {
        any_of.push(json!({"type": "null"}));
    }
    schema
}

fn per_device_limits(generator: &mut SchemaGenerator) -> Schema {
    let item = memory_limit(generator);
    json_schema!({
        "description": "Per-device pinned memory limits, overriding defaultPinnedDeviceMemoryLimit. \
            Keys: a device index (\"0\", \"1\", ...; decimal, no sign, no leading zeros), the \
            position among the UUIDs of the devices the config applies to, sorted (as NVIDIA's \
            driver counts), or a device UUID (GPU-<uuid>, MIG-<uuid>, or legacy \
            MIG-GPU-<uuid>/<gi>/<ci>). Indexes must be below the config's device count and UUIDs \
            among its devices (checked when devices are allocated).",
        "type": ["object", "null"],
        "propertyNames": {"pattern": device_key_pattern()},
        "additionalProperties": item
    })
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
enum ApiVersion {
    #[serde(rename = "resource.nvidia.com/v1beta1")]
    ResourceV1beta1,
    #[serde(rename = "gpu.nvidia.com/v1alpha1")]
    GpuV1alpha1,
}

/// Configuration for full GPUs (opaque parameters of a device config for this driver).
#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(rename = "GpuConfig", rename_all = "camelCase", deny_unknown_fields)]
struct GpuConfigSchema {
    /// Either version; both carry the same schema.
    api_version: ApiVersion,
    kind: GpuKind,
    /// How the allocated GPUs are shared. Absent: exclusive use, nothing applied.
    sharing: Option<GpuSharing>,
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
enum GpuKind {
    GpuConfig,
}

/// Configuration for MIG devices.
#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(
    rename = "MigDeviceConfig",
    rename_all = "camelCase",
    deny_unknown_fields
)]
struct MigDeviceConfigSchema {
    /// Either version; both carry the same schema.
    api_version: ApiVersion,
    kind: MigKind,
    /// How the allocated MIG devices are shared. Absent: exclusive use, nothing applied.
    sharing: Option<MigSharing>,
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
enum MigKind {
    MigDeviceConfig,
}

/// Sharing of a full GPU. timeSlicingConfig is only allowed with strategy TimeSlicing and
/// mpsConfig only with strategy MPS.
#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(rename = "GpuSharing", rename_all = "camelCase", deny_unknown_fields)]
struct GpuSharing {
    strategy: Strategy,
    /// Only with strategy TimeSlicing. Absent or empty: interval Default.
    time_slicing_config: Option<TimeSlicingConfig>,
    /// Only with strategy MPS. Absent: MPS defaults.
    mps_config: Option<MpsConfig>,
}

/// Sharing of a MIG device. MIG devices have no time-slice setting, so there is no
/// timeSlicingConfig; mpsConfig is only allowed with strategy MPS.
#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(
    rename = "MigDeviceSharing",
    rename_all = "camelCase",
    deny_unknown_fields
)]
struct MigSharing {
    strategy: Strategy,
    /// Only with strategy MPS. Absent: MPS defaults.
    mps_config: Option<MpsConfig>,
}

/// Sharing strategy, spelled exactly.
#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
enum Strategy {
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TimeSlicingConfig {
    /// Time-slice length (nvidia-smi compute-policy --set-timeslice 0..3). Absent: Default.
    interval: Option<Interval>,
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
enum Interval {
    Default,
    Short,
    Medium,
    Long,
}

#[allow(dead_code)] // schema only
#[derive(JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MpsConfig {
    /// Default active thread percentage of MPS clients, 1..=100 (MPS rejects 0).
    #[schemars(range(min = 1, max = 100))]
    default_active_thread_percentage: Option<i64>,
    /// Pinned device memory limit for every device of the claim: a Kubernetes quantity
    /// (e.g. "5Gi", "512Mi", "1e9"), positive and at least 1Mi. The value is rounded up to
    /// whole bytes, then DOWN to whole MiB, which is the unit MPS takes
    /// (set_default_device_pinned_mem_limit <uuid> <N>M).
    #[serde(default)]
    #[schemars(schema_with = "optional_memory_limit")]
    default_pinned_device_memory_limit: Option<String>,
    #[serde(default)]
    #[schemars(schema_with = "per_device_limits")]
    default_per_device_pinned_memory_limit: Option<BTreeMap<String, String>>,
    /// Run the claim's MPS control daemon multi-user (nvidia-cuda-mps-control -d -M): clients
    /// of every user share one MPS server. Without it, a client of another user than the
    /// running server's waits until that server exits. Needs compute capability 7.0 (Volta)
    /// or newer. Absent: false.
    multi_user: Option<bool>,
}

/// The JSON Schema (draft 2020-12) accepting a `GpuConfig` or a `MigDeviceConfig`.
pub fn json_schema() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .for_deserialize()
        .into_generator();
    let gpu = generator.subschema_for::<GpuConfigSchema>();
    let mig = generator.subschema_for::<MigDeviceConfigSchema>();
    let defs = generator.take_definitions(true);
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "GPU DRA driver opaque device configuration",
        "description": "The opaque.parameters of a device config for the gpu.nvidia.com driver: \
            a GpuConfig (full GPUs) or a MigDeviceConfig (MIG devices), under apiVersion \
            resource.nvidia.com/v1beta1 or gpu.nvidia.com/v1alpha1.",
        "oneOf": [gpu, mig],
        "$defs": defs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA_FILE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schema/opaque-config.schema.json"
    );

    #[test]
    fn generated_schema_is_fresh() {
        let fresh = serde_json::to_string_pretty(&json_schema()).unwrap() + "\n";
        if std::env::var_os("UPDATE_GENERATED").is_some_and(|v| v == "1") {
            std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/schema")).unwrap();
            std::fs::write(SCHEMA_FILE, &fresh).unwrap();
            return;
        }
        let committed = std::fs::read_to_string(SCHEMA_FILE).unwrap_or_default();
        assert!(
            committed == fresh,
            "{SCHEMA_FILE} is stale; run `make generate` (UPDATE_GENERATED=1 cargo test \
             generated_) and commit the result"
        );
    }

    #[test]
    fn only_identity_and_strategy_are_required() {
        let schema = json_schema();
        let required = |def: &str| schema["$defs"][def]["required"].clone();
        assert_eq!(required("GpuConfig"), json!(["apiVersion", "kind"]));
        assert_eq!(required("MigDeviceConfig"), json!(["apiVersion", "kind"]));
        assert_eq!(required("GpuSharing"), json!(["strategy"]));
        assert_eq!(required("MigDeviceSharing"), json!(["strategy"]));
        for optional in ["MpsConfig", "TimeSlicingConfig"] {
            assert_eq!(required(optional), Value::Null, "{optional}");
        }
        let mps = &schema["$defs"]["MpsConfig"]["properties"];
        let limit = mps["defaultPinnedDeviceMemoryLimit"].to_string();
        assert!(
            limit.contains("DOWN to whole MiB") && limit.contains("null"),
            "{limit}"
        );
    }

    #[test]
    fn schema_states_the_rules_it_cannot_express() {
        let text = json_schema().to_string();
        for needle in [
            "DOWN to whole MiB",
            "at least 1Mi",
            "1..=100",
            "only allowed with strategy TimeSlicing",
            "propertyNames",
            "resource.nvidia.com/v1beta1",
            "gpu.nvidia.com/v1alpha1",
            "\"additionalProperties\":false",
        ] {
            assert!(text.contains(needle), "schema lacks {needle:?}");
        }
    }
}
