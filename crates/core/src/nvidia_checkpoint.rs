//! NVIDIA's DRA driver's checkpoint, read so that a node moves from NVIDIA's driver to this
//! one in place: the claims NVIDIA prepared become [`ClaimEntry`] values marked
//! [`Imported`], so their devices stay reserved and their repeat prepare and unprepare work.
//!
//! NVIDIA's kubelet plugin keeps `checkpoint.json` in the same plugin directory
//! (`/var/lib/kubelet/plugins/gpu.nvidia.com`). The layouts it has shipped, all JSON, newest
//! section wins (v3, then v2, then v1), as NVIDIA's own reader does:
//! - **classic DRA** (`NVIDIA/k8s-dra-driver`, before structured parameters):
//!   `{"version":"v1","allocations":{..},"checksum":N}`. Its claims were allocated by a
//!   controller that no longer exists and carry no prepared devices: not importable
//!   ([`NvidiaCheckpointError::ClassicDra`]).
//! - **v1**: `{"checksum":N,"v1":{"preparedClaims":{<uid>:{"status":<ResourceClaimStatus>,
//!   "preparedDevices":[<group>..]}}}}` (`NVIDIA/k8s-dra-driver-gpu` up to 25.3). The first
//!   structured-parameters releases (`NVIDIA/k8s-dra-driver`, 2024) stored the group list
//!   directly as the claim's value; both are read.
//! - **v2**: v1 kept for downgrades plus `"v2":{"checksum":N,"preparedClaims":{<uid>:
//!   {"checkpointState":"PrepareStarted"|"PrepareCompleted","status":..,"preparedDevices":..,
//!   "name":..,"namespace":..}},"nodeBootID"?}`, and `"version":"v2"` at the top in the newest
//!   (`kubernetes-sigs/dra-driver-nvidia-gpu`). `nodeBootID` becomes the entries' boot ID.
//! - **v3** (a later `NVIDIA/k8s-dra-driver-gpu` revision): `"v3"` shaped like v2 with the
//!   device record in camelCase.
//!
//! A group is `{"devices":[..],"configState":{"mpsControlDaemonID":..,"timeSliceApplied"?}}`;
//! a device is one of `{"gpu":{"info":{"uuid"},"device":D}}`,
//! `{"mig":{"concrete":{"migUUID","parentUUID",..},"device":D}}` (older: `"info":{"uuid"}`)
//! or `{"vfio":{"info":{"uuid"},"device":D}}`. `D` is the kubelet plugin library's `Device`
//! in one of three spellings: Go field names (`Requests`, `PoolName`, `DeviceName`,
//! `CDIDeviceIDs`, `ShareID`), the gRPC message's (`request_names`, `pool_name`,
//! `device_name`, `cdi_device_ids`) in the oldest releases, or camelCase in v3. NVIDIA's CDI
//! device IDs are `k8s.gpu.nvidia.com/claim=<uid>-<device>`, the same as ours, so the recorded
//! IDs are answered as they are.
//!
//! Checksums are not verified. They are the kubelet checkpoint manager's hash over Go's
//! `json.Marshal` of NVIDIA's structs: reproducing it needs byte-identical Go serialization
//! of types that changed between their releases, and NVIDIA's own binaries rejected each
//! other's files over exactly that. Their writes are atomic, so a torn file is not the risk
//! a checksum would catch; the structure is checked instead, claim by claim: a claim whose
//! devices cannot be named is skipped with its reason ([`NvidiaImport::skipped`]) rather
//! than failing the whole file.
//!
//! Pure: bytes in, entries out. The plugin decides what to do with a file that does not
//! parse (it logs, keeps the file and starts without NVIDIA's claims).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::checkpoint::{ClaimEntry, Imported, PrepareState, PreparedDevice};

/// The driver name whose allocation results NVIDIA's claims are matched against.
const DRIVER_NAME: &str = "gpu.nvidia.com";

