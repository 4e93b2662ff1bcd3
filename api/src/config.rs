//! The opaque configuration kinds, `GpuConfig` and `MigDeviceConfig`, and their decoding.
//!
//! Decoding is a hand-written walk over `serde_json::Value` rather than serde derive, for two
//! reasons: it reports every problem at once (serde stops at the first), and each message can
//! name the field path and say what would be valid. The walk produces the *normalized* types
//! below, so callers never see the wire shape and never re-apply defaults:
//!
//! - no `sharing`: exclusive use, nothing to apply ([`Config::sharing`] is `None`);
//! - `TimeSlicing` without `timeSlicingConfig` (or with `{}`): interval [`Interval::Default`];
//! - `MPS` without `mpsConfig`: an empty [`MpsConfig`] (MPS defaults for everything);
//! - memory limits become whole MiB, rounded down, as `nvidia-cuda-mps-control` takes them.
//!
//! Invariant: a [`Config`] returned by [`crate::decode`] always passes [`Config::validate`].

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value};

use crate::error::{Errors, did_you_mean, join, one_of};
use crate::quantity::{Quantity, QuantityError};

/// `apiVersion` values accepted for both kinds (same schema under each).
pub const API_VERSIONS: [&str; 2] = ["resource.nvidia.com/v1beta1", "gpu.nvidia.com/v1alpha1"];
/// `kind` values.
pub const KINDS: [&str; 2] = ["GpuConfig", "MigDeviceConfig"];
/// `sharing.strategy` values.
pub const STRATEGIES: [&str; 2] = ["TimeSlicing", "MPS"];
/// `sharing.timeSlicingConfig.interval` values.
pub const INTERVALS: [&str; 4] = ["Default", "Short", "Medium", "Long"];

/// Smallest accepted MPS pinned memory limit, in bytes (1Mi).
pub const MIN_PINNED_MEMORY_BYTES: u64 = 1 << 20;

const TOP_FIELDS: [&str; 3] = ["apiVersion", "kind", "sharing"];
const GPU_SHARING_FIELDS: [&str; 3] = ["strategy", "timeSlicingConfig", "mpsConfig"];
const MIG_SHARING_FIELDS: [&str; 2] = ["strategy", "mpsConfig"];
const TIME_SLICING_FIELDS: [&str; 1] = ["interval"];
const MPS_FIELDS: [&str; 4] = [
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
];

/// Which API group/version the configuration was written against. Both carry the same schema;
/// the older one is what earlier talks and documents show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiVersion {
    /// `resource.nvidia.com/v1beta1` (current upstream form).
    ResourceNvidiaComV1beta1,
    /// `gpu.nvidia.com/v1alpha1` (older form).
    GpuNvidiaComV1alpha1,
}

impl ApiVersion {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ResourceNvidiaComV1beta1 => API_VERSIONS[0],
            Self::GpuNvidiaComV1alpha1 => API_VERSIONS[1],
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "resource.nvidia.com/v1beta1" => Some(Self::ResourceNvidiaComV1beta1),
            "gpu.nvidia.com/v1alpha1" => Some(Self::GpuNvidiaComV1alpha1),
            _ => None,
        }
    }
}

/// Which of the two kinds a configuration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigKind {
    /// `GpuConfig`: for full GPUs.
    Gpu,
    /// `MigDeviceConfig`: for MIG devices.
    Mig,
}

impl ConfigKind {
    /// The wire spelling of `kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => KINDS[0],
            Self::Mig => KINDS[1],
        }
    }
}

impl fmt::Display for ConfigKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decoded, defaulted and validated opaque configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Config {
    /// `kind: GpuConfig`.
    Gpu(GpuConfig),
    /// `kind: MigDeviceConfig`.
    Mig(MigDeviceConfig),
}

/// Configuration for full GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    /// The version it was written against.
    pub api_version: ApiVersion,
    /// How the allocated GPUs are shared; `None` = exclusive use.
    pub sharing: Option<Sharing>,
}

