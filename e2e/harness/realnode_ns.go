package harness

// A real node with a host tree: a node whose plugin runs deployed (Layout
// host-driver or container-driver) runs its kubelet and containerd in a
// mount namespace of its own, in which the node's tree (Node.HostRoot) is
// mounted at the standard host paths that the chart's hostPath volumes and
// our CDI specs name. The kubelet resolves hostPath volumes, and containerd
// CDI device nodes and mounts, in that namespace; so a plugin pod's
// /var/lib/kubelet/plugins is its node's, and two nodes on this machine do
// not see each other's sockets, CDI specs, device nodes or driver files.
//
// The namespace is held by a process of its own (`unshare --mount
// --propagation slave`, sleeping), and the kubelet and containerd enter it
// with `nsenter --mount=/proc/<holder>/ns/mnt`: both must share it, so that
// the volume mounts the kubelet makes under /var/lib/kubelet/pods are those
// containerd hands to runc. None of the mounts made in it leave it (it is
// a slave of this machine's mounts, and its "/" is made shared within it). When the last process of the
// node ends (the holder last), the namespace and every mount in it go.
//
// In the namespace (<tree> is Node.HostRoot):
//   - /var/lib/kubelet is <tree>/var/lib/kubelet (the kubelet's --root-dir:
//     plugins_registry, plugins, pods, pod-resources);
//   - /var/run/cdi (/run/cdi here) is <tree>/var/run/cdi, containerd's CDI
//     spec folder;
//   - container-driver: /run/nvidia/driver is the driver's tree, with its
//     /dev nodes and /proc/driver/nvidia as the GPU Operator's driver
//     container exposes them;
//   - host-driver: /dev is <tree>/dev (the simulated GPUs' device nodes and
//     the standard ones; /dev/pts and /dev/shm of its own), and the
//     driver's files are added to this machine's /usr/lib/x86_64-linux-gnu
//     and /usr/bin by read-only overlays in which this machine's files win:
//     the simulated driver root's stand-in system libraries (another glibc)
//     cannot replace the libraries the kubelet, containerd and runc load, so
//     a host-driver node's "/" carries this machine's glibc, not the stand-in.
//     An overlay does not follow changes made to its lower folders, so a
//     driver upgrade (upgrade.go) mounts those overlays anew whenever the
//     tree's driver files change (followDriverFiles): the node, and the
//     containers that mount its "/" with HostToContainer, see the new files
//     at the host paths as a host sees a package upgrade's. Rejected: the
//     driver's folder on top (its stand-in glibc would win), or a writable
//     overlay that the upgrade writes through (the upgrade writes the
//     stand-ins too).
//
// The simulated kernel: the simulator's state folder (<sim>/etc/gpu-sim,
// which stands for the kernel driver's state) is a mount of its own in the
// namespace, so a container that mounts the driver root read-only (the
// chart does) still reaches it writable, as processes reach a real driver
// through its device files; every container also gets it read-only at
// /etc/gpu-sim (realnode.go's base spec). So is, on a container-driver node,
// the driver's /proc/driver/nvidia/capabilities: the kernel adds and removes
// the capability files of GPU and compute instances whatever a process's view
// of procfs, and the simulator, which stands in for it, writes them from the
// process that changed the MIG layout (the plugin, whose mount of the
// driver's /proc/driver/nvidia the chart makes read-only). Without that
// mount the write fails, the new instance's /dev/nvidia-caps nodes are never
// made, the plugin no longer sees every instance of its GPUs and the
// simulator refuses its next MIG change (NVML's NO_PERMISSION), as a real
// driver refuses a process that cannot open every device. The node's simulated PCI devices
// are every container's /sys/devices and /sys/bus/pci (base spec mounts over
// the container's sysfs), where the plugin reads NUMA nodes and PCI roots.
// What differs from a real host: procfs is this machine's kernel's, so a
// host-driver plugin (`devRoot: /`) finds no /proc/driver/nvidia and no MIG
// capabilities (the container-driver layout mounts the tree's); the
// machine's mount points /var/lib/kubelet, /run/cdi and /run/nvidia/driver
// exist as empty folders on this machine.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// DeployedPluginLabel marks the nodes whose plugin runs deployed (a real
// node with a host tree); the harness installs the chart with
// kubeletPlugin.nodeSelector naming it, as admins target their GPU nodes,
// so the DaemonSet controller places no plugin pod on nodes that run the
// plugin as a process.
const DeployedPluginLabel = "e2e.gpu-dra/node-plugin"

