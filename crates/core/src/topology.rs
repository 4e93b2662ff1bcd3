//! NVLink domains: which whole GPUs of a node a claim may take together so that every pair of
//! them talks over NVLink, published as the `nvlinkDomain` attribute.
//!
//! The problem: "N GPUs that all talk over NVLink" must be one `matchAttribute` constraint,
//! so each GPU needs one value that it shares exactly with GPUs it can reach pairwise. Being
//! *connected* is not enough: on a hybrid cube-mesh (DGX-1) every GPU reaches every other
//! through a chain of links, but peer-to-peer over NVLink needs a direct link (or a common
//! NVSwitch), and GPU 0 has none to GPU 5. So a domain is a **clique** of the NVLink peer
//! graph, not a connected component.
//!
//! The scalar attribute partitions the GPUs into disjoint cliques, largest first: on NVSwitch
//! systems the whole baseboard is one domain; bridged PCIe pairs are one domain each; a cube
//! mesh splits into its two fully linked quads (GPUs 0-3 and 4-7), and the cross links
//! (0-4, 1-5, ...) are not expressible with one scalar per GPU. The list form
//! ([`NvlinkDomains::cliques_of`], for clusters with list-type attributes) names every
//! maximal clique a GPU is in, and `matchAttribute`'s list semantics (a value common to all
//! devices) then still means "all pairwise linked".
//!
//! Rules, each a deliberate choice:
//! - An edge needs both GPUs to report each other (NVML answers per ordered pair; a one-sided
//!   answer is treated as no link).
//! - GPUs in MIG mode are left out: MIG has no GPU-to-GPU peer-to-peer, and such a GPU is
//!   published as MIG devices, which never carry the attribute.
//! - A GPU without any peer gets no attribute (so hosts without NVLink publish exactly what
//!   they did before, and a `matchAttribute` on it never picks a lone GPU).
//! - A domain's value is `nvl-` and 16 hex digits of an FNV-1a hash of its members' sorted
//!   UUIDs: stable across reboots and index changes, unique in practice across nodes, at
//!   most 20 characters. Removing a GPU (lost, put in MIG mode) changes the value of its
//!   former domain, as it should: the set it names changed.
//! - Ties between cliques of one size go to the one whose sorted PCI bus IDs come first.

use std::collections::{BTreeMap, BTreeSet};

use gpu_dra_device::Inventory;

/// The NVLink domains of one node's whole GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvlinkDomains {
    /// GPU UUID -> the value of its scalar `nvlinkDomain`.
    domain: BTreeMap<String, String>,
    /// GPU UUID -> the values of every maximal clique it is in, its own domain first.
    cliques: BTreeMap<String, Vec<String>>,
}

impl NvlinkDomains {
    /// Computes the domains of `inventory`'s whole GPUs from their `nvlink_peers`.
    pub fn of(inventory: &Inventory) -> Self {
        // Vertices: GPUs not in MIG mode, in PCI bus ID order (deterministic tie-breaks).
        let mut gpus: Vec<(&str, &str)> = inventory
            .gpus
            .iter()
            .filter(|g| !g.mig_enabled())
            .map(|g| (g.pci_bus_id.as_str(), g.uuid.as_str()))
            .collect();
        gpus.sort_unstable();
        let index: BTreeMap<&str, usize> =
            gpus.iter().enumerate().map(|(i, (_, u))| (*u, i)).collect();
        let n = gpus.len();
        let mut adj = vec![BTreeSet::new(); n];
        for g in inventory.gpus.iter().filter(|g| !g.mig_enabled()) {
            let a = index[g.uuid.as_str()];
            for peer in &g.nvlink_peers {
                let Some(&b) = index.get(peer.as_str()) else {
                    continue;
                };
                let back = inventory
                    .gpus
                    .iter()
                    .find(|p| p.uuid == *peer)
                    .is_some_and(|p| p.nvlink_peers.contains(&g.uuid));
                if a != b && back {
                    adj[a].insert(b);
                    adj[b].insert(a);
                }
            }
        }
        let uuid = |i: usize| gpus[i].1.to_string();
        let value = |members: &BTreeSet<usize>| {
            let mut uuids: Vec<&str> = members.iter().map(|&i| gpus[i].1).collect();
            uuids.sort_unstable();
            format!("nvl-{:016x}", fnv1a64(uuids.join(",").as_bytes()))
        };
        let mut out = NvlinkDomains::default();
        // The partition: the largest clique among the GPUs left, until none has a peer left.
        let mut left: BTreeSet<usize> = (0..n).collect();
        loop {
            let best = maximal_cliques(&adj, &left)
                .into_iter()
                .filter(|c| c.len() >= 2)
                .max_by(|a, b| a.len().cmp(&b.len()).then_with(|| b.cmp(a)));
            let Some(clique) = best else { break };
            let v = value(&clique);
            for &i in &clique {
                out.domain.insert(uuid(i), v.clone());
                left.remove(&i);
            }
        }
        // Every maximal clique of the whole graph, for the list form.
        let all: BTreeSet<usize> = (0..n).collect();
        let mut cliques = maximal_cliques(&adj, &all);
        cliques.retain(|c| c.len() >= 2);
        cliques.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        for c in &cliques {
            let v = value(c);
            for &i in c {
                out.cliques.entry(uuid(i)).or_default().push(v.clone());
            }
        }
        for (u, list) in &mut out.cliques {
            if let Some(own) = out.domain.get(u) {
                list.retain(|v| v != own);
                list.insert(0, own.clone());
            }
        }
        out
    }

