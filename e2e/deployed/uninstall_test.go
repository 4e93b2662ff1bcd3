package deployed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// pluginDir is the node plugin's folder on the host (the chart's default).
const pluginDir = "/var/lib/kubelet/plugins/gpu.nvidia.com"

// TestUninstallRestoresNode: on each driver layout (containerized, and
// installed on the host; both with the host's own glibc beside the driver's
// libraries), install on two nodes, run the MPS example on one and the
// time-slicing example on the other, then `helm uninstall` while they still
// run. The chart's pre-delete hook
// Job (our binary, on the driver's image) stops the node plugins and runs
// `gpu-kubelet-plugin cleanup` on both nodes. Afterwards the simulated GPUs
// are back to compute mode DEFAULT and the default time-slice, and no CDI
// spec, plugin file, socket, mount or process of ours is left on the nodes.
func TestUninstallRestoresNode(t *testing.T) {
	for _, layout := range []harness.Layout{harness.LayoutContainerDriver, harness.LayoutHostDriver} {
		t.Run(string(layout), func(t *testing.T) { uninstallRestoresNode(t, layout) })
	}
}

func uninstallRestoresNode(t *testing.T, layout harness.Layout) {
	ctx := context.Background()
	mpsNode := addNode(t, "node-uninstall-mps-"+string(layout), layout, "t4")
	tsNode := addNode(t, "node-uninstall-ts-"+string(layout), layout, "t4")
	install(t, layout.HelmValues()...)
	mpsPlugin := waitPlugin(ctx, t, mpsNode, "")
	tsPlugin := waitPlugin(ctx, t, tsNode, "")

	workloads := runExample(ctx, t, "examples/mps/mps.yaml", mpsNode, string(layout))
	workloads = append(workloads, runExample(ctx, t, "examples/time-slicing-shared/shared.yaml", tsNode, string(layout))...)
	for _, p := range workloads {
		if _, err := cluster.WaitPodRunning(ctx, p.Namespace, p.Name, 90*time.Second); err != nil {
			t.Fatalf("%v\nplugin logs:\n%s\n%s", err, mpsPlugin.Log(), tsPlugin.Log())
		}
	}

	// What the uninstall has to undo is there (so the checks below can fail).
	if mode, slice := gpuSettings(t, mpsNode); mode != "EXCLUSIVE_PROCESS" {
		t.Fatalf("%s: MPS pod running but GPU 0 in compute mode %q (time-slice %d)", mpsNode.Name, mode, slice)
	}
	if mode, slice := gpuSettings(t, tsNode); slice != 3 {
		t.Fatalf("%s: time-sliced pods (interval Long) running but GPU 0 has time-slice %d (mode %q)", tsNode.Name, slice, mode)
	}
	for _, n := range []*harness.Node{mpsNode, tsNode} {
		if left := ourFiles(n); len(left) == 0 {
			t.Fatalf("%s: no CDI spec or plugin file before the uninstall", n.Name)
		}
	}
	procs := map[*harness.Node]nodeProcesses{mpsNode: newNodeProcesses(t, mpsNode), tsNode: newNodeProcesses(t, tsNode)}
	// The claim's MPS control daemon runs in a pod of its own (the chart's
	// default), seen here as that pod's container.
	if procs := procs[mpsNode].list(workloads); !containsProcess(procs, "nvidia-cuda-mps-control") && !containsDaemonContainer(procs) {
		t.Fatalf("%s: no MPS control daemon running before the uninstall: %v", mpsNode.Name, procs)
	}

	started := time.Now()
	if err := cluster.HelmUninstall(ctx); err != nil {
		t.Fatalf("%v\ncleanup logs:\n%s", err, cleanupLogs(mpsNode, tsNode))
	}
	t.Logf("helm uninstall with the cleanup hook took %s", time.Since(started).Round(time.Millisecond))
	if testing.Verbose() {
		t.Logf("logs of the driver's pods:\n%s", cleanupLogs(mpsNode, tsNode))
	}

	// The chart's other pods (the webhook Deployment's) go after the
	// uninstall: the garbage collector deletes them once their owners are
	// gone, and their kubelet stops them. Pods of an earlier subtest's
	// removed nodes are not this test's.
	ours := func(p v1.Pod) bool {
		return p.Spec.NodeName == "" || p.Spec.NodeName == mpsNode.Name || p.Spec.NodeName == tsNode.Name
	}
	var left []string
	if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(harness.DriverNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		left = nil
		for _, p := range pods.Items {
			if ours(p) {
				left = append(left, fmt.Sprintf("%s (%s)", p.Name, p.Status.Phase))
			}
		}
		return len(left) == 0, nil
	}); err != nil {
		t.Errorf("after uninstall: pods left in %s: %v", harness.DriverNamespace, left)
	}
	for _, n := range []*harness.Node{mpsNode, tsNode} {
		// The hook ran our cleanup on the node, on the driver's image: the
		// node's kubelet started a cleanup pod (its events stay in the API;
		// its logs go with the pod, which the hook deletes on success).
		if !cleanupStartedOn(ctx, t, n) {
			t.Errorf("%s: no cleanup pod ran `gpu-kubelet-plugin cleanup` here; logs of the driver's pods:\n%s", n.Name, cleanupLogs(mpsNode, tsNode))
		}
		if mode, slice := gpuSettings(t, n); mode != "DEFAULT" || slice != 0 {
			t.Errorf("%s after uninstall: GPU 0 in compute mode %q with time-slice %d, want DEFAULT and 0 (default)", n.Name, mode, slice)
		}
		if left := ourFiles(n); len(left) > 0 {
			t.Errorf("%s after uninstall: files of ours left: %v", n.Name, left)
		}
		if m := ourMounts(n); len(m) > 0 {
			t.Errorf("%s after uninstall: mounts left in the plugin folder: %v", n.Name, m)
		}
		if procs := procs[n].list(workloads); len(procs) > 0 {
			t.Errorf("%s after uninstall: processes of ours left: %v", n.Name, procs)
		}
		if d := n.DaemonPods(); len(d) > 0 {
			t.Errorf("%s after uninstall: %d plugin pods left", n.Name, len(d))
		}
	}
	if left, err := installedObjects(ctx); err != nil || len(left) > 0 {
		t.Errorf("after uninstall: %v left (%v)", left, err)
	}
	// The hook's Job and cleanup pods are gone too (hook-succeeded, deleted
	// on success): no pod of these nodes is left (above).
	jobs, err := cluster.Client.BatchV1().Jobs(harness.DriverNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range jobs.Items {
		t.Errorf("after uninstall: Job %s left", j.Name)
	}
	// The workloads were not touched: only the driver's state went.
	for _, p := range workloads {
		got, err := cluster.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			t.Errorf("workload %s/%s after uninstall: %v", p.Namespace, p.Name, err)
			continue
		}
		for _, c := range got.Status.ContainerStatuses {
			if c.State.Running == nil || c.RestartCount != 0 {
				t.Errorf("workload %s/%s container %s after uninstall: %+v, %d restarts", p.Namespace, p.Name, c.Name, c.State, c.RestartCount)
			}
		}
	}
}