/// Configuration for MIG devices. Its sharing never carries a time-slice interval: MIG
/// devices have no time-slice setting, so `TimeSlicing` here means the default behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDeviceConfig {
    /// The version it was written against.
    pub api_version: ApiVersion,
    /// How the allocated MIG devices are shared; `None` = exclusive use.
    pub sharing: Option<Sharing>,
}

/// Normalized sharing settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sharing {
    /// Time slicing between the containers that share the device. For a full GPU the node
    /// sets the interval with `nvidia-smi compute-policy --set-timeslice`; for a MIG device
    /// (always [`Interval::Default`]) there is nothing to set.
    TimeSlicing {
        /// The time-slice length.
        interval: Interval,
    },
    /// An MPS control daemon shared by the containers.
    Mps(MpsConfig),
}

/// Time-slice length (`sharing.timeSlicingConfig.interval`). Serializes as its wire spelling
/// (`"Default"`, `"Short"`, ...), which is how the node plugin persists it.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub enum Interval {
    /// The driver's default.
    #[default]
    Default,
    /// Short slices.
    Short,
    /// Medium slices.
    Medium,
    /// Long slices.
    Long,
}

impl Interval {
    /// The value `nvidia-smi compute-policy --set-timeslice` takes (Default 0, Short 1,
    /// Medium 2, Long 3).
    pub fn as_nvidia_smi_value(self) -> u8 {
        match self {
            Self::Default => 0,
            Self::Short => 1,
            Self::Medium => 2,
            Self::Long => 3,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        INTERVALS[usize::from(self.as_nvidia_smi_value())]
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "Default" => Some(Self::Default),
            "Short" => Some(Self::Short),
            "Medium" => Some(Self::Medium),
            "Long" => Some(Self::Long),
            _ => None,
        }
    }
}

/// Normalized MPS settings. Memory limits are whole MiB (rounded down from the quantity the
/// user wrote, never below 1), the unit `set_default_device_pinned_mem_limit <uuid> <N>M` takes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MpsConfig {
    /// `set_default_active_thread_percentage`, 1..=100; `None` = MPS default (100).
    pub active_thread_percentage: Option<u8>,
    /// Pinned device memory limit for every device the config applies to, in MiB.
    pub pinned_memory_limit_mib: Option<u64>,
    /// Per-device overrides of the limit, in MiB, keyed by device index or UUID (see
    /// [`DeviceKey`] for what an index names).
    pub per_device_pinned_memory_limit_mib: BTreeMap<DeviceKey, u64>,
    /// `multiUser`: the control daemon runs multi-user (`nvidia-cuda-mps-control -d -M`), so
    /// clients of every uid share one server instead of waiting for another user's server to
    /// exit. Needs compute capability 7.0 or newer (checked against the allocated devices by
    /// [`crate::validate_for_devices`]). NVIDIA's `mpsConfig.multiUser`, same meaning.
    pub multi_user: bool,
}

/// A key of `defaultPerDevicePinnedMemoryLimit`.
///
/// An index follows NVIDIA's driver (`MpsPerDevicePinnedMemoryLimit.Normalize` over the
/// device group's `UUIDs()`): it names a device by its position among the UUIDs of the
/// devices the config applies to, sorted, not by allocation order. So a config moved from
/// NVIDIA's driver limits the same GPU here. [`DeviceKey::resolve`] is the one place that
/// applies the rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceKey {
    /// Position of the device among the sorted UUIDs of the config's devices (`"0"`, `"1"`, ...).
    Index(u32),
    /// A device UUID: `GPU-<uuid>`, `MIG-<uuid>` or legacy `MIG-GPU-<uuid>/<gi>/<ci>`.
    Uuid(String),
}

