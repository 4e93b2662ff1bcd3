package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// PluginOptions start our node plugin on a simulated node.
type PluginOptions struct {
	// Profile is the simulator fleet profile (t4, dgx-a100-40gb, ...).
	Profile string
	// Driver is the driver name (default gpu.nvidia.com).
	Driver string
	// Identity is the service account the plugin runs as (default: the
	// driver's, see Cluster.Driver).
	Identity *Identity
	// ExtraArgs are appended to `gpu-kubelet-plugin run`; one of them may be
	// an --http-address, which then replaces the default (off), or a
	// --kubelet-pod-resources-socket, which replaces the node's (a real
	// node's kubelet socket, else none).
	ExtraArgs []string
	// BootIDFile is read by the plugin instead of the kernel's boot ID
	// (--boot-id-file), so a test can simulate a reboot (see Node.Reboot).
	BootIDFile string
}

// Identity is a service account in a namespace.
type Identity struct {
	Namespace, ServiceAccount string
}

// PluginProcess is a running `gpu-kubelet-plugin run`.
type PluginProcess struct {
	// Args are the full command line.
	Args []string
	// Env is the environment added for the process.
	Env []string
	// LogPath receives stdout and stderr.
	LogPath string
	// SimRoot is the simulated host root (`gpu-sim setup --root`).
	SimRoot string

	cluster *Cluster // starts it in the cluster's cgroups (clustercgroups.go)
	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	// logStart is the log's size when the current process started.
	logStart int64
}

// DefaultDriver is the driver name we publish by default.
const DefaultDriver = "gpu.nvidia.com"

// SimRoot is where the node's simulated driver lives (`gpu-sim setup --root`):
// <node>/sim for LayoutProcess, else the driver root inside HostRoot.
func (n *Node) SimRoot() string { return n.simRoot }

// PluginDir is the node plugin's --plugin-dir for a driver.
// It is short rather than <plugins>/<driver>: MPS control sockets live below
// it and a Unix socket path must fit in 108 bytes.
func (n *Node) PluginDir(driver string) string { return filepath.Join(n.Dir, "p") }

// SetupSim runs `gpu-sim setup --profile <profile> --root <node>/sim` once
// (and, on a node that runs containers, makes its device nodes; see devnodes.go).
func (n *Node) SetupSim(profile string) error {
	if err := n.setupHostDev(); err != nil {
		return err
	}
	if isFile(filepath.Join(n.SimRoot(), "etc", "gpu-sim", "state.json")) {
		if n.runtime != nil || n.real != nil {
			if err := makeDeviceNodes(n.SimRoot()); err != nil {
				return err
			}
		}
		return n.ensureToolkitSpec()
	}
	sim, err := Binary("gpu-sim")
	if err != nil {
		return err
	}
	out, err := exec.Command(sim, "setup", "--profile", profile, "--root", n.SimRoot()).CombinedOutput()
	if err != nil {
		return fmt.Errorf("gpu-sim setup --profile %s: %v: %s", profile, err, out)
	}
	if n.runtime != nil || n.real != nil {
		if err := makeDeviceNodes(n.SimRoot()); err != nil {
			return err
		}
	}
	return n.ensureToolkitSpec()
}

// ensureToolkitSpec writes the toolkit's nvidia.com/gpu spec into the CDI
// root of a real node with NVIDIA's runtime, as the GPU Operator's toolkit
// container does once the driver is there: containerd hands containers to
// the runtime directly, so there is no first container to wait for.
func (n *Node) ensureToolkitSpec() error {
	if n.real == nil || n.real.nvidia == nil {
		return nil
	}
	return n.real.nvidia.ensureSpec()
}

