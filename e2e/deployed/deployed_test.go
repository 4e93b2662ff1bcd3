package deployed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// addNode adds a node with the given layout and simulated GPUs; the test's
// end removes it.
func addNode(t *testing.T, name string, layout harness.Layout, profile string) *harness.Node {
	t.Helper()
	ctx := context.Background()
	n, err := cluster.AddNode(ctx, harness.NodeOptions{Name: name, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cluster.RemoveNode(context.Background(), name); err != nil {
			t.Errorf("remove node %s: %v", name, err)
		}
	})
	if err := n.SetupSim(profile); err != nil {
		t.Fatal(err)
	}
	return n
}

// install runs `helm install`; the test's end uninstalls whatever is left.
func install(t *testing.T, set ...string) {
	t.Helper()
	t.Cleanup(func() {
		if _, err := cluster.Helm(context.Background(), "status", harness.HelmRelease, "--namespace", harness.DriverNamespace); err == nil {
			_ = cluster.HelmUninstall(context.Background())
		}
	})
	// The plugin's pods run the image `make image` built (pushed to the
	// cluster's registry); without it they could not start.
	if _, err := cluster.DriverImage(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := cluster.HelmInstall(context.Background(), set...); err != nil {
		t.Fatal(err)
	}
}

// waitPlugin waits until the node runs a plugin pod other than `not` and the
// plugin registered with the node's kubelet.
func waitPlugin(ctx context.Context, t *testing.T, n *harness.Node, not types.UID) *harness.DaemonPod {
	t.Helper()
	var got *harness.DaemonPod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 120*time.Second, true, func(context.Context) (bool, error) {
		got = nil
		for _, d := range n.DaemonPods() {
			if d.Pod.UID != not && d.Pod.DeletionTimestamp == nil && d.Running() {
				got = d
			}
		}
		return got != nil && strings.Contains(got.Log(), "registered with the kubelet"), nil
	})
	if err != nil {
		var log string
		if got != nil {
			log = got.Log()
		}
		t.Fatalf("no plugin pod registered on %s: %v; last error: %v; log:\n%s", n.Name, err, n.DaemonPodError(harness.DriverNamespace+"/"+harness.HelmRelease+"-gpu-dra-driver-kubelet-plugin"), log)
	}
	return got
}

// gpuPod creates a claim for one whole GPU and a pod on the node using it.
func gpuPod(ctx context.Context, t *testing.T, ns, name, node string) *v1.Pod {
	t.Helper()
	if err := cluster.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	pod, err := createClaimPod(ctx, ns, name, node, nil)
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// createClaimPod creates a claim for one GPU (with an opaque config of our
// driver when params is not nil) and a pod on the node whose one container
// uses it.
func createClaimPod(ctx context.Context, ns, name, node string, params []byte) (*v1.Pod, error) {
	claim := gpuClaim(ns, name, params)
	if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			// The test image's sleep, as PID 1, ignores SIGTERM: without a
			// short grace period every deletion waits the default 30 s.
			TerminationGracePeriodSeconds: new(int64(1)),
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": node},
			Containers: []v1.Container{{
				Name: "ctr", Image: harness.TestImageName,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim.Name}},
		},
	}
	return cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
}

// gpuClaim is a claim for one GPU, with an opaque config of our driver when
// params is not nil.
func gpuClaim(ns, name string, params []byte) *resourceapi.ResourceClaim {
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			}}},
		}},
	}
	if params != nil {
		claim.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{
			Requests: []string{"gpu"},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: harness.DefaultDriver, Parameters: runtime.RawExtension{Raw: params},
			}},
		}}
	}
	return claim
}

func envOf(d *harness.DaemonPod, key string) string {
	spec := d.Spec()
	if spec == nil {
		return ""
	}
	for _, e := range spec.Process.Env {
		if k, v, _ := strings.Cut(e, "="); k == key {
			return v
		}
	}
	return ""
}

