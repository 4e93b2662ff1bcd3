package deployed

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

const daemonSelector = "app.kubernetes.io/component=mps-control-daemon"

// TestMPSDaemonOutlivesThePlugin: with the chart's defaults an MPS claim's
// control daemon runs in a pod of its own, visible with kubectl. A crash of
// the plugin's container and a rolling update of the plugin (helm upgrade)
// leave that pod, its daemon and its MPS server untouched: the workload's
// CUDA program keeps the same server and limits, and the new plugin
// re-adopts the daemon. A daemon pod that no record owns (its claim gone
// while no plugin ran) is deleted when the plugin starts. A daemon pod
// deleted by someone else is replaced, with the claim's limits: the plugin
// learns of it through its watch on the node's daemon pods (with the chart's
// RBAC). Deleting the workload unprepares the claim: the daemon pod goes and
// the GPU is back in compute mode DEFAULT. On each driver layout: the daemon
// runs the driver root's nvidia-cuda-mps-control, whose library folder holds
// the host's own glibc.
func TestMPSDaemonOutlivesThePlugin(t *testing.T) {
	for _, layout := range []harness.Layout{harness.LayoutContainerDriver, harness.LayoutHostDriver} {
		t.Run(string(layout), func(t *testing.T) { mpsDaemonOutlivesThePlugin(t, layout) })
	}
}

func mpsDaemonOutlivesThePlugin(t *testing.T, layout harness.Layout) {
	ctx := context.Background()
	n := addNode(t, "node-mps-pods-"+string(layout), layout, "t4")
	install(t, layout.HelmValues()...)
	plugin := waitPlugin(ctx, t, n, "")

	pod, daemon, server := runMPSWorkload(ctx, t, n, plugin, "mps-pods-"+string(layout))

	// A crash of the plugin's container: the kubelet starts it again.
	const adopted = "re-adopted MPS control daemon pod"
	before := strings.Count(plugin.Log(), adopted)
	plugin.Kill()
	waitLog(ctx, t, plugin, func(log string) bool { return strings.Count(log, adopted) > before })
	sameDaemon(ctx, t, n, daemon)
	if got := mpsServer(ctx, t, n, pod, "40.0"); got != server {
		t.Errorf("after the plugin's crash the workload's MPS server is %s, was %s", got, server)
	}

	// A rolling update: a new plugin pod replaces the old one.
	if err := cluster.HelmUpgrade(ctx, append(layout.HelmValues(), "logLevel=debug")...); err != nil {
		t.Fatal(err)
	}
	second := waitPlugin(ctx, t, n, plugin.Pod.UID)
	waitLog(ctx, t, second, func(log string) bool { return strings.Contains(log, adopted) })
	sameDaemon(ctx, t, n, daemon)
	if got := mpsServer(ctx, t, n, pod, "40.0"); got != server {
		t.Errorf("after the rolling update the workload's MPS server is %s, was %s", got, server)
	}

	// A daemon pod nothing records (as after its claim went while no plugin
	// ran): deleted at the next plugin start.
	stray := daemon.DeepCopy()
	stray.ObjectMeta = metav1.ObjectMeta{
		Name:        "mps-stray",
		Namespace:   daemon.Namespace,
		Labels:      daemon.Labels,
		Annotations: map[string]string{"resource.nvidia.com/mps-daemon-id": "00000000-0000-0000-0000-000000000000-c"},
	}
	stray.Status = v1.PodStatus{}
	if _, err := cluster.Client.CoreV1().Pods(stray.Namespace).Create(ctx, stray, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	second.Kill()
	if err := cluster.WaitPodGone(ctx, stray.Namespace, stray.Name, 60*time.Second); err != nil {
		t.Errorf("the daemon pod nothing records is still there after the plugin's restart: %v; log:\n%s", err, second.Log())
	}
	sameDaemon(ctx, t, n, daemon)

	// Deleted by someone else (an admin, an eviction): replaced.
	if err := cluster.Client.CoreV1().Pods(daemon.Namespace).Delete(ctx, daemon.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(daemon.Namespace).Get(ctx, daemon.Name, metav1.GetOptions{})
		return err == nil && p.UID != daemon.UID && p.DeletionTimestamp == nil && p.Status.Phase == v1.PodRunning, nil
	})
	if err != nil {
		t.Fatalf("the deleted MPS control daemon pod was not replaced: %v; plugin log:\n%s", err, second.Log())
	}
	daemon = daemonPod(ctx, t, n.Name)
	// The workload's CUDA program joins the new daemon's server, with the
	// claim's limits, once the daemon serves: the kubelet reports the pod
	// Running when its container started, not when the daemon listens.
	var res harness.ExecResult
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		res, err = n.Exec(ctx, pod, "ctr", "cuda-app")
		return err == nil && res.ExitCode == 0 && strings.Contains(res.Stdout, "MPS server "), nil
	})
	if err != nil {
		t.Fatalf("the workload's CUDA program joined no server of the replaced daemon: %v: %s%s", err, res.Stdout, res.Stderr)
	}
	mpsServer(ctx, t, n, pod, "40.0")

	// The claim is unprepared: its daemon pod goes, the GPU is released.
	if err := cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitPodGone(ctx, pod.Namespace, pod.Name, 60*time.Second); err != nil {
		t.Fatalf("%v; plugin log:\n%s", err, second.Log())
	}
	if err := cluster.WaitPodGone(ctx, daemon.Namespace, daemon.Name, 30*time.Second); err != nil {
		t.Errorf("daemon pod after its claim was unprepared: %v", err)
	}
	if mode, _ := gpuSettings(t, n); mode != "DEFAULT" {
		t.Errorf("GPU 0 in compute mode %q after the MPS claim was unprepared, want DEFAULT", mode)
	}
}

