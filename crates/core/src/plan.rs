//! Prepare planning: ResourceClaim + inventory + opaque configs -> what to do per device.
//!
//! Pure: the caller fetches the claim and the inventory; executing the plan (sharing, device
//! node lookups, CDI files, checkpoint) is the node plugin's job. Invariants:
//! - only results of our driver in this node's pool are taken; subrequest names are stripped
//!   (`req/sub` -> `req`) the way the kubelet's helper does;
//! - for every device exactly one opaque config applies (or none): DeviceClass configs
//!   (`FromClass`) rank below claim configs (`FromClaim`); within a source a config naming the
//!   request beats one for all requests; among equals the later one wins;
//! - a config kind that does not fit the device (a `GpuConfig` on a MIG device, a
//!   `MigDeviceConfig` on a whole GPU) is an error, never silently ignored;
//! - devices with the same effective sharing config form one group (one MPS daemon, one
//!   time-slice setting); a group carries the api crate's validated [`Sharing`] value as is,
//!   so the node plugin applies exactly what the webhook checked;
//! - at most one group of a claim uses MPS (a container may get all of a claim's devices,
//!   and two MPS pipe directories cannot both be mounted where clients look).

use gpu_dra_api::{ClaimDevice, Config, Errors, Sharing};
use gpu_dra_device::{DeviceRef, Inventory};

use crate::memory_shares::MemoryShare;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Why a claim cannot be planned. Messages name the field and what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The claim has no `status.allocation`.
    #[error("claim {claim} is not allocated (status.allocation is empty); wait for the scheduler")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The API server holds a different claim under this name (deleted and recreated).
    #[error(
        "claim {claim} was replaced: the kubelet asked for UID {expected}, the API server has UID {actual}"
    )]
    Replaced {
        /// `namespace/name`.
        claim: String,
        /// UID the kubelet asked for.
        expected: String,
        /// UID the API server returned.
        actual: String,
    },
    /// An allocated device is not in this node's inventory.
    #[error(
        "status.allocation.devices.results[{index}].device: {device} is not a device of this node (known: {known})"
    )]
    UnknownDevice {
        /// Index of the result.
        index: usize,
        /// Device name.
        device: String,
        /// Names of the devices this node has.
        known: String,
    },
    /// The opaque config is not valid (or not valid for the devices it applies to). The
    /// messages are the `api` crate's, the same the admission webhook gives, with paths from
    /// the claim's `status.allocation`.
    #[error("{}", config_errors(*index, errors))]
    Config {
        /// Index of the config in the allocation.
        index: usize,
        /// What is wrong, with paths inside the opaque parameters.
        errors: Errors,
    },
    /// Two MPS configs apply to devices of the claim, so a container could be given two MPS
    /// daemons (see [`gpu_dra_api::two_mps_configs_message`]).
    #[error("status.allocation.devices.config[{index}]: {message}")]
    TwoMpsDaemons {
        /// Index of the second config in the allocation.
        index: usize,
        /// The api crate's message, naming both configs' requests and what to do.
        message: String,
    },
}

fn config_errors(index: usize, errors: &Errors) -> String {
    let prefix = format!("status.allocation.devices.config[{index}].opaque.parameters");
    let lines: Vec<String> = errors
        .clone()
        .with_prefix(&prefix)
        .iter()
        .map(ToString::to_string)
        .collect();
    lines.join("; ")
}

/// Where an opaque config came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ConfigSource {
    /// From the DeviceClass (`FromClass`); ranks below claim configs.
    FromClass,
    /// From the claim itself (`FromClaim`).
    FromClaim,
}

/// One opaque config of our driver, as copied into `status.allocation.devices.config`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpaqueConfig {
    /// Index in `status.allocation.devices.config` (for error paths).
    pub index: usize,
    /// Source of the config.
    pub source: ConfigSource,
    /// Requests it applies to; empty = all requests.
    pub requests: Vec<String>,
    /// The opaque parameters object (`apiVersion`, `kind`, ...).
    pub parameters: Value,
}

/// One allocated device of our driver on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// Index in `status.allocation.devices.results`.
    pub index: usize,
    /// Request name as allocated (may be `req/sub`).
    pub request: String,
    /// Device name in the pool.
    pub device: String,
    /// Admin access: the device may be shared with other claims.
    pub admin_access: bool,
    /// Share ID when the device was allocated as one share (consumable capacity).
    pub share_id: Option<String>,
    /// `consumedCapacity.memory` of the allocation, in bytes (set by the scheduler for
    /// devices that allow multiple allocations).
    pub consumed_memory: Option<u64>,
    /// `consumedCapacity.shares` of the allocation (NVIDIA's `<N>` consumable shares).
    pub consumed_shares: Option<u64>,
}

