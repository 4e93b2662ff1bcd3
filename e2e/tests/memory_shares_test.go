package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// memoryShareGPU is the GPU of the memory-share node offered as memory
// shares: GPU 4 of the dgx-a100-40gb profile, an A100-SXM4-40GB with MIG
// disabled (GPUs 0-3 have MIG on).
const memoryShareGPU = "gpu-4"

// shareClaim asks for `memory` of the GPU with this UUID, as one share, with
// an MPS config (plus extra mpsConfig fields).
func shareClaim(t *testing.T, ns, name, uuid, memory string, mps map[string]any) *resourceapi.ResourceClaim {
	t.Helper()
	claim := pinnedClaim(ns, name, "gpu.nvidia.com", uuid)
	claim.Spec.Devices.Requests[0].Exactly.Capacity = &resourceapi.CapacityRequirements{
		Requests: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)},
	}
	if mps == nil {
		mps = map[string]any{}
	}
	claim.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{
		Requests: []string{"gpu"},
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: opaque(t, map[string]any{
			"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
			"sharing": map[string]any{"strategy": "MPS", "mpsConfig": mps},
		})},
	}}
	return claim
}

// cudaApp runs the CUDA program stand-in in the pod's container and returns
// what it printed; it must have joined an MPS server.
func cudaApp(ctx context.Context, t *testing.T, pod *v1.Pod) string {
	t.Helper()
	res, err := cluster.Node(pod.Spec.NodeName).Exec(ctx, pod, "ctr", "cuda-app")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod %s: cuda-app says:\n%s", pod.Name, strings.TrimRight(res.Stdout, "\n"))
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "MPS server ") {
		t.Fatalf("pod %s: the CUDA program did not join an MPS server (exit %d): %s%s", pod.Name, res.ExitCode, res.Stdout, res.Stderr)
	}
	return res.Stdout
}

// mpsServer is the server PID cuda-app reports.
func mpsServer(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if p, ok := strings.CutPrefix(l, "MPS server "); ok {
			return p
		}
	}
	return ""
}

