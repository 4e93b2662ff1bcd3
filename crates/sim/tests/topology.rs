//! The simulator's topology answers as the driver reads them: through `nvml-wrapper` (common
//! ancestor, peer-to-peer status, NVLink state and remote ends) and the raw call it does not
//! wrap (module ID) or wraps wrongly (remote device type: nvml-wrapper 0.13 reads the value
//! into a temporary and always answers `Unknown`), on hosts shaped like real ones.

// Raw calls through nvml-wrapper-sys.
#![allow(unsafe_code)]

use gpu_dra_sim::testing::SimHost;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

/// `nvmlIntNvLinkDeviceType_t` of link `link` of `d`, through the raw call.
fn remote_type(nvml: &Nvml, d: &Device<'_>, link: u32) -> u32 {
    let f = nvml
        .lib()
        .nvmlDeviceGetNvLinkRemoteDeviceType
        .as_ref()
        .expect("exported");
    let mut t = 0xFFu32;
    // SAFETY: a live handle of this session and a valid out-pointer.
    let rc = unsafe { f(d.handle(), link, &mut t) };
    assert_eq!(rc, 0, "link {link}");
    t
}

fn open(host: &SimHost) -> Nvml {
    Nvml::builder()
        .lib_path(host.lib_path().as_os_str())
        .init()
        .expect("nvml init")
}

#[test]
fn nvswitch_links_end_at_switches_and_every_pair_is_an_nvlink_peer() {
    let host = SimHost::new("dgx-h100");
    let nvml = open(&host);
    let d0 = nvml.device_by_index(0).expect("gpu 0");
    let d5 = nvml.device_by_index(5).expect("gpu 5");
    assert_eq!(
        d0.p2p_status(&d5, P2pCapabilitiesIndex::NvLink)
            .expect("p2p"),
        P2pStatus::Ok
    );
    assert_eq!(
        nvml.topology_common_ancestor(&d0, &d5).expect("ancestor"),
        TopologyLevel::System
    );
    let d1 = nvml.device_by_index(1).expect("gpu 1");
    assert_eq!(
        nvml.topology_common_ancestor(&d0, &d1).expect("ancestor"),
        TopologyLevel::Multiple
    );
    for l in 0..18 {
        let link = d0.link_wrapper_for(l);
        assert!(link.is_active().expect("active"), "link {l}");
        assert_eq!(remote_type(&nvml, &d0, l), 2, "SWITCH");
        let pci = link.remote_pci_info().expect("remote pci");
        assert!(pci.bus_id.starts_with("00000000:C"), "{}", pci.bus_id);
        assert_eq!(link.version().expect("version"), 4);
    }
    assert!(matches!(
        d0.link_wrapper_for(18).is_active(),
        Err(NvmlError::InvalidArg)
    ));
}

#[test]
fn bridge_pairs_end_at_the_peer_gpu() {
    let host = SimHost::new("h100-pcie-x8-nvlink");
    let nvml = open(&host);
    let d0 = nvml.device_by_index(0).expect("gpu 0");
    let link = d0.link_wrapper_for(0);
    assert_eq!(remote_type(&nvml, &d0, 0), 0, "GPU");
    assert_eq!(
        link.remote_pci_info().expect("pci").bus_id,
        host.profile().gpus[5].pci_bus_id
    );
    let d1 = nvml.device_by_index(1).expect("gpu 1");
    let d5 = nvml.device_by_index(5).expect("gpu 5");
    assert_eq!(
        d0.p2p_status(&d5, P2pCapabilitiesIndex::NvLink)
            .expect("p2p"),
        P2pStatus::Ok
    );
    assert_eq!(
        d0.p2p_status(&d1, P2pCapabilitiesIndex::NvLink)
            .expect("p2p"),
        P2pStatus::NotSupported
    );
    assert_eq!(
        nvml.topology_common_ancestor(&d0, &d1).expect("ancestor"),
        TopologyLevel::Node
    );
}

#[test]
fn gpus_without_nvlink_say_not_supported_and_mig_mode_has_no_peer_to_peer() {
    let host = SimHost::new("l40s-x8");
    let nvml = open(&host);
    let d0 = nvml.device_by_index(0).expect("gpu 0");
    let d1 = nvml.device_by_index(1).expect("gpu 1");
    assert!(matches!(
        d0.link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(
        nvml.topology_common_ancestor(&d0, &d1).expect("ancestor"),
        TopologyLevel::Single
    );
    drop(nvml);
    // GPUs 0-3 of the DGX A100 are in MIG mode: NVSwitch-connected, yet no peer-to-peer.
    let host = SimHost::new("dgx-a100-40gb");
    let nvml = open(&host);
    let d0 = nvml.device_by_index(0).expect("gpu 0");
    let d4 = nvml.device_by_index(4).expect("gpu 4");
    let d5 = nvml.device_by_index(5).expect("gpu 5");
    assert_eq!(
        d0.p2p_status(&d4, P2pCapabilitiesIndex::NvLink)
            .expect("p2p"),
        P2pStatus::NotSupported
    );
    assert_eq!(
        d4.p2p_status(&d5, P2pCapabilitiesIndex::NvLink)
            .expect("p2p"),
        P2pStatus::Ok
    );
}

#[test]
fn module_ids_are_baseboard_positions_or_zero() {
    for (profile, want) in [("dgx-a100-40gb", 1..=8), ("a100-pcie-x4-nvlink", 0..=0)] {
        let host = SimHost::new(profile);
        let nvml = open(&host);
        let d = nvml.device_by_index(0).expect("gpu 0");
        let f = nvml.lib().nvmlDeviceGetModuleId.as_ref().expect("exported");
        let mut id = 99u32;
        // SAFETY: a live handle of this session and a valid out-pointer.
        let rc = unsafe { f(d.handle(), &mut id) };
        assert_eq!(rc, 0, "{profile}");
        assert_eq!(id, *want.start(), "{profile}");
    }
}
