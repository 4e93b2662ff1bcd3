package harness

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// TestRealDRAErrors: a real node's failed kubelet calls to the driver are
// read from the kubelet's log as klog writes them (a prepare failure from
// kuberuntime_manager, an unprepare failure from the pod worker); other
// errors are not.
func TestRealDRAErrors(t *testing.T) {
	dir := t.TempDir()
	log := `I1125 23:29:43.425023   19478 flags.go:64] FLAG: --v="2"
E1125 23:31:40.001000   21448 kuberuntime_manager.go:1727] "Failed to prepare dynamic resources" err="prepare dynamic resources: NodePrepareResources failed for ResourceClaim w0-001: device gpu-3 is already prepared for claim \"rollout/w1-002\"" pod="rollout/w0-001"
E1125 23:31:41.002000   21448 pod_workers.go:1338] "Error syncing pod, skipping" err="failed to \"StartContainer\" for \"plugin\" with CrashLoopBackOff" pod="gpu-dra/plugin-x"
E1125 23:31:42.003000   21448 pod_workers.go:1338] "Error syncing pod, skipping" err="unprepare dynamic resources: NodeUnprepareResources failed for ResourceClaim gpu: connection refused" pod="lifecycle/gpu" podUID="1"
`
	if err := os.WriteFile(filepath.Join(dir, "kubelet.log"), []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	got := (&Node{Dir: dir}).realDRAErrors()
	want := []string{
		`prepare rollout/w0-001: NodePrepareResources failed for ResourceClaim w0-001: device gpu-3 is already prepared for claim \"rollout/w1-002\"`,
		`unprepare lifecycle/gpu: NodeUnprepareResources failed for ResourceClaim gpu: connection refused`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("DRA errors:\n%q\nwant\n%q", got, want)
	}
}
