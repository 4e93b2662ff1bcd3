package tests

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	"github.com/gpu-dra/e2e/harness"
)

// TestExamplesDeployed runs every scenario in examples/ again, with the node
// plugin as the chart deploys it: a real node whose plugin is the DaemonSet's
// pod that `helm install` created (kube-controller-manager's DaemonSet
// controller places it, the node's kubelet and containerd run it on the
// driver's image; see e2e/README.md), with the same checks inside every
// container as TestExamples. The suite's other
// nodes (plugins run as processes) are cordoned meanwhile, so the scheduler
// places every pod on the deployed node.
//
// Two driver layouts, as the chart supports them:
//   - driver installed on the host (`nvidiaDriverRoot: /`, the default):
//     an 8-GPU H100 node without MIG, every scenario that asks for no MIG
//     device. MIG
//     devices need the kernel's /proc/driver/nvidia capabilities, which a
//     host-layout plugin reads from its own procfs; here that is this
//     machine's kernel, which has none.
//   - containerized driver (`/run/nvidia/driver`, GPU Operator): an A100
//     node with MIG on four GPUs, every scenario; GPUs 0 and 1, emptied of
//     their instances, are offered as dynamic MIG
//     (`kubeletPlugin.partitioning.dynamicMigGpus`), as the dynamic-mig
//     scenario asks.
func TestExamplesDeployed(t *testing.T) {
	requirePlugins(t)
	requireChart(t)
	root, err := harness.RepoPath("examples")
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	cordon(t, nodeA100, nodeT4)
	// The DaemonSet as the suite installed it, back at the end.
	t.Cleanup(func() { applyPluginDaemonSet(t) })
	layouts := []struct {
		layout  harness.Layout
		node    string
		profile string
		mig     bool
		// dynamic is the example whose node this one also is: its GPUs are
		// emptied and offered as dynamic MIG.
		dynamic string
	}{
		{harness.LayoutHostDriver, "node-deployed-host", "dgx-h100", false, ""},
		{harness.LayoutContainerDriver, "node-deployed-operator", "dgx-a100-40gb", true, "dynamic-mig"},
	}
	for _, l := range layouts {
		t.Run(string(l.layout), func(t *testing.T) {
			var values []string
			var empty func(*harness.Node)
			if l.dynamic != "" {
				ex := exampleNodes[l.dynamic]
				if ex.profile != l.profile {
					t.Fatalf("%s needs a %s node, not %s", l.dynamic, ex.profile, l.profile)
				}
				// Escaped: --set reads a bare comma as the next value.
				values = append(values, "kubeletPlugin.partitioning.dynamicMigGpus="+harness.JoinInts(ex.emptyGPUs, `\,`))
				empty = func(n *harness.Node) {
					for _, g := range ex.emptyGPUs {
						destroyInstances(t, n, g)
					}
				}
			}
			deployedNode(t, l.node, l.layout, l.profile, empty, values...)
			ran := 0
			for _, d := range dirs {
				if !d.IsDir() || d.Name() == "invalid" {
					continue
				}
				files := yamlFiles(t, filepath.Join(root, d.Name()))
				if len(files) == 0 || (!l.mig && needsMIG(t, files)) {
					continue
				}
				if needsMemoryShares(t, files) {
					// These nodes offer no GPU as memory shares; TestExamples
					// runs the scenario on a node of its own.
					t.Logf("%s: skipped, needs a memory-share GPU", d.Name())
					continue
				}
				if _, ok := exampleNodes[d.Name()]; ok && d.Name() != l.dynamic {
					// Needs plugin flags (dynamic MIG GPUs) that this
					// node's chart values do not set; TestExamples runs it.
					continue
				}
				ran++
				t.Run(d.Name(), func(t *testing.T) { runExample(t, d.Name(), files) })
			}
			if ran == 0 {
				t.Fatalf("no examples in %s", root)
			}
		})
	}
}

