package harness

// Tests of reaper.go: a cluster runs in a child process (this test binary
// again, recognised by clusterChildArg in an init), the test ends that
// process as a crash or a user would, and then checks that nothing of the
// cluster is left on this machine.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// clusterChildArg, as the first argument, makes this test binary run
// runClusterChild instead of the tests.
const clusterChildArg = "e2e-harness-cluster-child"

func init() {
	if len(os.Args) == 4 && os.Args[1] == clusterChildArg {
		os.Exit(runClusterChild(os.Args[2], os.Args[3]))
	}
}

// childStatus is what the child reports once its cluster runs.
type childStatus struct {
	Dir string `json:"dir"`
	// Pids are the processes of the cluster, by what they are.
	Pids map[string][]int `json:"pids"`
	// Reaper is the cluster's reaper process.
	Reaper int `json:"reaper"`
	// Bridges and Cgroups are the real node's.
	Bridges []string `json:"bridges"`
	Cgroups []string `json:"cgroups"`
	// Mounts are those under Dir.
	Mounts []string `json:"mounts"`
}

// Child modes: what the child's cluster runs.
const (
	// childRealAndLoop: a real node (kubelet, containerd) running a pod with
	// a GPU claim, and a pod-loop node running a container; both with our
	// plugin, and the webhook.
	childRealAndLoop = "real-and-loop"
	// childLoop: a pod-loop node with our plugin running a container.
	childLoop = "loop"
)

// runClusterChild starts a cluster as mode says, writes its childStatus to
// statusPath (once it runs) and stops the cluster when InterruptContext
// says; it writes "stopping" to <statusPath>.stopping on the first signal.
func runClusterChild(statusPath, mode string) int {
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "child: "+format+"\n", args...) }
	ctx, stop := InterruptContext(context.Background(), func(format string, args ...any) {
		logf(format, args...)
		_ = os.WriteFile(statusPath+".stopping", []byte("stopping"), 0o644)
	})
	defer stop()
	c, err := Start(ctx, Options{Logf: logf})
	if err != nil {
		logf("start: %v", err)
		return 1
	}
	defer c.Stop()
	if err := runChildWorkloads(ctx, c, statusPath, mode); err != nil {
		logf("%v", err)
		return 1
	}
	<-ctx.Done()
	return 0
}

func runChildWorkloads(ctx context.Context, c *Cluster, statusPath, mode string) error {
	_, webhookErr := Binary("gpu-dra-webhook")
	drv, err := c.InstallDriver(ctx, InstallOptions{Webhook: webhookErr == nil})
	if err != nil {
		return err
	}
	st := childStatus{Dir: c.Dir, Pids: map[string][]int{}, Reaper: c.reaper.cmd.Process.Pid}
	if drv.Webhook != nil {
		st.Pids["webhook"] = []int{drv.Webhook.cmd.Process.Pid}
	}
	type workload struct {
		node  NodeOptions
		claim bool
	}
	loads := []workload{{node: NodeOptions{Name: "loop-t4"}}}
	if mode == childRealAndLoop {
		loads = append([]workload{{node: NodeOptions{Name: "real-t4", RealKubelet: true}, claim: true}}, loads...)
	}
	for _, w := range loads {
		n, err := c.AddNode(ctx, w.node)
		if err != nil {
			return err
		}
		if _, err := n.StartPlugin(ctx, PluginOptions{Profile: "t4"}); err != nil {
			return err
		}
		err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(context.Context) (bool, error) {
			return n.DriverRegistered(DefaultDriver), nil
		})
		if err != nil {
			return fmt.Errorf("plugin on %s not registered: %w; log:\n%s", n.Name, err, n.Plugin.Log())
		}
		pod := &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "on-" + n.Name, Namespace: "default"},
			Spec: v1.PodSpec{
				NodeSelector:                  map[string]string{"kubernetes.io/hostname": n.Name},
				TerminationGracePeriodSeconds: new(int64(1)),
				Containers: []v1.Container{{
					Name: "ctr", Image: TestImageName, Command: []string{"sleep", "2147483647"},
				}},
			},
		}
		if w.claim {
			claim := &resourceapi.ResourceClaim{
				ObjectMeta: metav1.ObjectMeta{Name: "gpu-" + n.Name, Namespace: "default"},
				Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
					Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
						DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
					}}},
				}},
			}
			if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, claim, metav1.CreateOptions{}); err != nil {
				return err
			}
			pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim.Name}}
			pod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu"}}
		}
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return err
		}
		if _, err := c.WaitPodRunning(ctx, "default", pod.Name, 3*time.Minute); err != nil {
			return err
		}
		st.Pids["plugin "+n.Name] = []int{n.Plugin.Pid()}
		if r := n.real; r != nil {
			st.Pids["kubelet "+n.Name] = []int{r.kubelet.cmd.Process.Pid}
			st.Pids["containerd "+n.Name] = []int{r.containerd.cmd.Process.Pid}
			// Shims and the containers they run (pause and the pod's).
			st.Pids["shims and containers "+n.Name] = r.strayProcesses()
			st.Bridges = append(st.Bridges, r.bridge)
			if hs, err := cgroupHierarchies(); err == nil {
				for _, h := range hs {
					st.Cgroups = append(st.Cgroups, filepath.Join(h, r.cgroupRoot))
				}
			}
		} else {
			st.Pids["runc and container "+n.Name] = append(runcProcesses(n), ContainerProcesses(n.Dir)...)
		}
	}
	st.Mounts = mountsUnder(realPath(c.Dir))
	data, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if err := os.WriteFile(statusPath+".tmp", data, 0o644); err != nil {
		return err
	}
	return os.Rename(statusPath+".tmp", statusPath)
}

