package tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TestPartitioningAnnotationsOnARunningNode: an admin annotates the Node of a
// running plugin; its GPU is republished as memory shares within seconds, with
// nothing else happening on the node (the plugin watches its Node), and as a
// whole GPU again once the annotation is removed. The plugin runs with the
// chart's RBAC, so this also checks that it may watch its Node.
func TestPartitioningAnnotationsOnARunningNode(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-annotated"
	addPluginNode(ctx, t, name, "dgx-a100-40gb", nil, nil)
	shared := func(device string) bool {
		d, ok := poolDevices(ctx, t, name)[device]
		return ok && d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations
	}
	if shared(memoryShareGPU) {
		t.Fatalf("%s offered as memory shares before any annotation", memoryShareGPU)
	}
	annotate := func(value string) {
		t.Helper()
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"gpu.nvidia.com/memory-share-gpus":%s}}}`, value)
		if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Set on the running node: applied within seconds (before the watch, the
	// publisher read it only when it reconciled for another reason).
	annotate(fmt.Sprintf("%q", memoryShareGPU))
	start := time.Now()
	if !eventually(ctx, 15*time.Second, func() bool { return shared(memoryShareGPU) }) {
		t.Fatalf("%s not offered as memory shares 15 s after the annotation was set; plugin log:\n%s", memoryShareGPU, cluster.Node(name).Plugin.Log())
	}
	t.Logf("%s offered as memory shares %s after the annotation was set", memoryShareGPU, time.Since(start).Round(time.Millisecond))
	if shared("gpu-5") {
		t.Errorf("gpu-5 is not named by the annotation but is offered as memory shares")
	}

	// Removed: a whole GPU again.
	annotate("null")
	start = time.Now()
	if !eventually(ctx, 15*time.Second, func() bool { return !shared(memoryShareGPU) }) {
		t.Fatalf("%s still offered as memory shares 15 s after the annotation was removed; plugin log:\n%s", memoryShareGPU, cluster.Node(name).Plugin.Log())
	}
	t.Logf("%s a whole GPU again %s after the annotation was removed", memoryShareGPU, time.Since(start).Round(time.Millisecond))
}
