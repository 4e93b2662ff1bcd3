package tests

import (
	"context"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// NVIDIA's runtime on the node: on GPU Operator nodes containerd runs every
// container through nvidia-container-runtime, which adds the GPUs that
// NVIDIA_VISIBLE_DEVICES in the container's environment names, and every
// CUDA image sets it to `all`. A claim's container must still see its
// claim's devices only.

// cudaClaimPod is a pod on node whose one container runs NVIDIA's CUDA image
// (the harness's stand-in) with the pod's env, using claim ("" for none).
// It sleeps until the pod is deleted: the image's own command is bash, as
// the real image's, which ends at once without a terminal, so a container
// left to it exits and the kubelet restarts it over and over.
func cudaClaimPod(ns, name, node, claim string, env ...v1.EnvVar) *v1.Pod {
	pod := claimPod(ns, name, node, claim)
	pod.Spec.Containers[0].Image = harness.CUDAImage
	pod.Spec.Containers[0].Command = []string{"sleep", "2147483647"}
	pod.Spec.Containers[0].Env = env
	if claim == "" {
		pod.Spec.ResourceClaims = nil
		pod.Spec.Containers[0].Resources = v1.ResourceRequirements{}
	}
	return pod
}

// oneDeviceClaim asks for one device of a device class.
func oneDeviceClaim(ns, name, class string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			}}},
		}},
	}
}

// containerEnv is a variable of the container's environment, as its
// processes see it ("" when unset).
func containerEnv(ctx context.Context, t *testing.T, pod *v1.Pod, name string) string {
	t.Helper()
	res, err := cluster.Node(pod.Spec.NodeName).Exec(ctx, pod, "ctr", "env")
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("pod %s: env: %v %+v", pod.Name, err, res)
	}
	v, _ := envValue(strings.Split(res.Stdout, "\n"), name)
	return v
}

var gpuOrCapNode = regexp.MustCompile(`^/dev/(nvidia[0-9]+|nvidia-caps/nvidia-cap[0-9]+)$`)

// containerGPUNodes are the GPU and MIG capability device nodes in the
// container's /dev.
func containerGPUNodes(ctx context.Context, t *testing.T, pod *v1.Pod) []string {
	t.Helper()
	res, err := cluster.Node(pod.Spec.NodeName).Exec(ctx, pod, "ctr", "sh", "-c", "ls -1d /dev/nvidia* /dev/nvidia-caps/* 2>/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range strings.Fields(res.Stdout) {
		if gpuOrCapNode.MatchString(p) {
			out = append(out, p)
		}
	}
	return sorted(out)
}

// claimGPUNodes are the GPU and MIG capability device nodes the container's
// CDI devices (its claim's spec) give it.
func claimGPUNodes(t *testing.T, pod *v1.Pod) []string {
	t.Helper()
	seen := map[string]bool{}
	for _, r := range podDevices(t, pod)["ctr"] {
		for _, n := range r.DeviceNodes() {
			if gpuOrCapNode.MatchString(n.Path) {
				seen[n.Path] = true
			}
		}
	}
	return sorted(keys(seen))
}

// TestNvidiaRuntimeSeesOnlyTheClaim: on a node whose runtime is NVIDIA's (mode
// cdi, the node's nvidia.com/gpu spec, as the GPU Operator sets it up), pods
// on the CUDA image with one-device claims (a whole GPU, a MIG device, and a
// whole GPU whose pod sets NVIDIA_VISIBLE_DEVICES=all itself), running side by
// side, each see exactly their claim's devices: nvidia-smi -L and the device
// nodes in /dev. Their claims' CDI specs set NVIDIA_VISIBLE_DEVICES=void, so
// the runtime adds nothing. A CUDA pod without a claim gets every GPU from the
// runtime: that shows the runtime is at work here (and is the node's setting
// `accept-nvidia-visible-devices-envvar-when-unprivileged`, beyond a DRA
// driver's reach).
func TestNvidiaRuntimeSeesOnlyTheClaim(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-nvidia-runtime"
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, NvidiaRuntime: true, RealKubelet: true}, "dgx-a100-40gb", nil, nil)
	ns := newNamespace(ctx, t, "nvidia-runtime")

	nodeGPUs, err := filepath.Glob(filepath.Join(n.SimRoot(), "dev", "nvidia[0-9]*"))
	if err != nil || len(nodeGPUs) < 2 {
		t.Fatalf("node %s: want several GPUs, has %v (%v)", name, nodeGPUs, err)
	}

	unclaimed := cudaClaimPod(ns, "no-claim", name, "")
	createPod(ctx, t, unclaimed)
	running, err := cluster.WaitPodRunning(ctx, ns, unclaimed.Name, 90*time.Second)
	if err != nil {
		t.Fatalf("%v; kubelet errors: %v", err, n.DRAErrors())
	}
	if gpus, _ := visibleDevices(ctx, t, running, "ctr"); len(gpus) != len(nodeGPUs) {
		t.Fatalf("a CUDA container without claims sees %d GPUs, not the node's %d: NVIDIA's runtime did not act on NVIDIA_VISIBLE_DEVICES=all", len(gpus), len(nodeGPUs))
	}
	deletePod(ctx, t, running)

	cases := []struct {
		name, class string
		env         []v1.EnvVar
	}{
		{"whole-gpu", "gpu.nvidia.com", nil},
		{"mig-device", "mig.nvidia.com", nil},
		{"pod-env-all", "gpu.nvidia.com", []v1.EnvVar{{Name: "NVIDIA_VISIBLE_DEVICES", Value: "all"}}},
	}
	var pods []*v1.Pod
	for _, c := range cases {
		pod, _ := runClaimPod(ctx, t, oneDeviceClaim(ns, c.name, c.class), cudaClaimPod(ns, c.name, name, c.name, c.env...))
		t.Cleanup(func() { deleteClaimAndPod(context.Background(), t, pod) })
		pods = append(pods, pod)
	}
	for _, pod := range pods {
		t.Run(pod.Name, func(t *testing.T) {
			if got := containerEnv(ctx, t, pod, "NVIDIA_DRIVER_CAPABILITIES"); got != "compute,utility" {
				t.Errorf("NVIDIA_DRIVER_CAPABILITIES=%q: the CUDA image's environment is not applied", got)
			}
			checkContainerSees(ctx, t, pod, pod.Spec.Containers[0])
			want, got := claimGPUNodes(t, pod), containerGPUNodes(ctx, t, pod)
			if len(want) == 0 || strings.Join(got, " ") != strings.Join(want, " ") {
				t.Errorf("device nodes in /dev: %v; the claim's: %v", got, want)
			}
		})
	}

}
