package harness

// Power loss and boot of a real node (realnode.go): what Node.PowerOff,
// PowerOn and Reboot do when the node runs the real kubelet and containerd.
//
// A power loss gives nothing a chance to clean up, so PowerOff sends SIGKILL
// to everything of the node at once (kubelet, containerd, every shim and
// container process, our plugin and the MPS daemons it started); nothing is
// stopped through CRI, no claim is unprepared. Then it takes away what lives
// in memory on a real machine and keeps what lives on disk:
//   - lost (tmpfs or kernel state): containerd's state folder (its /run:
//     task bundles, sandbox shm, the pods' netns mounts), containerd's
//     sockets, runc's state (its --root), the CDI root (/var/run/cdi, where
//     the plugin writes its specs), every mount under the node's folder
//     (container root filesystems, the kubelet's volume tmpfs), the node's
//     cgroups (its pods'), the GPUs' runtime settings (bootGPUs), the boot ID;
//   - kept (disk): containerd's root (images, snapshots, the metadata of the
//     sandboxes and containers that ran), the kubelet's root dir (its
//     checkpoints, the DRA manager's among them; pod volume folders; stale
//     sockets, as on a disk), the pod logs, the CNI IPAM state, our plugin's
//     folder with its checkpoint, the node's certificates and configuration,
//     its bridge and address (the machine's network configuration, which a
//     boot brings back as it was).
//
// PowerOn is the boot: the node's cgroup parent again, containerd and the
// kubelet with the same folders, configuration, port and IP, then the
// plugin with its earlier command line (as the kubelet would start its
// DaemonSet pod). The kubelet finds its pods in the API server with sandboxes
// that are no longer ready, prepares their claims again (its DRA checkpoint
// holds them, none prepared) and makes new sandboxes and containers.
//
// The Node object stays; while the node is off, kube-controller-manager's
// node lifecycle controller marks it not ready once its grace period passes.
// The kubelet reports the boot ID of this machine's kernel, which no
// simulated power cycle changes; our plugin reads the node's BootIDFile.
//
// The harness reaches a real node's containers through its containerd's CRI
// socket, as crictl does (Node.Exec, PodSandboxes).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// kill is a power loss for a daemon: SIGKILL to its process group, then
// wait until it is reaped.
func (d *daemon) kill() {
	if d == nil {
		return
	}
	_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
	<-d.done
}

// stateDir is containerd's state folder (its /run/containerd).
func (r *realNode) stateDir() string { return filepath.Join(r.dir, "state") }

// runcRoot is runc's state folder (its /run/runc).
func (r *realNode) runcRoot() string { return filepath.Join(r.n.Dir, "runc") }

