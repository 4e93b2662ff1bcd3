package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	podutil "k8s.io/kubernetes/pkg/api/v1/pod"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// CDIAnnotation is the pod annotation where a simulated node records, per
// container, the CDI device IDs the kubelet's DRA manager would hand to the
// container runtime: a JSON object {"<container>": ["vendor/class=name", ...]}.
const CDIAnnotation = "e2e.gpu-dra/cdi-devices"

// NodeOptions describe one simulated node.
type NodeOptions struct {
	// Name of the Node object.
	Name string
	// Labels added to the Node object (kubernetes.io/hostname is always set).
	Labels map[string]string
	// NoContainers: pods are marked Running once their claims are prepared
	// and no container runs (for the scale benchmark: hundreds of pods on a
	// few cores). Otherwise every container runs with runc (see runtime.go).
	NoContainers bool
	// Layout says where the node's host lives and where the simulated driver
	// sits in it (see Layout). Empty: LayoutProcess.
	Layout Layout
	// NvidiaRuntime: containers run through NVIDIA's nvidia-container-runtime
	// (mode cdi, wrapping runc, with the node's nvidia.com/gpu spec), as on a
	// GPU Operator node, so NVIDIA_VISIBLE_DEVICES in a container's env adds
	// GPUs (see nvidiaruntime.go). LayoutProcess nodes only.
	NvidiaRuntime bool
	// RealKubelet asks for a real node: the kubelet and containerd as
	// processes instead of the pod loop and runtime of this file (see
	// realnode.go), failing where the node cannot be one. Every node with
	// containers is real unless PodLoop says otherwise (nodes of a deployed
	// Layout always are: their plugin is the chart's DaemonSet pod, in the
	// node's mount namespace, realnode_ns.go), so only tests that insist set it.
	RealKubelet bool
	// PodLoop keeps a LayoutProcess node on the harness's pod loop and
	// runtime (this file, runtime.go) instead of the real kubelet and
	// containerd: for the test of that runtime's own CDI handling
	// (TestBrokenCDISpecFailsTheContainer, see e2e/README.md). Nodes with
	// NoContainers (the scale benchmark) always run it.
	PodLoop bool
	// Taints the kubelet registers a real node with (RealKubelet only).
	Taints []v1.Taint
}

// Node is a simulated node: a Node object kept Ready, the kubelet's plugin
// manager watching RegistrarDir, the kubelet's DRA manager (checkpoint in
// StateDir), a pod loop doing what the kubelet does for DRA, and a container
// runtime (runc, with the CDI library applying the claims' CDI devices).
type Node struct {
	// Name of the Node object.
	Name string
	// Dir holds everything of this node.
	Dir string
	// RegistrarDir is what the kubelet's plugin watcher watches (the node's
	// /var/lib/kubelet/plugins_registry).
	RegistrarDir string
	// PluginsDir is the node's /var/lib/kubelet/plugins.
	PluginsDir string
	// CDIRoot is the node's /var/run/cdi.
	CDIRoot string
	// StateDir holds the DRA manager's checkpoint.
	StateDir string
	// HostRoot is the directory tree standing for this node's host "/" when
	// the node plugin runs deployed (LayoutHostDriver, LayoutContainerDriver);
	// empty for LayoutProcess. Host paths named by the plugin (its registration
	// endpoint, CDI specs) resolve inside it.
	HostRoot string
	// Layout is the node's layout.
	Layout Layout

	// Plugin is our node plugin process, once started (see StartPlugin).
	Plugin *PluginProcess

	cluster *Cluster
	opts    NodeOptions
	simRoot string
	real    *realNode // nil unless NodeOptions.RealKubelet
	runtime *runtime  // nil with NodeOptions.NoContainers
	dra     *dra.Manager
	pods    corelisters.PodLister
	queue   workqueue.TypedRateLimitingInterface[string]
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	logger  klog.Logger

	draErrMu sync.Mutex
	draErrs  []string
}