/// Why NVIDIA's checkpoint cannot be imported at all.
#[derive(Debug, thiserror::Error)]
pub enum NvidiaCheckpointError {
    /// Not JSON.
    #[error("not JSON: {0}")]
    Parse(#[from] serde_json::Error),
    /// JSON, but not an object with any section NVIDIA has written.
    #[error(
        "not a checkpoint layout NVIDIA's driver is known to write (top-level keys: {keys}); expected `v1`, `v2` or `v3`"
    )]
    Unknown {
        /// The keys found, comma separated.
        keys: String,
    },
    /// The classic-DRA layout (`version: v1` with `allocations`), from before structured
    /// parameters.
    #[error(
        "classic DRA checkpoint (`allocations`) from before structured parameters: its claims cannot be imported; drain the node's GPU pods before switching drivers"
    )]
    ClassicDra,
}

/// Which NVIDIA layout a file was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvidiaFormat {
    /// The `v1` section only.
    V1,
    /// The `v2` section.
    V2,
    /// The `v3` section.
    V3,
}

impl NvidiaFormat {
    /// The name recorded in [`Imported::from`].
    pub fn as_str(self) -> &'static str {
        match self {
            NvidiaFormat::V1 => "nvidia-checkpoint-v1",
            NvidiaFormat::V2 => "nvidia-checkpoint-v2",
            NvidiaFormat::V3 => "nvidia-checkpoint-v3",
        }
    }
}

/// A claim that could not be imported, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedClaim {
    /// Claim UID.
    pub uid: String,
    /// What was wrong, with the JSON path.
    pub reason: String,
}

/// What NVIDIA's checkpoint holds, as our entries.
#[derive(Debug, Clone, PartialEq)]
pub struct NvidiaImport {
    /// The section read.
    pub format: NvidiaFormat,
    /// Claims by UID, each with [`ClaimEntry::imported`] set.
    pub claims: BTreeMap<String, ClaimEntry>,
    /// Claims left out.
    pub skipped: Vec<SkippedClaim>,
}

/// Reads NVIDIA's checkpoint document.
pub fn parse(bytes: &[u8]) -> Result<NvidiaImport, NvidiaCheckpointError> {
    let doc: Value = serde_json::from_slice(bytes)?;
    let Some(obj) = doc.as_object() else {
        return Err(NvidiaCheckpointError::Unknown {
            keys: format!("none, the document is {}", kind_of(&doc)),
        });
    };
    let section = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let (format, claims) = if let Some(v3) = section("v3") {
        (NvidiaFormat::V3, v3.get("preparedClaims"))
    } else if let Some(v2) = section("v2") {
        (NvidiaFormat::V2, v2.get("preparedClaims"))
    } else if let Some(v1) = section("v1") {
        (NvidiaFormat::V1, v1.get("preparedClaims"))
    } else if obj.contains_key("allocations") {
        return Err(NvidiaCheckpointError::ClassicDra);
    } else if obj.contains_key("checksum") {
        // A fresh NVIDIA checkpoint with no section yet: nothing prepared.
        (NvidiaFormat::V1, None)
    } else {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        return Err(NvidiaCheckpointError::Unknown {
            keys: if keys.is_empty() {
                "none".to_owned()
            } else {
                keys.join(", ")
            },
        });
    };
    // Newer v2 records the boot its claims were checked in; it means the same as ours.
    let boot_id = section("v2")
        .and_then(|v2| v2.get("nodeBootID"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let mut out = NvidiaImport {
        format,
        claims: BTreeMap::new(),
        skipped: Vec::new(),
    };
    let section_name = match format {
        NvidiaFormat::V1 => "v1",
        NvidiaFormat::V2 => "v2",
        NvidiaFormat::V3 => "v3",
    };
    match claims {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (uid, claim) in map {
                let path = format!("{section_name}.preparedClaims[{uid}]");
                match claim_entry(format, &path, claim) {
                    Ok(mut entry) => {
                        entry.boot_id.clone_from(&boot_id);
                        out.claims.insert(uid.clone(), entry);
                    }
                    Err(reason) => out.skipped.push(SkippedClaim {
                        uid: uid.clone(),
                        reason,
                    }),
                }
            }
        }
        Some(other) => {
            return Err(NvidiaCheckpointError::Unknown {
                keys: format!(
                    "{section_name}.preparedClaims is {}, not an object",
                    kind_of(other)
                ),
            });
        }
    }
    Ok(out)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn str_at<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

fn strings_at(v: &Value, keys: &[&str]) -> Vec<String> {
    keys.iter()
        .find_map(|k| v.get(*k).and_then(Value::as_array))
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn first_str<'a>(v: &'a Value, keys: &[&str]) -> &'a str {
    keys.iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str).filter(|s| !s.is_empty()))
        .unwrap_or_default()
}

