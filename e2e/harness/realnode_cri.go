package harness

// The harness's node API on real nodes (realnode.go): what a test asks of a
// node (run a command in a container, its logs, its state, the CDI devices
// it got, the kubelet's DRA errors) answered from the real components, so a
// test need not care which kind of node it runs on.
//
//   - Exec: CRI ExecSync on the node's containerd, the call the kubelet's
//     exec handler makes (`kubectl exec` ends there too).
//   - ContainerLogs: the kubelet's log files of the container (CRI log
//     format, every attempt in order), read back as the text written.
//   - Containers: the pod's containers as containerd's CRI reports them,
//     the latest attempt of each; RuncList: what runc still keeps state for
//     under the node's runc root (containerd's shim adds the namespace).
//   - CDI devices: the CDI device IDs the kubelet asked containerd to apply
//     to each container (CreateContainer's CDI_devices, in the container
//     status' verbose info), not anything the harness wrote.
//   - DRAErrors: the kubelet's FailedPrepareDynamicResources events of the
//     node's pods, and the unprepare errors its pod workers logged (the
//     kubelet reports those in no event).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// criLabelPodUID and criLabelContainerName are the labels the kubelet puts
// on every CRI container (pkg/kubelet/types/labels.go).
const (
	criLabelPodUID        = "io.kubernetes.pod.uid"
	criLabelContainerName = "io.kubernetes.container.name"
)

// cri calls f with a CRI runtime client of the node's containerd.
func (r *realNode) cri(f func(rt runtimeapi.RuntimeServiceClient) error) error {
	conn, err := grpc.NewClient("unix://"+r.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("node %s: CRI client: %w", r.n.Name, err)
	}
	defer conn.Close()
	return f(runtimeapi.NewRuntimeServiceClient(conn))
}

// latestContainers are the pod's CRI containers, the latest attempt of each
// container name, by name.
func (r *realNode) latestContainers(ctx context.Context, rt runtimeapi.RuntimeServiceClient, pod *v1.Pod) (map[string]*runtimeapi.Container, error) {
	list, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
		LabelSelector: map[string]string{criLabelPodUID: string(pod.UID)},
	}})
	if err != nil {
		return nil, fmt.Errorf("node %s: CRI ListContainers: %w", r.n.Name, err)
	}
	out := map[string]*runtimeapi.Container{}
	for _, c := range list.Containers {
		name := c.Labels[criLabelContainerName]
		if name == "" && c.Metadata != nil {
			name = c.Metadata.Name
		}
		if prev, ok := out[name]; !ok || c.Metadata.GetAttempt() > prev.Metadata.GetAttempt() {
			out[name] = c
		}
	}
	return out, nil
}

// containerStatus is the CRI status of the latest attempt of a pod's
// container, with containerd's verbose info.
func (r *realNode) containerStatus(ctx context.Context, rt runtimeapi.RuntimeServiceClient, pod *v1.Pod, name string) (*runtimeapi.ContainerStatusResponse, error) {
	all, err := r.latestContainers(ctx, rt, pod)
	if err != nil {
		return nil, err
	}
	c, ok := all[name]
	if !ok {
		return nil, fmt.Errorf("%w: container %q of pod %s/%s not in node %s's containerd", ErrNoContainer, name, pod.Namespace, pod.Name, r.n.Name)
	}
	st, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: c.Id, Verbose: true})
	if err != nil {
		return nil, fmt.Errorf("node %s: CRI ContainerStatus %s: %w", r.n.Name, c.Id, err)
	}
	return st, nil
}

// exec runs a command in the running container through CRI ExecSync.
func (r *realNode) exec(ctx context.Context, pod *v1.Pod, container string, args []string) (ExecResult, error) {
	var res ExecResult
	err := r.cri(func(rt runtimeapi.RuntimeServiceClient) error {
		st, err := r.containerStatus(ctx, rt, pod, container)
		if err != nil {
			return err
		}
		if s := st.Status.State; s != runtimeapi.ContainerState_CONTAINER_RUNNING {
			return fmt.Errorf("container %s of pod %s/%s is %s: %s %s", container, pod.Namespace, pod.Name, s, st.Status.Reason, st.Status.Message)
		}
		// ExecSync's timeout is whole seconds, 0 for none: the context's
		// deadline, rounded up.
		var timeout int64
		if dl, ok := ctx.Deadline(); ok {
			timeout = int64(time.Until(dl)/time.Second) + 1
		}
		out, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: st.Status.Id, Cmd: args, Timeout: timeout})
		if err != nil {
			return fmt.Errorf("node %s: CRI ExecSync in %s of pod %s/%s: %w", r.n.Name, container, pod.Namespace, pod.Name, err)
		}
		res = ExecResult{Stdout: string(out.Stdout), Stderr: string(out.Stderr), ExitCode: int(out.ExitCode)}
		return nil
	})
	return res, err
}