// runcProcesses are the `runc run` processes of a pod-loop node.
func runcProcesses(n *Node) []int {
	n.runtime.mu.Lock()
	defer n.runtime.mu.Unlock()
	var out []int
	for _, ctrs := range n.runtime.pods {
		for _, c := range ctrs {
			c.mu.Lock()
			if c.cmd != nil && c.cmd.Process != nil {
				out = append(out, c.cmd.Process.Pid)
			}
			c.mu.Unlock()
		}
	}
	return out
}

// requireNodeTools fails the test unless what real and pod-loop nodes run
// is here (and this runs as root, as containers need).
func requireNodeTools(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("runs containers and real nodes: run as root")
	}
	if _, err := findNodeTools(""); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"gpu-kubelet-plugin", "gpu-sim"} {
		if _, err := Binary(b); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := TestImage(); err != nil {
		t.Fatal(err)
	}
}

// clusterChild is a child process running a cluster.
type clusterChild struct {
	cmd    *exec.Cmd
	status string
	log    string
	exited chan struct{}
	st     childStatus
}

// startClusterChild starts the child and waits until its cluster runs.
func startClusterChild(t *testing.T, mode string) *clusterChild {
	t.Helper()
	dir := t.TempDir()
	ch := &clusterChild{status: filepath.Join(dir, "status.json"), log: filepath.Join(dir, "child.log"), exited: make(chan struct{})}
	log, err := os.Create(ch.log)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	ch.cmd = exec.Command(os.Args[0], clusterChildArg, ch.status, mode)
	ch.cmd.Stdout, ch.cmd.Stderr = log, log
	if err := ch.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = ch.cmd.Wait(); close(ch.exited) }()
	t.Cleanup(func() {
		// Whatever the test did: the child goes, and its reaper with it.
		_ = ch.cmd.Process.Kill()
		<-ch.exited
	})
	started := time.Now()
	for !isFile(ch.status) {
		select {
		case <-ch.exited:
			t.Fatalf("cluster child exited (%v) before its cluster ran; log:\n%s", ch.cmd.ProcessState, ch.logText())
		case <-time.After(200 * time.Millisecond):
		}
		if time.Since(started) > 8*time.Minute {
			t.Fatalf("cluster child not running after %s; log:\n%s", time.Since(started), ch.logText())
		}
	}
	data, err := os.ReadFile(ch.status)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &ch.st); err != nil {
		t.Fatal(err)
	}
	t.Logf("cluster child running after %s: %s", time.Since(started).Round(time.Millisecond), data)
	return ch
}

func (ch *clusterChild) logText() string {
	b, _ := os.ReadFile(ch.log)
	return string(b)
}

// signal sends sig to the child.
func (ch *clusterChild) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := ch.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %s: %v", sig, err)
	}
}

// waitExit waits until the child exited and returns its exit status.
func (ch *clusterChild) waitExit(t *testing.T, within time.Duration) int {
	t.Helper()
	select {
	case <-ch.exited:
		return ch.cmd.ProcessState.ExitCode()
	case <-time.After(within):
		t.Fatalf("cluster child still running %s after the signal; log:\n%s", within, ch.logText())
		return 0
	}
}