// runMPSWorkload runs, in namespace ns, a pod with a claim for one GPU shared
// with MPS (40% of the threads, 2Gi of pinned memory) and returns it, its
// control daemon's pod and the MPS server its CUDA program joined.
func runMPSWorkload(ctx context.Context, t *testing.T, n *harness.Node, plugin *harness.DaemonPod, ns string) (*v1.Pod, *v1.Pod, string) {
	t.Helper()
	pod := mpsPod(ctx, t, ns, "mps", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 90*time.Second); err != nil {
		t.Fatalf("%v; plugin log:\n%s", err, plugin.Log())
	}
	daemon := daemonPod(ctx, t, n.Name)
	t.Logf("MPS control daemon pod %s/%s (claim %s)", daemon.Namespace, daemon.Name, daemon.Labels["resource.nvidia.com/claim-uid"])
	return pod, daemon, mpsServer(ctx, t, n, pod, "40.0")
}

// mpsPod creates the claim and pod of runMPSWorkload.
func mpsPod(ctx context.Context, t *testing.T, ns, name, node string) *v1.Pod {
	t.Helper()
	if err := cluster.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	params, err := json.Marshal(map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{
			"defaultActiveThreadPercentage":  40,
			"defaultPinnedDeviceMemoryLimit": "2Gi",
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	pod, err := createClaimPod(ctx, ns, name, node, params)
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// daemonPod is the one MPS control daemon pod on the node, Running, as an
// admin finds it with kubectl.
func daemonPod(ctx context.Context, t *testing.T, node string) *v1.Pod {
	t.Helper()
	var found []v1.Pod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.CoreV1().Pods(harness.DriverNamespace).List(ctx, metav1.ListOptions{
			LabelSelector: daemonSelector, FieldSelector: "spec.nodeName=" + node,
		})
		if err != nil {
			return false, nil
		}
		found = list.Items
		return len(found) == 1 && found[0].Status.Phase == v1.PodRunning, nil
	})
	if err != nil {
		t.Fatalf("want one Running MPS control daemon pod on %s (%s), found %d: %v", node, daemonSelector, len(found), err)
	}
	return &found[0]
}

// sameDaemon asserts the daemon pod is still the one found first, running.
func sameDaemon(ctx context.Context, t *testing.T, n *harness.Node, want *v1.Pod) {
	t.Helper()
	got := daemonPod(ctx, t, n.Name)
	if got.UID != want.UID {
		t.Errorf("the MPS control daemon pod was replaced (%s, was %s)", got.UID, want.UID)
	}
}

// mpsServer runs the CUDA program stand-in in the workload and returns the
// MPS server it joined, checking the server's active thread percentage.
func mpsServer(ctx context.Context, t *testing.T, n *harness.Node, pod *v1.Pod, pct string) string {
	t.Helper()
	res, err := n.Exec(ctx, pod, "ctr", "cuda-app")
	if err != nil {
		t.Fatal(err)
	}
	server := ""
	for _, line := range strings.Split(res.Stdout, "\n") {
		if s, ok := strings.CutPrefix(line, "MPS server "); ok {
			server = s
		}
	}
	if res.ExitCode != 0 || server == "" {
		t.Fatalf("the workload's CUDA program joined no MPS server (exit %d): %s%s", res.ExitCode, res.Stdout, res.Stderr)
	}
	if !strings.Contains(res.Stdout, "active thread percentage "+pct+"\n") || !strings.Contains(res.Stdout, "pinned memory limit 2G\n") {
		t.Errorf("the workload's MPS server does not run with the claim's limits (%s%%, 2G): %s", pct, res.Stdout)
	}
	return server
}

// waitLog waits until the plugin pod's log satisfies ok.
func waitLog(ctx context.Context, t *testing.T, d *harness.DaemonPod, ok func(string) bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		return ok(d.Log()), nil
	})
	if err != nil {
		t.Fatalf("plugin log never showed what was waited for: %v; log:\n%s", err, d.Log())
	}
}

