package harness

// Topology constraints as the scheduler honours them: Kubernetes' own
// structured allocator (k8s.io/dynamic-resource-allocation/structured, the
// code kube-scheduler runs) against the golden slices the Rust renderer
// produces for the simulated hosts with real topologies. No API server and no
// kubelet: this shows which devices the scheduler would pick, not that pods
// run (the examples in e2e/tests do that).

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

// gpuClass is the chart's DeviceClass for whole GPUs.
var gpuClass = &resourcev1.DeviceClass{
	ObjectMeta: metav1.ObjectMeta{Name: "gpu.nvidia.com"},
	Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{
		Expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
	}}}},
}

type classLister struct{}

func (classLister) List() ([]*resourcev1.DeviceClass, error) {
	return []*resourcev1.DeviceClass{gpuClass}, nil
}

func (classLister) Get(name string) (*resourcev1.DeviceClass, error) {
	if name != gpuClass.Name {
		return nil, fmt.Errorf("no DeviceClass %s", name)
	}
	return gpuClass, nil
}

const nvlinkDomain = resourcev1.FullyQualifiedName("gpu.nvidia.com/nvlinkDomain")
const numaNode = resourcev1.FullyQualifiedName("resource.kubernetes.io/numaNode")

// gpus asks for n whole GPUs, all with one value of attr when attr is set.
func gpus(name string, n int64, attr resourcev1.FullyQualifiedName) *resourcev1.ResourceClaim {
	c := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: k8stypes.UID("uid-" + name)},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpus", Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: gpuClass.Name, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: n,
			}}},
		}},
	}
	if attr != "" {
		c.Spec.Devices.Constraints = []resourcev1.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: &attr}}
	}
	return c
}

// preferNVLink asks for two GPUs: an NVLink pair, else two on one NUMA node,
// else any two (the chart README's claim).
func preferNVLink(name string) *resourcev1.ResourceClaim {
	sub := func(n string) resourcev1.DeviceSubRequest {
		return resourcev1.DeviceSubRequest{Name: n, DeviceClassName: gpuClass.Name, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 2}
	}
	nv, numa := nvlinkDomain, numaNode
	return &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: k8stypes.UID("uid-" + name)},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpus", FirstAvailable: []resourcev1.DeviceSubRequest{sub("nvlink"), sub("numa"), sub("any")}}},
			Constraints: []resourcev1.DeviceConstraint{
				{Requests: []string{"gpus/nvlink"}, MatchAttribute: &nv},
				{Requests: []string{"gpus/numa"}, MatchAttribute: &numa},
			},
		}},
	}
}

// topoNode is a golden pool and what is allocated in it so far.
type topoNode struct {
	t         *testing.T
	slices    []*resourcev1.ResourceSlice
	features  structured.Features
	allocated sets.Set[structured.DeviceID]
}

func newTopoNode(t *testing.T, golden string, lists bool) *topoNode {
	t.Helper()
	read := readGolden(t, golden)
	n := &topoNode{t: t, allocated: sets.New[structured.DeviceID](),
		features: structured.Features{PrioritizedList: true, ListTypeAttributes: lists}}
	for i := range read {
		n.slices = append(n.slices, &read[i])
	}
	return n
}

// take marks GPUs as allocated to some other claim.
func (n *topoNode) take(devices ...string) {
	for _, d := range devices {
		n.allocated.Insert(structured.MakeDeviceID("gpu.nvidia.com", "sim-node", d))
	}
}

// allocate runs the scheduler's allocator for claim on the node; nil when it
// does not fit. The devices it gets are then allocated.
func (n *topoNode) allocate(claim *resourcev1.ResourceClaim) []resourcev1.DeviceRequestAllocationResult {
	n.t.Helper()
	ctx := context.Background()
	a, err := structured.NewAllocator(ctx, n.features,
		structured.AllocatedState{AllocatedDevices: n.allocated, AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](), AggregatedCapacity: structured.NewConsumedCapacityCollection()},
		classLister{}, n.slices, cel.NewCache(10, cel.Features{EnableListTypeAttributes: n.features.ListTypeAttributes}))
	if err != nil {
		n.t.Fatalf("allocator: %v", err)
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "sim-node"}}
	results, err := a.Allocate(ctx, node, []*resourcev1.ResourceClaim{claim})
	if err != nil {
		n.t.Fatalf("allocate %s: %v", claim.Name, err)
	}
	if len(results) == 0 {
		return nil
	}
	out := results[0].Devices.Results
	for _, r := range out {
		n.allocated.Insert(structured.MakeDeviceID(r.Driver, r.Pool, r.Device))
	}
	return out
}

