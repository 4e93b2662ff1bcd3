package gatesoff

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// TestMemorySharesAndDynamicMIGWithoutTheirGates: a node configured for memory
// shares (GPU 4 of a DGX A100, MIG off) and dynamic MIG (GPU 0, MIG on) on a cluster
// whose API server drops the fields of both features. The plugin writes no
// slice the server would strip: GPU 4 is published as a whole GPU (no
// allowMultipleAllocations, no request policy), GPU 0 as it is (its MIG devices) (no shared
// counters, no device consuming them), and it says so in its log and in one
// Warning event per feature on the Node, naming the gate and the release that
// has it on by default.
func TestMemorySharesAndDynamicMIGWithoutTheirGates(t *testing.T) {
	ctx := context.Background()
	const name = "node-gates-off"
	// GPU 0 emptied by the admin, as for dynamic MIG on a cluster that has it.
	emptied := func(n *harness.Node) {
		smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
		for _, op := range []string{"-dci", "-dgi"} {
			if out, err := exec.Command(smi, "mig", "-i", "0", op).CombinedOutput(); err != nil {
				t.Fatalf("nvidia-smi mig -i 0 %s: %v: %s", op, err, out)
			}
		}
	}
	n := cluster.AddSimNode(ctx, t, setupErr, name, "dgx-a100-40gb", emptied,
		"--memory-share-gpus=gpu-4", "--dynamic-mig-gpus=gpu-0")

	// Published, complete (all eight GPUs' devices), and without the fields of
	// the features that are off.
	var slices []resourceapi.ResourceSlice
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		if err != nil {
			return false, nil
		}
		slices = list.Items
		return hasDevice(slices, "gpu-4") && hasDevice(slices, "gpu-5"), nil
	})
	if err != nil {
		t.Fatalf("gpu-4 and gpu-5 not published: %v; slices: %+v\nplugin log:\n%s", err, slices, n.Plugin.Log())
	}
	for _, s := range slices {
		if len(s.Spec.SharedCounters) > 0 {
			t.Errorf("slice %s has shared counters, which this server drops", s.Name)
		}
		for _, d := range s.Spec.Devices {
			if d.AllowMultipleAllocations != nil {
				t.Errorf("device %s allows multiple allocations, which this server drops", d.Name)
			}
			if len(d.ConsumesCounters) > 0 {
				t.Errorf("device %s consumes counters, which this server drops", d.Name)
			}
			for c, v := range d.Capacity {
				if v.RequestPolicy != nil {
					t.Errorf("device %s capacity %s has a request policy, which this server drops", d.Name, c)
				}
			}
		}
	}

	// Said: one Warning event per feature on the Node, and the log.
	want := map[string]string{
		"DRAConsumableCapacity":   "offered whole",
		"DRAPartitionableDevices": "dynamic MIG is not offered",
	}
	var notes []string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		notes = nil
		for _, e := range list.Items {
			if e.Reason == "DRAFeatureMissing" && e.Regarding.Kind == "Node" && e.Regarding.Name == name {
				notes = append(notes, e.Note)
			}
		}
		return len(notes) >= len(want), nil
	})
	if err != nil {
		t.Fatalf("want %d DRAFeatureMissing events on node %s, got %q\nplugin log:\n%s", len(want), name, notes, n.Plugin.Log())
	}
	for gate, fallback := range want {
		found := false
		for _, note := range notes {
			if strings.Contains(note, gate+" is off") && strings.Contains(note, "on by default from Kubernetes 1.36") &&
				strings.Contains(note, fallback) {
				found = true
			}
		}
		if !found {
			t.Errorf("no event names %s with its release and fallback (%q): %q", gate, fallback, notes)
		}
	}
	if log := n.Plugin.Log(); !strings.Contains(log, "DRAConsumableCapacity is off") {
		t.Errorf("the plugin's log does not say DRAConsumableCapacity is off:\n%s", log)
	}
}

func hasDevice(slices []resourceapi.ResourceSlice, name string) bool {
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				return true
			}
		}
	}
	return false
}