// DeployedPluginSelector is the chart value that selects those nodes.
var DeployedPluginSelector = "kubeletPlugin.nodeSelector." + strings.ReplaceAll(DeployedPluginLabel, ".", `\.`) + "=deployed"

// KubeletRootDir is the kubelet's --root-dir on nodes with a host tree, as
// on a real host.
const KubeletRootDir = "/var/lib/kubelet"

// hostNamespace is the mount namespace of a node with a host tree.
type hostNamespace struct {
	holder *daemon
	nsPath string
}

// startHostNamespace makes the node's mount namespace and its mounts.
func (r *realNode) startHostNamespace(ctx context.Context) error {
	n := r.n
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return fmt.Errorf("%w: unshare (util-linux) for the node's mount namespace", ErrMissing)
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		return fmt.Errorf("%w: nsenter (util-linux) for the node's mount namespace", ErrMissing)
	}
	holder, err := startDaemon(r.n.cluster, "mount namespace", filepath.Join(n.Dir, "mountns.log"), nil,
		unshare, "--mount", "--propagation", "slave", "sleep", "2147483647")
	if err != nil {
		return err
	}
	r.ns = &hostNamespace{holder: holder, nsPath: fmt.Sprintf("/proc/%d/ns/mnt", holder.cmd.Process.Pid)}
	own, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	// unshare has made the namespace once its ns link differs from ours.
	err = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		if !holder.running() {
			return false, fmt.Errorf("unshare exited: %s", tail(filepath.Join(n.Dir, "mountns.log"), 5))
		}
		link, err := os.Readlink(r.ns.nsPath)
		return err == nil && link != own, nil
	})
	if err != nil {
		return fmt.Errorf("node %s mount namespace: %w", n.Name, err)
	}
	// Mount sources exist before the simulated driver is set up (SetupSim).
	for _, d := range []string{filepath.Join(n.HostRoot, "var/lib/kubelet"), filepath.Join(n.HostRoot, "var/run/cdi"),
		filepath.Join(n.SimRoot(), "etc", "gpu-sim"), filepath.Join(n.SimRoot(), migCapabilities),
		filepath.Join(n.SimRoot(), "sys", "devices"), filepath.Join(n.SimRoot(), "sys", "bus", "pci")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// The node's "/" shared, as systemd mounts a host's: the kubelet's
	// HostToContainer and Bidirectional volume mounts (the chart's driver
	// root and /dev) need their source in a shared or slave mount, and this
	// machine's "/" is private. Only the namespace's copy changes.
	script := []string{"mount --make-rshared /"}
	bind := func(src, dst string) {
		script = append(script, fmt.Sprintf("mkdir -p %q && mount --bind %q %q", dst, src, dst))
	}
	bind(filepath.Join(n.HostRoot, "var/lib/kubelet"), KubeletRootDir)
	bind(filepath.Join(n.HostRoot, "var/run/cdi"), "/run/cdi")
	state := filepath.Join(n.SimRoot(), "etc", "gpu-sim")
	switch n.Layout {
	case LayoutContainerDriver:
		bind(n.SimRoot(), ContainerDriverRoot)
		bind(state, filepath.Join(ContainerDriverRoot, "etc", "gpu-sim"))
		bind(filepath.Join(n.SimRoot(), migCapabilities), filepath.Join(ContainerDriverRoot, migCapabilities))
	case LayoutHostDriver:
		if err := r.hostDriverMounts(&script); err != nil {
			return err
		}
		// The state folder over the overlay of /etc (made in hostDriverMounts).
		script = append(script, fmt.Sprintf("mount --bind %q /etc/gpu-sim", state))
	}
	out, err := r.inNamespace(ctx, "sh", "-ec", strings.Join(script, "\n")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("node %s mounts: %v: %s", n.Name, err, out)
	}
	return nil
}

// migCapabilities is where, below a driver root, the simulated kernel keeps
// the capability files of MIG instances (a mount of its own on a
// container-driver node; see the file's doc).
const migCapabilities = "proc/driver/nvidia/capabilities"