/// The parts of a ResourceClaim that planning needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimInput {
    /// Claim UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Allocated devices of our driver in our pool.
    pub devices: Vec<AllocatedDevice>,
    /// Opaque configs of our driver.
    pub configs: Vec<OpaqueConfig>,
}

/// Strips a subrequest name: `req/sub` -> `req`.
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// Takes what planning needs from a ResourceClaim fetched from the API server.
///
/// `expected_uid` is the UID the kubelet asked for; `pool` is this node's pool (the node name).
pub fn claim_input(
    claim: &ResourceClaim,
    expected_uid: &str,
    driver: &str,
    pool: &str,
) -> Result<ClaimInput, PlanError> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let who = format!("{namespace}/{name}");
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    if uid != expected_uid {
        return Err(PlanError::Replaced {
            claim: who,
            expected: expected_uid.to_owned(),
            actual: uid,
        });
    }
    let Some(devices) = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .map(|a| a.devices.clone().unwrap_or_default())
    else {
        return Err(PlanError::NotAllocated { claim: who });
    };
    let results = devices
        .results
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.driver == driver && r.pool == pool)
        .map(|(index, r)| AllocatedDevice {
            index,
            consumed_memory: consumed(&r, crate::slices::cap::MEMORY),
            consumed_shares: consumed(&r, crate::slices::cap::SHARES),
            request: r.request,
            device: r.device,
            admin_access: r.admin_access.unwrap_or(false),
            share_id: r.share_id,
        })
        .collect();
    let configs = devices
        .config
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .filter_map(|(index, c)| {
            let opaque = c.opaque?;
            (opaque.driver == driver).then(|| OpaqueConfig {
                index,
                source: if c.source == "FromClass" {
                    ConfigSource::FromClass
                } else {
                    ConfigSource::FromClaim
                },
                requests: c.requests.unwrap_or_default(),
                parameters: opaque.parameters.0,
            })
        })
        .collect();
    Ok(ClaimInput {
        uid,
        namespace,
        name,
        devices: results,
        configs,
    })
}

/// `consumedCapacity.<name>` of an allocation result as a whole number (bytes for memory),
/// rounded up.
fn consumed(
    result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
    name: &str,
) -> Option<u64> {
    result
        .consumed_capacity
        .as_ref()
        .and_then(|c| c.get(name))
        .and_then(|q| gpu_dra_api::quantity::Quantity::parse(&q.0).ok())
        .and_then(|q| q.to_bytes_ceil().ok())
}

/// Decodes and validates opaque parameters (the `api` crate's one validation sits behind it).
pub trait ConfigDecoder {
    /// Decodes `parameters` for the devices with the given UUIDs; `Err` carries every problem
    /// with its field path inside the parameters.
    fn decode(&self, parameters: &Value, devices: &[DeviceTarget]) -> Result<Config, Errors>;
}

/// A device a config is validated against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTarget {
    /// Device UUID.
    pub uuid: String,
    /// True for a MIG device.
    pub is_mig: bool,
    /// CUDA compute capability (major, minor) of the GPU or of a MIG device's parent GPU.
    pub compute_capability: (u32, u32),
}

/// What the node plugin needs to build device nodes for one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNodesNeed {
    /// Minor of the (parent) GPU: `/dev/nvidia<minor>`.
    pub gpu_minor: u32,
    /// For a MIG device: GPU instance and compute instance IDs (capability files).
    pub mig: Option<MigIds>,
}

/// GPU instance and compute instance IDs of a MIG device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigIds {
    /// GPU instance ID.
    pub gi: u32,
    /// Compute instance ID.
    pub ci: u32,
}

/// The plan for one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePlan {
    /// Device name in the pool.
    pub device: String,
    /// Request names (subrequests stripped) this device answers, in allocation order.
    pub request_names: Vec<String>,
    /// Device UUID.
    pub uuid: String,
    /// Parent GPU UUID (the device itself for a whole GPU).
    pub gpu_uuid: String,
    /// Device nodes to resolve.
    pub nodes: DeviceNodesNeed,
    /// Admin access (may overlap other claims).
    pub admin_access: bool,
    /// Share ID, when allocated as a share.
    pub share_id: Option<String>,
    /// The claim's share of a device allocated as one share (with a share ID): of a
    /// memory-share GPU, or of a whole GPU or MIG device under consumable shares. Its `bytes`
    /// are the memory the allocation consumes, 0 when it consumes none (NVIDIA's `unlimited`
    /// and `<N>` modes by default): then nothing limits its memory.
    pub memory_share: Option<MemoryShare>,
    /// The `shares` the allocation consumes (NVIDIA's `<N>` consumable shares).
    pub shares: Option<u64>,
    /// Index of the sharing group in [`Plan::groups`].
    pub group: usize,
}