// left is what remains of the child's cluster: Leftovers, and whatever of
// what the child reported (processes, the real node's bridge and cgroups,
// mounts) is still there, checked on its own terms.
func (ch *clusterChild) left() []string {
	left := Leftovers(ch.st.Dir)
	for what, pids := range ch.st.Pids {
		for _, pid := range pids {
			if !isZombie(pid) {
				left = append(left, fmt.Sprintf("%s (pid %d) running", what, pid))
			}
		}
	}
	for _, b := range ch.st.Bridges {
		if _, err := net.InterfaceByName(b); err == nil {
			left = append(left, "network link "+b)
		}
	}
	for _, d := range ch.st.Cgroups {
		if isDir(d) {
			left = append(left, "cgroup "+d)
		}
	}
	for _, m := range ch.st.Mounts {
		if mounted(m) {
			left = append(left, "mount "+m)
		}
	}
	if isDir(ch.st.Dir) {
		left = append(left, "folder "+ch.st.Dir)
	}
	return left
}

// mounted says whether p is a mount point now.
func mounted(p string) bool {
	data, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && unescapeMountPath(f[4]) == p {
			return true
		}
	}
	return false
}

// checkNothingLeft waits (up to bound) until nothing of the child's cluster
// is left, and says how long that took after the child's end.
func (ch *clusterChild) checkNothingLeft(t *testing.T, ended time.Time, bound time.Duration) {
	t.Helper()
	var left []string
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, bound, true, func(context.Context) (bool, error) {
		left = ch.left()
		return len(left) == 0, nil
	})
	if err != nil {
		t.Fatalf("%s after the cluster's process ended, still left:\n  %s\nchild log:\n%s", bound, strings.Join(left, "\n  "), ch.logText())
	}
	t.Logf("nothing left %s after the cluster's process ended", time.Since(ended).Round(time.Millisecond))
}

// TestKilledClusterLeavesNothing: a cluster with a real node running a
// claim pod (kubelet, containerd, shims, containers, overlay and netns
// mounts, a bridge, the node's cgroups) and a pod-loop node running a
// container (runc), each with our plugin, and the webhook, runs in a child
// process; that process is killed with SIGKILL, or interrupted twice (the
// second Ctrl-C of `make demo` during its graceful stop, which exits at
// once); then, within a bound, nothing of the cluster is left: no process,
// mount, cgroup, bridge, link, record or folder.
func TestKilledClusterLeavesNothing(t *testing.T) {
	requireNodeTools(t)
	const bound = 60 * time.Second
	t.Run("SIGKILL", func(t *testing.T) {
		ch := startClusterChild(t, childRealAndLoop)
		if left := ch.left(); len(left) == 0 {
			t.Fatal("a running cluster shows nothing of its own: the check could not fail")
		}
		ch.signal(t, syscall.SIGKILL)
		ch.waitExit(t, 30*time.Second)
		ch.checkNothingLeft(t, time.Now(), bound)
		// Its last words, after the sweep.
		err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			return strings.Contains(ch.logText(), "its reaper removed"), nil
		})
		if err != nil {
			t.Errorf("the reaper did not report its sweep; child log:\n%s", ch.logText())
		}
	})
	t.Run("SIGINT twice", func(t *testing.T) {
		ch := startClusterChild(t, childRealAndLoop)
		ch.signal(t, syscall.SIGINT)
		// The second interrupt lands while the graceful stop runs.
		err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return isFile(ch.status + ".stopping"), nil
		})
		if err != nil {
			t.Fatalf("child did not start stopping after SIGINT; log:\n%s", ch.logText())
		}
		ch.signal(t, syscall.SIGINT)
		if code := ch.waitExit(t, 30*time.Second); code != 130 {
			t.Fatalf("child exited with %d after the second SIGINT, want 130 (at once); log:\n%s", code, ch.logText())
		}
		ch.checkNothingLeft(t, time.Now(), bound)
	})
}

