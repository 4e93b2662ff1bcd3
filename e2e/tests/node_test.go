package tests

import (
	"context"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpu-dra/e2e/harness"
)

var deviceName = regexp.MustCompile(`^gpu-[0-9]+(-mig-[0-9a-z]+-[0-9]+-[0-9]+)?$`)

// The plugin registers through the kubelet's own plugin watcher, which dials
// the registration socket with grpc-go and the socket path as HTTP/2
// :authority, and the kubelet's DRA manager connects to its DRA service.
func TestRegistrationThroughKubeletPluginWatcher(t *testing.T) {
	requireRegistered(t)
	for name := range nodeProfiles {
		if !cluster.Node(name).DriverRegistered(harness.DefaultDriver) {
			t.Errorf("%s: driver not registered with the kubelet's DRA manager", name)
		}
	}
}

// The plugin publishes slices that match what `gpu-kubelet-plugin discover`
// sees on the same simulated host.
func TestSlicesPublished(t *testing.T) {
	requireRegistered(t)
	if slicesErr != nil {
		t.Fatal(slicesErr)
	}
	ctx := context.Background()
	for name, profile := range nodeProfiles {
		n := cluster.Node(name)
		slices, err := nodeSlices(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, s := range slices {
			if s.Spec.NodeName == nil || *s.Spec.NodeName != name {
				t.Errorf("%s: slice %s not bound to the node", name, s.Name)
			}
			for _, d := range s.Spec.Devices {
				names = append(names, d.Name)
				if !deviceName.MatchString(d.Name) {
					t.Errorf("%s: device name %q does not follow gpu-<minor>[-mig-<profile>-<gi>-<start>]", name, d.Name)
				}
				for _, attr := range []string{"type", "uuid", "productName"} {
					if attrString(d, attr) == "" {
						t.Errorf("%s: device %s has no %s attribute", name, d.Name, attr)
					}
				}
			}
		}
		if len(names) == 0 {
			t.Fatalf("%s: no devices published", name)
		}
		t.Logf("%s (%s): %d devices in %d slices", name, profile, len(names), len(slices))
		if profile == "dgx-a100-40gb" && !strings.Contains(strings.Join(names, " "), "-mig-") {
			t.Errorf("%s: profile %s has MIG devices but none published: %v", name, profile, names)
		}

		bin, err := harness.Binary("gpu-kubelet-plugin")
		if err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "discover", "--output", "json", "--node-name", name,
			"--driver-root", n.SimRoot(), "--dev-root", n.SimRoot(), "--sysfs-root", n.SimRoot()+"/sys").Output()
		if err != nil {
			t.Fatalf("discover on %s: %v", name, err)
		}
		for _, dev := range names {
			if !strings.Contains(string(out), `"`+dev+`"`) {
				t.Errorf("%s: published device %s is not in `discover` output", name, dev)
			}
		}
	}
}

// Node A's plugin identity (a token bound to a pod on node A) cannot create,
// change or delete node B's slices; it can write its own.
func TestNodeRestriction(t *testing.T) {
	requirePlugins(t)
	requireChart(t)
	ctx := context.Background()
	cfg, err := clientcmd.BuildConfigFromFlags("", cluster.Node(nodeT4).Dir+"/plugin.kubeconfig")
	if err != nil {
		t.Fatal(err)
	}
	asT4, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	slices := asT4.ResourceV1().ResourceSlices()
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	newSlice := func(node string) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{GenerateName: node + "-intruder-"},
			Spec: resourceapi.ResourceSliceSpec{
				Driver: harness.DefaultDriver, NodeName: &node,
				Pool:    resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
				Devices: []resourceapi.Device{{Name: "gpu-99"}},
			},
		}
	}
	if _, err := slices.Create(ctx, newSlice(nodeT4), dry); err != nil {
		t.Errorf("t4 plugin may not create a slice for its own node: %v", err)
	}
	if _, err := slices.Create(ctx, newSlice(nodeA100), dry); err == nil {
		t.Errorf("t4 plugin created a slice for %s", nodeA100)
	} else if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) {
		t.Errorf("t4 plugin creating a slice for %s: want forbidden, got %v", nodeA100, err)
	} else {
		t.Logf("refused as expected: %v", err)
	}
	theirs, err := nodeSlices(ctx, nodeA100)
	if err != nil || len(theirs) == 0 {
		t.Fatalf("no slices of %s: %v", nodeA100, err)
	}
	victim := theirs[0].DeepCopy()
	victim.Spec.Devices = victim.Spec.Devices[:1]
	if _, err := slices.Update(ctx, victim, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}}); err == nil {
		t.Errorf("t4 plugin updated slice %s of %s", victim.Name, nodeA100)
	}
	if err := slices.Delete(ctx, victim.Name, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}); err == nil {
		t.Errorf("t4 plugin deleted slice %s of %s", victim.Name, nodeA100)
	}
	// Unbound to a node (a cluster-wide slice) is refused too.
	global := newSlice(nodeT4)
	global.Spec.NodeName = nil
	global.Spec.AllNodes = new(true)
	if _, err := slices.Create(ctx, global, dry); err == nil {
		t.Errorf("t4 plugin created an allNodes slice")
	}
}