impl DeviceKey {
    /// What a key may look like, for messages.
    pub const EXPECTED: &'static str = "a device index (\"0\", \"1\", ...: the position among \
        the config's device UUIDs sorted; decimal, no sign, no leading zeros) or a device UUID (\"GPU-<8-4-4-4-12 hex>\", \
        \"MIG-<8-4-4-4-12 hex>\" or \"MIG-GPU-<8-4-4-4-12 hex>/<gi>/<ci>\")";

    /// Parses a key, saying what is wrong with a malformed one.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid device key {s:?}: expected {}", Self::EXPECTED);
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            if s.len() > 1 && s.starts_with('0') {
                return Err(bad());
            }
            return s
                .parse()
                .map(Self::Index)
                .map_err(|_| format!("device index {s} is out of range: at most {}", u32::MAX));
        }
        let well_formed = if let Some(rest) = s.strip_prefix("MIG-GPU-") {
            let mut parts = rest.split('/');
            let uuid_ok = parts.next().is_some_and(is_uuid);
            let gi_ok = parts.next().is_some_and(is_small_decimal);
            let ci_ok = parts.next().is_some_and(is_small_decimal);
            uuid_ok && gi_ok && ci_ok && parts.next().is_none()
        } else if let Some(rest) = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("MIG-")) {
            is_uuid(rest)
        } else {
            false
        };
        if well_formed {
            Ok(Self::Uuid(s.to_owned()))
        } else {
            Err(bad())
        }
    }
}

impl DeviceKey {
    /// The device this key names among `uuids` (the devices the config applies to, in any
    /// order): its position in `uuids`. A UUID key matches whatever the case; an index key
    /// counts in the UUIDs sorted (byte order, as Go's `slices.Sort`). `None`: no such device.
    pub fn resolve<S: AsRef<str>>(&self, uuids: &[S]) -> Option<usize> {
        match self {
            Self::Uuid(u) => uuids
                .iter()
                .position(|d| d.as_ref().eq_ignore_ascii_case(u)),
            Self::Index(i) => {
                let wanted = *sorted_uuids(uuids).get(*i as usize)?;
                uuids.iter().position(|d| d.as_ref() == wanted)
            }
        }
    }
}

/// The UUIDs sorted as NVIDIA's driver sorts a device group's UUIDs: what an index key of
/// `defaultPerDevicePinnedMemoryLimit` counts in.
pub fn sorted_uuids<S: AsRef<str>>(uuids: &[S]) -> Vec<&str> {
    let mut sorted: Vec<&str> = uuids.iter().map(AsRef::as_ref).collect();
    sorted.sort_unstable();
    sorted
}

impl fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Index(i) => write!(f, "{i}"),
            Self::Uuid(u) => f.write_str(u),
        }
    }
}

/// `8-4-4-4-12` hexadecimal digits.
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn is_small_decimal(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 9
        && s.bytes().all(|b| b.is_ascii_digit())
        && (s == "0" || !s.starts_with('0'))
}

impl Config {
    /// The kind.
    pub fn kind(&self) -> ConfigKind {
        match self {
            Self::Gpu(_) => ConfigKind::Gpu,
            Self::Mig(_) => ConfigKind::Mig,
        }
    }

    /// The version it was written against.
    pub fn api_version(&self) -> ApiVersion {
        match self {
            Self::Gpu(c) => c.api_version,
            Self::Mig(c) => c.api_version,
        }
    }

    /// The normalized sharing settings; `None` = exclusive use, nothing to apply.
    pub fn sharing(&self) -> Option<&Sharing> {
        match self {
            Self::Gpu(c) => c.sharing.as_ref(),
            Self::Mig(c) => c.sharing.as_ref(),
        }
    }

