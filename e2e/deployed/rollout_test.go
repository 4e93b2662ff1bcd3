package deployed

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// TestRollingUpgrade: `helm upgrade` rolls the node plugin with the chart's
// default surge strategy while claims are prepared and unprepared without a
// pause. The new plugin pod starts while the old one runs, registers under
// its own socket names, waits for the old instance to release the node and
// takes over; then the old pod stops. Asserted: no kubelet call to the
// driver failed because of the handover (see below for the one refusal
// that is only logged), every pod of the stream ran and went (no claim lost or left
// prepared: the checkpoint and the CDI folder hold only the MPS claim at
// the end), the MPS workload kept its daemon pod and server. Printed: the
// claims' create -> Running latencies before, during and after the rollout,
// and how long the new instance waited for the old one.
func TestRollingUpgrade(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutContainerDriver
	n := addNode(t, "node-rollout", layout, "dgx-h100")
	install(t, layout.HelmValues()...)
	first := waitPlugin(ctx, t, n, "")

	mps, daemon, server := runMPSWorkload(ctx, t, n, first, "rollout-mps")

	const ns = "rollout"
	if err := cluster.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	type sample struct {
		start time.Time
		took  time.Duration
	}
	var (
		mu      sync.Mutex
		samples []sample
		errs    []string
		wg      sync.WaitGroup
	)
	stop := make(chan struct{})
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				name := fmt.Sprintf("w%d-%03d", w, i)
				start := time.Now()
				took, err := claimRoundTrip(ctx, ns, name, n.Name)
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Sprintf("%s: %v", name, err))
				} else {
					samples = append(samples, sample{start, took})
				}
				mu.Unlock()
			}
		}()
	}

	time.Sleep(3 * time.Second)
	upgradeStart := time.Now()
	if err := cluster.HelmUpgrade(ctx, append(layout.HelmValues(), "logLevel=debug")...); err != nil {
		close(stop)
		wg.Wait()
		t.Fatal(err)
	}
	second := waitPlugin(ctx, t, n, first.Pod.UID)
	waitLog(ctx, t, second, func(log string) bool {
		return strings.Contains(log, "\"serving\"") || strings.Contains(log, "took over the node")
	})
	var oldGone time.Time
	for time.Since(upgradeStart) < 60*time.Second {
		if !first.Running() {
			oldGone = time.Now()
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if oldGone.IsZero() {
		t.Errorf("the old plugin container still runs 60 s after the upgrade")
		oldGone = time.Now()
	}
	// The stream goes on after the rollout until claims went through
	// before, during and after it (a real kubelet's round trip, deletion
	// included, takes seconds on this machine).
	deadline := time.Now().Add(90 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		after := 0
		for _, s := range samples {
			if s.start.After(oldGone) {
				after++
			}
		}
		enough := len(samples) >= 12 && after >= 3
		mu.Unlock()
		if enough {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	close(stop)
	wg.Wait()

	if len(errs) > 0 {
		t.Errorf("%d claim round trips failed during the rollout:\n%s", len(errs), strings.Join(errs, "\n"))
	}
	// Every failed kubelet call is reported. The handover must cause none: a
	// call that reached no instance, or an instance on its way out, fails
	// the test. A prepare our plugin refuses because the scheduler gave the
	// device to a second claim before the first one's unprepare (seen once
	// under heavy load, retried by the kubelet with success) is logged, not
	// a handover failure; docs/STATUS.md tracks it.
	var handover, refused []string
	for _, e := range n.DRAErrors() {
		if strings.Contains(e, "is already prepared for claim") {
			refused = append(refused, e)
		} else {
			handover = append(handover, e)
		}
	}
	if len(handover) > 0 {
		t.Errorf("%d kubelet calls to the driver failed during the rollout (old plugin pod %s, new %s):\n%s", len(handover), first.Pod.UID, second.Pod.UID, strings.Join(handover, "\n"))
		if os.Getenv("E2E_ROLLOUT_LOGS") != "" {
			t.Logf("old plugin log:\n%s\nnew plugin log:\n%s", first.Log(), second.Log())
		}
	}
	if len(refused) > 0 {
		t.Logf("%d prepares refused for a device another claim still held (retried):\n%s", len(refused), strings.Join(refused, "\n"))
	}
	if len(samples) < 10 {
		t.Errorf("only %d claims went through; the stream did not run", len(samples))
	}
	newLog := second.Log()
	if !strings.Contains(newLog, "another plugin instance holds the node") {
		t.Errorf("the new plugin never waited for the old one: the two did not overlap (surge)")
	}
	// Nothing of the stream is left prepared: only the MPS claim.
	claimUID := mpsClaimUID(ctx, t, mps)
	// The last unprepares may be journal records still; the plugin folds them into the file
	// once its journal has been idle for 0.2 s.
	got := checkpointClaims(t, n)
	for deadline := time.Now().Add(10 * time.Second); (len(got) != 1 || got[0] != claimUID) && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		got = checkpointClaims(t, n)
	}
	if len(got) != 1 || got[0] != claimUID {
		t.Errorf("checkpoint claims after the stream: %v, want only the MPS claim %s", got, claimUID)
	}
	specs, _ := filepath.Glob(filepath.Join(n.CDIRoot, "k8s.gpu.nvidia.com-claim_*"))
	if len(specs) != 1 || !strings.Contains(specs[0], claimUID) {
		t.Errorf("CDI specs after the stream: %v, want only the MPS claim's", specs)
	}
	sameDaemon(ctx, t, n, daemon)
	if got := mpsServer(ctx, t, n, mps, "40.0"); got != server {
		t.Errorf("after the rollout the MPS workload's server is %s, was %s", got, server)
	}

	// Figures.
	var before, during, after []time.Duration
	for _, s := range samples {
		switch {
		case s.start.Before(upgradeStart):
			before = append(before, s.took)
		case s.start.Before(oldGone):
			during = append(during, s.took)
		default:
			after = append(after, s.took)
		}
	}
	t.Logf("rollout: %d claims (3 at a time), %d failed kubelet calls, old plugin gone %s after helm upgrade",
		len(samples), len(handover)+len(refused), oldGone.Sub(upgradeStart).Round(time.Millisecond))
	for _, part := range []struct {
		name string
		d    []time.Duration
	}{{"before", before}, {"during", during}, {"after", after}} {
		t.Logf("  claim created -> Running %-6s: %s", part.name, summary(part.d))
	}
	for _, line := range strings.Split(newLog, "\n") {
		if strings.Contains(line, "took over the node") {
			t.Logf("  new instance: %s", strings.TrimSpace(line))
		}
	}
}

// claimRoundTrip creates a one-GPU claim and a pod using it, waits until the
// pod runs, then deletes both and waits until the pod is gone; returns the
// time from creation to Running.
func claimRoundTrip(ctx context.Context, ns, name, node string) (time.Duration, error) {
	start := time.Now()
	if _, err := createClaimPod(ctx, ns, name, node, nil); err != nil {
		return 0, err
	}
	if _, err := cluster.WaitPodRunning(ctx, ns, name, 60*time.Second); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if err := cluster.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return took, err
	}
	if err := cluster.WaitPodGone(ctx, ns, name, 60*time.Second); err != nil {
		return took, err
	}
	return took, cluster.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, name, metav1.DeleteOptions{})
}

func mpsClaimUID(ctx context.Context, t *testing.T, pod *v1.Pod) string {
	t.Helper()
	claim, err := cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, *pod.Spec.ResourceClaims[0].ResourceClaimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return string(claim.UID)
}

// checkpointClaims are the claim UIDs in the plugin's checkpoint on the node.
func checkpointClaims(t *testing.T, n *harness.Node) []string {
	t.Helper()
	data, err := os.ReadFile(n.HostPath(pluginDir + "/gpu-dra-checkpoint.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cp struct {
		Claims map[string]json.RawMessage `json:"claims"`
	}
	if err := json.Unmarshal(data, &cp); err != nil {
		t.Fatal(err)
	}
	var out []string
	for uid := range cp.Claims {
		out = append(out, uid)
	}
	sort.Strings(out)
	return out
}

func summary(d []time.Duration) string {
	if len(d) == 0 {
		return "none"
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	at := func(p int) time.Duration { return d[(len(d)-1)*p/100].Round(time.Millisecond) }
	return fmt.Sprintf("n=%d p50 %s p90 %s max %s", len(d), at(50), at(90), d[len(d)-1].Round(time.Millisecond))
}
