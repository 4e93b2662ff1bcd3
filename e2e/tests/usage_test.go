package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// promSample is one line of a Prometheus text exposition.
type promSample struct {
	name   string
	labels map[string]string
	value  float64
}

// parseProm reads the samples of a Prometheus text exposition (comments skipped).
func parseProm(text string) ([]promSample, error) {
	var out []promSample
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s := promSample{labels: map[string]string{}}
		rest := line
		if i := strings.IndexAny(line, "{ "); i >= 0 && line[i] == '{' {
			s.name = line[:i]
			rest = line[i+1:]
			for !strings.HasPrefix(rest, "}") {
				eq := strings.Index(rest, `="`)
				if eq < 0 {
					return nil, fmt.Errorf("bad labels in %q", line)
				}
				key := strings.TrimLeft(rest[:eq], ",")
				rest = rest[eq+2:]
				var val strings.Builder
				for len(rest) > 0 && rest[0] != '"' {
					if rest[0] == '\\' && len(rest) > 1 {
						rest = rest[1:]
					}
					val.WriteByte(rest[0])
					rest = rest[1:]
				}
				if rest == "" {
					return nil, fmt.Errorf("unterminated label value in %q", line)
				}
				s.labels[key] = val.String()
				rest = strings.TrimPrefix(rest[1:], ",")
			}
			rest = rest[1:]
		} else {
			name, r, _ := strings.Cut(line, " ")
			s.name, rest = name, r
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return nil, fmt.Errorf("no value in %q", line)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return nil, fmt.Errorf("value of %q: %v", line, err)
		}
		s.value = v
		out = append(out, s)
	}
	return out, nil
}

// scrape reads a metrics endpoint.
func scrape(url string) (string, error) {
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	return string(body), nil
}

// freeLoopbackPort is a TCP port on 127.0.0.1 nothing listens on right now.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// claimFigures is what the plugin's metrics say of one claim (summed over its pods' series).
type claimFigures struct {
	info, allocated, used, sm, processes, deviceUtil, lastActive *float64
	labels                                                       map[string]string
}

func addTo(p **float64, v float64) {
	if *p == nil {
		*p = new(float64)
	}
	**p += v
}

// claimMetrics groups the gpu_dra_claim_* samples of a namespace by claim name.
func claimMetrics(samples []promSample, ns string) map[string]*claimFigures {
	out := map[string]*claimFigures{}
	for _, s := range samples {
		if !strings.HasPrefix(s.name, "gpu_dra_claim_") || s.labels["claim_namespace"] != ns {
			continue
		}
		f := out[s.labels["claim"]]
		if f == nil {
			f = &claimFigures{labels: map[string]string{}}
			out[s.labels["claim"]] = f
		}
		for k, v := range s.labels {
			f.labels[k] = v
		}
		switch s.name {
		case "gpu_dra_claim_info":
			addTo(&f.info, s.value)
		case "gpu_dra_claim_memory_allocated_bytes":
			addTo(&f.allocated, s.value)
		case "gpu_dra_claim_memory_used_bytes":
			addTo(&f.used, s.value)
		case "gpu_dra_claim_sm_utilization_percent":
			addTo(&f.sm, s.value)
		case "gpu_dra_claim_processes":
			addTo(&f.processes, s.value)
		case "gpu_dra_claim_device_utilization_percent":
			addTo(&f.deviceUtil, s.value)
		case "gpu_dra_claim_last_active_timestamp_seconds":
			addTo(&f.lastActive, s.value)
		}
	}
	return out
}

func fmtOpt(p *float64) string {
	if p == nil {
		return "none"
	}
	return strconv.FormatFloat(*p, 'f', -1, 64)
}

// loadCase is a claim of TestClaimUsage and the load its pod runs.
type loadCase struct {
	claim     string
	device    string // the device's name in the pool
	allocated float64
	holds     float64 // bytes its program holds; 0: no GPU program (sleep)
	sm        float64 // SM utilisation the metrics must show; -1: none (NVML has none there)
	util      float64 // device utilisation the metrics must show; -1: none (not the claim's alone)
	cmd       []string
	strategy  string
	profile   string
	// container is the container label its processes must carry: the
	// plugin reads it from the process's cgroup where the pod loop's
	// runtime names the container, and where a CRI runtime (containerd on
	// a real node) names only its ID, from the pod's containerStatuses.
	container string
}

// within says whether got is want within 2 % (or exactly 0 for 0).
func within(got *float64, want float64) bool {
	return got != nil && math.Abs(*got-want) <= 0.02*want
}

// nearOrNone says whether got is want ± 2, or absent for a want of -1.
func nearOrNone(got *float64, want float64) bool {
	if want < 0 {
		return got == nil
	}
	return got != nil && math.Abs(*got-want) <= 2
}

