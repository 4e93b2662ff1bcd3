//! PCIe topology from sysfs: the PCIe root complex and the NUMA node of a PCI device.
//!
//! The sysfs root is configurable so that a containerised plugin can read the host's `/sys`
//! from wherever it is mounted, and so tests can point at a simulated tree. Both lookups are
//! best effort: a missing entry yields `None`, never an error, because the attributes they feed
//! are optional in the ResourceSlice.

use std::path::{Component, Path};

/// The PCIe root of `bus_id` (`0000:07:00.0`): resolves `<sysfs>/bus/pci/devices/<bus_id>` (a
/// symlink into `devices/pciDDDD:BB/...`) and returns the `pciDDDD:BB` component. `None` when the
/// device is not in sysfs or its path has no such component.
pub fn pcie_root(sysfs_root: &Path, bus_id: &str) -> Option<String> {
    let link = sysfs_root.join("bus/pci/devices").join(bus_id);
    let resolved = std::fs::canonicalize(&link).ok()?;
    resolved.components().find_map(|c| match c {
        Component::Normal(name) => name
            .to_str()
            .filter(|n| is_pcie_root_name(n))
            .map(str::to_string),
        _ => None,
    })
}

/// True for `pci<domain hex>:<bus 2 hex>`, e.g. `pci0000:00`.
fn is_pcie_root_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("pci") else {
        return false;
    };
    let Some((domain, bus)) = rest.split_once(':') else {
        return false;
    };
    domain.len() >= 4
        && bus.len() == 2
        && domain.chars().all(|c| c.is_ascii_hexdigit())
        && bus.chars().all(|c| c.is_ascii_hexdigit())
}

/// The NUMA node of `bus_id` from `<sysfs>/bus/pci/devices/<bus_id>/numa_node`; `None` when the
/// file is missing or unparsable or holds a negative value (`-1`: no NUMA affinity).
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<i64> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bus_id)
        .join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    text.trim().parse::<i64>().ok().filter(|n| *n >= 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(numa: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir
            .path()
            .join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), numa).unwrap();
        let links = dir.path().join("bus/pci/devices");
        std::fs::create_dir_all(&links).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
            links.join("0000:3b:00.0"),
        )
        .unwrap();
        dir
    }

    #[test]
    fn root_and_numa_come_from_the_resolved_link() {
        let dir = tree("1\n");
        assert_eq!(
            pcie_root(dir.path(), "0000:3b:00.0").as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(numa_node(dir.path(), "0000:3b:00.0"), Some(1));
    }

    #[test]
    fn missing_device_and_negative_numa_give_none() {
        let dir = tree("-1\n");
        assert_eq!(numa_node(dir.path(), "0000:3b:00.0"), None);
        assert_eq!(pcie_root(dir.path(), "0000:99:00.0"), None);
        assert_eq!(numa_node(dir.path(), "0000:99:00.0"), None);
    }

    #[test]
    fn root_names_are_recognised_strictly() {
        assert!(is_pcie_root_name("pci0000:00"));
        assert!(is_pcie_root_name("pci10000:3a"));
        assert!(!is_pcie_root_name("pci0000:3a:00.0"));
        assert!(!is_pcie_root_name("pci_bus"));
        assert!(!is_pcie_root_name("0000:3b:00.0"));
    }
}
