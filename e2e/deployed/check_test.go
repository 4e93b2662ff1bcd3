package deployed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// checkReport is the part of `gpu-dra check -o json` the test reads.
type checkReport struct {
	Status string `json:"status"`
	Checks []struct {
		Name   string   `json:"name"`
		Status string   `json:"status"`
		Detail []string `json:"detail"`
		Fix    string   `json:"fix"`
	} `json:"checks"`
}

// runCheck runs `gpu-dra check -o json` (with the extra flags) against the
// cluster and returns its report and exit status.
func runCheck(t *testing.T, flags ...string) (checkReport, int) {
	t.Helper()
	bin, err := harness.Binary("gpu-dra")
	if err != nil {
		t.Fatalf("no gpu-dra CLI: %v", err)
	}
	cmd := exec.Command(bin, append([]string{"check", "--namespace", harness.DriverNamespace, "-o", "json"}, flags...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+cluster.Kubeconfig)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else if err != nil {
		t.Fatalf("gpu-dra check: %v", err)
	}
	var report checkReport
	if err := json.Unmarshal(out, &report); err != nil {
		t.Fatalf("gpu-dra check (exit %d): %v; stdout:\n%s\nstderr:\n%s", code, err, out, stderr.String())
	}
	t.Logf("gpu-dra check: exit %d, status %s\n%s", code, report.Status, out)
	return report, code
}

// checkWorkload runs `gpu-dra check --workload --node node` and expects the
// workload check passed on that node with the UUID of the device its claim
// got, and its namespace gone afterwards.
func checkWorkload(ctx context.Context, t *testing.T, node string) {
	t.Helper()
	report, code := runCheck(t, "--workload", "--node", node, "--workload-timeout", "90s")
	if code != 0 {
		t.Errorf("gpu-dra check --workload on a healthy install: exit %d, want 0", code)
	}
	var detail []string
	found := false
	for _, c := range report.Checks {
		if c.Name != "workload" {
			continue
		}
		found = true
		detail = c.Detail
		if c.Status != "passed" {
			t.Errorf("workload: %q, want passed: %v; fix: %s", c.Status, c.Detail, c.Fix)
		}
	}
	if !found {
		t.Fatal("no workload check in the report of gpu-dra check --workload")
	}
	joined := strings.Join(detail, "\n")
	if !strings.Contains(joined, "node "+node) {
		t.Errorf("workload detail %v does not name node %s", detail, node)
	}
	// The device line's UUID is the one the pod saw.
	var device, seen string
	for _, l := range detail {
		if _, rest, ok := strings.Cut(l, "(UUID "); ok && strings.HasPrefix(l, "device ") {
			device = strings.TrimSuffix(rest, ")")
		}
		if rest, ok := strings.CutPrefix(l, "UUID seen "); ok {
			seen = rest
		}
	}
	if !strings.HasPrefix(device, "GPU-") || device != seen {
		t.Errorf("workload detail %v: allocated UUID %q, seen %q; want the same GPU-... UUID", detail, device, seen)
	}
	// The check deletes its namespace.
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := cluster.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=gpu-dra-check"})
		return err == nil && len(l.Items) == 0, nil
	})
	if err != nil {
		t.Errorf("the workload's namespace stays after gpu-dra check: %v", err)
	}
}

// waitSlices waits until each node has our ResourceSlices.
func waitSlices(ctx context.Context, t *testing.T, nodes ...string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		for _, n := range nodes {
			l, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
				FieldSelector: "spec.nodeName=" + n + ",spec.driver=" + harness.DefaultDriver,
			})
			if err != nil || len(l.Items) == 0 {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("no ResourceSlices of %v: %v", nodes, err)
	}
}