/// Devices sharing one effective config.
#[derive(Debug, Clone, PartialEq)]
pub struct SharingGroup {
    /// Name, unique within the claim ([`crate::sharing::group_name`]).
    pub name: String,
    /// Index of the config in the allocation that produced it (`None` = no config).
    pub config_index: Option<usize>,
    /// Sharing action, the api crate's validated value; `None` = exclusive devices.
    pub sharing: Option<Sharing>,
    /// Indexes into [`Plan::devices`].
    pub devices: Vec<usize>,
}

/// Everything needed to prepare one claim on this node.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Claim UID.
    pub claim_uid: String,
    /// The claim's namespace: the tenant its containers belong to (a shared MPS daemon serves
    /// one namespace at a time).
    pub namespace: String,
    /// Devices, in allocation order, each listed once.
    pub devices: Vec<DevicePlan>,
    /// Sharing groups.
    pub groups: Vec<SharingGroup>,
}

/// Picks the config that applies to a result: highest (source, specificity, position).
fn effective_config<'c>(configs: &'c [OpaqueConfig], request: &str) -> Option<&'c OpaqueConfig> {
    let base = base_request(request);
    configs
        .iter()
        .filter_map(|c| {
            let specific = if c.requests.is_empty() {
                false
            } else if c.requests.iter().any(|r| r == request || r == base) {
                true
            } else {
                return None;
            };
            Some(((c.source, specific, c.index), c))
        })
        .max_by_key(|(key, _)| *key)
        .map(|(_, c)| c)
}

/// Builds the plan for a claim. Pure; deterministic for equal inputs.
pub fn plan(
    input: &ClaimInput,
    inventory: &Inventory,
    decoder: &dyn ConfigDecoder,
) -> Result<Plan, PlanError> {
    let mut devices: Vec<DevicePlan> = Vec::new();
    // Config index chosen per device (parallel to `devices`).
    let mut chosen: Vec<Option<usize>> = Vec::new();
    // Compute capability of each device's (parent) GPU (parallel to `devices`), which some
    // config rules need and the plan itself does not carry.
    let mut capabilities: Vec<(u32, u32)> = Vec::new();
    for result in &input.devices {
        let request = base_request(&result.request).to_owned();
        let config = effective_config(&input.configs, &result.request).map(|c| c.index);
        if let Some(existing) = devices.iter_mut().find(|d| d.device == result.device) {
            // The same device under several requests (admin access): one entry, all names.
            if !existing.request_names.contains(&request) {
                existing.request_names.push(request);
            }
            continue;
        }
        let Some(dev) = inventory.device(&result.device) else {
            let known: Vec<String> = inventory.devices().map(|d| d.name()).collect();
            return Err(PlanError::UnknownDevice {
                index: result.index,
                device: result.device.clone(),
                known: known.join(", "),
            });
        };
        let memory_share = result.share_id.as_ref().map(|_| {
            let cc = dev.gpu().cuda_compute_capability;
            MemoryShare {
                bytes: result.consumed_memory.unwrap_or(0),
                total_bytes: match dev {
                    DeviceRef::Gpu(g) => g.memory_bytes,
                    DeviceRef::Mig { mig, .. } => mig.memory_bytes,
                },
                compute_capability: (cc.major, cc.minor),
            }
        });
        let nodes = match dev {
            DeviceRef::Gpu(g) => DeviceNodesNeed {
                gpu_minor: g.minor,
                mig: None,
            },
            DeviceRef::Mig { parent, mig } => DeviceNodesNeed {
                gpu_minor: parent.minor,
                mig: Some(MigIds {
                    gi: mig.gi_id,
                    ci: mig.ci_id,
                }),
            },
        };
        devices.push(DevicePlan {
            device: result.device.clone(),
            request_names: vec![request],
            uuid: dev.uuid().to_owned(),
            gpu_uuid: dev.gpu().uuid.clone(),
            nodes,
            admin_access: result.admin_access,
            share_id: result.share_id.clone(),
            memory_share,
            shares: result.consumed_shares.filter(|_| result.share_id.is_some()),
            group: 0,
        });
        chosen.push(config);
        let cc = dev.gpu().cuda_compute_capability;
        capabilities.push((cc.major, cc.minor));
    }

    // Group devices by chosen config, in first-seen order, then decode each config once
    // against all of its devices.
    let mut groups: Vec<SharingGroup> = Vec::new();
    for (i, config_index) in chosen.iter().enumerate() {
        let g = match groups.iter().position(|g| g.config_index == *config_index) {
            Some(g) => g,
            None => {
                groups.push(SharingGroup {
                    name: crate::sharing::group_name(*config_index),
                    config_index: *config_index,
                    sharing: None,
                    devices: Vec::new(),
                });
                groups.len() - 1
            }
        };
        groups[g].devices.push(i);
        devices[i].group = g;
    }
    for group in &mut groups {
        let Some(index) = group.config_index else {
            continue;
        };
        let Some(config) = input.configs.iter().find(|c| c.index == index) else {
            continue;
        };
        let targets: Vec<DeviceTarget> = group
            .devices
            .iter()
            .map(|&d| DeviceTarget {
                uuid: devices[d].uuid.clone(),
                is_mig: devices[d].nodes.mig.is_some(),
                compute_capability: capabilities[d],
            })
            .collect();
        let decoded = decoder
            .decode(&config.parameters, &targets)
            .map_err(|errors| PlanError::Config { index, errors })?;
        group.sharing = decoded.sharing().cloned();
    }
    check_one_mps_daemon(&groups, &devices)?;
    for group in &groups {
        check_mps_share(group, &devices)?;
    }
    Ok(Plan {
        claim_uid: input.uid.clone(),
        namespace: input.namespace.clone(),
        devices,
        groups,
    })
}