// problems lists what the metrics of one case get wrong.
func (c loadCase) problems(f *claimFigures) []string {
	if f == nil {
		return []string{c.claim + ": no series"}
	}
	var p []string
	bad := func(what string, got *float64, want string) {
		p = append(p, fmt.Sprintf("%s: %s %s, want %s", c.claim, what, fmtOpt(got), want))
	}
	if f.info == nil || *f.info != 1 {
		bad("claim_info", f.info, "1")
	}
	if f.labels["device"] != c.device {
		p = append(p, fmt.Sprintf("%s: device label %q, want %q", c.claim, f.labels["device"], c.device))
	}
	if f.labels["strategy"] != c.strategy || f.labels["mig_profile"] != c.profile {
		p = append(p, fmt.Sprintf("%s: strategy %q MIG profile %q, want %q %q", c.claim,
			f.labels["strategy"], f.labels["mig_profile"], c.strategy, c.profile))
	}
	if !within(f.allocated, c.allocated) {
		bad("memory allocated", f.allocated, fmt.Sprint(c.allocated))
	}
	// A figure the driver does not expose is left out, never reported as 0.
	if !nearOrNone(f.sm, c.sm) {
		bad("SM utilisation", f.sm, fmt.Sprintf("%v ± 2 (-1: none)", c.sm))
	}
	if !nearOrNone(f.deviceUtil, c.util) {
		bad("device utilisation", f.deviceUtil, fmt.Sprintf("%v ± 2 (-1: none)", c.util))
	}
	if c.holds == 0 {
		if f.processes != nil && *f.processes != 0 {
			bad("processes", f.processes, "0")
		}
		if f.used != nil && *f.used != 0 {
			bad("memory used", f.used, "none or 0")
		}
		return p
	}
	if f.processes == nil || *f.processes != 1 {
		bad("processes", f.processes, "1")
	}
	if !within(f.used, c.holds) {
		bad("memory used", f.used, fmt.Sprintf("%v within 2%%", c.holds))
	}
	if f.labels["pod"] != c.claim || f.labels["container"] != c.container {
		p = append(p, fmt.Sprintf("%s: processes attributed to pod %q container %q, want %q %q", c.claim,
			f.labels["pod"], f.labels["container"], c.claim, c.container))
	}
	return p
}

// loadPod is claimPod running cmd.
func loadPod(ns, name, node string, cmd []string) *v1.Pod {
	pod := claimPod(ns, name, node, name)
	pod.Spec.Containers[0].Command = cmd
	return pod
}

