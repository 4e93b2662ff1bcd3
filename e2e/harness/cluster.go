// Package harness runs a real Kubernetes control plane in one Go process and
// simulated GPU nodes next to it, so our node plugin and webhook meet the real
// kube-apiserver, kube-scheduler, resourceclaim controller and the kubelet's
// own plugin watcher and DRA manager.
//
// Invariants: everything a Cluster starts lives under Cluster.Dir and stops
// with Cluster.Stop (containers included), or, when the process ends
// without Stop (killed, interrupted twice, a test timeout), with the
// cluster's reaper (reaper.go); nothing listens on anything but
// 127.0.0.1; nothing here fakes a Kubernetes component between the API and
// the container runtime: the kubelet's DRA manager prepares the claims, and
// the containers run with runc after the CDI library applied their CDI
// devices (see runtime.go).
package harness

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"google.golang.org/grpc/grpclog"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/scheduler"
	"k8s.io/kubernetes/pkg/scheduler/profile"
)

var metav1GetOptions = metav1.GetOptions{}

// klogOwner says whether a cluster of this process has klog's output.
var klogOwner struct {
	sync.Mutex
	taken bool
}

// Options configure a Cluster.
type Options struct {
	// Dir holds all state (etcd data, certificates, kubeconfigs, node
	// directories, logs). Empty: a new temporary directory, removed by Stop
	// (or by the cluster's reaper when the process ends without Stop).
	Dir string
	// Logf receives progress lines (test logger or stdout). Nil: discarded.
	Logf func(format string, args ...any)
	// Verbose sends the control plane's own logs to stderr instead of
	// Dir/control-plane.log.
	Verbose bool
	// FeatureGates are set on the API server (`--feature-gates`). The
	// control plane runs in this process, whose feature gates are global:
	// the scheduler and controller manager see the same, and so does every
	// other cluster of the process (a package of tests sets them once).
	FeatureGates map[string]bool
	// ReleaseDir holds another Kubernetes release's kube-apiserver,
	// kube-controller-manager, kube-scheduler and kubelet (external.go):
	// the control plane runs them as processes, real nodes that kubelet.
	// Empty: $E2E_K8S_RELEASE_DIR; neither: the in-process control plane
	// and .tools/bin/kubelet.
	ReleaseDir string
}

// Cluster is a running in-process control plane.
type Cluster struct {
	// Dir holds the cluster's state.
	Dir string
	// CA signs every serving certificate of this cluster.
	CA *CA
	// Host is the apiserver URL (https://127.0.0.1:<port>).
	Host string
	// AdminConfig is a rest.Config with cluster-admin rights.
	AdminConfig *rest.Config
	// Client is a typed admin client.
	Client kubernetes.Interface
	// Dynamic is an untyped admin client (for applying YAML).
	Dynamic dynamic.Interface
	// Mapper maps kinds to resources, refreshed on cache misses.
	Mapper *restmapper.DeferredDiscoveryRESTMapper
	// Kubeconfig is the path of an admin kubeconfig for kubectl.
	Kubeconfig string

	logf      func(format string, args ...any)
	ownDir    bool
	tag       string         // names the cluster's cgroups and bridges (clusterTag)
	placement *placement     // where its processes start (clustercgroups.go); nil: no cgroups
	reaper    *reaper        // reaper.go; nil until started
	record    *clusterRecord // what a sweep removes; nil until the reaper started
	cancel    context.CancelFunc
	etcd      *embed.Etcd
	apiserver *apiserver
	logFile   *os.File
	ownsKlog  bool
	// releaseDir holds the binaries of the release the cluster runs as
	// processes (external.go); "" for the in-process control plane.
	releaseDir string

	mu            sync.Mutex
	imageRegistry *imageRegistry // registry.go; nil until a real node needs it
	nodes         map[string]*Node
	driver        *Driver
	nodeSeq       int
	stops         []func()
	wg            sync.WaitGroup

	// The driver's image pushed to imageRegistry (imagepods.go), once.
	driverImageOnce sync.Once
	driverImageRef  string
	driverImageErr  error
}