// TestMemoryShares: a 40 GB A100 offered as memory shares is published as one
// device several claims may hold; three claims of 10Gi, 10Gi and 20Gi with MPS
// run at once on it, each container limited to its share (pinned memory) and
// its part of the threads, through one MPS daemon; a fourth claim of 10Gi
// stays pending with the scheduler's reason until one of them goes; after all
// are gone the daemon is gone and the GPU back in compute mode DEFAULT.
func TestMemoryShares(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-memshare"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--memory-share-gpus=" + memoryShareGPU}, nil)
	ns := newNamespace(ctx, t, "memshare")

	// Published: the shared GPU allows multiple allocations, with a request
	// policy on its memory; the other whole GPUs do not.
	devices := poolDevices(ctx, t, name)
	gpu, ok := devices[memoryShareGPU]
	if !ok {
		t.Fatalf("%s not published: %v", memoryShareGPU, keys(devices))
	}
	if gpu.AllowMultipleAllocations == nil || !*gpu.AllowMultipleAllocations {
		t.Fatalf("%s does not allow multiple allocations: %+v", memoryShareGPU, gpu)
	}
	memory := gpu.Capacity["memory"]
	if memory.RequestPolicy == nil || memory.RequestPolicy.ValidRange == nil {
		t.Fatalf("%s memory has no request policy with a range: %+v", memoryShareGPU, memory)
	}
	t.Logf("%s memory %s, request policy default %s, min %s, step %s", memoryShareGPU, memory.Value.String(),
		memory.RequestPolicy.Default, memory.RequestPolicy.ValidRange.Min, memory.RequestPolicy.ValidRange.Step)
	if other := devices["gpu-5"]; other.AllowMultipleAllocations != nil {
		t.Errorf("gpu-5 is not a memory-share GPU but allows multiple allocations")
	}
	uuid := attrString(gpu, "uuid")

	// Three shares at once: 10Gi, 10Gi, 20Gi = the GPU's 40Gi.
	shares := []struct {
		name, memory, limit, pct string
	}{
		{"share-a", "10Gi", "10G", "25.0"},
		{"share-b", "10Gi", "10G", "25.0"},
		{"share-c", "20Gi", "20G", "50.0"},
	}
	// Created one after the other, each once the previous one runs: three created in the same
	// instant once left the third Pending for good (the scheduler's "cannot allocate all
	// claims" from a moment when the first two were being allocated, with no later event to
	// retry it within the wait), which is the scheduler's queueing, not what is tested here.
	pods := map[string]*v1.Pod{}
	for _, s := range shares {
		pods[s.name] = createClaimAndPod(ctx, t, shareClaim(t, ns, s.name, uuid, s.memory, nil), name)
		if _, err := cluster.WaitPodRunning(ctx, ns, s.name, 90*time.Second); err != nil {
			t.Fatalf("pod %s: %v; kubelet errors: %v\nplugin log:\n%s", s.name, err, n.DRAErrors(), n.Plugin.Log())
		}
	}
	servers := map[string]bool{}
	for _, s := range shares {
		running, err := cluster.WaitPodRunning(ctx, ns, s.name, 90*time.Second)
		if err != nil {
			t.Fatalf("pod %s: %v; kubelet errors: %v\nplugin log:\n%s", s.name, err, n.DRAErrors(), n.Plugin.Log())
		}
		pods[s.name] = running
		claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, s.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		res := claim.Status.Allocation.Devices.Results[0]
		if res.Device != memoryShareGPU || res.ShareID == nil {
			t.Fatalf("claim %s: allocated %s share %v, want a share of %s", s.name, res.Device, res.ShareID, memoryShareGPU)
		}
		consumed := res.ConsumedCapacity["memory"]
		if consumed.Cmp(resource.MustParse(s.memory)) != 0 {
			t.Errorf("claim %s consumes %s, want %s", s.name, consumed.String(), s.memory)
		}
		out := cudaApp(ctx, t, running)
		if want := "active thread percentage " + s.pct + "\n"; !strings.Contains(out, want) {
			t.Errorf("pod %s: want %q from its MPS client", s.name, want)
		}
		if want := fmt.Sprintf("device 0 %s pinned memory limit %s\n", uuid, s.limit); !strings.Contains(out, want) {
			t.Errorf("pod %s: want %q from its MPS client", s.name, want)
		}
		servers[mpsServer(out)] = true
		var shareEnv string
		for _, r := range podDevices(t, running)["ctr"] {
			if v, ok := envValue(r.Env(), "GPU_DRA_MEMORY_SHARE"); ok {
				shareEnv = v
			}
		}
		asked := resource.MustParse(s.memory)
		if want := fmt.Sprint(asked.Value()); shareEnv != want {
			t.Errorf("pod %s: GPU_DRA_MEMORY_SHARE=%q, want %s", s.name, shareEnv, want)
		}
	}
	if len(servers) != 1 {
		t.Errorf("the three shares joined %d MPS servers, want one (one daemon per GPU): %v", len(servers), keys(servers))
	}
	if daemons := n.MPSDaemons(); len(daemons) != 1 {
		t.Errorf("want one MPS control daemon for the shared GPU, got %d", len(daemons))
	}
	if got := computeMode(t, n, uuid); got != "EXCLUSIVE_PROCESS" {
		t.Errorf("compute mode of the shared GPU while shares run: %s", got)
	}

	// A fourth share does not fit: the scheduler keeps it pending.
	staysPending(ctx, t, shareClaim(t, ns, "share-d", uuid, "10Gi", nil), name)

	// One share goes: the fourth runs, with its own limits, on the same daemon.
	deleteClaimAndPod(ctx, t, pods["share-a"])
	running, err := cluster.WaitPodRunning(ctx, ns, "share-d", 90*time.Second)
	if err != nil {
		t.Fatalf("pod share-d after share-a was deleted: %v; kubelet errors: %v", err, n.DRAErrors())
	}
	out := cudaApp(ctx, t, running)
	if !strings.Contains(out, "active thread percentage 25.0\n") || !strings.Contains(out, "pinned memory limit 10G\n") {
		t.Errorf("pod share-d: want 25%% of the threads and 10G pinned memory: %s", out)
	}
	if !servers[mpsServer(out)] {
		t.Errorf("pod share-d joined server %s, not the one the other shares use (%v)", mpsServer(out), keys(servers))
	}

	// All gone: the daemon stops with the last share, the GPU is back to DEFAULT.
	for _, p := range []*v1.Pod{pods["share-b"], pods["share-c"]} {
		deleteClaimAndPod(ctx, t, p)
		if len(n.MPSDaemons()) != 1 {
			t.Errorf("the shared MPS daemon stopped while share-d still runs")
		}
	}
	deleteClaimAndPod(ctx, t, running)
	if !eventually(ctx, 20*time.Second, func() bool { return len(n.MPSDaemons()) == 0 }) {
		t.Errorf("MPS daemon still running after the last share was deleted: %v", n.MPSDaemons())
	}
	if got := computeMode(t, n, uuid); got != "DEFAULT" {
		t.Errorf("compute mode of %s after the last share: %s, want DEFAULT", uuid, got)
	}
}

