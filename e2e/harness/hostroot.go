package harness

// A node whose host is a directory tree: with a deployed node plugin, each
// simulated node gets its own tree (Node.HostRoot) standing for the host's
// "/": the kubelet's folders, the CDI root, /dev and the simulated driver sit
// at their standard paths inside it, and the chart's hostPath volumes are
// bind mounts of its folders. Whatever names a host path (the plugin's
// registration endpoint, the host paths in its CDI specs) is resolved inside
// the tree, as the node's kubelet and container runtime would resolve it on
// the node itself. Paths the plugin sees inside its container are never
// translated: a CDI spec naming a container path fails here as it would fail
// on a real node.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"sigs.k8s.io/yaml"
	cdispecs "tags.cncf.io/container-device-interface/specs-go"
)

// Layout says how a node runs our node plugin and where its driver is.
type Layout string

const (
	// LayoutProcess runs the plugin as a plain process (StartPlugin) with
	// the node's folders passed as flags; the simulated driver is in
	// <node>/sim.
	LayoutProcess Layout = ""
	// LayoutHostDriver: the node plugin runs deployed (the chart's DaemonSet,
	// see daemonset.go) and the driver is installed on the host: the
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

// HelmValues are the chart values that describe the layout to the chart.
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

// shortHostRoot is a symbolic link to the node's tree with a short path
// (/tmp/h<random>), made once; removing the node (or stopping the cluster)
// removes it.
func (n *Node) shortHostRoot() (string, error) {
	if n.shortRoot != "" {
		return n.shortRoot, nil
	}
	for range 100 {
		link := fmt.Sprintf("/tmp/h%05d", rand.IntN(100000))
		if err := os.Symlink(n.HostRoot, link); err == nil {
			n.shortRoot = link
			return link, nil
		} else if !os.IsExist(err) {
			return "", fmt.Errorf("node %s: short link to its tree: %w", n.Name, err)
		}
	}
	return "", fmt.Errorf("node %s: no free short link name under /tmp", n.Name)
}

// removeShortRoot removes the short link to the node's tree, if any.
func (n *Node) removeShortRoot() {
	if n.shortRoot != "" {
		_ = os.Remove(n.shortRoot)
		n.shortRoot = ""
	}
}

// HostPath is where a path of the node's host lies on this machine.
func (n *Node) HostPath(p string) string {
	if n.HostRoot == "" {
		return p
	}
	return filepath.Join(n.HostRoot, p)
}

// hostEndpoints is the kubelet's DRA plugin handler on a node whose host is
// a tree: the endpoint a plugin registers is a host path.
type hostEndpoints struct {
	cache.PluginHandler
	root string
}

func (h hostEndpoints) path(endpoint string) string {
	if strings.HasPrefix(endpoint, h.root+"/") {
		return endpoint
	}
	return filepath.Join(h.root, endpoint)
}

func (h hostEndpoints) ValidatePlugin(ctx context.Context, name, endpoint string, versions []string) error {
	return h.PluginHandler.ValidatePlugin(ctx, name, h.path(endpoint), versions)
}

func (h hostEndpoints) RegisterPlugin(ctx context.Context, name, endpoint string, versions []string, timeout *time.Duration) error {
	return h.PluginHandler.RegisterPlugin(ctx, name, h.path(endpoint), versions, timeout)
}

func (h hostEndpoints) DeRegisterPlugin(ctx context.Context, name, endpoint string) {
	h.PluginHandler.DeRegisterPlugin(ctx, name, h.path(endpoint))
}

// hostView copies the CDI specs of cdiRoot into a new folder under base with
// every host path (device nodes, mount sources, hook binaries) resolved
// inside the node's tree at root. The caller removes the folder.
func hostView(root, cdiRoot, base string) (string, error) {
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	out, err := os.MkdirTemp(base, "v")
	if err != nil {
		return "", err
	}
	entries, err := os.ReadDir(cdiRoot)
	if err != nil {
		return out, err
	}
	at := func(p string) string {
		if p == "" {
			return p
		}
		return filepath.Join(root, p)
	}
	edit := func(e *cdispecs.ContainerEdits) {
		for _, d := range e.DeviceNodes {
			if d.HostPath == "" {
				d.HostPath = d.Path
			}
			d.HostPath = at(d.HostPath)
		}
		for _, m := range e.Mounts {
			if strings.HasPrefix(m.HostPath, "/") {
				m.HostPath = at(m.HostPath)
			}
		}
		for _, h := range e.Hooks {
			h.Path = at(h.Path)
		}
	}
	for _, e := range entries {
		ext := filepath.Ext(e.Name())
		if e.IsDir() || (ext != ".yaml" && ext != ".json") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(cdiRoot, e.Name()))
		if err != nil {
			continue // removed meanwhile
		}
		var spec cdispecs.Spec
		if err := yaml.Unmarshal(data, &spec); err != nil {
			return out, fmt.Errorf("CDI spec %s: %w", e.Name(), err)
		}
		edit(&spec.ContainerEdits)
		for i := range spec.Devices {
			edit(&spec.Devices[i].ContainerEdits)
		}
		data, err = yaml.Marshal(&spec)
		if err != nil {
			return out, err
		}
		name := strings.TrimSuffix(e.Name(), ext) + ".yaml"
		if err := os.WriteFile(filepath.Join(out, name), data, 0o644); err != nil {
			return out, err
		}
	}
	return out, nil
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