// Start brings up etcd, kube-apiserver, kube-scheduler and
// kube-controller-manager's default controllers, and writes an admin
// kubeconfig.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	c = &Cluster{Dir: opts.Dir, logf: opts.Logf, nodes: map[string]*Node{}, releaseDir: opts.ReleaseDir}
	if c.releaseDir == "" {
		c.releaseDir = os.Getenv(ReleaseDirEnv)
	}
	if c.releaseDir != "" {
		if c.releaseDir, err = filepath.Abs(c.releaseDir); err != nil {
			return nil, err
		}
		if err := checkReleaseDir(c.releaseDir); err != nil {
			return nil, err
		}
	}
	if c.logf == nil {
		c.logf = func(string, ...any) {}
	}
	if c.Dir == "" {
		c.Dir, err = os.MkdirTemp("", "e2e-")
		if err != nil {
			return nil, err
		}
		c.ownDir = true
	}
	if c.Dir, err = filepath.Abs(c.Dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	if err := checkFreeSpace(c.Dir); err != nil { // diskspace.go
		if c.ownDir {
			os.Remove(c.Dir)
		}
		return nil, err
	}
	ctx, c.cancel = context.WithCancel(ctx)
	c.wg.Add(1)
	go func() { defer c.wg.Done(); watchFreeSpace(ctx, c.Dir) }()
	// `return nil, err` clears c before deferred calls run: stop what was started.
	self := c
	defer func() {
		if err != nil {
			self.Stop()
		}
	}()
	// Dead clusters' leftovers first (their reapers were killed too), then
	// this cluster's reaper, before anything of it exists outside Dir.
	sweepStale(c.logf)
	c.tag = clusterTag(c.Dir)
	rec := clusterRecord{
		Dir: c.Dir, Cgroups: clusterCgroupDirs(c.Dir), BridgePrefix: bridgePrefix(c.Dir),
		RemoveDir: c.ownDir && os.Getenv("E2E_KEEP_DIR") == "", Pid: os.Getpid(),
	}
	if c.reaper, err = startReaper(rec); err != nil {
		return nil, fmt.Errorf("cluster reaper: %w", err)
	}
	c.record = &rec
	if c.placement, err = newPlacement(c.Dir); err != nil {
		return nil, fmt.Errorf("cluster cgroups: %w", err)
	}
	if !opts.Verbose {
		c.logFile, err = os.Create(filepath.Join(c.Dir, "control-plane.log"))
		if err != nil {
			return nil, err
		}
		// klog is process-wide: the first cluster of the process takes it
		// (a second one, e.g. a test's own, logs into the first one's file).
		klogOwner.Lock()
		if !klogOwner.taken {
			klogOwner.taken, c.ownsKlog = true, true
			quietKlog()
			klog.SetOutput(c.logFile)
			grpclog.SetLoggerV2(grpclog.NewLoggerV2(c.logFile, c.logFile, c.logFile))
		}
		klogOwner.Unlock()
	}

	started := time.Now()
	c.CA, err = NewCA()
	if err != nil {
		return nil, err
	}
	var etcdURL string
	c.etcd, etcdURL, err = startEtcd(filepath.Join(c.Dir, "etcd"))
	if err != nil {
		return nil, err
	}
	apiDir := filepath.Join(c.Dir, "apiserver")
	if err := os.MkdirAll(apiDir, 0o700); err != nil {
		return nil, err
	}
	if c.releaseDir != "" {
		c.apiserver, err = c.startExternalAPIServer(apiDir, etcdURL, opts.FeatureGates)
	} else {
		c.apiserver, err = startAPIServer(ctx, apiDir, etcdURL, c.CA, opts.FeatureGates)
	}
	if err != nil {
		return nil, err
	}
	c.Host = c.apiserver.host
	c.AdminConfig = c.TokenConfig(adminToken)
	if err := c.apiserver.waitHealthy(ctx, c.AdminConfig); err != nil {
		return nil, err
	}
	if c.Client, err = kubernetes.NewForConfig(c.AdminConfig); err != nil {
		return nil, err
	}
	if c.Dynamic, err = dynamic.NewForConfig(c.AdminConfig); err != nil {
		return nil, err
	}
	c.Mapper = restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.Client.Discovery()))
	c.Kubeconfig = filepath.Join(c.Dir, "kubeconfig")
	if err := c.WriteKubeconfig(c.Kubeconfig, "e2e-admin", adminToken); err != nil {
		return nil, err
	}
	c.logf("control plane: apiserver %s up in %s", c.Host, time.Since(started).Round(time.Millisecond))

	if c.releaseDir != "" {
		if err := c.startExternalControllers(opts.FeatureGates); err != nil {
			return nil, err
		}
		if err := c.waitControllersUp(ctx); err != nil {
			return nil, err
		}
	} else {
		if err := c.startControllerManager(ctx); err != nil { // controllermanager.go
			return nil, err
		}
		if err := c.startScheduler(ctx); err != nil {
			return nil, err
		}
	}
	c.logf("control plane: scheduler and controllers running (%s)", time.Since(started).Round(time.Millisecond))
	return c, nil
}