// runExample creates the claims of an example manifest and its pods (a
// workload's pods as its controller would), pinned to node, in the example's
// namespaces suffixed with "-"+suffix (each run its own), and removes the
// pods at the test's end (forced: no plugin is left to unprepare them).
func runExample(ctx context.Context, t *testing.T, file string, node *harness.Node, suffix string) []*v1.Pod {
	t.Helper()
	path, err := harness.RepoPath(file)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := harness.ParseYAML(data)
	if err != nil {
		t.Fatal(err)
	}
	var pods []*unstructured.Unstructured
	for _, o := range objs {
		if ns := o.GetNamespace(); ns != "" {
			o.SetNamespace(ns + "-" + suffix)
		}
		if err := cluster.CreateNamespace(ctx, o.GetNamespace()); err != nil {
			t.Fatal(err)
		}
		switch {
		case o.GetKind() == "Pod":
			pods = append(pods, o)
		case harness.WorkloadKinds[o.GetKind()]:
			expanded, err := harness.PodsFromWorkload(o)
			if err != nil {
				t.Fatal(err)
			}
			pods = append(pods, expanded...)
		default:
			if _, err := cluster.Create(ctx, o, o.GetNamespace()); err != nil {
				t.Fatalf("%s: create %s %s: %v", file, o.GetKind(), o.GetName(), err)
			}
		}
	}
	var out []*v1.Pod
	for _, o := range pods {
		if err := unstructured.SetNestedStringMap(o.Object, map[string]string{"kubernetes.io/hostname": node.Name}, "spec", "nodeSelector"); err != nil {
			t.Fatal(err)
		}
		created, err := cluster.Create(ctx, o, o.GetNamespace())
		if err != nil {
			t.Fatalf("%s: create pod %s: %v", file, o.GetName(), err)
		}
		pod := &v1.Pod{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(created.Object, pod); err != nil {
			t.Fatal(err)
		}
		out = append(out, pod)
		t.Cleanup(func() {
			_ = cluster.Client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		})
	}
	return out
}

// gpuSettings are GPU 0's compute mode and time-slice value in the node's
// simulator state (what the simulated kernel driver holds).
func gpuSettings(t *testing.T, n *harness.Node) (string, int) {
	t.Helper()
	state, err := n.SimState()
	if err != nil {
		t.Fatalf("%s: simulator state: %v", n.Name, err)
	}
	gpus, _ := state["gpus"].([]any)
	if len(gpus) == 0 {
		t.Fatalf("%s: simulator state without GPUs: %s", n.Name, n.SimStateRaw())
	}
	gpu, _ := gpus[0].(map[string]any)
	mode, _ := gpu["computeMode"].(string)
	slice, ok := gpu["timeslice"].(float64)
	if mode == "" || !ok {
		t.Fatalf("%s: simulator state without computeMode/timeslice: %s", n.Name, n.SimStateRaw())
	}
	return mode, int(slice)
}

// ourFiles are the driver's files on the node: our claim specs (and their
// temp files) in the CDI root, anything in the plugin folder, our
// registration socket.
func ourFiles(n *harness.Node) []string {
	var out []string
	entries, _ := os.ReadDir(n.CDIRoot)
	for _, e := range entries {
		if strings.Contains(e.Name(), "k8s.gpu.nvidia.com-claim_") {
			out = append(out, filepath.Join(n.CDIRoot, e.Name()))
		}
	}
	dir := n.HostPath(pluginDir)
	_ = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err == nil && p != dir {
			out = append(out, p)
		}
		return nil
	})
	if _, err := os.Lstat(filepath.Join(n.RegistrarDir, harness.DefaultDriver+"-reg.sock")); err == nil {
		out = append(out, filepath.Join(n.RegistrarDir, harness.DefaultDriver+"-reg.sock"))
	}
	return out
}

