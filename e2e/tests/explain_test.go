package tests

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpu-dra/e2e/harness"
)

// indexSelector is the selector of NVIDIA's quickstart that neither driver
// can satisfy: no device publishes an `index` attribute.
const indexSelector = "device.attributes['gpu.nvidia.com'].index == 0"

// warningRecorder keeps the admission warnings the API server returns.
type warningRecorder struct {
	mu       sync.Mutex
	warnings []string
}

// HandleWarningHeader implements rest.WarningHandler.
func (w *warningRecorder) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.warnings = append(w.warnings, text)
}

// explainJSON is the part of `gpu-dra explain -o json` the test reads.
type explainJSON struct {
	Claim     string `json:"claim"`
	Allocated bool   `json:"allocated"`
	Requests  []struct {
		Matching  int `json:"matching"`
		Selectors []struct {
			Source     string `json:"source"`
			Expression string `json:"expression"`
		} `json:"selectors"`
		Nodes []struct {
			Node    string `json:"node"`
			Devices []struct {
				Device      string `json:"device"`
				Pool        string `json:"pool"`
				Matches     bool   `json:"matches"`
				RejectedBy  *int   `json:"rejectedBy"`
				Reason      string `json:"reason"`
				AllocatedTo string `json:"allocatedTo"`
			} `json:"devices"`
		} `json:"nodes"`
	} `json:"requests"`
}

func runExplain(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"explain"}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+cluster.Kubeconfig)
	out, err := cmd.Output()
	if err != nil {
		stderr := ""
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("gpu-dra explain %v: %v: %s", args, err, stderr)
	}
	return string(out)
}

// A claim with NVIDIA's quickstart `index` selector gets a webhook warning
// with a hint when created, stays pending, and `gpu-dra explain` names the
// selector and the missing attribute for every GPU; for a running claim it
// shows the allocated device as matching and allocated to that claim.
func TestExplainPendingAndRunningClaims(t *testing.T) {
	requirePlugins(t)
	bin, err := harness.Binary("gpu-dra")
	if err != nil {
		t.Fatalf("no gpu-dra CLI: %v", err)
	}
	ctx := context.Background()
	ns := newNamespace(ctx, t, "explain")

	cfg, err := clientcmd.BuildConfigFromFlags("", cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	recorder := &warningRecorder{}
	cfg.WarningHandler = recorder
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}

	pending := gpuClaim(t, ns, "first-gpu", 1, nil)
	pending.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{
		CEL: &resourceapi.CELDeviceSelector{Expression: indexSelector},
	}}
	if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, pending, metav1.CreateOptions{}); err != nil {
		t.Fatalf("claim with an unmatchable selector refused (the webhook must only warn): %v", err)
	}
	t.Logf("warnings on create: %q", recorder.warnings)
	if webhookErr == nil {
		joined := strings.Join(recorder.warnings, "\n")
		for _, want := range []string{`attribute "index" is not published`, "set `count` on the request"} {
			if !strings.Contains(joined, want) {
				t.Errorf("webhook warnings %q do not mention %q", recorder.warnings, want)
			}
		}
	}
	pod := claimPod(ns, "first-gpu", nodeT4, "first-gpu")
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cluster.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{})
	}()
	// Give the scheduler a chance: the claim must still be unallocated.
	time.Sleep(2 * time.Second)

	text := runExplain(t, bin, ns+"/first-gpu")
	t.Logf("gpu-dra explain %s/first-gpu:\n%s", ns, text)
	for _, want := range []string{
		"ResourceClaim " + ns + "/first-gpu: not allocated",
		"request selector 0: " + indexSelector,
		"node " + nodeT4 + ":",
		"gpu-0: rejected by request selector 0: `" + indexSelector + "`: evaluation error: no such key: index",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("explain output does not contain %q:\n%s", want, text)
		}
	}
	var got explainJSON
	if err := json.Unmarshal([]byte(runExplain(t, bin, "-o", "json", ns+"/first-gpu")), &got); err != nil {
		t.Fatal(err)
	}
	if got.Allocated || len(got.Requests) != 1 || got.Requests[0].Matching != 0 {
		t.Fatalf("pending claim: %+v", got)
	}
	devices := 0
	for _, n := range got.Requests[0].Nodes {
		for _, d := range n.Devices {
			devices++
			if d.Matches || d.RejectedBy == nil || d.Reason == "" {
				t.Errorf("%s/%s: %+v", n.Node, d.Device, d)
			}
			// Whole GPUs pass the class and fail on `index`; MIG devices fail the class.
			if !strings.Contains(d.Device, "-mig-") && !strings.Contains(d.Reason, "no such key: index") {
				t.Errorf("%s/%s: reason %q does not name the missing attribute", n.Node, d.Device, d.Reason)
			}
		}
	}
	if devices == 0 {
		t.Fatal("explain saw no devices")
	}

	// A running claim: its device matches and is allocated to it.
	running := gpuClaim(t, ns, "t4", 1, nil)
	runPod := claimPod(ns, "t4", nodeT4, "t4")
	_, claim := runClaimPod(ctx, t, running, runPod)
	defer deletePod(ctx, t, runPod)
	result := claim.Status.Allocation.Devices.Results[0]
	if err := json.Unmarshal([]byte(runExplain(t, bin, "-o", "json", ns+"/t4")), &got); err != nil {
		t.Fatal(err)
	}
	if !got.Allocated {
		t.Fatalf("running claim not allocated in explain: %+v", got)
	}
	found := false
	for _, n := range got.Requests[0].Nodes {
		for _, d := range n.Devices {
			if d.Pool == result.Pool && d.Device == result.Device {
				found = true
				if !d.Matches || d.AllocatedTo != "this claim" {
					t.Errorf("allocated device %s: %+v", d.Device, d)
				}
			}
		}
	}
	if !found {
		t.Errorf("allocated device %s/%s not in explain output", result.Pool, result.Device)
	}
	if text := runExplain(t, bin, ns+"/t4"); !strings.Contains(text, result.Device+": matches, allocated to this claim") {
		t.Errorf("text output does not show the allocation:\n%s", text)
	}
}
