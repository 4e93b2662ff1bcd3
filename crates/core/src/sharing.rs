//! The pure parts of GPU sharing: what a plan's sharing group means on the node, before any
//! tool runs.
//!
//! The sharing values themselves are the `api` crate's ([`gpu_dra_api::Sharing`]), decoded and
//! validated once when the claim is planned; nothing here re-validates them. This module names
//! a group's daemon, resolves its MPS limits to one value per device UUID, and builds the
//! container edits a group's MPS clients need. The node plugin carries these out.
//!
//! What an MPS client container gets: the daemon's pipe directory, bind-mounted at NVIDIA's
//! default `/tmp/nvidia-mps`, and `CUDA_MPS_PIPE_DIRECTORY` naming it; device nodes come with
//! the devices themselves. It keeps its own `/dev/shm`: on driver 580 (measured on an H100) the
//! MPS server shares memory with its clients through a memfd passed over the pipe directory's
//! socket, and clients in their own PID, IPC and mount namespaces with a private `/dev/shm`
//! attach. NVIDIA documents no driver branch that needs more, but two reports do: MPS on
//! pre-Volta GPUs (compute capability below 7.0, e.g. Tesla P4) failed until the daemon's
//! `/dev/shm` was shared (kubernetes-sigs/dra-driver-nvidia-gpu issue 974, 2026), and a 2024
//! report on NVIDIA's device plugin (issue 467) found a small `cuda.shm.*` file clients needed
//! in `/dev/shm`, driver branch not stated. Neither is supported here yet (docs/STATUS.md).
//!
//! What a client gets no more than it needs, because one daemon may serve several claims (the
//! shared daemon of a memory-share or consumable-share device):
//! - The pipe directory is mounted read-only. A client connects to the daemon's sockets and
//!   opens its `log` FIFO, which Linux allows on a read-only mount (`EROFS` is for regular
//!   files, directories and links only; checked by a test of the node plugin), but it cannot
//!   create, rename or delete entries: no container can put its own listener in place of
//!   `control` for other claims' clients to connect to, or remove the daemon's sockets.
//!   A CUDA client needs no more: the server's shared memory comes over the socket (a memfd,
//!   measured on driver 580). The log directory is not mounted at all (daemon only).
//! - The spec of a claim whose containers are MPS clients mounts no `nvidia-cuda-mps-control`
//!   ([`without_control_tool`]): the control tool is the operator's front end (`quit`,
//!   `shutdown_server`, limits), never a client's. This only removes the ready-made tool: the
//!   control socket a client must reach also takes the front end's commands, and the real
//!   daemon runs them for a root peer, so a root container speaking the protocol can still
//!   stop its daemon. That is why a shared daemon serves one namespace at a time (the node
//!   plugin's `sharing::shared_mps` states and enforces that rule).

use std::collections::BTreeMap;

use gpu_dra_api::MpsConfig;
use serde::{Deserialize, Serialize};

use crate::cdi::{ContainerEdits, Mount, Spec};
use crate::memory_shares::{MemoryShare, mps_limit};
use crate::plan::{Plan, SharingGroup};

/// Where containers see the MPS pipe directory (NVIDIA's default `CUDA_MPS_PIPE_DIRECTORY`).
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// Environment variable naming the MPS pipe directory.
pub const PIPE_DIR_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";

/// Name of a plan's sharing group, unique within the claim and usable as a path component:
/// `c<N>` after the index of the config that produced it in the allocation, `c` for none.
pub fn group_name(config_index: Option<usize>) -> String {
    match config_index {
        Some(i) => format!("c{i}"),
        None => "c".to_owned(),
    }
}

/// `<claimUID>-<group>`: an MPS daemon's id and directory name.
pub fn daemon_id(claim_uid: &str, group: &str) -> String {
    format!("{claim_uid}-{group}")
}

/// Directory name of daemon `daemon_id(claim_uid, group)` under `<plugin-dir>/mps`: 16 hex
/// digits of its 64-bit FNV-1a hash. The control socket (`<dir>/pipe/control_privileged`) must
/// fit a UNIX socket address (107 bytes): named by the id it would not with the default kubelet
/// root once the config index has two digits; named by the hash it leaves 23 bytes for a longer
/// kubelet root or driver name. (Not a security boundary: claim UIDs come from the API server.)
pub fn daemon_dir_name(claim_uid: &str, group: &str) -> String {
    let hash = daemon_id(claim_uid, group)
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("{hash:016x}")
}

