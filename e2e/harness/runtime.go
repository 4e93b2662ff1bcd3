package harness

// The container runtime of a simulated node: what containerd or CRI-O do for
// the kubelet, done with the same pieces. Each container of a pod gets an OCI
// bundle (its own copy of the test image as root filesystem, the process from
// the pod spec), the container's CDI devices are applied to the OCI spec by
// the official CDI library (tags.cncf.io/container-device-interface, the code
// containerd and CRI-O call), and runc runs it, or NVIDIA's runtime wrapping
// runc on a node set up as the GPU Operator does (nvidiaruntime.go).
//
// Invariants: every runc state of a node lives under <node>/runc (runc's
// --root), so nodes and test runs never see each other's containers; a
// container is killed and deleted before its pod's claims are unprepared, and
// every container of a node is gone when the node stops; logs stay in
// <node>/logs until the cluster directory goes.
//
// What is simplified: every container runs on the test image, the pod's
// image selects only the environment it starts with (images.go); containers are never restarted (a pod whose containers
// have all exited is Succeeded or Failed when its restartPolicy is Never, or OnFailure and none failed; otherwise it
// stays Running with them waiting in CrashLoopBackOff, as the kubelet reports them between restarts); no
// resource limits, probes, volumes or networking.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// SimStateMount is where every container finds its node's simulator state
// folder (`<sim root>/etc/gpu-sim`, bind-mounted read-only). It stands for
// the kernel driver, which every process of a real node shares; the
// simulated NVML and nvidia-smi find it by walking up from their own path
// and then show only the devices whose nodes the container's /dev has. It is
// added by this runtime, never by our CDI specs, which are the product.
const SimStateMount = "/etc/gpu-sim"

// ErrNoContainer is returned for a pod or container this node's runtime does not run.
var ErrNoContainer = errors.New("no such container")

// ContainerPhase is where a container is in its life.
type ContainerPhase string

const (
	// ContainerRunning has a process.
	ContainerRunning ContainerPhase = "running"
	// ContainerExited ran and exited (see ExitCode).
	ContainerExited ContainerPhase = "exited"
	// ContainerStartFailed never ran: the runtime refused it (see Message).
	ContainerStartFailed ContainerPhase = "start-failed"
	// ContainerCreated is created and not started yet (real nodes only:
	// containerd reports it between CreateContainer and StartContainer).
	ContainerCreated ContainerPhase = "created"
)

// Container is one runc container of a pod.
type Container struct {
	// ID is runc's container ID: <pod UID>_<container name> on pod-loop
	// nodes, containerd's on real nodes.
	ID string
	// Name is the container's name in the pod.
	Name string
	// Bundle is the OCI bundle directory (empty on real nodes: containerd's).
	Bundle string
	// LogPath receives the container's stdout and stderr.
	LogPath string
	// CDIDevices are the CDI device IDs applied to it.
	CDIDevices []string

	mu       sync.Mutex
	phase    ContainerPhase
	exitCode int32
	message  string
	started  metav1.Time
	finished metav1.Time
	done     chan struct{}
	cmd      *exec.Cmd
}

// State is the container's phase, exit code and runtime message.
func (c *Container) State() (ContainerPhase, int32, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.phase, c.exitCode, c.message
}

type runtime struct {
	node *Node
	runc string
	// nvidia runs containers through NVIDIA's runtime (nvidiaruntime.go);
	// nil: runc runs them.
	nvidia  *nvidiaRuntime
	image   string
	root    string // runc --root
	bundles string
	logs    string
	// changed is called (with the pod's key) when a container's state changes.
	changed func(key string)

	mu    sync.Mutex
	pods  map[types.UID][]*Container
	byKey map[string]types.UID
	// stopped: stop was called; nothing is started any more.
	stopped bool
}

