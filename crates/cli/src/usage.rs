//! `gpu-dra usage`: the admin's view of who holds what, per node and GPU: which claim holds a
//! whole GPU, which MIG partition (static or created on demand), which memory share.
//!
//! Built from what the API server already knows, so it needs no access to the nodes: our
//! ResourceSlices (devices, their parent GPU, memory) and every allocated ResourceClaim
//! (`status.allocation.devices.results`: device, pool, `consumedCapacity`, `shareID`; and the
//! node plugin's `status.devices` entries, which name the device's UUID: the only place a
//! dynamic MIG device's UUID is published). [`usage`] is pure over those objects; [`run`]
//! fetches them.

use std::collections::BTreeMap;
use std::io::Write;

use clap::Args;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use serde::Serialize;

use crate::explain::Format;
use crate::{CliError, Outcome};

/// `gpu-dra usage` arguments.
#[derive(Debug, Args)]
pub struct UsageArgs {
    /// Only this node.
    #[arg(long, env = "NODE_NAME")]
    pub node: Option<String>,
    /// Driver whose devices are shown.
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.nvidia.com")]
    pub driver_name: String,
    /// Output format.
    #[arg(short, long, env = "OUTPUT_FORMAT", value_enum, default_value_t = Format::Text)]
    pub output: Format,
}

/// One GPU and what is allocated on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuUsage {
    /// Node (pool) name.
    pub node: String,
    /// The whole GPU's device name (`gpu-<minor>`), or its UUID when no whole-GPU device is
    /// published (a GPU with static MIG devices only).
    pub gpu: String,
    /// GPU UUID.
    pub uuid: String,
    /// Memory of the GPU as published (e.g. `40Gi`), when known.
    pub memory: Option<String>,
    /// Allocations on it.
    pub holders: Vec<Holder>,
}

/// One allocation of a device of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// The allocated device.
    pub device: String,
    /// `gpu`, `mig` (with its profile) or `share` (with the memory consumed).
    pub kind: String,
    /// The MIG profile, or the memory share consumed.
    pub detail: String,
    /// Admin access (monitoring; may overlap other holders).
    pub admin_access: bool,
    /// UUID of the device (`MIG-...` for a MIG device) as the node plugin reported it in the
    /// claim's status, else the slice's `uuid` attribute; `None` before the claim is
    /// prepared for a device whose slice has none (a dynamic MIG device).
    pub uuid: Option<String>,
}

fn attr<'a>(d: &'a Device, name: &str) -> Option<&'a str> {
    d.attributes
        .as_ref()?
        .get(name)
        .and_then(|a| a.string.as_deref())
}