// StartPlugin sets up the node's simulated host and starts our node plugin
// with the node's directories and a service-account token bound to a Pod
// object on this node (so the token carries the node name, and RBAC and the
// node-restriction admission policy apply as in a real cluster).
func (n *Node) StartPlugin(ctx context.Context, opts PluginOptions) (*PluginProcess, error) {
	bin, err := Binary("gpu-kubelet-plugin")
	if err != nil {
		return nil, err
	}
	if opts.Driver == "" {
		opts.Driver = DefaultDriver
	}
	if opts.Identity == nil {
		opts.Identity = n.cluster.pluginIdentity()
	}
	if err := n.SetupSim(opts.Profile); err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(n.Dir, "plugin.kubeconfig")
	token, err := n.cluster.NodeBoundToken(ctx, n.Name, *opts.Identity)
	if err != nil {
		return nil, err
	}
	if err := n.cluster.WriteKubeconfig(kubeconfig, opts.Identity.ServiceAccount, token); err != nil {
		return nil, err
	}
	for _, d := range []string{n.PluginDir(opts.Driver)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	// NVIDIA's hook binary at a path of this machine, which is the host the
	// runtime runs the specs' hooks on (`make toolkit`).
	hook, err := Tool("nvidia-cdi-hook")
	if err != nil {
		return nil, err
	}
	p := &PluginProcess{
		Args: append([]string{bin, "run",
			"--nvidia-cdi-hook-path=" + hook,
			"--node-name=" + n.Name,
			"--driver-name=" + opts.Driver,
			"--kubeconfig=" + kubeconfig,
			"--plugin-dir=" + n.PluginDir(opts.Driver),
			"--registrar-dir=" + n.RegistrarDir,
			"--cdi-root=" + n.CDIRoot,
			"--driver-root=" + n.SimRoot(),
			"--dev-root=" + n.SimRoot(),
			"--sysfs-root=" + filepath.Join(n.SimRoot(), "sys"),
			"--log-level=info",
		}, opts.ExtraArgs...),
		LogPath: filepath.Join(n.Dir, "plugin.log"),
		SimRoot: n.SimRoot(),
		cluster: n.cluster,
	}
	if opts.BootIDFile != "" {
		p.Args = append(p.Args, "--boot-id-file="+opts.BootIDFile)
	}
	// The cleanup asks the kubelet which claims are in use: a real node's
	// kubelet serves its PodResources API under its root dir; the pod loop
	// has none, and the default path would be this machine's.
	if !slices.ContainsFunc(opts.ExtraArgs, func(a string) bool { return strings.HasPrefix(a, "--kubelet-pod-resources-socket") }) {
		p.Args = append(p.Args, "--kubelet-pod-resources-socket="+n.PodResourcesSocket())
	}
	// No HTTP endpoint unless asked for: the plugin's default port would be
	// one for all the nodes of this machine (and the flag may appear once).
	if !slices.ContainsFunc(opts.ExtraArgs, func(a string) bool { return strings.HasPrefix(a, "--http-address") }) {
		p.Args = append(p.Args, "--http-address=")
	}
	if err := p.start(); err != nil {
		return nil, err
	}
	n.Plugin = p
	return p, nil
}

func (p *PluginProcess) start() error {
	log, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	var logStart int64
	if st, err := log.Stat(); err == nil {
		logStart = st.Size()
	}
	cmd := exec.Command(p.Args[0], p.Args[1:]...)
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.Env = append(os.Environ(), p.Env...)
	// Its own process group, so MPS daemons it starts can be found and
	// reaped even after a kill -9 of the plugin itself.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cluster.startProcess(cmd); err != nil {
		log.Close()
		return fmt.Errorf("start %s: %w", p.Args[0], err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); log.Close(); close(done) }()
	p.mu.Lock()
	p.cmd, p.done, p.logStart = cmd, done, logStart
	p.mu.Unlock()
	return nil
}

// Pid is the plugin's process id.
func (p *PluginProcess) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd.Process.Pid
}

// Running says whether the process has not exited.
func (p *PluginProcess) Running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Kill sends SIGKILL to the plugin process only (not its children) and
// waits for it to exit: a crash.
func (p *PluginProcess) Kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// Restart starts the same command line again (after Kill or Stop).
func (p *PluginProcess) Restart() error {
	if p.Running() {
		return fmt.Errorf("plugin still running (pid %d)", p.Pid())
	}
	return p.start()
}

// Stop sends SIGTERM, waits up to 10 s, then kills.
func (p *PluginProcess) Stop() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
	}
}

// Log returns the plugin's log so far.
func (p *PluginProcess) Log() string {
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// CurrentLog is what the plugin's current process (since its last start or
// Restart) has logged.
func (p *PluginProcess) CurrentLog() string {
	p.mu.Lock()
	start := p.logStart
	p.mu.Unlock()
	b, _ := os.ReadFile(p.LogPath)
	if int64(len(b)) < start {
		return ""
	}
	return string(b[start:])
}

// NodeBoundToken creates (once) a Pod object standing for the plugin's
// DaemonSet pod on the node, and returns a service-account token bound to
// it: the apiserver puts the node name and UID into such tokens, which is
// what the node-restriction admission policy keys on.
func (c *Cluster) NodeBoundToken(ctx context.Context, node string, id Identity) (string, error) {
	if err := c.ensureNamespace(ctx, id.Namespace); err != nil {
		return "", err
	}
	sas := c.Client.CoreV1().ServiceAccounts(id.Namespace)
	if _, err := sas.Get(ctx, id.ServiceAccount, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		if _, err := sas.Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: id.ServiceAccount}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return "", err
		}
	}
	name := "gpu-kubelet-plugin-" + node
	pods := c.Client.CoreV1().Pods(id.Namespace)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		pod, err = pods.Create(ctx, &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app.kubernetes.io/component": "kubelet-plugin"}},
			// The plugin process stands for this pod's container; on a real
			// node the kubelet runs the pod too, so its image is one the node
			// has (the test image, which sleeps) rather than a name no
			// registry serves (ImagePullBackOff for ever).
			Spec: v1.PodSpec{
				NodeName:                      node,
				ServiceAccountName:            id.ServiceAccount,
				TerminationGracePeriodSeconds: new(int64(1)),
				Containers:                    []v1.Container{{Name: "plugin", Image: TestImageName}},
			},
		}, metav1.CreateOptions{})
	}
	if err != nil {
		return "", fmt.Errorf("plugin pod on %s: %w", node, err)
	}
	return c.podToken(ctx, pod, id)
}

// podToken is the token the kubelet projects into a pod: its service
// account's, bound to the pod (so it carries the pod's node).
func (c *Cluster) podToken(ctx context.Context, pod *v1.Pod, id Identity) (string, error) {
	sas := c.Client.CoreV1().ServiceAccounts(id.Namespace)
	tr, err := sas.CreateToken(ctx, id.ServiceAccount, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: new(int64(24 * 3600)),
		BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for %s/%s bound to pod %s: %w", id.Namespace, id.ServiceAccount, pod.Name, err)
	}
	return tr.Status.Token, nil
}

func (c *Cluster) ensureNamespace(ctx context.Context, ns string) error {
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	// The serviceaccount controller creates "default" shortly after.
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
}

// CreateNamespace creates a namespace and waits for its default service account.
func (c *Cluster) CreateNamespace(ctx context.Context, ns string) error {
	return c.ensureNamespace(ctx, ns)
}