    /// The canonical wire form: `decode(&c.to_parameters()) == Ok(c)` for every valid `c`.
    /// Defaults are written out (`interval: Default`) and limits are whole MiB (`"1536Mi"`),
    /// so two configs that mean the same produce the same JSON (useful for checkpoints and
    /// for comparing what was applied).
    pub fn to_parameters(&self) -> Value {
        let mut obj = Map::new();
        obj.insert("apiVersion".into(), self.api_version().as_str().into());
        obj.insert("kind".into(), self.kind().as_str().into());
        let sharing = match self.sharing() {
            None => None,
            Some(Sharing::TimeSlicing { interval }) if self.kind() == ConfigKind::Gpu => {
                Some(serde_json::json!({
                    "strategy": "TimeSlicing",
                    "timeSlicingConfig": {"interval": interval.as_str()},
                }))
            }
            Some(Sharing::TimeSlicing { .. }) => {
                Some(serde_json::json!({"strategy": "TimeSlicing"}))
            }
            Some(Sharing::Mps(mps)) => {
                let mut m = Map::new();
                if let Some(p) = mps.active_thread_percentage {
                    m.insert("defaultActiveThreadPercentage".into(), p.into());
                }
                if let Some(mib) = mps.pinned_memory_limit_mib {
                    m.insert(
                        "defaultPinnedDeviceMemoryLimit".into(),
                        format!("{mib}Mi").into(),
                    );
                }
                if !mps.per_device_pinned_memory_limit_mib.is_empty() {
                    let per: Map<String, Value> = mps
                        .per_device_pinned_memory_limit_mib
                        .iter()
                        .map(|(k, mib)| (k.to_string(), format!("{mib}Mi").into()))
                        .collect();
                    m.insert("defaultPerDevicePinnedMemoryLimit".into(), per.into());
                }
                // Written only when set, so configs without it keep the canonical form they
                // had before the field existed (checkpoints compare it).
                if mps.multi_user {
                    m.insert("multiUser".into(), true.into());
                }
                Some(serde_json::json!({"strategy": "MPS", "mpsConfig": m}))
            }
        };
        if let Some(sharing) = sharing {
            obj.insert("sharing".into(), sharing);
        }
        Value::Object(obj)
    }

    /// Checks the rules that a normalized value can still break when built in code rather
    /// than decoded: thread percentage 1..=100, limits at least 1 MiB, well-formed per-device
    /// keys, no time-slice interval on a MIG device configuration.
    pub fn validate(&self) -> Result<(), Errors> {
        let mut errs = Errors::new();
        match self.sharing() {
            None => {}
            Some(Sharing::TimeSlicing { interval })
                if self.kind() == ConfigKind::Mig && *interval != Interval::Default =>
            {
                errs.push(
                    "sharing.timeSlicingConfig",
                    "not supported in MigDeviceConfig: MIG devices have no time-slice setting",
                );
            }
            Some(Sharing::TimeSlicing { .. }) => {}
            Some(Sharing::Mps(mps)) => {
                let base = "sharing.mpsConfig";
                if let Some(p) = mps.active_thread_percentage
                    && !(1..=100).contains(&p)
                {
                    errs.push(
                        join(base, "defaultActiveThreadPercentage"),
                        percentage_message(&p.to_string()),
                    );
                }
                if mps.pinned_memory_limit_mib == Some(0) {
                    errs.push(
                        join(base, "defaultPinnedDeviceMemoryLimit"),
                        "must be at least 1 MiB",
                    );
                }
                for (key, mib) in &mps.per_device_pinned_memory_limit_mib {
                    let path = format!("{base}.defaultPerDevicePinnedMemoryLimit[{key}]");
                    if *mib == 0 {
                        errs.push(path.clone(), "must be at least 1 MiB");
                    }
                    if let DeviceKey::Uuid(u) = key
                        && let Err(msg) = DeviceKey::parse(u)
                    {
                        errs.push(path, msg);
                    }
                }
            }
        }
        errs.into_result(())
    }
}

fn percentage_message(got: &str) -> String {
    // 0 is the value users reach for to mean "no limit"; MPS itself refuses it.
    if got
        .trim_start_matches('-')
        .trim_start_matches('0')
        .is_empty()
    {
        format!("{got} is out of range 1..=100 (MPS rejects 0)")
    } else {
        format!("{got} is out of range 1..=100")
    }
}

