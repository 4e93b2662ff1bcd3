package tests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-dra/e2e/harness"
)

// The real nodes other people's specs run on (harness/specs.go): both
// simulated DGX A100s with our plugin as a process, neither labelled nor
// tainted. specNodeStatic has the profile's static MIG instances on GPUs 0-3
// (1g.5gb, 1g.5gb, 2g.10gb, 3g.20gb each, the layout NVIDIA's quickstart
// asks for) and whole GPUs 4-7; specNodeDynamic offers GPUs 0 and 1 as
// dynamic MIG (emptied first, as an admin does), GPUs 2 and 3 with static
// instances and 4-7 whole. Together: 10 whole GPUs (GPU 0 and 1 of
// specNodeDynamic whole or partitioned), 6 GPUs of static MIG devices.
const (
	specNodeStatic  = "spec-a100"
	specNodeDynamic = "spec-a100-dyn"
)

// specDynamicGPUs are specNodeDynamic's dynamic MIG GPUs.
var specDynamicGPUs = []int{0, 1}

// addSpecNodes adds the spec nodes for the rest of the test and cordons the
// suite's pod-loop nodes meanwhile, so that pods of specs, which name no
// node, run on real nodes only.
func addSpecNodes(ctx context.Context, t *testing.T) {
	t.Helper()
	started := time.Now()
	defer func() { t.Logf("spec nodes up in %s", time.Since(started).Round(time.Millisecond)) }()
	for _, n := range cluster.Nodes() {
		if n.IsReal() {
			continue
		}
		setUnschedulable(ctx, t, n.Name, true)
		name := n.Name
		t.Cleanup(func() { setUnschedulable(context.Background(), t, name, false) })
	}
	addPluginNodeWith(ctx, t, harness.NodeOptions{Name: specNodeStatic, RealKubelet: true}, "dgx-a100-40gb", nil, nil)
	args := []string{"--dynamic-mig-gpus=" + harness.JoinInts(specDynamicGPUs, ",")}
	empty := func(n *harness.Node) {
		for _, gpu := range specDynamicGPUs {
			destroyInstances(t, n, gpu)
		}
	}
	addPluginNodeWith(ctx, t, harness.NodeOptions{Name: specNodeDynamic, RealKubelet: true}, "dgx-a100-40gb", args, empty)
}

// setUnschedulable cordons or uncordons a node, as kubectl cordon does.
func setUnschedulable(ctx context.Context, t *testing.T, node string, on bool) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%t}}`, on)
	if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Errorf("cordon %s (%t): %v", node, on, err)
	}
}

// TestSpecFolder runs every YAML file of the folder E2E_SPECS_DIR (`make
// e2e-specs DIR=<folder>`) through the spec runner on real nodes, one file
// at a time (each a subtest, in its own fresh namespace; a folder of demos
// together may want more GPUs than the nodes have), or the whole folder as
// one unit with E2E_SPECS_TOGETHER=1. What it checks is what holds for any
// spec (harness/specs.go); the files are not edited.
func TestSpecFolder(t *testing.T) {
	dir := os.Getenv("E2E_SPECS_DIR")
	if dir == "" {
		t.Skip("E2E_SPECS_DIR names no spec folder (make e2e-specs DIR=<folder>)")
	}
	requirePlugins(t)
	files, err := harness.SpecFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	addSpecNodes(ctx, t)
	checkRelease(ctx, t)
	units := make([][]harness.SpecFile, 0, len(files))
	if os.Getenv("E2E_SPECS_TOGETHER") == "1" {
		units = append(units, files)
	} else {
		for _, f := range files {
			units = append(units, []harness.SpecFile{f})
		}
	}
	var summary []string
	for _, unit := range units {
		name := filepath.Base(unit[0].Path)
		if len(unit) > 1 {
			name = filepath.Base(dir)
		}
		ok := t.Run(name, func(t *testing.T) {
			runSpecUnit(ctx, t, unit, harness.SpecOptions{NamespacePrefix: strings.TrimSuffix(name, filepath.Ext(name))}, nil)
		})
		verdict := "pass"
		if !ok {
			verdict = "FAIL"
		}
		summary = append(summary, verdict+" "+name)
	}
	t.Logf("spec folder %s:\n%s", dir, strings.Join(summary, "\n"))
}

