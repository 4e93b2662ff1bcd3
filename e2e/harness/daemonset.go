package harness

// The DaemonSet controller and the kubelet's part for DaemonSet pods, on a
// node whose plugin runs deployed (Layout other than LayoutProcess): a loop
// per node watches the DaemonSets in the API server and, for each one whose
// nodeSelector matches the node, creates the Pod from its pod template (owned
// by the DaemonSet, bound to the node, through admission like any pod) and
// runs its container with runc on the driver's image (`make image-rootfs`).
// The pod's spec, as the API server stored it, is translated into the OCI
// spec: command, args, env (fieldRefs resolved), user, privileges and
// capabilities, hostPath volumes as bind mounts of the node's tree with their
// mount propagation, and the projected service-account token at
// /var/run/secrets/kubernetes.io/serviceaccount. A changed pod template
// replaces the pod (deleted, then created again: the rolling update of one
// node); a container that exits is started again (restartPolicy Always); a
// DaemonSet that goes takes its pods with it.
//
// Unless the pod asks for hostNetwork, it gets its own network namespace
// (podnet.go) where the API server is forwarded to the address that
// KUBERNETES_SERVICE_HOST/PORT name, as kube-proxy forwards the `kubernetes`
// Service.
//
// What is simplified: probes, resources, tolerations and affinity are not
// evaluated; one container per pod, no init containers. The node's kernel is
// simulated: the simulated sysfs is the container's /sys, and the
// simulator's state folder (which stands for the kernel driver) is writable
// wherever it appears in the container. The container's procfs is this
// machine's (runc refuses mounts inside /proc), so a plugin reading
// /proc/driver/nvidia from procfs (`devRoot: /`) sees no MIG capabilities.

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// ImageRootfs is the driver's image content the plugin container runs on:
// E2E_IMAGE_ROOTFS, else <repo>/target/image-rootfs (`make image-rootfs`).
func ImageRootfs() (string, error) {
	dir := os.Getenv("E2E_IMAGE_ROOTFS")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "target", "image-rootfs")
	}
	if !isFile(filepath.Join(dir, "usr", "local", "bin", "gpu-kubelet-plugin")) {
		return "", fmt.Errorf("%w: driver image rootfs %s (run `make image-rootfs`)", ErrMissing, dir)
	}
	return dir, nil
}

// imageUser is the user the image runs as when the pod does not say: the
// Dockerfile's USER (the image carries no config of its own here).
func imageUser() (uid, gid uint32, err error) {
	path, err := RepoPath("Dockerfile")
	if err != nil {
		return 0, 0, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "USER" {
			u, g, _ := strings.Cut(f[1], ":")
			un, err1 := strconv.ParseUint(u, 10, 32)
			gn, err2 := strconv.ParseUint(g, 10, 32)
			if g == "" {
				gn, err2 = un, nil
			}
			if err1 != nil || err2 != nil {
				return 0, 0, fmt.Errorf("Dockerfile USER %q is not numeric", f[1])
			}
			uid, gid = uint32(un), uint32(gn)
		}
	}
	return uid, gid, nil
}

// DaemonPod is a DaemonSet's pod on a node and its running container.
type DaemonPod struct {
	// DaemonSet is namespace/name of the owner.
	DaemonSet string
	// Pod is the Pod object as created.
	Pod *v1.Pod
	// Hash identifies the pod template the pod was made from.
	Hash string
	// LogPath receives the container's stdout and stderr (every restart).
	LogPath string

	mu        sync.Mutex
	container *Container
	restarts  int
	spec      *rspec.Spec
	network   *podNetwork // nil with hostNetwork
}

// Container is the pod's current container.
func (d *DaemonPod) Container() *Container {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.container
}

// Log is what the pod's container printed so far.
func (d *DaemonPod) Log() string {
	b, _ := os.ReadFile(d.LogPath)
	return string(b)
}

// Spec is the OCI spec the pod's container runs with.
func (d *DaemonPod) Spec() *rspec.Spec {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.spec
}