/// One device of a sharing group, as sharing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDevice {
    /// GPU (`GPU-…`) or MIG (`MIG-…`) UUID.
    pub uuid: String,
    /// Whether it is a MIG device (no compute mode or time-slice settings apply).
    pub mig: bool,
    /// The claim's share, when the device is allocated as one share (a memory-share GPU, or
    /// a GPU or MIG device under consumable shares; `bytes` 0 when it consumes no memory).
    pub share: Option<MemoryShare>,
}

impl SharedDevice {
    /// A whole GPU.
    pub fn gpu(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            mig: false,
            share: None,
        }
    }

    /// A MIG device.
    pub fn mig(uuid: impl Into<String>) -> Self {
        Self {
            uuid: uuid.into(),
            mig: true,
            share: None,
        }
    }
}

/// The devices of `group` in `plan`, in allocation order.
pub fn shared_devices(plan: &Plan, group: &SharingGroup) -> Vec<SharedDevice> {
    group
        .devices
        .iter()
        .filter_map(|&i| plan.devices.get(i))
        .map(|d| SharedDevice {
            uuid: d.uuid.clone(),
            mig: d.nodes.mig.is_some(),
            share: d.memory_share,
        })
        .collect()
}

/// MPS limits as the daemon takes them, device keys resolved to UUIDs. Persisted by the node
/// plugin (its field names are part of its state file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsLimits {
    /// `set_default_active_thread_percentage`.
    pub active_thread_percentage: Option<u8>,
    /// `set_default_device_pinned_mem_limit <uuid> <MiB>M`, by UUID.
    pub pinned_memory_mib: BTreeMap<String, u64>,
    /// The daemon runs multi-user (`nvidia-cuda-mps-control -M`): clients of every user share
    /// one server. Written only when set, so state files of daemons without it keep their
    /// shape and older plugins read them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

/// Resolves `config`'s limits for the group's `devices`: per device a key naming its UUID, else
/// an index key naming it ([`gpu_dra_api::DeviceKey::resolve`]: sorted UUIDs, NVIDIA's rule),
/// else the default. Keys that name no device are ignored here: the api crate's
/// `validate_for_devices` refused them when the claim was planned.
pub fn mps_limits(config: &MpsConfig, devices: &[SharedDevice]) -> MpsLimits {
    let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
    let mut by_uuid: BTreeMap<usize, u64> = BTreeMap::new();
    let mut by_index: BTreeMap<usize, u64> = BTreeMap::new();
    for (key, mib) in &config.per_device_pinned_memory_limit_mib {
        let Some(at) = key.resolve(&uuids) else {
            continue;
        };
        match key {
            gpu_dra_api::DeviceKey::Uuid(_) => by_uuid.insert(at, *mib),
            gpu_dra_api::DeviceKey::Index(_) => by_index.insert(at, *mib),
        };
    }
    let pinned_memory_mib = uuids
        .iter()
        .enumerate()
        .filter_map(|(at, uuid)| {
            let mib = by_uuid
                .get(&at)
                .or_else(|| by_index.get(&at))
                .copied()
                .or(config.pinned_memory_limit_mib)?;
            Some(((*uuid).to_owned(), mib))
        })
        .collect();
    MpsLimits {
        active_thread_percentage: config.active_thread_percentage,
        pinned_memory_mib,
        multi_user: config.multi_user,
    }
}

/// The container edits of an MPS group's clients: the daemon's pipe directory (`pipe_dir`, a
/// host path) at [`CONTAINER_PIPE_DIR`], read-only, and [`PIPE_DIR_ENV`] naming it. Nothing
/// else: no log directory, no `/dev/shm` replacement and no IPC namespace (see the module
/// documentation).
pub fn mps_edits(pipe_dir: &str) -> ContainerEdits {
    ContainerEdits {
        env: vec![format!("{PIPE_DIR_ENV}={CONTAINER_PIPE_DIR}")],
        mounts: vec![Mount::read_only(
            pipe_dir.to_owned(),
            CONTAINER_PIPE_DIR.to_owned(),
        )],
        ..Default::default()
    }
}

/// The MPS control tool's file name: the operator's front end to a daemon, which no MPS
/// client container gets (see the module documentation).
pub const MPS_CONTROL_TOOL: &str = "nvidia-cuda-mps-control";

/// Whether `edits` make a container an MPS client: they mount a pipe directory at
/// [`CONTAINER_PIPE_DIR`].
pub fn is_mps_client(edits: &ContainerEdits) -> bool {
    edits
        .mounts
        .iter()
        .any(|m| m.container_path == CONTAINER_PIPE_DIR)
}

