package tests

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/gpu-dra/e2e/harness"
)

// Our plugin's `discover` on each node's simulated host (the production
// NVML code path against the simulator library) reports every full GPU as
// gpu-<minor> and MIG devices for GPUs in MIG mode.
func TestDiscoverOnSimulatedHosts(t *testing.T) {
	bin, err := harness.BinaryWith("gpu-kubelet-plugin", regexp.MustCompile(`(?m)^\s+discover\b`))
	if err != nil {
		t.Fatalf("no gpu-kubelet-plugin discover: %v", err)
	}
	if _, err := harness.Binary("gpu-sim"); err != nil {
		t.Fatalf("no simulator: %v", err)
	}
	for name, profile := range nodeProfiles {
		t.Run(profile, func(t *testing.T) {
			n := cluster.Node(name)
			if err := n.SetupSim(profile); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(bin, "discover", "--output", "json", "--node-name", name,
				"--driver-root", n.SimRoot(), "--dev-root", n.SimRoot(), "--sysfs-root", filepath.Join(n.SimRoot(), "sys"))
			out, err := cmd.Output()
			if err != nil {
				stderr := ""
				if ee, ok := err.(*exec.ExitError); ok {
					stderr = string(ee.Stderr)
				}
				t.Fatalf("discover: %v: %s", err, stderr)
			}
			var decoded any
			if err := json.Unmarshal(out, &decoded); err != nil {
				t.Fatalf("discover --output json is not JSON: %v", err)
			}
			text := string(out)
			var state struct {
				Profile struct {
					Gpus []struct {
						Minor int `json:"minor"`
					} `json:"gpus"`
				} `json:"profile"`
				Gpus []struct {
					MigCurrent   bool  `json:"migCurrent"`
					GpuInstances []any `json:"gpuInstances"`
				} `json:"gpus"`
			}
			if err := json.Unmarshal([]byte(n.SimStateRaw()), &state); err != nil {
				t.Fatal(err)
			}
			if len(state.Profile.Gpus) == 0 {
				t.Fatalf("simulator profile %s has no GPUs", profile)
			}
			for i, g := range state.Profile.Gpus {
				full := fmt.Sprintf(`"gpu-%d"`, g.Minor)
				mig := fmt.Sprintf(`"gpu-%d-mig-`, g.Minor)
				st := state.Gpus[i]
				switch {
				case !st.MigCurrent && !strings.Contains(text, full):
					t.Errorf("GPU minor %d (not in MIG mode) not reported as %s", g.Minor, full)
				case st.MigCurrent && len(st.GpuInstances) > 0 && !strings.Contains(text, mig):
					t.Errorf("GPU minor %d in MIG mode with %d GPU instances: no %s... device", g.Minor, len(st.GpuInstances), mig)
				}
			}
		})
	}
}
