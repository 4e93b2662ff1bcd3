package harness

// Real nodes: a node added with NodeOptions.RealKubelet runs the kubelet
// binary built from the control plane's Kubernetes release and containerd v2
// (its CRI plugin, runc, CNI bridge networking) as processes, instead of the
// harness's pod loop and runtime (node.go, runtime.go). Plugin registration,
// the DRA manager, pod status, logs and exec are the kubelet's own; CDI
// devices are applied by containerd.
//
// Per node, so that several share this machine without seeing each other:
//   - containerd: root, state, sockets, config, CNI config and IPAM state
//     under <node>/containerd; runc's state under <node>/runc; NRI off (its
//     socket would be machine-wide); netns mounts under the state folder.
//   - kubelet: root dir <node>/kubelet (plugins_registry and plugins are
//     there, and our plugin's --registrar-dir points at them), pod logs
//     under <node>/pod-logs, its own port, cgroupRoot /e2e-<tag>/n<i> in
//     every cgroup hierarchy (under the cluster's cgroup, clustercgroups.go).
//   - network: a Linux bridge of its own (name and /24 unique on the
//     machine), which the CNI bridge plugin attaches pods to; the bridge's
//     address is the node IP. The kubelet refuses a loopback node IP ("nodeIP
//     can't be loopback address", kubelet_node_status.go) and this kernel
//     has no dummy links, so the node IP lives on the bridge; the API server
//     reaches the kubelet there (--kubelet-preferred-address-types=InternalIP).
//
// No mount namespace for a LayoutProcess node: its CDI specs name host
// paths of this machine (<node>/sim), which containerd resolves as they
// are. A node with a host tree (deployed plugin) runs its kubelet and
// containerd in a mount namespace of its own (realnode_ns.go).
//
// Images: no registry is reachable; the images a node's pods may use are
// the catalogue's (nodeimages.go): the sandbox and test images are written
// as OCI archives (ociimage.go) and imported with `ctr images import` into
// the node's containerd (namespace k8s.io) before the kubelet starts; the
// others are pulled by the kubelet from the cluster's registry
// (registry.go), which containerd uses for every registry host.
//
// Invariant: Node.Stop leaves nothing of the node behind: kubelet,
// containerd, shims and containers killed (pods stopped and removed through
// CRI first, so CNI releases their addresses), mounts under the node's
// folder unmounted, its cgroups and bridge removed. RealNodeLeftovers checks.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"sigs.k8s.io/yaml"
)

// realNode is what a real node runs besides our plugin.
type realNode struct {
	n           *Node
	dir         string // <node>/containerd
	kubeletRoot string
	sock        string
	bridge      string
	ip          net.IP
	subnet      *net.IPNet
	cgroupRoot  string
	port        int
	ns          *hostNamespace // nil without a host tree
	service     []string       // the iptables rule forwarding the API Service (podnet.go)

	mu         sync.Mutex
	containerd *daemon
	kubelet    *daemon
	stopped    bool

	// nvidia is NVIDIA's runtime, containerd's default runtime on this node
	// (NodeOptions.NvidiaRuntime); nil otherwise.
	nvidia *nvidiaRuntime
}

// daemon is a process the harness started and waits for.
type daemon struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func startDaemon(c *Cluster, name, logPath string, env []string, args ...string) (*daemon, error) {
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), env...)
	// Its own process group; killed if the harness dies without stopping it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := c.startProcess(cmd); err != nil { // in the cluster's cgroups (clustercgroups.go)
		log.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	d := &daemon{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); log.Close(); close(d.done) }()
	return d, nil
}