// hostDriverMounts adds the mounts of a host-driver node: its /dev, and
// the driver's files on this machine's /usr and /etc (see the file's doc).
func (r *realNode) hostDriverMounts(script *[]string) error {
	n := r.n
	dev := filepath.Join(n.HostRoot, "dev")
	if err := n.setupHostDev(); err != nil { // hostroot.go: the standard nodes
		return err
	}
	// What a host's /dev has besides setupHostDev's nodes: the kubelet reads
	// /dev/kmsg (its OOM watcher), exec with a terminal needs /dev/ptmx.
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"kmsg", 1, 11}, {"ptmx", 5, 2}} {
		path := filepath.Join(dev, d.name)
		if _, err := os.Lstat(path); err == nil {
			continue
		}
		if err := unix.Mknod(path, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("mknod %s: %w", path, err)
		}
	}
	for _, l := range [][2]string{{"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"}} {
		if _, err := os.Lstat(filepath.Join(dev, l[1])); err != nil {
			if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
				return err
			}
		}
	}
	for _, d := range []string{"pts", "shm"} {
		if err := os.MkdirAll(filepath.Join(dev, d), 0o755); err != nil {
			return err
		}
	}
	*script = append(*script,
		fmt.Sprintf("mount --bind %q /dev", dev),
		"mount --rbind /proc/1/root/dev/pts /dev/pts 2>/dev/null || mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts",
		"mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm")
	// Read-only overlays: this machine's folder over the driver's, so the
	// machine's files win and the driver's are added.
	for _, d := range append(append([]string{}, driverFileDirs...), "etc") {
		if err := os.MkdirAll(filepath.Join(n.HostRoot, d), 0o755); err != nil {
			return err
		}
		*script = append(*script, r.driverOverlay(d))
	}
	return nil
}

// driverFileDirs are the folders of a host-driver node's tree whose files
// a driver upgrade changes (libraries and links, tools), mounted anew when
// they change (followDriverFiles). The tree's etc adds nothing the machine's
// does not hide (its ld.so.cache) but the mount point of the state folder,
// which is a mount of its own: that overlay stays.
var driverFileDirs = []string{"usr/lib/x86_64-linux-gnu", "usr/bin"}

// driverOverlay is the command that mounts the read-only overlay of folder d
// (relative to "/") in the namespace: this machine's d over the tree's.
func (r *realNode) driverOverlay(d string) string {
	return fmt.Sprintf("mount -t overlay overlay -o ro,lowerdir=%s:%s %q", "/"+d, filepath.Join(r.n.HostRoot, d), "/"+d)
}

// followDriverFiles keeps a host-driver node's view of the driver's files
// in step with its tree while something changes them there (a driver
// upgrade, until done delivers its result, which it returns): an overlay
// does not follow changes made to its lower folders behind its back (it
// keeps the entries it has looked up, so a replaced libnvidia-ml.so.1 link
// still names the old, removed library), so whenever the names, inodes or
// link targets in the tree's driverFileDirs differ from the last look, the
// overlays of driverFileDirs are mounted anew. The old ones are detached
// lazily (`umount -l`: the plugin may still have the old library mapped, a
// container keeps the files it bind-mounted), then the new ones mounted;
// both propagate to the containers that mount the host's "/" with
// HostToContainer (the chart's driver root), as a package upgrade's new
// files reach them on a real host. The tree is looked at every 50 ms, so
// the node sees a change at most that much later than the tree. On other
// nodes it only waits for done.
func (r *realNode) followDriverFiles(ctx context.Context, done <-chan error) error {
	if r == nil || r.ns == nil || r.n.Layout != LayoutHostDriver {
		return <-done
	}
	seen := r.driverFilesLook()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			if now := r.driverFilesLook(); now != seen {
				if rerr := r.remountDriverFiles(ctx); rerr != nil && err == nil {
					err = rerr
				}
			}
			return err
		case <-tick.C:
			if now := r.driverFilesLook(); now != seen {
				// The look before the remount: a change made while it runs is
				// seen at the next tick.
				seen = now
				if err := r.remountDriverFiles(ctx); err != nil {
					return errors.Join(err, <-done)
				}
			}
		}
	}
}