type daemonSets struct {
	n      *Node
	cancel context.CancelFunc
	done   chan struct{}

	mu   sync.Mutex
	pods map[string]*DaemonPod
	errs map[string]error
}

func newDaemonSets(n *Node) *daemonSets {
	return &daemonSets{n: n, pods: map[string]*DaemonPod{}, errs: map[string]error{}, done: make(chan struct{})}
}

// DaemonPods are the DaemonSet pods running on this node.
func (n *Node) DaemonPods() []*DaemonPod {
	if n.daemons == nil {
		return nil
	}
	n.daemons.mu.Lock()
	defer n.daemons.mu.Unlock()
	var out []*DaemonPod
	for _, d := range n.daemons.pods {
		out = append(out, d)
	}
	return out
}

// DaemonPodError is why the last attempt to run a DaemonSet's pod here
// failed, if it did (namespace/name of the DaemonSet).
func (n *Node) DaemonPodError(ds string) error {
	if n.daemons == nil {
		return nil
	}
	n.daemons.mu.Lock()
	defer n.daemons.mu.Unlock()
	return n.daemons.errs[ds]
}

func (s *daemonSets) run(ctx context.Context) {
	ctx, s.cancel = context.WithCancel(ctx)
	defer close(s.done)
	for {
		s.sync(ctx)
		select {
		case <-ctx.Done():
			return
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// stop ends the loop, then stops every pod's container (the pods stay in
// the API server, as when a node goes down).
func (s *daemonSets) stop() {
	if s.cancel != nil {
		s.cancel()
		<-s.done
	}
	s.mu.Lock()
	pods := s.pods
	s.pods = map[string]*DaemonPod{}
	s.mu.Unlock()
	for _, d := range pods {
		s.kill(d)
	}
}

func templateHash(t *v1.PodTemplateSpec) string {
	data, _ := json.Marshal(t)
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:8])
}

func ownedByDaemonSet(pod *v1.Pod) bool {
	ref := metav1.GetControllerOf(pod)
	return ref != nil && ref.Kind == "DaemonSet"
}

func (s *daemonSets) sync(ctx context.Context) {
	c := s.n.cluster
	list, err := c.Client.AppsV1().DaemonSets("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	node, err := c.Client.CoreV1().Nodes().Get(ctx, s.n.Name, metav1.GetOptions{})
	if err != nil {
		return
	}
	wanted := map[string]*appsv1.DaemonSet{}
	for i := range list.Items {
		ds := &list.Items[i]
		if ds.DeletionTimestamp != nil {
			continue
		}
		if !labels.SelectorFromSet(ds.Spec.Template.Spec.NodeSelector).Matches(labels.Set(node.Labels)) {
			continue
		}
		wanted[ds.Namespace+"/"+ds.Name] = ds
	}
	s.mu.Lock()
	current := map[string]*DaemonPod{}
	for k, d := range s.pods {
		current[k] = d
	}
	s.mu.Unlock()
	for key, d := range current {
		ds, ok := wanted[key]
		if ok && d.Hash == templateHash(&ds.Spec.Template) {
			s.restartIfExited(ctx, d)
			continue
		}
		if ok && surges(ds) {
			// Changed, with maxSurge: the new pod starts first and the old one
			// goes once the new one is available, as the DaemonSet controller
			// does it.
			next, err := s.start(ctx, ds)
			if err != nil {
				s.mu.Lock()
				s.errs[key] = err
				s.mu.Unlock()
				continue
			}
			s.waitAvailable(ctx, next)
			s.mu.Lock()
			delete(s.errs, key)
			s.pods[key] = next
			s.mu.Unlock()
		} else {
			// Gone or changed without surge: the old pod goes first.
			s.mu.Lock()
			delete(s.pods, key)
			s.mu.Unlock()
		}
		s.kill(d)
		err := c.Client.CoreV1().Pods(d.Pod.Namespace).Delete(ctx, d.Pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		if err != nil && !apierrors.IsNotFound(err) {
			s.n.logger.Info("delete DaemonSet pod", "pod", d.Pod.Name, "err", err)
		}
	}
	for key, ds := range wanted {
		s.mu.Lock()
		_, running := s.pods[key]
		s.mu.Unlock()
		if running {
			continue
		}
		d, err := s.start(ctx, ds)
		s.mu.Lock()
		if err != nil {
			s.errs[key] = err
		} else {
			delete(s.errs, key)
			s.pods[key] = d
		}
		s.mu.Unlock()
	}
}

// surges says whether a DaemonSet's rolling update starts the new pod on a
// node before the old one stops (maxSurge above zero).
func surges(ds *appsv1.DaemonSet) bool {
	ru := ds.Spec.UpdateStrategy.RollingUpdate
	if ds.Spec.UpdateStrategy.Type != appsv1.RollingUpdateDaemonSetStrategyType || ru == nil || ru.MaxSurge == nil {
		return false
	}
	return ru.MaxSurge.IntValue() > 0 || (ru.MaxSurge.Type == intstr.String && ru.MaxSurge.StrVal != "0%" && ru.MaxSurge.StrVal != "0")
}

// waitAvailable waits until a new DaemonSet pod is available: its container
// runs and its readiness probe (an httpGet, run inside the pod's network
// namespace as the kubelet runs it) answers 2xx; at most 30 s.
func (s *daemonSets) waitAvailable(ctx context.Context, d *DaemonPod) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if ctr := d.Container(); ctr != nil {
			if phase, _, _ := ctr.State(); phase == ContainerRunning && d.ready() {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ready runs the container's readiness probe once (true without one).
func (d *DaemonPod) ready() bool {
	ctr := d.Pod.Spec.Containers[0]
	probe := ctr.ReadinessProbe
	if probe == nil || probe.HTTPGet == nil || d.network == nil {
		return true
	}
	port := probe.HTTPGet.Port.IntValue()
	if probe.HTTPGet.Port.Type == intstr.String {
		for _, p := range ctr.Ports {
			if p.Name == probe.HTTPGet.Port.StrVal {
				port = int(p.ContainerPort)
			}
		}
	}
	conn, err := d.network.dial("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
	if err != nil {
		return false
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", probe.HTTPGet.Path); err != nil {
		return false
	}
	status, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return false
	}
	fields := strings.Fields(status)
	return len(fields) >= 2 && strings.HasPrefix(fields[1], "2")
}

// start creates the DaemonSet's pod for this node and runs its container.
func (s *daemonSets) start(ctx context.Context, ds *appsv1.DaemonSet) (*DaemonPod, error) {
	c, n := s.n.cluster, s.n
	t := ds.Spec.Template.DeepCopy()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: ds.Name + "-", Namespace: ds.Namespace,
			Labels: t.Labels, Annotations: t.Annotations,
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID,
				Controller: new(true), BlockOwnerDeletion: new(true),
			}},
		},
		Spec: t.Spec,
	}
	pod.Spec.NodeName = n.Name
	created, err := c.Client.CoreV1().Pods(ds.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create pod of DaemonSet %s/%s: %w", ds.Namespace, ds.Name, err)
	}
	d := &DaemonPod{
		DaemonSet: ds.Namespace + "/" + ds.Name, Pod: created, Hash: templateHash(&ds.Spec.Template),
		LogPath: filepath.Join(n.Dir, "logs", fmt.Sprintf("%s_%s_%s", created.Namespace, created.Name, created.UID), "daemon.log"),
	}
	fail := func(err error) (*DaemonPod, error) {
		if d.network != nil {
			d.network.close()
		}
		_ = c.Client.CoreV1().Pods(created.Namespace).Delete(context.WithoutCancel(ctx), created.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		return nil, err
	}
	api, err := url.Parse(c.Host)
	if err != nil {
		return fail(err)
	}
	netns := ""
	if !created.Spec.HostNetwork {
		if d.network, err = newPodNetwork(api.Host); err != nil {
			return fail(fmt.Errorf("pod %s/%s network: %w", created.Namespace, created.Name, err))
		}
		netns = d.network.path()
	}
	spec, err := s.ociSpec(ctx, created, netns)
	if err != nil {
		return fail(fmt.Errorf("pod %s/%s: %w", created.Namespace, created.Name, err))
	}
	d.spec = spec
	if err := s.runContainer(ctx, d); err != nil {
		return fail(err)
	}
	return d, nil
}

func (s *daemonSets) runContainer(ctx context.Context, d *DaemonPod) error {
	image, err := ImageRootfs()
	if err != nil {
		return err
	}
	d.mu.Lock()
	restarts := d.restarts
	spec := d.spec
	d.mu.Unlock()
	name := d.Pod.Spec.Containers[0].Name
	id := fmt.Sprintf("%s_%s_%d", d.Pod.UID, name, restarts)
	ctr := &Container{
		ID: id, Name: name, Bundle: filepath.Join(s.n.runtime.bundles, id),
		LogPath: d.LogPath, done: make(chan struct{}),
	}
	// A fresh copy per run: runc wrote into the last one.
	copySpec := *spec
	if err := s.n.runtime.run(ctr, &copySpec, image, nil); err != nil {
		return err
	}
	d.mu.Lock()
	d.container = ctr
	d.mu.Unlock()
	s.setStatus(ctx, d)
	return nil
}

// restartIfExited starts the pod's container again once it has exited
// (restartPolicy Always), after a short back-off.
func (s *daemonSets) restartIfExited(ctx context.Context, d *DaemonPod) {
	ctr := d.Container()
	if ctr == nil {
		return
	}
	phase, _, _ := ctr.State()
	if phase == ContainerRunning {
		return
	}
	ctr.mu.Lock()
	finished := ctr.finished.Time
	ctr.mu.Unlock()
	if time.Since(finished) < time.Second {
		return
	}
	s.n.runtime.kill(ctr)
	d.mu.Lock()
	d.restarts++
	d.mu.Unlock()
	if err := s.runContainer(ctx, d); err != nil {
		s.n.logger.Info("restart DaemonSet pod", "pod", d.Pod.Name, "err", err)
	}
}

// kill stops the pod's container: SIGTERM, then SIGKILL after the grace
// period (10 s here), then deletes it and the pod's network.
func (s *daemonSets) kill(d *DaemonPod) {
	if ctr := d.Container(); ctr != nil {
		r := s.n.runtime
		_ = runcCmd(r, "kill", ctr.ID, "TERM").Run()
		select {
		case <-ctr.done:
		case <-time.After(10 * time.Second):
		}
		r.kill(ctr)
	}
	if d.network != nil {
		d.network.close()
	}
}

// Kill kills the pod's container with SIGKILL, as a crash; the node starts it
// again (restartPolicy Always).
func (d *DaemonPod) Kill(n *Node) {
	if ctr := d.Container(); ctr != nil {
		_ = runcCmd(n.runtime, "kill", ctr.ID, "KILL").Run()
		<-ctr.done
	}
}

func (s *daemonSets) setStatus(ctx context.Context, d *DaemonPod) {
	ctr := d.Container()
	now := metav1.Now()
	p := d.Pod.DeepCopy()
	p.Status.Phase = v1.PodRunning
	p.Status.HostIP = "127.0.0.1"
	p.Status.HostIPs = []v1.HostIP{{IP: "127.0.0.1"}}
	p.Status.PodIP = "127.0.0.1"
	p.Status.StartTime = &now
	d.mu.Lock()
	restarts := int32(d.restarts)
	d.mu.Unlock()
	p.Status.ContainerStatuses = []v1.ContainerStatus{{
		Name: ctr.Name, Image: p.Spec.Containers[0].Image, ImageID: p.Spec.Containers[0].Image,
		ContainerID: "runc://" + ctr.ID, Started: new(true), RestartCount: restarts,
		State: v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
	}}
	_, _ = s.n.cluster.Client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
}

// privilegedCapabilities are what a privileged container gets: every
// capability the runtime itself holds (its bounding set), as containerd
// does; this machine may not grant them all.
func privilegedCapabilities() []string {
	data, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(data), "\n") {
		if hexBits, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			bits, err := strconv.ParseUint(strings.TrimSpace(hexBits), 16, 64)
			if err != nil {
				break
			}
			var caps []string
			for i, name := range allCapabilities {
				if bits&(1<<uint(i)) != 0 {
					caps = append(caps, name)
				}
			}
			return caps
		}
	}
	return append([]string{}, defaultCapabilities...)
}