func (d *daemon) running() bool {
	select {
	case <-d.done:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs the process group.
func (d *daemon) stop(grace time.Duration) {
	if d == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(grace):
		_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
		<-d.done
	}
}

// nodeTools are the binaries a real node runs.
type nodeTools struct {
	kubelet, containerd, shim, ctr, runc, cniDir string
}

// findNodeTools finds the real node's binaries; the kubelet is releaseDir's
// if given (a cluster of another release, external.go).
func findNodeTools(releaseDir string) (nodeTools, error) {
	var t nodeTools
	var err error
	for _, x := range []struct {
		name string
		dst  *string
	}{{"kubelet", &t.kubelet}, {"containerd", &t.containerd}, {"containerd-shim-runc-v2", &t.shim}, {"ctr", &t.ctr}} {
		if x.name == "kubelet" && releaseDir != "" {
			t.kubelet = filepath.Join(releaseDir, "kubelet")
			continue
		}
		if *x.dst, err = Tool(x.name); err != nil {
			return t, fmt.Errorf("%w (`make e2e-node-tools` builds the real nodes' kubelet and containerd)", err)
		}
	}
	if t.runc, err = exec.LookPath("runc"); err != nil {
		return t, fmt.Errorf("%w: runc not in PATH (`make e2e-runtime`)", ErrMissing)
	}
	for _, dir := range []string{"/usr/lib/cni", "/opt/cni/bin"} {
		if isFile(filepath.Join(dir, "bridge")) && isFile(filepath.Join(dir, "host-local")) && isFile(filepath.Join(dir, "loopback")) {
			t.cniDir = dir
			return t, nil
		}
	}
	return t, fmt.Errorf("%w: CNI plugins bridge, host-local and loopback not in /usr/lib/cni nor /opt/cni/bin (`make e2e-runtime` installs containernetworking-plugins)", ErrMissing)
}

// startReal starts the node's containerd and kubelet and waits until the
// kubelet registered the Node and reports it Ready.
func (n *Node) startReal(ctx context.Context, seq int) (err error) {
	tools, err := findNodeTools(n.cluster.releaseDir)
	if err != nil {
		return err
	}
	c := n.cluster
	r := &realNode{
		n:           n,
		dir:         filepath.Join(n.Dir, "containerd"),
		kubeletRoot: filepath.Join(n.Dir, "kubelet"),
		bridge:      c.bridgeName(seq),     // clustercgroups.go: the cluster's reaper
		cgroupRoot:  c.nodeCgroupRoot(seq), // finds and removes both by these names
	}
	r.sock = filepath.Join(r.dir, "containerd.sock")
	if n.HostRoot != "" {
		r.kubeletRoot = filepath.Join(n.HostRoot, "var/lib/kubelet")
	}
	n.real = r
	defer func() {
		if err != nil {
			r.stop()
		}
	}()
	for _, d := range []string{r.dir, r.kubeletRoot, filepath.Join(n.Dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := r.setupNetwork(); err != nil {
		return fmt.Errorf("node %s network: %w", n.Name, err)
	}
	if err := r.setupCgroups(); err != nil {
		return fmt.Errorf("node %s cgroups: %w", n.Name, err)
	}
	if err := r.forwardAPIService(); err != nil { // podnet.go
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	if n.HostRoot != "" {
		if err := r.startHostNamespace(ctx); err != nil { // realnode_ns.go
			return err
		}
	}
	archives, err := c.nodeImageArchives()
	if err != nil {
		return err
	}
	if err := r.startContainerd(ctx, tools); err != nil {
		return fmt.Errorf("node %s containerd: %w", n.Name, err)
	}
	for _, a := range archives {
		out, err := exec.CommandContext(ctx, tools.ctr, "--address", r.sock, "--namespace", "k8s.io",
			"images", "import", "--snapshotter", "overlayfs", a).CombinedOutput()
		if err != nil {
			return fmt.Errorf("node %s: ctr images import %s: %v: %s", n.Name, a, err, out)
		}
	}
	if err := r.startKubelet(ctx, tools); err != nil {
		return fmt.Errorf("node %s kubelet: %w", n.Name, err)
	}
	return r.waitReady(ctx)
}

// setupNetwork creates the node's bridge with a free /24 whose first
// address is the node IP.
func (r *realNode) setupNetwork() error {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return err
	}
	taken := func(ip net.IP) bool {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.Contains(ip) {
				return true
			}
		}
		return false
	}
	for range 64 {
		ip := net.IPv4(10, byte(200+rand.IntN(8)), byte(rand.IntN(256)), 1).To4()
		if taken(ip) {
			continue
		}
		r.ip = ip
		r.subnet = &net.IPNet{IP: ip.Mask(net.CIDRMask(24, 32)), Mask: net.CIDRMask(24, 32)}
		break
	}
	if r.ip == nil {
		return fmt.Errorf("no free /24 in 10.200.0.0/13")
	}
	for _, args := range [][]string{
		{"link", "add", r.bridge, "type", "bridge"},
		{"addr", "add", r.ip.String() + "/24", "dev", r.bridge},
		{"link", "set", r.bridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// cgroupHierarchies are the mount points of this machine's cgroup
// hierarchies (v1 controllers, named ones, and a v2 one if mounted).
func cgroupHierarchies() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		for i, x := range fields {
			if x == "-" && i+1 < len(fields) && (fields[i+1] == "cgroup" || fields[i+1] == "cgroup2") {
				out = append(out, unescapeMountPath(fields[4]))
			}
		}
	}
	return out, sc.Err()
}

// setupCgroups creates the node's cgroupRoot in every hierarchy (the
// kubelet refuses a cgroupRoot that does not exist); a cpuset cgroup
// starts with the parent's CPUs and memory nodes.
func (r *realNode) setupCgroups() error {
	hs, err := cgroupHierarchies()
	if err != nil {
		return err
	}
	for _, h := range hs {
		dir := filepath.Join(h, r.cgroupRoot)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if data, err := os.ReadFile(filepath.Join(h, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), data, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(dir, f), err)
				}
			}
		}
	}
	return nil
}