// ourMounts are the mount points in the plugin folder, at its host path or
// in the node's tree, of the node's mount namespace (where its kubelet and
// containerd, and so every mount made for the driver's pods, live).
func ourMounts(n *harness.Node) []string {
	var out []string
	for _, p := range n.NamespaceMounts() {
		for _, dir := range []string{pluginDir, n.HostPath(pluginDir)} {
			if p == dir || strings.HasPrefix(p, dir+"/") {
				out = append(out, p)
			}
		}
	}
	return out
}

// nodeProcesses finds the processes of our driver on a node: those that see
// the node's plugin folder (identified by device and inode, taken while it
// exists) at its host path, i.e. the plugin, hook and cleanup containers and
// everything they started (MPS control daemons among them), and those
// running the node's simulated driver tools from the host. Workload
// containers do not mount the plugin folder; the node's own kubelet,
// containerd and shims (its mount namespace) see it as the host does and
// are not ours.
type nodeProcesses struct {
	n        *harness.Node
	dev, ino uint64
}

func newNodeProcesses(t *testing.T, n *harness.Node) nodeProcesses {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(n.HostPath(pluginDir), &st); err != nil {
		t.Fatalf("%s: plugin folder: %v", n.Name, err)
	}
	return nodeProcesses{n: n, dev: uint64(st.Dev), ino: st.Ino}
}