// allCapabilities are the capabilities by number.
var allCapabilities = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
	"CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
	"CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
	"CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
	"CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"}

// defaultCapabilities are containerd's defaults for an unprivileged container.
var defaultCapabilities = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT",
	"CAP_KILL", "CAP_AUDIT_WRITE"}

// ociSpec translates the pod (as stored by the API server, admission
// defaults included) into the OCI spec of its container.
func (s *daemonSets) ociSpec(ctx context.Context, pod *v1.Pod, netns string) (*rspec.Spec, error) {
	n, c := s.n, s.n.cluster
	if len(pod.Spec.Containers) != 1 || len(pod.Spec.InitContainers) > 0 {
		return nil, fmt.Errorf("the harness runs DaemonSet pods with exactly one container and no init containers")
	}
	ctr := &pod.Spec.Containers[0]
	api, err := url.Parse(c.Host)
	if err != nil {
		return nil, err
	}
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME=" + n.Name,
		"KUBERNETES_SERVICE_HOST=" + api.Hostname(), "KUBERNETES_SERVICE_PORT=" + api.Port()}
	for _, e := range ctr.Env {
		value := e.Value
		if e.ValueFrom != nil {
			if e.ValueFrom.FieldRef == nil {
				return nil, fmt.Errorf("env %s: only fieldRef is supported", e.Name)
			}
			switch e.ValueFrom.FieldRef.FieldPath {
			case "spec.nodeName":
				value = n.Name
			case "metadata.name":
				value = pod.Name
			case "metadata.namespace":
				value = pod.Namespace
			case "metadata.uid":
				value = string(pod.UID)
			case "status.podIP", "status.hostIP":
				value = "127.0.0.1"
			default:
				return nil, fmt.Errorf("env %s: fieldRef %s not supported", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		}
		env = append(env, e.Name+"="+value)
	}
	args := append(append([]string{}, ctr.Command...), ctr.Args...)
	if len(args) == 0 {
		return nil, fmt.Errorf("container %s has no command (the image's entrypoint is not known here)", ctr.Name)
	}

	// User and privileges: the container's securityContext over the pod's,
	// over the image's USER.
	uid, gid, err := imageUser()
	if err != nil {
		return nil, err
	}
	psc := pod.Spec.SecurityContext
	if psc == nil {
		psc = &v1.PodSecurityContext{}
	}
	sc := ctr.SecurityContext
	if sc == nil {
		sc = &v1.SecurityContext{}
	}
	if psc.RunAsUser != nil {
		uid = uint32(*psc.RunAsUser)
	}
	if psc.RunAsGroup != nil {
		gid = uint32(*psc.RunAsGroup)
	}
	if sc.RunAsUser != nil {
		uid = uint32(*sc.RunAsUser)
	}
	if sc.RunAsGroup != nil {
		gid = uint32(*sc.RunAsGroup)
	}
	nonRoot := psc.RunAsNonRoot
	if sc.RunAsNonRoot != nil {
		nonRoot = sc.RunAsNonRoot
	}
	if nonRoot != nil && *nonRoot && uid == 0 {
		// The kubelet's CreateContainerConfigError.
		return nil, fmt.Errorf("container has runAsNonRoot and image will run as root")
	}
	privileged := sc.Privileged != nil && *sc.Privileged
	caps := append([]string{}, defaultCapabilities...)
	if privileged {
		caps = privilegedCapabilities()
	} else if sc.Capabilities != nil {
		drop := map[string]bool{}
		for _, d := range sc.Capabilities.Drop {
			drop["CAP_"+strings.ToUpper(string(d))] = true
		}
		kept := []string{}
		for _, c := range caps {
			if !drop[c] && !drop["CAP_ALL"] {
				kept = append(kept, c)
			}
		}
		for _, a := range sc.Capabilities.Add {
			kept = append(kept, "CAP_"+strings.ToUpper(string(a)))
		}
		caps = kept
	}
	noNewPrivs := !privileged
	if sc.AllowPrivilegeEscalation != nil {
		noNewPrivs = !*sc.AllowPrivilegeEscalation
	}

	sysMode := "ro"
	if privileged {
		sysMode = "rw"
	}
	mounts := []rspec.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
		// The node's kernel: its (simulated) sysfs.
		{Destination: "/sys", Type: "bind", Source: filepath.Join(n.SimRoot(), "sys"), Options: []string{"rbind", sysMode, "nosuid", "nodev"}},
	}
	propagation := ""
	volumes := map[string]*v1.Volume{}
	for i := range pod.Spec.Volumes {
		volumes[pod.Spec.Volumes[i].Name] = &pod.Spec.Volumes[i]
	}
	stateDir := filepath.Join(n.SimRoot(), "etc", "gpu-sim")
	var stateMounts []rspec.Mount
	for _, vm := range ctr.VolumeMounts {
		vol, ok := volumes[vm.Name]
		if !ok {
			return nil, fmt.Errorf("volumeMount %s: no such volume", vm.Name)
		}
		var source string
		switch {
		case vol.HostPath != nil:
			source = n.HostPath(vol.HostPath.Path)
			if err := checkHostPath(source, vol.HostPath.Type); err != nil {
				return nil, fmt.Errorf("volume %s: %w", vm.Name, err)
			}
		case vol.Projected != nil:
			if source, err = s.projected(ctx, pod, vol); err != nil {
				return nil, fmt.Errorf("volume %s: %w", vm.Name, err)
			}
		default:
			return nil, fmt.Errorf("volume %s: only hostPath and the projected service-account token are supported", vm.Name)
		}
		if vm.SubPath != "" {
			source = filepath.Join(source, vm.SubPath)
		}
		opts := []string{"rbind"}
		if vm.ReadOnly {
			opts = append(opts, "ro")
		}
		switch {
		case vm.MountPropagation != nil && *vm.MountPropagation == v1.MountPropagationHostToContainer:
			opts = append(opts, "rslave")
			if propagation == "" {
				propagation = "rslave"
			}
		case vm.MountPropagation != nil && *vm.MountPropagation == v1.MountPropagationBidirectional:
			opts = append(opts, "rshared")
			propagation = "rshared"
		default:
			opts = append(opts, "rprivate")
		}
		mounts = append(mounts, rspec.Mount{Destination: vm.MountPath, Type: "bind", Source: source, Options: opts})
		// The simulator's state stands for the kernel driver: writable
		// wherever the container sees it, like the driver's real state.
		if rel, err := filepath.Rel(source, stateDir); err == nil && !strings.HasPrefix(rel, "..") {
			stateMounts = append(stateMounts, rspec.Mount{Destination: filepath.Join(vm.MountPath, rel), Type: "bind",
				Source: stateDir, Options: []string{"rbind", "rw"}})
		}
	}
	mounts = append(mounts, stateMounts...)
	mounts = append(mounts, rspec.Mount{Destination: SimStateMount, Type: "bind", Source: stateDir, Options: []string{"rbind", "rw"}})

	namespaces := []rspec.LinuxNamespace{{Type: rspec.UTSNamespace}, {Type: rspec.MountNamespace}}
	if netns != "" {
		namespaces = append(namespaces, rspec.LinuxNamespace{Type: rspec.NetworkNamespace, Path: netns})
	}
	if !pod.Spec.HostPID {
		namespaces = append(namespaces, rspec.LinuxNamespace{Type: rspec.PIDNamespace})
	}
	if !pod.Spec.HostIPC {
		namespaces = append(namespaces, rspec.LinuxNamespace{Type: rspec.IPCNamespace})
	}
	linux := &rspec.Linux{
		Namespaces:        namespaces,
		RootfsPropagation: propagation,
		Resources:         &rspec.LinuxResources{Devices: []rspec.LinuxDeviceCgroup{{Allow: privileged, Access: "rwm"}}},
	}
	if !privileged {
		linux.MaskedPaths = []string{"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
			"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"}
		linux.ReadonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
	}
	cwd := ctr.WorkingDir
	if cwd == "" {
		cwd = "/"
	}
	return &rspec.Spec{
		Version:  rspec.Version,
		Root:     &rspec.Root{Path: "rootfs", Readonly: sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem},
		Hostname: n.Name,
		Process: &rspec.Process{
			Args: args, Env: env, Cwd: cwd,
			User:            rspec.User{UID: uid, GID: gid},
			Capabilities:    &rspec.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
			NoNewPrivileges: noNewPrivs,
		},
		Mounts: mounts,
		Linux:  linux,
	}, nil
}

