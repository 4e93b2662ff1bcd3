package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpu-dra/e2e/harness"
)

// upgradeWindow is how long NVML cannot be reached during each swap: long
// enough that the plugin's check (every 5 s) may land inside it, far below
// the grace after which /healthz fails (30 s).
const upgradeWindow = 3 * time.Second

// TestDriverUpgradeInPlace swaps the driver version under a running node
// twice, as the GPU Operator restarting its driver container with a new
// version and a host package upgrade followed by a module reload do, with the
// node plugin deployed by the chart, on both driver layouts: the driver on
// the host (`nvidiaDriverRoot: /`) and the GPU Operator's driver container
// root (`/run/nvidia/driver`). Each subtest swaps in both orders
// (`gpu-sim upgrade-driver --style container|package`).
//
// Before the first swap a pod with a one-GPU claim runs. After each swap:
//   - every pod started before it is still Running and its container still
//     has the NVML library it mounted; its claim's CDI spec now names the new
//     version's files only, with the same CDI devices; its container, made to
//     exit, is started again by the kubelet from that spec and nvidia-smi in it
//     reports the new version (a spec naming the removed files failed this
//     with CreateContainerError);
//   - every device of the node's ResourceSlices has the new driverVersion
//     (within a bounded wait: the plugin checks the library every 5 s);
//   - a new claim's pod starts; its claim's CDI spec names no file of an
//     earlier version and every host path it mounts exists on the host; in
//     its container the new libnvidia-ml.so.<version> is there and
//     nvidia-smi prints the new version in its header (the simulated
//     nvidia-smi refuses with "Driver/library version mismatch" when the
//     library it finds is not the loaded module's).
//
// At the end every pod is deleted: the claims prepared under each version are
// unprepared and their specs removed.
func TestDriverUpgradeInPlace(t *testing.T) {
	requirePlugins(t)
	requireChart(t)
	// The DaemonSet as the suite installed it, back at the end.
	t.Cleanup(func() { applyPluginDaemonSet(t) })
	for _, l := range []struct {
		layout  harness.Layout
		node    string
		profile string
		// The first swap is the layout's own way of upgrading.
		swaps []driverSwap
	}{
		{harness.LayoutHostDriver, "node-upgrade-host", "dgx-h100",
			[]driverSwap{{"580.105.08", harness.UpgradePackage}, {"590.44.01", harness.UpgradeContainer}}},
		{harness.LayoutContainerDriver, "node-upgrade-operator", "dgx-a100-40gb",
			[]driverSwap{{"580.105.08", harness.UpgradeContainer}, {"590.44.01", harness.UpgradePackage}}},
	} {
		t.Run(string(l.layout), func(t *testing.T) {
			upgradeInPlace(t, l.node, l.layout, l.profile, l.swaps)
		})
	}
}

// driverSwap is one upgrade in place: the new version and the order of its
// steps.
type driverSwap struct {
	version string
	style   harness.UpgradeStyle
}

// gpuWorkload is a running pod with a one-GPU claim, started under one
// driver version.
type gpuWorkload struct {
	pod     *v1.Pod
	claim   *resourceapi.ResourceClaim
	version string
	// specs are the claim's CDI spec files (path -> content) after prepare.
	specs map[string]string
	// lib is the container path of the versioned NVML library its CDI
	// devices mount.
	lib string
}

