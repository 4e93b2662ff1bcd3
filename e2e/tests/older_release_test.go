package tests

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// TestUnhealthyGPUWithheldWithoutDeviceTaints runs on a release whose API
// server drops device taints from ResourceSlices (DRADeviceTaints off by
// default before 1.36; `make e2e-1.34`): an unhealthy GPU cannot be tainted
// there, so the plugin withholds it from its slices (new claims cannot get
// it), says so once in a DRAFeatureMissing Node event naming the gate, and
// offers it again once the GPU is reset. On the harness's own release the
// taint is kept and TestDeviceHealth covers it; this test skips there.
func TestUnhealthyGPUWithheldWithoutDeviceTaints(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	release, err := cluster.Release(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if minor := harness.ReleaseMinor(release); minor >= 36 || minor < 0 {
		t.Skipf("Kubernetes %s keeps device taints (DRADeviceTaints on by default from 1.36); `make e2e-1.34` runs this test on 1.34", release)
	}
	const name = "node-no-taints"
	n := addPluginNode(ctx, t, name, "dgx-h100", []string{"--health-probe-interval-seconds=1"}, nil)
	devices := poolDevices(ctx, t, name)
	if len(devices) == 0 {
		t.Fatalf("node %s publishes no devices", name)
	}
	sick := "gpu-3"
	uuid := attrString(devices[sick], "uuid")
	if uuid == "" {
		t.Fatalf("device %s has no uuid attribute: %+v", sick, devices[sick])
	}
	sim := func(args ...string) { t.Helper(); gpuSim(t, n, args...) }

	// XID 48 (a double-bit ECC error): the GPU would be tainted; here it
	// leaves the slices, the other GPUs stay.
	sim("xid", "--gpu", uuid, "48")
	if !eventually(ctx, 30*time.Second, func() bool {
		_, published := poolDevices(ctx, t, name)[sick]
		return !published
	}) {
		t.Fatalf("unhealthy device %s still published, taints %v; plugin log:\n%s", sick, taintsOf(poolDevices(ctx, t, name)[sick]), n.Plugin.Log())
	}
	left := poolDevices(ctx, t, name)
	if len(left) != len(devices)-1 {
		t.Errorf("after withholding %s the node publishes %d devices, want %d", sick, len(left), len(devices)-1)
	}
	for d, dev := range left {
		if len(dev.Taints) > 0 {
			t.Errorf("device %s published with taints %v, which this API server drops", d, taintsOf(dev))
		}
	}
	var note string
	if !eventually(ctx, 30*time.Second, func() bool {
		list, err := cluster.Client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, e := range list.Items {
			if e.Reason == "DRAFeatureMissing" && e.Regarding.Kind == "Node" && e.Regarding.Name == name && strings.Contains(e.Note, "DRADeviceTaints") {
				note = e.Note
				return true
			}
		}
		return false
	}) {
		t.Fatalf("no DRAFeatureMissing event naming DRADeviceTaints on node %s; plugin log:\n%s", name, n.Plugin.Log())
	}
	t.Logf("node event: %s", note)
	if !strings.Contains(note, "1.36") {
		t.Errorf("event %q does not name the release that has DRADeviceTaints on by default (1.36)", note)
	}

	// The GPU is reset: offered again, untainted.
	sim("reset", "--gpu", uuid)
	if !eventually(ctx, 30*time.Second, func() bool {
		_, published := poolDevices(ctx, t, name)[sick]
		return published
	}) {
		t.Fatalf("device %s not offered again after the GPU reset; plugin log:\n%s", sick, n.Plugin.Log())
	}
}