/// One allocation result of the claim's recorded status.
struct AllocationResult<'a> {
    device: &'a str,
    pool: &'a str,
    admin: bool,
}

fn allocation_results(status: Option<&Value>) -> Vec<AllocationResult<'_>> {
    status
        .and_then(|s| s.pointer("/allocation/devices/results"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| {
            let driver = str_at(r, "driver");
            driver.is_empty() || driver == DRIVER_NAME
        })
        .map(|r| AllocationResult {
            device: str_at(r, "device"),
            pool: str_at(r, "pool"),
            admin: r.get("adminAccess").and_then(Value::as_bool) == Some(true),
        })
        .collect()
}

/// Whether the claim's recorded opaque configs ask for time-slicing for any of `requests`
/// (used when a group does not record `timeSliceApplied`, which older releases lack).
fn configs_time_slicing(status: Option<&Value>, requests: &[String]) -> bool {
    status
        .and_then(|s| s.pointer("/allocation/devices/config"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            let params = c.pointer("/opaque/parameters");
            let driver = c.pointer("/opaque/driver").and_then(Value::as_str);
            let strategy = params
                .and_then(|p| p.pointer("/sharing/strategy"))
                .and_then(Value::as_str);
            let applies = strings_at(c, &["requests"]);
            driver == Some(DRIVER_NAME)
                && strategy == Some("TimeSlicing")
                && (applies.is_empty() || applies.iter().any(|r| requests.contains(r)))
        })
}

fn claim_entry(format: NvidiaFormat, path: &str, claim: &Value) -> Result<ClaimEntry, String> {
    // The earliest structured releases stored the group list as the claim's value.
    let (groups, status) = match claim {
        Value::Array(groups) => (Some(groups), None),
        Value::Object(_) => (
            claim.get("preparedDevices").and_then(Value::as_array),
            claim.get("status").filter(|s| s.is_object()),
        ),
        other => return Err(format!("{path} is {}, not an object", kind_of(other))),
    };
    let state = match str_at(claim, "checkpointState") {
        "PrepareStarted" => PrepareState::PrepareStarted,
        // v1 has no state: NVIDIA wrote v1 entries only once prepared.
        "PrepareCompleted" | "" => PrepareState::PrepareCompleted,
        other => {
            return Err(format!(
                "{path}.checkpointState is {other:?}; expected PrepareStarted or PrepareCompleted"
            ));
        }
    };
    let results = allocation_results(status);
    let mut imported = Imported {
        from: format.as_str().to_owned(),
        ..Imported::default()
    };
    let mut devices = Vec::new();
    for (g, group) in groups.into_iter().flatten().enumerate() {
        let gpath = format!("{path}.preparedDevices[{g}]");
        if !group.is_object() {
            return Err(format!("{gpath} is {}, not an object", kind_of(group)));
        }
        let mut whole_gpus = Vec::new();
        let mut requests = Vec::new();
        for (d, dev) in group
            .get("devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let dpath = format!("{gpath}.devices[{d}]");
            let prepared = prepared_device(&dpath, dev, &results)?;
            if dev.get("gpu").is_some_and(|g| !g.is_null()) {
                whole_gpus.push(prepared.uuid.clone());
            }
            requests.extend(prepared.request_names.iter().cloned());
            devices.push(prepared);
        }
        let config = group.get("configState").unwrap_or(&Value::Null);
        let mps = str_at(config, "mpsControlDaemonID");
        if !mps.is_empty() {
            imported.mps_control_daemons.push(mps.to_owned());
            imported.mps_gpus.extend(whole_gpus.iter().cloned());
        }
        let time_sliced = match config.get("timeSliceApplied").and_then(Value::as_bool) {
            Some(applied) => applied,
            None => mps.is_empty() && configs_time_slicing(status, &requests),
        };
        if time_sliced {
            imported.time_sliced_gpus.extend(whole_gpus);
        }
    }
    if devices.is_empty() && state == PrepareState::PrepareCompleted {
        return Err(format!(
            "{path}.preparedDevices names no device; a prepared claim holds at least one"
        ));
    }
    for list in [
        &mut imported.time_sliced_gpus,
        &mut imported.mps_gpus,
        &mut imported.mps_control_daemons,
    ] {
        list.sort();
        list.dedup();
    }
    Ok(ClaimEntry {
        state,
        namespace: str_at(claim, "namespace").to_owned(),
        name: str_at(claim, "name").to_owned(),
        devices,
        sharing: None,
        boot_id: None,
        driver_version: None,
        imported: Some(imported),
        dynamic_mig: Vec::new(),
        extra: Map::new(),
    })
}

