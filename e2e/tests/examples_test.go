package tests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-dra/e2e/harness"
)

// Every scenario folder in examples/ (but invalid/) runs through the spec
// runner (harness/specs.go) on the spec nodes (real kubelets and containerd;
// dynamic-mig's GPUs 0 and 1 are specNodeDynamic's dynamic MIG GPUs, the
// memory-share scenario gets a real node with a memory-share GPU): applied
// as written to a fresh namespace, every pod runs, each container that claims
// devices lists exactly them with nvidia-smi -L, claims are released and CDI
// specs removed after deletion. On top, the examples' own checks: the CDI
// devices the kubelet gave each container (its PodResources) resolve to
// specs with the GPU device nodes (and MIG capability nodes), the driver's
// NVML library is in the container and found by the loader, MPS clients
// reach their daemon with the claim's settings, the examples that list
// /dev/nvidia* or their MPS pipe directory print it, and a container without
// devices sees none; the topology examples print what nvidia-smi topo -m
// showed them (after checking it).
func TestExamples(t *testing.T) {
	requirePlugins(t)
	root, err := harness.RepoPath("examples")
	if err != nil {
		t.Fatalf("no examples: %v", err)
	}
	dirs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	addSpecNodes(ctx, t)
	ran := 0
	for _, d := range dirs {
		if !d.IsDir() || d.Name() == "invalid" {
			continue
		}
		files, err := harness.SpecFiles(filepath.Join(root, d.Name()))
		if err != nil {
			continue
		}
		ran++
		var paths []string
		for _, f := range files {
			paths = append(paths, f.Path)
		}
		memoryShares := needsMemoryShares(t, paths)
		t.Run(d.Name(), func(t *testing.T) {
			if memoryShares {
				// Its node is there for this unit only: the unit runs
				// alone, before the others, so that no other unit's pods
				// land on the node it removes at its end.
				addMemoryShareNode(t)
			} else {
				// Each unit has namespaces of its own and the spec nodes
				// have the devices of several at once; a unit whose pods
				// find them taken waits for them within its timeout.
				t.Parallel()
			}
			// The examples' busybox sleep ignores SIGTERM: their pods are
			// deleted with a 1 s grace period, not the default 30 s.
			opts := harness.SpecOptions{NamespacePrefix: "ex-" + d.Name(), DeleteGracePeriod: new(int64(1))}
			runSpecUnit(ctx, t, files, opts, func(run *harness.SpecRun) { exampleChecks(ctx, t, run) })
		})
	}
	if ran == 0 {
		t.Fatalf("no examples: no scenario folder with manifests in %s", root)
	}
}

// exampleNode is a node an example needs besides the suite's, added for its
// run only: a node plugin with extra flags on a simulator profile.
type exampleNode struct {
	profile string
	args    []string
	// emptyGPUs are emptied of their MIG instances by hand before the plugin
	// starts, as an admin does before offering a GPU as dynamic MIG.
	emptyGPUs []int
}

// exampleNodes by example folder, for the pod-loop nodes of
// TestExamplesDeployed (TestExamples runs them on the spec nodes, whose
// specNodeDynamic has these GPUs dynamic). dynamic-mig asks for MIG profiles that no
// static instance of the suite's nodes has: only this node's dynamic GPUs
// offer them.
var exampleNodes = map[string]exampleNode{
	"dynamic-mig": {profile: "dgx-a100-40gb", args: []string{"--dynamic-mig-gpus=0,1"}, emptyGPUs: []int{0, 1}},
}

// needsMemoryShares says whether a scenario asks for consumable capacity,
// which only a memory-share GPU offers.
func needsMemoryShares(t *testing.T, files []string) bool {
	t.Helper()
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(data), "allowMultipleAllocations") {
			return true
		}
	}
	return false
}

// exampleShareGPU is the GPU the examples' memory-share node offers as
// memory shares, named in the examples' READMEs.
const exampleShareGPU = "gpu-7"