/// Refuses a claim with two MPS groups: the kubelet gives a container every device of the
/// requests it names (all of the claim's when it names none), so any two of a claim's MPS
/// groups can meet in one container, where the second pipe directory mount would hide the
/// first. The api crate gives the webhook the same message from the claim spec; here it also
/// covers DeviceClass configs and configs for all requests.
fn check_one_mps_daemon(groups: &[SharingGroup], devices: &[DevicePlan]) -> Result<(), PlanError> {
    let mut mps = groups
        .iter()
        .filter(|g| matches!(g.sharing, Some(Sharing::Mps(_))));
    let (Some(first), Some(second)) = (mps.next(), mps.next()) else {
        return Ok(());
    };
    let requests = |g: &SharingGroup| {
        let mut names: Vec<String> = Vec::new();
        for &d in &g.devices {
            for r in &devices[d].request_names {
                if !names.contains(r) {
                    names.push(r.clone());
                }
            }
        }
        names
    };
    Err(PlanError::TwoMpsDaemons {
        index: second.config_index.unwrap_or_default(),
        message: gpu_dra_api::two_mps_configs_message(&requests(first), &requests(second)),
    })
}

/// Checks an MPS group that holds a memory share: the share is served by the GPU's one MPS
/// daemon, shared by every claim on it, so the group must be that one device (another device
/// would need a daemon of the claim's own, and a container can mount only one pipe
/// directory), and a pinned memory limit the config sets must fit in the share.
fn check_mps_share(group: &SharingGroup, devices: &[DevicePlan]) -> Result<(), PlanError> {
    let (Some(Sharing::Mps(config)), Some(index)) = (&group.sharing, group.config_index) else {
        return Ok(());
    };
    let Some(share_device) = group
        .devices
        .iter()
        .map(|&d| &devices[d])
        .find(|d| d.memory_share.is_some())
    else {
        return Ok(());
    };
    let mut errors = Errors::new();
    if group.devices.len() > 1 {
        errors.push(
            "sharing.mpsConfig",
            format!(
                "applies to {} devices, one of them the memory share {} (request {}): an MPS config on a memory share must apply to that device alone; give its request a config of its own",
                group.devices.len(),
                share_device.device,
                share_device.request_names.join(", ")
            ),
        );
        return Err(PlanError::Config { index, errors });
    }
    let share = share_device.memory_share.unwrap_or(MemoryShare {
        bytes: 0,
        total_bytes: 0,
        compute_capability: (0, 0),
    });
    if share.bytes == 0 {
        // A share consuming no memory (consumable shares, `unlimited` or `<N>`): the config's
        // limits are all there is, nothing to fit them in.
        return errors
            .into_result(())
            .map_err(|errors| PlanError::Config { index, errors });
    }
    let share_text = crate::slices::capacity_quantity(share.bytes).0;
    let uuids = [share_device.uuid.as_str()];
    let mut overridden = false;
    for (key, mib) in &config.per_device_pinned_memory_limit_mib {
        if key.resolve(&uuids).is_none() {
            continue;
        }
        overridden = true;
        if *mib > share.mib() {
            errors.push(
                format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]"),
                format!(
                    "{mib}Mi is more than the claim's memory share of {} ({share_text}, consumedCapacity.memory); request more memory (capacity.requests.memory) or lower the limit",
                    share_device.device
                ),
            );
        }
    }
    if let Some(mib) = config.pinned_memory_limit_mib
        && !overridden
        && mib > share.mib()
    {
        errors.push(
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            format!(
                "{mib}Mi is more than the claim's memory share of {} ({share_text}, consumedCapacity.memory); request more memory (capacity.requests.memory) or lower the limit",
                share_device.device
            ),
        );
    }
    errors
        .into_result(())
        .map_err(|errors| PlanError::Config { index, errors })
}