    /// The `nvlinkDomain` value of GPU `uuid`, if it has NVLink peers.
    pub fn domain_of(&self, uuid: &str) -> Option<&str> {
        self.domain.get(uuid).map(String::as_str)
    }

    /// Every maximal all-to-all NVLink set GPU `uuid` belongs to (its own domain first): the
    /// list form of the attribute. Empty without peers.
    pub fn cliques_of(&self, uuid: &str) -> &[String] {
        self.cliques.get(uuid).map_or(&[], Vec::as_slice)
    }
}

/// Maximal cliques of the subgraph of `adj` induced by `within` (Bron–Kerbosch with pivot).
/// Nodes have at most a few dozen GPUs, so the exponential worst case does not matter.
fn maximal_cliques(adj: &[BTreeSet<usize>], within: &BTreeSet<usize>) -> Vec<BTreeSet<usize>> {
    fn go(
        adj: &[BTreeSet<usize>],
        r: &mut BTreeSet<usize>,
        mut p: BTreeSet<usize>,
        mut x: BTreeSet<usize>,
        out: &mut Vec<BTreeSet<usize>>,
    ) {
        if p.is_empty() && x.is_empty() {
            out.push(r.clone());
            return;
        }
        let pivot = p
            .iter()
            .chain(x.iter())
            .copied()
            .max_by_key(|u| adj[*u].intersection(&p).count());
        let candidates: Vec<usize> = p
            .iter()
            .copied()
            .filter(|v| pivot.is_none_or(|u| !adj[u].contains(v)))
            .collect();
        for v in candidates {
            r.insert(v);
            let np = p.intersection(&adj[v]).copied().collect();
            let nx = x.intersection(&adj[v]).copied().collect();
            go(adj, r, np, nx, out);
            r.remove(&v);
            p.remove(&v);
            x.insert(v);
        }
    }
    let mut out = Vec::new();
    go(
        adj,
        &mut BTreeSet::new(),
        within.clone(),
        BTreeSet::new(),
        &mut out,
    );
    out
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_device::Gpu;
    use gpu_dra_device::testing::{a100, inventory, mig_1g5gb};

    fn uuid(i: u32) -> String {
        format!("GPU-{i:08x}-1111-2222-3333-444444444444")
    }

    /// GPUs 0..n with the given undirected links.
    fn host(n: u32, links: &[(u32, u32)]) -> Vec<Gpu> {
        (0..n)
            .map(|i| {
                let peers: Vec<String> = links
                    .iter()
                    .filter_map(|&(a, b)| match (a == i, b == i) {
                        (true, _) => Some(uuid(b)),
                        (_, true) => Some(uuid(a)),
                        _ => None,
                    })
                    .collect();
                let refs: Vec<&str> = peers.iter().map(String::as_str).collect();
                a100(i).nvlink_peers(&refs).build()
            })
            .collect()
    }

    fn groups(d: &NvlinkDomains, n: u32) -> Vec<Vec<u32>> {
        let mut by: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for i in 0..n {
            if let Some(v) = d.domain_of(&uuid(i)) {
                by.entry(v).or_default().push(i);
            }
        }
        let mut g: Vec<Vec<u32>> = by.into_values().collect();
        g.sort();
        g
    }

    fn all_pairs(n: u32) -> Vec<(u32, u32)> {
        (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .collect()
    }

    #[test]
    fn an_nvswitch_baseboard_is_one_domain() {
        let d = NvlinkDomains::of(&inventory(host(8, &all_pairs(8))));
        assert_eq!(groups(&d, 8), [[0, 1, 2, 3, 4, 5, 6, 7]]);
        let v = d.domain_of(&uuid(0)).expect("domain");
        assert!(v.starts_with("nvl-") && v.len() == 20, "{v}");
        assert_eq!(d.cliques_of(&uuid(3)), [v.to_string()]);
    }

    #[test]
    fn bridge_pairs_are_a_domain_each_even_when_not_adjacent() {
        let d = NvlinkDomains::of(&inventory(host(8, &[(0, 5), (1, 2), (3, 4), (6, 7)])));
        assert_eq!(
            groups(&d, 8),
            [vec![0, 5], vec![1, 2], vec![3, 4], vec![6, 7]]
        );
    }

    #[test]
    fn a_cube_mesh_splits_into_its_quads_and_lists_the_cross_links() {
        let links = [
            (0, 1),
            (0, 2),
            (0, 3),
            (0, 4),
            (1, 2),
            (1, 3),
            (1, 5),
            (2, 3),
            (2, 6),
            (3, 7),
            (4, 5),
            (4, 6),
            (4, 7),
            (5, 6),
            (5, 7),
            (6, 7),
        ];
        let d = NvlinkDomains::of(&inventory(host(8, &links)));
        assert_eq!(groups(&d, 8), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        // GPU 0 is in its quad and in the pair 0-4; GPU 4 shares only the pair with it.
        let l0 = d.cliques_of(&uuid(0));
        let l4 = d.cliques_of(&uuid(4));
        assert_eq!(l0.len(), 2);
        assert_eq!(l0[0], d.domain_of(&uuid(0)).expect("own"));
        let common: Vec<&String> = l0.iter().filter(|v| l4.contains(v)).collect();
        assert_eq!(common.len(), 1);
        let l5 = d.cliques_of(&uuid(5));
        assert!(l0.iter().all(|v| !l5.contains(v)), "0 and 5 are not linked");
    }

    #[test]
    fn no_links_no_domains_and_one_sided_links_do_not_count() {
        let d = NvlinkDomains::of(&inventory(host(4, &[])));
        assert_eq!(d, NvlinkDomains::default());
        let mut gpus = host(2, &[(0, 1)]);
        gpus[1].nvlink_peers.clear();
        assert_eq!(
            NvlinkDomains::of(&inventory(gpus)),
            NvlinkDomains::default()
        );
    }

    #[test]
    fn gpus_in_mig_mode_are_left_out() {
        let mut gpus = host(3, &all_pairs(3));
        gpus[0] = a100(0)
            .mig(mig_1g5gb(0))
            .nvlink_peers(&[&uuid(1), &uuid(2)])
            .build();
        let d = NvlinkDomains::of(&inventory(gpus));
        assert_eq!(groups(&d, 3), [[1, 2]]);
        assert_eq!(d.domain_of(&uuid(0)), None);
    }

    #[test]
    fn values_do_not_depend_on_enumeration_order() {
        let gpus = host(4, &[(0, 1), (2, 3)]);
        let mut reversed = gpus.clone();
        reversed.reverse();
        for (i, g) in reversed.iter_mut().enumerate() {
            g.index = i as u32;
        }
        let a = NvlinkDomains::of(&inventory(gpus));
        let b = NvlinkDomains::of(&inventory(reversed));
        assert_eq!(a, b);
    }
}
