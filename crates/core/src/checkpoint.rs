//! The node plugin's checkpoint: which claims are prepared (or half prepared) on this node.
//!
//! Versioned JSON. Invariants:
//! - every document carries `version`; readers accept any version they know how to migrate
//!   and also newer ones, keeping fields they do not know (`extra`) so an older plugin that
//!   rewrites a newer file does not lose data (upgrade and downgrade both work);
//! - no checksums: a checksum over a document that another version rewrote is what turned
//!   NVIDIA's upgrades into "checkpoint is corrupted" crash loops; atomic writes (temp file,
//!   fsync, rename) already rule out torn files;
//! - a claim is `PrepareStarted` from before the first side effect until all side effects are
//!   done, then `PrepareCompleted`; a `PrepareStarted` entry found later is rolled back;
//! - a claim records the boot ID of the node it was prepared in (`bootId`, optional: older
//!   documents lack it). Side effects outside the plugin directory (CDI specs on a tmpfs, GPU
//!   settings, MPS daemons) do not survive a reboot, so an entry of another boot is prepared
//!   again, with the same answer, instead of being answered from here;
//! - the file is [`FILE_NAME`] in the plugin directory. [`LEGACY_FILE_NAME`]
//!   (`checkpoint.json`) is what this plugin used before and also what NVIDIA's driver uses
//!   in the same directory: [`is_own_format`] tells them apart (ours has an integer
//!   `version`), the plugin migrates its own and imports NVIDIA's
//!   (see [`crate::nvidia_checkpoint`]). Claims imported once are listed in
//!   `importedFromNvidia` so that NVIDIA's file, which is left untouched for a rollback, does
//!   not bring them back after they were unprepared;
//! - a claim with dynamic MIG devices lists each instance it creates in `dynamicMig`
//!   ([`DynamicMigInstance`]) **before** creating it (GPU, profile, placement), and the
//!   instance's IDs and UUID once it exists. So after a crash at any point the checkpoint names
//!   every instance that may exist: the plugin keeps those of prepared claims, destroys those
//!   of half-prepared ones (found by placement when the IDs were never written) and destroys
//!   the strays on a dynamic GPU. An older plugin keeps the field as unknown data;
//! - `dynamicMigGpus` lists the GPUs the plugin last saw offered as dynamic MIG, each with the
//!   instances that were on it, owned by no dynamic record, when it first saw it so
//!   ([`DynamicMigGpu`]): those are an admin's or a claim's static device and are never
//!   destroyed; only an instance that appeared later and that no claim uses is a stray.
//!   Written before any instance of that GPU is destroyed, so a crash cannot turn a kept
//!   instance into a stray;
//! - between two full writes the plugin records its changes as [`ChangeRecord`]s in a
//!   journal beside the file ([`JOURNAL_FILE_NAME`]): each record holds the new state of
//!   what changed (a claim's whole entry, or its removal; a top-level field whole), not a
//!   delta, so replaying the records in order over the document they extend gives the
//!   document as it was after the last one. The document stays the only thing an older
//!   version reads; the plugin folds the journal into it when idle, at start and at a
//!   graceful stop.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Format version this code writes.
pub const CURRENT_VERSION: u32 = 1;

/// The checkpoint's file name in the plugin directory.
pub const FILE_NAME: &str = "gpu-dra-checkpoint.json";

/// The journal of changes since the checkpoint was last written, in the plugin directory.
pub const JOURNAL_FILE_NAME: &str = "gpu-dra-checkpoint.journal";

/// The name this plugin used before [`FILE_NAME`], shared with NVIDIA's driver.
pub const LEGACY_FILE_NAME: &str = "checkpoint.json";

/// Whether `bytes` is a checkpoint of this plugin (a JSON object with a positive integer
/// `version`), as opposed to NVIDIA's driver's (string or missing `version`).
pub fn is_own_format(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| v.get("version").and_then(Value::as_u64))
        .is_some_and(|v| v > 0)
}

/// Errors reading a checkpoint document.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Not JSON, or a known field has the wrong type.
    #[error("checkpoint is not valid JSON of a known layout: {0}")]
    Parse(#[from] serde_json::Error),
    /// `version` is missing or zero.
    #[error("checkpoint field `version` must be a positive integer, found {0}")]
    Version(String),
}