// addMemoryShareNode adds a real dgx-a100-40gb node for the rest of the test whose
// gpu-7 is offered as memory shares through the Node annotation, set as an
// admin sets it (the plugin reads it when it publishes; set here before it
// starts).
func addMemoryShareNode(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	const name = "node-ex-memshare"
	annotate := func(n *harness.Node) {
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"gpu.nvidia.com/memory-share-gpus":%q}}}`, exampleShareGPU)
		if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, RealKubelet: true}, "dgx-a100-40gb", nil, annotate)
	if !eventually(ctx, 60*time.Second, func() bool {
		d, ok := poolDevices(ctx, t, name)[exampleShareGPU]
		return ok && d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations
	}) {
		t.Fatalf("%s on %s not offered as memory shares with the annotation; plugin log:\n%s", exampleShareGPU, name, cluster.Node(name).Plugin.Log())
	}
}

func yamlFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if ext := filepath.Ext(e.Name()); !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	sort.Strings(out)
	return out
}

// exampleChecks are the examples' own checks on a unit whose pods run.
func exampleChecks(ctx context.Context, t *testing.T, run *harness.SpecRun) {
	t.Helper()
	for _, pod := range run.Pods {
		if pod.Status.Phase != v1.PodRunning {
			continue
		}
		node := cluster.Node(pod.Spec.NodeName)
		cdiIDs, err := node.CDIDevices(ctx, pod)
		if err != nil {
			t.Fatal(err)
		}
		for _, ctr := range pod.Spec.Containers {
			if !usesDevices(pod, ctr) {
				checkNoGPU(ctx, t, pod, ctr.Name)
				continue
			}
			var resolved []harness.ResolvedDevice
			for _, id := range cdiIDs[ctr.Name] {
				r, err := harness.ResolveCDI(node.CDIRoot, id)
				if err != nil {
					t.Fatalf("pod %s container %s: %v", pod.Name, ctr.Name, err)
				}
				resolved = append(resolved, r)
			}
			if len(resolved) == 0 {
				t.Errorf("pod %s container %s asks for devices but got no CDI device", pod.Name, ctr.Name)
			}
			for _, r := range resolved {
				checkGPUEdits(t, r)
				if strings.Contains(r.ID, "-mig-") {
					checkMIGEdits(t, r)
				}
			}
			t.Logf("pod %s on %s container %s: %v", pod.Name, pod.Spec.NodeName, ctr.Name, ids(resolved))
			checkDriverLibrary(ctx, t, pod, ctr.Name, resolved)
			if strings.Contains(strings.Join(ctr.Command, " "), "ls -l /dev/nvidia") {
				// The example's own command listed what it got.
				checkContainerLog(ctx, t, pod, ctr.Name, "/dev/nvidiactl")
			}
			if strings.Contains(strings.Join(ctr.Command, " "), "nvidia-smi topo -m") {
				// The topology examples check what they got with nvidia-smi topo -m
				// (and exit if it is not) and print what it is.
				checkContainerLog(ctx, t, pod, ctr.Name, "got: ")
			}
			if dir := mpsPipeDir(resolved); dir != "" {
				// The examples' MPS clients print their pipe directory.
				checkContainerLog(ctx, t, pod, ctr.Name, dir)
				checkMPSControl(ctx, t, pod, ctr)
			}
		}
	}
}

// runExample runs a scenario on the deployed pod-loop nodes of
// TestExamplesDeployed: workloads expanded to bare pods, runc exec.
func runExample(t *testing.T, name string, files []string) {
	ctx := context.Background()
	ns := newNamespace(ctx, t, "ex-"+name)
	var objs []*unstructured.Unstructured
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		parsed, err := harness.ParseYAML(data)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		objs = append(objs, parsed...)
	}
	// Namespaced objects go to the test's namespace whatever they say, so
	// scenarios do not collide.
	var pods []string
	var expanded []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetNamespace() != "" {
			o.SetNamespace(ns)
		}
		if harness.WorkloadKinds[o.GetKind()] {
			// No workload controllers run here: their pod template becomes
			// bare pods, one per replica, as the controller would create.
			workloadPods, err := harness.PodsFromWorkload(o)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range workloadPods {
				expanded = append(expanded, p)
				pods = append(pods, p.GetName())
			}
			continue
		}
		expanded = append(expanded, o)
		if o.GetKind() == "Pod" {
			pods = append(pods, o.GetName())
		}
	}
	objs = expanded
	if err := cluster.Apply(ctx, objs, ns); err != nil {
		t.Fatal(err)
	}
	if len(pods) == 0 {
		t.Logf("no pods in this scenario; objects applied")
		return
	}
	var running []*v1.Pod
	for _, p := range pods {
		pod, err := cluster.WaitPodRunning(ctx, ns, p, 90*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		running = append(running, pod)
	}
	claimUIDs := map[string]string{} // uid -> node
	for _, pod := range running {
		resolved := podDevices(t, pod)
		for _, ctr := range pod.Spec.Containers {
			if !usesDevices(pod, ctr) {
				continue
			}
			if len(resolved[ctr.Name]) == 0 {
				t.Errorf("pod %s container %s asks for devices but got no CDI device", pod.Name, ctr.Name)
			}
			for _, r := range resolved[ctr.Name] {
				checkGPUEdits(t, r)
				if strings.Contains(r.ID, "-mig-") {
					checkMIGEdits(t, r)
				}
			}
			t.Logf("pod %s on %s container %s: %v", pod.Name, pod.Spec.NodeName, ctr.Name, ids(resolved[ctr.Name]))
			// Inside the running container.
			checkContainerSees(ctx, t, pod, ctr)
			checkDriverLibrary(ctx, t, pod, ctr.Name, resolved[ctr.Name])
			if strings.Contains(strings.Join(ctr.Command, " "), "ls -l /dev/nvidia") {
				// The example's own command listed what it got.
				checkContainerLog(ctx, t, pod, ctr.Name, "/dev/nvidiactl")
			}
			if dir := mpsPipeDir(resolved[ctr.Name]); dir != "" {
				// The examples' MPS clients print their pipe directory.
				checkContainerLog(ctx, t, pod, ctr.Name, dir)
				checkMPSControl(ctx, t, pod, ctr)
			}
		}
		for _, ctr := range pod.Spec.Containers {
			if !usesDevices(pod, ctr) {
				checkNoGPU(ctx, t, pod, ctr.Name)
			}
		}
		for _, st := range pod.Status.ResourceClaimStatuses {
			if st.ResourceClaimName == nil {
				continue
			}
			claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *st.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if claim.Status.Allocation == nil {
				t.Fatalf("claim %s of running pod %s is not allocated", claim.Name, pod.Name)
			}
			for _, res := range claim.Status.Allocation.Devices.Results {
				if res.Driver == harness.DefaultDriver {
					sliceDevice(ctx, t, res.Pool, res.Device)
				}
			}
			claimUIDs[string(claim.UID)] = pod.Spec.NodeName
		}
	}
	// All pods deleted at once, with a 1 s grace period (their busybox
	// sleep ignores SIGTERM and the kubelet would wait the default 30 s for
	// each), then waited for.
	for _, pod := range running {
		if err := cluster.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &testGracePeriod}); err != nil {
			t.Fatal(err)
		}
	}
	for _, pod := range running {
		if err := cluster.WaitPodGone(ctx, ns, pod.Name, 60*time.Second); err != nil {
			t.Fatalf("pod %s/%s not gone: %v", ns, pod.Name, err)
		}
	}
	for uid, node := range claimUIDs {
		if !eventually(ctx, 10*time.Second, func() bool { return len(claimSpecFiles(t, node, uid)) == 0 }) {
			t.Errorf("claim %s: CDI spec files left on %s after its pods are gone: %v", uid, node, claimSpecFiles(t, node, uid))
		}
	}
}

func usesDevices(pod *v1.Pod, ctr v1.Container) bool {
	if len(ctr.Resources.Claims) > 0 {
		return true
	}
	for name := range ctr.Resources.Limits {
		if strings.Contains(string(name), "nvidia.com/") {
			return true
		}
	}
	return false
}

var capNode = regexp.MustCompile(`^/dev/nvidia-caps/nvidia-cap[0-9]+$`)

// checkMIGEdits: a MIG device needs its GPU- and compute-instance
// capability nodes.
func checkMIGEdits(t *testing.T, r harness.ResolvedDevice) {
	t.Helper()
	caps := 0
	for _, n := range r.DeviceNodes() {
		if capNode.MatchString(n.Path) {
			caps++
		}
	}
	if caps < 2 {
		t.Errorf("MIG CDI device %s: %d nvidia-caps nodes, want the gi and ci access nodes", r.ID, caps)
	}
}

func ids(rs []harness.ResolvedDevice) []string {
	var out []string
	for _, r := range rs {
		out = append(out, r.ID)
	}
	return out
}

// Every config in examples/invalid/ is refused at create by the webhook with
// each message its <name>.expected.txt lists (one per line); where the
// examples' README says a problem is only a warning at admission, the
// messages must come back as warnings instead.
func TestInvalidExamplesRefused(t *testing.T) {
	requireWebhook(t)
	root, err := harness.RepoPath("examples/invalid")
	if err != nil {
		t.Fatalf("no examples/invalid: %v", err)
	}
	files := yamlFiles(t, root)
	if len(files) == 0 {
		t.Fatalf("examples/invalid has no manifests")
	}
	ctx := context.Background()
	ns := newNamespace(ctx, t, "invalid")
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), filepath.Ext(f)), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			want := expectedMessages(t, f)
			objs, err := harness.ParseYAML(data)
			if err != nil {
				t.Fatal(err)
			}
			var refusals, warnings []string
			for _, o := range objs {
				if o.GetNamespace() != "" {
					o.SetNamespace(ns)
				}
				warns, err := cluster.CreateWithWarnings(ctx, o, ns)
				warnings = append(warnings, warns...)
				if err == nil {
					continue
				}
				if !strings.Contains(err.Error(), "admission webhook") {
					t.Errorf("%s %s refused, but not by the webhook: %v", o.GetKind(), o.GetName(), err)
				}
				refusals = append(refusals, err.Error())
			}
			got := strings.Join(refusals, "\n")
			if len(refusals) == 0 {
				got = strings.Join(warnings, "\n")
				t.Logf("admitted with warnings: %v", warnings)
			}
			if got == "" {
				t.Fatalf("%s: neither refused nor warned about", filepath.Base(f))
			}
			for _, w := range want {
				if !strings.Contains(got, w) {
					t.Errorf("response %q lacks expected message %q", got, w)
				}
			}
		})
	}
}

// expectedMessages reads <name>.expected.txt next to an invalid example:
// one expected message per line.
func expectedMessages(t *testing.T, yamlPath string) []string {
	t.Helper()
	data, err := os.ReadFile(strings.TrimSuffix(yamlPath, filepath.Ext(yamlPath)) + ".expected.txt")
	if err != nil {
		t.Fatalf("expected messages: %v", err)
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			out = append(out, line)
		}
	}
	return out
}