// TestNextStartSweepsADeadCluster: when the reaper died too (SIGKILLed
// before the harness), the cluster's processes, cgroups and folder stay;
// the next cluster start on the machine removes them.
func TestNextStartSweepsADeadCluster(t *testing.T) {
	requireNodeTools(t)
	ch := startClusterChild(t, childLoop)
	if err := syscall.Kill(ch.st.Reaper, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return isZombie(ch.st.Reaper), nil
	}); err != nil {
		t.Fatalf("reaper %d still running after SIGKILL", ch.st.Reaper)
	}
	ch.signal(t, syscall.SIGKILL)
	ch.waitExit(t, 30*time.Second)
	time.Sleep(2 * time.Second)
	if left := ch.left(); len(left) == 0 {
		t.Fatal("nothing left of a cluster whose harness and reaper were killed: the next start has nothing to prove")
	} else {
		t.Logf("left by the dead cluster: %s", strings.Join(left, "; "))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var logs []string
	started := time.Now()
	c, err := Start(ctx, Options{Logf: func(format string, args ...any) { logs = append(logs, fmt.Sprintf(format, args...)) }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if left := ch.left(); len(left) > 0 {
		t.Fatalf("after the next cluster started (%s), still left:\n  %s\nits log:\n  %s",
			time.Since(started).Round(time.Millisecond), strings.Join(left, "\n  "), strings.Join(logs, "\n  "))
	}
	if !strings.Contains(strings.Join(logs, "\n"), "removed what a dead cluster (harness pid "+strconv.Itoa(ch.cmd.Process.Pid)) {
		t.Errorf("the next start did not report the dead cluster's sweep; its log:\n  %s", strings.Join(logs, "\n  "))
	}
}

// TestSweepRefusesWhatIsNotACluster: a record whose folder is not absolute
// or is "/" or the temporary folder, or whose cgroups or bridges are not named after its folder,
// sweeps nothing (a damaged record must not unmount or kill this machine's
// processes).
func TestSweepRefusesWhatIsNotACluster(t *testing.T) {
	dir := "/var/e2e-x"
	good := clusterRecord{Dir: dir, BridgePrefix: bridgePrefix(dir)}
	if !good.valid() {
		t.Fatalf("a record with the cluster's own names is refused: %+v", good)
	}
	for name, rec := range map[string]clusterRecord{
		"root folder":      {Dir: "/", BridgePrefix: bridgePrefix("/")},
		"empty folder":     {Dir: "", BridgePrefix: bridgePrefix("")},
		"relative folder":  {Dir: "x", BridgePrefix: bridgePrefix("x")},
		"temporary folder": {Dir: os.TempDir(), BridgePrefix: bridgePrefix(os.TempDir())},
		"other bridges":    {Dir: dir, BridgePrefix: "e2e"},
		"other cgroup":     {Dir: dir, BridgePrefix: bridgePrefix(dir), Cgroups: []string{"/sys/fs/cgroup/pids/user.slice"}},
		"not a cgroup":     {Dir: dir, BridgePrefix: bridgePrefix(dir), Cgroups: []string{filepath.Join(os.TempDir(), clusterCgroupName(dir))}},
	} {
		if rec.valid() {
			t.Errorf("%s: record %+v accepted", name, rec)
		}
		rep := rec.sweep()
		if rep.processes+rep.mounts+rep.cgroups+rep.bridges+rep.files != 0 || len(rep.left) != 1 {
			t.Errorf("%s: sweep of %+v did %s, left %v; want nothing done and the refusal reported", name, rec, rep, rep.left)
		}
	}
}

// TestCgroupOf: a task's cgroup line names the folder under the hierarchy's
// mount (v1 by its controllers in any order, v2 by "0::"), also where the
// mount shows only a part of the hierarchy.
func TestCgroupOf(t *testing.T) {
	procCgroup := "12:cpu,cpuacct:/a/b\n4:memory:/limits/x\n1:name=systemd:/s\n0::/u"
	for _, tc := range []struct {
		m    cgroupMount
		want string
	}{
		{cgroupMount{dir: "/cg/cpu,cpuacct", root: "/", controllers: []string{"cpuacct", "cpu"}}, "/cg/cpu,cpuacct/a/b"},
		{cgroupMount{dir: "/cg/memory", root: "/limits", controllers: []string{"memory"}}, "/cg/memory/x"},
		{cgroupMount{dir: "/cg/memory", root: "/other", controllers: []string{"memory"}}, ""},
		{cgroupMount{dir: "/cg/systemd", root: "/", controllers: []string{"name=systemd"}}, "/cg/systemd/s"},
		{cgroupMount{dir: "/cg/unified", root: "/", v2: true}, "/cg/unified/u"},
		{cgroupMount{dir: "/cg/pids", root: "/", controllers: []string{"pids"}}, ""},
	} {
		if got := cgroupOf(tc.m, procCgroup); got != tc.want {
			t.Errorf("cgroupOf(%+v) = %q, want %q", tc.m, got, tc.want)
		}
	}
}
