package tests

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// pinnedClaim asks for one device of a class whose uuid attribute is uuid.
func pinnedClaim(ns, name, class, uuid string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: fmt.Sprintf(`device.attributes["gpu.nvidia.com"].uuid == %q`, uuid),
				}}},
			}}},
		}},
	}
}

// createClaimAndPod creates both without waiting.
func createClaimAndPod(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, node string) *v1.Pod {
	t.Helper()
	if _, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create claim: %v", err)
	}
	pod := claimPod(claim.Namespace, claim.Name, node, claim.Name)
	created, err := cluster.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	return created
}

// deleteClaimAndPod deletes a pod (waiting for the node to finish it) and its claim.
func deleteClaimAndPod(ctx context.Context, t *testing.T, pod *v1.Pod) {
	t.Helper()
	deletePod(ctx, t, pod)
	for _, c := range pod.Spec.ResourceClaims {
		if c.ResourceClaimName == nil {
			continue
		}
		if err := cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Delete(ctx, *c.ResourceClaimName, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// poolDevices maps device name to device for one node's pool.
func poolDevices(ctx context.Context, t *testing.T, node string) map[string]resourceapi.Device {
	t.Helper()
	slices, err := nodeSlices(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]resourceapi.Device{}
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			out[d.Name] = d
		}
	}
	return out
}

func draErrorsContaining(n *harness.Node, pod, text string) bool {
	for _, e := range n.DRAErrors() {
		if strings.Contains(e, pod) && strings.Contains(e, text) {
			return true
		}
	}
	return false
}

// kubeletRetryWait bounds the wait for a prepare error that the node's
// kubelet reports. A real kubelet retries a pod whose sync failed 10 s later,
// jittered up to 15 s (its pod workers' backoff), and reports each failed
// attempt as a FailedPrepareDynamicResources event of the pod; the error a
// test waits for can come at a later attempt than the first (which may fail
// for another reason: the pod was bound before its claim was allocated, or
// the kubelet reported another claim of the pod), so the wait holds several
// attempts on a loaded machine.
const kubeletRetryWait = 2 * time.Minute

// waitPrepareErrors waits until the node's kubelet has reported prepare
// errors of the pod that contain each of texts, and fails the test if the
// pod runs meanwhile or the errors do not come within kubeletRetryWait.
func waitPrepareErrors(ctx context.Context, t *testing.T, n *harness.Node, pod *v1.Pod, texts ...string) {
	t.Helper()
	key := "prepare " + pod.Namespace + "/" + pod.Name + ":"
	start := time.Now()
	var running bool
	if !eventually(ctx, kubeletRetryWait, func() bool {
		p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err == nil && p.Status.Phase == v1.PodRunning {
			running = true
			return true
		}
		for _, text := range texts {
			if !draErrorsContaining(n, key, text) {
				return false
			}
		}
		return true
	}) || running {
		t.Fatalf("pod %s/%s: want prepare errors with %q from the kubelet within %v, running=%v; kubelet errors: %v\nplugin log:\n%s",
			pod.Namespace, pod.Name, texts, kubeletRetryWait, running, n.DRAErrors(), n.Plugin.Log())
	}
	t.Logf("pod %s/%s: the kubelet reported %q after %v", pod.Namespace, pod.Name, texts, time.Since(start).Round(time.Second))
}

// TestMIGRelayoutWhilePluginRuns changes MIG layouts under a running plugin
// (with its periodic rediscovery off, so only prepare notices): claims the
// scheduler allocated from the stale slices are refused (a device recreated
// under the same name, a device gone), the slices are republished at once,
// and a claim allocated afterwards gets the new instance's nodes. The first
// stale pod has two claims, so one kubelet call carries both: the first
// refusal republishes at once, and the second claim must still be judged by
// what was published when the call arrived (refused as changed, not prepared
// on the new instance).
func TestMIGRelayoutWhilePluginRuns(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-relayout"
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, RealKubelet: true}, "dgx-a100-40gb", []string{"--rediscover-interval-seconds=3600"}, nil)
	ns := newNamespace(ctx, t, "relayout")
	before := poolDevices(ctx, t, name)
	const (
		recreated = "gpu-0-mig-1g5gb-19-0"
		removed   = "gpu-0-mig-1g5gb-19-1"
		// Gone in the second re-layout, on GPU 1: GPU instance 12 (the
		// profile's 1g.5gb at placement 1).
		gone = "gpu-1-mig-1g5gb-19-1"
	)
	oldRecreated, oldRemoved, oldGone := attrString(before[recreated], "uuid"), attrString(before[removed], "uuid"), attrString(before[gone], "uuid")
	if oldRecreated == "" || oldGone == "" || oldRemoved == "" {
		t.Fatalf("the profile lacks %s, %s or %s: %v", recreated, removed, gone, keys(before))
	}
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	relayout := func(steps ...[]string) {
		t.Helper()
		for _, args := range steps {
			if out, err := exec.Command(smi, args...).CombinedOutput(); err != nil {
				t.Fatalf("nvidia-smi %v: %v: %s", args, err, out)
			}
		}
	}
	// stalePod creates claims pinned to device identities (claim name, UUID,
	// ...) and one pod that uses them all, named after the first.
	stalePod := func(claimsAndUUIDs ...string) *v1.Pod {
		t.Helper()
		var pod *v1.Pod
		for i := 0; i+1 < len(claimsAndUUIDs); i += 2 {
			claim, uuid := claimsAndUUIDs[i], claimsAndUUIDs[i+1]
			if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, pinnedClaim(ns, claim, "mig.nvidia.com", uuid), metav1.CreateOptions{}); err != nil {
				t.Fatalf("create claim: %v", err)
			}
			if pod == nil {
				pod = claimPod(ns, "stale-"+claim, name, claim)
				continue
			}
			ref := claim
			pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{Name: claim, ResourceClaimName: &ref})
			pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, v1.ResourceClaim{Name: claim})
		}
		pod, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod: %v", err)
		}
		return pod
	}

	// The operator re-partitions GPU 0: both 1g.5gb instances destroyed, one
	// created again at placement 0 (new GPU instance ID, new UUID). Claims
	// allocated from the stale slices onto the recreated and the removed
	// device, in one pod, are both refused.
	relayout(
		[]string{"mig", "-i", "0", "-dci", "-gi", "11,12"},
		[]string{"mig", "-i", "0", "-dgi", "-gi", "11,12"},
		[]string{"mig", "-i", "0", "-cgi", "19:0", "-C"},
	)
	changed := stalePod("changed", oldRecreated, "removed", oldRemoved)
	waitPrepareErrors(ctx, t, n, changed, "changed since this node published it", "is no longer on this node")

	// Republished without waiting for the rediscovery: the new identity, and
	// no removed device.
	var newUUID string
	if !eventually(ctx, 30*time.Second, func() bool {
		after := poolDevices(ctx, t, name)
		_, stillThere := after[removed]
		newUUID = attrString(after[recreated], "uuid")
		return !stillThere && newUUID != "" && newUUID != oldRecreated
	}) {
		t.Fatalf("slices not republished after the re-layout: %v", keys(poolDevices(ctx, t, name)))
	}

	// Then GPU 1 loses an instance its slices still offer (nothing has made
	// the plugin look at GPU 1 since): a claim allocated onto it is refused as
	// gone, and the slices drop it.
	if _, ok := poolDevices(ctx, t, name)[gone]; !ok {
		t.Fatalf("%s not published before its instance is destroyed", gone)
	}
	relayout(
		[]string{"mig", "-i", "1", "-dci", "-gi", "12"},
		[]string{"mig", "-i", "1", "-dgi", "-gi", "12"},
	)
	lost := stalePod("gone", oldGone)
	waitPrepareErrors(ctx, t, n, lost, "is no longer on this node")
	if !eventually(ctx, 30*time.Second, func() bool {
		_, stillThere := poolDevices(ctx, t, name)[gone]
		return !stillThere
	}) {
		t.Fatalf("slices still offer %s after its refusal", gone)
	}

	// Both stay refused at the kubelet's retries.
	time.Sleep(3 * time.Second)
	for _, pod := range []*v1.Pod{changed, lost} {
		got, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Status.Phase == v1.PodRunning {
			t.Errorf("pod %s runs on a device allocated for an identity that no longer exists", pod.Name)
		}
		deleteClaimAndPod(ctx, t, pod)
	}

	// Allocated now: runs, and its container sees exactly the new instance.
	pod, claim := runClaimPod(ctx, t, pinnedClaim(ns, "fresh", "mig.nvidia.com", newUUID), claimPod(ns, "fresh", name, "fresh"))
	if got := claim.Status.Allocation.Devices.Results[0].Device; got != recreated {
		t.Fatalf("fresh claim got %s, want %s", got, recreated)
	}
	for _, ctr := range pod.Spec.Containers {
		checkContainerSees(ctx, t, pod, ctr)
	}
	// The admin view names the claim and its partition (holders only: the
	// plugin pod here stands for a plugin that runs as a process, so no
	// metrics are served at that pod's address).
	if usage := runUsage(t, "--node", name, "--no-metrics"); !strings.Contains(usage, recreated+"  "+ns+"/fresh  MIG 1g.5gb") {
		t.Errorf("gpu-dra usage does not show %s/fresh on %s:\n%s", ns, recreated, usage)
	}
	deleteClaimAndPod(ctx, t, pod)
}