// powerOff is Node.PowerOff for a real node (see the top of this file); the
// caller resets the GPUs and writes the new boot ID.
func (r *realNode) powerOff() error {
	n := r.n
	r.mu.Lock()
	kubelet, containerd := r.kubelet, r.containerd
	r.mu.Unlock()
	kubelet.kill()
	containerd.kill()
	if n.Plugin != nil {
		n.Plugin.Kill()
	}
	// Shims, containers and the simulated host's tools (MPS daemons) may
	// fork while they die: kill until none is left.
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		left := r.processes()
		for _, pid := range left {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		return len(left) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("node %s: processes alive after power-off: %v", n.Name, r.processes())
	}
	for _, m := range mountsUnder(n.Dir) {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("node %s: unmount %s: %w", n.Name, m, err)
		}
	}
	// A network namespace goes once nothing holds it (no process, no
	// mount); the kernel then deletes its veth pair, which leaves the bridge.
	// The kernel does that from a work queue, behind every other namespace
	// being torn down on the machine: over 10 s was seen with the other e2e
	// packages' clusters starting and stopping beside this one.
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 45*time.Second, true, func(context.Context) (bool, error) {
		return len(r.bridgePorts()) == 0, nil
	}); err != nil {
		return fmt.Errorf("node %s: pod links still on bridge %s after power-off: %v", n.Name, r.bridge, r.bridgePorts())
	}
	for _, dir := range []string{r.stateDir(), r.runcRoot()} {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	for _, sock := range []string{r.sock, r.sock + ".ttrpc"} {
		if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	if err := emptyDir(n.CDIRoot); err != nil {
		return fmt.Errorf("node %s: empty the CDI root: %w", n.Name, err)
	}
	hs, err := cgroupHierarchies()
	if err != nil {
		return err
	}
	for _, h := range hs {
		removeCgroupTree(filepath.Join(h, r.cgroupRoot))
	}
	if left := n.PoweredOffLeftovers(); len(left) > 0 {
		return fmt.Errorf("node %s: left after power-off: %s", n.Name, strings.Join(left, "; "))
	}
	return nil
}

// processes are the live processes of the node: its kubelet and containerd,
// shims, container processes, plugin and simulated host's tools.
func (r *realNode) processes() []int {
	var out []int
	r.mu.Lock()
	for _, d := range []*daemon{r.kubelet, r.containerd} {
		if d != nil && d.running() {
			out = append(out, d.cmd.Process.Pid)
		}
	}
	r.mu.Unlock()
	if p := r.n.Plugin; p != nil && p.Running() {
		out = append(out, p.Pid())
	}
	for _, pid := range r.strayProcesses() {
		if !slices.Contains(out, pid) {
			out = append(out, pid)
		}
	}
	for _, p := range Processes(r.n.SimRoot()) {
		if !slices.Contains(out, p.Pid) {
			out = append(out, p.Pid)
		}
	}
	return out
}

// bridgePorts are the links attached to the node's bridge: the host ends of
// its pods' veth pairs.
func (r *realNode) bridgePorts() []string {
	entries, _ := os.ReadDir(filepath.Join("/sys/class/net", r.bridge, "brif"))
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// PoweredOffLeftovers lists what a power loss would not have left of a real
// node: its processes (kubelet, containerd, shims, containers, plugin, MPS
// daemons), mounts under its folder, its cgroups, its pods' links on its
// bridge, and the memory-backed state (containerd's state folder and
// sockets, runc's state, CDI specs).
// Empty for other nodes.
func (n *Node) PoweredOffLeftovers() []string {
	r := n.real
	if r == nil {
		return nil
	}
	var left []string
	left = append(left, r.leftovers(r.processes())...)
	for _, l := range r.bridgePorts() {
		left = append(left, "pod link "+l+" on bridge "+r.bridge)
	}
	for _, p := range []string{r.stateDir(), r.runcRoot(), r.sock, r.sock + ".ttrpc"} {
		if _, err := os.Lstat(p); err == nil {
			left = append(left, "memory-backed "+p)
		}
	}
	if specs, _ := os.ReadDir(n.CDIRoot); len(specs) > 0 {
		for _, s := range specs {
			left = append(left, "CDI spec "+filepath.Join(n.CDIRoot, s.Name()))
		}
	}
	return left
}

// powerOn is Node.PowerOn for a real node: it returns once the kubelet
// reported the Node Ready again and the plugin runs.
func (r *realNode) powerOn(ctx context.Context) error {
	n := r.n
	tools, err := findNodeTools(n.cluster.releaseDir)
	if err != nil {
		return err
	}
	// The Node's heartbeats have whole seconds: the boot starts in a second
	// after the last one before the power loss, so that a heartbeat of this
	// boot tells itself apart (waitReadySince).
	if last, err := r.lastHeartbeat(ctx); err != nil {
		return err
	} else if d := time.Until(last.Add(time.Second)); d > 0 {
		time.Sleep(d)
	}
	booted := time.Now()
	if err := r.setupCgroups(); err != nil {
		return fmt.Errorf("node %s cgroups: %w", n.Name, err)
	}
	if err := r.startContainerd(ctx, tools); err != nil {
		return fmt.Errorf("node %s containerd: %w", n.Name, err)
	}
	// The toolkit's spec went with the CDI root (tmpfs); its container writes
	// it again at boot, before the kubelet starts pods.
	if err := n.ensureToolkitSpec(); err != nil {
		return err
	}
	if err := r.startKubelet(ctx, tools); err != nil {
		return fmt.Errorf("node %s kubelet: %w", n.Name, err)
	}
	if n.Plugin != nil {
		if err := n.Plugin.Restart(); err != nil {
			return fmt.Errorf("node %s: plugin after power-on: %w", n.Name, err)
		}
	}
	return r.waitReadySince(ctx, booted)
}

// lastHeartbeat is the time of the Node's last Ready heartbeat (zero if none).
func (r *realNode) lastHeartbeat(ctx context.Context) (time.Time, error) {
	node, err := r.n.cluster.Client.CoreV1().Nodes().Get(ctx, r.n.Name, metav1.GetOptions{})
	if err != nil {
		return time.Time{}, fmt.Errorf("node %s: %w", r.n.Name, err)
	}
	for _, cond := range node.Status.Conditions {
		if cond.Type == v1.NodeReady {
			return cond.LastHeartbeatTime.Time, nil
		}
	}
	return time.Time{}, nil
}

// waitReadySince waits until the kubelet renewed its node Lease after since
// and reported the Node Ready in a heartbeat of since's second or later
// (powerOn makes sure no heartbeat from before the power loss has one).
func (r *realNode) waitReadySince(ctx context.Context, since time.Time) error {
	c := r.n.cluster
	var last string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 120*time.Second, true, func(ctx context.Context) (bool, error) {
		r.mu.Lock()
		kubelet := r.kubelet
		r.mu.Unlock()
		if !kubelet.running() {
			return false, fmt.Errorf("kubelet exited")
		}
		lease, err := c.Client.CoordinationV1().Leases(v1.NamespaceNodeLease).Get(ctx, r.n.Name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		if lease.Spec.RenewTime == nil || lease.Spec.RenewTime.Time.Before(since) {
			last = fmt.Sprintf("node lease renewed at %v, before the power-on", lease.Spec.RenewTime)
			return false, nil
		}
		node, err := c.Client.CoreV1().Nodes().Get(ctx, r.n.Name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == v1.NodeReady {
				last = fmt.Sprintf("Ready=%s %s, heartbeat %s", cond.Status, cond.Reason, cond.LastHeartbeatTime)
				return cond.Status == v1.ConditionTrue && !cond.LastHeartbeatTime.Time.Before(since.Truncate(time.Second)), nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("node %s not ready after power-on: %w (last: %s); kubelet log:\n%s", r.n.Name, err, last,
			tail(filepath.Join(r.n.Dir, "kubelet.log"), 40))
	}
	return nil
}

// runtimeService connects to the node's containerd CRI socket.
func (r *realNode) runtimeService() (runtimeapi.RuntimeServiceClient, func(), error) {
	conn, err := grpc.NewClient("unix://"+r.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return runtimeapi.NewRuntimeServiceClient(conn), func() { _ = conn.Close() }, nil
}

// PodSandbox is a pod sandbox a real node's containerd keeps.
type PodSandbox struct {
	ID      string
	Ready   bool
	Attempt uint32
}

// PodSandboxes are the sandboxes of a pod that a real node's containerd
// keeps (ready or not), as `crictl pods` lists them.
func (n *Node) PodSandboxes(ctx context.Context, pod *v1.Pod) ([]PodSandbox, error) {
	if n.real == nil {
		return nil, fmt.Errorf("node %s runs no containerd", n.Name)
	}
	rt, done, err := n.real.runtimeService()
	if err != nil {
		return nil, err
	}
	defer done()
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": string(pod.UID)},
	}})
	if err != nil {
		return nil, fmt.Errorf("node %s: CRI ListPodSandbox: %w", n.Name, err)
	}
	var out []PodSandbox
	for _, s := range list.Items {
		out = append(out, PodSandbox{ID: s.Id, Ready: s.State == runtimeapi.PodSandboxState_SANDBOX_READY, Attempt: s.GetMetadata().GetAttempt()})
	}
	return out, nil
}