// startContainerd writes the node's containerd configuration (see the
// file's doc), its base OCI spec and CNI network, and starts it.
func (r *realNode) startContainerd(ctx context.Context, tools nodeTools) error {
	baseSpec, err := r.writeBaseSpec(ctx, tools.ctr)
	if err != nil {
		return err
	}
	netDir := filepath.Join(r.dir, "net.d")
	if err := os.MkdirAll(netDir, 0o755); err != nil {
		return err
	}
	first := make(net.IP, 4)
	copy(first, r.subnet.IP.To4())
	first[3] = 10
	cni, err := json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "e2e-" + r.n.Name,
		"plugins": []map[string]any{{
			"type": "bridge", "bridge": r.bridge,
			// The bridge has its address already (the node IP); as a
			// gateway the plugin would also turn on IP forwarding for the
			// whole machine.
			"isGateway": false, "ipMasq": false, "hairpinMode": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"dataDir": filepath.Join(r.dir, "ipam"),
				"ranges":  [][]map[string]string{{{"subnet": r.subnet.String(), "rangeStart": first.String(), "gateway": r.ip.String()}}},
				// The Service range through the node (podnet.go).
				"routes": []map[string]string{{"dst": serviceCIDR}},
			},
		}},
	}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(netDir, "10-bridge.conflist"), cni, 0o644); err != nil {
		return err
	}
	registry, err := r.n.cluster.registry()
	if err != nil {
		return err
	}
	hostsDir := filepath.Join(r.dir, "certs.d")
	if err := os.MkdirAll(filepath.Join(hostsDir, "_default"), 0o755); err != nil {
		return err
	}
	hosts := "server = " + strconv.Quote("http://"+registry) + "\n"
	if err := os.WriteFile(filepath.Join(hostsDir, "_default", "hosts.toml"), []byte(hosts), 0o644); err != nil {
		return err
	}
	q := strconv.Quote
	// The runtimes containerd knows: runc, and with NodeOptions.NvidiaRuntime
	// also `nvidia` as the default, as the GPU Operator's toolkit configures
	// containerd: the same runc shim with nvidia-container-runtime as its
	// binary, which edits the bundle on `create` and hands every command to
	// runc (same --root, so containers of both runtimes share runc's state).
	defaultRuntime := "runc"
	runtimeBinaries := [][2]string{{"runc", tools.runc}}
	env := []string{"PATH=" + filepath.Dir(tools.shim) + ":" + os.Getenv("PATH")}
	if r.n.opts.NvidiaRuntime {
		if r.nvidia, err = newNvidiaRuntime(r.n, tools.runc); err != nil {
			return err
		}
		defaultRuntime = "nvidia"
		runtimeBinaries = append(runtimeBinaries, [2]string{"nvidia", r.nvidia.bin})
		// The shims inherit containerd's environment, and the runtime reads
		// its config from here.
		env = append(env, "NVIDIA_CTK_CONFIG_FILE_PATH="+r.nvidia.config)
	}
	var runtimes []string
	for _, rt := range runtimeBinaries {
		section := `[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.` + rt[0] + `]`
		runtimes = append(runtimes,
			section,
			`  runtime_type = "io.containerd.runc.v2"`,
			`  base_runtime_spec = `+q(baseSpec),
			strings.TrimSuffix(section, "]")+`.options]`,
			`  BinaryName = `+q(rt[1]),
			`  Root = `+q(filepath.Join(r.n.Dir, "runc")),
			`  SystemdCgroup = false`)
	}
	config := strings.Join([]string{
		`version = 3`,
		`root = ` + q(filepath.Join(r.dir, "root")),
		`state = ` + q(filepath.Join(r.dir, "state")),
		`imports = []`,
		// Machine-wide paths these plugins would use; nothing here needs them.
		`disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]`,
		`[grpc]`,
		`  address = ` + q(r.sock),
		`[ttrpc]`,
		`  address = ` + q(r.sock+".ttrpc"),
		`[plugins."io.containerd.nri.v1.nri"]`,
		`  disable = true`,
		`[plugins."io.containerd.grpc.v1.cri"]`,
		`  stream_server_address = "127.0.0.1"`,
		`  stream_server_port = "0"`,
		`[plugins."io.containerd.cri.v1.images"]`,
		`  snapshotter = "overlayfs"`,
		// A pulled layer's compressed blob goes once it is unpacked: a
		// node with the driver's image keeps about 70 MiB less.
		`  discard_unpacked_layers = true`,
		// Every registry host resolves to the cluster's registry (hosts.toml).
		`[plugins."io.containerd.cri.v1.images".registry]`,
		`  config_path = ` + q(hostsDir),
		`[plugins."io.containerd.cri.v1.images".pinned_images]`,
		`  sandbox = ` + q(PauseImageName),
		// CDI is always on in containerd 2 (`enable_cdi` is gone); the
		// node's CDI root is the only spec folder.
		`[plugins."io.containerd.cri.v1.runtime"]`,
		`  cdi_spec_dirs = [` + q(r.n.CDIRoot) + `]`,
		`  netns_mounts_under_state_dir = true`,
		// This machine refuses a negative oom_score_adj (writing one fails
		// with EIO), which the kubelet asks for sandboxes (-998) and
		// Guaranteed pods; containerd then keeps scores at or above its own.
		`  restrict_oom_score_adj = true`,
		`[plugins."io.containerd.cri.v1.runtime".containerd]`,
		`  default_runtime_name = ` + q(defaultRuntime),
		strings.Join(runtimes, "\n"),
		`[plugins."io.containerd.cri.v1.runtime".cni]`,
		`  bin_dirs = [` + q(tools.cniDir) + `]`,
		`  conf_dir = ` + q(netDir),
		`  max_conf_num = 1`,
	}, "\n") + "\n"
	configPath := filepath.Join(r.dir, "config.toml")
	if err := os.WriteFile(configPath, []byte(config), 0o644); err != nil {
		return err
	}
	// The shim is found next to containerd's binary on PATH.
	d, err := startDaemon(r.n.cluster, "containerd", filepath.Join(r.n.Dir, "containerd.log"), env,
		r.nodeCommand([]string{tools.containerd, "--config", configPath})...)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.containerd = d
	r.mu.Unlock()
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		if !d.running() {
			return false, fmt.Errorf("containerd exited; log:\n%s", tail(filepath.Join(r.n.Dir, "containerd.log"), 40))
		}
		return exec.CommandContext(ctx, tools.ctr, "--address", r.sock, "version").Run() == nil, nil
	})
}

