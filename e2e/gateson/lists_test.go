package gateson

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// TestListFormsOnACubeMesh: a DGX-1-like node (hybrid cube-mesh NVLink) with
// the plugin's --list-type-attributes. The API server keeps the lists
// (nvlinkDomain as strings, numaNode as ints), and the scheduler allocates a
// claim for GPUs 0 and 4 with matchAttribute on nvlinkDomain: a cross pair of
// the mesh that shares no scalar domain, allocatable only by the lists. The
// pod runs: the plugin prepares what it published.
func TestListFormsOnACubeMesh(t *testing.T) {
	ctx := context.Background()
	const name = "node-lists"
	n := cluster.AddSimNode(ctx, t, setupErr, name, "dgx1-v100", nil, "--list-type-attributes=true")

	// Stored with their lists (read untyped: the typed API has no list fields).
	slicesGVR := schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "resourceslices"}
	uuids := map[string]string{}
	var lists int
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		if !n.Plugin.Running() {
			return false, errors.New("the plugin exited")
		}
		got, err := cluster.Dynamic.Resource(slicesGVR).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		if err != nil {
			return false, nil
		}
		lists = 0
		for _, s := range got.Items {
			devices, _, _ := unstructuredSlice(s.Object, "spec", "devices")
			for _, d := range devices {
				dev, _ := d.(map[string]any)
				attrs, _ := dev["attributes"].(map[string]any)
				if dom, ok := attrs["nvlinkDomain"].(map[string]any); ok {
					if l, ok := dom["strings"].([]any); ok && len(l) > 0 {
						lists++
					}
				}
				if u, ok := attrs["uuid"].(map[string]any); ok {
					uuids[dev["name"].(string)], _ = u["string"].(string)
				}
			}
		}
		return lists == 8 && len(uuids) == 8, nil
	})
	if err != nil {
		t.Fatalf("want 8 GPUs with nvlinkDomain lists stored, got %d lists, devices %v\nplugin log:\n%s", lists, uuids, n.Plugin.Log())
	}

	ns := "lists"
	if _, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	domain := resourceapi.FullyQualifiedName("gpu.nvidia.com/nvlinkDomain")
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "cross-pair", Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpus", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: "device.attributes['gpu.nvidia.com'].uuid in ['" + uuids["gpu-0"] + "', '" + uuids["gpu-4"] + "']",
				}}},
			}}},
			Constraints: []resourceapi.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: &domain}},
		}},
	}
	if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	grace := int64(1)
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "cross-pair", Namespace: ns},
		Spec: v1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": name},
			Containers: []v1.Container{{
				Name: "ctr", Image: harness.TestImageName,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpus"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpus", ResourceClaimName: &claim.Name}},
		},
	}
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), pod.Name, metav1.DeleteOptions{})
	})
	if _, err := cluster.WaitPodRunning(ctx, ns, pod.Name, 100*time.Second); err != nil {
		t.Fatalf("pod of the cross-pair claim: %v\nplugin log:\n%s", err, n.Plugin.Log())
	}
	got, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
	if err != nil || got.Status.Allocation == nil {
		t.Fatalf("claim not allocated: %v %+v", err, got)
	}
	var devices []string
	for _, r := range got.Status.Allocation.Devices.Results {
		devices = append(devices, r.Device)
	}
	slices.Sort(devices)
	if !slices.Equal(devices, []string{"gpu-0", "gpu-4"}) {
		t.Errorf("allocated %v, want the cross pair gpu-0, gpu-4", devices)
	}
}

// unstructuredSlice is the list at path in obj.
func unstructuredSlice(obj map[string]any, path ...string) ([]any, bool, error) {
	var at any = obj
	for _, p := range path {
		m, ok := at.(map[string]any)
		if !ok {
			return nil, false, nil
		}
		at = m[p]
	}
	l, ok := at.([]any)
	return l, ok, nil
}
