package tests

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
// from the API server's side, by the plugin's user agent. At rest (nothing
// changes on the node or in its claims) the plugin sends nothing but the
// watches it keeps open: its slices are republished only on a change, claim
// status is written only on prepare and unprepare, and no heartbeat exists.
// Then it creates and deletes one-GPU claims with pods on the node and
// reports the plugin's requests per prepare.
func TestPluginAPIRequestsAtRest(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const node = nodeT4
	const window = 30 * time.Second
	waitPluginQuiet(ctx, t, node, 3*time.Second, 20*time.Second)

	before := cluster.APIRequests()
	time.Sleep(window)
	rest := nodePluginRequests(before, cluster.APIRequests(), node)
	t.Logf("plugin on %s at rest over %s: %v", node, window, rest)
	if rest.total != 0 {
		t.Errorf("plugin on %s at rest sent %v over %s, want no request besides its watches", node, rest, window)
	}
	// kube-rs restarts a watch when the server ends it (timeoutSeconds of
	// about 5 minutes); a restart a window is the most it may see.
	if rest.watches > 2 {
		t.Errorf("plugin on %s restarted %d watches at rest over %s", node, rest.watches, window)
	}

	const claims = 10
	ns := newNamespace(ctx, t, "api-requests")
	before = cluster.APIRequests()
	started := time.Now()
	for i := range claims {
		name := fmt.Sprintf("gpu-%d", i)
		pod, claim := runClaimPod(ctx, t, gpuClaim(t, ns, name, 1, nil), claimPod(ns, name, node, name))
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
}