// TestImage is the root filesystem every container runs on:
// E2E_TEST_IMAGE, else <repo>/.tools/test-image/rootfs (`make e2e-image`).
func TestImage() (string, error) {
	dir := os.Getenv("E2E_TEST_IMAGE")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, ".tools", "test-image", "rootfs")
	}
	if !isFile(filepath.Join(dir, "bin", "busybox")) {
		return "", fmt.Errorf("%w: test image %s (run `make e2e-image`)", ErrMissing, dir)
	}
	return dir, nil
}

func newRuntime(n *Node, changed func(string)) (*runtime, error) {
	runc, err := exec.LookPath("runc")
	if err != nil {
		return nil, fmt.Errorf("%w: runc (Debian package runc; `make e2e-runtime` installs it): %v", ErrMissing, err)
	}
	image, err := TestImage()
	if err != nil {
		return nil, err
	}
	r := &runtime{
		node: n, runc: runc, image: image, changed: changed,
		root:    filepath.Join(n.Dir, "runc"),
		bundles: filepath.Join(n.Dir, "containers"),
		logs:    filepath.Join(n.Dir, "logs"),
		pods:    map[types.UID][]*Container{},
		byKey:   map[string]types.UID{},
	}
	for _, d := range []string{r.root, r.bundles, r.logs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if n.opts.NvidiaRuntime {
		if r.nvidia, err = newNvidiaRuntime(n, runc); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func podKey(pod *v1.Pod) string { return pod.Namespace + "/" + pod.Name }

// stopping says whether stop was called.
func (r *runtime) stopping() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopped
}

// has says whether the pod's containers were started here.
func (r *runtime) has(uid types.UID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.pods[uid]
	return ok
}

func (r *runtime) containers(uid types.UID) []*Container {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*Container(nil), r.pods[uid]...)
}

func (r *runtime) container(uid types.UID, name string) (*Container, error) {
	for _, c := range r.containers(uid) {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, fmt.Errorf("%w: container %q of pod %s on %s", ErrNoContainer, name, uid, r.node.Name)
}

// startPod starts every container of the pod with its CDI devices (by
// container name). A container the runtime refuses is recorded as
// ContainerStartFailed with the runtime's message, as containerd reports it.
func (r *runtime) startPod(pod *v1.Pod, devices map[string][]string) {
	// Devices named in cdi.k8s.io/ pod annotations go to every container,
	// as containerd and CRI-O do for device plugins.
	_, annotated, annErr := cdi.ParseAnnotations(pod.Annotations)
	var started []*Container
	for i := range pod.Spec.Containers {
		ctr := &pod.Spec.Containers[i]
		ids := append(append([]string{}, devices[ctr.Name]...), annotated...)
		c := &Container{
			ID:         string(pod.UID) + "_" + ctr.Name,
			Name:       ctr.Name,
			Bundle:     filepath.Join(r.bundles, string(pod.UID)+"_"+ctr.Name),
			LogPath:    filepath.Join(r.logs, fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), ctr.Name+".log"),
			CDIDevices: ids,
			done:       make(chan struct{}),
		}
		err := annErr
		if err == nil {
			err = r.start(pod, ctr, c)
		}
		if err != nil {
			c.fail(err)
		}
		started = append(started, c)
	}
	r.mu.Lock()
	r.pods[pod.UID] = started
	r.byKey[podKey(pod)] = pod.UID
	r.mu.Unlock()
}

func (c *Container) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := metav1.Now().Rfc3339Copy()
	c.phase, c.exitCode, c.message = ContainerStartFailed, 128, err.Error()
	c.started, c.finished = now, now
	select {
	case <-c.done:
	default:
		close(c.done)
	}
}

// start builds the pod container's OCI spec (with its CDI devices applied)
// and runs it on the test image.
func (r *runtime) start(pod *v1.Pod, ctr *v1.Container, c *Container) error {
	if RunsOnDriverImage(ctr.Image) {
		return errDriverImageOnPodLoop(pod) // imagepods.go
	}
	spec := r.ociSpec(pod, ctr)
	if len(c.CDIDevices) > 0 {
		if err := r.injectCDI(spec, c.CDIDevices); err != nil {
			return err
		}
	}
	if r.nvidia != nil {
		if err := r.nvidia.ensureSpec(); err != nil {
			return err
		}
	}
	key := podKey(pod)
	return r.run(c, spec, r.image, func() { r.changed(key) })
}