func upgradeInPlace(t *testing.T, name string, layout harness.Layout, profile string, swaps []driverSwap) {
	ctx := context.Background()
	n := deployedNode(t, name, layout, profile, nil)
	ns := newNamespace(ctx, t, "upgrade")
	version, err := n.DriverVersion()
	if err != nil {
		t.Fatal(err)
	}
	waitSlicesDriverVersion(ctx, t, n, version, 10*time.Second)
	seen := []string{version}
	running := []gpuWorkload{startGPUWorkload(ctx, t, n, ns, version, nil)}

	for _, s := range swaps {
		start := time.Now()
		if err := n.UpgradeDriver(ctx, s.version, s.style, upgradeWindow); err != nil {
			t.Fatal(err)
		}
		if got, err := n.DriverVersion(); err != nil || got != s.version {
			t.Fatalf("after gpu-sim upgrade-driver: the node's driver is %q (%v), want %s", got, err, s.version)
		}
		swapped := time.Since(start)
		for i, w := range running {
			running[i] = checkKeepsRunning(ctx, t, n, w, s)
		}
		waitSlicesDriverVersion(ctx, t, n, s.version, 60*time.Second)
		t.Logf("%s: %s -> %s (%s upgrade, NVML out of reach for %s): swap took %s, slices republished %s after it began",
			name, seen[len(seen)-1], s.version, s.style, upgradeWindow, swapped.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		running = append(running, startGPUWorkload(ctx, t, n, ns, s.version, seen))
		seen = append(seen, s.version)
	}

	for _, w := range running {
		deletePod(ctx, t, w.pod)
		if files := claimSpecFiles(t, name, string(w.claim.UID)); len(files) > 0 {
			t.Errorf("claim %s (prepared under driver %s): CDI spec files left after unprepare: %v", w.claim.Name, w.version, files)
		}
	}
}

// startGPUWorkload runs a pod with a one-GPU claim on the node, whose driver
// is now version (replacing every version of older), and checks what its
// container got: a spec naming only existing files of this version, the
// versioned library, and nvidia-smi working against the loaded module.
func startGPUWorkload(ctx context.Context, t *testing.T, n *harness.Node, ns, version string, older []string) gpuWorkload {
	t.Helper()
	name := "at-" + strings.ReplaceAll(version, ".", "-")
	pod := claimPod(ns, name, n.Name, name)
	// Runs until told to exit (a file in the container's own filesystem,
	// which a restarted container does not have).
	pod.Spec.Containers[0].Command = []string{"sh", "-c", "until [ -e /tmp/exit ]; do sleep 0.2; done; exit 7"}
	pod, claim := runClaimPod(ctx, t, gpuClaim(t, ns, name, 1, nil), pod)
	specs := claimSpecs(t, n, claim)
	if len(specs) == 0 {
		t.Fatalf("claim %s: no CDI spec file in %s", claim.Name, n.CDIRoot)
	}
	for path, text := range specs {
		for _, old := range older {
			if strings.Contains(text, old) {
				t.Errorf("claim %s, prepared under driver %s: its CDI spec %s names driver %s, which the upgrade removed:\n%s",
					claim.Name, version, filepath.Base(path), old, text)
			}
		}
	}
	devices := podDevices(t, pod)["ctr"]
	if len(devices) == 0 {
		t.Fatalf("pod %s: no CDI devices for its container", pod.Name)
	}
	want := "libnvidia-ml.so." + version
	lib := ""
	for _, r := range devices {
		for _, m := range r.Mounts() {
			if _, err := os.Stat(n.HostPath(m.HostPath)); err != nil {
				t.Errorf("claim %s (driver %s): CDI device %s mounts %s, not on the host: %v", claim.Name, version, r.ID, m.HostPath, err)
			}
			if filepath.Base(m.HostPath) == want {
				lib = m.ContainerPath
			}
		}
	}
	if lib == "" {
		t.Fatalf("claim %s (driver %s): its CDI devices mount no %s", claim.Name, version, want)
	}
	if res, err := n.Exec(ctx, pod, "ctr", "test", "-s", lib); err != nil || res.ExitCode != 0 {
		t.Errorf("pod %s (driver %s): %s not in its container (%v, exit %d)", pod.Name, version, lib, err, res.ExitCode)
	}
	res, err := n.Exec(ctx, pod, "ctr", "nvidia-smi")
	if err != nil {
		t.Fatalf("pod %s: exec nvidia-smi: %v", pod.Name, err)
	}
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "Driver Version: "+version+" ") {
		t.Errorf("pod %s: nvidia-smi in its container (exit %d) does not report driver %s in its header:\n%s%s",
			pod.Name, res.ExitCode, version, res.Stdout, res.Stderr)
	}
	return gpuWorkload{pod: pod, claim: claim, version: version, specs: specs, lib: lib}
}

