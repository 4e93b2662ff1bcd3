package harness

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

const refDriver = "ref.e2e.gpu-dra"

// TestControlPlaneWithReferenceDriver: control plane up, a driver registers
// through the kubelet's plugin watcher, the scheduler allocates a claim from
// a template against a ResourceSlice created here, the DRA manager prepares
// it, the pod runs with the CDI IDs recorded, and deletion unprepares it.
func TestControlPlaneWithReferenceDriver(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	// The reference driver writes no CDI specs, so no container could start.
	n, err := c.AddNode(ctx, NodeOptions{Name: "node-1", NoContainers: true})
	if err != nil {
		t.Fatal(err)
	}

	plugin, err := n.StartRefDriver(ctx, refDriver, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer plugin.Stop()
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		return n.DriverRegistered(refDriver), nil
	}); err != nil {
		t.Fatalf("driver never registered with the kubelet's plugin manager: %v", err)
	}

	slice := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1-ref"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   refDriver,
			Pool:     resourceapi.ResourcePool{Name: n.Name, ResourceSliceCount: 1},
			NodeName: &n.Name,
			Devices: []resourceapi.Device{
				{Name: "dev-0", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: new("gpu")}}},
				{Name: "dev-1", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: new("gpu")}}},
			},
		},
	}
	if _, err := c.Client.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The kubelet wipes the node's slices of every driver once at its start, in the
	// background, as soon as it can read its Node: on a loaded machine that can come after the
	// slice above was created. The slice is made again when it went, until the pod runs (a
	// real driver's publisher does the same).
	keep, stopKeeping := context.WithCancel(ctx)
	kept := make(chan struct{})
	defer func() {
		stopKeeping()
		<-kept
	}()
	go func() {
		defer close(kept)
		for keep.Err() == nil {
			if _, err := c.Client.ResourceV1().ResourceSlices().Get(keep, slice.Name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
				t.Logf("slice %s was wiped by the kubelet's start; creating it again", slice.Name)
				_, _ = c.Client.ResourceV1().ResourceSlices().Create(keep, slice, metav1.CreateOptions{})
			}
			select {
			case <-keep.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: "ref"},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: `device.driver == "` + refDriver + `"`},
		}}},
	}
	if _, err := c.Client.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "one", Namespace: "default"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "ref"},
			}}},
		}},
	}
	if _, err := c.Client.ResourceV1().ResourceClaimTemplates("default").Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// With a quota in the namespace, pods are admitted only once the
	// resourcequota controller has computed its status.
	quota := &v1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Name: "q", Namespace: "default"},
		Spec:       v1.ResourceQuotaSpec{Hard: v1.ResourceList{"pods": resource.MustParse("10"), "count/resourceclaims.resource.k8s.io": resource.MustParse("5")}},
	}
	if _, err := c.Client.CoreV1().ResourceQuotas("default").Create(ctx, quota, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		q, err := c.Client.CoreV1().ResourceQuotas("default").Get(ctx, "q", metav1.GetOptions{})
		return err == nil && len(q.Status.Hard) > 0, nil
	}); err != nil {
		t.Fatalf("resourcequota controller never computed the quota status: %v", err)
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "default"},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{
				Name: "ctr", Image: "busybox",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: new("one")}},
		},
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	running, err := c.WaitPodRunning(ctx, "default", "p", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	stopKeeping()
	if running.Spec.NodeName != n.Name {
		t.Fatalf("pod on %q, want %q", running.Spec.NodeName, n.Name)
	}
	ids, err := CDIDevices(running)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids["ctr"]) != 1 {
		t.Fatalf("container CDI devices %v, want one", ids)
	}
	claimName := *running.Status.ResourceClaimStatuses[0].ResourceClaimName
	claim, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, claimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim not allocated: %+v", claim.Status)
	}
	want := refDriver + "/dev=" + string(claim.UID) + "-" + claim.Status.Allocation.Devices.Results[0].Device
	if ids["ctr"][0] != want {
		t.Fatalf("CDI ID %q, want %q", ids["ctr"][0], want)
	}

	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "p", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitPodGone(ctx, "default", "p", time.Minute); err != nil {
		t.Fatal(err)
	}
	if !plugin.Unprepared(claim.UID) {
		t.Fatalf("claim %s was not unprepared on pod deletion", claim.UID)
	}
	// The generated claim goes away with its pod (resourceclaim controller).
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, claimName, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatalf("generated claim %s not deleted after its pod: %v", claimName, err)
	}
}