/// Who holds what, per node and GPU, sorted by node and GPU name.
pub fn usage(
    slices: &[ResourceSlice],
    claims: &[ResourceClaim],
    driver: &str,
    node: Option<&str>,
) -> Vec<GpuUsage> {
    // Devices by (pool, name); GPUs by (pool, uuid).
    let mut devices: BTreeMap<(String, String), &Device> = BTreeMap::new();
    let mut gpus: BTreeMap<(String, String), GpuUsage> = BTreeMap::new();
    for s in slices.iter().filter(|s| s.spec.driver == driver) {
        let pool = &s.spec.pool.name;
        if node.is_some_and(|n| n != pool) {
            continue;
        }
        for d in s.spec.devices.iter().flatten() {
            devices.insert((pool.clone(), d.name.clone()), d);
            let mig = attr(d, "type") == Some("mig");
            let gpu_uuid = if mig {
                attr(d, "parentUUID")
            } else {
                attr(d, "uuid")
            };
            let Some(gpu_uuid) = gpu_uuid else { continue };
            let entry = gpus
                .entry((pool.clone(), gpu_uuid.to_string()))
                .or_insert_with(|| GpuUsage {
                    node: pool.clone(),
                    gpu: gpu_uuid.to_string(),
                    uuid: gpu_uuid.to_string(),
                    memory: None,
                    holders: Vec::new(),
                });
            if !mig {
                entry.gpu = d.name.clone();
                entry.memory = d
                    .capacity
                    .as_ref()
                    .and_then(|c| c.get("memory"))
                    .map(|c| c.value.0.clone());
            }
        }
    }
    for claim in claims {
        let Some(alloc) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        let prepared = crate::explain::prepared_devices(claim, driver);
        let name = format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            claim.metadata.name.as_deref().unwrap_or_default()
        );
        for r in alloc
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
        {
            if r.driver != driver {
                continue;
            }
            let Some(d) = devices.get(&(r.pool.clone(), r.device.clone())) else {
                continue;
            };
            let mig = attr(d, "type") == Some("mig");
            let gpu_uuid = if mig {
                attr(d, "parentUUID")
            } else {
                attr(d, "uuid")
            };
            let Some(gpu) = gpu_uuid.and_then(|u| gpus.get_mut(&(r.pool.clone(), u.to_string())))
            else {
                continue;
            };
            let share = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|q| q.0.clone());
            let (kind, detail) = match (mig, share) {
                (true, _) => ("mig", attr(d, "profile").unwrap_or_default().to_string()),
                (false, Some(mem)) => (
                    "share",
                    match &gpu.memory {
                        Some(total) => format!("{mem} of {total}"),
                        None => mem,
                    },
                ),
                (false, None) => ("gpu", "whole GPU".to_string()),
            };
            let reported = prepared
                .iter()
                .find(|p| p.pool == r.pool && p.device == r.device && p.share_id == r.share_id)
                .and_then(|p| p.data.as_ref())
                .map(|data| data.uuid.clone());
            gpu.holders.push(Holder {
                claim: name.clone(),
                device: r.device.clone(),
                kind: kind.into(),
                detail,
                admin_access: r.admin_access == Some(true),
                uuid: reported.or_else(|| attr(d, "uuid").map(str::to_owned)),
            });
        }
    }
    let mut out: Vec<GpuUsage> = gpus.into_values().collect();
    for g in &mut out {
        g.holders
            .sort_by(|a, b| (&a.device, &a.claim).cmp(&(&b.device, &b.claim)));
    }
    out.sort_by(|a, b| (&a.node, &a.gpu).cmp(&(&b.node, &b.gpu)));
    out
}