/// The decoder the driver runs: the `api` crate's strict decoding and validation, then its
/// allocation-time rules against the devices the config lands on. The one validation that
/// the webhook and the CLI run too, so a config is judged the same everywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiDecoder;

impl ConfigDecoder for ApiDecoder {
    fn decode(&self, parameters: &Value, devices: &[DeviceTarget]) -> Result<Config, Errors> {
        let config = gpu_dra_api::decode(parameters)?;
        let claim_devices: Vec<ClaimDevice> = devices
            .iter()
            .map(|d| ClaimDevice {
                uuid: d.uuid.clone(),
                is_mig: d.is_mig,
                compute_capability: Some(d.compute_capability),
            })
            .collect();
        gpu_dra_api::validate_for_devices(&config, &claim_devices)?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::testing::{self, a100, mig_1g5gb};
    use serde_json::json;

    /// GPU 0 whole, GPU 1 with MIG on and two `1g.5gb` devices (GPU instances 7 and 8).
    fn inventory() -> Inventory {
        testing::inventory([
            a100(0).build(),
            a100(1).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build(),
        ])
    }

    fn dev(index: usize, request: &str, device: &str) -> AllocatedDevice {
        AllocatedDevice {
            index,
            request: request.into(),
            device: device.into(),
            admin_access: false,
            share_id: None,
            consumed_memory: None,
            consumed_shares: None,
        }
    }

    fn cfg(index: usize, source: ConfigSource, requests: &[&str], params: Value) -> OpaqueConfig {
        OpaqueConfig {
            index,
            source,
            requests: requests.iter().map(|s| s.to_string()).collect(),
            parameters: params,
        }
    }

    fn gpu_cfg(interval: &str) -> Value {
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
               "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}})
    }

    fn input(devices: Vec<AllocatedDevice>, configs: Vec<OpaqueConfig>) -> ClaimInput {
        ClaimInput {
            uid: "uid-1".into(),
            namespace: "ns".into(),
            name: "c".into(),
            devices,
            configs,
        }
    }

    fn interval(plan: &Plan, device: usize) -> Option<&'static str> {
        match &plan.groups[plan.devices[device].group].sharing {
            Some(Sharing::TimeSlicing { interval }) => Some(interval.as_str()),
            _ => None,
        }
    }

    #[test]
    fn claim_config_beats_class_config_and_specific_beats_general() {
        let configs = vec![
            cfg(0, ConfigSource::FromClass, &["gpu"], gpu_cfg("Long")),
            cfg(1, ConfigSource::FromClaim, &[], gpu_cfg("Short")),
            cfg(2, ConfigSource::FromClaim, &["gpu"], gpu_cfg("Medium")),
            cfg(3, ConfigSource::FromClaim, &[], gpu_cfg("Default")),
        ];
        let p = plan(
            &input(vec![dev(0, "gpu/sub", "gpu-0")], configs),
            &inventory(),
            &ApiDecoder,
        )
        .expect("plans");
        assert_eq!(p.devices[0].request_names, ["gpu"]);
        assert_eq!(interval(&p, 0), Some("Medium"));
    }

    #[test]
    fn later_config_wins_among_equals_and_class_applies_without_claim_config() {
        let configs = vec![
            cfg(0, ConfigSource::FromClass, &[], gpu_cfg("Long")),
            cfg(1, ConfigSource::FromClass, &[], gpu_cfg("Short")),
        ];
        let p = plan(
            &input(vec![dev(0, "gpu", "gpu-0")], configs),
            &inventory(),
            &ApiDecoder,
        )
        .expect("plans");
        assert_eq!(interval(&p, 0), Some("Short"));
    }