/// The checkpoint document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Format version.
    pub version: u32,
    /// Claims by UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimEntry>,
    /// UIDs of claims imported from NVIDIA's driver's checkpoint, never imported again.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub imported_from_nvidia: BTreeSet<String>,
    /// The GPUs the plugin last saw offered as dynamic MIG, by UUID, with the instances it
    /// found on each when it first saw it so and keeps as an admin's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dynamic_mig_gpus: BTreeMap<String, DynamicMigGpu>,
    /// Fields of a newer format, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Preparation state of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrepareState {
    /// Side effects may have begun; roll back before retrying.
    PrepareStarted,
    /// Fully prepared; a repeat prepare answers from here.
    PrepareCompleted,
}

/// One claim in the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    /// State.
    pub state: PrepareState,
    /// Namespace of the claim.
    #[serde(default)]
    pub namespace: String,
    /// Name of the claim.
    #[serde(default)]
    pub name: String,
    /// Devices reserved or prepared for it.
    #[serde(default)]
    pub devices: Vec<PreparedDevice>,
    /// Sharing state (e.g. MPS daemon pid, pipe directory, limits), owned by the sharing module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Value>,
    /// Boot ID of the node when the claim was prepared (`None`: unknown, e.g. written by an
    /// older version or imported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// Version of the NVIDIA driver whose files the claim's CDI spec names (`None`: written
    /// by an older version or imported; the spec's own library names then tell). A driver
    /// upgraded in place removes those files, so a spec of another version is stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// Set when NVIDIA's driver prepared the claim and this plugin imported it: its side
    /// effects (CDI spec, sharing) are NVIDIA's and are cleaned up their way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported: Option<Imported>,
    /// MIG instances created (or about to be created) for the claim's dynamic MIG devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dynamic_mig: Vec<DynamicMigInstance>,
    /// Fields of a newer format, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A MIG instance of a dynamic MIG device: written with the placement before the instance is
/// created, completed with its IDs and UUID after.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DynamicMigInstance {
    /// Device name in the pool (`gpu-<minor>-mig-<profile>-<giProfileId>-<start>`).
    pub device: String,
    /// UUID of the parent GPU.
    pub gpu_uuid: String,
    /// GPU instance profile ID (19 for `1g.5gb` on an A100).
    pub gi_profile_id: u32,
    /// First memory slice of the placement.
    pub placement_start: u32,
    /// Memory slices of the placement.
    pub placement_size: u32,
    /// GPU instance ID, once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gi_id: Option<u32>,
    /// Compute instance ID, once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci_id: Option<u32>,
    /// UUID of the MIG device, once created (new with every creation: what tells this
    /// instance from a later one with the same IDs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Fields of a newer format, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl DynamicMigInstance {
    /// Whether this instance's placement shares a memory slice with `start..start + size`.
    pub fn overlaps(&self, start: u32, size: u32) -> bool {
        self.placement_start < start.saturating_add(size)
            && start < self.placement_start.saturating_add(self.placement_size)
    }
}

/// A GPU the plugin saw offered as dynamic MIG.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DynamicMigGpu {
    /// UUIDs of the MIG devices that existed, owned by no claim's dynamic device, when the
    /// plugin first saw the GPU dynamic: an admin's (or a claim's static device), never
    /// destroyed by the plugin. An entry goes once its instance is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_instances: Vec<String>,
    /// Fields of a newer format, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// What NVIDIA's driver did for an imported claim, as far as cleaning it up needs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Imported {
    /// The format it came from, e.g. `nvidia-checkpoint-v2`.
    pub from: String,
    /// Whole GPUs NVIDIA set time-slicing on (compute mode and interval to reset).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub time_sliced_gpus: Vec<String>,
    /// NVIDIA MPS control daemon IDs (`<claimUID>-<hash>`): each runs as the Deployment
    /// `mps-control-daemon-<id>` in NVIDIA's namespace, with files in `<plugin-dir>/mps/<id>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps_control_daemons: Vec<String>,
    /// Whole GPUs an NVIDIA MPS daemon of the claim put in `EXCLUSIVE_PROCESS` mode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps_gpus: Vec<String>,
}