/// Removes [`MPS_CONTROL_TOOL`] from the common edits of `spec` when any of its devices makes
/// its containers MPS clients; other specs keep it (a container with a whole GPU may run its
/// own daemon, as with NVIDIA's toolkit). Applied to every spec written, so a spec rewritten
/// for a new driver keeps the rule.
pub fn without_control_tool(mut spec: Spec) -> Spec {
    if spec
        .devices
        .iter()
        .any(|d| is_mps_client(&d.container_edits))
    {
        spec.container_edits
            .mounts
            .retain(|m| m.container_path.rsplit('/').next() != Some(MPS_CONTROL_TOOL));
    }
    spec
}

/// Owner part of the id of a memory-share GPU's MPS daemon (`memory-shares-<GPU UUID>`): one
/// daemon per GPU, shared by every claim holding a share of it, so it belongs to no claim.
pub const MEMORY_SHARE_DAEMON_OWNER: &str = "memory-shares";
/// Client variable: the active thread percentage of the client's context (MPS lets a client
/// lower, never raise, the daemon's default).
pub const ACTIVE_THREAD_PERCENTAGE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// Client variable: `<device ordinal>=<limit>[,...]`, the client's pinned device memory limit
/// (MPS lets a client lower, never raise, the daemon's default).
pub const PINNED_MEMORY_LIMIT_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// The environment of an MPS client holding `share` of its device under `config`: its
/// pinned memory limit (the config's limit for the device, which planning checked fits in the
/// share, else the share) and its active thread percentage (the config's, else the share's
/// part of the memory, see [`MemoryShare::thread_percentage`]). A share that consumes no
/// memory (consumable shares, `unlimited` or `<N>`) gets the config's limits only. The device
/// is ordinal 0: the daemon serves that one device and the client sees no other through it.
pub fn mps_share_env(
    config: &MpsConfig,
    device: &SharedDevice,
    share: &MemoryShare,
) -> Vec<String> {
    let limits = mps_limits(config, std::slice::from_ref(device));
    let configured = limits.pinned_memory_mib.get(&device.uuid).copied();
    let (mib, pct) = if share.bytes == 0 {
        (configured, config.active_thread_percentage)
    } else {
        (
            Some(configured.unwrap_or_else(|| share.mib()).min(share.mib())),
            Some(
                config
                    .active_thread_percentage
                    .unwrap_or_else(|| share.thread_percentage()),
            ),
        )
    };
    let mut env = Vec::new();
    if let Some(mib) = mib {
        env.push(format!("{PINNED_MEMORY_LIMIT_ENV}=0={}", mps_limit(mib)));
    }
    if let Some(pct) = pct {
        env.push(format!("{ACTIVE_THREAD_PERCENTAGE_ENV}={pct}"));
    }
    env
}