// containers are the pod's containers as containerd reports them.
func (r *realNode) containers(ctx context.Context, pod *v1.Pod) ([]*Container, error) {
	var out []*Container
	err := r.cri(func(rt runtimeapi.RuntimeServiceClient) error {
		all, err := r.latestContainers(ctx, rt, pod)
		if err != nil {
			return err
		}
		for name, c := range all {
			st, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: c.Id, Verbose: true})
			if err != nil {
				return fmt.Errorf("node %s: CRI ContainerStatus %s: %w", r.n.Name, c.Id, err)
			}
			ids, err := criCDIDevices(st)
			if err != nil {
				return err
			}
			ctr := &Container{ID: c.Id, Name: name, LogPath: st.Status.LogPath, CDIDevices: ids, done: make(chan struct{})}
			s := st.Status
			switch s.State {
			case runtimeapi.ContainerState_CONTAINER_RUNNING:
				ctr.phase = ContainerRunning
			case runtimeapi.ContainerState_CONTAINER_EXITED:
				ctr.phase, ctr.exitCode = ContainerExited, s.ExitCode
				// runc refused to start it: containerd reports it exited
				// (code 128) with the reason StartError, never run.
				if s.Reason == "StartError" {
					ctr.phase = ContainerStartFailed
				}
			default:
				ctr.phase = ContainerCreated
			}
			ctr.message = strings.TrimSpace(s.Reason + " " + s.Message)
			if s.StartedAt > 0 {
				ctr.started = metav1.NewTime(time.Unix(0, s.StartedAt))
			}
			if s.FinishedAt > 0 {
				ctr.finished = metav1.NewTime(time.Unix(0, s.FinishedAt))
			}
			out = append(out, ctr)
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, err
}

// criCDIDevices are the CDI device IDs the kubelet asked containerd to apply
// to a container: containerd's verbose info carries the CRI container config
// it was created with.
func criCDIDevices(st *runtimeapi.ContainerStatusResponse) ([]string, error) {
	raw, ok := st.Info["info"]
	if !ok {
		return nil, fmt.Errorf("CRI ContainerStatus of %s has no verbose info", st.Status.GetId())
	}
	var info struct {
		Config struct {
			CDIDevices []struct {
				Name string `json:"name"`
			} `json:"CDI_devices"`
		} `json:"config"`
	}
	if err := json.Unmarshal([]byte(raw), &info); err != nil {
		return nil, fmt.Errorf("CRI ContainerStatus of %s: verbose info: %w", st.Status.GetId(), err)
	}
	ids := []string{}
	for _, d := range info.Config.CDIDevices {
		ids = append(ids, d.Name)
	}
	return ids, nil
}

// cdiDevices are the CDI device IDs containerd applied to each container of
// the pod (an empty list for a container without devices).
func (r *realNode) cdiDevices(ctx context.Context, pod *v1.Pod) (map[string][]string, error) {
	ctrs, err := r.containers(ctx, pod)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, c := range ctrs {
		out[c.Name] = c.CDIDevices
	}
	for _, c := range pod.Spec.Containers {
		if _, ok := out[c.Name]; !ok {
			return nil, fmt.Errorf("%w: container %q of pod %s/%s not created on node %s yet", ErrNoContainer, c.Name, pod.Namespace, pod.Name, r.n.Name)
		}
	}
	return out, nil
}

// logs is what a container wrote, from the kubelet's log files of every
// attempt (<pod logs>/<ns>_<name>_<uid>/<container>/<attempt>.log), in
// attempt order.
func (r *realNode) logs(pod *v1.Pod, container string) (string, error) {
	dir := filepath.Join(r.n.Dir, "pod-logs", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), container)
	entries, err := os.ReadDir(dir)
	if err != nil {
		if os.IsNotExist(err) {
			return "", fmt.Errorf("%w: no logs of container %q of pod %s/%s on %s", ErrNoContainer, container, pod.Namespace, pod.Name, r.n.Name)
		}
		return "", err
	}
	type attempt struct {
		n    int
		path string
	}
	var attempts []attempt
	for _, e := range entries {
		base, ok := strings.CutSuffix(e.Name(), ".log")
		if !ok {
			continue // rotated files (<n>.log.<time>) are older parts of the same attempt; none here
		}
		if n, err := strconv.Atoi(base); err == nil {
			attempts = append(attempts, attempt{n, filepath.Join(dir, e.Name())})
		}
	}
	sort.Slice(attempts, func(i, j int) bool { return attempts[i].n < attempts[j].n })
	var b strings.Builder
	for _, a := range attempts {
		data, err := os.ReadFile(a.path)
		if err != nil {
			return "", err
		}
		b.WriteString(decodeCRILog(string(data)))
	}
	return b.String(), nil
}