// TestHelmLifecycle: install on two nodes, a whole-GPU pod, `helm upgrade`
// with another log level rolls the plugin on each node while the pod keeps
// running, the new plugin unprepares the pod's claim, `helm uninstall`
// removes what the chart installed. The driver is containerized (GPU
// Operator layout), where our CDI specs' paths are host paths.
func TestHelmLifecycle(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutContainerDriver
	n := addNode(t, "node-operator", layout, "t4")
	other := addNode(t, "node-operator-2", layout, "t4")
	install(t, layout.HelmValues()...)
	first := waitPlugin(ctx, t, n, "")
	otherFirst := waitPlugin(ctx, t, other, "")

	// The container is the chart's DaemonSet pod, as containerd ran it:
	// root, privileged, the kubelet's folders bind-mounted from their host
	// paths, which in the node's mount namespace are the node's own tree
	// (the plugin's registration socket is there, not on the other node).
	// It runs the image `make image` built, pulled by digest from the
	// cluster's registry (the harness pushed it and pinned image.digest).
	ref, err := cluster.DriverImage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, digest, _ := strings.Cut(ref, "@")
	if st := first.Pod.Status.ContainerStatuses; first.Pod.Spec.Containers[0].Image != ref || len(st) == 0 || !strings.HasSuffix(st[0].ImageID, "@"+digest) {
		t.Errorf("plugin pod runs %s (status %v), want %s pulled by its digest", first.Pod.Spec.Containers[0].Image, st, ref)
	}
	spec := first.Spec()
	if spec == nil {
		t.Fatalf("no OCI spec of the plugin container %s", first.Pod.Name)
	}
	if spec.Process.User.UID != 0 || !slices.Contains(spec.Process.Capabilities.Effective, "CAP_SYS_ADMIN") {
		t.Errorf("plugin container runs as uid %d with %v; the chart asks for root, privileged", spec.Process.User.UID, spec.Process.Capabilities.Effective)
	}
	mounts := map[string]string{}
	for _, m := range spec.Mounts {
		mounts[m.Destination] = m.Source
	}
	for _, p := range []string{"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins/gpu.nvidia.com", "/var/run/cdi", harness.ContainerDriverRoot} {
		if mounts[p] != p {
			t.Errorf("mount %s: source %q, want the host path %q", p, mounts[p], p)
		}
	}
	socket := "gpu.nvidia.com-" + string(first.Pod.UID) + "-reg.sock"
	if _, err := os.Stat(n.HostPath("/var/lib/kubelet/plugins_registry/" + socket)); err != nil {
		t.Errorf("the plugin's registration socket is not in its node's tree: %v", err)
	}
	if _, err := os.Stat(other.HostPath("/var/lib/kubelet/plugins_registry/" + socket)); err == nil {
		t.Errorf("the plugin's registration socket of %s is in the tree of %s", n.Name, other.Name)
	}
	if got := mounts["/var/run/secrets/kubernetes.io/serviceaccount"]; got == "" {
		t.Errorf("no service-account token mounted: %v", mounts)
	}
	// Its own network namespace (no hostNetwork in the chart): both nodes'
	// plugins serve the chart's HTTP port.
	ownNet := false
	for _, ns := range spec.Linux.Namespaces {
		ownNet = ownNet || (ns.Type == "network" && ns.Path != "")
	}
	if !ownNet {
		t.Errorf("plugin container without its pod's network namespace: %v", spec.Linux.Namespaces)
	}

	pod := gpuPod(ctx, t, "lifecycle", "gpu", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 90*time.Second); err != nil {
		t.Fatalf("%v; plugin log:\n%s", err, first.Log())
	}
	res, err := n.Exec(ctx, pod, "ctr", "nvidia-smi", "-L")
	if err != nil || res.ExitCode != 0 || !strings.Contains(res.Stdout, "GPU 0:") {
		t.Fatalf("nvidia-smi -L in the pod: %v %+v", err, res)
	}
	checkHooksRan(ctx, t, n, pod)

	upgraded := append(layout.HelmValues(), "logLevel=debug")
	if err := cluster.HelmUpgrade(ctx, upgraded...); err != nil {
		t.Fatal(err)
	}
	second := waitPlugin(ctx, t, n, first.Pod.UID)
	otherSecond := waitPlugin(ctx, t, other, otherFirst.Pod.UID)
	if got := envOf(otherSecond, "LOG_LEVEL"); got != "debug" {
		t.Errorf("after the upgrade the plugin on %s runs with LOG_LEVEL=%q, want debug", other.Name, got)
	}
	if got := envOf(second, "LOG_LEVEL"); got != "debug" {
		t.Errorf("after the upgrade the plugin runs with LOG_LEVEL=%q, want debug", got)
	}
	// The surge rollout (maxSurge 1, maxUnavailable 0): the DaemonSet
	// controller deletes the old pod once the new one is available.
	if err := cluster.WaitPodGone(ctx, first.Pod.Namespace, first.Pod.Name, 60*time.Second); err != nil {
		t.Errorf("the old plugin pod %s is still there: %v", first.Pod.Name, err)
	}
	if first.Running() {
		t.Errorf("the old plugin container still runs after its pod is gone")
	}
	got, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || got.Status.Phase != v1.PodRunning {
		t.Fatalf("workload pod after the upgrade: %v %v", err, got.Status.Phase)
	}
	for _, c := range got.Status.ContainerStatuses {
		if c.State.Running == nil || c.RestartCount != 0 {
			t.Errorf("workload container %s after the upgrade: %+v, %d restarts", c.Name, c.State, c.RestartCount)
		}
	}
	// The new plugin unprepares the claim the old one prepared.
	if err := cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitPodGone(ctx, pod.Namespace, pod.Name, 60*time.Second); err != nil {
		t.Fatalf("%v; plugin log:\n%s", err, second.Log())
	}

	if err := cluster.HelmUninstall(ctx); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		left, err := installedObjects(ctx)
		return err == nil && len(left) == 0 && len(n.DaemonPods())+len(other.DaemonPods()) == 0, nil
	})
	if err != nil {
		left, _ := installedObjects(ctx)
		t.Errorf("after helm uninstall: %v left, %d plugin pods on the nodes", left, len(n.DaemonPods())+len(other.DaemonPods()))
	}
}