// gpuSet is the sorted GPU indexes of results ("gpu-5" -> 5).
func gpuSet(results []resourcev1.DeviceRequestAllocationResult) []int {
	var out []int
	for _, r := range results {
		var i int
		if _, err := fmt.Sscanf(r.Device, "gpu-%d", &i); err == nil {
			out = append(out, i)
		}
	}
	sort.Ints(out)
	return out
}

// linked says whether every two of set are NVLink peers in links.
func linked(links [][2]int, set []int) bool {
	for i := range set {
		for _, b := range set[i+1:] {
			if !slices.Contains(links, [2]int{set[i], b}) && !slices.Contains(links, [2]int{b, set[i]}) {
				return false
			}
		}
	}
	return true
}

func allPairs(n int) [][2]int {
	var out [][2]int
	for a := 0; a < n; a++ {
		for b := a + 1; b < n; b++ {
			out = append(out, [2]int{a, b})
		}
	}
	return out
}

// The hosts' NVLink pairs, as their simulated `nvidia-smi topo -m` shows.
var (
	h100PCIePairs = [][2]int{{0, 5}, {1, 2}, {3, 4}, {6, 7}}
	a100PCIePairs = [][2]int{{0, 1}, {2, 3}}
	cubeMesh      = [][2]int{{0, 1}, {0, 2}, {0, 3}, {0, 4}, {1, 2}, {1, 3}, {1, 5}, {2, 3}, {2, 6}, {3, 7}, {4, 5}, {4, 6}, {4, 7}, {5, 6}, {5, 7}, {6, 7}}
)

// TestTopologyClaimsAllocateNVLinkSets: 2-GPU claims with matchAttribute on
// nvlinkDomain get NVLink pairs until none is left, on every host shape;
// without the constraint the allocator's first-fit pairs mostly are not.
func TestTopologyClaimsAllocateNVLinkSets(t *testing.T) {
	for _, tc := range []struct {
		golden string
		links  [][2]int
		pairs  int
	}{
		{"h100-pcie-x8-nvlink.json", h100PCIePairs, 4},
		{"a100-pcie-x4-nvlink.json", a100PCIePairs, 2},
		{"dgx-h100.json", allPairs(8), 4},
		{"dgx1-v100.json", cubeMesh, 4},
	} {
		t.Run(tc.golden, func(t *testing.T) {
			n := newTopoNode(t, tc.golden, false)
			got := 0
			for i := 0; ; i++ {
				r := n.allocate(gpus(fmt.Sprintf("pair-%d", i), 2, nvlinkDomain))
				if r == nil {
					break
				}
				if set := gpuSet(r); !linked(tc.links, set) || len(set) != 2 {
					t.Errorf("claim %d got GPUs %v: not an NVLink pair", i, set)
				}
				got++
			}
			if got != tc.pairs {
				t.Errorf("%d NVLink pairs allocated, want %d", got, tc.pairs)
			}
			// The same claims without the constraint: what a user gets today.
			n = newTopoNode(t, tc.golden, false)
			onNVLink := 0
			for i := 0; i < tc.pairs; i++ {
				if linked(tc.links, gpuSet(n.allocate(gpus(fmt.Sprintf("any-%d", i), 2, "")))) {
					onNVLink++
				}
			}
			t.Logf("%s: with the constraint %d of %d pairs on NVLink, without it %d of %d", tc.golden, got, tc.pairs, onNVLink, tc.pairs)
		})
	}
	// Hosts without NVLink publish no nvlinkDomain: the constraint never fits.
	if r := newTopoNode(t, "l40s-x8.json", false).allocate(gpus("pair", 2, nvlinkDomain)); r != nil {
		t.Errorf("l40s-x8 gave an NVLink pair: %v", gpuSet(r))
	}
}

