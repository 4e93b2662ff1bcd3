package tests

import (
	"context"
	"fmt"
	"os"
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
	"k8s.io/apimachinery/pkg/types"

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

// destroyInstances destroys GPU instances of one GPU of a node by hand, as
// an admin does with nvidia-smi (the node's simulated driver): each of gis,
// or every instance when gis is empty.
func destroyInstances(t *testing.T, n *harness.Node, gpu int, gis ...int) {
	t.Helper()
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	var gi []string
	if len(gis) > 0 {
		var ids []string
		for _, g := range gis {
			ids = append(ids, fmt.Sprint(g))
		}
		gi = []string{"-gi", strings.Join(ids, ",")}
	}
	for _, op := range []string{"-dci", "-dgi"} {
		args := append([]string{"mig", "-i", fmt.Sprint(gpu), op}, gi...)
		if out, err := exec.Command(smi, args...).CombinedOutput(); err != nil {
			t.Fatalf("nvidia-smi %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

// TestDynamicMIG: GPU 0 of an A100 node, emptied by the admin (the plugin
// keeps the instances a GPU has when it becomes dynamic), is offered as
// dynamic MIG; the scheduler places 3g.20gb, 2g.10gb and 1g.5gb claims on
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
	empty := func(n *harness.Node) { destroyInstances(t, n, 0) }
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--dynamic-mig-gpus=0"}, empty)
	if got := gpuInstances(t, n, 0); len(got) != 0 {
		t.Fatalf("GPU 0 has instances at start: %v; plugin log:\n%s", got, n.Plugin.Log())
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
	// Registered first: a real kubelet that finds no plugin at prepare
	// retries the pod only at its next periodic sync (a minute later).
	if !eventually(ctx, registerTimeout, func() bool { return n.DriverRegistered(harness.DefaultDriver) }) {
		t.Fatalf("plugin with the failpoint did not register; log:\n%s", n.Plugin.Log())
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

// memorySlices are the memory slices a published device consumes from its
// GPU's counter set (none for a static device).
func memorySlices(d resourceapi.Device) []int {
	var out []int
	for _, c := range d.ConsumesCounters {
		for k := range c.Counters {
			var i int
			if _, err := fmt.Sscanf(k, "memory-slice-%d", &i); err == nil {
				out = append(out, i)
			}
		}
	}
	sort.Ints(out)
	return out
}

// TestDynamicMIGSwitchKeepsInstancesInUse: GPU 0 of an A100 node is
// partitioned statically (the admin left one 3g.20gb at memory slices 4-7)
// and a pod runs on that static MIG device. The admin then marks GPU 0
// dynamic with the Node annotation, which the running plugin applies. The
// pod's instance survives (same UUID, the pod keeps running), it stays
// published as the static device it is, no placement over slices 4-7 is
// offered, and a new 2g.10gb claim gets a placement beside it. When both
// pods are gone, the claim's dynamic instance is destroyed and the kept one
// stays.
func TestDynamicMIGSwitchKeepsInstancesInUse(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-dynmig-switch"
	// GI 1 is the 3g.20gb at 4 of the profile; 6, 11 and 12 the rest.
	keepOne := func(n *harness.Node) { destroyInstances(t, n, 0, 6, 11, 12) }
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", nil, keepOne)
	if got := gpuInstances(t, n, 0); strings.Join(got, " ") != "3g.20gb@4" {
		t.Fatalf("GPU 0 instances %v, want the 3g.20gb at 4 only", got)
	}
	const static3g = "gpu-0-mig-3g20gb-9-4"
	devices := poolDevices(ctx, t, name)
	gpu0 := attrString(devices[static3g], "parentUUID")
	if gpu0 == "" {
		t.Fatalf("static device %s not published: %v", static3g, keys(devices))
	}
	ns := newNamespace(ctx, t, "dynmig-switch")
	running, claim := runClaimPod(ctx, t, migClaim(ns, "static", "3g.20gb", gpu0), claimPod(ns, "static", name, "static"))
	if got := claim.Status.Allocation.Devices.Results[0].Device; got != static3g {
		t.Fatalf("static claim allocated %s, want %s", got, static3g)
	}
	inUse := dynamicMIGUUID(t, name, gpu0, "3g.20gb")

	patch := `{"metadata":{"annotations":{"gpu.nvidia.com/dynamic-mig-gpus":"0"}}}`
	if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	// The running plugin watches its Node: the switch applies without a restart.
	const free2g = "gpu-0-mig-2g10gb-14-0"
	if !eventually(ctx, 60*time.Second, func() bool {
		_, ok := poolDevices(ctx, t, name)[free2g]
		return ok
	}) {
		t.Fatalf("GPU 0 not offered as dynamic MIG after the switch; plugin log:\n%s", n.Plugin.Log())
	}
	if got := dynamicMIGUUID(t, name, gpu0, "3g.20gb"); got != inUse {
		t.Fatalf("the pod's instance %s was replaced by %s; plugin log:\n%s", inUse, got, n.Plugin.Log())
	}
	if !strings.Contains(n.Plugin.Log(), "found on a GPU that became dynamic MIG: kept") {
		t.Errorf("plugin log does not say it kept the instance")
	}
	devices = poolDevices(ctx, t, name)
	if d, ok := devices[static3g]; !ok || attrString(d, "uuid") != inUse || len(d.ConsumesCounters) != 0 {
		t.Errorf("%s after the switch: published %v, uuid %q, counters %v; want the static device of %s", static3g, ok, attrString(d, "uuid"), d.ConsumesCounters, inUse)
	}
	if _, ok := devices["gpu-0"]; ok {
		t.Errorf("whole GPU 0 offered over the kept instance")
	}
	for dn, d := range devices {
		for _, i := range memorySlices(d) {
			if i >= 4 {
				t.Errorf("%s offered over memory slice %d of the kept instance", dn, i)
			}
		}
	}

	fresh, claim := runClaimPod(ctx, t, migClaim(ns, "fresh", "2g.10gb", gpu0), claimPod(ns, "fresh", name, "fresh"))
	placed := claim.Status.Allocation.Devices.Results[0].Device
	t.Logf("new 2g.10gb claim allocated %s", placed)
	if !strings.HasPrefix(placed, "gpu-0-mig-2g10gb-14-") || placed == "gpu-0-mig-2g10gb-14-4" {
		t.Fatalf("new claim allocated %s, want a 2g.10gb placement beside the kept instance", placed)
	}
	got := gpuInstances(t, n, 0)
	if len(got) != 2 || got[0] != "2g.10gb@"+strings.TrimPrefix(placed, "gpu-0-mig-2g10gb-14-") || got[1] != "3g.20gb@4" {
		t.Errorf("GPU 0 instances %v, want the new 2g.10gb and the kept 3g.20gb", got)
	}
	for _, pod := range []*v1.Pod{running, fresh} {
		for _, ctr := range pod.Spec.Containers {
			checkContainerSees(ctx, t, pod, ctr)
		}
	}
	if p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, running.Name, metav1.GetOptions{}); err != nil || p.Status.Phase != v1.PodRunning {
		t.Errorf("pod on the static device after the switch: %v (%v)", p.Status.Phase, err)
	}

	deleteClaimAndPod(ctx, t, fresh)
	deleteClaimAndPod(ctx, t, running)
	if !eventually(ctx, 30*time.Second, func() bool { return strings.Join(gpuInstances(t, n, 0), " ") == "3g.20gb@4" }) {
		t.Fatalf("GPU 0 instances %v after the claims are gone, want the kept 3g.20gb only; plugin log:\n%s", gpuInstances(t, n, 0), n.Plugin.Log())
	}
}

// TestCleanupDestroysDynamicMIGInstances: what `helm uninstall` runs on a
// node (the chart's pre-delete hook stops the node plugin, then runs
// `gpu-kubelet-plugin cleanup` with the plugin's host paths), here on a
// plugin-as-process node, whose dynamic MIG GPU the deployed suite's nodes
// lack. A claim's dynamic 2g.10gb instance is prepared when the plugin
// goes; cleanup destroys it before it removes the checkpoint, and leaves the
// 3g.20gb the admin had made before the GPU became dynamic.
func TestCleanupDestroysDynamicMIGInstances(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-dynmig-cleanup"
	keepOne := func(n *harness.Node) { destroyInstances(t, n, 0, 6, 11, 12) }
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--dynamic-mig-gpus=0"}, keepOne)
	var gpu0 string
	if !eventually(ctx, 60*time.Second, func() bool {
		gpu0 = attrString(poolDevices(ctx, t, name)["gpu-0-mig-2g10gb-14-0"], "parentUUID")
		return gpu0 != ""
	}) {
		t.Fatalf("GPU 0 not offered as dynamic MIG; plugin log:\n%s", n.Plugin.Log())
	}
	ns := newNamespace(ctx, t, "dynmig-cleanup")
	pod, claim := runClaimPod(ctx, t, migClaim(ns, "dyn", "2g.10gb", gpu0), claimPod(ns, "dyn", name, "dyn"))
	t.Logf("claim allocated %s", claim.Status.Allocation.Devices.Results[0].Device)
	if got := gpuInstances(t, n, 0); len(got) != 2 {
		t.Fatalf("GPU 0 instances %v, want the claim's 2g.10gb and the admin's 3g.20gb", got)
	}
	checkpoint := filepath.Join(n.PluginDir(harness.DefaultDriver), "gpu-dra-checkpoint.json")
	// The record is in the journal first; the plugin folds it into the file once its
	// journal has been idle for 0.2 s.
	var data []byte
	var err error
	if !eventually(ctx, 10*time.Second, func() bool {
		data, err = os.ReadFile(checkpoint)
		return err == nil && strings.Contains(string(data), "dynamicMig")
	}) {
		t.Fatalf("no dynamic MIG record in the checkpoint before the uninstall (%v): %s", err, data)
	}

	n.Plugin.Stop()
	bin, err := harness.Binary("gpu-kubelet-plugin")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "cleanup",
		"--driver-name="+harness.DefaultDriver,
		"--plugin-dir="+n.PluginDir(harness.DefaultDriver),
		"--registrar-dir="+n.RegistrarDir,
		"--cdi-root="+n.CDIRoot,
		"--driver-root="+n.SimRoot(),
		"--dev-root="+n.SimRoot(),
		"--sysfs-root="+filepath.Join(n.SimRoot(), "sys"),
		"--boot-id-file="+n.BootIDFile(),
	).CombinedOutput()
	if err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "destroyed MIG instance") {
		t.Errorf("cleanup log does not name the destroyed instance:\n%s", out)
	}
	if got := gpuInstances(t, n, 0); strings.Join(got, " ") != "3g.20gb@4" {
		t.Errorf("GPU 0 instances after cleanup %v, want the admin's 3g.20gb only\n%s", got, out)
	}
	if _, err := os.Stat(checkpoint); !os.IsNotExist(err) {
		t.Errorf("checkpoint left after cleanup (%v)", err)
	}

	// A plugin again, so that the kubelet can unprepare the claim (unknown now) when the pod goes.
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	deleteClaimAndPod(ctx, t, pod)
}