// kill -9 of the plugin with pods running, then a restart: the running pods
// keep their CDI specs, the plugin registers again, new claims prepare, and
// after the pods go nothing is left (spec files, MPS daemons).
func TestPluginCrashAndRestart(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "crash")
	n := cluster.Node(nodeA100)
	before, claimBefore := runClaimPod(ctx, t, gpuClaim(t, ns, "before", 1, nil), claimPod(ns, "before", nodeA100, "before"))
	devsBefore := podDevices(t, before)
	mpsConfig := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{"defaultActiveThreadPercentage": 25}},
	}
	// With MPS when the build has sharing: the daemon must survive the crash.
	var mps *v1.Pod
	var claimMPS *resourceapi.ResourceClaim
	var devsMPS map[string][]harness.ResolvedDevice
	t.Run("mps-before-crash", func(t *testing.T) {
		mps, claimMPS = runClaimPod(ctx, t, gpuClaim(t, ns, "mps", 1, mpsConfig), claimPod(ns, "mps", nodeA100, "mps"))
		devsMPS = podDevices(t, mps)
		if len(n.MPSDaemons()) != 1 {
			t.Fatalf("want one MPS daemon before the crash, got %v", n.MPSDaemons())
		}
	})
	if mps == nil {
		_ = cluster.Client.CoreV1().Pods(ns).Delete(ctx, "mps", metav1.DeleteOptions{})
		_ = cluster.WaitPodGone(ctx, ns, "mps", 60*time.Second)
	}

	n.Plugin.Kill()
	t.Logf("killed plugin pid on %s", nodeA100)
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	if !eventually(ctx, registerTimeout, func() bool { return n.DriverRegistered(harness.DefaultDriver) }) {
		t.Fatalf("plugin did not register again after restart; log:\n%s", n.Plugin.Log())
	}
	// The running pods still have their devices, and the MPS daemon (re-adopted or restarted) still serves.
	if mps != nil && len(n.MPSDaemons()) != 1 {
		t.Errorf("want one MPS daemon after the restart, got %v", n.MPSDaemons())
	}
	for _, list := range devsMPS {
		for _, r := range list {
			if _, err := harness.ResolveCDI(n.CDIRoot, r.ID); err != nil {
				t.Errorf("after restart: %v", err)
			}
		}
	}
	for _, list := range devsBefore {
		for _, r := range list {
			if _, err := harness.ResolveCDI(n.CDIRoot, r.ID); err != nil {
				t.Errorf("after restart: %v", err)
			}
		}
	}
	after, claimAfter := runClaimPod(ctx, t, gpuClaim(t, ns, "after", 1, nil), claimPod(ns, "after", nodeA100, "after"))
	podDevices(t, after)
	if claimAfter.Status.Allocation.Devices.Results[0].Device == claimBefore.Status.Allocation.Devices.Results[0].Device {
		t.Errorf("two claims got the same device %s", claimAfter.Status.Allocation.Devices.Results[0].Device)
	}

	deletePod(ctx, t, before)
	deletePod(ctx, t, after)
	claims := []*resourceapi.ResourceClaim{claimBefore, claimAfter}
	if mps != nil {
		deletePod(ctx, t, mps)
		claims = append(claims, claimMPS)
	}
	if !eventually(ctx, 20*time.Second, func() bool { return len(n.MPSDaemons()) == 0 }) {
		t.Errorf("MPS daemon left after its pod is gone: %v", n.MPSDaemons())
	}
	for _, claim := range claims {
		if files := claimSpecFiles(t, nodeA100, string(claim.UID)); len(files) > 0 {
			t.Errorf("claim %s: CDI spec files left after unprepare: %v", claim.Name, files)
		}
	}
}