// TestCheck: `gpu-dra check` on a healthy install (two nodes with the
// deployed plugin) fails no check and exits 0; `--workload --node` runs a
// one-GPU pod on that node, on the chart's plugin image (the default: no shell,
// nvidia-smi from the claim's CDI spec), which lists exactly the GPU its claim
// was allocated, and removes its namespace; with the plugin gone from one
// GPU node (no longer selected by the DaemonSet, labeled as a GPU node as
// NVIDIA's GPU feature discovery labels them), `plugin-pods` fails naming
// the node, with its fix, and it exits 1.
//
// The webhook is not installed: the suite's in-process API server cannot
// reach in-cluster Services (docs/STATUS.md), so `webhook-reachable` would
// fail on every run; without it that check is a warning (exit 0).
func TestCheck(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutHostDriver
	a := addNode(t, "node-check-a", layout, "t4")
	b := addNode(t, "node-check-b", layout, "t4")
	install(t, append(layout.HelmValues(), "webhook.enabled=false")...)
	waitPlugin(ctx, t, a, "")
	waitPlugin(ctx, t, b, "")
	waitSlices(ctx, t, a.Name, b.Name)

	// Healthy: every check passed or warned (the webhook is absent).
	var report checkReport
	var code int
	// A plugin pod's readiness can trail its registration by a probe period.
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		report, code = runCheck(t)
		return code == 0, nil
	})
	if err != nil {
		t.Fatalf("gpu-dra check on a healthy install: exit %d, want 0", code)
	}
	status := map[string]string{}
	for _, c := range report.Checks {
		status[c.Name] = c.Status
		if c.Status == "failed" {
			t.Errorf("check %s failed on a healthy install: %v; fix: %s", c.Name, c.Detail, c.Fix)
		}
	}
	for _, name := range []string{"api-server", "resource-api", "dra-features", "device-classes", "plugin-pods", "resource-slices", "mps-daemons", "stuck-claims", "device-taints", "webhook-certificate"} {
		if status[name] != "passed" {
			t.Errorf("check %s: %q, want passed", name, status[name])
		}
	}
	if status["webhook-reachable"] != "warning" {
		t.Errorf("check webhook-reachable without a webhook: %q, want warning", status["webhook-reachable"])
	}
	checkWorkload(ctx, t, a.Name)

	// Broken: node b is a GPU node the DaemonSet no longer selects.
	patch := fmt.Sprintf(`{"metadata":{"labels":{"nvidia.com/gpu.present":"true",%q:null}}}`, harness.DeployedPluginLabel)
	if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, b.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(harness.DriverNamespace).List(ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/component=kubelet-plugin",
			FieldSelector: "spec.nodeName=" + b.Name,
		})
		return err == nil && len(pods.Items) == 0, nil
	})
	if err != nil {
		t.Fatalf("the plugin pod on %s stays: %v", b.Name, err)
	}
	report, code = runCheck(t)
	if code != 1 {
		t.Errorf("gpu-dra check with the plugin gone from %s: exit %d, want 1", b.Name, code)
	}
	if report.Status != "failed" {
		t.Errorf("report status %q, want failed", report.Status)
	}
	found := false
	for _, c := range report.Checks {
		if c.Name != "plugin-pods" {
			continue
		}
		found = true
		if c.Status != "failed" {
			t.Errorf("plugin-pods: %q, want failed", c.Status)
		}
		want := "node " + b.Name + ": no plugin pod"
		if !strings.Contains(strings.Join(c.Detail, "\n"), want) {
			t.Errorf("plugin-pods detail %v does not say %q", c.Detail, want)
		}
		if !strings.Contains(c.Fix, "describe daemonset") {
			t.Errorf("plugin-pods fix %q does not point at the DaemonSet", c.Fix)
		}
		if strings.Contains(strings.Join(c.Detail, "\n"), "node "+a.Name+":") {
			t.Errorf("plugin-pods blames the healthy node %s: %v", a.Name, c.Detail)
		}
	}
	if !found {
		t.Error("no plugin-pods check in the report")
	}
}