// TestClaimUsage: pods with known loads on a whole GPU, a static MIG device, two MPS memory
// shares of one GPU and a time-sliced GPU, plus a claim whose pod never touches its GPU. The
// node plugin's /metrics (sampling every second) shows each claim's allocated memory, the
// memory its process holds, the SM load where the driver exposes it and its process count,
// attributed to the pod and container; `gpu-dra usage -o json` reading that endpoint shows
// the same per claim and the unused claim as idle; a deleted claim's series are gone within a
// few samples.
func TestClaimUsage(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	start := time.Now()
	const name = "node-usage"
	url := fmt.Sprintf("http://127.0.0.1:%d/metrics", freeLoopbackPort(t))
	addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{
		"--memory-share-gpus=" + memoryShareGPU,
		"--usage-interval-seconds=1",
		"--http-address=" + strings.TrimSuffix(strings.TrimPrefix(url, "http://"), "/metrics"),
	}, nil)
	ns := newNamespace(ctx, t, "usage")
	devices := poolDevices(ctx, t, name)
	memoryOf := func(device string) float64 {
		q, ok := devices[device].Capacity["memory"]
		if !ok {
			t.Fatalf("%s publishes no memory capacity", device)
		}
		return float64(q.Value.Value())
	}
	migName, migUUID := firstMIG(t, devices)
	const gi = float64(1 << 30)
	app := func(hold string, sm int) []string {
		return []string{"cuda-app", "--hold-memory", hold, "--sm-load", strconv.Itoa(sm), "--seconds", "600"}
	}
	cases := []loadCase{
		{claim: "whole", device: "gpu-5", allocated: memoryOf("gpu-5"), holds: 2 * gi, sm: 40, util: 40, cmd: app("2Gi", 40)},
		// NVML has no SM or device utilisation on MIG devices.
		{claim: "mig", device: migName, allocated: memoryOf(migName), holds: 1 * gi, sm: -1, util: -1, cmd: app("1Gi", 30),
			profile: attrString(devices[migName], "profile")},
		// Each share gets 4/40 of the threads (the load asked for stays below that); the
		// GPU's utilisation is both claims', so neither's.
		{claim: "share-a", device: memoryShareGPU, allocated: 4 * gi, holds: 1 * gi, sm: 5, util: -1, cmd: app("1Gi", 5), strategy: "MPS"},
		{claim: "share-b", device: memoryShareGPU, allocated: 4 * gi, holds: 3 * gi, sm: 5, util: -1, cmd: app("3Gi", 5), strategy: "MPS"},
		{claim: "sliced", device: "gpu-6", allocated: memoryOf("gpu-6"), holds: gi / 2, sm: 20, util: 20, cmd: app("512Mi", 20), strategy: "TimeSlicing"},
		{claim: "idle", device: "gpu-7", allocated: memoryOf("gpu-7"), sm: 0, util: 0, cmd: []string{"sleep", "600"}},
	}
	for i := range cases {
		cases[i].container = "ctr"
	}
	claimFor := func(c loadCase) *resourceapi.ResourceClaim {
		uuid := attrString(devices[c.device], "uuid")
		switch c.strategy {
		case "MPS":
			return shareClaim(t, ns, c.claim, uuid, "4Gi", nil)
		case "TimeSlicing":
			claim := pinnedClaim(ns, c.claim, "gpu.nvidia.com", uuid)
			claim.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{
				Requests: []string{"gpu"},
				DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: opaque(t, map[string]any{
					"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
					"sharing": map[string]any{"strategy": "TimeSlicing"},
				})},
			}}
			return claim
		}
		if c.device == migName {
			return pinnedClaim(ns, c.claim, "mig.nvidia.com", migUUID)
		}
		return pinnedClaim(ns, c.claim, "gpu.nvidia.com", uuid)
	}
	// All at once, but the second share once the first runs: two claims on one shared
	// device created in the same instant may leave one pending until the scheduler retries
	// (see TestMemoryShares).
	pods := map[string]*v1.Pod{}
	create := func(c loadCase) {
		claim := claimFor(c)
		if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create claim %s: %v", c.claim, err)
		}
		pod, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, loadPod(ns, c.claim, name, c.cmd), metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod %s: %v", c.claim, err)
		}
		pods[c.claim] = pod
	}
	waitRunning := func(c loadCase) {
		if _, err := cluster.WaitPodRunning(ctx, ns, c.claim, 90*time.Second); err != nil {
			t.Fatalf("pod %s: %v\nplugin log:\n%s", c.claim, err, cluster.Node(name).Plugin.Log())
		}
	}
	for _, c := range cases {
		if c.claim != "share-b" {
			create(c)
		}
	}
	waitRunning(cases[2])
	create(cases[3])
	for _, c := range cases {
		waitRunning(c)
	}
	t.Logf("%d pods running after %s", len(cases), time.Since(start).Round(time.Millisecond))

	// The metrics: every claim's figures, within a few samples.
	var last string
	var issues []string
	seen := time.Now()
	if !eventually(ctx, 20*time.Second, func() bool {
		text, err := scrape(url)
		if err != nil {
			issues = []string{err.Error()}
			return false
		}
		last = text
		samples, err := parseProm(text)
		if err != nil {
			issues = []string{err.Error()}
			return false
		}
		got := claimMetrics(samples, ns)
		issues = nil
		for _, c := range cases {
			issues = append(issues, c.problems(got[c.claim])...)
		}
		return len(issues) == 0
	}) {
		t.Fatalf("metrics at %s after 20 s:\n  %s\nclaim series:\n%s\nplugin log:\n%s", url,
			strings.Join(issues, "\n  "), claimLines(last, ns), cluster.Node(name).Plugin.Log())
	}
	t.Logf("metrics right %s after the pods ran:\n%s", time.Since(seen).Round(time.Millisecond), claimLines(last, ns))

	// gpu-dra usage reads the same endpoint: the same figures per claim, and the claim whose
	// pod never used its GPU idle once the threshold passed (the busy ones were active at
	// the last sample, a second ago).
	const threshold = 4
	var report usageReport
	var out string
	if !eventually(ctx, 15*time.Second, func() bool {
		out = runUsage(t, "-o", "json", "--node", name, "--metrics-url", url, "--idle-threshold", fmt.Sprintf("%ds", threshold))
		report = usageReport{}
		if err := json.Unmarshal([]byte(out), &report); err != nil {
			issues = []string{err.Error()}
			return false
		}
		issues = report.problems(ns, cases)
		return len(issues) == 0
	}) {
		t.Fatalf("gpu-dra usage -o json:\n  %s\n%s", strings.Join(issues, "\n  "), out)
	}
	// The node's 8 GPUs: 5 with claims (gpu-0 through its MIG device), all but the idle
	// claim's busy; memory summed over the claims.
	var alloc, used int64
	for _, c := range cases {
		alloc += int64(c.allocated)
		used += int64(c.holds)
	}
	s := report.Summary
	if s.GPUs != 8 || s.GPUsAllocated != 5 || s.GPUsBusy != 4 || s.IdleClaims != 1 || s.MetricsRead != 1 ||
		s.MemoryAlloc != alloc || s.MemoryUsed != used {
		t.Errorf("summary: %+v, want 8 GPUs, 5 allocated, 4 busy, 1 idle claim, 1 endpoint read, memory %d allocated, %d used",
			s, alloc, used)
	}
	t.Logf("gpu-dra usage summary: %+v", report.Summary)

	// Unprepared: its series go at the next samples.
	deleteClaimAndPod(ctx, t, pods["sliced"])
	gone := time.Now()
	if !eventually(ctx, 10*time.Second, func() bool {
		text, err := scrape(url)
		if err != nil {
			return false
		}
		last = text
		samples, err := parseProm(text)
		return err == nil && claimMetrics(samples, ns)["sliced"] == nil && claimMetrics(samples, ns)["whole"] != nil
	}) {
		t.Fatalf("series of the deleted claim still there 10 s after its pod and claim were gone:\n%s", claimLines(last, ns))
	}
	t.Logf("deleted claim's series gone %s after its pod; test took %s", time.Since(gone).Round(time.Millisecond),
		time.Since(start).Round(time.Millisecond))
}

