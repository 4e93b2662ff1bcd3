package tests

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// A node's containers: pod phase follows the containers and logs are kept
// (on the suite's real nodes), and a CDI spec that fails on a real node
// fails the same way in the pod loop's runtime (runtime.go).

// runtimePod is a pod pinned to a node with one container running script,
// CDI devices from cdi.k8s.io annotations (as containerd injects them for
// device plugins) and restartPolicy Never.
func runtimePod(ns, name, node, script string, cdiDevices ...string) *v1.Pod {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeName:                      node,
			RestartPolicy:                 v1.RestartPolicyNever,
			TerminationGracePeriodSeconds: &testGracePeriod,
			Containers:                    []v1.Container{{Name: "ctr", Image: "busybox:1.37", Command: []string{"sh", "-c", script}}},
		},
	}
	if len(cdiDevices) > 0 {
		pod.Annotations = map[string]string{"cdi.k8s.io/e2e": strings.Join(cdiDevices, ",")}
	}
	return pod
}

// waitPodPhase waits until the pod reaches phase; it fails early on any other
// terminal phase.
func waitPodPhase(ctx context.Context, t *testing.T, pod *v1.Pod, phase v1.PodPhase) *v1.Pod {
	t.Helper()
	var got *v1.Pod
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		got = p
		if p.Status.Phase == phase {
			return true, nil
		}
		if p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed {
			return false, errUnexpectedPhase
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("pod %s: want phase %s: %v; %s", pod.Name, phase, err, harness.PodProblem(got))
	}
	return got
}

var errUnexpectedPhase = errors.New("reached another terminal phase")

func createPod(ctx context.Context, t *testing.T, pod *v1.Pod) {
	t.Helper()
	if _, err := cluster.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", pod.Name, err)
	}
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{})
		_ = cluster.WaitPodGone(context.Background(), pod.Namespace, pod.Name, 60*time.Second)
	})
}