// checkKeepsRunning asserts a pod started before the swap still runs, its
// container still has the library it mounted, and its claim's spec follows
// the new driver: a restarted container starts on it. It returns the
// workload as its restarted container runs.
func checkKeepsRunning(ctx context.Context, t *testing.T, n *harness.Node, w gpuWorkload, s driverSwap) gpuWorkload {
	t.Helper()
	got := getPod(ctx, t, w.pod)
	if got.Status.Phase != v1.PodRunning || !allRunning(n.Containers(w.pod), 1) {
		t.Errorf("pod %s (driver %s) no longer running after the %s upgrade to %s: %s", w.pod.Name, w.version, s.style, s.version, harness.PodProblem(got))
		return w
	}
	if res, err := n.Exec(ctx, w.pod, "ctr", "test", "-s", w.lib); err != nil || res.ExitCode != 0 {
		t.Errorf("pod %s: %s, mounted under driver %s, gone from its container after the upgrade to %s (%v, exit %d)",
			w.pod.Name, w.lib, w.version, s.version, err, res.ExitCode)
	}
	// A real host answers the same: the container's NVML library is the old
	// version, the loaded module the new one.
	if res, err := n.Exec(ctx, w.pod, "ctr", "nvidia-smi", "-L"); err == nil {
		t.Logf("pod %s (driver %s) after the upgrade to %s: nvidia-smi -L exits %d: %s", w.pod.Name, w.version, s.version, res.ExitCode, strings.TrimSpace(res.Stdout+res.Stderr))
	}
	// The spec follows the driver: the new version's files, the same devices.
	var now map[string]string
	if !eventually(ctx, 20*time.Second, func() bool {
		now = claimSpecs(t, n, w.claim)
		return specsNameOnly(now, s.version, w.version)
	}) {
		t.Errorf("claim %s (driver %s): its CDI spec does not name driver %s's files only, 20 s after the upgrade:\n%v\nplugin log:\n%s",
			w.claim.Name, w.version, s.version, now, deployedPluginLog(n))
	}
	if got, want := specDevices(t, now), specDevices(t, w.specs); !reflect.DeepEqual(got, want) {
		t.Errorf("claim %s: its CDI devices changed with the upgrade to %s:\nbefore: %v\nafter: %v", w.claim.Name, s.version, want, got)
	}
	restartContainer(ctx, t, n, w, s)
	// The restarted container runs on the new driver's files.
	w.version, w.specs = s.version, now
	w.lib = filepath.Join(filepath.Dir(w.lib), "libnvidia-ml.so."+s.version)
	return w
}

// specsNameOnly tells whether specs name files of version and none of old.
func specsNameOnly(specs map[string]string, version, old string) bool {
	if len(specs) == 0 {
		return false
	}
	for _, text := range specs {
		if !strings.Contains(text, ".so."+version) || strings.Contains(text, ".so."+old) {
			return false
		}
	}
	return true
}

// specDevices are the CDI devices of a claim's specs (path -> the spec's
// devices as JSON).
func specDevices(t *testing.T, specs map[string]string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for path, text := range specs {
		var spec struct {
			Devices json.RawMessage `json:"devices"`
		}
		if err := json.Unmarshal([]byte(text), &spec); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		out[path] = string(spec.Devices)
	}
	return out
}

