package tests

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
)

// outageDriver is a second DRA driver (the reference driver) running
// beside ours during the outage test.
const outageDriver = "outage.example.com"

// With the webhook down, DRA keeps working: claims of another driver and
// our claims without opaque configs are never sent to the webhook
// (matchConditions), so their pods schedule, run and are deleted cleanly;
// claims with our configs are admitted or refused as the chart's
// failurePolicy says. Once the webhook is back, bad configs are refused
// again.
func TestWebhookOutageDoesNotStopDRA(t *testing.T) {
	requireWebhook(t)
	requireChart(t)
	requirePlugins(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "webhook-outage")
	policy := webhookFailurePolicy(t)

	other, err := cluster.Node(nodeT4).StartRefDriver(ctx, outageDriver, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Stop()
	classes := cluster.Client.ResourceV1().DeviceClasses()
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: outageDriver},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: "device.driver == '" + outageDriver + "'"},
		}}},
	}
	if _, err := classes.Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = classes.Delete(ctx, outageDriver, metav1.DeleteOptions{}) }()

	cluster.Driver().Webhook.Stop()
	restarted := false
	defer func() {
		if !restarted {
			if _, err := cluster.RestartWebhook(ctx); err != nil {
				t.Errorf("restart webhook: %v", err)
			}
		}
	}()

	// Another driver's claim, with that driver's opaque config.
	params, err := json.Marshal(map[string]any{"mode": "anything"})
	if err != nil {
		t.Fatal(err)
	}
	otherClaim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "other", Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "dev", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: outageDriver, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			}}},
			Config: []resourceapi.DeviceClaimConfiguration{{
				DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
					Driver: outageDriver, Parameters: runtime.RawExtension{Raw: params},
				}},
			}},
		}},
	}
	pod := claimPod(ns, "other", nodeT4, "other")
	_, got := runClaimPod(ctx, t, otherClaim, pod)
	deletePod(ctx, t, pod)
	if !other.Unprepared(got.UID) {
		t.Errorf("claim of %s not unprepared after its pod was deleted", outageDriver)
	}

	// Our GPU, without an opaque config.
	plain := gpuClaim(t, ns, "plain", 1, nil)
	plainPod := claimPod(ns, "plain", nodeT4, "plain")
	runClaimPod(ctx, t, plain, plainPod)
	deletePod(ctx, t, plainPod)

	// Our GPU with an invalid config: the failure policy decides.
	claims := cluster.Client.ResourceV1().ResourceClaims(ns)
	bad := badMPSClaim(t, ns, "bad-during-outage")
	_, err = claims.Create(ctx, bad, metav1.CreateOptions{})
	switch policy {
	case "Ignore":
		if err != nil {
			t.Errorf("failurePolicy Ignore, webhook down: claim refused: %v", err)
		}
	case "Fail":
		if err == nil || !strings.Contains(err.Error(), "failed calling webhook") {
			t.Errorf("failurePolicy Fail, webhook down: want a webhook call failure, got %v", err)
		}
	default:
		t.Fatalf("unknown failurePolicy %q", policy)
	}

	// Back up: bad configs are refused again (once the apiserver sees the new endpoint).
	if _, err := cluster.RestartWebhook(ctx); err != nil {
		t.Fatal(err)
	}
	restarted = true
	var lastErr error
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		name := "bad-after-" + time.Now().Format("150405.000000")
		name = strings.ReplaceAll(name, ".", "-")
		_, lastErr = claims.Create(ctx, badMPSClaim(t, ns, name), metav1.CreateOptions{})
		if lastErr == nil {
			_ = claims.Delete(ctx, name, metav1.DeleteOptions{})
			return false, nil
		}
		return strings.Contains(lastErr.Error(), "defaultActiveThreadPercentage"), nil
	})
	if err != nil {
		t.Fatalf("webhook restarted but bad configs are not refused: %v (last: %v)", err, lastErr)
	}
}

// badMPSClaim asks for one GPU with an MPS thread percentage the node
// and the webhook both refuse.
func badMPSClaim(t *testing.T, ns, name string) *resourceapi.ResourceClaim {
	return gpuClaim(t, ns, name, 1, map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{"defaultActiveThreadPercentage": 150}},
	})
}

// webhookFailurePolicy is the failurePolicy the chart registered (every
// opaque-config entry carries the same one).
func webhookFailurePolicy(t *testing.T) string {
	t.Helper()
	for _, o := range driver.Objects {
		if o.GetKind() != "ValidatingWebhookConfiguration" {
			continue
		}
		hooks, _, _ := unstructured.NestedSlice(o.Object, "webhooks")
		policy := ""
		for _, h := range hooks {
			m, _ := h.(map[string]any)
			if name, _ := m["name"].(string); !strings.Contains(name, ".opaque-config.") {
				continue // the bound on pods per node always fails closed
			}
			p, _ := m["failurePolicy"].(string)
			if policy != "" && p != policy {
				t.Fatalf("webhook entries disagree on failurePolicy: %q and %q", policy, p)
			}
			policy = p
		}
		if policy != "" {
			return policy
		}
	}
	t.Fatal("no ValidatingWebhookConfiguration with a failurePolicy applied")
	return ""
}