// injectCDI applies CDI devices to a spec with the official CDI library. A
// fresh cache per container, as a runtime refreshes before each create: the
// plugin has just written the claim's spec. Errors of unrelated spec files do
// not stop the injection (containerd logs them).
func (r *runtime) injectCDI(spec *rspec.Spec, ids []string) error {
	cache, _ := cdi.NewCache(cdi.WithSpecDirs(r.node.CDIRoot), cdi.WithAutoRefresh(false))
	if cache == nil {
		return fmt.Errorf("CDI cache for %s", r.node.CDIRoot)
	}
	if _, err := cache.InjectDevices(spec, ids...); err != nil {
		return fmt.Errorf("CDI device injection failed: %w", err)
	}
	return nil
}

// run writes the bundle (a copy of image as root filesystem, spec as
// config.json) and runs `runc run` in the foreground (its exit status is the
// container's); it returns once the container process runs or runc has given
// up. exited is called after the container's state changed to exited.
func (r *runtime) run(c *Container, spec *rspec.Spec, image string, exited func()) error {
	if err := os.MkdirAll(filepath.Dir(c.LogPath), 0o755); err != nil {
		return err
	}
	if err := os.MkdirAll(c.Bundle, 0o755); err != nil {
		return err
	}
	// Each container gets its own copy of the image: runc creates mount
	// points in it, and a container may write to its root. Hard links where
	// the file system allows (the driver's image holds large binaries).
	rootfs := filepath.Join(c.Bundle, "rootfs")
	if err := exec.Command("cp", "-al", image, rootfs).Run(); err != nil {
		_ = os.RemoveAll(rootfs)
		if out, err := exec.Command("cp", "-a", image, rootfs).CombinedOutput(); err != nil {
			return fmt.Errorf("copy image %s: %v: %s", image, err, out)
		}
	}
	// This machine refuses raising RLIMIT_NOFILE/NPROC, and a pod cannot ask
	// for rlimits anyway.
	spec.Process.Rlimits = nil
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(c.Bundle, "config.json"), data, 0o644); err != nil {
		return err
	}
	logFile, err := os.OpenFile(c.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	pidFile := filepath.Join(c.Bundle, "pid")
	runcLog := filepath.Join(c.Bundle, "runc.log")
	cmd := exec.Command(r.runc, "--root", r.root, "--log", runcLog, "--log-format", "json",
		"run", "--bundle", c.Bundle, "--pid-file", pidFile, c.ID)
	if r.nvidia != nil {
		if cmd, err = r.nvidia.shimCommand(r.root, runcLog, c.Bundle, pidFile, c.ID); err != nil {
			logFile.Close()
			return err
		}
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Its own process group: a Ctrl-C of the demo reaches the harness, which
	// then stops the containers itself.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := r.node.cluster.startProcess(cmd); err != nil { // in the cluster's cgroups (clustercgroups.go)
		logFile.Close()
		return fmt.Errorf("start runc: %w", err)
	}
	c.mu.Lock()
	c.cmd = cmd
	c.started = metav1.Now().Rfc3339Copy()
	c.phase = ContainerRunning
	c.mu.Unlock()
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		logFile.Close()
		code := int32(0)
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = int32(ee.ExitCode())
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				code = 128 + int32(ws.Signal())
			}
		} else if err != nil {
			code = 128
		}
		c.mu.Lock()
		c.finished = metav1.Now().Rfc3339Copy()
		if msg := runcError(runcLog); msg != "" {
			c.phase, c.exitCode, c.message = ContainerStartFailed, 128, msg
		} else {
			c.phase, c.exitCode = ContainerExited, code
		}
		c.mu.Unlock()
		close(done)
		close(c.done)
		if exited != nil {
			exited()
		}
	}()
	deadline := time.After(30 * time.Second)
	for {
		if isFile(pidFile) {
			return nil
		}
		select {
		case <-done:
			return nil
		case <-deadline:
			return nil
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// runcError is the last error runc logged, if any: why it could not create
// or start the container (a container's own exit status is not logged).
func runcError(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var last string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		var entry struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &entry) == nil && (entry.Level == "error" || entry.Level == "fatal") {
			last = entry.Msg
		}
	}
	return last
}