// writeBaseSpec writes the node's base OCI spec: containerd's default
// (`ctr oci spec`) without rlimits (this machine refuses raising
// RLIMIT_NOFILE; containerd drops them too when it has no base spec) and
// with the node's simulator state at SimStateMount, read-only: it stands
// for the kernel driver, which every process of a node shares (see
// SimStateMount); never part of our CDI specs, which are the product.
func (r *realNode) writeBaseSpec(ctx context.Context, ctr string) (string, error) {
	out, err := exec.CommandContext(ctx, ctr, "oci", "spec").Output()
	if err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	var spec rspec.Spec
	if err := json.Unmarshal(out, &spec); err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	spec.Process.Rlimits = nil
	spec.Mounts = append(spec.Mounts, rspec.Mount{
		Destination: SimStateMount, Type: "bind", Source: filepath.Join(r.n.SimRoot(), "etc", "gpu-sim"),
		Options: []string{"rbind", "ro", "nosuid", "nodev"},
	})
	spec.Mounts = append(spec.Mounts, r.hostTreeBaseMounts()...) // realnode_ns.go
	if err := os.MkdirAll(filepath.Join(r.n.SimRoot(), "etc", "gpu-sim"), 0o755); err != nil {
		return "", err
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return "", err
	}
	p := filepath.Join(r.dir, "base-spec.json")
	return p, os.WriteFile(p, data, 0o644)
}