/// The table people read.
pub fn to_text(rows: &[GpuUsage]) -> String {
    let mut lines = vec![[
        "NODE".to_string(),
        "GPU".into(),
        "DEVICE".into(),
        "CLAIM".into(),
        "HOLDS".into(),
        "UUID".into(),
    ]];
    for g in rows {
        if g.holders.is_empty() {
            lines.push([
                g.node.clone(),
                g.gpu.clone(),
                "-".into(),
                "-".into(),
                "free".into(),
                String::new(),
            ]);
        }
        for h in &g.holders {
            let holds = match h.kind.as_str() {
                "mig" => format!("MIG {}", h.detail),
                "share" => format!("memory {}", h.detail),
                _ => h.detail.clone(),
            };
            let holds = if h.admin_access {
                format!("{holds} (admin access)")
            } else {
                holds
            };
            lines.push([
                g.node.clone(),
                g.gpu.clone(),
                h.device.clone(),
                h.claim.clone(),
                holds,
                h.uuid.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
    }
    let widths: Vec<usize> = (0..6)
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut text = String::new();
    for l in &lines {
        let row: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        text.push_str(row.join("  ").trim_end());
        text.push('\n');
    }
    text
}

/// Runs `gpu-dra usage`.
pub fn run(args: &UsageArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let (slices, claims) = runtime.block_on(fetch())?;
    let rows = usage(&slices, &claims, &args.driver_name, args.node.as_deref());
    match args.output {
        Format::Text => write!(out, "{}", to_text(&rows))?,
        Format::Json => {
            serde_json::to_writer_pretty(&mut *out, &rows)?;
            writeln!(out)?;
        }
    }
    Ok(Outcome::Valid)
}

async fn fetch() -> Result<(Vec<ResourceSlice>, Vec<ResourceClaim>), CliError> {
    let client = crate::explain::cluster_client().await?;
    crate::explain::slices_and_claims(&client).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice() -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "node-a-gpu-nvidia-com-0"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-0"}},
                     "capacity": {"memory": {"value": "40Gi"}}},
                    {"name": "gpu-1", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-1"}},
                     "capacity": {"memory": {"value": "40Gi"}}, "allowMultipleAllocations": true},
                    {"name": "gpu-2-mig-3g20gb-9-4", "attributes": {"type": {"string": "mig"},
                     "parentUUID": {"string": "GPU-2"}, "profile": {"string": "3g.20gb"}}},
                    {"name": "gpu-3", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-3"}}}
                ]}
        }))
        .expect("slice")
    }

    fn claim(name: &str, device: &str, memory: Option<&str>, admin: bool) -> ResourceClaim {
        let mut result = json!({"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device});
        if let Some(m) = memory {
            result["consumedCapacity"] = json!({"memory": m});
            result["shareID"] = json!("0d1c3a0e-0000-4000-8000-000000000001");
        }
        if admin {
            result["adminAccess"] = json!(true);
        }
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}}
        }))
        .expect("claim")
    }

    #[test]
    fn shows_whole_gpus_partitions_shares_and_free_gpus() {
        let claims = [
            claim("train", "gpu-0", None, false),
            claim("a", "gpu-1", Some("10Gi"), false),
            claim("b", "gpu-1", Some("20Gi"), false),
            claim("part", "gpu-2-mig-3g20gb-9-4", None, false),
            claim("watch", "gpu-0", None, true),
            claim("unallocated", "gpu-3", None, false),
        ];
        let mut claims = claims.to_vec();
        claims[5].status = None;
        // The MIG device's slice has no UUID (dynamic MIG): the plugin's status entry names it.
        claims[3].status.as_mut().expect("status").devices = Some(vec![
            serde_json::from_value(json!({"driver": "gpu.nvidia.com", "pool": "node-a",
                "device": "gpu-2-mig-3g20gb-9-4", "data": {"uuid": "MIG-P", "type": "mig"}}))
            .expect("entry"),
        ]);
        let rows = usage(&[slice()], &claims, "gpu.nvidia.com", None);
        let text = to_text(&rows);
        let expect = [
            "node-a  GPU-2  gpu-2-mig-3g20gb-9-4  ns/part   MIG 3g.20gb",
            "node-a  gpu-0  gpu-0                 ns/train  whole GPU",
            "node-a  gpu-0  gpu-0                 ns/watch  whole GPU (admin access)",
            "node-a  gpu-1  gpu-1                 ns/a      memory 10Gi of 40Gi",
            "node-a  gpu-1  gpu-1                 ns/b      memory 20Gi of 40Gi",
            "node-a  gpu-3  -                     -         free",
        ];
        for line in expect {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        let uuid_of = |claim: &str| {
            rows.iter()
                .flat_map(|g| &g.holders)
                .find(|h| h.claim == claim)
                .and_then(|h| h.uuid.clone())
        };
        assert_eq!(uuid_of("ns/part").as_deref(), Some("MIG-P"));
        assert_eq!(uuid_of("ns/train").as_deref(), Some("GPU-0"));
        assert!(
            text.lines()
                .any(|l| l.contains("ns/part") && l.ends_with("MIG-P")),
            "{text}"
        );
        assert!(usage(&[slice()], &claims, "gpu.nvidia.com", Some("node-b")).is_empty());
        assert!(usage(&[slice()], &claims, "other.example.com", None).is_empty());
    }
}