// TestMemorySharesOfTwoUsers: two claims' pods on one memory-share GPU, running
// as different users, both use its MPS server at once. An MPS daemon serves one
// user's server at a time and a client of another user waits until that
// server's clients are gone, so without a multi-user daemon (-M, which the
// plugin starts on GPUs of compute capability 7.0 and newer, the A100 here
// 8.0) the second user's program would hang while the first one runs.
func TestMemorySharesOfTwoUsers(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-memshare-users"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--memory-share-gpus=" + memoryShareGPU}, nil)
	ns := newNamespace(ctx, t, "memshare-users")
	uuid := attrString(poolDevices(ctx, t, name)[memoryShareGPU], "uuid")

	users := map[string]int64{"user-a": 1000, "user-b": 2000}
	pods := map[string]*v1.Pod{}
	for pod, uid := range users {
		claim := shareClaim(t, ns, pod, uuid, "10Gi", nil)
		p := claimPod(ns, pod, name, pod)
		p.Spec.SecurityContext = &v1.PodSecurityContext{RunAsUser: &uid, RunAsGroup: &uid}
		pods[pod], _ = runClaimPod(ctx, t, claim, p)
	}
	if daemons := n.MPSDaemons(); len(daemons) != 1 {
		t.Fatalf("want one MPS control daemon for the shared GPU, got %d", len(daemons))
	} else if args := strings.Join(daemons[0].Args[1:], " "); !strings.Contains(args, "-M") {
		t.Errorf("the shared GPU's daemon runs without -M: %q", args)
	}

	// user-a's program stays on the server (in the background of its exec)...
	held, err := n.Exec(ctx, pods["user-a"], "ctr", "sh", "-c",
		`cuda-app --hold-seconds 60 >/dev/shm/held 2>&1 & `+
			`for i in $(seq 100); do grep -q "MPS server" /dev/shm/held && break; sleep 0.1; done; id -u; cat /dev/shm/held`)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod user-a: %s", held.Stdout)
	if !strings.HasPrefix(held.Stdout, "1000\n") || mpsServer(held.Stdout) == "" {
		t.Fatalf("pod user-a: the program did not join an MPS server as user 1000: %s%s", held.Stdout, held.Stderr)
	}
	// ...while user-b's joins the same server at once.
	quick, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := n.Exec(quick, pods["user-b"], "ctr", "sh", "-c", "id -u; cuda-app")
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("pod user-b: the CUDA program did not finish while user-a's runs (%v, exit %d): %s%s",
			err, res.ExitCode, res.Stdout, res.Stderr)
	}
	t.Logf("pod user-b: %s", res.Stdout)
	if !strings.HasPrefix(res.Stdout, "2000\n") {
		t.Errorf("pod user-b does not run as user 2000: %s", res.Stdout)
	}
	if a, b := mpsServer(held.Stdout), mpsServer(res.Stdout); a != b {
		t.Errorf("the two users' programs joined servers %q and %q, want one", a, b)
	}
	for _, p := range pods {
		deleteClaimAndPod(ctx, t, p)
	}
}
