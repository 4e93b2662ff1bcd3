package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/gpu-dra/e2e/harness"
)

// A node switches from NVIDIA's DRA driver to ours in place: two claims
// NVIDIA prepared (one time-sliced) are allocated in the API server, their
// pods bound to the node, NVIDIA's checkpoint.json (its v2 layout) and its
// CDI specs are on the node, and its time slice is set on the GPU. Our plugin
// then starts on that node. It must start and import those claims into its
// own checkpoint, answer their prepare with NVIDIA's CDI devices (the pods
// run from NVIDIA's specs), keep their devices from other claims (a new
// claim lands on a free GPU; a claim allocated onto a held GPU behind the
// scheduler's back is refused), and unprepare them when their pods go:
// NVIDIA's specs removed, the time slice NVIDIA set reset, nothing imported
// again after a restart, and NVIDIA's checkpoint.json never touched.
func TestReplaceNvidiaDriver(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-nv-switch"
	ns := newNamespace(ctx, t, "nv-switch")
	tsConfig := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "TimeSlicing", "timeSlicingConfig": map[string]any{"interval": "Long"}},
	}

	// What NVIDIA's driver left on the node, written before our plugin starts.
	type nvidiaClaim struct {
		claim      *resourceapi.ResourceClaim
		pod        *v1.Pod
		device     string // gpu-<minor>
		uuid       string
		timeSliced bool
	}
	var held []nvidiaClaim
	var nvCheckpoint []byte
	var nvCheckpointPath string
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, RealKubelet: true}, "dgx-h100", nil, func(n *harness.Node) {
		gpus := simGPUs(t, n)
		if len(gpus) < 3 {
			t.Fatalf("profile has %d GPUs, the test needs 3", len(gpus))
		}
		for i, c := range []struct {
			name   string
			config map[string]any
		}{{"train", tsConfig}, {"infer", nil}} {
			device := "gpu-" + gpus[i].minor
			claim, pod := allocateBehindScheduler(ctx, t, gpuClaim(t, ns, c.name, 1, c.config), name, device)
			held = append(held, nvidiaClaim{claim: claim, pod: pod, device: device, uuid: gpus[i].uuid, timeSliced: c.config != nil})
		}
		// NVIDIA's driver set the time slice of the time-sliced claim's GPU.
		smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
		if out, err := exec.Command(smi, "compute-policy", "-i", held[0].uuid, "--set-timeslice", "3").CombinedOutput(); err != nil {
			t.Fatalf("nvidia-smi compute-policy: %v: %s", err, out)
		}
		claims := map[string]nvidiaCheckpointClaim{}
		for _, h := range held {
			claims[string(h.claim.UID)] = nvidiaCheckpointClaim{h.claim, h.device, h.uuid, h.timeSliced}
			writeNvidiaSpec(t, n, string(h.claim.UID), h.device)
		}
		nvCheckpoint = nvidiaCheckpointV2(t, name, n.BootID(), claims)
		nvCheckpointPath = filepath.Join(n.PluginDir(harness.DefaultDriver), "checkpoint.json")
		if err := os.MkdirAll(filepath.Dir(nvCheckpointPath), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(nvCheckpointPath, nvCheckpoint, 0o600); err != nil {
			t.Fatal(err)
		}
	})
	if got := timeSlice(t, n, held[0].uuid); got != "3" {
		t.Fatalf("time slice NVIDIA set on %s: %s, want 3", held[0].uuid, got)
	}
	for _, h := range held {
		if got := attrString(sliceDevice(ctx, t, name, h.device), "uuid"); got != h.uuid {
			t.Fatalf("published %s/%s has uuid %q; NVIDIA's checkpoint says %s", name, h.device, got, h.uuid)
		}
	}

	// Imported into our checkpoint, once.
	ours := readOurCheckpoint(t, n)
	for _, h := range held {
		uid := string(h.claim.UID)
		e, ok := ours.Claims[uid]
		if !ok || e.Imported == nil {
			t.Errorf("claim %s (%s) not imported into gpu-dra-checkpoint.json: %s", h.claim.Name, uid, ours.raw)
		}
		if !ours.importedFrom(uid) {
			t.Errorf("claim %s not listed in importedFromNvidia", h.claim.Name)
		}
	}

	// The kubelet prepares the pods' claims: our plugin answers NVIDIA's
	// CDI devices and the containers start from NVIDIA's specs.
	for i, h := range held {
		pod, err := cluster.WaitPodRunning(ctx, ns, h.pod.Name, 90*time.Second)
		if err != nil {
			t.Fatalf("pod %s of imported claim %s: %v; plugin log:\n%s", h.pod.Name, h.claim.Name, err, n.Plugin.Log())
		}
		held[i].pod = pod
		want := "k8s.gpu.nvidia.com/claim=" + string(h.claim.UID) + "-" + h.device
		for ctr, list := range podDevices(t, pod) {
			if len(list) != 1 || list[0].ID != want {
				t.Errorf("pod %s container %s: CDI devices %v, want NVIDIA's %s", pod.Name, ctr, list, want)
				continue
			}
			if base := filepath.Base(list[0].Spec.Path); base != "k8s.gpu.nvidia.com-claim_"+string(h.claim.UID)+".yaml" {
				t.Errorf("pod %s: %s resolved from %s, not NVIDIA's spec", pod.Name, want, base)
			}
		}
		for _, ctr := range pod.Spec.Containers {
			checkContainerSees(ctx, t, pod, ctr)
		}
	}

	// A new claim goes to a free GPU.
	fresh, freshClaim := runClaimPod(ctx, t, gpuClaim(t, ns, "fresh", 1, nil), claimPod(ns, "fresh", name, "fresh"))
	got := freshClaim.Status.Allocation.Devices.Results[0].Device
	for _, h := range held {
		if got == h.device {
			t.Errorf("new claim got %s, held by imported claim %s", got, h.claim.Name)
		}
	}
	checkContainerSees(ctx, t, fresh, fresh.Spec.Containers[0])

	// A claim allocated onto a held GPU without the scheduler: our plugin
	// refuses to prepare it, naming the imported holder (the kubelet's first
	// attempt may come before the claim is allocated and fail for that).
	_, intruder := allocateBehindScheduler(ctx, t, gpuClaim(t, ns, "intruder", 1, nil), name, held[0].device)
	waitPrepareErrors(ctx, t, n, intruder, "already prepared for claim "+ns+"/"+held[0].claim.Name)
	deletePod(ctx, t, intruder)
	if _, err := os.Stat(n.CDIRoot + "/k8s.gpu.nvidia.com-claim_" + string(held[0].claim.UID) + ".yaml"); err != nil {
		t.Errorf("NVIDIA's spec of %s after the refused claim's pod went: %v", held[0].claim.Name, err)
	}

	// The imported claims' pods go: the kubelet unprepares them.
	for _, h := range held {
		deletePod(ctx, t, h.pod)
		if files := claimSpecFiles(t, name, string(h.claim.UID)); len(files) > 0 {
			t.Errorf("imported claim %s: spec files left after unprepare: %v", h.claim.Name, files)
		}
	}
	if got := timeSlice(t, n, held[0].uuid); got != "0" {
		t.Errorf("time slice NVIDIA set on %s after its claim was unprepared: %s, want 0", held[0].uuid, got)
	}
	// The unprepares are journal records first; the plugin folds them into the file once
	// its journal has been idle for 0.2 s.
	eventually(ctx, 10*time.Second, func() bool {
		ours = readOurCheckpoint(t, n)
		for _, h := range held {
			if _, ok := ours.Claims[string(h.claim.UID)]; ok {
				return false
			}
		}
		return true
	})
	for _, h := range held {
		if _, ok := ours.Claims[string(h.claim.UID)]; ok {
			t.Errorf("imported claim %s still in our checkpoint after unprepare", h.claim.Name)
		}
	}

	// A restart does not bring them back from NVIDIA's file. The new process
	// has opened (and would have imported into) the checkpoint once it serves.
	n.Plugin.Stop()
	if err := n.Plugin.Restart(); err != nil {
		t.Fatal(err)
	}
	if !eventually(ctx, registerTimeout, func() bool {
		return strings.Count(n.Plugin.Log(), "serving registration=") == 2 && n.DriverRegistered(harness.DefaultDriver)
	}) {
		t.Fatalf("plugin not serving and registered after restart; log:\n%s", n.Plugin.Log())
	}
	ours = readOurCheckpoint(t, n)
	for _, h := range held {
		if _, ok := ours.Claims[string(h.claim.UID)]; ok {
			t.Errorf("claim %s imported again after a restart", h.claim.Name)
		}
		if !ours.importedFrom(string(h.claim.UID)) {
			t.Errorf("claim %s no longer in importedFromNvidia after a restart", h.claim.Name)
		}
	}
	if strings.Count(n.Plugin.Log(), "imported claim prepared by NVIDIA's driver") != len(held) {
		t.Errorf("plugin log: want %d imports in all, log:\n%s", len(held), n.Plugin.Log())
	}
	if !n.Plugin.Running() {
		t.Errorf("plugin exited; log:\n%s", n.Plugin.Log())
	}

	after, err := os.ReadFile(nvCheckpointPath)
	if err != nil {
		t.Fatalf("NVIDIA's checkpoint.json: %v", err)
	}
	if !bytes.Equal(after, nvCheckpoint) {
		t.Errorf("NVIDIA's checkpoint.json changed:\n%s", after)
	}
	deletePod(ctx, t, fresh)
}

