package gatesoff

import (
	"context"
	"strings"
	"testing"

	"github.com/gpu-dra/e2e/harness"
)

// TestCheckNamesTheGatesOff: `gpu-dra check --only dra-features` on this
// control plane (release 1.37, its DRA beta gates turned off). With the
// chart's defaults no setting needs a gate that is off: it passes, and says
// the dry-run write found consumable capacity and partitionable devices
// turned off, and that ResourceHealthStatus, which no dry-run write shows,
// is assumed on from the release's default. With memory shares and dynamic MIG selected in the chart's
// values (`helm upgrade`; the chart lets them through, 1.37 having their
// gates on by default) it fails naming each gate, the release that has it on
// by default and the value that needs it, and exits 1; the chart's values
// are restored afterwards.
//
// Only dra-features is asserted: the plugins here run as processes, not as
// the chart's DaemonSet pods (which select no node), and nothing serves the
// webhook's Service, so plugin-pods, resource-slices and webhook-reachable
// fail on this cluster by design.
func TestCheckNamesTheGatesOff(t *testing.T) {
	ctx := context.Background()
	if d := cluster.Driver(); d == nil || !d.FromChart {
		t.Fatalf("the driver was not installed with helm (helm or the chart missing): %+v", d)
	}
	const check = "dra-features"
	r, code := cluster.CheckOnly(t, check)
	harness.ExpectCheckPassed(t, r, code)
	detail := strings.Join(r.Detail, "\n")
	for _, want := range []string{
		"DRAConsumableCapacity: off (fields dropped by a dry-run write: turned off on this cluster)",
		"DRAPartitionableDevices: off (fields dropped by a dry-run write: turned off on this cluster)",
		// Off here too, but no dry-run write shows it: the release's default, said to be assumed.
		"ResourceHealthStatus: on (not observed: on by default in 1.37 (on by default from Kubernetes 1.36), unless the cluster turned it off)",
	} {
		if !strings.Contains(detail, want) {
			t.Errorf("dra-features detail %q does not say %q", r.Detail, want)
		}
	}

	t.Cleanup(func() {
		// The values RunWithFeatureGates installed.
		if err := cluster.HelmUpgrade(context.Background()); err != nil {
			t.Errorf("restore the chart's values: %v", err)
		}
	})
	if err := cluster.HelmUpgrade(ctx, "kubeletPlugin.partitioning.memoryShareGpus=gpu-4",
		"kubeletPlugin.partitioning.dynamicMigGpus=gpu-0"); err != nil {
		t.Fatal(err)
	}
	r, code = cluster.CheckOnly(t, check)
	harness.ExpectCheckFailed(t, r, code,
		[]string{`DRAConsumableCapacity: off (fields dropped by a dry-run write: turned off on this cluster); needed by kubeletPlugin.partitioning.memoryShareGpus="gpu-4"`},
		[]string{
			"turn the feature gate DRAConsumableCapacity on in the API server, scheduler, controller manager and kubelets (on by default from Kubernetes 1.36), or turn off kubeletPlugin.partitioning.memoryShareGpus=\"gpu-4\"",
			"turn the feature gate DRAPartitionableDevices on in the API server, scheduler, controller manager and kubelets (on by default from Kubernetes 1.36), or turn off kubeletPlugin.partitioning.dynamicMigGpus=\"gpu-0\"",
		})
}
