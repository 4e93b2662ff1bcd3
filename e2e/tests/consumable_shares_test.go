package tests

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// NVIDIA's consumable shares (--consumable-shares, chart consumableShares):
// every whole GPU and MIG device of the node several claims may hold.

// sharedClaim asks for one device of a class with this UUID and the given
// capacity requests (none: the device's request policy defaults).
func sharedClaim(ns, name, class, uuid string, requests map[string]string) *resourceapi.ResourceClaim {
	claim := pinnedClaim(ns, name, class, uuid)
	if len(requests) > 0 {
		caps := map[resourceapi.QualifiedName]resource.Quantity{}
		for k, v := range requests {
			caps[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
		claim.Spec.Devices.Requests[0].Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: caps}
	}
	return claim
}

// runShares creates each claim with its pod, one after the other (each once
// the previous one runs: claims created in the same instant once left one
// Pending past the wait, the scheduler's queueing, see docs/STATUS.md), and
// checks that every claim was allocated `device` as a share consuming
// `consumed`, and that its container sees the device and is told `env`.
func runShares(ctx context.Context, t *testing.T, n *harness.Node, claims []*resourceapi.ResourceClaim, device, uuid string, consumed map[string]string, env map[string]string) []*v1.Pod {
	t.Helper()
	var pods []*v1.Pod
	for _, claim := range claims {
		pod := createClaimAndPod(ctx, t, claim, n.Name)
		running, err := cluster.WaitPodRunning(ctx, claim.Namespace, pod.Name, 90*time.Second)
		if err != nil {
			t.Fatalf("pod %s: %v; kubelet errors: %v\nplugin log:\n%s", pod.Name, err, n.DRAErrors(), n.Plugin.Log())
		}
		pods = append(pods, running)
		got, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		res := got.Status.Allocation.Devices.Results[0]
		if res.Device != device || res.ShareID == nil {
			t.Fatalf("claim %s: allocated %s (share ID %v), want a share of %s", claim.Name, res.Device, res.ShareID, device)
		}
		for name, want := range consumed {
			have := res.ConsumedCapacity[resourceapi.QualifiedName(name)]
			if have.Cmp(resource.MustParse(want)) != 0 {
				t.Errorf("claim %s consumes %s %s, want %s", claim.Name, have.String(), name, want)
			}
		}
		gpus, migs := visibleDevices(ctx, t, running, "ctr")
		if !slices.Contains(gpus, uuid) && !slices.Contains(migs, uuid) {
			t.Errorf("pod %s: nvidia-smi -L lists %v %v, not its device %s", pod.Name, gpus, migs, uuid)
		}
		for key, want := range env {
			var have string
			for _, r := range podDevices(t, running)["ctr"] {
				if v, ok := envValue(r.Env(), key); ok {
					have = v
				}
			}
			if have != want {
				t.Errorf("pod %s: %s=%q, want %q", pod.Name, key, have, want)
			}
		}
	}
	return pods
}

// staysPending checks that the pod of `claim` is not scheduled and returns the
// scheduler's reason.
func staysPending(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, node string) *v1.Pod {
	t.Helper()
	pod := createClaimAndPod(ctx, t, claim, node)
	var reason string
	if !eventually(ctx, 30*time.Second, func() bool {
		p := getPod(ctx, t, pod)
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Message != "" {
				reason = c.Message
				return true
			}
		}
		return false
	}) {
		t.Fatalf("pod %s: no PodScheduled=False condition: %+v", pod.Name, getPod(ctx, t, pod).Status)
	}
	time.Sleep(2 * time.Second)
	if p := getPod(ctx, t, pod); p.Spec.NodeName != "" || p.Status.Phase == v1.PodRunning {
		t.Fatalf("pod %s was scheduled although its device is taken (node %q, phase %s)", pod.Name, p.Spec.NodeName, p.Status.Phase)
	}
	t.Logf("pod %s pending: %s", pod.Name, reason)
	return pod
}

// firstMIG is the name and UUID of a MIG device of the pool.
func firstMIG(t *testing.T, devices map[string]resourceapi.Device) (string, string) {
	t.Helper()
	names := keys(devices)
	slices.Sort(names)
	for _, name := range names {
		if attrString(devices[name], "type") == "mig" {
			return name, attrString(devices[name], "uuid")
		}
	}
	t.Fatalf("no MIG device published: %v", names)
	return "", ""
}