// startKubelet writes the kubelet's credentials, kubeconfig and
// configuration and starts it.
func (r *realNode) startKubelet(ctx context.Context, tools nodeTools) error {
	n, c := r.n, r.n.cluster
	pki := filepath.Join(n.Dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		return err
	}
	caFile, err := c.CA.writeFile(pki)
	if err != nil {
		return err
	}
	// The Node authorizer and NodeRestriction admission know a kubelet by
	// this identity.
	clientCert, clientKey, err := c.CA.issue(pki, "kubelet-client", certRequest{
		commonName: "system:node:" + n.Name, groups: []string{"system:nodes"}, client: true,
	})
	if err != nil {
		return err
	}
	servingCert, servingKey, err := c.CA.issue(pki, "kubelet-serving", certRequest{
		commonName: "system:node:" + n.Name, server: true, dnsNames: []string{n.Name}, ips: []net.IP{r.ip},
	})
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(n.Dir, "kubelet.kubeconfig")
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["e2e"] = &clientcmdapi.Cluster{Server: c.Host, CertificateAuthority: caFile}
	cfg.AuthInfos["kubelet"] = &clientcmdapi.AuthInfo{ClientCertificate: clientCert, ClientKey: clientKey}
	cfg.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: "kubelet"}
	cfg.CurrentContext = "e2e"
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		return err
	}
	// A node powered on again (realnode_reboot.go) keeps its port.
	if r.port == 0 {
		if r.port, err = freePortOn(r.ip); err != nil {
			return err
		}
	}
	taints := []map[string]string{}
	for _, t := range n.opts.Taints {
		taints = append(taints, map[string]string{"key": t.Key, "value": t.Value, "effect": string(t.Effect)})
	}
	config := map[string]any{
		"apiVersion": "kubelet.config.k8s.io/v1beta1",
		"kind":       "KubeletConfiguration",
		// This machine's cgroups are v1 (cgroup v2 is not mounted); the
		// kubelet of this release refuses to start there unless told so.
		"failCgroupV1":  false,
		"cgroupDriver":  "cgroupfs",
		"cgroupRoot":    r.cgroupRoot,
		"cgroupsPerQOS": true,
		"failSwapOn":    false,
		"address":       r.ip.String(),
		"port":          r.port,
		"readOnlyPort":  0,
		"healthzPort":   0,
		"tlsCertFile":   servingCert, "tlsPrivateKeyFile": servingKey,
		"authentication": map[string]any{
			"anonymous": map[string]any{"enabled": false},
			"webhook":   map[string]any{"enabled": true},
			"x509":      map[string]any{"clientCAFile": caFile},
		},
		"authorization":            map[string]any{"mode": "Webhook"},
		"containerRuntimeEndpoint": "unix://" + r.sock,
		"imageServiceEndpoint":     "unix://" + r.sock,
		"podLogsDir":               filepath.Join(n.Dir, "pod-logs"),
		"volumePluginDir":          filepath.Join(r.kubeletRoot, "volume-plugins"),
		"resolvConf":               "",
		"registerWithTaints":       taints,
		// This machine's disk may be fuller than the kubelet's default
		// eviction and image GC thresholds; no test here is about either.
		"evictionHard":                  map[string]string{"memory.available": "1Mi"},
		"imageGCHighThresholdPercent":   100,
		"imageGCLowThresholdPercent":    99,
		"localStorageCapacityIsolation": false,
		"nodeStatusReportFrequency":     "10s",
		// The kubelet retries a pod whose DRA prepare failed only at its
		// periodic sync (default 1 min): 10 s lets a test see the retry
		// (the next claim's error, the prepare after a plugin restart).
		"syncFrequency":       "10s",
		"serializeImagePulls": false,
	}
	// The kubelet's restart back-off (10 s, doubling) capped at 2 s: a
	// test watching restarts sees them within seconds. The setting needs
	// KubeletCrashLoopBackOffMax, on by default from 1.35; an older
	// release's kubelet keeps its default back-off (a node of that release
	// as users run it).
	if minor, err := releaseMinorOf(tools.kubelet); err != nil {
		return err
	} else if minor >= 35 {
		config["crashLoopBackOff"] = map[string]any{"maxContainerRestartPeriod": "2s"}
	}
	data, err := yaml.Marshal(config)
	if err != nil {
		return err
	}
	configPath := filepath.Join(n.Dir, "kubelet-config.yaml")
	if err := os.WriteFile(configPath, data, 0o644); err != nil {
		return err
	}
	var labels []string
	for k, v := range n.opts.Labels {
		labels = append(labels, k+"="+v)
	}
	sort.Strings(labels)
	args := []string{tools.kubelet,
		"--config=" + configPath,
		"--kubeconfig=" + kubeconfig,
		"--hostname-override=" + n.Name,
		"--node-ip=" + r.ip.String(),
		"--root-dir=" + r.kubeletRootDir(),
		"--cert-dir=" + pki,
		"--v=2",
	}
	if len(labels) > 0 {
		args = append(args, "--node-labels="+strings.Join(labels, ","))
	}
	d, err := startDaemon(r.n.cluster, "kubelet", filepath.Join(n.Dir, "kubelet.log"), nil, r.nodeCommand(args)...)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.kubelet = d
	r.mu.Unlock()
	return nil
}

