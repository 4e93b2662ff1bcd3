package tests

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// migClaim asks for one MIG device of a profile on the GPU parentUUID.
func migClaim(ns, name, profile, parentUUID string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "mig.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: fmt.Sprintf(`device.attributes["gpu.nvidia.com"].profile == %q && device.attributes["gpu.nvidia.com"].parentUUID == %q`, profile, parentUUID),
				}}},
			}}},
		}},
	}
}

var lgiRow = regexp.MustCompile(`(?m)^\|\s+([0-9]+)\s+MIG (\S+)\s+([0-9]+)\s+([0-9]+)\s+([0-9]+):([0-9]+)\s+\|$`)

// gpuInstances lists the GPU instances of one GPU of a node as the
// simulator's nvidia-smi (the node's driver) reports them: "<profile>@<start>",
// sorted.
func gpuInstances(t *testing.T, n *harness.Node, gpu int) []string {
	t.Helper()
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	out, err := exec.Command(smi, "mig", "-lgi", "-i", fmt.Sprint(gpu)).CombinedOutput()
	if err != nil && !strings.Contains(string(out), "No GPU instances found") {
		t.Fatalf("nvidia-smi mig -lgi -i %d: %v: %s", gpu, err, out)
	}
	var got []string
	for _, m := range lgiRow.FindAllStringSubmatch(string(out), -1) {
		got = append(got, m[2]+"@"+m[5])
	}
	sort.Strings(got)
	return got
}

// dynamicMIGUUID is the UUID of the MIG device of a profile on the GPU
// parentUUID of a node, as the node's nvidia-smi -L lists it: dynamic MIG
// devices are published without one (it exists only once prepare created
// the instance). Fails when the profile is on that GPU more than once.
func dynamicMIGUUID(t *testing.T, node, parentUUID, profile string) string {
	t.Helper()
	n := cluster.Node(node)
	if n == nil {
		t.Fatalf("no node %s", node)
	}
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	out, err := exec.Command(smi, "-L").CombinedOutput()
	if err != nil {
		t.Fatalf("nvidia-smi -L on %s: %v: %s", node, err, out)
	}
	var found []string
	inGPU := false
	for _, line := range strings.Split(string(out), "\n") {
		if m := smiGPU.FindStringSubmatch(line); m != nil {
			inGPU = m[1] == parentUUID
			continue
		}
		fields := strings.Fields(line)
		if inGPU && len(fields) > 1 && fields[0] == "MIG" && fields[1] == profile {
			if m := smiMIG.FindStringSubmatch(line); m != nil {
				found = append(found, m[1])
			}
		}
	}
	if len(found) != 1 {
		t.Fatalf("node %s GPU %s: %d MIG devices of profile %s, want 1:\n%s", node, parentUUID, len(found), profile, out)
	}
	return found[0]
}

// schedulerMessage is the PodScheduled=False message of a pod ("" while it
// has none).
func schedulerMessage(ctx context.Context, t *testing.T, pod *v1.Pod) string {
	t.Helper()
	got, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range got.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse {
			return c.Reason + ": " + c.Message
		}
	}
	return ""
}