// TestConsumableSharesCount: with --consumable-shares=2 every whole GPU and MIG
// device carries 2 `shares`; a GPU chosen for memory shares keeps its own
// policy. Two claims asking for nothing (1 share each, NVIDIA's default) share
// a GPU and see it, a third stays pending; two claims asking for
// `shares: 1` share a MIG device and see it.
func TestConsumableSharesCount(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-shares-count"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb",
		[]string{"--consumable-shares=2", "--memory-share-gpus=gpu-5"}, nil)
	ns := newNamespace(ctx, t, "shares-count")

	devices := poolDevices(ctx, t, name)
	gpu := devices["gpu-4"]
	if gpu.AllowMultipleAllocations == nil || !*gpu.AllowMultipleAllocations {
		t.Fatalf("gpu-4 does not allow multiple allocations: %+v", gpu)
	}
	shares, ok := gpu.Capacity["shares"]
	if !ok || shares.Value.Cmp(resource.MustParse("2")) != 0 || shares.RequestPolicy == nil || shares.RequestPolicy.Default == nil {
		t.Fatalf("gpu-4 has no shares capacity of 2 with a default: %+v", gpu.Capacity)
	}
	t.Logf("gpu-4 shares %s (default %s), memory default %s", shares.Value.String(), shares.RequestPolicy.Default, gpu.Capacity["memory"].RequestPolicy.Default)
	own := devices["gpu-5"]
	_, ownShares := own.Capacity["shares"]
	if ownMemory := own.Capacity["memory"]; ownShares || ownMemory.RequestPolicy == nil || ownMemory.RequestPolicy.ValidRange == nil ||
		ownMemory.RequestPolicy.ValidRange.Min.Cmp(resource.MustParse("1Gi")) != 0 {
		t.Errorf("gpu-5, chosen for memory shares, does not keep their policy (min 1Gi, no shares): %+v", own.Capacity)
	}
	uuid := attrString(gpu, "uuid")

	// Two claims as NVIDIA's users write them (no capacity requests): 1 share each.
	pods := runShares(ctx, t, n, []*resourceapi.ResourceClaim{
		sharedClaim(ns, "one-a", "gpu.nvidia.com", uuid, nil),
		sharedClaim(ns, "one-b", "gpu.nvidia.com", uuid, nil),
	}, "gpu-4", uuid, map[string]string{"shares": "1", "memory": "0"}, map[string]string{"GPU_DRA_SHARES": "1"})
	third := staysPending(ctx, t, sharedClaim(ns, "one-c", "gpu.nvidia.com", uuid, nil), name)
	deleteClaimAndPod(ctx, t, pods[0])
	if _, err := cluster.WaitPodRunning(ctx, ns, third.Name, 90*time.Second); err != nil {
		t.Fatalf("pod %s after a share was freed: %v; kubelet errors: %v", third.Name, err, n.DRAErrors())
	}
	deleteClaimAndPod(ctx, t, pods[1])
	deleteClaimAndPod(ctx, t, third)

	// A MIG device shared by two claims.
	mig, migUUID := firstMIG(t, devices)
	if d := devices[mig]; d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations {
		t.Fatalf("%s does not allow multiple allocations", mig)
	}
	one := map[string]string{"shares": "1"}
	pods = runShares(ctx, t, n, []*resourceapi.ResourceClaim{
		sharedClaim(ns, "mig-a", "mig.nvidia.com", migUUID, one),
		sharedClaim(ns, "mig-b", "mig.nvidia.com", migUUID, one),
	}, mig, migUUID, map[string]string{"shares": "1", "multiprocessors": "0"}, map[string]string{"GPU_DRA_SHARES": "1"})
	for _, p := range pods {
		deleteClaimAndPod(ctx, t, p)
	}
}

// TestConsumableSharesMemory: with --consumable-shares=memory, two claims of
// 2Gi land on one GPU as shares, each told its share; a claim asking for no
// memory there gets the whole GPU (NVIDIA's default), so it waits until they
// are gone.
func TestConsumableSharesMemory(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-shares-memory"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--consumable-shares=memory"}, nil)
	ns := newNamespace(ctx, t, "shares-memory")

	gpu := poolDevices(ctx, t, name)["gpu-6"]
	memory := gpu.Capacity["memory"]
	if memory.RequestPolicy == nil || memory.RequestPolicy.Default == nil || memory.RequestPolicy.Default.Cmp(memory.Value) != 0 {
		t.Fatalf("gpu-6 memory policy does not default to all of it: %+v", memory)
	}
	uuid := attrString(gpu, "uuid")
	twoGi := map[string]string{"memory": "2Gi"}
	pods := runShares(ctx, t, n, []*resourceapi.ResourceClaim{
		sharedClaim(ns, "mem-a", "gpu.nvidia.com", uuid, twoGi),
		sharedClaim(ns, "mem-b", "gpu.nvidia.com", uuid, twoGi),
	}, "gpu-6", uuid, twoGi, map[string]string{"GPU_DRA_MEMORY_SHARE": fmt.Sprint(2 << 30)})
	whole := staysPending(ctx, t, sharedClaim(ns, "mem-whole", "gpu.nvidia.com", uuid, nil), name)
	for _, p := range pods {
		deleteClaimAndPod(ctx, t, p)
	}
	if _, err := cluster.WaitPodRunning(ctx, ns, whole.Name, 90*time.Second); err != nil {
		t.Fatalf("pod %s once the shares were gone: %v; kubelet errors: %v", whole.Name, err, n.DRAErrors())
	}
	deleteClaimAndPod(ctx, t, whole)
}