/// A prepared device of a claim, with everything the kubelet's answer needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// Device name in the pool.
    pub device: String,
    /// Pool name.
    pub pool: String,
    /// Request names (subrequests stripped).
    #[serde(default)]
    pub request_names: Vec<String>,
    /// CDI device IDs.
    #[serde(default)]
    pub cdi_device_ids: Vec<String>,
    /// Device UUID.
    #[serde(default)]
    pub uuid: String,
    /// Admin access (may overlap other claims).
    #[serde(default)]
    pub admin_access: bool,
    /// Share ID, when allocated as a share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The share of a memory-share GPU the allocation consumes (`consumedCapacity.memory`),
    /// in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_share_bytes: Option<u64>,
    /// Wire name of the sharing strategy applied to the device's group (`TimeSlicing`,
    /// `MPS`); `None` when the claim configured none (and for entries of older versions or
    /// imported from NVIDIA's driver). Reported in the claim's `status.devices`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_strategy: Option<String>,
    /// Fields of a newer format, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Checkpoint {
    /// An empty checkpoint of the current version.
    pub fn new() -> Self {
        Checkpoint {
            version: CURRENT_VERSION,
            ..Checkpoint::default()
        }
    }

    /// Reads a document of any version, migrating known older layouts.
    ///
    /// A newer version is read as far as its fields are known; unknown fields are kept and
    /// written back unchanged by [`Checkpoint::to_json`].
    pub fn from_json(bytes: &[u8]) -> Result<Self, CheckpointError> {
        let value: Value = serde_json::from_slice(bytes)?;
        let version = value.get("version").and_then(Value::as_u64).unwrap_or(0);
        if version == 0 {
            return Err(CheckpointError::Version(
                value
                    .get("version")
                    .map_or_else(|| "nothing".to_owned(), Value::to_string),
            ));
        }
        // Version 1 is the first format; later formats add fields only, which `extra` keeps.
        let mut checkpoint: Checkpoint = serde_json::from_value(value)?;
        checkpoint.version = checkpoint.version.max(CURRENT_VERSION);
        Ok(checkpoint)
    }

    /// Serializes the document (pretty, stable key order for claims).
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing plain maps, strings and numbers cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }
}

/// What changed in a [`Checkpoint`] from one state to a later one, as the new state of each
/// part that changed: replaying a record over the earlier state gives the later one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChangeRecord {
    /// Claims whose entry changed, with the new entry, or `null` when it was removed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub claims: BTreeMap<String, Option<ClaimEntry>>,
    /// The whole new `importedFromNvidia`, when it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported_from_nvidia: Option<BTreeSet<String>>,
    /// The whole new `dynamicMigGpus`, when it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_mig_gpus: Option<BTreeMap<String, DynamicMigGpu>>,
    /// The whole new set of the document's fields of a newer format, when it changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

impl ChangeRecord {
    /// The changes from `before` to `after` (claims compared entry by entry).
    pub fn between(before: &Checkpoint, after: &Checkpoint) -> Self {
        let mut claims: BTreeMap<String, Option<ClaimEntry>> = after
            .claims
            .iter()
            .filter(|(uid, entry)| before.claims.get(*uid) != Some(entry))
            .map(|(uid, entry)| (uid.clone(), Some(entry.clone())))
            .collect();
        claims.extend(
            before
                .claims
                .keys()
                .filter(|uid| !after.claims.contains_key(*uid))
                .map(|uid| (uid.clone(), None)),
        );
        ChangeRecord {
            claims,
            imported_from_nvidia: (before.imported_from_nvidia != after.imported_from_nvidia)
                .then(|| after.imported_from_nvidia.clone()),
            dynamic_mig_gpus: (before.dynamic_mig_gpus != after.dynamic_mig_gpus)
                .then(|| after.dynamic_mig_gpus.clone()),
            extra: (before.extra != after.extra).then(|| after.extra.clone()),
        }
    }