    #[test]
    fn gpu_config_on_mig_device_is_an_error_naming_the_device() {
        let configs = vec![cfg(4, ConfigSource::FromClaim, &[], gpu_cfg("Long"))];
        let err = plan(
            &input(vec![dev(0, "mig", "gpu-1-mig-1g5gb-19-0")], configs),
            &inventory(),
            &ApiDecoder,
        )
        .expect_err("kind mismatch");
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "status.allocation.devices.config[4].opaque.parameters.kind: GpuConfig applies to full GPUs"
            ),
            "{msg}"
        );
        let uuid = inventory()
            .device("gpu-1-mig-1g5gb-19-0")
            .map(|d| d.uuid().to_owned())
            .expect("device");
        assert!(msg.contains(&uuid), "{msg}");
    }

    #[test]
    fn two_mig_devices_of_one_gpu_keep_their_own_instances() {
        let p = plan(
            &input(
                vec![
                    dev(0, "a", "gpu-1-mig-1g5gb-19-0"),
                    dev(1, "b", "gpu-1-mig-1g5gb-19-1"),
                ],
                vec![],
            ),
            &inventory(),
            &ApiDecoder,
        )
        .expect("plans");
        assert_eq!(p.devices.len(), 2);
        assert_eq!(p.devices[0].nodes.mig, Some(MigIds { gi: 7, ci: 0 }));
        assert_eq!(p.devices[1].nodes.mig, Some(MigIds { gi: 8, ci: 0 }));
        assert_eq!(
            p.devices[1].gpu_uuid,
            "GPU-00000001-1111-2222-3333-444444444444"
        );
        assert_eq!(p.groups.len(), 1);
        assert_eq!(p.groups[0].sharing, None);
    }

    #[test]
    fn unknown_device_is_an_error_listing_known_devices() {
        let err = plan(
            &input(vec![dev(3, "gpu", "gpu-9")], vec![]),
            &inventory(),
            &ApiDecoder,
        )
        .expect_err("unknown");
        let msg = err.to_string();
        assert!(msg.contains("results[3].device: gpu-9"), "{msg}");
        assert!(msg.contains("gpu-0"), "{msg}");
    }

    #[test]
    fn claim_input_checks_uid_allocation_driver_and_pool() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
            "spec": {},
            "status": {"allocation": {"devices": {
                "results": [
                    {"request": "gpu/x", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"},
                    {"request": "gpu", "driver": "other", "pool": "node-a", "device": "d"},
                    {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-b", "device": "gpu-1"}
                ],
                "config": [
                    {"source": "FromClass", "requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}}},
                    {"source": "FromClaim", "opaque": {"driver": "other", "parameters": {}}}
                ]
            }}}
        }))
        .expect("valid claim");
        let input = claim_input(&claim, "u1", "gpu.nvidia.com", "node-a").expect("input");
        assert_eq!(input.devices.len(), 1);
        assert_eq!(input.devices[0].device, "gpu-0");
        assert_eq!(input.configs.len(), 1);
        assert_eq!(input.configs[0].source, ConfigSource::FromClass);

        let replaced = claim_input(&claim, "u2", "gpu.nvidia.com", "node-a").expect_err("uid");
        assert!(replaced.to_string().contains("replaced"));
        let mut unallocated = claim.clone();
        unallocated.status = None;
        let err = claim_input(&unallocated, "u1", "gpu.nvidia.com", "node-a").expect_err("alloc");
        assert!(matches!(err, PlanError::NotAllocated { .. }));
    }

    #[test]
    fn api_decoder_judges_like_the_webhook() {
        let d = ApiDecoder;
        let err = d
            .decode(&json!({"apiVersion": "x/v1", "kind": "GpuConfig"}), &[])
            .expect_err("apiVersion");
        assert!(err.to_string().starts_with("apiVersion: "), "{err}");
        let err = d
            .decode(
                &json!({"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "mps"}}),
                &[],
            )
            .expect_err("strategy");
        assert!(err.to_string().contains("did you mean \"MPS\"?"), "{err}");
        let mps = d
            .decode(
                &json!({"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "MigDeviceConfig",
                        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}),
                &[DeviceTarget {
                    uuid: "MIG-1".into(),
                    is_mig: true,
                    compute_capability: (8, 0),
                }],
            )
            .expect("mps");
        assert_eq!(mps.kind(), gpu_dra_api::ConfigKind::Mig);
        let Some(Sharing::Mps(config)) = mps.sharing() else {
            panic!("MPS expected");
        };
        assert_eq!(config.active_thread_percentage, Some(50));
    }

    fn mps_cfg(per_device: Value) -> Value {
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {
                   "defaultPinnedDeviceMemoryLimit": "1Gi",
                   "defaultPerDevicePinnedMemoryLimit": per_device}}})
    }

    /// A second GPU of the same shape, for claims of two whole GPUs.
    fn two_gpus() -> Inventory {
        testing::inventory([a100(0).build(), a100(1).build(), a100(2).build()])
    }

    #[test]
    fn multi_user_mps_is_refused_on_a_gpu_older_than_volta() {
        let mut pascal = a100(0).build();
        pascal.cuda_compute_capability = gpu_dra_device::ComputeCapability { major: 6, minor: 0 };
        let inventory = testing::inventory([pascal, a100(1).build()]);
        let multi_user = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": true}}});
        let configs = || vec![cfg(0, ConfigSource::FromClaim, &[], multi_user.clone())];
        let err = plan(
            &input(vec![dev(0, "gpu", "gpu-0")], configs()),
            &inventory,
            &ApiDecoder,
        )
        .expect_err("a 6.0 GPU cannot run a multi-user daemon");
        let PlanError::Config { index: 0, errors } = &err else {
            panic!("config error expected, got {err:?}");
        };
        assert_eq!(errors.len(), 1, "{errors}");
        assert_eq!(errors.0[0].path, "sharing.mpsConfig.multiUser", "{errors}");
        assert!(errors.0[0].message.contains("has 6.0"), "{errors}");
        let p = plan(
            &input(vec![dev(0, "gpu", "gpu-1")], configs()),
            &inventory,
            &ApiDecoder,
        )
        .expect("an 8.0 GPU can");
        let Some(Sharing::Mps(mps)) = &p.groups[0].sharing else {
            panic!("MPS expected");
        };
        assert!(mps.multi_user);
    }

    #[test]
    fn groups_carry_the_api_value_and_a_name() {
        let configs = vec![cfg(
            3,
            ConfigSource::FromClaim,
            &[],
            mps_cfg(json!({"0": "2Gi"})),
        )];
        let p = plan(
            &input(
                vec![dev(0, "gpu", "gpu-2"), dev(1, "gpu", "gpu-0")],
                configs,
            ),
            &two_gpus(),
            &ApiDecoder,
        )
        .expect("plans");
        assert_eq!(p.groups.len(), 1);
        assert_eq!(p.groups[0].name, "c3");
        let Some(Sharing::Mps(m)) = &p.groups[0].sharing else {
            panic!("MPS expected");
        };
        assert_eq!(m.pinned_memory_limit_mib, Some(1024));
        // Index 0 is the smaller UUID, gpu-0's, though gpu-2 was allocated first.
        let devices = crate::sharing::shared_devices(&p, &p.groups[0]);
        let limits = crate::sharing::mps_limits(m, &devices);
        assert_eq!(limits.pinned_memory_mib[&p.devices[1].uuid], 2048);
        assert_eq!(limits.pinned_memory_mib[&p.devices[0].uuid], 1024);
        assert!(p.devices[1].uuid < p.devices[0].uuid);
    }

    #[test]
    fn two_mps_groups_in_one_claim_are_refused_naming_both() {
        let configs = vec![
            cfg(0, ConfigSource::FromClass, &[], mps_cfg(json!({}))),
            cfg(1, ConfigSource::FromClaim, &["b"], mps_cfg(json!({}))),
        ];
        let err = plan(
            &input(vec![dev(0, "a", "gpu-0"), dev(1, "b/x", "gpu-1")], configs),
            &two_gpus(),
            &ApiDecoder,
        )
        .expect_err("two MPS daemons");
        assert_eq!(
            err.to_string(),
            format!(
                "status.allocation.devices.config[1]: {}",
                gpu_dra_api::two_mps_configs_message(&["a".into()], &["b".into()])
            )
        );
        // One MPS config and one time-slicing config: fine.
        let configs = vec![
            cfg(0, ConfigSource::FromClaim, &["a"], gpu_cfg("Long")),
            cfg(1, ConfigSource::FromClaim, &["b"], mps_cfg(json!({}))),
        ];
        plan(
            &input(vec![dev(0, "a", "gpu-0"), dev(1, "b", "gpu-1")], configs),
            &two_gpus(),
            &ApiDecoder,
        )
        .expect("one MPS group");
    }

    #[test]
    fn config_errors_carry_the_allocation_path() {
        let configs = vec![cfg(
            2,
            ConfigSource::FromClaim,
            &[],
            json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                   "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}}),
        )];
        let err = plan(
            &input(vec![dev(0, "gpu", "gpu-0")], configs),
            &inventory(),
            &ApiDecoder,
        )
        .expect_err("out of range");
        assert_eq!(
            err.to_string(),
            "status.allocation.devices.config[2].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: 150 is out of range 1..=100"
        );
    }

    fn share(index: usize, request: &str, device: &str, gib: u64) -> AllocatedDevice {
        AllocatedDevice {
            share_id: Some(format!("share-{index}")),
            consumed_memory: Some(gib << 30),
            ..dev(index, request, device)
        }
    }

    fn mps_limit_cfg(limit: &str) -> Value {
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": limit}}})
    }

    #[test]
    fn claim_input_reads_share_id_and_consumed_memory() {
        let mut claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0",
                 "shareID": "7d3c6f4e-0000-4000-8000-000000000001",
                 "consumedCapacity": {"memory": "10Gi"}}
            ]}}}
        }))
        .expect("claim");
        let input = claim_input(&claim, "uid-1", "gpu.nvidia.com", "node-a").expect("input");
        assert_eq!(input.devices[0].consumed_memory, Some(10 << 30));
        let p = plan(&input, &inventory(), &ApiDecoder).expect("plan");
        assert_eq!(
            p.devices[0].memory_share,
            Some(MemoryShare {
                bytes: 10 << 30,
                total_bytes: 40 << 30,
                compute_capability: (8, 0),
            })
        );
        // Without a share ID (a single-allocation device) there is no share.
        claim
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
            .expect("results")[0]
            .share_id = None;
        let input = claim_input(&claim, "uid-1", "gpu.nvidia.com", "node-a").expect("input");
        let p = plan(&input, &inventory(), &ApiDecoder).expect("plan");
        assert_eq!(p.devices[0].memory_share, None);
    }

    #[test]
    fn an_mps_limit_above_the_share_is_refused_with_its_path() {
        let err = plan(
            &input(
                vec![share(0, "gpu", "gpu-0", 10)],
                vec![cfg(0, ConfigSource::FromClaim, &[], mps_limit_cfg("12Gi"))],
            ),
            &inventory(),
            &ApiDecoder,
        )
        .expect_err("limit above the share");
        let text = err.to_string();
        assert!(
            text.starts_with("status.allocation.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 12288Mi is more than the claim's memory share of gpu-0 (10Gi"),
            "{text}"
        );
        // Within the share: fine.
        plan(
            &input(
                vec![share(0, "gpu", "gpu-0", 10)],
                vec![cfg(0, ConfigSource::FromClaim, &[], mps_limit_cfg("8Gi"))],
            ),
            &inventory(),
            &ApiDecoder,
        )
        .expect("limit within the share");
    }

    /// Consumable shares: a MIG device held as one share (NVIDIA's `unlimited` and `<N>`
    /// modes consume no memory by default), and its `shares`.
    #[test]
    fn a_share_of_a_mig_device_carries_its_memory_and_shares() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "mig", "driver": "gpu.nvidia.com", "pool": "node-a",
                 "device": "gpu-1-mig-1g5gb-19-0",
                 "shareID": "7d3c6f4e-0000-4000-8000-000000000002",
                 "consumedCapacity": {"memory": "0", "shares": "2", "multiprocessors": "0"}}
            ]}}}
        }))
        .expect("claim");
        let input = claim_input(&claim, "uid-1", "gpu.nvidia.com", "node-a").expect("input");
        assert_eq!(input.devices[0].consumed_shares, Some(2));
        let p = plan(&input, &inventory(), &ApiDecoder).expect("plan");
        assert_eq!(p.devices[0].shares, Some(2));
        assert_eq!(
            p.devices[0].memory_share,
            Some(MemoryShare {
                bytes: 0,
                total_bytes: 4864 << 20,
                compute_capability: (8, 0),
            })
        );
        // An MPS limit on a share that consumes no memory has nothing to fit in: accepted.
        let mig_mps = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "2Gi"}}});
        let mut input = input;
        input.configs = vec![cfg(0, ConfigSource::FromClaim, &[], mig_mps)];
        plan(&input, &inventory(), &ApiDecoder).expect("limit on a share without memory");
    }

    #[test]
    fn an_mps_config_on_a_share_and_another_device_is_refused() {
        let err = plan(
            &input(
                vec![share(0, "gpu", "gpu-0", 10), dev(1, "gpu", "gpu-1")],
                vec![cfg(0, ConfigSource::FromClaim, &[], mps_limit_cfg("1Gi"))],
            ),
            &two_gpus(),
            &ApiDecoder,
        )
        .expect_err("share mixed with a whole GPU");
        assert!(
            err.to_string().contains("must apply to that device alone"),
            "{err}"
        );
    }
}