// installedObjects are the chart's DaemonSets, webhook registrations and
// DeviceClasses still in the cluster.
func installedObjects(ctx context.Context) ([]string, error) {
	var left []string
	dss, err := cluster.Client.AppsV1().DaemonSets(harness.DriverNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, d := range dss.Items {
		left = append(left, "DaemonSet/"+d.Name)
	}
	hooks, err := cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, h := range hooks.Items {
		left = append(left, "ValidatingWebhookConfiguration/"+h.Name)
	}
	for _, name := range []string{"gpu.nvidia.com", "mig.nvidia.com"} {
		_, err := cluster.Client.ResourceV1().DeviceClasses().Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			left = append(left, "DeviceClass/"+name)
		} else if !apierrors.IsNotFound(err) {
			return nil, err
		}
	}
	return left, nil
}

// TestHostInstalledDriver: the chart's default layout, a driver installed on
// the host (`nvidiaDriverRoot: /`), which the plugin reads at /driver-root in
// its container. The plugin registers and publishes the node's GPUs; its CDI
// specs name the driver's files by their host paths, so the workload container
// starts, and `nvidia-smi -L` inside lists its GPU. No hook path is set: the
// plugin installs the image's nvidia-cdi-hook under its plugin folder on the
// host, the specs' hooks run from there, and the container gets the
// libnvidia-ml.so.1 link and a loader cache listing it.
func TestHostInstalledDriver(t *testing.T) {
	ctx := context.Background()
	n := addNode(t, "node-host-driver", harness.LayoutHostDriver, "t4")
	install(t, harness.LayoutHostDriver.HelmValues()...)
	plugin := waitPlugin(ctx, t, n, "")
	if got := envOf(plugin, "CONTAINER_DRIVER_ROOT"); got != "/driver-root" {
		t.Fatalf("CONTAINER_DRIVER_ROOT=%q; this test is written for the chart's /driver-root mount", got)
	}
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		slices, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + n.Name})
		return err == nil && len(slices.Items) > 0, nil
	})
	if err != nil {
		t.Fatalf("no ResourceSlices for %s: %v; plugin log:\n%s", n.Name, err, plugin.Log())
	}

	pod := gpuPod(ctx, t, "host-driver", "gpu", n.Name)
	if _, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 90*time.Second); err != nil {
		got, _ := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		msg := ""
		if got != nil && len(got.Status.ContainerStatuses) > 0 {
			msg = describe(got.Status.ContainerStatuses[0])
		}
		t.Fatalf("%v (%s); plugin log:\n%s", err, msg, plugin.Log())
	}
	specs := claimSpecs(t, n)
	for _, s := range specs {
		if strings.Contains(s, "/driver-root") {
			t.Errorf("a CDI spec names the plugin's container path /driver-root:\n%s", s)
		}
	}
	hooks, _ := filepath.Glob(n.HostPath("/var/lib/kubelet/plugins/gpu.nvidia.com/bin/nvidia-cdi-hook-*"))
	if len(hooks) != 1 {
		t.Fatalf("want one nvidia-cdi-hook installed under the plugin folder on the host, found %v", hooks)
	}
	hostHook := strings.TrimPrefix(hooks[0], n.HostRoot)
	if len(specs) == 0 || !strings.Contains(strings.Join(specs, "\n"), `"`+hostHook+`"`) {
		t.Errorf("the specs' hooks do not name the installed hook %s:\n%s", hostHook, strings.Join(specs, "\n"))
	}

	res, err := n.Exec(ctx, pod, "ctr", "nvidia-smi", "-L")
	if err != nil || res.ExitCode != 0 || !strings.Contains(res.Stdout, "GPU 0:") {
		t.Fatalf("nvidia-smi -L in the pod: %v %+v", err, res)
	}
	checkHooksRan(ctx, t, n, pod)
	// The chart mounts the kubelet's pod-resources folder: the cleanup asks
	// the kubelet which claims are in use instead of reading them.
	if log := plugin.Log(); !strings.Contains(log, "PodResources API tells which prepared claims are in use") {
		t.Errorf("the deployed plugin does not ask the kubelet's PodResources API; log:\n%s", log)
	}

	if err := cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitPodGone(ctx, pod.Namespace, pod.Name, 60*time.Second); err != nil {
		t.Fatal(err)
	}
}

