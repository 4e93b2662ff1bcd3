package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-dra/e2e/harness"
)

// An MPS claim gets a control daemon with its limits while the pod runs,
// the container gets the pipe directory, and after the pod is gone the
// daemon and its directories are gone too.
func TestMPSDaemonLifecycle(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "mps")
	n := cluster.Node(nodeT4)
	config := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{
			"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "5Gi",
		}},
	}
	pod, claim := runClaimPod(ctx, t, gpuClaim(t, ns, "mps", 1, config), claimPod(ns, "mps", nodeT4, "mps"))
	devs := podDevices(t, pod)["ctr"]
	if len(devs) == 0 {
		t.Fatal("no CDI devices for the container")
	}
	pipe := ""
	for _, r := range devs {
		checkGPUEdits(t, r)
		if v, ok := envValue(r.Env(), "CUDA_MPS_PIPE_DIRECTORY"); ok {
			pipe = v
		}
	}
	if pipe == "" {
		t.Fatalf("no CUDA_MPS_PIPE_DIRECTORY in the container's CDI edits")
	}
	mounted := false
	for _, r := range devs {
		for _, m := range r.Mounts() {
			if m.ContainerPath == pipe {
				mounted = true
			}
		}
	}
	if !mounted {
		t.Errorf("pipe directory %s not mounted into the container", pipe)
	}

	daemons := n.MPSDaemons()
	if len(daemons) != 1 {
		t.Fatalf("want one MPS control daemon on %s, got %d", nodeT4, len(daemons))
	}
	d := daemons[0]
	hostPipe := d.Env["CUDA_MPS_PIPE_DIRECTORY"]
	if hostPipe == "" {
		t.Fatalf("daemon %d has no CUDA_MPS_PIPE_DIRECTORY", d.Pid)
	}
	uuid := attrString(sliceDevice(ctx, t, claim.Status.Allocation.Devices.Results[0].Pool, claim.Status.Allocation.Devices.Results[0].Device), "uuid")
	if got := d.Env["CUDA_VISIBLE_DEVICES"]; !strings.Contains(got, uuid) {
		t.Errorf("daemon CUDA_VISIBLE_DEVICES %q, want the allocated GPU %s", got, uuid)
	}
	// Ask the daemon for its limits through its pipe, as a user would.
	if got := mpsControl(t, d.Args[0], hostPipe, "get_default_active_thread_percentage"); !strings.HasPrefix(got, "50") {
		t.Errorf("active thread percentage %q, want 50", got)
	}
	if got := mpsControl(t, d.Args[0], hostPipe, "get_default_device_pinned_mem_limit "+uuid); got != "5G" && got != "5120M" {
		t.Errorf("pinned memory limit of %s is %q, want 5G", uuid, got)
	}

	deletePod(ctx, t, pod)
	if !eventually(ctx, 20*time.Second, func() bool { return len(n.MPSDaemons()) == 0 }) {
		t.Errorf("MPS daemon still running after the pod was deleted: %v", n.MPSDaemons())
	}
	if _, err := os.Stat(hostPipe); err == nil {
		t.Errorf("pipe directory %s left behind", hostPipe)
	}
}

func mpsControl(t *testing.T, bin, pipe, command string) string {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+pipe)
	cmd.Stdin = strings.NewReader(command + "\n")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("%s <<< %q: %v: %s", filepath.Base(bin), command, err, out)
	}
	return strings.TrimSpace(string(out))
}

// A time-slicing claim sets the GPU's time slice while prepared and resets
// it to Default when unprepared (as seen in the simulator's state).
func TestTimeSlicingSetAndReset(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	ns := newNamespace(ctx, t, "ts")
	n := cluster.Node(nodeA100)
	config := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "TimeSlicing", "timeSlicingConfig": map[string]any{"interval": "Long"}},
	}
	pod, claim := runClaimPod(ctx, t, gpuClaim(t, ns, "ts", 1, config), claimPod(ns, "ts", nodeA100, "ts"))
	for _, r := range podDevices(t, pod)["ctr"] {
		checkGPUEdits(t, r)
	}
	res := claim.Status.Allocation.Devices.Results[0]
	uuid := attrString(sliceDevice(ctx, t, res.Pool, res.Device), "uuid")
	if got := timeSlice(t, n, uuid); got != "3" {
		t.Errorf("time slice of %s while prepared: %q, want 3 (Long)", uuid, got)
	}
	deletePod(ctx, t, pod)
	if !eventually(ctx, 10*time.Second, func() bool {
		return timeSlice(t, n, uuid) == "0"
	}) {
		t.Errorf("time slice of %s after unprepare: %q, want Default (0)", uuid, timeSlice(t, n, uuid))
	}
}

// timeSlice reads a GPU's time-slice setting (0..3: Default, Short, Medium,
// Long) from the simulator state.
func timeSlice(t *testing.T, n *harness.Node, uuid string) string {
	t.Helper()
	return fmt.Sprint(gpuSettings(t, n, uuid).Timeslice)
}

// gpuSettings is a GPU's settings in the simulator state: profile.gpus[i].uuid
// names GPU i, gpus[i] holds its settings.
func gpuSettings(t *testing.T, n *harness.Node, uuid string) gpuSettingsState {
	t.Helper()
	var state struct {
		Profile struct {
			Gpus []struct {
				UUID string `json:"uuid"`
			} `json:"gpus"`
		} `json:"profile"`
		Gpus []gpuSettingsState `json:"gpus"`
	}
	if err := json.Unmarshal([]byte(n.SimStateRaw()), &state); err != nil {
		t.Fatalf("simulator state of %s: %v", n.Name, err)
	}
	for i, g := range state.Profile.Gpus {
		if g.UUID == uuid && i < len(state.Gpus) {
			return state.Gpus[i]
		}
	}
	t.Fatalf("GPU %s not in the simulator state of %s", uuid, n.Name)
	return gpuSettingsState{}
}

// gpuSettingsState is what the tests read of a simulated GPU's settings.
type gpuSettingsState struct {
	ComputeMode string `json:"computeMode"`
	Timeslice   int    `json:"timeslice"`
}