// checkRelease says which Kubernetes release the specs run on and, for a
// release run from its own binaries (`make e2e-1.34`), that the API server
// and the real nodes' kubelets (spec nodes and the suite's) are that release
// and not the harness's.
func checkRelease(ctx context.Context, t *testing.T) {
	t.Helper()
	release, err := cluster.Release(ctx)
	if err != nil {
		t.Fatalf("API server version: %v", err)
	}
	var kubelets []string
	for _, n := range cluster.Nodes() {
		if !n.IsReal() {
			continue
		}
		name := n.Name
		node, err := cluster.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		v := node.Status.NodeInfo.KubeletVersion
		kubelets = append(kubelets, name+" "+v)
		if v != release {
			t.Errorf("node %s runs kubelet %s, the control plane %s", name, v, release)
		}
	}
	t.Logf("Kubernetes %s (control plane), kubelets: %s", release, strings.Join(kubelets, ", "))
	if dir := cluster.ReleaseDir(); dir != "" {
		if want := harness.ModuleKubernetesVersion(); release == want {
			t.Errorf("the control plane reports %s, the harness's own release, though %s runs the release of %s", release, harness.ReleaseDirEnv, dir)
		}
	}
}

// runSpecUnit applies one spec unit through the runner (opts: its
// namespace prefix and grace period; E2E_SPECS_TIMEOUT sets the timeout),
// reports each
// problem, calls during (if any) with the run while its pods run, then
// deletes everything and reports what deletion left behind.
func runSpecUnit(ctx context.Context, t *testing.T, files []harness.SpecFile, opts harness.SpecOptions, during func(*harness.SpecRun)) {
	t.Helper()
	started := time.Now()
	opts.Logf = t.Logf
	if v := os.Getenv("E2E_SPECS_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("E2E_SPECS_TIMEOUT=%q: %v (a Go duration such as 90s or 5m)", v, err)
		}
		opts.Timeout = d
	}
	run, err := cluster.RunSpec(ctx, files, opts)
	defer func() {
		problems := len(run.Problems)
		run.Teardown(ctx)
		for _, p := range run.Problems[problems:] {
			t.Errorf("after deletion: %s", p)
		}
		t.Logf("ran and deleted in %s", time.Since(started).Round(time.Millisecond))
	}()
	if err != nil {
		t.Errorf("%v", err)
		return
	}
	for _, p := range run.Problems {
		t.Errorf("%s", p)
	}
	t.Logf("%d pods ran in %s", len(run.Pods), time.Since(started).Round(time.Millisecond))
	if during != nil && len(run.Problems) == 0 {
		during(run)
	}
}

// execIn runs a command in a pod's container: through the API server's
// pods/exec on a real node (as kubectl exec), with runc on a pod-loop node.
func execIn(ctx context.Context, pod *v1.Pod, ctr string, args ...string) (harness.ExecResult, error) {
	n := cluster.Node(pod.Spec.NodeName)
	if n == nil {
		return harness.ExecResult{}, fmt.Errorf("pod %s/%s on unknown node %q", pod.Namespace, pod.Name, pod.Spec.NodeName)
	}
	if n.IsReal() {
		return cluster.ExecInContainer(ctx, pod, ctr, 30*time.Second, args...)
	}
	return n.Exec(ctx, pod, ctr, args...)
}

// containerLogs is what a container has written so far: the API server's
// pods/log on a real node (served by its kubelet), the runtime's log file
// on a pod-loop node.
func containerLogs(ctx context.Context, pod *v1.Pod, ctr string) (string, error) {
	n := cluster.Node(pod.Spec.NodeName)
	if n == nil {
		return "", fmt.Errorf("pod %s/%s on unknown node %q", pod.Namespace, pod.Name, pod.Spec.NodeName)
	}
	if n.IsReal() {
		raw, err := cluster.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &v1.PodLogOptions{Container: ctr}).DoRaw(ctx)
		return string(raw), err
	}
	return n.ContainerLogs(pod, ctr)
}