// AddNode creates a Node object and starts the node's kubelet pieces.
func (c *Cluster) AddNode(ctx context.Context, opts NodeOptions) (*Node, error) {
	// Socket paths (registration, DRA, MPS control pipes) must stay under
	// 108 bytes, so node directories are short: n<index>.
	c.mu.Lock()
	c.nodeSeq++
	seq := c.nodeSeq
	dir := filepath.Join(c.Dir, fmt.Sprintf("n%d", seq))
	c.mu.Unlock()
	n := &Node{
		Name:         opts.Name,
		Dir:          dir,
		RegistrarDir: filepath.Join(dir, "reg"),
		PluginsDir:   filepath.Join(dir, "plugins"),
		CDIRoot:      filepath.Join(dir, "cdi"),
		StateDir:     filepath.Join(dir, "dra-state"),
		Layout:       opts.Layout,
		cluster:      c,
		simRoot:      filepath.Join(dir, "sim"),
		logger:       klog.LoggerWithValues(klog.Background(), "node", opts.Name),
		opts:         opts,
	}
	if opts.RealKubelet && opts.PodLoop {
		return nil, fmt.Errorf("node %s: RealKubelet and PodLoop both set; a node runs one of them", opts.Name)
	}
	// Real unless it cannot be (see NodeOptions.PodLoop).
	if !opts.PodLoop && opts.Layout == LayoutProcess && !opts.NoContainers {
		opts.RealKubelet = true
		n.opts = opts
	}
	if opts.NvidiaRuntime && (opts.Layout != LayoutProcess || opts.NoContainers) {
		return nil, fmt.Errorf("node %s: NVIDIA's runtime runs containers of nodes whose plugin runs as a process (LayoutProcess, containers on)", opts.Name)
	}
	if opts.Layout != LayoutProcess {
		if opts.NoContainers {
			return nil, fmt.Errorf("node %s: a deployed node plugin needs the container runtime", opts.Name)
		}
		// A real node with its host tree (realnode_ns.go), which the chart's
		// DaemonSet selects (DeployedPluginLabel).
		opts.RealKubelet = true
		labels := map[string]string{DeployedPluginLabel: "deployed"}
		for k, v := range opts.Labels {
			labels[k] = v
		}
		opts.Labels = labels
		n.opts = opts
		n.useHostTree(filepath.Join(dir, "r"))
	} else if opts.RealKubelet {
		if opts.NoContainers {
			return nil, fmt.Errorf("node %s: a real kubelet runs containers", opts.Name)
		}
		// The real kubelet's own folders (its --root-dir is <node>/kubelet).
		n.RegistrarDir = filepath.Join(dir, "kubelet", "plugins_registry")
		n.PluginsDir = filepath.Join(dir, "kubelet", "plugins")
	}
	for _, d := range []string{n.RegistrarDir, n.PluginsDir, n.CDIRoot, n.StateDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	if opts.RealKubelet {
		if err := n.startReal(ctx, seq); err != nil { // realnode.go
			return nil, err
		}
	} else {
		if err := n.register(ctx, opts); err != nil {
			return nil, err
		}
		if err := n.startKubelet(ctx); err != nil {
			return nil, err
		}
	}

	c.mu.Lock()
	c.nodes[n.Name] = n
	c.mu.Unlock()
	return n, nil
}

// startKubelet starts what the kubelet runs for this node: the pod informer
// and loop, the container runtime, the DRA manager (its checkpoint in
// StateDir survives a restart, as /var/lib/kubelet does), the plugin manager
// and the status heartbeat. Node.Stop and Node.Reboot stop them.
func (n *Node) startKubelet(ctx context.Context) error {
	c, opts := n.cluster, n.opts
	ctx, n.cancel = context.WithCancel(klog.NewContext(context.WithoutCancel(ctx), n.logger))
	factory := informers.NewSharedInformerFactoryWithOptions(c.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = "spec.nodeName=" + n.Name
		}))
	podInformer := factory.Core().V1().Pods()
	n.pods = podInformer.Lister()
	n.queue = workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](50*time.Millisecond, 5*time.Second),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "pods-" + n.Name})
	if !opts.NoContainers {
		var err error
		if n.runtime, err = newRuntime(n, n.queue.Add); err != nil {
			return fmt.Errorf("node %s: container runtime: %w", n.Name, err)
		}
	}
	// This start's queue, not n.queue: after a restart the old informer's
	// last events must not reach the new loop.
	queue := n.queue
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			queue.Add(key)
		}
	}
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())

	var err error
	n.dra, err = dra.NewManager(n.logger, c.Client, n.StateDir)
	if err != nil {
		return fmt.Errorf("node %s: DRA manager: %w", n.Name, err)
	}
	sourcesReady := kubeletconfig.NewSourcesReady(func(sets.Set[string]) bool {
		return podInformer.Informer().HasSynced()
	})
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return c.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	}
	if err := n.dra.Start(ctx, n.activePods, getNode, sourcesReady); err != nil {
		return fmt.Errorf("node %s: start DRA manager: %w", n.Name, err)
	}
	plugins := pluginmanager.NewPluginManager(n.RegistrarDir, &record.FakeRecorder{})
	plugins.AddHandler(pluginwatcherapi.DRAPlugin, n.dra.GetWatcherHandler())
	n.wg.Add(1)
	go func() { defer n.wg.Done(); plugins.Run(ctx, sourcesReady, ctx.Done()) }()

	for range 4 {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			for n.processNext(ctx) {
			}
		}()
	}
	n.wg.Add(1)
	go func() { defer n.wg.Done(); n.heartbeat(ctx) }()
	n.wg.Add(1)
	go func() { defer n.wg.Done(); n.watchHealthUpdates(ctx, queue) }()
	go func() { <-ctx.Done(); queue.ShutDown() }()
	return nil
}