// TestTopologyFourGPUsOnOneDomain: a 4-GPU claim on one NVLink domain fits an
// NVSwitch baseboard and a cube-mesh quad, never bridged pairs.
func TestTopologyFourGPUsOnOneDomain(t *testing.T) {
	for golden, links := range map[string][][2]int{"dgx-h100.json": allPairs(8), "dgx1-v100.json": cubeMesh} {
		r := newTopoNode(t, golden, false).allocate(gpus("four", 4, nvlinkDomain))
		if set := gpuSet(r); len(set) != 4 || !linked(links, set) {
			t.Errorf("%s: 4 GPUs on one domain got %v", golden, set)
		}
	}
	if r := newTopoNode(t, "h100-pcie-x8-nvlink.json", false).allocate(gpus("four", 4, nvlinkDomain)); r != nil {
		t.Errorf("h100-pcie-x8-nvlink: 4 GPUs on one domain got %v, the host has pairs only", gpuSet(r))
	}
}

// TestTopologyFirstAvailableFallsBackInOrder: NVLink pair, else one NUMA
// node, else any two.
func TestTopologyFirstAvailableFallsBackInOrder(t *testing.T) {
	n := newTopoNode(t, "h100-pcie-x8-nvlink.json", false)
	// Pairs 0-5 and 1-2 broken; left: 2 (NUMA 0), 3-4 and 6-7 (pairs, NUMA 1), 5 (NUMA 1).
	n.take("gpu-0", "gpu-1")
	want := []struct {
		sub  string
		test func([]int) bool
	}{
		{"gpus/nvlink", func(s []int) bool { return linked(h100PCIePairs, s) }},
		{"gpus/nvlink", func(s []int) bool { return linked(h100PCIePairs, s) }},
		// Left: 2 (NUMA 0) and 5 (NUMA 1).
		{"gpus/any", func(s []int) bool { return slices.Equal(s, []int{2, 5}) }},
	}
	for i, w := range want {
		r := n.allocate(preferNVLink(fmt.Sprintf("fa-%d", i)))
		if len(r) != 2 || r[0].Request != w.sub || !w.test(gpuSet(r)) {
			t.Errorf("claim %d: got %v from %v, want %s", i, gpuSet(r), requestsOf(r), w.sub)
		}
	}
	// Two GPUs of one NUMA node without a pair: the middle alternative.
	n = newTopoNode(t, "h100-pcie-x8-nvlink.json", false)
	n.take("gpu-0", "gpu-2", "gpu-3", "gpu-6") // left: 1 (NUMA 0), 4, 5, 7 (NUMA 1), no pair
	r := n.allocate(preferNVLink("numa"))
	if len(r) != 2 || r[0].Request != "gpus/numa" {
		t.Errorf("got %v from %v, want gpus/numa", gpuSet(r), requestsOf(r))
	}
}

func requestsOf(r []resourcev1.DeviceRequestAllocationResult) []string {
	var out []string
	for _, x := range r {
		out = append(out, x.Request)
	}
	return out
}

// TestTopologyListFormsOfferCrossPairs: with DRAListTypeAttributes and the
// plugin's list forms, the cube-mesh's cross pair 0-4 is allocatable; with
// scalars it is not (0 and 4 are in different quads).
func TestTopologyListFormsOfferCrossPairs(t *testing.T) {
	rest := []string{"gpu-1", "gpu-2", "gpu-3", "gpu-5", "gpu-6", "gpu-7"}
	scalar := newTopoNode(t, "dgx1-v100.json", false)
	scalar.take(rest...)
	if r := scalar.allocate(gpus("cross", 2, nvlinkDomain)); r != nil {
		t.Errorf("scalar domains gave %v", gpuSet(r))
	}
	lists := newTopoNode(t, "dgx1-v100-list-attributes.json", true)
	lists.take(rest...)
	if r := lists.allocate(gpus("cross", 2, nvlinkDomain)); !slices.Equal(gpuSet(r), []int{0, 4}) {
		t.Errorf("list domains gave %v, want the cross pair [0 4]", gpuSet(r))
	}
	// 0 and 5 are not linked: never together.
	lists = newTopoNode(t, "dgx1-v100-list-attributes.json", true)
	lists.take("gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-6", "gpu-7")
	if r := lists.allocate(gpus("unlinked", 2, nvlinkDomain)); r != nil {
		t.Errorf("list domains gave the unlinked GPUs %v", gpuSet(r))
	}
}