// ociSpec is what a CRI runtime builds for a container before CDI: runc's
// default spec with the process from the pod, containerd's default
// capabilities, its own PID, IPC, UTS, mount and network namespaces, a
// private /dev/shm, and the node's simulator state (see SimStateMount).
func (r *runtime) ociSpec(pod *v1.Pod, ctr *v1.Container) *rspec.Spec {
	args := append(append([]string{}, ctr.Command...), ctr.Args...)
	if len(args) == 0 {
		// The test image's default command: a workload that keeps running.
		args = []string{"sleep", "2147483647"}
	}
	// The image's environment (images.go), HOSTNAME, then the pod's env over
	// both, as containerd layers them.
	env := mergeEnv(ImageEnv(ctr.Image), "HOSTNAME="+pod.Name)
	for _, e := range ctr.Env {
		if e.ValueFrom == nil {
			env = mergeEnv(env, e.Name+"="+e.Value)
		}
	}
	cwd := ctr.WorkingDir
	if cwd == "" {
		cwd = "/"
	}
	// The user, as a CRI runtime takes it: the container's securityContext over
	// the pod's; root otherwise (the test image has no USER).
	var user rspec.User
	if psc := pod.Spec.SecurityContext; psc != nil {
		if psc.RunAsUser != nil {
			user.UID = uint32(*psc.RunAsUser)
		}
		if psc.RunAsGroup != nil {
			user.GID = uint32(*psc.RunAsGroup)
		}
	}
	if sc := ctr.SecurityContext; sc != nil {
		if sc.RunAsUser != nil {
			user.UID = uint32(*sc.RunAsUser)
		}
		if sc.RunAsGroup != nil {
			user.GID = uint32(*sc.RunAsGroup)
		}
	}
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
		"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT",
		"CAP_KILL", "CAP_AUDIT_WRITE"}
	return &rspec.Spec{
		Version: rspec.Version,
		Root:    &rspec.Root{Path: "rootfs"},
		Process: &rspec.Process{
			Args: args, Env: env, Cwd: cwd, User: user,
			Capabilities:    &rspec.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
			NoNewPrivileges: true,
		},
		Hostname: pod.Name,
		Mounts: []rspec.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: SimStateMount, Type: "bind", Source: filepath.Join(r.node.SimRoot(), "etc", "gpu-sim"), Options: []string{"rbind", "ro", "nosuid", "nodev"}},
		},
		Linux: &rspec.Linux{
			Namespaces: []rspec.LinuxNamespace{{Type: rspec.PIDNamespace}, {Type: rspec.IPCNamespace},
				{Type: rspec.UTSNamespace}, {Type: rspec.MountNamespace}, {Type: rspec.NetworkNamespace}},
			Resources: &rspec.LinuxResources{Devices: []rspec.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}}},
			MaskedPaths: []string{"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
				"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"},
			ReadonlyPaths: []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"},
		},
	}
}

// killPod kills and deletes the pod's containers and forgets them.
func (r *runtime) killPod(uid types.UID) {
	r.mu.Lock()
	ctrs := r.pods[uid]
	delete(r.pods, uid)
	for k, u := range r.byKey {
		if u == uid {
			delete(r.byKey, k)
		}
	}
	r.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range ctrs {
		wg.Add(1)
		go func() { defer wg.Done(); r.kill(c) }()
	}
	wg.Wait()
}

// killKey is killPod for a pod known only by namespace/name (it is gone).
func (r *runtime) killKey(key string) {
	r.mu.Lock()
	uid, ok := r.byKey[key]
	r.mu.Unlock()
	if ok {
		r.killPod(uid)
	}
}

