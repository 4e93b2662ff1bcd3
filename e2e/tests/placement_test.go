package tests

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/gpu-dra/e2e/harness"
)

// TestNVLinkConstraintMakesPlacementsNVLink: on a host with NVLink bridge
// pairs that are not index-adjacent (h100-pcie-x8-nvlink: 0-5, 1-2, 3-4, 6-7)
// and one without NVLink (l40s-x8), the real scheduler gives 2-GPU claims
// with `matchAttribute: gpu.nvidia.com/nvlinkDomain` only NVLink pairs (by the
// node's own nvidia-smi topo -m, not by the attribute), until the four pairs
// are taken: a fifth pair and a 4-GPU claim (no four GPUs of these hosts are
// all linked) stay Pending. The same 2-GPU claims without the constraint,
// created one after the other on the emptied nodes, get at least one pair
// that is not NVLink: the first one lands on the L40S or on the H100's GPUs 0
// and 1, which the scheduler's allocator takes first. So the constraint is
// what makes the difference. The nodes run no containers (a pod is Running
// once its claim is prepared); the benchmark `make bench-topology` runs the
// same rounds on a fleet.
func TestNVLinkConstraintMakesPlacementsNVLink(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	selector := map[string]string{"e2e.gpu-dra/placement": "nvlink"}
	for name, profile := range map[string]string{"placement-h100": "h100-pcie-x8-nvlink", "placement-l40s": "l40s-x8"} {
		addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, NoContainers: true, Labels: selector}, profile, nil, nil)
	}
	ns := newNamespace(ctx, t, "placement")

	with, err := cluster.RunPlacement(ctx, harness.PlacementRound{
		Namespace: ns, Name: "with", GPUs: []int64{2, 2, 2, 2, 2, 4}, NVLink: true,
		NodeSelector: selector, Parallel: 1, Settle: 2 * time.Second, Timeout: 2 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range with.Placed {
		t.Logf("with the constraint: %s on %s got %v, NVLink %v", p.Pod, p.Node, p.Devices, p.NVLink)
		if !p.NVLink || p.Node != "placement-h100" {
			t.Errorf("with the constraint, %s got %v on %s: not an NVLink set", p.Pod, p.Devices, p.Node)
		}
	}
	if len(with.Placed) != 4 {
		t.Errorf("with the constraint %d claims placed, want the h100-pcie-x8-nvlink node's 4 NVLink pairs", len(with.Placed))
	}
	if pending := sortedKeys(with.Pending); len(pending) != 2 || with.Pending["with-0004"] != 2 || with.Pending["with-0005"] != 4 {
		t.Errorf("with the constraint pending: %v (sizes %v), want with-0004 (2 GPUs, no pair left) and with-0005 (4 GPUs, no NVLink quad)", pending, with.Pending)
	}
	if err := cluster.DeletePlacement(ctx, ns, time.Minute); err != nil {
		t.Fatal(err)
	}

	without, err := cluster.RunPlacement(ctx, harness.PlacementRound{
		Namespace: ns, Name: "without", GPUs: []int64{2, 2, 2, 2}, NVLink: false,
		NodeSelector: selector, Parallel: 1, Settle: 2 * time.Second, Timeout: 2 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	onNVLink := 0
	for _, p := range without.Placed {
		t.Logf("without the constraint: %s on %s got %v, NVLink %v", p.Pod, p.Node, p.Devices, p.NVLink)
		if p.NVLink {
			onNVLink++
		}
	}
	if len(without.Placed) != 4 || len(without.Pending) != 0 {
		t.Errorf("without the constraint %d of 4 claims placed, pending %v: want all placed (24 free GPUs)", len(without.Placed), without.Pending)
	}
	if onNVLink == len(without.Placed) {
		t.Errorf("without the constraint all %d pairs are on NVLink: the test no longer shows that the constraint makes the difference", onNVLink)
	}
	t.Logf("NVLink pairs: with the constraint %d of %d placed (%d pending), without it %d of %d", len(with.Placed), len(with.Placed), len(with.Pending), onNVLink, len(without.Placed))
	if err := cluster.DeletePlacement(ctx, ns, time.Minute); err != nil {
		t.Fatal(err)
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := keys(m)
	sort.Strings(out)
	return out
}