// simGPU is a GPU of a simulated node's profile.
type simGPU struct{ uuid, minor string }

func simGPUs(t *testing.T, n *harness.Node) []simGPU {
	t.Helper()
	var state struct {
		Profile struct {
			Gpus []struct {
				UUID  string `json:"uuid"`
				Minor int    `json:"minor"`
			} `json:"gpus"`
		} `json:"profile"`
	}
	if err := json.Unmarshal([]byte(n.SimStateRaw()), &state); err != nil {
		t.Fatalf("simulator state of %s: %v", n.Name, err)
	}
	var out []simGPU
	for _, g := range state.Profile.Gpus {
		out = append(out, simGPU{uuid: g.UUID, minor: strconv.Itoa(g.Minor)})
	}
	return out
}

// allocateBehindScheduler creates the claim and a pod bound to node that uses
// it, then writes the claim's status as an allocation of device (our pool is
// the node's name) reserved for that pod: what the scheduler had written for
// a claim NVIDIA's driver prepared, or, for a device already taken, what the
// scheduler would never write.
func allocateBehindScheduler(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, node, device string) (*resourceapi.ResourceClaim, *v1.Pod) {
	t.Helper()
	created, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create claim: %v", err)
	}
	pod := claimPod(claim.Namespace, claim.Name, node, claim.Name)
	pod.Spec.NodeSelector = nil
	pod.Spec.NodeName = node
	pod, err = cluster.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	var config []resourceapi.DeviceAllocationConfiguration
	for _, c := range created.Spec.Devices.Config {
		config = append(config, resourceapi.DeviceAllocationConfiguration{
			Source: resourceapi.AllocationConfigSourceClaim, Requests: c.Requests, DeviceConfiguration: c.DeviceConfiguration,
		})
	}
	created.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: harness.DefaultDriver, Pool: node, Device: device,
			}},
			Config: config,
		},
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
			MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}},
		}}},
	}
	created.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
	allocated, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("allocate claim %s to %s: %v", claim.Name, device, err)
	}
	return allocated, pod
}

