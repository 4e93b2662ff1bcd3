package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// nodeSlices lists our driver's ResourceSlices of one node.
func nodeSlices(ctx context.Context, node string) ([]resourceapi.ResourceSlice, error) {
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + harness.DefaultDriver,
	})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// sliceDevice finds a published device by pool and name.
func sliceDevice(ctx context.Context, t *testing.T, pool, name string) resourceapi.Device {
	t.Helper()
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + harness.DefaultDriver})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list.Items {
		if s.Spec.Pool.Name != pool {
			continue
		}
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				return d
			}
		}
	}
	t.Fatalf("device %s/%s not in any slice", pool, name)
	return resourceapi.Device{}
}

func attrString(d resourceapi.Device, name string) string {
	if a, ok := d.Attributes[resourceapi.QualifiedName(name)]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	if a, ok := d.Attributes[resourceapi.QualifiedName(harness.DefaultDriver+"/"+name)]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return ""
}

var nsCleaner = regexp.MustCompile(`[^a-z0-9-]+`)

// newNamespace creates a fresh namespace for a test.
func newNamespace(ctx context.Context, t *testing.T, prefix string) string {
	t.Helper()
	name := nsCleaner.ReplaceAllString(strings.ToLower(prefix), "-")
	if len(name) > 40 {
		name = name[:40]
	}
	name = fmt.Sprintf("%s-%d", strings.Trim(name, "-"), time.Now().UnixNano()%100000)
	if err := cluster.CreateNamespace(ctx, name); err != nil {
		t.Fatal(err)
	}
	return name
}

// opaque builds an opaque driver config for a claim.
func opaque(t *testing.T, params map[string]any) *resourceapi.OpaqueDeviceConfiguration {
	t.Helper()
	raw, err := json.Marshal(params)
	if err != nil {
		t.Fatal(err)
	}
	return &resourceapi.OpaqueDeviceConfiguration{Driver: harness.DefaultDriver, Parameters: runtime.RawExtension{Raw: raw}}
}

// gpuClaim is a claim for count whole GPUs with an optional GpuConfig.
func gpuClaim(t *testing.T, ns, name string, count int64, config map[string]any) *resourceapi.ResourceClaim {
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
			}}},
		}},
	}
	if config != nil {
		claim.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{
			Requests:            []string{"gpu"},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: opaque(t, config)},
		}}
	}
	return claim
}

// testGracePeriod is the test pods' termination grace period. Their
// containers (sleep as PID 1) ignore SIGTERM, so the real kubelet waits the
// whole period before SIGKILL: the default 30 s added half a minute to every
// deletion, which no test is about.
var testGracePeriod = int64(1)

// claimPod is a pod on a node using one claim in its one container.
func claimPod(ns, name, node, claim string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			TerminationGracePeriodSeconds: &testGracePeriod,
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": node},
			Containers: []v1.Container{{
				// The test image sleeps by default: the container runs
				// until the pod is deleted.
				Name: "ctr", Image: harness.TestImageName,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}},
		},
	}
}

// runClaimPod creates the claim and the pod and waits until it runs.
func runClaimPod(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, pod *v1.Pod) (*v1.Pod, *resourceapi.ResourceClaim) {
	t.Helper()
	if _, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create claim: %v", err)
	}
	if _, err := cluster.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod: %v", err)
	}
	running, err := cluster.WaitPodRunning(ctx, pod.Namespace, pod.Name, 100*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return running, got
}

// deletePod deletes a pod and waits until the node finished it.
func deletePod(ctx context.Context, t *testing.T, pod *v1.Pod) {
	t.Helper()
	if err := cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitPodGone(ctx, pod.Namespace, pod.Name, 60*time.Second); err != nil {
		t.Fatalf("pod %s/%s not gone: %v", pod.Namespace, pod.Name, err)
	}
}

// podDevices resolves every CDI ID a running pod's containers got (on a
// real node, those containerd applied) against its node's CDI root, per
// container.
func podDevices(t *testing.T, pod *v1.Pod) map[string][]harness.ResolvedDevice {
	t.Helper()
	node := cluster.Node(pod.Spec.NodeName)
	if node == nil {
		t.Fatalf("pod %s on unknown node %q", pod.Name, pod.Spec.NodeName)
	}
	ids, err := node.CDIDevices(context.Background(), pod)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]harness.ResolvedDevice{}
	for ctr, list := range ids {
		for _, id := range list {
			r, err := harness.ResolveCDI(node.CDIRoot, id)
			if err != nil {
				t.Fatalf("pod %s container %s: %v", pod.Name, ctr, err)
			}
			out[ctr] = append(out[ctr], r)
		}
	}
	return out
}

// checkGPUEdits asserts a resolved device gives a container what a CUDA
// program needs: the control and UVM nodes, and at least one GPU node.
func checkGPUEdits(t *testing.T, r harness.ResolvedDevice) {
	t.Helper()
	paths := map[string]bool{}
	gpuNode := false
	for _, n := range r.DeviceNodes() {
		paths[n.Path] = true
		if regexp.MustCompile(`^/dev/nvidia[0-9]+$`).MatchString(n.Path) {
			gpuNode = true
		}
	}
	for _, want := range []string{"/dev/nvidiactl", "/dev/nvidia-uvm"} {
		if !paths[want] {
			t.Errorf("CDI device %s: no device node %s (has %v)", r.ID, want, keys(paths))
		}
	}
	if !gpuNode {
		t.Errorf("CDI device %s: no /dev/nvidiaN device node (has %v)", r.ID, keys(paths))
	}
}

// claimSpecFiles lists the CDI spec files of a node that mention a claim UID.
func claimSpecFiles(t *testing.T, node string, claimUID string) []string {
	t.Helper()
	files, err := harness.ClaimSpecFiles(cluster.Node(node).CDIRoot, claimUID)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// registerTimeout bounds the wait for a started or restarted plugin to
// register with the kubelet: the plugin must finish its start (inventory,
// recovery) and the real kubelet's plugin watcher see its socket; the start
// alone took over 80 s at a load of 100-200 on this 2-core machine.
const registerTimeout = 3 * time.Minute

// eventually polls cond for up to timeout.
func eventually(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		return cond(), nil
	}) == nil
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func envValue(env []string, key string) (string, bool) {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v, true
		}
	}
	return "", false
}

// gpuSim runs `gpu-sim <command> --root <the node's simulated host> <args...>`
// (args[0] is the command: xid, ecc, reset, ...); the test fails if it fails.
func gpuSim(t *testing.T, n *harness.Node, args ...string) {
	t.Helper()
	bin, err := harness.Binary("gpu-sim")
	if err != nil {
		t.Fatal(err)
	}
	full := append([]string{args[0], "--root", n.SimRoot()}, args[1:]...)
	if out, err := exec.Command(bin, full...).CombinedOutput(); err != nil {
		t.Fatalf("gpu-sim %v: %v: %s", full, err, out)
	}
}
