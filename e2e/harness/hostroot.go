package harness

// A node whose host is a directory tree: with a deployed node plugin, each
// simulated node gets its own tree (Node.HostRoot) standing for the host's
// "/": the kubelet's folders, the CDI root, /dev and the simulated driver sit
// at their standard paths inside it. The node is a real one whose kubelet
// and containerd run in a mount namespace where the tree is mounted at those
// paths (realnode_ns.go), so the chart's hostPath volumes, the plugin's
// registration endpoint and the host paths of its CDI specs resolve inside
// the tree as they would on the node itself. Nothing is translated: a CDI
// spec naming a container path fails here as it would fail on a real node.

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Layout says how a node runs our node plugin and where its driver is.
type Layout string

const (
	// LayoutProcess runs the plugin as a plain process (StartPlugin) with
	// the node's folders passed as flags; the simulated driver is in
	// <node>/sim.
	LayoutProcess Layout = ""
	// LayoutHostDriver: the node plugin runs deployed (the chart's DaemonSet,
	// run by the node's kubelet) and the driver is installed on the host: the
	// simulated driver sits at the standard paths of the node's tree (the
	// chart's default `nvidiaDriverRoot: /`).
	LayoutHostDriver Layout = "host-driver"
	// LayoutContainerDriver: the node plugin runs deployed and the driver is
	// containerized, as the GPU Operator installs it: the simulated driver,
	// its device nodes and /proc/driver/nvidia are under /run/nvidia/driver
	// in the node's tree (`nvidiaDriverRoot` and `kubeletPlugin.devRoot: /run/nvidia/driver`).
	LayoutContainerDriver Layout = "container-driver"
)

// ContainerDriverRoot is the driver root of LayoutContainerDriver.
const ContainerDriverRoot = "/run/nvidia/driver"

// HelmValues are the chart values that describe the layout to the chart
// (the harness adds the node selector of deployed nodes to every install,
// see helm.go).
func (l Layout) HelmValues() []string {
	if l == LayoutContainerDriver {
		return []string{"nvidiaDriverRoot=" + ContainerDriverRoot, "kubeletPlugin.devRoot=" + ContainerDriverRoot}
	}
	return nil
}

// useHostTree puts the node's kubelet folders, CDI root and simulated
// driver into the tree at root.
func (n *Node) useHostTree(root string) {
	n.HostRoot = root
	n.RegistrarDir = filepath.Join(root, "var/lib/kubelet/plugins_registry")
	n.PluginsDir = filepath.Join(root, "var/lib/kubelet/plugins")
	n.CDIRoot = filepath.Join(root, "var/run/cdi")
	n.simRoot = root
	if n.Layout == LayoutContainerDriver {
		n.simRoot = filepath.Join(root, ContainerDriverRoot)
	}
}

// HostPath is where a path of the node's host lies on this machine.
func (n *Node) HostPath(p string) string {
	if n.HostRoot == "" {
		return p
	}
	return filepath.Join(n.HostRoot, p)
}

// hostDevNodes are the character devices every host's /dev has, which a
// container that mounts the host's /dev (the chart's default `devRoot: /`)
// relies on: runc itself needs /dev/null.
var hostDevNodes = []struct {
	name         string
	major, minor uint32
}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}}

// setupHostDev makes the node's /dev a host's /dev: the simulated driver's
// device nodes (LayoutHostDriver puts them there) and the standard ones.
func (n *Node) setupHostDev() error {
	if n.Layout != LayoutHostDriver {
		return nil
	}
	dev := filepath.Join(n.HostRoot, "dev")
	if err := os.MkdirAll(dev, 0o755); err != nil {
		return err
	}
	for _, d := range hostDevNodes {
		path := filepath.Join(dev, d.name)
		if _, err := os.Lstat(path); err == nil {
			continue
		}
		if err := unix.Mknod(path, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("mknod %s: %w", path, err)
		}
	}
	return nil
}