func (r *runtime) kill(c *Container) {
	_ = exec.Command(r.runc, "--root", r.root, "kill", c.ID, "KILL").Run()
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		c.mu.Lock()
		cmd := c.cmd
		c.mu.Unlock()
		if cmd != nil && cmd.Process != nil {
			_ = cmd.Process.Kill()
		}
	}
	_ = exec.Command(r.runc, "--root", r.root, "delete", "--force", c.ID).Run()
	_ = os.RemoveAll(c.Bundle)
}

// stop kills every container of the node, including any runc still lists
// under the node's root (a container whose start was interrupted).
func (r *runtime) stop() {
	r.mu.Lock()
	r.stopped = true
	var uids []types.UID
	for uid := range r.pods {
		uids = append(uids, uid)
	}
	r.mu.Unlock()
	for _, uid := range uids {
		r.killPod(uid)
	}
	out, _ := exec.Command(r.runc, "--root", r.root, "list", "-q").Output()
	for _, id := range strings.Fields(string(out)) {
		_ = exec.Command(r.runc, "--root", r.root, "delete", "--force", id).Run()
	}
}

// podStatus is the pod phase and container statuses the kubelet would
// report from the runtime's view of the pod's containers.
func (r *runtime) podStatus(pod *v1.Pod) (v1.PodPhase, []v1.ContainerStatus) {
	byName := map[string]*Container{}
	for _, c := range r.containers(pod.UID) {
		byName[c.Name] = c
	}
	running, failed, done := 0, 0, 0
	var statuses []v1.ContainerStatus
	for _, ctr := range pod.Spec.Containers {
		st := v1.ContainerStatus{Name: ctr.Name, Image: ctr.Image, ImageID: ctr.Image}
		c, ok := byName[ctr.Name]
		if !ok {
			st.State.Waiting = &v1.ContainerStateWaiting{Reason: "ContainerCreating"}
			statuses = append(statuses, st)
			continue
		}
		st.ContainerID = "runc://" + c.ID
		c.mu.Lock()
		switch c.phase {
		case ContainerRunning:
			running++
			st.Ready, st.Started = true, new(true)
			st.State.Running = &v1.ContainerStateRunning{StartedAt: c.started}
		case ContainerExited:
			done++
			reason := "Completed"
			if c.exitCode != 0 {
				reason = "Error"
				failed++
			}
			st.Started = new(false)
			st.State.Terminated = &v1.ContainerStateTerminated{ExitCode: c.exitCode, Reason: reason,
				StartedAt: c.started, FinishedAt: c.finished, ContainerID: st.ContainerID}
		case ContainerStartFailed:
			done++
			failed++
			st.Started = new(false)
			st.State.Terminated = &v1.ContainerStateTerminated{ExitCode: c.exitCode, Reason: "StartError",
				Message: c.message, StartedAt: c.started, FinishedAt: c.finished, ContainerID: st.ContainerID}
		}
		c.mu.Unlock()
		statuses = append(statuses, st)
	}
	restarts := pod.Spec.RestartPolicy == v1.RestartPolicyAlways || pod.Spec.RestartPolicy == "" ||
		(pod.Spec.RestartPolicy == v1.RestartPolicyOnFailure && failed > 0)
	switch {
	case done < len(pod.Spec.Containers) && running+done == len(pod.Spec.Containers):
		return v1.PodRunning, statuses
	case done == len(pod.Spec.Containers) && restarts:
		// The kubelet would restart the containers and keep the pod Running
		// (a workload controller does not replace it); this loop does not
		// restart them: they stay exited, reported as the kubelet reports a
		// container between restarts (real nodes restart them).
		for i := range statuses {
			if t := statuses[i].State.Terminated; t != nil {
				statuses[i].LastTerminationState.Terminated = t
				statuses[i].State = v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
					Message: "exited; containers of pods on pod-loop nodes are not restarted"}}
			}
		}
		return v1.PodRunning, statuses
	case done == len(pod.Spec.Containers) && failed > 0:
		return v1.PodFailed, statuses
	case done == len(pod.Spec.Containers):
		return v1.PodSucceeded, statuses
	default:
		return v1.PodPending, statuses
	}
}

