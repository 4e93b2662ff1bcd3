package tests

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestMPSTenantsOfTwoNamespaces: tenants sharing GPUs through MPS cannot stop
// or hijack each other. Two namespaces hold memory shares of the node's
// GPUs; a shared MPS daemon serves one namespace at a time, so the second
// namespace's share of the first one's GPU waits (its prepare is refused,
// naming both namespaces) while its share of another GPU runs a CUDA client
// on a daemon of its own. A pod of the first namespace finds no
// nvidia-cuda-mps-control and cannot rewrite its pipe folder (read-only),
// and even a quit sent to its daemon with the tool (as a root container
// bringing its own copy could) leaves the second namespace's client running
// on the same MPS server. Once the first namespace's share is gone, the
// waiting share runs.
func TestMPSTenantsOfTwoNamespaces(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-mps-tenants"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--memory-share-gpus=gpu-4,gpu-5"}, nil)
	nsA := newNamespace(ctx, t, "tenant-a")
	nsB := newNamespace(ctx, t, "tenant-b")
	devices := poolDevices(ctx, t, name)
	gpu4, gpu5 := attrString(devices["gpu-4"], "uuid"), attrString(devices["gpu-5"], "uuid")
	if gpu4 == "" || gpu5 == "" {
		t.Fatalf("gpu-4 and gpu-5 not published: %v", keys(devices))
	}
	running := func(ns, pod string) *v1.Pod {
		t.Helper()
		p, err := cluster.WaitPodRunning(ctx, ns, pod, 90*time.Second)
		if err != nil {
			t.Fatalf("pod %s/%s: %v; kubelet errors: %v\nplugin log:\n%s", ns, pod, err, n.DRAErrors(), n.Plugin.Log())
		}
		return p
	}
	exec := func(pod *v1.Pod, script string) (int, string) {
		t.Helper()
		res, err := n.Exec(ctx, pod, "ctr", "sh", "-c", script)
		if err != nil {
			t.Fatalf("exec in %s/%s: %v", pod.Namespace, pod.Name, err)
		}
		return res.ExitCode, res.Stdout + res.Stderr
	}

	// Tenant A: a share of gpu-4 (its pod sleeps: the attacker).
	createClaimAndPod(ctx, t, shareClaim(t, nsA, "a-gpu4", gpu4, "10Gi", nil), name)
	podA := running(nsA, "a-gpu4")
	cudaApp(ctx, t, podA)

	// Tenant B: a share of gpu-5 whose container is a CUDA client that keeps
	// running.
	claimB := shareClaim(t, nsB, "b-gpu5", gpu5, "10Gi", nil)
	if _, err := cluster.Client.ResourceV1().ResourceClaims(nsB).Create(ctx, claimB, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	client := claimPod(nsB, "b-gpu5", name, "b-gpu5")
	client.Spec.Containers[0].Command = []string{"cuda-app", "--seconds", "3600"}
	if _, err := cluster.Client.CoreV1().Pods(nsB).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	podB := running(nsB, "b-gpu5")
	var server string
	if !eventually(ctx, 30*time.Second, func() bool {
		logs, _ := n.ContainerLogs(podB, "ctr")
		server = mpsServer(logs)
		return server != ""
	}) {
		logs, _ := n.ContainerLogs(podB, "ctr")
		t.Fatalf("tenant B's client joined no MPS server: %s", logs)
	}
	if got := len(n.MPSDaemons()); got != 2 {
		t.Errorf("want one MPS daemon per GPU (two), got %d", got)
	}

	// Tenant B's share of gpu-4 waits: its daemon serves tenant A.
	waiting := createClaimAndPod(ctx, t, shareClaim(t, nsB, "b-gpu4", gpu4, "10Gi", nil), name)
	waitPrepareErrors(ctx, t, n, waiting,
		`already shared with MPS clients of namespace "`+nsA+`"`,
		`MPS clients of namespace "`+nsB+`"`)

	// Tenant A's pod tries to stop or hijack the daemon.
	if code, out := exec(podA, "command -v nvidia-cuda-mps-control || ls /usr/bin/nvidia-cuda-mps-control"); code == 0 {
		t.Errorf("an MPS client container has nvidia-cuda-mps-control: %s", out)
	}
	if code, out := exec(podA, "echo quit | nvidia-cuda-mps-control"); code != 127 {
		t.Errorf("echo quit | nvidia-cuda-mps-control in tenant A's pod: exit %d, want 127 (no such command): %s", code, out)
	}
	for _, attack := range []string{
		"rm -f /tmp/nvidia-mps/control",
		"mv /tmp/nvidia-mps/control /tmp/nvidia-mps/moved",
		"touch /tmp/nvidia-mps/control2",
		"mkdir /tmp/nvidia-mps/sub",
		"ln -s /tmp /tmp/nvidia-mps/link",
	} {
		code, out := exec(podA, attack)
		if code == 0 {
			t.Errorf("tenant A's pod rewrote its pipe folder: %q succeeded", attack)
		} else if !strings.Contains(out, "Read-only file system") {
			t.Errorf("%q failed, but not because the pipe folder is read-only: %s", attack, out)
		}
	}
	if code, out := exec(podA, "ls -la /tmp/nvidia-mps"); code != 0 || !strings.Contains(out, "control") {
		t.Errorf("tenant A's pipe folder (exit %d): %s", code, out)
	}
	// Its own client still connects through the read-only folder.
	cudaApp(ctx, t, podA)

	// The worst a root container of A can do with its own copy of the tool:
	// quit its daemon. B's client on its own daemon is untouched.
	var pipeA string
	for _, d := range n.MPSDaemons() {
		if strings.Contains(d.Env["CUDA_VISIBLE_DEVICES"], gpu4) {
			pipeA = d.Env["CUDA_MPS_PIPE_DIRECTORY"]
			mpsControl(t, d.Args[0], pipeA, "quit")
		}
	}
	if pipeA == "" {
		t.Fatalf("no MPS daemon serving gpu-4: %v", n.MPSDaemons())
	}
	time.Sleep(2 * time.Second)
	p := getPod(ctx, t, podB)
	if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].State.Running == nil || p.Status.ContainerStatuses[0].RestartCount != 0 {
		t.Errorf("tenant B's CUDA client stopped after tenant A's daemon quit: %+v", p.Status.ContainerStatuses)
	}
	if out := cudaApp(ctx, t, podB); mpsServer(out) != server {
		t.Errorf("tenant B's client joined server %s after A's quit, want the one it had, %s", mpsServer(out), server)
	}

	// Tenant A's share gone, tenant B's waiting share runs (on a new daemon
	// for B).
	deleteClaimAndPod(ctx, t, podA)
	running(nsB, "b-gpu4")
	cudaApp(ctx, t, getPod(ctx, t, waiting))
	deleteClaimAndPod(ctx, t, waiting)
	deleteClaimAndPod(ctx, t, podB)
	if !eventually(ctx, 20*time.Second, func() bool { return len(n.MPSDaemons()) == 0 }) {
		t.Errorf("MPS daemons still running after every share was deleted: %v", n.MPSDaemons())
	}
}