// nvidiaCheckpointClaim is a claim as NVIDIA's driver recorded it.
type nvidiaCheckpointClaim struct {
	claim      *resourceapi.ResourceClaim
	device     string
	uuid       string
	timeSliced bool
}

// nvidiaCheckpointV2 is NVIDIA's checkpoint.json in the layout of
// kubernetes-sigs/dra-driver-nvidia-gpu (`version: v2`, the v1 section kept
// for downgrades), as crates/core/testdata/nvidia-checkpoint-v2.json shows
// it: per claim its status as in the API server, its prepared device group
// (the kubelet plugin library's Device with Go field names) and the sharing
// NVIDIA applied. The checksums are placeholders: our reader does not verify
// them (see crates/core/src/nvidia_checkpoint.rs for why).
func nvidiaCheckpointV2(t *testing.T, node, bootID string, claims map[string]nvidiaCheckpointClaim) []byte {
	t.Helper()
	v1Claims, v2Claims := map[string]any{}, map[string]any{}
	for uid, c := range claims {
		groups := []any{map[string]any{
			"devices": []any{map[string]any{
				"gpu": map[string]any{
					"info": map[string]any{"uuid": c.uuid},
					"device": map[string]any{
						"Requests":     []string{"gpu"},
						"PoolName":     node,
						"DeviceName":   c.device,
						"CDIDeviceIDs": []string{"k8s.gpu.nvidia.com/claim=" + uid + "-" + c.device},
					},
				},
				"mig": nil,
			}},
			"configState": map[string]any{"mpsControlDaemonID": "", "timeSliceApplied": c.timeSliced},
		}}
		v1Claims[uid] = map[string]any{"status": c.claim.Status, "preparedDevices": groups}
		v2Claims[uid] = map[string]any{
			"checkpointState": "PrepareCompleted", "status": c.claim.Status, "preparedDevices": groups,
			"name": c.claim.Name, "namespace": c.claim.Namespace,
		}
	}
	doc := map[string]any{
		"version":  "v2",
		"checksum": 1,
		"v1":       map[string]any{"preparedClaims": v1Claims},
		"v2":       map[string]any{"checksum": 1, "preparedClaims": v2Claims, "nodeBootID": bootID},
	}
	out, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// writeNvidiaSpec writes the CDI spec NVIDIA's driver keeps for a prepared
// claim, under its name for it (k8s.gpu.nvidia.com-claim_<uid>.yaml, see
// CdiHost::nvidia_spec_path): one device <uid>-<device> with the GPU's node,
// the control and UVM nodes and nvidia-smi, all from the node's host.
func writeNvidiaSpec(t *testing.T, n *harness.Node, uid, device string) {
	t.Helper()
	minor := strings.TrimPrefix(device, "gpu-")
	host := func(p string) string { return filepath.Join(n.SimRoot(), p) }
	node := func(p string) map[string]any { return map[string]any{"path": p, "hostPath": host(p)} }
	spec := map[string]any{
		"cdiVersion": "0.5.0",
		"kind":       "k8s.gpu.nvidia.com/claim",
		"devices": []any{map[string]any{
			"name": uid + "-" + device,
			"containerEdits": map[string]any{
				"env":         []string{"NVIDIA_VISIBLE_DEVICES=void"},
				"deviceNodes": []any{node("/dev/nvidia" + minor)},
			},
		}},
		"containerEdits": map[string]any{
			"deviceNodes": []any{node("/dev/nvidiactl"), node("/dev/nvidia-uvm"), node("/dev/nvidia-uvm-tools")},
			"mounts": []any{map[string]any{
				"hostPath": host("/usr/bin/nvidia-smi"), "containerPath": "/usr/bin/nvidia-smi",
				"options": []string{"ro", "nosuid", "nodev", "bind"},
			}},
		},
	}
	out, err := yaml.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(n.CDIRoot, "k8s.gpu.nvidia.com-claim_"+uid+".yaml")
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// ourCheckpoint is the part of gpu-dra-checkpoint.json the test reads.
type ourCheckpoint struct {
	Claims map[string]struct {
		Imported *struct {
			From string `json:"from"`
		} `json:"imported"`
	} `json:"claims"`
	ImportedFromNvidia []string `json:"importedFromNvidia"`
	raw                string
}

func (c ourCheckpoint) importedFrom(uid string) bool {
	for _, u := range c.ImportedFromNvidia {
		if u == uid {
			return true
		}
	}
	return false
}

func readOurCheckpoint(t *testing.T, n *harness.Node) ourCheckpoint {
	t.Helper()
	path := filepath.Join(n.PluginDir(harness.DefaultDriver), "gpu-dra-checkpoint.json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("our checkpoint: %v", err)
	}
	var c ourCheckpoint
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatalf("our checkpoint %s: %v", path, err)
	}
	c.raw = string(data)
	return c
}