// claimLines are the gpu_dra_claim_* lines of a namespace in a metrics text.
func claimLines(text, ns string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, "gpu_dra_claim_") && strings.Contains(l, `claim_namespace="`+ns+`"`) {
			out = append(out, "  "+l)
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// usageReport is the part of `gpu-dra usage -o json` checked here.
type usageReport struct {
	GPUs []struct {
		Node    string `json:"node"`
		GPU     string `json:"gpu"`
		Holders []struct {
			Claim  string `json:"claim"`
			Device string `json:"device"`
			Usage  *struct {
				MemoryAllocatedBytes *float64 `json:"memoryAllocatedBytes"`
				MemoryUsedBytes      *float64 `json:"memoryUsedBytes"`
				SMUtilizationPercent *float64 `json:"smUtilizationPercent"`
				Processes            float64  `json:"processes"`
				IdleSeconds          *float64 `json:"idleSeconds"`
				Idle                 bool     `json:"idle"`
			} `json:"usage"`
		} `json:"holders"`
	} `json:"gpus"`
	Summary struct {
		GPUs          int   `json:"gpus"`
		GPUsAllocated int   `json:"gpusAllocated"`
		GPUsBusy      int   `json:"gpusBusy"`
		IdleClaims    int   `json:"idleClaims"`
		MemoryAlloc   int64 `json:"memoryAllocatedBytes"`
		MemoryUsed    int64 `json:"memoryUsedBytes"`
		MetricsRead   int   `json:"metricsRead"`
	} `json:"summary"`
}

// problems lists what the report gets wrong about the cases' claims.
func (r usageReport) problems(ns string, cases []loadCase) []string {
	var p []string
	for _, c := range cases {
		found := false
		for _, g := range r.GPUs {
			for _, h := range g.Holders {
				if h.Claim != ns+"/"+c.claim {
					continue
				}
				found = true
				u := h.Usage
				switch {
				case h.Device != c.device:
					p = append(p, fmt.Sprintf("%s: device %s, want %s", c.claim, h.Device, c.device))
				case u == nil:
					p = append(p, c.claim+": no usage")
				case !within(u.MemoryAllocatedBytes, c.allocated):
					p = append(p, fmt.Sprintf("%s: allocated %s, want %v", c.claim, fmtOpt(u.MemoryAllocatedBytes), c.allocated))
				case c.holds > 0 && !within(u.MemoryUsedBytes, c.holds):
					p = append(p, fmt.Sprintf("%s: used %s, want %v", c.claim, fmtOpt(u.MemoryUsedBytes), c.holds))
				case c.holds > 0 && u.Processes != 1:
					p = append(p, fmt.Sprintf("%s: %v processes, want 1", c.claim, u.Processes))
				case !nearOrNone(u.SMUtilizationPercent, c.sm):
					p = append(p, fmt.Sprintf("%s: SM %s, want %v", c.claim, fmtOpt(u.SMUtilizationPercent), c.sm))
				case u.Idle != (c.holds == 0):
					p = append(p, fmt.Sprintf("%s: idle %v (for %s s), want %v", c.claim, u.Idle, fmtOpt(u.IdleSeconds), c.holds == 0))
				}
			}
		}
		if !found {
			p = append(p, c.claim+": not listed")
		}
	}
	return p
}