    /// Whether the record changes nothing.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
            && self.imported_from_nvidia.is_none()
            && self.dynamic_mig_gpus.is_none()
            && self.extra.is_none()
    }

    /// Applies the record to `doc`.
    pub fn apply(self, doc: &mut Checkpoint) {
        for (uid, entry) in self.claims {
            match entry {
                Some(entry) => doc.claims.insert(uid, entry),
                None => doc.claims.remove(&uid),
            };
        }
        if let Some(imported) = self.imported_from_nvidia {
            doc.imported_from_nvidia = imported;
        }
        if let Some(gpus) = self.dynamic_mig_gpus {
            doc.dynamic_mig_gpus = gpus;
        }
        if let Some(extra) = self.extra {
            doc.extra = extra;
        }
    }

    /// Serializes the record (compact: records are written on every change).
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing plain maps, strings and numbers cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a record.
    pub fn from_json(bytes: &[u8]) -> Result<Self, CheckpointError> {
        Ok(serde_json::from_slice(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN_V1: &str = include_str!("../testdata/checkpoint-v1.json");
    const FUTURE_V2: &str = include_str!("../testdata/checkpoint-v2-future.json");

    #[test]
    fn golden_v1_reads_and_round_trips() {
        let cp = Checkpoint::from_json(GOLDEN_V1.as_bytes()).expect("v1 reads");
        assert_eq!(cp.version, 1);
        let done = &cp.claims["6f9d2c1e-0000-4000-8000-000000000001"];
        assert_eq!(done.state, PrepareState::PrepareCompleted);
        assert_eq!(
            done.devices[0].cdi_device_ids,
            ["k8s.gpu.nvidia.com/claim=6f9d2c1e-0000-4000-8000-000000000001-gpu-0"]
        );
        let started = &cp.claims["6f9d2c1e-0000-4000-8000-000000000002"];
        assert_eq!(started.state, PrepareState::PrepareStarted);
        let again = Checkpoint::from_json(&cp.to_json()).expect("round trip");
        assert_eq!(again, cp);
    }

    #[test]
    fn newer_format_is_read_and_its_unknown_fields_survive_a_rewrite() {
        let cp = Checkpoint::from_json(FUTURE_V2.as_bytes()).expect("v2 reads");
        assert_eq!(cp.version, 2);
        let entry = &cp.claims["6f9d2c1e-0000-4000-8000-000000000003"];
        assert_eq!(entry.devices[0].device, "gpu-1-mig-1g5gb-19-0");
        let rewritten: Value = serde_json::from_slice(&cp.to_json()).expect("json");
        let original: Value = serde_json::from_str(FUTURE_V2).expect("json");
        assert_eq!(
            rewritten, original,
            "an older reader must not drop newer fields"
        );
    }

    #[test]
    fn older_entries_without_boot_id_or_import_marks_load_and_new_fields_round_trip() {
        let mut cp = Checkpoint::from_json(GOLDEN_V1.as_bytes()).expect("v1 reads");
        let done = cp
            .claims
            .get_mut("6f9d2c1e-0000-4000-8000-000000000001")
            .expect("entry");
        assert_eq!(done.boot_id, None);
        assert_eq!(done.imported, None);
        assert!(cp.imported_from_nvidia.is_empty());
        done.boot_id = Some("0f6c9a52-1d1e-4f7b-9b8e-2f4c1a7d5e01".into());
        done.imported = Some(Imported {
            from: "nvidia-checkpoint-v2".into(),
            time_sliced_gpus: vec!["GPU-1".into()],
            ..Imported::default()
        });
        cp.imported_from_nvidia.insert("uid-x".into());
        let json: Value = serde_json::from_slice(&cp.to_json()).expect("json");
        let entry = &json["claims"]["6f9d2c1e-0000-4000-8000-000000000001"];
        assert_eq!(entry["bootId"], "0f6c9a52-1d1e-4f7b-9b8e-2f4c1a7d5e01");
        assert_eq!(entry["imported"]["timeSlicedGpus"][0], "GPU-1");
        assert_eq!(json["importedFromNvidia"][0], "uid-x");
        assert_eq!(Checkpoint::from_json(&cp.to_json()).expect("reads"), cp);
    }

    #[test]
    fn dynamic_mig_intents_round_trip_and_are_absent_when_empty() {
        let mut cp = Checkpoint::from_json(GOLDEN_V1.as_bytes()).expect("v1 reads");
        let uid = "6f9d2c1e-0000-4000-8000-000000000002";
        assert!(cp.claims[uid].dynamic_mig.is_empty());
        let before: Value = serde_json::from_slice(&cp.to_json()).expect("json");
        assert!(before["claims"][uid].get("dynamicMig").is_none());
        let intent = DynamicMigInstance {
            device: "gpu-0-mig-3g20gb-9-4".into(),
            gpu_uuid: "GPU-1".into(),
            gi_profile_id: 9,
            placement_start: 4,
            placement_size: 4,
            ..DynamicMigInstance::default()
        };
        assert!(intent.overlaps(6, 1) && intent.overlaps(0, 8) && !intent.overlaps(0, 4));
        let entry = cp.claims.get_mut(uid).expect("entry");
        entry.dynamic_mig.push(intent.clone());
        entry.dynamic_mig.push(DynamicMigInstance {
            gi_id: Some(2),
            ci_id: Some(0),
            uuid: Some("MIG-2".into()),
            ..intent
        });
        let json: Value = serde_json::from_slice(&cp.to_json()).expect("json");
        let list = &json["claims"][uid]["dynamicMig"];
        assert_eq!(list[0]["placementStart"], 4);
        assert!(list[0].get("giId").is_none(), "not created yet");
        assert_eq!(list[1]["giId"], 2);
        assert_eq!(list[1]["uuid"], "MIG-2");
        assert_eq!(Checkpoint::from_json(&cp.to_json()).expect("reads"), cp);

        // The dynamic GPUs and their kept instances: absent when none, camelCase otherwise.
        assert!(json.get("dynamicMigGpus").is_none());
        cp.dynamic_mig_gpus.insert(
            "GPU-1".into(),
            DynamicMigGpu {
                kept_instances: vec!["MIG-admin".into()],
                ..DynamicMigGpu::default()
            },
        );
        let json: Value = serde_json::from_slice(&cp.to_json()).expect("json");
        assert_eq!(
            json["dynamicMigGpus"]["GPU-1"]["keptInstances"][0],
            "MIG-admin"
        );
        assert_eq!(Checkpoint::from_json(&cp.to_json()).expect("reads"), cp);
    }

    #[test]
    fn own_format_is_told_from_nvidias() {
        assert!(is_own_format(GOLDEN_V1.as_bytes()));
        assert!(is_own_format(FUTURE_V2.as_bytes()));
        assert!(!is_own_format(br#"{"version":"v2","checksum":1,"v2":{}}"#));
        assert!(!is_own_format(br#"{"checksum":1,"v1":{}}"#));
        assert!(!is_own_format(b"not json"));
        assert!(!is_own_format(br#"{"version":0}"#));
    }

    #[test]
    fn missing_version_is_a_clear_error() {
        let err = Checkpoint::from_json(br#"{"claims": {}}"#).expect_err("no version");
        assert!(err.to_string().contains("`version`"), "{err}");
        assert!(Checkpoint::from_json(b"{").is_err());
    }

    #[test]
    fn a_change_record_replayed_over_the_earlier_state_gives_the_later_one() {
        let before = Checkpoint::from_json(GOLDEN_V1.as_bytes()).expect("v1 reads");
        let (done, started) = (
            "6f9d2c1e-0000-4000-8000-000000000001",
            "6f9d2c1e-0000-4000-8000-000000000002",
        );
        let mut after = before.clone();
        after.claims.remove(done);
        after.claims.get_mut(started).expect("entry").state = PrepareState::PrepareCompleted;
        let mut added = before.claims[done].clone();
        added.name = "new".into();
        after.claims.insert("uid-new".into(), added);
        after.imported_from_nvidia.insert("uid-x".into());

        let record = ChangeRecord::between(&before, &after);
        assert_eq!(record.claims.len(), 3, "{record:?}");
        assert_eq!(record.claims[done], None, "a removal is a null entry");
        assert!(record.dynamic_mig_gpus.is_none() && record.extra.is_none());
        let json: Value = serde_json::from_slice(&record.to_json()).expect("json");
        assert!(json["claims"][done].is_null());
        assert_eq!(json["claims"][started]["state"], "PrepareCompleted");
        assert!(
            json.get("dynamicMigGpus").is_none(),
            "unchanged parts are absent"
        );

        let read = ChangeRecord::from_json(&record.to_json()).expect("reads");
        assert_eq!(read, record);
        let mut replayed = before.clone();
        read.apply(&mut replayed);
        assert_eq!(replayed, after);
        assert!(ChangeRecord::between(&after, &after).is_empty());
        assert!(!record.is_empty());

        // Replaying twice changes nothing more: records hold states, not deltas.
        ChangeRecord::between(&before, &after).apply(&mut replayed);
        assert_eq!(replayed, after);
        assert!(ChangeRecord::from_json(b"{\"claims\": 7}").is_err());
    }
}