// driverFilesLook is what the tree's driverFileDirs hold: each entry's
// name, inode and, for a link, its target.
func (r *realNode) driverFilesLook() string {
	var b strings.Builder
	for _, d := range driverFileDirs {
		dir := filepath.Join(r.n.HostRoot, d)
		entries, err := os.ReadDir(dir)
		if err != nil {
			fmt.Fprintf(&b, "%s: %v\n", d, err)
			continue
		}
		for _, e := range entries {
			fmt.Fprintf(&b, "%s/%s", d, e.Name())
			if info, err := e.Info(); err == nil {
				if st, ok := info.Sys().(*syscall.Stat_t); ok {
					fmt.Fprintf(&b, " %d", st.Ino)
				}
			}
			if e.Type()&os.ModeSymlink != 0 {
				target, _ := os.Readlink(filepath.Join(dir, e.Name()))
				fmt.Fprintf(&b, " -> %s", target)
			}
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// remountDriverFiles mounts the overlays of driverFileDirs anew in the
// node's namespace (see followDriverFiles). Between the detach and the
// mount a folder is this machine's alone: the machine's files stay, only
// the driver's are absent for that moment.
func (r *realNode) remountDriverFiles(ctx context.Context) error {
	var script []string
	for _, d := range driverFileDirs {
		script = append(script, fmt.Sprintf("umount -l %q", "/"+d), r.driverOverlay(d))
	}
	out, err := r.inNamespace(ctx, "sh", "-ec", strings.Join(script, "\n")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("node %s: mounting the driver's files anew: %v: %s", r.n.Name, err, out)
	}
	return nil
}

// inNamespace is a command run in the node's mount namespace.
func (r *realNode) inNamespace(ctx context.Context, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "nsenter", append([]string{"--mount=" + r.ns.nsPath, "--"}, args...)...)
}

// nodeCommand is the command line of a node daemon: entered into the
// node's mount namespace when it has one.
func (r *realNode) nodeCommand(args []string) []string {
	if r.ns == nil {
		return args
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		nsenter = "nsenter"
	}
	return append([]string{nsenter, "--mount=" + r.ns.nsPath, "--"}, args...)
}

// kubeletRootDir is the kubelet's --root-dir as the kubelet sees it.
func (r *realNode) kubeletRootDir() string {
	if r.ns == nil {
		return r.kubeletRoot
	}
	return KubeletRootDir
}

// hostTreeBaseMounts are the base spec's mounts of a node with a host tree:
// its simulated PCI devices over the container's sysfs (see the file's doc).
func (r *realNode) hostTreeBaseMounts() []rspec.Mount {
	if r.ns == nil {
		return nil
	}
	sys := filepath.Join(r.n.SimRoot(), "sys")
	var out []rspec.Mount
	for _, d := range []string{"devices", "bus/pci"} {
		out = append(out, rspec.Mount{Destination: "/sys/" + d, Type: "bind", Source: filepath.Join(sys, d),
			Options: []string{"rbind", "ro", "nosuid", "nodev"}})
	}
	return out
}

// stopHostNamespace ends the holder; the namespace goes with the last of
// the node's processes.
func (r *realNode) stopHostNamespace() {
	if r.ns == nil {
		return
	}
	_ = r.ns.holder.cmd.Process.Signal(syscall.SIGKILL)
	<-r.ns.holder.done
}

// hostNamespaceLeft says what is left of the namespace's holder.
func (r *realNode) hostNamespaceLeft() []string {
	if r.ns == nil || !r.ns.holder.running() {
		return nil
	}
	return []string{fmt.Sprintf("mount namespace holder (pid %d) running", r.ns.holder.cmd.Process.Pid)}
}

// MountNamespace is the node's mount namespace as /proc/<pid>/ns/mnt links
// name it ("mnt:[<inode>]"), where its kubelet, containerd and shims run;
// "" for a node without a host tree.
func (n *Node) MountNamespace() string {
	if n.real == nil || n.real.ns == nil {
		return ""
	}
	link, err := os.Readlink(n.real.ns.nsPath)
	if err != nil {
		return ""
	}
	return link
}

// NamespaceMounts are the mount points of the node's mount namespace (the
// host's mounts as the node's kubelet and containerd see them, theirs
// included); nil for a node without a host tree or once it is gone.
func (n *Node) NamespaceMounts() []string {
	if n.real == nil || n.real.ns == nil || !n.real.ns.holder.running() {
		return nil
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", n.real.ns.holder.cmd.Process.Pid))
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 {
			out = append(out, unescapeMountPath(f[4]))
		}
	}
	return out
}