// A container that exits 0 makes a restartPolicy Never pod Succeeded, one
// that exits non-zero makes it Failed with its exit code; what they print
// stays readable; a deleted pod's runc containers are gone.
func TestContainerExitAndLogs(t *testing.T) {
	requireRegistered(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "runtime-exit")

	ok := runtimePod(ns, "ok", nodeT4, "echo hello from $HOSTNAME; exit 0")
	createPod(ctx, t, ok)
	got := waitPodPhase(ctx, t, ok, v1.PodSucceeded)
	if st := got.Status.ContainerStatuses[0].State.Terminated; st == nil || st.ExitCode != 0 || st.Reason != "Completed" {
		t.Errorf("exit 0: container state %+v", got.Status.ContainerStatuses[0].State)
	}
	checkContainerLog(ctx, t, got, "ctr", "hello from ok")

	bad := runtimePod(ns, "bad", nodeT4, "echo failing >&2; exit 3")
	createPod(ctx, t, bad)
	got = waitPodPhase(ctx, t, bad, v1.PodFailed)
	if st := got.Status.ContainerStatuses[0].State.Terminated; st == nil || st.ExitCode != 3 || st.Reason != "Error" {
		t.Errorf("exit 3: container state %+v", got.Status.ContainerStatuses[0].State)
	}
	checkContainerLog(ctx, t, got, "ctr", "failing")

	long := runtimePod(ns, "long", nodeT4, "sleep 3600")
	createPod(ctx, t, long)
	running, err := cluster.WaitPodRunning(ctx, ns, long.Name, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	node := cluster.Node(nodeT4)
	// Own PID namespace: the container's command is PID 1 there.
	res, err := node.Exec(ctx, running, "ctr", "sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname")
	if err != nil || !strings.Contains(res.Stdout, "sleep 3600") || !strings.Contains(res.Stdout, "long") {
		t.Errorf("exec in long-running container: %v %+v", err, res)
	}
	checkNoGPU(ctx, t, running, "ctr")
	ctrs := node.Containers(running)
	if len(ctrs) != 1 {
		t.Fatalf("containers of the running pod: %d, want 1", len(ctrs))
	}
	before, err := node.RuncList()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(before, ctrs[0].ID) {
		t.Fatalf("runc does not list the running container %s: %v", ctrs[0].ID, before)
	}
	deletePod(ctx, t, running)
	ids, err := node.RuncList()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(ids, ctrs[0].ID) {
		t.Errorf("runc still lists container %s of the deleted pod", ctrs[0].ID)
	}
}

// A CDI spec naming a missing device node, a missing host path or a missing
// hook binary makes the container fail with the runtime's message, as it
// does on a real node; the same spec's good device runs. It checks the pod
// loop's runtime (still the runtime of NVIDIA-runtime and deployed-layout
// nodes) against containerd's behaviour, so it runs on a pod-loop node: the
// CDI IDs come from cdi.k8s.io pod annotations, which only the pod loop
// applies (the real kubelet hands containerd only DRA's and device
// plugins' CDI devices).
func TestBrokenCDISpecFailsTheContainer(t *testing.T) {
	requireRegistered(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "runtime-cdi")
	const nodeName = "node-podloop-cdi"
	node, err := cluster.AddNode(ctx, harness.NodeOptions{Name: nodeName, PodLoop: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cluster.RemoveNode(context.Background(), nodeName); err != nil {
			t.Errorf("remove node %s: %v", nodeName, err)
		}
	})
	// The simulated host (the state folder every container mounts); no plugin.
	if err := node.SetupSim("t4"); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(node.Dir, "e2e-cdi-good.txt")
	if err := os.WriteFile(good, []byte("mounted\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := map[string]any{
		"cdiVersion": "1.1.0",
		"kind":       "e2e.example.com/test",
		"devices": []any{
			map[string]any{"name": "good", "containerEdits": map[string]any{
				"env":    []string{"E2E_CDI=good"},
				"mounts": []any{map[string]any{"hostPath": good, "containerPath": "/e2e/good.txt", "options": []string{"ro", "bind"}}},
			}},
			map[string]any{"name": "missing-node", "containerEdits": map[string]any{
				"deviceNodes": []any{map[string]any{"path": "/dev/nvidia99", "hostPath": filepath.Join(node.SimRoot(), "dev", "nvidia99")}},
			}},
			map[string]any{"name": "missing-mount", "containerEdits": map[string]any{
				"mounts": []any{map[string]any{"hostPath": filepath.Join(node.SimRoot(), "usr/lib/x86_64-linux-gnu/libnvidia-missing.so.1"),
					"containerPath": "/usr/lib/x86_64-linux-gnu/libnvidia-missing.so.1", "options": []string{"ro", "bind"}}},
			}},
			map[string]any{"name": "missing-hook", "containerEdits": map[string]any{
				"hooks": []any{map[string]any{"hookName": "createContainer", "path": filepath.Join(node.SimRoot(), "usr/bin/nvidia-cdi-hook"),
					"args": []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}}},
			}},
		},
	}
	data, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	specPath := filepath.Join(node.CDIRoot, "e2e.example.com-test.json")
	if err := os.WriteFile(specPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(specPath) })

	t.Run("good", func(t *testing.T) {
		pod := runtimePod(ns, "good", nodeName, "echo $E2E_CDI; cat /e2e/good.txt; sleep 3600", "e2e.example.com/test=good")
		createPod(ctx, t, pod)
		running, err := cluster.WaitPodRunning(ctx, ns, pod.Name, 60*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		checkContainerLog(ctx, t, running, "ctr", "good\nmounted")
	})
	const enoent = "no such file or directory"
	for _, tc := range []struct{ device, path string }{
		// The CDI library refuses a device node it cannot stat.
		{"missing-node", "dev/nvidia99"},
		// runc cannot bind-mount a host path that does not exist.
		{"missing-mount", "libnvidia-missing.so.1"},
		// runc cannot run a hook binary that does not exist.
		{"missing-hook", "usr/bin/nvidia-cdi-hook"},
	} {
		t.Run(tc.device, func(t *testing.T) {
			pod := runtimePod(ns, tc.device, nodeName, "echo started; sleep 3600", "e2e.example.com/test="+tc.device)
			createPod(ctx, t, pod)
			failed := waitPodPhase(ctx, t, pod, v1.PodFailed)
			st := failed.Status.ContainerStatuses[0].State.Terminated
			if st == nil || st.Reason != "StartError" {
				t.Fatalf("container state %+v, want terminated with StartError", failed.Status.ContainerStatuses[0].State)
			}
			if !strings.Contains(st.Message, tc.path) || !strings.Contains(st.Message, enoent) {
				t.Errorf("runtime message %q does not say that %s does not exist", st.Message, tc.path)
			}
			t.Logf("%s: %s", tc.device, st.Message)
			if logs, _ := node.ContainerLogs(failed, "ctr"); strings.Contains(logs, "started") {
				t.Errorf("the container's command ran: %q", logs)
			}
		})
	}
}