// list returns "pid argv0" for each process of ours, and the runc
// containers of the node that are not the workloads'.
func (np nodeProcesses) list(workloads []*v1.Pod) []string {
	var out []string
	seen := map[int]bool{}
	add := func(pid int) {
		if seen[pid] {
			return
		}
		seen[pid] = true
		cmd, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		out = append(out, fmt.Sprintf("%d %s", pid, strings.SplitN(string(cmd), "\x00", 2)[0]))
	}
	for _, p := range harness.Processes(np.n.SimRoot()) {
		add(p.Pid)
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if ns, _ := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "mnt")); ns == np.n.MountNamespace() {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join("/proc", e.Name(), "root")+pluginDir, &st) == nil &&
			uint64(st.Dev) == np.dev && st.Ino == np.ino {
			add(pid)
		}
	}
	workloadPods := map[string]bool{}
	for _, p := range workloads {
		workloadPods[string(p.UID)] = true
	}
	ctrs, err := np.n.CRIContainers(context.Background())
	if err != nil {
		out = append(out, "CRI ListContainers: "+err.Error())
	}
	for _, c := range ctrs {
		if c.Running && !workloadPods[c.PodUID] {
			out = append(out, fmt.Sprintf("container %s/%s/%s", c.PodNamespace, c.PodName, c.Name))
		}
	}
	return out
}

func containsProcess(procs []string, name string) bool {
	for _, p := range procs {
		if _, argv0, ok := strings.Cut(p, " "); ok && filepath.Base(argv0) == name {
			return true
		}
	}
	return false
}

// containsDaemonContainer says whether the list holds the container of an MPS
// control daemon pod.
func containsDaemonContainer(procs []string) bool {
	for _, p := range procs {
		if strings.HasPrefix(p, "container "+harness.DriverNamespace+"/mps-") {
			return true
		}
	}
	return false
}

// cleanupStartedOn says whether the node's kubelet started a container of
// the uninstall hook's cleanup pods (a Started event from that node).
func cleanupStartedOn(ctx context.Context, t *testing.T, n *harness.Node) bool {
	t.Helper()
	events, err := cluster.Client.CoreV1().Events(harness.DriverNamespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Pod,reason=Started",
	})
	if err != nil {
		t.Fatal(err)
	}
	prefix := harness.HelmRelease + "-gpu-dra-driver-kubelet-plugin-cleanup-"
	for _, e := range events.Items {
		if strings.HasPrefix(e.InvolvedObject.Name, prefix) && e.Source.Host == n.Name {
			return true
		}
	}
	return false
}

// cleanupLogs are the logs of the hook's pods (uninstall Job and cleanup
// pods) the nodes ran, for a failed uninstall.
func cleanupLogs(nodes ...*harness.Node) string {
	var b strings.Builder
	for _, n := range nodes {
		// The kubelet's pod logs: <ns>_<pod>_<uid>/<container>/<restart>.log.
		files, _ := filepath.Glob(filepath.Join(n.Dir, "pod-logs", harness.DriverNamespace+"_*", "*", "*.log"))
		for _, f := range files {
			data, _ := os.ReadFile(f)
			fmt.Fprintf(&b, "--- %s %s\n%s\n", n.Name, strings.TrimPrefix(f, n.Dir+"/"), data)
		}
	}
	return b.String()
}