// checkHostPath does what the kubelet does for a hostPath volume's type.
func checkHostPath(path string, t *v1.HostPathType) error {
	kind := v1.HostPathUnset
	if t != nil {
		kind = *t
	}
	st, err := os.Stat(path)
	switch kind {
	case v1.HostPathDirectoryOrCreate:
		if errors.Is(err, os.ErrNotExist) {
			return os.MkdirAll(path, 0o755)
		}
	case v1.HostPathDirectory:
		if err != nil || !st.IsDir() {
			return fmt.Errorf("hostPath type check failed: %s is not a directory", path)
		}
	case v1.HostPathFileOrCreate:
		if errors.Is(err, os.ErrNotExist) {
			return os.WriteFile(path, nil, 0o644)
		}
	case v1.HostPathUnset:
	default:
		if err != nil {
			return fmt.Errorf("hostPath type check failed: %s: %v", path, err)
		}
	}
	return nil
}

// projected writes what the kubelet projects for the service-account volume
// that admission adds (token bound to the pod, the cluster CA, the
// namespace) and returns its folder.
func (s *daemonSets) projected(ctx context.Context, pod *v1.Pod, vol *v1.Volume) (string, error) {
	dir := filepath.Join(s.n.Dir, "pods", string(pod.UID), vol.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for _, src := range vol.Projected.Sources {
		switch {
		case src.ServiceAccountToken != nil:
			token, err := s.n.cluster.podToken(ctx, pod, Identity{Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName})
			if err != nil {
				return "", err
			}
			if err := os.WriteFile(filepath.Join(dir, src.ServiceAccountToken.Path), []byte(token), 0o644); err != nil {
				return "", err
			}
		case src.ConfigMap != nil && src.ConfigMap.Name == "kube-root-ca.crt":
			for _, item := range src.ConfigMap.Items {
				if err := os.WriteFile(filepath.Join(dir, item.Path), s.n.cluster.CA.CertPEM, 0o644); err != nil {
					return "", err
				}
			}
		case src.DownwardAPI != nil:
			for _, item := range src.DownwardAPI.Items {
				if item.FieldRef == nil || item.FieldRef.FieldPath != "metadata.namespace" {
					return "", fmt.Errorf("downwardAPI item %s not supported", item.Path)
				}
				if err := os.WriteFile(filepath.Join(dir, item.Path), []byte(pod.Namespace), 0o644); err != nil {
					return "", err
				}
			}
		default:
			return "", fmt.Errorf("projected source not supported")
		}
	}
	return dir, nil
}

func runcCmd(r *runtime, args ...string) *exec.Cmd {
	return exec.Command(r.runc, append([]string{"--root", r.root}, args...)...)
}