// Node returns a node added with AddNode.
func (c *Cluster) Node(name string) *Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[name]
}

// DRAErrors are the kubelet's failed PrepareResources and UnprepareResources
// calls on this node so far ("prepare ns/pod: error"), in order (on a real
// node from the kubelet's events and log, see realnode_cri.go).
func (n *Node) DRAErrors() []string {
	if n.real != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return n.real.draErrors(ctx)
	}
	n.draErrMu.Lock()
	defer n.draErrMu.Unlock()
	return append([]string(nil), n.draErrs...)
}

func (n *Node) recordDRAError(op string, pod *v1.Pod, err error) {
	n.draErrMu.Lock()
	defer n.draErrMu.Unlock()
	n.draErrs = append(n.draErrs, fmt.Sprintf("%s %s/%s: %v", op, pod.Namespace, pod.Name, err))
}

// SetUnschedulable cordons (true) or uncordons (false) a node, as `kubectl
// cordon` does: the scheduler places no new pod there; running pods stay.
func (c *Cluster) SetUnschedulable(ctx context.Context, name string, on bool) error {
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%t}}`, on)
	_, err := c.Client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// register creates (or refreshes) the Node object, Ready, without the
// not-ready taint that the TaintNodesByCondition admission plugin adds at
// creation (the node lifecycle controller would lift it within seconds; a
// node is usable at once).
func (n *Node) register(ctx context.Context, opts NodeOptions) error {
	labels := map[string]string{
		"kubernetes.io/hostname": opts.Name,
		"kubernetes.io/os":       "linux",
		"kubernetes.io/arch":     "amd64",
	}
	for k, v := range opts.Labels {
		labels[k] = v
	}
	capacity := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse("64"),
		v1.ResourceMemory: resource.MustParse("512Gi"),
		v1.ResourcePods:   resource.MustParse("250"),
	}
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: opts.Name, Labels: labels},
	}
	nodes := n.cluster.Client.CoreV1().Nodes()
	if _, err := nodes.Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create node %s: %w", opts.Name, err)
	}
	// kube-controller-manager's node lifecycle controller writes the new
	// Node too (taints, conditions): retried on conflicts.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := nodes.Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		current.Spec.Taints = nil
		current.Labels = labels
		_, err = nodes.Update(ctx, current, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("untaint node %s: %w", opts.Name, err)
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := nodes.Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		current.Status = v1.NodeStatus{
			Capacity:    capacity,
			Allocatable: capacity,
			Phase:       v1.NodeRunning,
			Conditions: []v1.NodeCondition{{
				Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
				Message: "simulated kubelet is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now,
			}},
			Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}, {Type: v1.NodeHostName, Address: opts.Name}},
			NodeInfo: v1.NodeSystemInfo{
				KubeletVersion: KubernetesVersion, OperatingSystem: "linux", Architecture: "amd64",
				ContainerRuntimeVersion: "simulated://0",
			},
		}
		_, err = nodes.UpdateStatus(ctx, current, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("node %s status: %w", opts.Name, err)
	}
	return nil
}

// heartbeat keeps the Ready condition fresh like the kubelet's node status
// loop: kube-controller-manager's node lifecycle controller marks a node
// whose condition is older than its grace period (50 s) unreachable and
// taints it.
func (n *Node) heartbeat(ctx context.Context) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		node, err := n.cluster.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			continue
		}
		for i := range node.Status.Conditions {
			if node.Status.Conditions[i].Type == v1.NodeReady {
				node.Status.Conditions[i].LastHeartbeatTime = metav1.Now()
			}
		}
		_, _ = n.cluster.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	}
}

// activePods is what the DRA manager's reconcile loop treats as still using
// its claims: every pod bound here that has not finished.
func (n *Node) activePods() []*v1.Pod {
	pods, err := n.pods.List(everything)
	if err != nil {
		return nil
	}
	active := pods[:0:0]
	for _, p := range pods {
		if p.Status.Phase != v1.PodSucceeded && p.Status.Phase != v1.PodFailed {
			active = append(active, p)
		}
	}
	return active
}

func (n *Node) processNext(ctx context.Context) bool {
	key, quit := n.queue.Get()
	if quit {
		return false
	}
	defer n.queue.Done(key)
	if err := n.syncPod(ctx, key); err != nil {
		n.logger.V(2).Info("pod sync failed, retrying", "pod", key, "err", err)
		n.queue.AddRateLimited(key)
		return true
	}
	n.queue.Forget(key)
	return true
}

// syncPod does the kubelet's part of the pod lifecycle: prepare the pod's
// claims, start its containers with their CDI devices, report their state;
// on deletion stop the containers, then unprepare.
func (n *Node) syncPod(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pod, err := n.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		// Gone (force-deleted): its containers go; the DRA manager's
		// reconcile loop unprepares whatever is left.
		if n.runtime != nil {
			n.runtime.killKey(key)
		}
		return nil
	}
	if err != nil {
		return err
	}
	pods := n.cluster.Client.CoreV1().Pods(ns)
	if pod.DeletionTimestamp != nil {
		// As the kubelet: containers stopped, the pod in a terminal phase
		// (which lets the resourceclaim controller release and delete
		// generated claims), then unprepare, then the final delete.
		if n.runtime != nil {
			n.runtime.killPod(pod.UID)
		}
		if !podutil.IsPodPhaseTerminal(pod.Status.Phase) {
			if err := n.setTerminated(ctx, pod); err != nil {
				return err
			}
		}
		if err := n.dra.UnprepareResources(ctx, pod); err != nil {
			n.recordDRAError("unprepare", pod, err)
			return err
		}
		uid := pod.UID
		err := pods.Delete(ctx, name, metav1.DeleteOptions{
			GracePeriodSeconds: new(int64),
			Preconditions:      &metav1.Preconditions{UID: &uid},
		})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return err
		}
		return nil
	}
	if podutil.IsPodPhaseTerminal(pod.Status.Phase) {
		return nil
	}
	started := n.runtime != nil && n.runtime.has(pod.UID)
	if pod.Status.Phase == v1.PodRunning && !started && (n.runtime == nil || n.runtime.stopping()) {
		// NoContainers: nothing more to report; a stopping runtime: its
		// containers are being killed, not to be started again. A Running pod
		// that a fresh runtime does not run yet (the kubelet restarted, see
		// Node.Reboot) is prepared and started again, as the kubelet does.
		return nil
	}
	if !started {
		if pod, err = n.prepare(ctx, pod); err != nil {
			return err
		}
	}
	if n.runtime == nil {
		return n.setRunning(ctx, pod)
	}
	phase, statuses := n.runtime.podStatus(pod)
	statuses = n.withResourceHealth(pod, statuses)
	if statusSignature(phase, statuses) == statusSignature(pod.Status.Phase, pod.Status.ContainerStatuses) &&
		healthSignature(statuses) == healthSignature(pod.Status.ContainerStatuses) {
		return nil
	}
	return n.setStatus(ctx, pod, phase, statuses)
}

// withResourceHealth fills each container's allocatedResourcesStatus from
// the DRA manager's health cache (what the plugins' health streams
// reported), as the kubelet's status manager does.
func (n *Node) withResourceHealth(pod *v1.Pod, statuses []v1.ContainerStatus) []v1.ContainerStatus {
	status := v1.PodStatus{ContainerStatuses: statuses}
	n.dra.UpdateAllocatedResourcesStatus(n.logger, pod, &status)
	return status.ContainerStatuses
}

// healthSignature is the device health in container statuses, comparable.
func healthSignature(statuses []v1.ContainerStatus) string {
	var parts []string
	for _, s := range statuses {
		for _, r := range s.AllocatedResourcesStatus {
			for _, h := range r.Resources {
				msg := ""
				if h.Message != nil {
					msg = *h.Message
				}
				parts = append(parts, fmt.Sprintf("%s/%s/%s=%s:%s", s.Name, r.Name, h.ResourceID, h.Health, msg))
			}
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, "|")
}

// watchHealthUpdates re-syncs the pods whose devices' health changed (the
// DRA manager names them by UID), as the kubelet's sync loop does.
func (n *Node) watchHealthUpdates(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string]) {
	for {
		select {
		case <-ctx.Done():
			return
		case update, ok := <-n.dra.Updates():
			if !ok {
				return
			}
			uids := sets.New(update.PodUIDs...)
			pods, err := n.pods.List(labels.Everything())
			if err != nil {
				continue
			}
			for _, p := range pods {
				if uids.Has(string(p.UID)) {
					queue.Add(p.Namespace + "/" + p.Name)
				}
			}
		}
	}
}

// prepare prepares the pod's claims, records each container's CDI device
// IDs on the pod (CDIAnnotation) and starts the containers with them.
func (n *Node) prepare(ctx context.Context, pod *v1.Pod) (*v1.Pod, error) {
	if err := n.dra.PrepareResources(ctx, pod); err != nil {
		n.recordDRAError("prepare", pod, err)
		n.setWaiting(ctx, pod, err)
		return nil, err
	}
	devices := map[string][]string{}
	for i := range pod.Spec.Containers {
		ctr := &pod.Spec.Containers[i]
		info, err := n.dra.GetResources(pod, ctr)
		if err != nil {
			return nil, err
		}
		ids := []string{}
		for _, d := range info.CDIDevices {
			ids = append(ids, d.Name)
		}
		devices[ctr.Name] = ids
	}
	encoded, err := json.Marshal(devices)
	if err != nil {
		return nil, err
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{CDIAnnotation: string(encoded)},
	}})
	if err != nil {
		return nil, err
	}
	patched, err := n.cluster.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return nil, err
	}
	if n.runtime != nil {
		n.runtime.startPod(patched, devices)
	}
	return patched, nil
}

// setStatus writes the pod phase and container statuses from the runtime.
func (n *Node) setStatus(ctx context.Context, pod *v1.Pod, phase v1.PodPhase, statuses []v1.ContainerStatus) error {
	p := pod.DeepCopy()
	now := metav1.Now()
	p.Status.Phase = phase
	p.Status.HostIP = "127.0.0.1"
	p.Status.HostIPs = []v1.HostIP{{IP: "127.0.0.1"}}
	if p.Status.StartTime == nil {
		p.Status.StartTime = &now
	}
	ready := v1.ConditionTrue
	reason := ""
	for _, st := range statuses {
		if !st.Ready {
			ready = v1.ConditionFalse
			reason = "ContainersNotReady"
		}
	}
	if podutil.IsPodPhaseTerminal(phase) {
		reason = "PodCompleted"
	}
	p.Status.Conditions = []v1.PodCondition{}
	for _, t := range []v1.PodConditionType{v1.PodScheduled, v1.PodInitialized, v1.PodReadyToStartContainers, v1.ContainersReady, v1.PodReady} {
		cond := v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now}
		if t == v1.ContainersReady || t == v1.PodReady {
			cond.Status, cond.Reason = ready, reason
		}
		p.Status.Conditions = append(p.Status.Conditions, cond)
	}
	p.Status.ContainerStatuses = statuses
	_, err := n.cluster.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// setRunning marks a pod Running without containers (NoContainers).
func (n *Node) setRunning(ctx context.Context, pod *v1.Pod) error {
	running := pod.DeepCopy()
	now := metav1.Now()
	running.Status.Phase = v1.PodRunning
	running.Status.HostIP = "127.0.0.1"
	running.Status.HostIPs = []v1.HostIP{{IP: "127.0.0.1"}}
	running.Status.StartTime = &now
	running.Status.Conditions = []v1.PodCondition{}
	for _, t := range []v1.PodConditionType{v1.PodScheduled, v1.PodInitialized, v1.PodReadyToStartContainers, v1.ContainersReady, v1.PodReady} {
		running.Status.Conditions = append(running.Status.Conditions, v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now})
	}
	running.Status.ContainerStatuses = nil
	for _, ctr := range pod.Spec.Containers {
		running.Status.ContainerStatuses = append(running.Status.ContainerStatuses, v1.ContainerStatus{
			Name: ctr.Name, Image: ctr.Image, ImageID: ctr.Image, Ready: true, Started: new(true),
			ContainerID: "simulated://" + string(pod.UID) + "/" + ctr.Name,
			State:       v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
		})
	}
	running.Status.ContainerStatuses = n.withResourceHealth(pod, running.Status.ContainerStatuses)
	_, err := n.cluster.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, running, metav1.UpdateOptions{})
	return err
}

// setTerminated records the containers as exited and the pod as Succeeded.
func (n *Node) setTerminated(ctx context.Context, pod *v1.Pod) error {
	p := pod.DeepCopy()
	now := metav1.Now()
	p.Status.Phase = v1.PodSucceeded
	for i := range p.Status.Conditions {
		if t := p.Status.Conditions[i].Type; t == v1.PodReady || t == v1.ContainersReady {
			p.Status.Conditions[i].Status = v1.ConditionFalse
			p.Status.Conditions[i].Reason = "PodCompleted"
			p.Status.Conditions[i].LastTransitionTime = now
		}
	}
	for i := range p.Status.ContainerStatuses {
		st := &p.Status.ContainerStatuses[i]
		started := now
		if st.State.Running != nil {
			started = st.State.Running.StartedAt
		}
		st.Ready = false
		st.Started = new(false)
		st.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
			ExitCode: 0, Reason: "Completed", StartedAt: started, FinishedAt: now, ContainerID: st.ContainerID,
		}}
	}
	_, err := n.cluster.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// setWaiting reports a failed prepare the way the kubelet does: the
// containers stay waiting in ContainerCreating with the error as message.
func (n *Node) setWaiting(ctx context.Context, pod *v1.Pod, cause error) {
	p := pod.DeepCopy()
	p.Status.ContainerStatuses = nil
	for _, ctr := range pod.Spec.Containers {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, v1.ContainerStatus{
			Name: ctr.Name, Image: ctr.Image,
			State: v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: "ContainerCreating", Message: cause.Error()}},
		})
	}
	_, _ = n.cluster.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
}

// DriverRegistered says whether the kubelet's DRA manager on this node has a
// registered, connected plugin for the driver (registration went through the
// kubelet's plugin watcher).
func (n *Node) DriverRegistered(driver string) bool {
	if n.real != nil {
		return n.real.driverRegistered()
	}
	pm, ok := n.dra.GetWatcherHandler().(*draplugin.DRAPluginManager)
	if !ok {
		return false
	}
	_, err := pm.GetPlugin(driver)
	return err == nil
}

// Stop stops the node's containers, plugin process and kubelet pieces; the
// Node object stays.
func (n *Node) Stop() {
	if n.real != nil {
		n.real.stopWorkloads() // realnode.go; the rest after the plugin
	}
	if n.runtime != nil {
		n.runtime.stop()
	}
	if n.Plugin != nil {
		n.Plugin.Stop()
	}
	// MPS control daemons outlive a plugin restart by design; when the node
	// goes, they go too (they run binaries of this node's simulated host).
	for _, p := range Processes(n.SimRoot()) {
		_ = syscall.Kill(p.Pid, syscall.SIGKILL)
	}
	if n.real != nil {
		n.real.stop()
	}
	if n.cancel != nil {
		n.cancel()
	}
	n.wg.Wait()
	if n.runtime != nil {
		// A pod sync that was under way may have started containers since.
		n.runtime.stop()
	}
}

// CDIDevices are the CDI device IDs each container of a running pod on this
// node got: on a real node those the kubelet handed containerd (CRI), on a
// pod-loop node those the pod loop recorded (CDIAnnotation).
func (n *Node) CDIDevices(ctx context.Context, pod *v1.Pod) (map[string][]string, error) {
	if n.real != nil {
		return n.real.cdiDevices(ctx, pod)
	}
	return CDIDevices(pod)
}

// CDIDevices returns the CDI device IDs the pod loop recorded on a pod, per
// container (pod-loop nodes; Node.CDIDevices works on every node).
func CDIDevices(pod *v1.Pod) (map[string][]string, error) {
	raw, ok := pod.Annotations[CDIAnnotation]
	if !ok {
		return nil, fmt.Errorf("pod %s/%s has no %s annotation", pod.Namespace, pod.Name, CDIAnnotation)
	}
	out := map[string][]string{}
	if err := json.Unmarshal([]byte(raw), &out); err != nil {
		return nil, fmt.Errorf("pod %s/%s annotation %s: %w", pod.Namespace, pod.Name, CDIAnnotation, err)
	}
	return out, nil
}

var everything = labels.Everything()

// RemoveNode stops a node (containers, plugin, kubelet pieces) and deletes
// its Node object, as when a machine leaves the cluster.
func (c *Cluster) RemoveNode(ctx context.Context, name string) error {
	c.mu.Lock()
	n := c.nodes[name]
	delete(c.nodes, name)
	c.mu.Unlock()
	if n != nil {
		n.Stop()
	}
	err := c.Client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}
