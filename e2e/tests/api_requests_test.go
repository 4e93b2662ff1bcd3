package tests

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpu-dra/e2e/harness"
)

// pluginRequests is the node plugin's share of two API request snapshots
// (after minus before): its requests other than watches, by verb and
// resource, and how many watch streams it (re)started.
type pluginRequests struct {
	calls   map[string]int // "verb resource" -> count
	total   int
	watches int
}

func (p pluginRequests) String() string {
	var parts []string
	for k, v := range p.calls {
		parts = append(parts, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(parts)
	return fmt.Sprintf("%d requests [%s], %d watch starts", p.total, strings.Join(parts, " "), p.watches)
}

// nodePluginRequests counts the requests between two snapshots whose user
// agent is the node plugin's on node (`gpu-kubelet-plugin/<version> (run; <node>)`).
func nodePluginRequests(before, after map[harness.APIRequestKind]int, node string) pluginRequests {
	suffix := "(run; " + node + ")"
	p := pluginRequests{calls: map[string]int{}}
	for k, n := range after {
		if !strings.HasPrefix(k.UserAgent, "gpu-kubelet-plugin/") || !strings.HasSuffix(k.UserAgent, suffix) {
			continue
		}
		n -= before[k]
		if n == 0 {
			continue
		}
		if k.Verb == "watch" {
			p.watches += n
			continue
		}
		p.calls[k.Verb+" "+k.Resource] += n
		p.total += n
	}
	return p
}

// waitPluginQuiet waits until node's plugin has sent no request other than
// watches for quiet (its publishing and status writes done), at most limit.
func waitPluginQuiet(ctx context.Context, t *testing.T, node string, quiet, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	last := cluster.APIRequests()
	since := time.Now()
	for time.Since(since) < quiet {
		if time.Now().After(deadline) {
			t.Fatalf("plugin on %s still sending requests after %s: %v", node, limit, nodePluginRequests(last, cluster.APIRequests(), node))
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
		now := cluster.APIRequests()
		if nodePluginRequests(last, now, node).total > 0 {
			since = time.Now()
		}
		last = now
	}
}

// TestPluginAPIRequestsAtRest counts the API requests of one node's plugin
// from the API server's side, by the plugin's user agent, on a real node of
// its own whose plugin cleans up every 5 s. At rest (nothing changes on the
// node or in its claims) with claims prepared and their pods running, the
// plugin sends nothing but the watches it keeps open over several cleanups:
// the kubelet's PodResources API names the claims in use, so none is read;
// slices are republished only on a change, claim status is written only on
// prepare and unprepare, and no heartbeat exists. Then it creates and
// deletes one-GPU claims with pods on the node and reports the plugin's
// requests per prepare. Last, a claim prepared for no pod the kubelet knows
// and then deleted (the kubelet never unprepares it) is still cleaned up.
func TestPluginAPIRequestsAtRest(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const node = "api-at-rest"
	const cleanupEvery = 5 * time.Second
	const window = 30 * time.Second
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: node, RealKubelet: true}, "dgx-a100-40gb",
		[]string{fmt.Sprintf("--cleanup-interval-seconds=%d", int(cleanupEvery.Seconds()))}, nil)
	ns := newNamespace(ctx, t, "api-requests")

	// Two claims stay prepared, their pods running, through the window.
	var held []*v1.Pod
	t.Cleanup(func() {
		for _, pod := range held {
			deletePod(context.Background(), t, pod)
		}
	})
	for i := range 2 {
		name := fmt.Sprintf("held-%d", i)
		pod, _ := runClaimPod(ctx, t, gpuClaim(t, ns, name, 1, nil), claimPod(ns, name, node, name))
		held = append(held, pod)
	}
	waitPluginQuiet(ctx, t, node, 3*time.Second, 30*time.Second)

	before := cluster.APIRequests()
	time.Sleep(window)
	rest := nodePluginRequests(before, cluster.APIRequests(), node)
	t.Logf("plugin on %s at rest over %s with %d claims prepared (a cleanup every %s): %v", node, window, len(held), cleanupEvery, rest)
	if rest.total != 0 {
		t.Errorf("plugin on %s at rest sent %v over %s with %d claims prepared and a cleanup every %s, want no request besides its watches", node, rest, window, len(held), cleanupEvery)
	}
	// kube-rs restarts a watch when the server ends it (timeoutSeconds of
	// about 5 minutes); a restart a window is the most it may see.
	if rest.watches > 2 {
		t.Errorf("plugin on %s restarted %d watches at rest over %s", node, rest.watches, window)
	}
	if log := n.Plugin.Log(); !strings.Contains(log, "PodResources API tells which prepared claims are in use") {
		t.Errorf("plugin on %s does not say it asks the kubelet's PodResources API (%s); log:\n%s", node, n.PodResourcesSocket(), log)
	}

	const claims = 10
	before = cluster.APIRequests()
	started := time.Now()
	var lastDevice string
	for i := range claims {
		name := fmt.Sprintf("gpu-%d", i)
		pod, claim := runClaimPod(ctx, t, gpuClaim(t, ns, name, 1, nil), claimPod(ns, name, node, name))
		lastDevice = claim.Status.Allocation.Devices.Results[0].Device
		deletePod(ctx, t, pod)
		if err := cluster.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	churnTime := time.Since(started)
	waitPluginQuiet(ctx, t, node, 2*time.Second, 20*time.Second)
	churn := nodePluginRequests(before, cluster.APIRequests(), node)
	perPrepare := float64(churn.total) / claims
	t.Logf("plugin on %s, %d one-GPU claims prepared and unprepared in %s: %v; %.1f requests per prepare (with its unprepare)",
		node, claims, churnTime.Round(time.Millisecond), churn, perPrepare)
	// Attribution by user agent works: a prepare reads its claim and writes
	// its status (else the figure at rest proves nothing).
	if churn.total < claims {
		t.Errorf("only %d requests attributed to the plugin on %s for %d prepares: is its user agent %q?", churn.total, node, claims, "gpu-kubelet-plugin/<version> (run; "+node+")")
	}
	// The design's figure is one claim status write per prepare and per
	// unprepare; the bound leaves room for a conflict retry each and a
	// republish of the node's slices.
	if perPrepare > 6 {
		t.Errorf("plugin on %s sent %.1f requests per prepare and unprepare (%v), want at most 6", node, perPrepare, churn)
	}

	// A claim prepared for no pod of the kubelet's (this test calls the
	// plugin's DRA service as the kubelet would) and then deleted: nothing
	// will unprepare it but the cleanup, which reads it once it has gone
	// unnamed for a cleanup interval (at least 10 s).
	orphan := allocateToNode(ctx, t, gpuClaim(t, ns, "orphan", 1, nil), node, lastDevice)
	prepareAsKubelet(ctx, t, n, orphan)
	if len(claimSpecFiles(t, node, string(orphan.UID))) == 0 {
		t.Fatalf("claim %s prepared but no CDI spec names it", orphan.Name)
	}
	if err := cluster.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, orphan.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	if !eventually(ctx, 90*time.Second, func() bool { return len(claimSpecFiles(t, node, string(orphan.UID))) == 0 }) {
		t.Fatalf("claim %s deleted %s ago, no pod using it, still prepared on %s; plugin log:\n%s", orphan.Name, time.Since(deleted).Round(time.Second), node, n.Plugin.Log())
	}
	t.Logf("deleted claim no pod used unprepared by the cleanup after %s", time.Since(deleted).Round(time.Second))
	if !strings.Contains(n.Plugin.Log(), "claim is gone from the API server; unpreparing") {
		t.Errorf("claim %s unprepared, but not by the cleanup; plugin log:\n%s", orphan.Name, n.Plugin.Log())
	}
}

// allocateToNode creates the claim and writes its status as an allocation of
// device on node (our pool is the node's name) reserved for nobody: a claim
// no pod will use, which the kubelet never prepares.
func allocateToNode(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, node, device string) *resourceapi.ResourceClaim {
	t.Helper()
	created, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create claim: %v", err)
	}
	created.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: harness.DefaultDriver, Pool: node, Device: device,
			}},
		},
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
			MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}},
		}}},
	}
	allocated, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("allocate claim %s to %s: %v", claim.Name, device, err)
	}
	return allocated
}

// prepareAsKubelet calls NodePrepareResources for claim on the plugin's DRA
// socket of node, as the kubelet does.
func prepareAsKubelet(ctx context.Context, t *testing.T, n *harness.Node, claim *resourceapi.ResourceClaim) {
	t.Helper()
	socket := filepath.Join(n.PluginDir(harness.DefaultDriver), "dra.sock")
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	res, err := drav1.NewDRAPluginClient(conn).NodePrepareResources(ctx, &drav1.NodePrepareResourcesRequest{
		Claims: []*drav1.Claim{{Namespace: claim.Namespace, Name: claim.Name, Uid: string(claim.UID)}},
	})
	if err != nil {
		t.Fatalf("NodePrepareResources on %s: %v", socket, err)
	}
	if r := res.Claims[string(claim.UID)]; r == nil || r.Error != "" || len(r.Devices) == 0 {
		t.Fatalf("NodePrepareResources of %s on %s: %v", claim.Name, socket, r)
	}
}
