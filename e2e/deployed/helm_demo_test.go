package deployed

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/demo"
	"github.com/gpu-dra/e2e/harness"
)

// TestHelmDemo runs the steps of `make demo-helm` (package demo, as
// cmd/demo --helm runs them) with NVIDIA's release name and namespace: the
// GPU nodes join without a driver, `helm install` of the chart puts a
// Running plugin pod on each and the webhook's Deployment up, `kubectl
// apply` of a claim with a bad GPU config is refused by that webhook with
// every message its example expects, a whole-GPU example and a static MIG example
// run, `helm upgrade --reuse-values --set consumableShares=4` rolls the
// plugins and their slices publish the shares, `kubectl logs` and `kubectl
// exec` answer for a plugin pod, `gpu-dra check` passes (webhook-reachable
// too, not a warning) and `gpu-dra usage`
// shows its usage columns from the plugins' metrics (read through the API
// server's pod proxy), memory allocated for the claims, and each GPU named
// by its UUID.
func TestHelmDemo(t *testing.T) {
	ctx := context.Background()
	const release, ns = "dra-driver-nvidia-gpu", "dra-driver-nvidia-gpu"
	if _, err := cluster.DriverImage(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	say := func(format string, args ...any) { t.Logf(format, args...) }
	nodes, err := demo.AddHelmNodes(ctx, cluster, say)
	for _, n := range nodes {
		t.Cleanup(func() {
			if err := cluster.RemoveNode(context.Background(), n.Name); err != nil {
				t.Errorf("remove node %s: %v", n.Name, err)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last-in first-out: the examples, then the release, then
	// the nodes.
	t.Cleanup(func() {
		if _, err := cluster.Helm(context.Background(), "status", release, "-n", ns); err == nil {
			if _, err := cluster.Helm(context.Background(), "uninstall", release, "-n", ns, "--wait"); err != nil {
				t.Errorf("helm uninstall: %v", err)
			}
		}
	})
	res, err := demo.RunHelm(ctx, cluster, demo.HelmOptions{Release: release, Namespace: ns, Examples: "whole-gpu,mig-1g5gb", Say: say})
	if res != nil {
		t.Cleanup(func() {
			for _, r := range res.Runs {
				r.Teardown(context.Background())
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the demo's steps took %s", time.Since(start).Round(time.Second))

	// Plugin pods Running on both nodes, from the DaemonSet, replaced by the
	// upgrade.
	for _, spec := range demo.HelmNodes {
		first, second := res.Installed[spec.Name], res.Upgraded[spec.Name]
		if first == nil || second == nil {
			t.Fatalf("plugin pods on %s: installed %v, upgraded %v", spec.Name, first, second)
		}
		if first.UID == second.UID {
			t.Errorf("the upgrade left the plugin pod %s on %s", first.Name, spec.Name)
		}
		if len(second.OwnerReferences) == 0 || second.OwnerReferences[0].Kind != "DaemonSet" {
			t.Errorf("plugin pod %s not the DaemonSet's: %v", second.Name, second.OwnerReferences)
		}
	}
	// The examples' pods Running (in the namespaces their files name).
	want := map[string]bool{"whole-gpu": false, "mig": false}
	for _, r := range res.Runs {
		for _, p := range r.Problems {
			t.Errorf("example: %s", p)
		}
		for _, pod := range r.Pods {
			got, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
			if err != nil || got.Status.Phase != v1.PodRunning {
				t.Errorf("example pod %s/%s after the upgrade: %v", pod.Namespace, pod.Name, err)
				continue
			}
			want[pod.Namespace] = true
		}
	}
	for ns, ran := range want {
		if !ran {
			t.Errorf("no Running pod in the example's namespace %s", ns)
		}
	}
	// The upgrade's value on the slices, as kubectl printed them.
	if strings.Contains(res.Shares, "shares=4") || !strings.Contains(res.SharesUpgraded, "gpu-0 shares=4") {
		t.Errorf("slices of %s before the upgrade:\n%s\nafter:\n%s\nwant shares=4 after only", demo.HelmNodes[1].Name, res.Shares, res.SharesUpgraded)
	}
	if !strings.Contains(res.Logs, `"level"`) {
		t.Errorf("kubectl logs of the plugin pod shows no JSON log lines:\n%s", res.Logs)
	}
	if !strings.HasPrefix(res.Exec, "gpu-kubelet-plugin ") {
		t.Errorf("kubectl exec gpu-kubelet-plugin --version: %q", res.Exec)
	}
	if res.CheckExit != 0 || strings.Contains(res.Check, "×") {
		t.Errorf("gpu-dra check: exit %d:\n%s", res.CheckExit, res.Check)
	}
	if !strings.Contains(res.Check, "√ admission webhook reachable from the API server [webhook-reachable]") {
		t.Errorf("gpu-dra check: webhook-reachable did not pass:\n%s", res.Check)
	}
	checkRefusal(t, res.Refusal)
	checkUsage(t, res.Usage)
}

// checkRefusal asserts that `kubectl apply` of demo.InvalidExample was
// refused as invalid with every line of the example's expected messages
// (the webhook's; the API server's own validation knows nothing of opaque
// parameters).
func checkRefusal(t *testing.T, out string) {
	t.Helper()
	path, err := harness.RepoPath(strings.TrimSuffix(demo.InvalidExample, ".yaml") + ".expected.txt")
	if err != nil {
		t.Fatal(err)
	}
	expected, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// kubectl prints a 422 refusal's causes after "The request is invalid".
	want := append([]string{"The request is invalid: "}, strings.Split(strings.TrimSpace(string(expected)), "\n")...)
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("kubectl apply -f %s printed\n%s\nwithout %q", demo.InvalidExample, out, w)
		}
	}
}

// checkUsage asserts `gpu-dra usage`'s text: its usage columns, every
// plugin's metrics read, the whole-GPU claim and the MIG claim with
// figures, memory allocated above zero, and the GPU column a UUID on every
// row.
func checkUsage(t *testing.T, out string) {
	t.Helper()
	if !demo.UsageHasColumns(out) {
		t.Errorf("gpu-dra usage without its usage columns, or with metrics not read:\n%s", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	uuid := regexp.MustCompile(`^GPU-[0-9a-fA-F-]+$`)
	holders := map[string]bool{}
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) < 5 || f[0] == "cluster:" {
			continue
		}
		if !uuid.MatchString(f[1]) {
			t.Errorf("GPU column %q is not a GPU UUID: %s", f[1], l)
		}
		if ns, _, _ := strings.Cut(f[3], "/"); ns == "whole-gpu" || ns == "mig" {
			holders[f[3]] = strings.Contains(l, "Mi") || strings.Contains(l, "Gi")
		}
	}
	mig, whole := false, false
	for claim, figures := range holders {
		if !figures {
			t.Errorf("claim %s has no memory figures:\n%s", claim, out)
		}
		mig = mig || strings.HasPrefix(claim, "mig/")
		whole = whole || strings.HasPrefix(claim, "whole-gpu/")
	}
	if !mig || !whole {
		t.Errorf("gpu-dra usage does not show the examples' claims (whole GPU %v, MIG %v):\n%s", whole, mig, out)
	}
	summary := regexp.MustCompile(`memory allocated ([0-9.]+)(Mi|Gi)`).FindStringSubmatch(out)
	if summary == nil || summary[1] == "0" {
		t.Errorf("the summary's memory allocated is not above zero: %v\n%s", summary, out)
	}
}