// restartContainer makes the workload's container exit and waits until the
// kubelet started it again, from the claim's spec as it is now: the container
// must start and nvidia-smi in it report the new driver.
func restartContainer(ctx context.Context, t *testing.T, n *harness.Node, w gpuWorkload, s driverSwap) {
	t.Helper()
	before := getPod(ctx, t, w.pod)
	restarts := int32(0)
	if len(before.Status.ContainerStatuses) == 1 {
		restarts = before.Status.ContainerStatuses[0].RestartCount
	}
	if res, err := n.Exec(ctx, w.pod, "ctr", "touch", "/tmp/exit"); err != nil || res.ExitCode != 0 {
		t.Fatalf("pod %s: cannot tell its container to exit (%v, exit %d)", w.pod.Name, err, res.ExitCode)
	}
	var got *v1.Pod
	if !eventually(ctx, 60*time.Second, func() bool {
		got = getPod(ctx, t, w.pod)
		if len(got.Status.ContainerStatuses) != 1 {
			return false
		}
		st := got.Status.ContainerStatuses[0]
		return st.RestartCount > restarts && st.State.Running != nil && st.Ready
	}) {
		t.Fatalf("pod %s (driver %s): its container did not start again after the upgrade to %s: %s", w.pod.Name, w.version, s.version, harness.PodProblem(got))
	}
	res, err := n.Exec(ctx, w.pod, "ctr", "nvidia-smi")
	if err != nil {
		t.Fatalf("pod %s: exec nvidia-smi: %v", w.pod.Name, err)
	}
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "Driver Version: "+s.version+" ") {
		t.Errorf("pod %s: nvidia-smi in its restarted container (exit %d) does not report driver %s:\n%s%s",
			w.pod.Name, res.ExitCode, s.version, res.Stdout, res.Stderr)
	}
}

// claimSpecs are the node's CDI spec files of a claim, path -> content.
func claimSpecs(t *testing.T, n *harness.Node, claim *resourceapi.ResourceClaim) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, p := range claimSpecFiles(t, n.Name, string(claim.UID)) {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("claim %s: %v", claim.Name, err)
		}
		out[p] = string(data)
	}
	return out
}

// waitSlicesDriverVersion waits until every device the node publishes has the
// driverVersion attribute of version (as the API's semantic version: no
// leading zeros) and none is tainted.
func waitSlicesDriverVersion(ctx context.Context, t *testing.T, n *harness.Node, version string, timeout time.Duration) {
	t.Helper()
	want := semverOf(version)
	var seen map[string]int
	var tainted []string
	ok := eventually(ctx, timeout, func() bool {
		slices, err := nodeSlices(ctx, n.Name)
		if err != nil {
			return false
		}
		seen, tainted = map[string]int{}, nil
		for _, s := range slices {
			for _, d := range s.Spec.Devices {
				seen[attrVersion(d, "driverVersion")]++
				if ts := taintsOf(d); len(ts) > 0 {
					tainted = append(tainted, fmt.Sprintf("%s %v", d.Name, ts))
				}
			}
		}
		return len(seen) == 1 && seen[want] > 0 && len(tainted) == 0
	})
	if !ok {
		t.Fatalf("node %s: devices by driverVersion after %s: %v (want all %s), tainted: %v; plugin log:\n%s",
			n.Name, timeout, seen, want, tainted, deployedPluginLog(n))
	}
}

// attrVersion is a device's version attribute ("" when it has none).
func attrVersion(d resourceapi.Device, name string) string {
	for _, key := range []string{name, harness.DefaultDriver + "/" + name} {
		if a, ok := d.Attributes[resourceapi.QualifiedName(key)]; ok && a.VersionValue != nil {
			return *a.VersionValue
		}
	}
	return ""
}

// semverOf is a driver version (580.95.05) as a semantic version (580.95.5).
func semverOf(version string) string {
	parts := strings.Split(version, ".")
	for i, p := range parts {
		if trimmed := strings.TrimLeft(p, "0"); trimmed != "" {
			parts[i] = trimmed
		} else {
			parts[i] = "0"
		}
	}
	return strings.Join(parts, ".")
}

// deployedPluginLog is the log of the node's plugin pod, for failure messages.
func deployedPluginLog(n *harness.Node) string {
	for _, p := range n.DaemonPods() {
		return p.Log()
	}
	return "(no plugin pod)"
}