/// Short description of a JSON value for "got ..." messages.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) if s.chars().count() > 40 => {
            let short: String = s.chars().take(40).collect();
            format!("string {short:?}...")
        }
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// Decodes, defaults and validates; paths in errors are relative to `v`.
pub(crate) fn decode_value(v: &Value) -> Result<Config, Errors> {
    let mut errs = Errors::new();
    let config = walk_config(v, &mut errs);
    match config {
        Some(c) if errs.is_empty() => {
            // Belt and braces: the walk enforces every rule already.
            c.validate()?;
            Ok(c)
        }
        _ => {
            if errs.is_empty() {
                errs.push("", "invalid configuration");
            }
            Err(errs)
        }
    }
}

fn walk_config(v: &Value, errs: &mut Errors) -> Option<Config> {
    let Some(obj) = v.as_object() else {
        errs.push(
            "",
            format!(
                "must be an object with apiVersion, kind and sharing, got {}",
                describe(v)
            ),
        );
        return None;
    };
    unknown_fields(obj, "", &TOP_FIELDS, errs);
    let api_version = match obj.get("apiVersion") {
        None => {
            errs.push(
                "apiVersion",
                format!("required: one of {}", one_of(&API_VERSIONS)),
            );
            None
        }
        Some(Value::String(s)) => {
            let parsed = ApiVersion::parse(s);
            if parsed.is_none() {
                errs.push(
                    "apiVersion",
                    format!(
                        "unknown apiVersion {s:?}; {}valid: {}",
                        did_you_mean(s, &API_VERSIONS),
                        one_of(&API_VERSIONS)
                    ),
                );
            }
            parsed
        }
        Some(other) => {
            errs.push(
                "apiVersion",
                format!(
                    "must be a string ({}), got {}",
                    one_of(&API_VERSIONS),
                    describe(other)
                ),
            );
            None
        }
    };
    let kind = match obj.get("kind") {
        None => {
            errs.push("kind", format!("required: one of {}", one_of(&KINDS)));
            None
        }
        Some(Value::String(s)) => {
            let parsed = match s.as_str() {
                "GpuConfig" => Some(ConfigKind::Gpu),
                "MigDeviceConfig" => Some(ConfigKind::Mig),
                _ => None,
            };
            if parsed.is_none() {
                errs.push(
                    "kind",
                    format!(
                        "unknown kind {s:?}; {}valid: {}",
                        did_you_mean(s, &KINDS),
                        one_of(&KINDS)
                    ),
                );
            }
            parsed
        }
        Some(other) => {
            errs.push(
                "kind",
                format!(
                    "must be a string ({}), got {}",
                    one_of(&KINDS),
                    describe(other)
                ),
            );
            None
        }
    };
    // With an unknown kind, judge the body by the GpuConfig rules: they allow everything the
    // MigDeviceConfig rules do, so no error is invented, and real ones still show.
    let sharing = walk_sharing(obj.get("sharing"), kind.unwrap_or(ConfigKind::Gpu), errs);
    let api_version = api_version?;
    Some(match kind? {
        ConfigKind::Gpu => Config::Gpu(GpuConfig {
            api_version,
            sharing,
        }),
        ConfigKind::Mig => Config::Mig(MigDeviceConfig {
            api_version,
            sharing,
        }),
    })
}

fn unknown_fields(obj: &Map<String, Value>, base: &str, allowed: &[&str], errs: &mut Errors) {
    for key in obj.keys() {
        if !allowed.contains(&key.as_str()) {
            unknown_field(key, base, allowed, errs);
        }
    }
}

