package tests

import (
	"context"
	"os"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-dra/e2e/harness"
)

// A real node (the kubelet and containerd, harness/realnode.go) loses power
// with a time-sliced and an MPS claim prepared and their pods running, and
// boots again (harness/realnode_reboot.go). Afterwards the kubelet prepares
// both claims again (its DRA checkpoint holds them, none prepared), our
// plugin sees the new boot ID and prepares them from scratch: the CDI specs
// come back under the same device IDs, the kubelet's new containers start
// from them and see exactly their GPU, the MPS container reaches a new
// control daemon with the claim's limits, and the GPUs get their sharing
// settings again (a boot resets them).
func TestNodeReboot(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-reboot"
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, RealKubelet: true, Taints: []v1.Taint{realNodeTaint}},
		"dgx-h100", nil, nil)
	ns := newNamespace(ctx, t, "reboot")

	tsConfig := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "TimeSlicing", "timeSlicingConfig": map[string]any{"interval": "Long"}},
	}
	mpsConfig := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{
			"defaultActiveThreadPercentage": 40, "defaultPinnedDeviceMemoryLimit": "6Gi",
		}},
	}
	sleep := []string{"sleep", "2147483647"}
	ts, tsClaim := runClaimPod(ctx, t, gpuClaim(t, ns, "ts", 1, tsConfig), realNodePod(ns, "ts", name, sleep, map[string]string{"gpu": "ts"}))
	mps, mpsClaim := runClaimPod(ctx, t, gpuClaim(t, ns, "mps", 1, mpsConfig), realNodePod(ns, "mps", name, sleep, map[string]string{"gpu": "mps"}))
	tsGPU, mpsGPU := claimGPU(ctx, t, tsClaim), claimGPU(ctx, t, mpsClaim)
	if tsGPU == mpsGPU {
		t.Fatalf("both claims got GPU %s", tsGPU)
	}
	idsBefore := map[string]map[string][]string{ts.Name: kubeletCDIIDs(ctx, t, n, ts), mps.Name: kubeletCDIIDs(ctx, t, n, mps)}
	containersBefore := map[string]string{ts.Name: ts.Status.ContainerStatuses[0].ContainerID, mps.Name: mps.Status.ContainerStatuses[0].ContainerID}

	checkShared := func(when string) {
		t.Helper()
		for _, pod := range []*v1.Pod{ts, mps} {
			for ctr, ids := range kubeletCDIIDs(ctx, t, n, pod) {
				for _, id := range ids {
					r, err := harness.ResolveCDI(n.CDIRoot, id)
					if err != nil {
						t.Fatalf("%s: pod %s container %s: %v", when, pod.Name, ctr, err)
					}
					checkGPUEdits(t, r)
				}
			}
			for _, ctr := range pod.Spec.Containers {
				checkContainerSees(ctx, t, pod, ctr)
			}
		}
		checkMPSControl(ctx, t, mps, mps.Spec.Containers[0])
		if got := timeSlice(t, n, tsGPU); got != "3" {
			t.Errorf("%s: time slice of %s is %s, want 3 (Long)", when, tsGPU, got)
		}
		if got := computeMode(t, n, mpsGPU); got != "EXCLUSIVE_PROCESS" {
			t.Errorf("%s: compute mode of the MPS GPU %s is %s, want EXCLUSIVE_PROCESS", when, mpsGPU, got)
		}
		if d := n.MPSDaemons(); len(d) != 1 {
			t.Errorf("%s: want one MPS control daemon, got %v", when, d)
		}
	}
	checkShared("before the reboot")
	daemonBefore := n.MPSDaemons()
	bootBefore := n.BootID()

	off := time.Now()
	if err := n.PowerOff(); err != nil {
		t.Fatal(err)
	}
	// What the power cycle took, so that what comes back is the plugin's doing.
	if n.BootID() == bootBefore {
		t.Fatalf("boot ID unchanged: %s", bootBefore)
	}
	if left := n.PoweredOffLeftovers(); len(left) > 0 {
		t.Errorf("left after the power loss:\n%s", strings.Join(left, "\n"))
	}
	if left, _ := os.ReadDir(n.CDIRoot); len(left) > 0 {
		t.Errorf("CDI root not empty after power-off: %v", left)
	}
	if d := n.MPSDaemons(); len(d) > 0 {
		t.Errorf("MPS daemons alive after power-off: %v", d)
	}
	if got := timeSlice(t, n, tsGPU); got != "0" {
		t.Errorf("time slice of %s after power-off: %s, want 0", tsGPU, got)
	}
	if got := computeMode(t, n, mpsGPU); got != "DEFAULT" {
		t.Errorf("compute mode of %s after power-off: %s, want DEFAULT", mpsGPU, got)
	}
	offTook := time.Since(off)
	on := time.Now()
	if err := n.PowerOn(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s rebooted: boot ID %s -> %s; power-off %s, power-on to Node Ready %s", name, bootBefore, n.BootID(),
		offTook.Round(time.Millisecond), time.Since(on).Round(time.Millisecond))

	// The kubelet makes a new sandbox and container for each pod; the old
	// container is gone with the power.
	for _, pod := range []*v1.Pod{ts, mps} {
		if !eventually(ctx, 90*time.Second, func() bool {
			got, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
			return err == nil && runningAgain(got, containersBefore[pod.Name])
		}) {
			got, _ := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
			t.Fatalf("pod %s: container not running again after the reboot (%s); plugin log:\n%s\nkubelet log (end):\n%s",
				pod.Name, harness.PodProblem(got), n.Plugin.Log(), lastLines(n.KubeletLog(), 30))
		}
	}
	t.Logf("both pods running again %s after power-on", time.Since(on).Round(time.Millisecond))
	ts, mps = getPod(ctx, t, ts), getPod(ctx, t, mps)
	for _, pod := range []*v1.Pod{ts, mps} {
		if got := kubeletCDIIDs(ctx, t, n, pod); !reflect.DeepEqual(got, idsBefore[pod.Name]) {
			t.Errorf("pod %s: CDI devices after the reboot %v, before %v", pod.Name, got, idsBefore[pod.Name])
		}
	}
	checkShared("after the reboot")
	if after := n.MPSDaemons(); len(after) == 1 && len(daemonBefore) == 1 && after[0].Pid == daemonBefore[0].Pid {
		t.Errorf("MPS daemon pid %d before and after the reboot", after[0].Pid)
	}
	log := n.Plugin.Log()
	if got := strings.Count(log, "the node rebooted since it was prepared"); got < 2 {
		t.Errorf("plugin log names the reboot as the reason to prepare again %d times, want one per claim (2)", got)
	}
	if !eventually(ctx, 60*time.Second, func() bool {
		slices, err := nodeSlices(ctx, name)
		return err == nil && len(slices) > 0
	}) {
		t.Errorf("no ResourceSlices of %s after the reboot (the kubelet wipes them at start; the plugin publishes again)", name)
	}

	deletePod(ctx, t, ts)
	deletePod(ctx, t, mps)
	if !eventually(ctx, 20*time.Second, func() bool { return len(n.MPSDaemons()) == 0 }) {
		t.Errorf("MPS daemon left after its pod is gone: %v", n.MPSDaemons())
	}
	for _, claim := range []*resourceapi.ResourceClaim{tsClaim, mpsClaim} {
		if files := claimSpecFiles(t, name, string(claim.UID)); len(files) > 0 {
			t.Errorf("claim %s: CDI spec files left after unprepare: %v", claim.Name, files)
		}
	}
	if got := timeSlice(t, n, tsGPU); got != "0" {
		t.Errorf("time slice of %s after unprepare: %s, want 0", tsGPU, got)
	}
	if got := computeMode(t, n, mpsGPU); got != "DEFAULT" {
		t.Errorf("compute mode of %s after unprepare: %s, want DEFAULT", mpsGPU, got)
	}
}