// runUsage runs `gpu-dra usage` against the test cluster.
func runUsage(t *testing.T, args ...string) string {
	t.Helper()
	bin, err := harness.Binary("gpu-dra")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append([]string{"usage"}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+cluster.Kubeconfig)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("gpu-dra usage %v: %v: %s", args, err, out)
	}
	return string(out)
}

// resourceHealth is the health the pod's container status reports per
// allocated device (by ResourceID).
func resourceHealth(ctx context.Context, t *testing.T, pod *v1.Pod) map[string]string {
	t.Helper()
	got, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, cs := range got.Status.ContainerStatuses {
		for _, rs := range cs.AllocatedResourcesStatus {
			for _, r := range rs.Resources {
				msg := ""
				if r.Message != nil {
					msg = ": " + *r.Message
				}
				out[string(r.ResourceID)] = string(r.Health) + msg
			}
		}
	}
	return out
}

// deviceHealth is the health of a pod's one allocated device ("" while none
// is reported).
func deviceHealth(ctx context.Context, t *testing.T, pod *v1.Pod) string {
	t.Helper()
	for _, h := range resourceHealth(ctx, t, pod) {
		return h
	}
	return ""
}

func taintsOf(d resourceapi.Device) []string {
	var out []string
	for _, t := range d.Taints {
		out = append(out, fmt.Sprintf("%s=%s:%s", t.Key, t.Value, t.Effect))
	}
	return out
}