// applyPluginDaemonSet sets the node-plugin DaemonSet's spec to the chart's,
// rendered
// with the given values (and the release's name and namespace), and the
// node-restriction policy's to the one rendered with them (it admits the MPS
// daemon pods of the driver root these values name).
func applyPluginDaemonSet(t *testing.T, set ...string) {
	t.Helper()
	ctx := context.Background()
	chart, err := harness.RepoPath(harness.ChartPath)
	if err != nil {
		t.Fatal(err)
	}
	render := func(template string) string {
		args := []string{"template", harness.HelmRelease, chart, "--namespace", harness.DriverNamespace,
			"--kube-version", harness.KubernetesVersion, "--show-only", template,
			// As the harness installs it: on the deployed nodes only.
			"--set", harness.DeployedPluginSelector}
		for _, s := range set {
			args = append(args, "--set", s)
		}
		out, err := cluster.Helm(ctx, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	policy, err := harness.ParseYAML([]byte(render("templates/kubelet-plugin-node-restriction.yaml")))
	if err != nil {
		t.Fatal(err)
	}
	policies := cluster.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies()
	for _, o := range policy {
		if o.GetKind() != "ValidatingAdmissionPolicy" {
			continue
		}
		var want admissionv1.ValidatingAdmissionPolicy
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &want); err != nil {
			t.Fatal(err)
		}
		live, err := policies.Get(ctx, want.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		live.Spec = want.Spec
		if _, err := policies.Update(ctx, live, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	out := render("templates/kubelet-plugin-daemonset.yaml")
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal([]byte(out), &ds); err != nil {
		t.Fatal(err)
	}
	// Replaced whole, as `helm upgrade` leaves it: a server-side apply would
	// keep list items (volume mounts) that the install's field manager owns.
	dss := cluster.Client.AppsV1().DaemonSets(harness.DriverNamespace)
	live, err := dss.Get(ctx, ds.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	live.Spec = ds.Spec
	if _, err := dss.Update(ctx, live, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// needsMIG says whether a scenario asks for MIG devices (their class, their
// config or a MIG profile).
func needsMIG(t *testing.T, files []string) bool {
	t.Helper()
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(data)
		if strings.Contains(text, "mig.nvidia.com") || strings.Contains(text, "MigDeviceConfig") || strings.Contains(text, ".profile ==") {
			return true
		}
	}
	return false
}

// cordon marks the named nodes unschedulable until the test ends.
func cordon(t *testing.T, names ...string) {
	t.Helper()
	ctx := context.Background()
	set := func(name string, on bool) error {
		return cluster.SetUnschedulable(ctx, name, on)
	}
	for _, name := range names {
		if err := set(name, true); err != nil {
			t.Fatalf("cordon %s: %v", name, err)
		}
		t.Cleanup(func() {
			if err := set(name, false); err != nil {
				t.Errorf("uncordon %s: %v", name, err)
			}
		})
	}
}

// deployedNode adds a node whose plugin is the chart's DaemonSet pod and
// waits until it registered and published; the test's end removes the node.
// prepare, when set, runs once the node's driver is set up and before the
// plugin starts (as an admin empties the GPUs to offer as dynamic MIG), and
// values are chart values besides the layout's.
func deployedNode(t *testing.T, name string, layout harness.Layout, profile string, prepare func(*harness.Node), values ...string) *harness.Node {
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
	if prepare != nil {
		prepare(n)
	}
	// One release serves every node and its values name the layout: the
	// plugin DaemonSet as the chart renders it with this layout's values,
	// applied once the node's driver is in place (a `helm upgrade` would also
	// reset the webhook registration that the suite points at its local
	// webhook).
	applyPluginDaemonSet(t, append(layout.HelmValues(), values...)...)
	// The DaemonSet already placed a pod on the node when it joined, before its driver was
	// set up: that pod found no driver, exited, and may wait out a long crash backoff on a
	// loaded machine. Deleted, the DaemonSet makes it again at once.
	for _, p := range n.DaemonPods() {
		if !strings.HasSuffix(p.DaemonSet, "-kubelet-plugin") {
			continue
		}
		zero := int64(0)
		err := cluster.Client.CoreV1().Pods(p.Pod.Namespace).Delete(ctx, p.Pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete plugin pod %s started before the node's driver: %v", p.Pod.Name, err)
		}
	}
	var plugin *harness.DaemonPod
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods := n.DaemonPods()
		if len(pods) == 0 {
			return false, nil
		}
		plugin = pods[0]
		if !n.DriverRegistered(harness.DefaultDriver) {
			return false, nil
		}
		slices, err := nodeSlices(ctx, name)
		return err == nil && len(slices) > 0, nil
	})
	if err != nil {
		log := ""
		if plugin != nil {
			log = plugin.Log()
		}
		t.Fatalf("the chart's plugin on %s did not register and publish: %v; pod error: %v; log:\n%s", name, err,
			n.DaemonPodError(harness.DriverNamespace+"/"+harness.HelmRelease+"-gpu-dra-driver-kubelet-plugin"), log)
	}
	if plugin.Pod.UID == types.UID("") {
		t.Fatalf("plugin pod on %s without UID", name)
	}
	return n
}