fn prepared_device(
    path: &str,
    dev: &Value,
    results: &[AllocationResult<'_>],
) -> Result<PreparedDevice, String> {
    let kinds: Vec<(&str, &Value)> = ["gpu", "mig", "vfio"]
        .into_iter()
        .filter_map(|k| dev.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
        .collect();
    let [(kind, body)] = kinds.as_slice() else {
        return Err(format!(
            "{path} must set exactly one of gpu, mig, vfio; it sets {}",
            if kinds.is_empty() {
                "none".to_owned()
            } else {
                kinds.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            }
        ));
    };
    let record = body.get("device").unwrap_or(&Value::Null);
    let name = first_str(record, &["DeviceName", "deviceName", "device_name"]);
    if name.is_empty() {
        return Err(format!("{path}.{kind}.device names no device (DeviceName)"));
    }
    // MIG: `concrete.migUUID` since dynamic MIG, `info.uuid` before; others: `info.uuid`.
    let uuid = body
        .get("concrete")
        .map(|c| str_at(c, "migUUID"))
        .filter(|s| !s.is_empty())
        .or_else(|| body.get("info").map(|i| str_at(i, "uuid")))
        .unwrap_or_default()
        .to_owned();
    let result = results.iter().find(|r| r.device == name);
    let mut pool = first_str(record, &["PoolName", "poolName", "pool_name"]).to_owned();
    if pool.is_empty() {
        pool = result.map(|r| r.pool.to_owned()).unwrap_or_default();
    }
    let share_id = first_str(record, &["ShareID", "shareID", "share_id"]);
    Ok(PreparedDevice {
        device: name.to_owned(),
        pool,
        request_names: strings_at(record, &["Requests", "requests", "request_names"]),
        cdi_device_ids: strings_at(record, &["CDIDeviceIDs", "cdiDeviceIDs", "cdi_device_ids"]),
        uuid,
        admin_access: result.is_some_and(|r| r.admin),
        share_id: (!share_id.is_empty()).then(|| share_id.to_owned()),
        memory_share_bytes: None,
        sharing_strategy: None,
        extra: Map::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = include_str!("../testdata/nvidia-checkpoint-v1.json");
    const V1_EARLY: &str = include_str!("../testdata/nvidia-checkpoint-v1-early.json");
    const V2: &str = include_str!("../testdata/nvidia-checkpoint-v2.json");
    const V3: &str = include_str!("../testdata/nvidia-checkpoint-v3.json");
    const CLASSIC: &str = include_str!("../testdata/nvidia-checkpoint-classic-dra.json");

    const TIME_SLICED: &str = "3f0c1b7e-8a55-4d2a-9b61-0c3e5f7a9d11";
    const MIG: &str = "5a2e9c44-1f3b-4e8d-a7c0-6b9d2e4f8a22";
    const MPS: &str = "7c4d1e55-2a6b-4f9e-b8d1-7cae3f5b9b33";
    const STARTED: &str = "9e6f3a77-4c8d-4b1a-8e2f-9d0b5a7c1d44";

    /// The claims every structured layout holds: a time-sliced whole GPU, a MIG device and
    /// an MPS group, each with the devices, CDI IDs and sharing NVIDIA recorded.
    fn check_common(import: &NvidiaImport, format: NvidiaFormat) {
        assert!(import.skipped.is_empty(), "{:?}", import.skipped);
        let ts = &import.claims[TIME_SLICED];
        assert_eq!(ts.state, PrepareState::PrepareCompleted);
        assert_eq!(ts.devices.len(), 1);
        let d = &ts.devices[0];
        assert_eq!(
            (d.device.as_str(), d.pool.as_str(), d.uuid.as_str()),
            (
                "gpu-1",
                "node-a",
                "GPU-00000001-1111-2222-3333-444444444444"
            )
        );
        assert_eq!(d.request_names, ["gpu"]);
        assert_eq!(
            d.cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={TIME_SLICED}-gpu-1")]
        );
        assert!(!d.admin_access);
        let imported = ts.imported.as_ref().expect("marked imported");
        assert_eq!(imported.from, format.as_str());
        assert_eq!(
            imported.time_sliced_gpus,
            ["GPU-00000001-1111-2222-3333-444444444444"]
        );
        assert!(imported.mps_control_daemons.is_empty());

        let mig = &import.claims[MIG].devices[0];
        assert_eq!(mig.device, "gpu-0-mig-1g5gb-19-0");
        assert_eq!(mig.uuid, "MIG-0b1e6d3a-7f2c-5e48-9a61-3c5d7e9f1a2b");
        assert_eq!(mig.request_names, ["mig"]);
        let mig_imported = import.claims[MIG].imported.as_ref().expect("imported");
        assert!(mig_imported.time_sliced_gpus.is_empty() && mig_imported.mps_gpus.is_empty());

        let mps = import.claims[MPS].imported.as_ref().expect("imported");
        assert_eq!(mps.mps_control_daemons, [format!("{MPS}-4e1a9")]);
        assert_eq!(mps.mps_gpus, ["GPU-00000002-1111-2222-3333-444444444444"]);
        assert!(mps.time_sliced_gpus.is_empty());
    }

    #[test]
    fn v1_with_go_field_names_and_mig_info() {
        let import = parse(V1.as_bytes()).expect("v1 parses");
        assert_eq!(import.format, NvidiaFormat::V1);
        check_common(&import, NvidiaFormat::V1);
        assert_eq!(import.claims.len(), 3);
        // v1 records neither name nor namespace.
        assert_eq!(import.claims[TIME_SLICED].name, "");
    }

    #[test]
    fn v1_early_with_grpc_field_names_and_groups_as_the_claim() {
        let import = parse(V1_EARLY.as_bytes()).expect("early v1 parses");
        assert_eq!(import.format, NvidiaFormat::V1);
        assert!(import.skipped.is_empty(), "{:?}", import.skipped);
        assert_eq!(import.claims.len(), 3);
        let d = &import.claims[MIG].devices[0];
        assert_eq!(d.device, "gpu-0-mig-1g5gb-19-0");
        assert_eq!(
            d.cdi_device_ids,
            [format!(
                "k8s.gpu.nvidia.com/claim={MIG}-gpu-0-mig-1g5gb-19-0"
            )]
        );
        // No status, no `timeSliceApplied`: time-slicing cannot be known.
        let ts = import.claims[TIME_SLICED]
            .imported
            .as_ref()
            .expect("imported");
        assert!(ts.time_sliced_gpus.is_empty());
        assert_eq!(
            import.claims[MPS]
                .imported
                .as_ref()
                .expect("imported")
                .mps_control_daemons,
            [format!("{MPS}-4e1a9")]
        );
    }

    #[test]
    fn v2_prefers_the_v2_section_with_states_and_names() {
        let import = parse(V2.as_bytes()).expect("v2 parses");
        assert_eq!(import.format, NvidiaFormat::V2);
        check_common(&import, NvidiaFormat::V2);
        assert_eq!(
            import.claims.len(),
            4,
            "v2 also holds the half-prepared claim"
        );
        let started = &import.claims[STARTED];
        assert_eq!(started.state, PrepareState::PrepareStarted);
        assert_eq!(
            (started.namespace.as_str(), started.name.as_str()),
            ("team-a", "starting")
        );
        assert_eq!(import.claims[MPS].namespace, "team-c");
        assert_eq!(
            started.boot_id.as_deref(),
            Some("c8a1f4de-6b2e-4f0a-9d37-5e81b2c4a6f0"),
            "v2's nodeBootID is the boot the claims belong to"
        );
    }

    #[test]
    fn v3_camel_case_devices_win_over_v2() {
        let import = parse(V3.as_bytes()).expect("v3 parses");
        assert_eq!(import.format, NvidiaFormat::V3);
        check_common(&import, NvidiaFormat::V3);
        assert_eq!(import.claims.len(), 4);
    }

    #[test]
    fn classic_dra_is_recognised_as_not_importable() {
        let err = parse(CLASSIC.as_bytes()).expect_err("classic");
        assert!(matches!(err, NvidiaCheckpointError::ClassicDra));
        assert!(
            err.to_string().contains("before structured parameters"),
            "{err}"
        );
    }

    #[test]
    fn checksums_are_not_verified() {
        let mut doc: Value = serde_json::from_str(V2).expect("json");
        doc["checksum"] = Value::from(1);
        doc["v2"]["checksum"] = Value::from(2);
        let import = parse(&serde_json::to_vec(&doc).expect("json")).expect("still parses");
        assert_eq!(import.claims.len(), 4);
    }

    #[test]
    fn garbage_is_an_error_and_never_a_panic() {
        for bad in [
            &b"{"[..],
            b"[]",
            b"42",
            b"{\"foo\": 1}",
            b"{\"v2\": {\"preparedClaims\": []}}",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let err = parse(b"{\"foo\": 1, \"bar\": 2}")
            .expect_err("unknown")
            .to_string();
        assert!(err.contains("foo") && err.contains("v2"), "{err}");
        // An empty fresh checkpoint holds nothing.
        assert!(
            parse(b"{\"checksum\": 0}")
                .expect("empty")
                .claims
                .is_empty()
        );
    }

    #[test]
    fn a_claim_that_names_no_device_is_skipped_with_its_path_and_the_rest_import() {
        let doc = serde_json::json!({"checksum": 0, "v2": {"checksum": 0, "preparedClaims": {
            "bad-1": {"checkpointState": "PrepareCompleted", "preparedDevices": [
                {"devices": [{"gpu": {"info": {"uuid": "GPU-1"}, "device": {}}}], "configState": {}}]},
            "bad-2": {"checkpointState": "PrepareCompleted", "preparedDevices": [
                {"devices": [{"gpu": null, "mig": null}], "configState": {}}]},
            "bad-3": {"checkpointState": "Weird"},
            "bad-4": "text",
            "good": {"checkpointState": "PrepareCompleted", "preparedDevices": [
                {"devices": [{"gpu": {"info": {"uuid": "GPU-1"},
                    "device": {"Requests": ["r"], "PoolName": "p", "DeviceName": "gpu-1", "CDIDeviceIDs": ["x"]}}}],
                 "configState": {"mpsControlDaemonID": ""}}]}
        }}});
        let import = parse(&serde_json::to_vec(&doc).expect("json")).expect("parses");
        assert_eq!(import.claims.keys().collect::<Vec<_>>(), ["good"]);
        let reasons: Vec<&str> = import.skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(reasons.len(), 4);
        assert!(
            reasons[0]
                .contains("v2.preparedClaims[bad-1].preparedDevices[0].devices[0].gpu.device"),
            "{reasons:?}"
        );
        assert!(
            reasons[1].contains("exactly one of gpu, mig, vfio"),
            "{reasons:?}"
        );
        assert!(reasons[2].contains("Weird"), "{reasons:?}");
        assert!(reasons[3].contains("a string"), "{reasons:?}");
    }

    #[test]
    fn admin_access_comes_from_the_recorded_allocation() {
        let mut doc: Value = serde_json::from_str(V2).expect("json");
        doc["v2"]["preparedClaims"][TIME_SLICED]["status"]["allocation"]["devices"]["results"][0]
            ["adminAccess"] = Value::Bool(true);
        let import = parse(&serde_json::to_vec(&doc).expect("json")).expect("parses");
        assert!(import.claims[TIME_SLICED].devices[0].admin_access);
    }
}