#[cfg(test)]
mod tests {
    #[test]
    fn daemon_dirs_are_short_distinct_and_stable() {
        let uid = "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b";
        let a = super::daemon_dir_name(uid, "c1");
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, super::daemon_dir_name(uid, "c1"));
        assert_ne!(a, super::daemon_dir_name(uid, "c10"));
        assert_ne!(
            a,
            super::daemon_dir_name("0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7c", "c1")
        );
        // FNV-1a 64 of the empty string is its offset basis (the function is FNV-1a).
        assert_eq!(
            "-".bytes()
                .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b))
                    .wrapping_mul(0x0000_0100_0000_01b3)),
            u64::from_str_radix(&super::daemon_dir_name("", ""), 16).unwrap()
        );
    }

    use super::*;
    use gpu_dra_api::DeviceKey;

    // Allocation order differs from sorted UUID order on purpose: sorted, GPU-1 < GPU-2 < GPU-3.
    fn devices() -> Vec<SharedDevice> {
        ["GPU-3", "GPU-1", "GPU-2"].map(SharedDevice::gpu).to_vec()
    }

    #[test]
    fn limits_resolve_uuid_over_index_over_default_with_sorted_indexes() {
        let config = MpsConfig {
            active_thread_percentage: Some(50),
            pinned_memory_limit_mib: Some(1024),
            per_device_pinned_memory_limit_mib: [
                (DeviceKey::Index(0), 2048),
                (DeviceKey::Index(1), 4096),
                (DeviceKey::Uuid("gpu-2".into()), 512),
            ]
            .into(),
            multi_user: false,
        };
        let l = mps_limits(&config, &devices());
        assert_eq!(l.active_thread_percentage, Some(50));
        assert_eq!(
            l.pinned_memory_mib,
            [
                // Index 0 is the smallest UUID, GPU-1, though it was allocated second.
                ("GPU-1".to_owned(), 2048),
                // Index 1 is GPU-2, but its UUID key wins.
                ("GPU-2".to_owned(), 512),
                ("GPU-3".to_owned(), 1024),
            ]
            .into()
        );
    }

    #[test]
    fn no_default_leaves_unnamed_devices_unlimited() {
        let config = MpsConfig {
            per_device_pinned_memory_limit_mib: [(DeviceKey::Index(2), 100)].into(),
            ..Default::default()
        };
        assert_eq!(
            mps_limits(&config, &devices()).pinned_memory_mib,
            [("GPU-3".to_owned(), 100)].into()
        );
    }

    #[test]
    fn limits_keep_their_persisted_field_names() {
        let l = MpsLimits {
            active_thread_percentage: Some(40),
            pinned_memory_mib: [("GPU-1".to_owned(), 1024)].into(),
            multi_user: false,
        };
        assert_eq!(
            serde_json::to_value(&l).expect("serializes"),
            serde_json::json!({"activeThreadPercentage": 40, "pinnedMemoryMib": {"GPU-1": 1024}})
        );
    }

    /// Exactly what an MPS client container receives from its group: one mount, read-only (a
    /// client of a shared daemon must not replace or remove the daemon's sockets), one
    /// variable.
    #[test]
    fn mps_clients_get_the_pipe_directory_read_only_and_keep_their_own_dev_shm() {
        let e = mps_edits("/p/mps/c-c0/pipe");
        assert_eq!(
            e,
            ContainerEdits {
                env: vec!["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".into()],
                device_nodes: vec![],
                mounts: vec![Mount {
                    host_path: "/p/mps/c-c0/pipe".into(),
                    container_path: "/tmp/nvidia-mps".into(),
                    options: ["ro", "nosuid", "nodev", "rbind", "rprivate"]
                        .map(String::from)
                        .to_vec(),
                }],
                hooks: vec![],
            }
        );
        assert!(e.mounts.iter().all(|m| m.container_path != "/dev/shm"));
    }

    /// A claim spec with common edits mounting the driver's tools, and one device whose
    /// edits are `device_edits`.
    fn spec_with_tools(device_edits: ContainerEdits) -> Spec {
        let tool = |name: &str| {
            Mount::read_only(
                format!("/driver/usr/bin/{name}"),
                format!("/usr/bin/{name}"),
            )
        };
        Spec {
            cdi_version: crate::cdi::CDI_VERSION.into(),
            kind: crate::cdi::cdi_kind(),
            devices: vec![crate::cdi::Device {
                name: "uid-gpu-4".into(),
                container_edits: device_edits,
            }],
            container_edits: ContainerEdits {
                mounts: vec![
                    tool("nvidia-smi"),
                    tool(MPS_CONTROL_TOOL),
                    tool("nvidia-cuda-mps-server"),
                ],
                ..ContainerEdits::default()
            },
        }
    }

    fn tools(spec: &Spec) -> Vec<&str> {
        spec.container_edits
            .mounts
            .iter()
            .map(|m| m.container_path.as_str())
            .collect()
    }

    #[test]
    fn mps_clients_get_no_control_tool_and_other_claims_keep_it() {
        let client = without_control_tool(spec_with_tools(mps_edits("/p/mps/x/pipe")));
        assert_eq!(
            tools(&client),
            ["/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-server"]
        );
        let exclusive = without_control_tool(spec_with_tools(ContainerEdits::default()));
        assert_eq!(
            tools(&exclusive),
            [
                "/usr/bin/nvidia-smi",
                "/usr/bin/nvidia-cuda-mps-control",
                "/usr/bin/nvidia-cuda-mps-server"
            ]
        );
    }

    #[test]
    fn group_and_daemon_names() {
        assert_eq!(group_name(Some(3)), "c3");
        assert_eq!(group_name(None), "c");
        assert_eq!(daemon_id("uid", "c3"), "uid-c3");
    }

    #[test]
    fn a_share_gives_its_client_its_memory_and_threads_unless_the_config_says_otherwise() {
        let share = MemoryShare {
            bytes: 10 << 30,
            total_bytes: 40 << 30,
            compute_capability: (8, 0),
        };
        let device = SharedDevice {
            share: Some(share),
            ..SharedDevice::gpu("GPU-1")
        };
        assert_eq!(
            mps_share_env(&MpsConfig::default(), &device, &share),
            [
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"
            ]
        );
        let config = MpsConfig {
            active_thread_percentage: Some(60),
            pinned_memory_limit_mib: Some(6000),
            ..MpsConfig::default()
        };
        assert_eq!(
            mps_share_env(&config, &device, &share),
            [
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6000M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60"
            ]
        );
        // A share consuming no memory (consumable shares): only what the config sets.
        let none = MemoryShare { bytes: 0, ..share };
        assert!(mps_share_env(&MpsConfig::default(), &device, &none).is_empty());
        assert_eq!(
            mps_share_env(&config, &device, &none),
            [
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6000M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60"
            ]
        );
    }
}
