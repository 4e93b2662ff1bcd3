package deployed

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// TestChartOnAnOlderRelease runs on a release before 1.36 (`make e2e-1.34`:
// the 1.34 control plane and kubelet): the chart installs there as a user
// installs it (helm reads the API server's version), its plugin pod serves a
// whole-GPU claim, an upgrade to values needing a gate the release has off
// (`consumableShares`: DRAConsumableCapacity) is refused by helm naming the
// gate, the release and the release that has it on, and changes nothing,
// and `gpu-dra check` passes its API, plugin and slice checks and warns on
// the features: the gates are off, device health runs on its fallback. It
// skips on the harness's own release.
func TestChartOnAnOlderRelease(t *testing.T) {
	ctx := context.Background()
	release, err := cluster.Release(ctx)
	if err != nil {
		t.Fatal(err)
	}
	minor := harness.ReleaseMinor(release)
	if minor < 0 || minor >= 36 {
		t.Skipf("Kubernetes %s has DRAConsumableCapacity on by default; `make e2e-1.34` runs this test on 1.34", release)
	}
	layout := harness.LayoutHostDriver
	n := addNode(t, "node-older", layout, "t4")
	install(t, append(layout.HelmValues(), "webhook.enabled=false")...)
	plugin := waitPlugin(ctx, t, n, "")
	waitSlices(ctx, t, n.Name)

	pod := gpuPod(ctx, t, "older-release", "gpu", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 90*time.Second); err != nil {
		t.Fatalf("whole-GPU pod on %s: %v", release, err)
	}

	// Values needing a gate that is off: refused at install time, by helm.
	out, err := cluster.Helm(ctx, "upgrade", harness.HelmRelease, "deploy/helm/gpu-dra-driver", "--namespace", harness.DriverNamespace,
		"--reuse-values", "--set", "consumableShares=4")
	if err == nil {
		t.Fatalf("helm upgrade with consumableShares=4 on %s succeeded, want it refused:\n%s", release, out)
	}
	msg := err.Error() + out
	for _, want := range []string{"DRAConsumableCapacity", "off by default in Kubernetes 1." + strconv.Itoa(minor), "on by default from 1.36", "clusterFeatureGates"} {
		if !strings.Contains(msg, want) {
			t.Errorf("helm's refusal does not say %q: %s", want, msg)
		}
	}
	t.Logf("helm upgrade refused: %s", msg)
	if now := waitPlugin(ctx, t, n, ""); now.Pod.UID != plugin.Pod.UID {
		t.Errorf("the refused upgrade replaced the plugin pod %s with %s", plugin.Pod.Name, now.Pod.Name)
	}

	var report harness.CheckReport
	var code int
	// A plugin pod's readiness can trail its registration by a probe period.
	if err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		report, code = cluster.Check(t, "--only", "api-server,resource-api,dra-features,plugin-pods,resource-slices")
		return code == 0, nil
	}); err != nil {
		t.Errorf("gpu-dra check on %s: exit %d, want 0", release, code)
	}
	// The chart's default device health works there with less: unhealthy
	// GPUs withheld instead of tainted. A warning that says so, not a failure.
	features := report.Find(t, "dra-features")
	if features.Status != "warning" || !strings.Contains(strings.Join(features.Detail, "\n"), "DRAConsumableCapacity: off") ||
		!strings.Contains(features.Fix, "withheld from the ResourceSlices") {
		t.Errorf("check dra-features on %s: %s %v, fix %q; want a warning naming DRAConsumableCapacity off and the withheld GPUs", release, features.Status, features.Detail, features.Fix)
	}
	if api := report.Find(t, "api-server"); !strings.Contains(strings.Join(api.Detail, "\n"), release) {
		t.Errorf("check api-server does not name the release %s: %v", release, api.Detail)
	}
}