fn unknown_field(key: &str, base: &str, allowed: &[&str], errs: &mut Errors) {
    errs.push(
        join(base, key),
        format!(
            "unknown field; {}valid fields here: {}",
            did_you_mean(key, allowed),
            allowed.join(", ")
        ),
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Strategy {
    TimeSlicing,
    Mps,
}

fn walk_sharing(v: Option<&Value>, kind: ConfigKind, errs: &mut Errors) -> Option<Sharing> {
    const BASE: &str = "sharing";
    let obj = match v {
        None | Some(Value::Null) => return None,
        Some(Value::Object(o)) => o,
        Some(other) => {
            errs.push(
                BASE,
                format!(
                    "must be an object with strategy ({}), got {}",
                    one_of(&STRATEGIES),
                    describe(other)
                ),
            );
            return None;
        }
    };
    match kind {
        ConfigKind::Gpu => unknown_fields(obj, BASE, &GPU_SHARING_FIELDS, errs),
        ConfigKind::Mig => {
            for key in obj.keys() {
                if key == "timeSlicingConfig" {
                    errs.push(
                        "sharing.timeSlicingConfig",
                        "not supported in MigDeviceConfig: MIG devices have no time-slice \
                         setting; remove it (strategy TimeSlicing alone is allowed)",
                    );
                } else if !MIG_SHARING_FIELDS.contains(&key.as_str()) {
                    unknown_field(key, BASE, &MIG_SHARING_FIELDS, errs);
                }
            }
        }
    }
    let strategy = match obj.get("strategy") {
        None | Some(Value::Null) => {
            errs.push(
                "sharing.strategy",
                format!("required: one of {}", one_of(&STRATEGIES)),
            );
            None
        }
        Some(Value::String(s)) => match s.as_str() {
            "TimeSlicing" => Some(Strategy::TimeSlicing),
            "MPS" => Some(Strategy::Mps),
            _ => {
                errs.push(
                    "sharing.strategy",
                    format!(
                        "unknown strategy {s:?}; {}valid: {}",
                        did_you_mean(s, &STRATEGIES),
                        one_of(&STRATEGIES)
                    ),
                );
                None
            }
        },
        Some(other) => {
            errs.push(
                "sharing.strategy",
                format!(
                    "must be a string ({}), got {}",
                    one_of(&STRATEGIES),
                    describe(other)
                ),
            );
            None
        }
    };
    let mut interval = Interval::Default;
    if kind == ConfigKind::Gpu
        && let Some(tsc) = obj.get("timeSlicingConfig").filter(|v| !v.is_null())
    {
        interval = walk_time_slicing(tsc, errs);
        if strategy == Some(Strategy::Mps) {
            errs.push(
                "sharing.timeSlicingConfig",
                "only allowed with strategy \"TimeSlicing\", but strategy is \"MPS\"; \
                 remove it or change the strategy",
            );
        }
    }
    let mut mps = MpsConfig::default();
    if let Some(m) = obj.get("mpsConfig").filter(|v| !v.is_null()) {
        mps = walk_mps(m, errs);
        if strategy == Some(Strategy::TimeSlicing) {
            errs.push(
                "sharing.mpsConfig",
                "only allowed with strategy \"MPS\", but strategy is \"TimeSlicing\"; \
                 remove it or change the strategy",
            );
        }
    }
    match strategy? {
        Strategy::TimeSlicing => Some(Sharing::TimeSlicing { interval }),
        Strategy::Mps => Some(Sharing::Mps(mps)),
    }
}

fn walk_time_slicing(v: &Value, errs: &mut Errors) -> Interval {
    const BASE: &str = "sharing.timeSlicingConfig";
    let Some(obj) = v.as_object() else {
        errs.push(
            BASE,
            format!(
                "must be an object with an optional interval ({}), got {}",
                one_of(&INTERVALS),
                describe(v)
            ),
        );
        return Interval::Default;
    };
    unknown_fields(obj, BASE, &TIME_SLICING_FIELDS, errs);
    let path = "sharing.timeSlicingConfig.interval";
    match obj.get("interval") {
        None | Some(Value::Null) => Interval::Default,
        Some(Value::String(s)) => Interval::parse(s).unwrap_or_else(|| {
            errs.push(
                path,
                format!(
                    "unknown interval {s:?}; {}valid: {}",
                    did_you_mean(s, &INTERVALS),
                    one_of(&INTERVALS)
                ),
            );
            Interval::Default
        }),
        Some(other) => {
            errs.push(
                path,
                format!(
                    "must be a string ({}), got {}",
                    one_of(&INTERVALS),
                    describe(other)
                ),
            );
            Interval::Default
        }
    }
}

fn walk_mps(v: &Value, errs: &mut Errors) -> MpsConfig {
    const BASE: &str = "sharing.mpsConfig";
    let mut mps = MpsConfig::default();
    let Some(obj) = v.as_object() else {
        errs.push(
            BASE,
            format!(
                "must be an object with optional {}, got {}",
                MPS_FIELDS.join(", "),
                describe(v)
            ),
        );
        return mps;
    };
    unknown_fields(obj, BASE, &MPS_FIELDS, errs);

    let path = "sharing.mpsConfig.defaultActiveThreadPercentage";
    match obj.get("defaultActiveThreadPercentage") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) => match n.as_i64() {
            Some(p) if (1..=100).contains(&p) => mps.active_thread_percentage = Some(p as u8),
            Some(p) => errs.push(path, percentage_message(&p.to_string())),
            None if n.as_u64().is_some() => errs.push(path, percentage_message(&n.to_string())),
            None => errs.push(
                path,
                format!("must be a whole number 1..=100, got number {n}"),
            ),
        },
        Some(other) => errs.push(
            path,
            format!("must be a whole number 1..=100, got {}", describe(other)),
        ),
    }

    let path = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit";
    if let Some(q) = obj
        .get("defaultPinnedDeviceMemoryLimit")
        .filter(|v| !v.is_null())
    {
        mps.pinned_memory_limit_mib = memory_limit_mib(q, path, errs);
    }

    let base = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit";
    match obj.get("defaultPerDevicePinnedMemoryLimit") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (key, q) in map {
                let path = format!("{base}[{key}]");
                let parsed = DeviceKey::parse(key);
                if let Err(msg) = &parsed {
                    errs.push(path.clone(), msg.clone());
                }
                let mib = memory_limit_mib(q, &path, errs);
                if let (Ok(key), Some(mib)) = (parsed, mib) {
                    mps.per_device_pinned_memory_limit_mib.insert(key, mib);
                }
            }
        }
        Some(other) => errs.push(
            base,
            format!(
                "must be a map from device index or UUID to a memory quantity, got {}",
                describe(other)
            ),
        ),
    }

    match obj.get("multiUser") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => mps.multi_user = *b,
        Some(other) => errs.push(
            "sharing.mpsConfig.multiUser",
            format!("must be true or false, got {}", describe(other)),
        ),
    }
    mps
}