// decodeCRILog is the text a CRI log file holds: each line is
// "<time> <stream> <P|F> <text>", P marking a partial line whose text
// continues in the next one (the kubelet splits long lines).
func decodeCRILog(data string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSuffix(data, "\n"), "\n") {
		fields := strings.SplitN(line, " ", 4)
		if len(fields) < 3 {
			continue
		}
		if len(fields) == 4 {
			b.WriteString(fields[3])
		}
		if fields[2] != "P" {
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// runcList lists the containers runc keeps state for under the node's runc
// root (one folder per containerd namespace).
func (r *realNode) runcList() ([]string, error) {
	runc, err := exec.LookPath("runc")
	if err != nil {
		return nil, err
	}
	root := filepath.Join(r.n.Dir, "runc")
	entries, err := os.ReadDir(root)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		out, err := exec.Command(runc, "--root", filepath.Join(root, e.Name()), "list", "-q").Output()
		if err != nil {
			return nil, fmt.Errorf("runc list under %s: %w", filepath.Join(root, e.Name()), err)
		}
		ids = append(ids, strings.Fields(string(out))...)
	}
	return ids, nil
}

// draErrors are the kubelet's DRA errors: FailedPrepareDynamicResources
// events of pods on this node ("prepare ns/pod: message", oldest first,
// each repetition of a message once), then the unprepare errors in its log
// ("unprepare ns/pod: error").
func (r *realNode) draErrors(ctx context.Context) []string {
	var out []string
	list, err := r.n.cluster.Client.CoreV1().Events("").List(ctx, metav1.ListOptions{
		FieldSelector: "reason=FailedPrepareDynamicResources,involvedObject.kind=Pod",
	})
	if err == nil {
		items := list.Items
		sort.SliceStable(items, func(i, j int) bool { return items[i].FirstTimestamp.Before(&items[j].FirstTimestamp) })
		for _, e := range items {
			if e.Source.Host != r.n.Name {
				continue
			}
			out = append(out, fmt.Sprintf("prepare %s/%s: %s", e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Message))
		}
	} else {
		out = append(out, "listing the kubelet's events: "+err.Error())
	}
	return append(out, unprepareErrors(r.n.KubeletLog())...)
}

// unprepareErrors finds the pod workers' failed syncs of terminating pods
// whose error is the DRA manager's unprepare in a kubelet log (klog text:
// `"Error syncing pod, skipping" err="..." pod="ns/name" ...`).
func unprepareErrors(log string) []string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		_, rest, ok := strings.Cut(line, `"Error syncing pod, skipping" err=`)
		if !ok {
			continue
		}
		msg, rest, err := cutQuoted(rest)
		if err != nil || !strings.Contains(strings.ToLower(msg), "unprepare") {
			continue
		}
		_, rest, ok = strings.Cut(rest, " pod=")
		if !ok {
			continue
		}
		pod, _, err := cutQuoted(rest)
		if err != nil {
			continue
		}
		out = append(out, fmt.Sprintf("unprepare %s: %s", pod, msg))
	}
	return out
}

// cutQuoted reads a Go-quoted string at the start of s, returning it and what follows.
func cutQuoted(s string) (string, string, error) {
	q, err := strconv.QuotedPrefix(s)
	if err != nil {
		return "", "", err
	}
	v, err := strconv.Unquote(q)
	return v, s[len(q):], err
}