// statusSignature is what decides whether a pod's status needs writing:
// phase and each container's state, not timestamps.
func statusSignature(phase v1.PodPhase, statuses []v1.ContainerStatus) string {
	parts := []string{string(phase)}
	for _, s := range statuses {
		switch {
		case s.State.Running != nil:
			parts = append(parts, s.Name+":running")
		case s.State.Terminated != nil:
			t := s.State.Terminated
			parts = append(parts, fmt.Sprintf("%s:terminated:%d:%s:%s", s.Name, t.ExitCode, t.Reason, t.Message))
		case s.State.Waiting != nil:
			parts = append(parts, s.Name+":waiting:"+s.State.Waiting.Reason+":"+s.State.Waiting.Message)
		default:
			parts = append(parts, s.Name+":unknown")
		}
	}
	sort.Strings(parts[1:])
	return strings.Join(parts, "|")
}

// ExecResult is what a command run in a container printed and how it ended.
type ExecResult struct {
	Stdout, Stderr string
	ExitCode       int
}

// Exec runs a command in a running container of a pod on this node, like
// `kubectl exec` (runc exec: same namespaces, root, devices and cgroup; on
// a real node CRI ExecSync, see realnode_cri.go).
func (n *Node) Exec(ctx context.Context, pod *v1.Pod, container string, args ...string) (ExecResult, error) {
	if n.real != nil {
		return n.real.exec(ctx, pod, container, args)
	}
	if n.runtime == nil {
		return ExecResult{}, fmt.Errorf("%w: node %s runs no containers", ErrNoContainer, n.Name)
	}
	c, err := n.runtime.container(pod.UID, container)
	if err != nil {
		return ExecResult{}, err
	}
	if phase, _, msg := c.State(); phase != ContainerRunning {
		return ExecResult{}, fmt.Errorf("container %s of pod %s/%s is %s: %s", container, pod.Namespace, pod.Name, phase, msg)
	}
	var stdout, stderr strings.Builder
	cmd := exec.CommandContext(ctx, n.runtime.runc, append([]string{"--root", n.runtime.root, "exec", c.ID}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	res := ExecResult{Stdout: stdout.String(), Stderr: stderr.String()}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		res.ExitCode = ee.ExitCode()
		return res, nil
	}
	return res, err
}

// ContainerLogs is what a container of a pod on this node has written to
// stdout and stderr so far (kept after the pod is gone on pod-loop nodes;
// on a real node the kubelet's files, every attempt, gone with the pod).
func (n *Node) ContainerLogs(pod *v1.Pod, container string) (string, error) {
	if n.real != nil {
		return n.real.logs(pod, container)
	}
	path := filepath.Join(n.Dir, "logs", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), container+".log")
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("%w: no logs of container %q of pod %s/%s on %s", ErrNoContainer, container, pod.Namespace, pod.Name, n.Name)
	}
	return string(data), err
}

// Containers are the runc containers of a pod on this node (on a real node
// the latest attempt of each, as containerd's CRI reports them; none if
// containerd does not answer).
func (n *Node) Containers(pod *v1.Pod) []*Container {
	if n.real != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		ctrs, err := n.real.containers(ctx, pod)
		if err != nil {
			n.logger.Error(err, "list containers", "pod", pod.Namespace+"/"+pod.Name)
			return nil
		}
		return ctrs
	}
	if n.runtime == nil {
		return nil
	}
	return n.runtime.containers(pod.UID)
}

// RuncList is what runc lists under this node's root: container IDs that
// runc still keeps state for (on a real node, containerd's runc).
func (n *Node) RuncList() ([]string, error) {
	if n.real != nil {
		return n.real.runcList()
	}
	if n.runtime == nil {
		return nil, nil
	}
	out, err := exec.Command(n.runtime.runc, "--root", n.runtime.root, "list", "-q").Output()
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(out)), nil
}