func freePortOn(ip net.IP) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip.String(), "0"))
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitReady waits until the kubelet registered the Node and reports it
// Ready, and kube-controller-manager's node lifecycle controller lifted the
// not-ready taint that admission put on the new Node.
func (r *realNode) waitReady(ctx context.Context) error {
	nodes := r.n.cluster.Client.CoreV1().Nodes()
	var last string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 120*time.Second, true, func(ctx context.Context) (bool, error) {
		if !r.kubelet.running() {
			return false, fmt.Errorf("kubelet exited")
		}
		node, err := nodes.Get(ctx, r.n.Name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		ready := false
		for _, cond := range node.Status.Conditions {
			if cond.Type == v1.NodeReady {
				last = fmt.Sprintf("Ready=%s %s: %s", cond.Status, cond.Reason, cond.Message)
				ready = cond.Status == v1.ConditionTrue
			}
		}
		for _, t := range node.Spec.Taints {
			if t.Key == v1.TaintNodeNotReady {
				last += "; taint " + t.ToString()
				return false, nil
			}
		}
		return ready, nil
	})
	if err != nil {
		return fmt.Errorf("node %s not ready: %w (last: %s); kubelet log:\n%s", r.n.Name, err, last,
			tail(filepath.Join(r.n.Dir, "kubelet.log"), 40))
	}
	return nil
}

// driverRegistered says whether the kubelet accepted the driver's current
// plugin process: the kubelet tells the plugin (NotifyRegistrationStatus)
// once its DRA handler registered it, and our plugin logs that (a process
// before a restart logged it too: only the current one's log counts).
func (r *realNode) driverRegistered() bool {
	if p := r.n.Plugin; p != nil {
		return p.Running() && strings.Contains(p.CurrentLog(), "registered with the kubelet")
	}
	// A deployed plugin: a running DaemonSet pod of the node said so.
	for _, d := range r.n.DaemonPods() { // daemonpods.go
		if d.Pod.DeletionTimestamp == nil && d.Running() && strings.Contains(d.Log(), "registered with the kubelet") {
			return true
		}
	}
	return false
}

// stopWorkloads stops the kubelet, then every pod through CRI (containers
// killed, CNI releasing the pods' addresses, sandbox mounts gone).
func (r *realNode) stopWorkloads() {
	r.mu.Lock()
	kubelet := r.kubelet
	containerd := r.containerd
	r.mu.Unlock()
	kubelet.stop(10 * time.Second)
	if containerd == nil || !containerd.running() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+r.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		r.n.logger.Error(err, "CRI client")
		return
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		r.n.logger.Error(err, "CRI ListPodSandbox")
		return
	}
	for _, s := range list.Items {
		if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.Id}); err != nil {
			r.n.logger.Error(err, "CRI StopPodSandbox", "sandbox", s.Id)
		}
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
			r.n.logger.Error(err, "CRI RemovePodSandbox", "sandbox", s.Id)
		}
	}
}

// stop stops whatever is left after stopWorkloads: containerd, stray shims
// and container processes, mounts, cgroups, the bridge. Idempotent.
func (r *realNode) stop() {
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	r.stopped = true
	kubelet, containerd := r.kubelet, r.containerd
	r.mu.Unlock()
	kubelet.stop(10 * time.Second)
	containerd.stop(10 * time.Second)
	for _, pid := range r.strayProcesses() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	// Killed processes leave their cgroups only once reaped.
	_ = wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return len(r.strayProcesses()) == 0, nil
	})
	for _, m := range mountsUnder(r.n.Dir) {
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
	if hs, err := cgroupHierarchies(); err == nil {
		for _, h := range hs {
			removeCgroupTree(filepath.Join(h, r.cgroupRoot))
		}
	}
	r.stopHostNamespace() // realnode_ns.go
	r.removeAPIService()  // podnet.go
	if r.bridge != "" {
		if _, err := net.InterfaceByName(r.bridge); err == nil {
			_ = exec.Command("ip", "link", "del", r.bridge).Run()
		}
	}
}