// quietKlog stops klog copying errors to stderr: the control plane logs
// plenty of expected errors while starting and stopping.
func quietKlog() {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false", "stderrthreshold": "FATAL", "one_output": "true"} {
		_ = fs.Set(k, v)
	}
}

// APIRequests is how many requests the API server has served since it
// started, by user agent, verb and resource (APIRequestKind); subtract two
// snapshots for the requests of a window. Empty for a release run as
// processes (external.go), whose requests are not counted.
func (c *Cluster) APIRequests() map[APIRequestKind]int {
	if c.apiserver.requests == nil {
		return map[APIRequestKind]int{}
	}
	return c.apiserver.requests.snapshot()
}

// TokenConfig is a rest.Config for the given bearer token, trusting the cluster CA.
func (c *Cluster) TokenConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            c.Host,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.CA.CertPEM},
		QPS:             1000,
		Burst:           2000,
	}
}

// WriteKubeconfig writes a kubeconfig for a bearer token.
func (c *Cluster) WriteKubeconfig(path, user, token string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["e2e"] = &clientcmdapi.Cluster{Server: c.Host, CertificateAuthorityData: c.CA.CertPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = "e2e"
	return clientcmd.WriteToFile(*cfg, path)
}

func (c *Cluster) startScheduler(ctx context.Context) error {
	factory := scheduler.NewInformerFactory(c.Client, 0, nil)
	dynFactory := dynamicinformer.NewFilteredDynamicSharedInformerFactory(c.Dynamic, 0, v1.NamespaceAll, nil)
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: c.Client.EventsV1()})
	sched, err := scheduler.New(ctx, c.Client, factory, dynFactory,
		profile.NewRecorderFactory(broadcaster),
		scheduler.WithKubeConfig(c.AdminConfig),
	)
	if err != nil {
		return fmt.Errorf("kube-scheduler: %w", err)
	}
	broadcaster.StartRecordingToSink(ctx.Done())
	factory.Start(ctx.Done())
	dynFactory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	dynFactory.WaitForCacheSync(ctx.Done())
	if err := sched.WaitForHandlersSync(ctx); err != nil {
		return fmt.Errorf("kube-scheduler handlers: %w", err)
	}
	c.wg.Add(1)
	go func() { defer c.wg.Done(); sched.Run(ctx) }()
	return nil
}

// Stop stops the nodes (and their plugin processes), the control plane and
// etcd, then sweeps (reaper.go): whatever still runs in the cluster's
// cgroups is killed, mounts under Dir, the cluster's cgroups and bridges
// go, and Dir too if Start created it (unless E2E_KEEP_DIR is set).
func (c *Cluster) Stop() {
	c.mu.Lock()
	nodes := c.nodes
	c.nodes = map[string]*Node{}
	c.mu.Unlock()
	for _, n := range nodes {
		n.Stop()
	}
	c.mu.Lock()
	stops := c.stops
	c.stops = nil
	c.mu.Unlock()
	for _, stop := range stops {
		stop()
	}
	if c.cancel != nil {
		c.cancel()
	}
	if c.apiserver != nil {
		select {
		case <-c.apiserver.errCh:
		case <-time.After(30 * time.Second):
		}
	}
	done := make(chan struct{})
	go func() { c.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
	}
	if c.etcd != nil {
		c.etcd.Close()
	}
	if c.ownsKlog {
		klog.Flush()
		klog.SetOutput(os.Stderr)
		klog.LogToStderr(true)
		klogOwner.Lock()
		klogOwner.taken = false
		klogOwner.Unlock()
	}
	if c.logFile != nil {
		c.logFile.Close()
	}
	c.placement.close()
	if c.record == nil {
		if c.ownDir && os.Getenv("E2E_KEEP_DIR") == "" {
			os.RemoveAll(c.Dir)
		}
		return
	}
	rep := c.record.sweep()
	// The cluster's own cgroups are always there; anything else is what the
	// graceful stop missed.
	if rep.processes+rep.mounts+rep.bridges+rep.files > 0 {
		c.logf("stop: removed what the nodes' stop left: %s", rep)
	}
	if len(rep.left) > 0 {
		c.logf("stop: left on this machine: %s", strings.Join(rep.left, "; "))
	}
	c.reaper.finish()
	c.reaper, c.record = nil, nil
}