/// Converts a memory limit as MPS takes it: a positive Kubernetes quantity, rounded up to
/// whole bytes, then DOWN to whole MiB; below 1Mi is an error (MPS would get `0M`).
pub fn pinned_memory_limit_mib(q: &Quantity) -> Result<u64, String> {
    if q.is_negative() || q.is_zero() {
        return Err(format!("{q} must be positive (at least 1Mi)"));
    }
    match q.to_bytes_ceil() {
        Ok(bytes) if bytes < MIN_PINNED_MEMORY_BYTES => Err(format!(
            "{q} is below the minimum 1Mi: MPS takes pinned memory limits in whole MiB"
        )),
        Ok(bytes) => Ok(bytes >> 20),
        Err(QuantityError::Overflow(_)) => {
            Err(format!("{q} is too large: at most {} bytes", u64::MAX))
        }
        Err(e) => Err(e.to_string()),
    }
}

fn memory_limit_mib(v: &Value, path: &str, errs: &mut Errors) -> Option<u64> {
    let text = match v {
        Value::String(s) => s.clone(),
        // Kubernetes quantities also decode from bare JSON numbers.
        Value::Number(n) if n.is_f64() => n.as_f64().map(|f| format!("{f:e}"))?,
        Value::Number(n) => n.to_string(),
        other => {
            errs.push(
                path,
                format!(
                    "must be a memory quantity such as \"5Gi\" or \"512Mi\", got {}",
                    describe(other)
                ),
            );
            return None;
        }
    };
    let result = Quantity::parse(&text)
        .map_err(|e| e.to_string())
        .and_then(|q| pinned_memory_limit_mib(&q));
    match result {
        Ok(mib) => Some(mib),
        Err(msg) => {
            errs.push(path, msg);
            None
        }
    }
}