// TestMPSDaemonPodBound: with kubeletPlugin.nodeRestriction.maxPodsPerNode
// set, the chart registers its pods-per-node webhook entry (failurePolicy
// Fail) for the pods the plugin's credentials create, and its webhook
// Deployment counts the release namespace's pods per node. One 4-GPU node
// holds the plugin's pod and the webhook's (one replica); with the bound at
// 3, the first MPS claim's control daemon pod is admitted (2 pods there) and
// its workload runs; the second claim's daemon pod, on another GPU, is
// refused through the API server: its pod stays Pending, the kubelet's
// prepare error names the node, the count and the value to raise, and no
// second daemon pod exists.
func TestMPSDaemonPodBound(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutContainerDriver
	n := addNode(t, "node-mps-bound", layout, "a100-pcie-x4-nvlink")
	const bound = 3
	install(t, append(layout.HelmValues(), "webhook.replicas=1",
		fmt.Sprintf("kubeletPlugin.nodeRestriction.maxPodsPerNode=%d", bound))...)
	plugin := waitPlugin(ctx, t, n, "")
	// Until a replica serves, the Fail entry refuses every daemon pod (the
	// kubelet retries the prepare): wait for it, so the refusal below is the
	// count's.
	webhook := harness.HelmRelease + "-gpu-dra-driver-webhook"
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 120*time.Second, true, func(ctx context.Context) (bool, error) {
		d, err := cluster.Client.AppsV1().Deployments(harness.DriverNamespace).Get(ctx, webhook, metav1.GetOptions{})
		return err == nil && d.Status.AvailableReplicas == 1, nil
	})
	if err != nil {
		t.Fatalf("the webhook's Deployment %s has no available replica: %v", webhook, err)
	}

	first := mpsPod(ctx, t, "mps-bound-1", "mps", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, first.Namespace, first.Name, 90*time.Second); err != nil {
		t.Fatalf("%v; prepare errors: %v; plugin log:\n%s", err, n.DRAErrors(), plugin.Log())
	}
	daemon := daemonPod(ctx, t, n.Name)

	second := mpsPod(ctx, t, "mps-bound-2", "mps", n.Name)
	want := fmt.Sprintf("node %s has %d pods of this namespace already", n.Name, bound)
	var refused string
	err = wait.PollUntilContextTimeout(ctx, time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		for _, e := range n.DRAErrors() {
			if strings.Contains(e, second.Namespace+"/"+second.Name) && strings.Contains(e, want) {
				refused = e
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("no prepare error of %s/%s saying %q: %v; errors: %v; plugin log:\n%s", second.Namespace, second.Name, want, err, n.DRAErrors(), plugin.Log())
	}
	t.Logf("refused: %s", refused)
	for _, w := range []string{`admission webhook "pods-per-node.` + harness.DefaultDriver + `"`, fmt.Sprintf("kubeletPlugin.nodeRestriction.maxPodsPerNode=%d", bound)} {
		if !strings.Contains(refused, w) {
			t.Errorf("the prepare error does not say %q: %s", w, refused)
		}
	}
	if p, err := cluster.Client.CoreV1().Pods(second.Namespace).Get(ctx, second.Name, metav1.GetOptions{}); err != nil || p.Status.Phase != v1.PodPending {
		t.Errorf("the workload over the bound: %v, want Pending", err)
	}
	sameDaemon(ctx, t, n, daemon)
}