// TestDeviceHealth injects GPU faults into the simulated driver: XID and ECC
// errors taint the device (new claims avoid it) and a running pod's status
// shows its device unhealthy; the GPU reset clears both. A GPU fallen off the
// bus is tainted NoExecute and refused at prepare, the rest of the node keeps
// working.
func TestDeviceHealth(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-health"
	n := addPluginNode(ctx, t, name, "dgx-h100", []string{"--health-probe-interval-seconds=1"}, nil)
	ns := newNamespace(ctx, t, "health")
	sim := func(args ...string) { t.Helper(); gpuSim(t, n, args...) }
	deviceWith := func(device string, cond func(taints []string) bool) bool {
		return eventually(ctx, 30*time.Second, func() bool {
			return cond(taintsOf(poolDevices(ctx, t, name)[device]))
		})
	}

	running, claim := runClaimPod(ctx, t, gpuClaim(t, ns, "busy", 1, nil), claimPod(ns, "busy", name, "busy"))
	busy := claim.Status.Allocation.Devices.Results[0].Device
	busyUUID := claimGPU(ctx, t, claim)
	devices := poolDevices(ctx, t, name)
	var free, lost string
	for d := range devices {
		if d != busy && free == "" {
			free = d
		} else if d != busy && d != free && lost == "" {
			lost = d
		}
	}
	freeUUID, lostUUID := attrString(devices[free], "uuid"), attrString(devices[lost], "uuid")
	if !eventually(ctx, 30*time.Second, func() bool { return strings.HasPrefix(deviceHealth(ctx, t, running), "Healthy") }) {
		t.Fatalf("pod %s: device health %v, want Healthy", running.Name, resourceHealth(ctx, t, running))
	}

	// An application XID changes nothing; XID 48 on the busy GPU taints it
	// and the pod's status shows it unhealthy.
	sim("xid", "--gpu", busyUUID, "13")
	sim("xid", "--gpu", busyUUID, "48")
	if !deviceWith(busy, func(ts []string) bool {
		return strings.Join(ts, " ") == "gpu.nvidia.com/recovery-action=reset:NoSchedule gpu.nvidia.com/xid=48:NoSchedule"
	}) {
		t.Fatalf("device %s taints %v, want the XID 48 and reset taints", busy, taintsOf(poolDevices(ctx, t, name)[busy]))
	}
	if !eventually(ctx, 30*time.Second, func() bool {
		h := deviceHealth(ctx, t, running)
		return strings.HasPrefix(h, "Unhealthy") && strings.Contains(h, "XID error 48")
	}) {
		t.Fatalf("pod %s: device health %v, want Unhealthy with XID 48", running.Name, resourceHealth(ctx, t, running))
	}

	// The plugin crashes and restarts: the conditions it saw are kept (the XID
	// event is not delivered again).
	n.Plugin.Kill()
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	if !eventually(ctx, registerTimeout, func() bool { return n.DriverRegistered(harness.DefaultDriver) }) {
		t.Fatalf("plugin did not register again; log:\n%s", n.Plugin.Log())
	}
	time.Sleep(3 * time.Second)
	if ts := strings.Join(taintsOf(poolDevices(ctx, t, name)[busy]), " "); !strings.Contains(ts, "gpu.nvidia.com/xid=48:NoSchedule") {
		t.Fatalf("after a plugin restart device %s has taints %q, want the XID 48 taint kept", busy, ts)
	}

	// An ECC error on a free GPU: a claim pinned to it is not allocated.
	sim("ecc", "--gpu", freeUUID)
	if !deviceWith(free, func(ts []string) bool {
		return strings.Contains(strings.Join(ts, " "), "gpu.nvidia.com/ecc=uncorrectable:NoSchedule")
	}) {
		t.Fatalf("device %s taints %v, want the ECC taint", free, taintsOf(poolDevices(ctx, t, name)[free]))
	}
	waiting := createClaimAndPod(ctx, t, pinnedClaim(ns, "pinned", "gpu.nvidia.com", freeUUID), name)
	time.Sleep(5 * time.Second)
	if c, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, "pinned", metav1.GetOptions{}); err != nil || c.Status.Allocation != nil {
		t.Fatalf("claim pinned to the tainted GPU was allocated (%v): %+v", err, c.Status.Allocation)
	}

	// A GPU falls off the bus: NoExecute taint, the node still publishes and
	// prepares the others.
	sim("fall-off-bus", "--gpu", lostUUID)
	if !deviceWith(lost, func(ts []string) bool {
		return strings.Contains(strings.Join(ts, " "), "gpu.nvidia.com/gpu-lost=:NoExecute")
	}) {
		t.Fatalf("device %s taints %v, want gpu-lost NoExecute", lost, taintsOf(poolDevices(ctx, t, name)[lost]))
	}

	// The GPUs are reset: healthy again, the waiting claim is allocated and runs.
	for _, uuid := range []string{busyUUID, freeUUID, lostUUID} {
		sim("reset", "--gpu", uuid)
	}
	for _, d := range []string{busy, free, lost} {
		if !deviceWith(d, func(ts []string) bool { return len(ts) == 0 }) {
			t.Fatalf("device %s still tainted after the reset: %v", d, taintsOf(poolDevices(ctx, t, name)[d]))
		}
	}
	if !eventually(ctx, 30*time.Second, func() bool { return strings.HasPrefix(deviceHealth(ctx, t, running), "Healthy") }) {
		t.Fatalf("pod %s: device health %v after the reset, want Healthy", running.Name, resourceHealth(ctx, t, running))
	}
	if _, err := cluster.WaitPodRunning(ctx, ns, waiting.Name, 60*time.Second); err != nil {
		t.Fatalf("pod on the recovered GPU: %v", err)
	}
	deleteClaimAndPod(ctx, t, waiting)
	deletePod(ctx, t, running)
}