// strayProcesses are the node's shims (started with containerd's address)
// and container processes (their root under the node's folder, or in the
// node's cgroups).
func (r *realNode) strayProcesses() []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-address" && args[i+1] == r.sock {
				out = append(out, pid)
				break
			}
		}
	}
	out = append(out, ContainerProcesses(r.n.Dir)...)
	// A container whose root mount was detached no longer shows it; its
	// cgroup still says whose it is.
	if hs, err := cgroupHierarchies(); err == nil {
		for _, h := range hs {
			_ = filepath.WalkDir(filepath.Join(h, r.cgroupRoot), func(p string, d os.DirEntry, err error) error {
				if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
					return nil
				}
				data, _ := os.ReadFile(p)
				for _, f := range strings.Fields(string(data)) {
					if pid, err := strconv.Atoi(f); err == nil && !slices.Contains(out, pid) {
						out = append(out, pid)
					}
				}
				return nil
			})
		}
	}
	return out
}

// removeCgroupTree removes a cgroup and its descendants, deepest first.
func removeCgroupTree(dir string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if e.IsDir() {
			removeCgroupTree(filepath.Join(dir, e.Name()))
		}
	}
	_ = os.Remove(dir)
}

// mountsUnder lists the mount points under dir, deepest first.
func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		if p := unescapeMountPath(fields[4]); strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// RealNodeLeftovers lists what a stopped real node left on this machine:
// its kubelet or containerd still running, shims or container processes,
// mounts under its folder, its cgroups, its bridge. Empty for other nodes.
func (n *Node) RealNodeLeftovers() []string {
	r := n.real
	if r == nil {
		return nil
	}
	var left []string
	r.mu.Lock()
	for _, d := range []*daemon{r.kubelet, r.containerd} {
		if d != nil && d.running() {
			left = append(left, fmt.Sprintf("%s (pid %d) running", d.name, d.cmd.Process.Pid))
		}
	}
	r.mu.Unlock()
	left = append(left, r.hostNamespaceLeft()...)
	left = append(left, r.apiServiceLeft()...)
	left = append(left, r.leftovers(r.strayProcesses())...)
	if r.bridge != "" {
		if _, err := net.InterfaceByName(r.bridge); err == nil {
			left = append(left, "network link "+r.bridge)
		}
	}
	return left
}

// leftovers names pids (with their command lines), the mounts under the
// node's folder and the node's cgroups that still exist.
func (r *realNode) leftovers(pids []int) []string {
	var left []string
	for _, pid := range pids {
		cmd, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		left = append(left, fmt.Sprintf("process %d: %s", pid, strings.ReplaceAll(strings.TrimRight(string(cmd), "\x00"), "\x00", " ")))
	}
	for _, m := range mountsUnder(r.n.Dir) {
		left = append(left, "mount "+m)
	}
	if hs, err := cgroupHierarchies(); err == nil {
		for _, h := range hs {
			if isDir(filepath.Join(h, r.cgroupRoot)) {
				left = append(left, "cgroup "+filepath.Join(h, r.cgroupRoot))
			}
		}
	}
	return left
}

// KubeletLog is a real node's kubelet log so far ("" for other nodes).
func (n *Node) KubeletLog() string {
	b, _ := os.ReadFile(filepath.Join(n.Dir, "kubelet.log"))
	return string(b)
}

// IsReal says whether the node runs the real kubelet and containerd.
func (n *Node) IsReal() bool { return n.real != nil }

// tail is the last lines of a file, for error messages.
func tail(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// PodResourcesSocket is the socket of a real node's kubelet PodResources API
// (the kubelet serves it under its root dir, pod-resources/kubelet.sock, as
// dcgm-exporter and device monitoring agents read it); "" for other nodes.
func (n *Node) PodResourcesSocket() string {
	if n.real == nil {
		return ""
	}
	return filepath.Join(n.real.kubeletRoot, "pod-resources", "kubelet.sock")
}
