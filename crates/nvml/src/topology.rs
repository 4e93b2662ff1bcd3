//! NVLink peers of each GPU, from NVML's peer-to-peer status for the NVLink capability
//! (`nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)`), one query per unordered pair
//! of GPUs: N(N-1)/2, 28 on an 8-GPU host.
//!
//! Why the P2P status and not the links: on NVSwitch systems every link's remote end is a
//! switch, not the peer GPU (NVIDIA's own allocator counts only links whose remote PCI address
//! is the peer's, so it sees no NVLink at all on HGX boards); the P2P status answers "can these
//! two GPUs talk over NVLink" for direct links and switches alike, and is `NOT_SUPPORTED` for a
//! GPU in MIG mode. Walking the links would also cost one call per link per GPU (up to 18).
//!
//! A failed query is not a failed discovery: the pair is treated as not linked (the GPUs are
//! still published, without the domain that pair would have given) and a warning says so.

use gpu_dra_device::Gpu;
use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
use nvml_wrapper::error::NvmlError;

/// Sets `nvlink_peers` of every GPU of `gpus` (whose NVML handles are `handles`, same order):
/// the UUIDs of the GPUs it reaches over NVLink, in NVML index order.
pub fn fill_nvlink_peers(gpus: &mut [Gpu], handles: &[Device<'_>]) {
    let n = gpus.len().min(handles.len());
    let mut peers: Vec<Vec<String>> = vec![Vec::new(); n];
    for a in 0..n {
        for b in a + 1..n {
            match handles[a].p2p_status(&handles[b], P2pCapabilitiesIndex::NvLink) {
                Ok(P2pStatus::Ok) => {
                    peers[a].push(gpus[b].uuid.clone());
                    peers[b].push(gpus[a].uuid.clone());
                }
                Ok(_) | Err(NvmlError::NotSupported) => {}
                Err(e) => tracing::warn!(
                    gpu = gpus[a].index, peer = gpus[b].index, error = %e,
                    "nvmlDeviceGetP2PStatus (NVLink) failed; treating the pair as not NVLink-connected"
                ),
            }
        }
    }
    // Pairs are visited in index order, so each list already is.
    for (gpu, list) in gpus.iter_mut().zip(peers) {
        gpu.nvlink_peers = list;
    }
}