// addBootNode adds a node whose plugin reads its boot ID from the node's
// BootIDFile (so Node.Reboot can change it). before runs once the simulated
// host exists and before the plugin starts. The node and its slices go when
// the test ends.
func addBootNode(ctx context.Context, t *testing.T, name, profile string, before func(*harness.Node)) *harness.Node {
	t.Helper()
	return addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name}, profile, nil, before)
}

// addPluginNode is addBootNode with extra plugin flags.
func addPluginNode(ctx context.Context, t *testing.T, name, profile string, extraArgs []string, before func(*harness.Node)) *harness.Node {
	t.Helper()
	return addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name}, profile, extraArgs, before)
}

// addPluginNodeWith is addPluginNode for a node with more options than a name.
func addPluginNodeWith(ctx context.Context, t *testing.T, opts harness.NodeOptions, profile string, extraArgs []string, before func(*harness.Node)) *harness.Node {
	t.Helper()
	name := opts.Name
	n, err := cluster.AddNode(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if err := cluster.RemoveNode(ctx, name); err != nil {
			t.Errorf("remove node %s: %v", name, err)
		}
		err := cluster.Client.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		if err != nil {
			t.Errorf("delete slices of %s: %v", name, err)
		}
	})
	if err := n.SetupSim(profile); err != nil {
		t.Fatal(err)
	}
	if err := n.WriteBootID(harness.NewBootID()); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(n)
	}
	if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: profile, BootIDFile: n.BootIDFile(), ExtraArgs: extraArgs}); err != nil {
		t.Fatal(err)
	}
	if !eventually(ctx, registerTimeout, func() bool { return n.DriverRegistered(harness.DefaultDriver) }) {
		t.Fatalf("plugin on %s not registered (running: %v); log:\n%s", name, n.Plugin.Running(), n.Plugin.Log())
	}
	if !eventually(ctx, 60*time.Second, func() bool {
		slices, err := nodeSlices(ctx, name)
		return err == nil && len(slices) > 0
	}) {
		t.Fatalf("plugin on %s published no slices; log:\n%s", name, n.Plugin.Log())
	}
	return n
}

