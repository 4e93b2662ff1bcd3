package harness

// What tests see of the DaemonSet pods on a real node (the chart's plugin
// pods): kube-controller-manager's DaemonSet controller creates them, the
// node's kubelet runs them with containerd. A DaemonPod is the API's Pod
// plus what the node has of its container: the log the kubelet keeps, the
// OCI spec containerd gave runc (its bundle's config.json), its process.
// Nothing here runs or changes a pod, except Kill, which crashes the
// container's process as a fault would.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// DaemonPod is a DaemonSet's pod on a real node, as listed.
type DaemonPod struct {
	// DaemonSet is namespace/name of the owner.
	DaemonSet string
	// Pod is the Pod object as listed.
	Pod *v1.Pod

	node *Node
	// containerID is the first container's containerd ID when listed ("" if
	// it had none yet).
	containerID string
}

// DaemonPods are the DaemonSet pods bound to this node that the API still
// has (terminating ones included), oldest first.
func (n *Node) DaemonPods() []*DaemonPod {
	pods, err := n.cluster.Client.CoreV1().Pods("").List(context.Background(), metav1.ListOptions{FieldSelector: "spec.nodeName=" + n.Name})
	if err != nil {
		return nil
	}
	var out []*DaemonPod
	for i := range pods.Items {
		p := &pods.Items[i]
		ref := metav1.GetControllerOf(p)
		if ref == nil || ref.Kind != "DaemonSet" {
			continue
		}
		d := &DaemonPod{DaemonSet: p.Namespace + "/" + ref.Name, Pod: p, node: n}
		if len(p.Status.ContainerStatuses) > 0 {
			_, d.containerID, _ = strings.Cut(p.Status.ContainerStatuses[0].ContainerID, "://")
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pod.CreationTimestamp.Before(&out[j].Pod.CreationTimestamp) })
	return out
}

// DaemonPodError is the DaemonSet controller's last failure to create the
// DaemonSet's pod (namespace/name), from its FailedCreate events; nil if
// there is none.
func (n *Node) DaemonPodError(ds string) error {
	ns, name, _ := strings.Cut(ds, "/")
	events, err := n.cluster.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.kind=DaemonSet,involvedObject.name=" + name + ",reason=FailedCreate",
	})
	if err != nil || len(events.Items) == 0 {
		return nil
	}
	last := events.Items[0]
	for _, e := range events.Items[1:] {
		if e.LastTimestamp.After(last.LastTimestamp.Time) {
			last = e
		}
	}
	return errors.New(last.Message)
}

// bundle is the container's runc bundle in the node's containerd state.
func (d *DaemonPod) bundle() string {
	if d.containerID == "" || d.node.real == nil {
		return ""
	}
	return filepath.Join(d.node.real.dir, "state", "io.containerd.runtime.v2.task", "k8s.io", d.containerID)
}

// Spec is the OCI spec containerd ran the pod's (first) container with;
// nil once the container is gone.
func (d *DaemonPod) Spec() *rspec.Spec {
	b := d.bundle()
	if b == "" {
		return nil
	}
	data, err := os.ReadFile(filepath.Join(b, "config.json"))
	if err != nil {
		return nil
	}
	var spec rspec.Spec
	if json.Unmarshal(data, &spec) != nil {
		return nil
	}
	return &spec
}

// pid is the container's process as this machine numbers it (0: none).
func (d *DaemonPod) pid() int {
	b := d.bundle()
	if b == "" {
		return 0
	}
	data, err := os.ReadFile(filepath.Join(b, "init.pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return pid
}

// Running says whether the container seen when listed still has its
// process (a zombie does not count).
func (d *DaemonPod) Running() bool {
	pid := d.pid()
	if pid <= 0 {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(stat, ')')
	return i > 0 && i+2 < len(stat) && stat[i+2] != 'Z'
}

// Kill kills the container's process with SIGKILL, as a crash; the kubelet
// starts it again (restartPolicy Always).
func (d *DaemonPod) Kill() {
	if pid := d.pid(); pid > 0 {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// Log is what the pod's first container printed so far, every restart, as
// the kubelet keeps it.
func (d *DaemonPod) Log() string {
	return criLogs(d.node.podLogDir(d.Pod, d.Pod.Spec.Containers[0].Name))
}

// podLogDir is where a real node's kubelet keeps a container's logs:
// podLogsDir/<ns>_<name>_<uid>/<container>/<restart>.log.
func (n *Node) podLogDir(pod *v1.Pod, container string) string {
	return filepath.Join(n.Dir, "pod-logs", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), container)
}

// criLogs is the content of a container's log files in dir, oldest first
// (CRI format: time, stream, tag P or F, line).
func criLogs(dir string) string {
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	num := func(f string) int { n, _ := strconv.Atoi(strings.TrimSuffix(filepath.Base(f), ".log")); return n }
	sort.Slice(files, func(i, j int) bool { return num(files[i]) < num(files[j]) })
	var b strings.Builder
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
			if f := strings.SplitN(line, " ", 4); len(f) == 4 {
				b.WriteString(f[3])
				if f[2] == "F" {
					b.WriteByte('\n')
				}
			}
		}
	}
	return b.String()
}

// CRIContainer is a container a real node's containerd runs for a pod.
type CRIContainer struct {
	// ID is containerd's container ID.
	ID string
	// PodNamespace, PodName, PodUID name the pod; Name is the container's.
	PodNamespace, PodName, PodUID, Name string
	// Running says whether the container runs.
	Running bool
}

// CRIContainers are the containers (not the pod sandboxes) the node's
// containerd has, as `crictl ps -a` lists them; nil for other nodes.
func (n *Node) CRIContainers(ctx context.Context) ([]CRIContainer, error) {
	if n.real == nil {
		return nil, nil
	}
	conn, err := grpc.NewClient("unix://"+n.real.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	list, err := runtimeapi.NewRuntimeServiceClient(conn).ListContainers(ctx, &runtimeapi.ListContainersRequest{})
	if err != nil {
		return nil, err
	}
	var out []CRIContainer
	for _, c := range list.Containers {
		out = append(out, CRIContainer{
			ID: c.Id, Name: c.Metadata.GetName(), Running: c.State == runtimeapi.ContainerState_CONTAINER_RUNNING,
			PodNamespace: c.Labels["io.kubernetes.pod.namespace"], PodName: c.Labels["io.kubernetes.pod.name"], PodUID: c.Labels["io.kubernetes.pod.uid"],
		})
	}
	return out, nil
}
