package deployed

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// TestChartOnAnOlderRelease runs on a release before the harness's own
// (`make e2e-1.34`, `e2e-1.35`, `e2e-1.36`: that release's control plane and
// kubelet): the chart installs there as a user installs it (helm reads the
// API server's version) and its plugin pod serves a whole-GPU claim. Then
// `helm upgrade --set consumableShares=4`, which needs DRAConsumableCapacity:
//   - before 1.36 (the gate off by default) helm refuses it naming the gate,
//     the release and the release that has it on, and changes nothing; `gpu-dra
//     check` passes its API, plugin and slice checks and warns on the features
//     (the gates are off, device health runs on its fallback);
//   - on 1.36 (beta, on) the plugin pod is replaced, the slices the API server
//     keeps carry 4 shares on the GPU with multiple allocations allowed, two
//     claims run on the node's one GPU at once, and the check passes.
//
// It skips on the harness's own release (TestHelmDemo upgrades there).
func TestChartOnAnOlderRelease(t *testing.T) {
	ctx := context.Background()
	release, err := cluster.Release(ctx)
	if err != nil {
		t.Fatal(err)
	}
	minor := harness.ReleaseMinor(release)
	if minor < 0 || minor >= 37 {
		t.Skipf("Kubernetes %s is the harness's own release; `make e2e-1.34` (1.35, 1.36) runs this test on an older one", release)
	}
	gatesOff := minor < 36
	layout := harness.LayoutHostDriver
	n := addNode(t, "node-older", layout, "t4")
	install(t, append(layout.HelmValues(), "webhook.enabled=false")...)
	plugin := waitPlugin(ctx, t, n, "")
	waitSlices(ctx, t, n.Name)

	pod := gpuPod(ctx, t, "older-release", "gpu", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 90*time.Second); err != nil {
		t.Fatalf("whole-GPU pod on %s: %v", release, err)
	}

	// Values needing DRAConsumableCapacity: refused at install time, by helm,
	// where the gate is off.
	out, err := cluster.Helm(ctx, "upgrade", harness.HelmRelease, "deploy/helm/gpu-dra-driver", "--namespace", harness.DriverNamespace,
		"--reuse-values", "--set", "consumableShares=4")
	if gatesOff {
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
	} else {
		if err != nil {
			t.Fatalf("helm upgrade with consumableShares=4 on %s: %v\n%s", release, err, out)
		}
		waitPlugin(ctx, t, n, plugin.Pod.UID)
		sharedGPUOnRelease(ctx, t, release, n.Name, pod)
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
	features := report.Find(t, "dra-features")
	if !gatesOff {
		if features.Status != "passed" {
			t.Errorf("check dra-features on %s with consumable shares: %s %v, fix %q; want passed", release, features.Status, features.Detail, features.Fix)
		}
		return
	}
	// The chart's default device health works there with less: unhealthy
	// GPUs withheld instead of tainted. A warning that says so, not a failure.
	if features.Status != "warning" || !strings.Contains(strings.Join(features.Detail, "\n"), "DRAConsumableCapacity: off") ||
		!strings.Contains(features.Fix, "withheld from the ResourceSlices") {
		t.Errorf("check dra-features on %s: %s %v, fix %q; want a warning naming DRAConsumableCapacity off and the withheld GPUs", release, features.Status, features.Detail, features.Fix)
	}
	if api := report.Find(t, "api-server"); !strings.Contains(strings.Join(api.Detail, "\n"), release) {
		t.Errorf("check api-server does not name the release %s: %v", release, api.Detail)
	}
}

// sharedGPUOnRelease: the node's slices, as the API server of release keeps
// them, offer its GPU with 4 shares and multiple allocations; once the pod
// holding the GPU whole is gone, two claims of one share each run on it at
// once.
func sharedGPUOnRelease(ctx context.Context, t *testing.T, release, node string, whole *v1.Pod) {
	t.Helper()
	var kept string
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
			FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + harness.DefaultDriver,
		})
		if err != nil {
			return false, nil
		}
		kept = ""
		for _, s := range l.Items {
			for _, d := range s.Spec.Devices {
				shares, ok := d.Capacity["shares"]
				kept += fmt.Sprintf(" %s(allowMultipleAllocations=%v, capacity=%v)", d.Name, d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations, len(d.Capacity))
				if ok && shares.Value.Value() == 4 && d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations {
					return true, nil
				}
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("no device of %s with 4 shares and multiple allocations in the slices %s keeps:%s", node, release, kept)
	}
	grace := int64(0)
	if err := cluster.Client.CoreV1().Pods(whole.Namespace).Delete(ctx, whole.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Client.ResourceV1().ResourceClaims(whole.Namespace).Delete(ctx, whole.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"share-a", "share-b"} {
		if _, err := createClaimPod(ctx, whole.Namespace, name, node, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"share-a", "share-b"} {
		if _, err := cluster.WaitPodRunning(ctx, whole.Namespace, name, 120*time.Second); err != nil {
			t.Fatalf("pod %s sharing the GPU of %s on %s: %v", name, node, release, err)
		}
	}
	for _, name := range []string{"share-a", "share-b"} {
		c, err := cluster.Client.ResourceV1().ResourceClaims(whole.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if c.Status.Allocation == nil || len(c.Status.Allocation.Devices.Results) != 1 {
			t.Fatalf("claim %s: no single-device allocation: %+v", name, c.Status.Allocation)
		}
		r := c.Status.Allocation.Devices.Results[0]
		if r.ShareID == nil {
			t.Errorf("claim %s: allocated without a share ID on a device allowing multiple allocations", name)
			continue
		}
		consumed := []string{}
		for k, q := range r.ConsumedCapacity {
			consumed = append(consumed, string(k)+"="+q.String())
		}
		slices.Sort(consumed)
		t.Logf("claim %s on %s: %s/%s share %s, consumed %s", name, release, r.Pool, r.Device, *r.ShareID, strings.Join(consumed, " "))
	}
}