// claimGPU is the UUID of a one-GPU claim's device.
func claimGPU(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim) string {
	t.Helper()
	res := claim.Status.Allocation.Devices.Results
	if len(res) != 1 {
		t.Fatalf("claim %s: want one allocated device, got %v", claim.Name, res)
	}
	uuid := attrString(sliceDevice(ctx, t, res[0].Pool, res[0].Device), "uuid")
	if uuid == "" {
		t.Fatalf("device %s of claim %s has no uuid", res[0].Device, claim.Name)
	}
	return uuid
}

// kubeletCDIIDs are the CDI device IDs a real node's kubelet gives each
// container of a pod for its claims, as its PodResources API reports them
// (sorted per container).
func kubeletCDIIDs(ctx context.Context, t *testing.T, n *harness.Node, pod *v1.Pod) map[string][]string {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+n.PodResourcesSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	res, err := podresourcesv1.NewPodResourcesListerClient(conn).Get(ctx, &podresourcesv1.GetPodResourcesRequest{PodName: pod.Name, PodNamespace: pod.Namespace})
	if err != nil {
		t.Fatalf("PodResources Get %s/%s on %s: %v", pod.Namespace, pod.Name, n.Name, err)
	}
	out := map[string][]string{}
	for _, c := range res.PodResources.Containers {
		for _, dr := range c.DynamicResources {
			for _, cr := range dr.ClaimResources {
				for _, cdi := range cr.CdiDevices {
					out[c.Name] = append(out[c.Name], cdi.Name)
				}
			}
		}
		sort.Strings(out[c.Name])
	}
	if len(out) == 0 {
		t.Fatalf("PodResources: no CDI devices for pod %s/%s: %v", pod.Namespace, pod.Name, res.PodResources)
	}
	return out
}

// runningAgain says whether every container of a pod runs in a container
// other than before, and the pod is Ready.
func runningAgain(pod *v1.Pod, before string) bool {
	if len(pod.Status.ContainerStatuses) != len(pod.Spec.Containers) {
		return false
	}
	for _, st := range pod.Status.ContainerStatuses {
		if st.State.Running == nil || !st.Ready || st.ContainerID == before {
			return false
		}
	}
	return true
}

func getPod(ctx context.Context, t *testing.T, pod *v1.Pod) *v1.Pod {
	t.Helper()
	got, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// allRunning says whether want containers exist and all run.
func allRunning(ctrs []*harness.Container, want int) bool {
	if len(ctrs) != want {
		return false
	}
	for _, c := range ctrs {
		if phase, _, _ := c.State(); phase != harness.ContainerRunning {
			return false
		}
	}
	return true
}

// computeMode reads a GPU's compute mode (DEFAULT, EXCLUSIVE_PROCESS, ...)
// from the simulator state.
func computeMode(t *testing.T, n *harness.Node, uuid string) string {
	t.Helper()
	return gpuSettings(t, n, uuid).ComputeMode
}