// checkHooksRan asserts the specs' hooks ran in the pod's container "ctr":
// the soname link next to the mounted NVML library and the loader cache entry,
// as a CUDA program needs them for libcuda.so.1.
func checkHooksRan(ctx context.Context, t *testing.T, n *harness.Node, pod *v1.Pod) {
	t.Helper()
	res, err := n.Exec(ctx, pod, "ctr", "sh", "-c", "test -e /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 && ldconfig -p")
	if err != nil || res.ExitCode != 0 || !strings.Contains(res.Stdout, "libnvidia-ml.so.1") {
		t.Errorf("no libnvidia-ml.so.1 link or loader cache entry in the container (hooks did not run): %v %+v", err, res)
	}
}

// claimSpecs are the JSON CDI specs our plugin wrote on the node.
func claimSpecs(t *testing.T, n *harness.Node) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(n.CDIRoot, "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, string(b))
	}
	return out
}

func describe(s v1.ContainerStatus) string {
	switch {
	case s.State.Running != nil:
		return "running (the fix has landed: turn this test around)"
	case s.State.Terminated != nil:
		return fmt.Sprintf("terminated %s (%d): %s", s.State.Terminated.Reason, s.State.Terminated.ExitCode, s.State.Terminated.Message)
	default:
		return fmt.Sprintf("%+v", s.State)
	}
}