// TestDynamicMIG: GPU 0 of an A100 node is offered as dynamic MIG. The
// plugin destroys at start the profile's instances on it (no claim owns
// them); the scheduler places 3g.20gb, 2g.10gb and 1g.5gb claims on
// placements that fit together, prepare creates exactly those instances and
// each container sees exactly its MIG device; a 4g.20gb claim that cannot
// fit stays pending with the scheduler's reason; deleting everything leaves
// no instance. Then a kill -9 right after an instance's creation (before its
// IDs reach the checkpoint): the restarted plugin destroys it, and the
// kubelet's retry prepares the claim with a new one.
func TestDynamicMIG(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-dynmig"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--dynamic-mig-gpus=0"}, nil)
	if got := gpuInstances(t, n, 0); len(got) != 0 {
		t.Fatalf("GPU 0 still has instances no claim owns: %v; plugin log:\n%s", got, n.Plugin.Log())
	}
	if got := gpuInstances(t, n, 1); len(got) != 4 {
		t.Errorf("GPU 1 (static) lost its instances: %v", got)
	}
	devices := poolDevices(ctx, t, name)
	const d3g = "gpu-0-mig-3g20gb-9-4"
	for _, d := range []string{d3g, "gpu-0-mig-2g10gb-14-0", "gpu-0-mig-1g5gb-19-6", "gpu-0-mig-4g20gb-5-0", "gpu-0"} {
		if _, ok := devices[d]; !ok {
			t.Fatalf("dynamic device %s not published: %v", d, keys(devices))
		}
	}
	if attrString(devices[d3g], "uuid") != "" {
		t.Errorf("dynamic device %s published with a uuid", d3g)
	}
	gpu0 := attrString(devices[d3g], "parentUUID")
	ns := newNamespace(ctx, t, "dynmig")

	var pods []*v1.Pod
	for _, c := range []struct{ name, profile string }{{"big", "3g.20gb"}, {"mid", "2g.10gb"}, {"small", "1g.5gb"}} {
		pod, claim := runClaimPod(ctx, t, migClaim(ns, c.name, c.profile, gpu0), claimPod(ns, c.name, name, c.name))
		t.Logf("claim %s (%s) allocated %s", c.name, c.profile, claim.Status.Allocation.Devices.Results[0].Device)
		pods = append(pods, pod)
	}
	got := gpuInstances(t, n, 0)
	t.Logf("GPU 0 instances: %v", got)
	var profiles []string
	for _, g := range got {
		p, _, _ := strings.Cut(g, "@")
		profiles = append(profiles, p)
	}
	if strings.Join(profiles, " ") != "1g.5gb 2g.10gb 3g.20gb" {
		t.Fatalf("GPU 0 instances %v, want one 1g.5gb, one 2g.10gb, one 3g.20gb", got)
	}
	for _, pod := range pods {
		for _, ctr := range pod.Spec.Containers {
			checkContainerSees(ctx, t, pod, ctr)
		}
	}

	// No placement of 4g.20gb is free: the scheduler keeps the pod pending.
	pending := createClaimAndPod(ctx, t, migClaim(ns, "huge", "4g.20gb", gpu0), name)
	var reason string
	if !eventually(ctx, 30*time.Second, func() bool {
		reason = schedulerMessage(ctx, t, pending)
		return reason != ""
	}) {
		t.Fatalf("pod %s has no PodScheduled=False condition", pending.Name)
	}
	t.Logf("4g.20gb pod pending: %s", reason)
	time.Sleep(2 * time.Second)
	if p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pending.Name, metav1.GetOptions{}); err != nil || p.Spec.NodeName != "" {
		t.Errorf("4g.20gb pod bound to %q (%v), want pending", p.Spec.NodeName, err)
	}
	if got := gpuInstances(t, n, 0); len(got) != 3 {
		t.Errorf("GPU 0 instances %v after the pending claim, want the 3 of before", got)
	}
	deleteClaimAndPod(ctx, t, pending)
	for _, pod := range pods {
		deleteClaimAndPod(ctx, t, pod)
	}
	if !eventually(ctx, 30*time.Second, func() bool { return len(gpuInstances(t, n, 0)) == 0 }) {
		t.Fatalf("GPU 0 instances left after the claims are gone: %v", gpuInstances(t, n, 0))
	}

	// Crash between creation and checkpoint.
	n.Plugin.Stop()
	n.Plugin.Env = append(n.Plugin.Env, "GPU_DRA_FAILPOINTS=prepare.after_mig_create=kill")
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	crash := createClaimAndPod(ctx, t, migClaim(ns, "crash", "3g.20gb", gpu0), name)
	if !eventually(ctx, 60*time.Second, func() bool { return !n.Plugin.Running() }) {
		t.Fatalf("plugin not killed at prepare.after_mig_create; log:\n%s", n.Plugin.Log())
	}
	orphan := gpuInstances(t, n, 0)
	if len(orphan) != 1 {
		t.Fatalf("GPU 0 instances after the kill: %v, want the one created", orphan)
	}
	t.Logf("killed after creating %v", orphan)
	n.Plugin.Env = nil
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	pod, err := cluster.WaitPodRunning(ctx, ns, crash.Name, 90*time.Second)
	if err != nil {
		t.Fatalf("claim not prepared after the restart: %v; kubelet errors: %v; plugin log:\n%s", err, n.DRAErrors(), n.Plugin.Log())
	}
	if got := gpuInstances(t, n, 0); len(got) != 1 {
		t.Errorf("GPU 0 instances after the restart: %v, want only the claim's", got)
	}
	log := n.Plugin.Log()
	for _, want := range []string{"rolling back half-prepared claim", "destroyed MIG instance"} {
		if !strings.Contains(log, want) {
			t.Errorf("plugin log lacks %q", want)
		}
	}
	for _, ctr := range pod.Spec.Containers {
		checkContainerSees(ctx, t, pod, ctr)
	}
	deleteClaimAndPod(ctx, t, pod)
	if !eventually(ctx, 30*time.Second, func() bool { return len(gpuInstances(t, n, 0)) == 0 }) {
		t.Fatalf("GPU 0 instances left: %v", gpuInstances(t, n, 0))
	}
}
