package tests

import (
	"context"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The webhook, registered through the apiserver like in a cluster, refuses
// a claim with a broken opaque config at create (naming the field) and
// admits a valid one.
func TestWebhookRefusesBadConfigAtCreate(t *testing.T) {
	requireWebhook(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "webhook")
	claims := cluster.Client.ResourceV1().ResourceClaims(ns)

	bad := gpuClaim(t, ns, "bad", 1, map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{"defaultActiveThreadPercentage": 150}},
	})
	_, err := claims.Create(ctx, bad, metav1.CreateOptions{})
	if err == nil {
		t.Fatal("claim with defaultActiveThreadPercentage 150 was admitted")
	}
	for _, want := range []string{"admission webhook", "defaultActiveThreadPercentage", "150"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not mention %q", err, want)
		}
	}

	good := gpuClaim(t, ns, "good", 1, map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{"defaultActiveThreadPercentage": 50}},
	})
	if _, err := claims.Create(ctx, good, metav1.CreateOptions{}); err != nil {
		t.Fatalf("valid claim refused: %v", err)
	}
}
