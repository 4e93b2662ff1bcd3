package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
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

	"github.com/gpu-dra/e2e/harness"
)

// wasteKind is one kind of workload of the wasteful cluster: how many of it, the GPUs each
// asks for, and the load each of its GPUs carries (cuda-app --hold-memory, --sm-load).
type wasteKind struct {
	template string
	count    int
	gpus     int
	holdGiB  int
	sm       int
}

// wasteScenario is the cluster: nodes of 4 A100-SXM4-80GB and the workloads.
type wasteScenario struct {
	nodes int
	kinds []wasteKind
}

// The textbook waste: training jobs that fill their GPUs, inference services and notebooks
// that each hold a whole 80 GB GPU for a fraction of it. The full one (`make advise-demo`,
// E2E_ADVISE_SCENARIO=full) is 8 nodes with 4 training jobs of 4 GPUs, 12 inference
// services and 8 notebooks: 36 GPUs asked for 32. CI runs it at a quarter: 2 nodes, 9 GPUs
// asked for 8.
func wasteScenarioFromEnv(t *testing.T) wasteScenario {
	switch s := os.Getenv("E2E_ADVISE_SCENARIO"); s {
	case "", "small":
		return wasteScenario{nodes: 2, kinds: []wasteKind{
			{"training", 1, 4, 70, 95}, {"inference", 3, 1, 10, 15}, {"notebook", 2, 1, 3, 5},
		}}
	case "full":
		return wasteScenario{nodes: 8, kinds: []wasteKind{
			{"training", 4, 4, 70, 95}, {"inference", 12, 1, 10, 15}, {"notebook", 8, 1, 3, 5},
		}}
	default:
		t.Fatalf("E2E_ADVISE_SCENARIO=%q: want small or full", s)
		return wasteScenario{}
	}
}

const gpusPerWasteNode = 4

// wasteTemplate is the workload's ResourceClaimTemplate as a team writes it: whole GPUs.
func wasteTemplate(ns string, k wasteKind) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: k.template, Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(k.gpus),
			}}},
		}}},
	}
}

// wastePod is one workload: a pod whose claim comes from its kind's template, on one of the
// scenario's nodes (label), running its load on each of its GPUs until deleted.
func wastePod(ns, name, label string, k wasteKind) *v1.Pod {
	load := fmt.Sprintf("cuda-app --hold-memory %dGi --sm-load %d", k.holdGiB, k.sm)
	cmd := []string{"sh", "-c", "exec " + load}
	if k.gpus > 1 {
		var parts []string
		for i := 0; i < k.gpus; i++ {
			parts = append(parts, fmt.Sprintf("CUDA_VISIBLE_DEVICES=%d %s &", i, load))
		}
		cmd = []string{"sh", "-c", strings.Join(parts, " ") + " wait"}
	}
	template := k.template
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"workload": k.template}},
		Spec: v1.PodSpec{
			TerminationGracePeriodSeconds: &testGracePeriod,
			NodeSelector:                  map[string]string{"gpu-dra-e2e/advise": label},
			Containers: []v1.Container{{
				Name: "ctr", Image: harness.TestImageName, Command: cmd,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}},
		},
	}
}

// adviseReport is the part of `gpu-dra advise -o json` checked here.
type adviseReport struct {
	Claims []struct {
		Claim    string `json:"claim"`
		Node     string `json:"node"`
		Device   string `json:"device"`
		Evidence *struct {
			PeakUsedBytes  float64 `json:"peakUsedBytes"`
			SMP95Percent   *int    `json:"smP95Percent"`
			Samples        int     `json:"samples"`
			CoveredSeconds int     `json:"coveredSeconds"`
		} `json:"evidence"`
		Advice struct {
			Kind                   string  `json:"kind"`
			MemoryBytes            float64 `json:"memoryBytes"`
			ActiveThreadPercentage int     `json:"activeThreadPercentage"`
			Reason                 string  `json:"reason"`
		} `json:"advice"`
	} `json:"claims"`
	Fleet struct {
		GPUsHeld   int     `json:"gpusHeld"`
		GPUsNeeded int     `json:"gpusNeeded"`
		HoursFreed float64 `json:"gpuHoursPerMonthFreed"`
	} `json:"fleet"`
	MetricsErrors []string `json:"metricsErrors"`
}

// runAdvise runs `gpu-dra advise` against the test cluster.
func runAdvise(t *testing.T, args ...string) string {
	t.Helper()
	bin, err := harness.Binary("gpu-dra")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append([]string{"advise"}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+cluster.Kubeconfig)
	out, err := cmd.Output()
	if err != nil {
		stderr := ""
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("gpu-dra advise %v: %v: %s%s", args, err, out, stderr)
	}
	return string(out)
}

// wastePhase is what the cluster looks like at one moment of the scenario.
type wastePhase struct {
	gpusRequested int
	running       int
	pending       int
	gpusHeld      int     // distinct GPUs holding a claim of the scenario
	smSum         float64 // SM utilisation summed over the claims, as the plugins report it
}

// TestWastefulClusterAdvice: the textbook GPU waste on nodes of 4 A100-SXM4-80GB offered as
// memory shares (a whole-GPU claim there takes all the memory): a training job of 4 GPUs at
// 95 % SM and 70 GiB each, inference services at 15 % and 10 GiB, notebooks at 5 % and
// 3 GiB, each from its team's ResourceClaimTemplate asking for whole GPUs; one more GPU
// asked for than the nodes have, so one pod stays Pending. `gpu-dra advise` over their
// history keeps the training job whole (multi-GPU) and moves the others to MPS shares of
// their peak plus 20 %; its `-o yaml`, applied with `kubectl replace --force`, changes the
// inference and notebook templates; the workloads recreated all run, on 5 GPUs instead of 8
// (plus the one that was Pending), each still seeing its load; a program of an advised claim
// that asks for more than its share gets CUDA's out of memory, as under a real MPS limit.
// E2E_ADVISE_SCENARIO=full runs the 8-node cluster (`make advise-demo`) and
// E2E_ADVISE_TABLE=<file> writes the before/after table there.
func TestWastefulClusterAdvice(t *testing.T) {
	requirePlugins(t)
	kubectl, err := harness.Tool("kubectl")
	if err != nil {
		t.Skipf("%v (run `make e2e-kubectl`)", err)
	}
	sc := wasteScenarioFromEnv(t)
	ctx := context.Background()
	start := time.Now()
	ns := newNamespace(ctx, t, "waste")
	label := ns

	// The nodes: every GPU offered as memory shares, usage sampled every second.
	var urls []string
	var nodes []string
	for i := 0; i < sc.nodes; i++ {
		name := fmt.Sprintf("waste-%d", i)
		url := fmt.Sprintf("http://127.0.0.1:%d/metrics", freeLoopbackPort(t))
		addPluginNodeWith(ctx, t, harness.NodeOptions{Name: name, Labels: map[string]string{"gpu-dra-e2e/advise": label}},
			"hgx-a100-80gb-x4", []string{
				"--memory-share-gpus=all",
				"--usage-interval-seconds=1",
				"--http-address=" + strings.TrimSuffix(strings.TrimPrefix(url, "http://"), "/metrics"),
			}, nil)
		urls = append(urls, url)
		nodes = append(nodes, name)
	}
	t.Logf("%d nodes of 4 A100-SXM4-80GB up after %s", sc.nodes, time.Since(start).Round(time.Second))
	for _, k := range sc.kinds {
		if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, wasteTemplate(ns, k), metav1.CreateOptions{}); err != nil {
			t.Fatalf("create template %s: %v", k.template, err)
		}
	}
	kindOf := map[string]wasteKind{}
	var names []string
	requested := 0
	for _, k := range sc.kinds {
		for i := 0; i < k.count; i++ {
			name := fmt.Sprintf("%s-%d", k.template, i)
			kindOf[name] = k
			names = append(names, name)
			requested += k.gpus
		}
	}
	capacity := sc.nodes * gpusPerWasteNode

	// create starts the workloads: the multi-GPU ones first, each once the one before runs (a
	// team's training job was there before the notebooks came), then the rest at once.
	create := func() {
		for _, name := range names {
			k := kindOf[name]
			if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, wastePod(ns, name, label, k), metav1.CreateOptions{}); err != nil {
				t.Fatalf("create pod %s: %v", name, err)
			}
			if k.gpus > 1 {
				if _, err := cluster.WaitPodRunning(ctx, ns, name, 3*time.Minute); err != nil {
					t.Fatalf("pod %s: %v", name, err)
				}
			}
		}
	}
	// settle waits until `pending` pods are unschedulable and the others run, and returns the
	// running pods by name.
	settle := func(pending int) map[string]*v1.Pod {
		var running map[string]*v1.Pod
		var unschedulable []string
		var waiting []string
		if !eventually(ctx, 5*time.Minute, func() bool {
			list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false
			}
			running, unschedulable, waiting = map[string]*v1.Pod{}, nil, nil
			for i := range list.Items {
				p := &list.Items[i]
				switch {
				case p.Status.Phase == v1.PodRunning:
					running[p.Name] = p
				case p.Spec.NodeName == "" && podUnschedulable(p):
					unschedulable = append(unschedulable, p.Name)
				default:
					waiting = append(waiting, p.Name)
				}
			}
			return len(waiting) == 0 && len(unschedulable) == pending && len(running) == len(names)-pending
		}) {
			t.Fatalf("pods: %d running, unschedulable %v, neither %v; want %d pending", len(running), unschedulable, waiting, pending)
		}
		if pending > 0 {
			// Still pending a while later: the scheduler does not find room it missed.
			time.Sleep(3 * time.Second)
			for _, name := range unschedulable {
				p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
				if err != nil || p.Spec.NodeName != "" {
					t.Fatalf("pod %s was scheduled after all (%v)", name, err)
				}
			}
			t.Logf("pending: %v", unschedulable)
		}
		return running
	}
	// measure reads what the running pods' claims hold and use: distinct GPUs, and each claim's
	// memory used and SM, which must be its load on every one of its GPUs.
	measure := func(running map[string]*v1.Pod, pending int) wastePhase {
		ph := wastePhase{gpusRequested: requested, running: len(running), pending: pending}
		held := map[string]bool{}
		claimOf := map[string]string{}
		for name, p := range running {
			for _, s := range p.Status.ResourceClaimStatuses {
				if s.ResourceClaimName != nil {
					claimOf[*s.ResourceClaimName] = name
				}
			}
		}
		for claim := range claimOf {
			c, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range c.Status.Allocation.Devices.Results {
				held[r.Pool+"/"+r.Device] = true
			}
		}
		ph.gpusHeld = len(held)
		var issues []string
		if !eventually(ctx, 30*time.Second, func() bool {
			got := map[string]*claimFigures{}
			for _, url := range urls {
				text, err := scrape(url)
				if err != nil {
					issues = []string{err.Error()}
					return false
				}
				samples, err := parseProm(text)
				if err != nil {
					issues = []string{err.Error()}
					return false
				}
				for c, f := range claimMetrics(samples, ns) {
					got[c] = f
				}
			}
			issues, ph.smSum = nil, 0
			for claim, pod := range claimOf {
				k, f := kindOf[pod], got[claim]
				want := float64(k.gpus) * float64(k.holdGiB) * (1 << 30)
				switch {
				case f == nil:
					issues = append(issues, pod+": no series")
				case f.used == nil || math.Abs(*f.used-want) > 0.02*want:
					issues = append(issues, fmt.Sprintf("%s: memory used %s, want %v", pod, fmtOpt(f.used), want))
				case f.sm == nil || math.Abs(*f.sm-float64(k.gpus*k.sm)) > float64(2*k.gpus):
					issues = append(issues, fmt.Sprintf("%s: SM %s, want %d", pod, fmtOpt(f.sm), k.gpus*k.sm))
				default:
					ph.smSum += *f.sm
				}
			}
			return len(issues) == 0
		}) {
			t.Fatalf("the loads as the plugins report them:\n  %s", strings.Join(issues, "\n  "))
		}
		return ph
	}

	// Before: whole GPUs for everyone, one pod (four at full size) Pending.
	create()
	beforePending := requested - capacity
	before := measure(settle(beforePending), beforePending)
	if before.gpusHeld != capacity {
		t.Errorf("before: %d GPUs held, want all %d", before.gpusHeld, capacity)
	}
	t.Logf("before: %+v (after %s)", before, time.Since(start).Round(time.Second))

	// The advice, once every claim has the history it asks for (seconds here, not hours).
	const minSamples, minHistory = 15, "15s"
	adviseArgs := []string{"-n", ns, "--metrics-url", strings.Join(urls, ","), "--min-samples", strconv.Itoa(minSamples),
		"--min-history", minHistory, "--offerings", "share,mps"}
	var report adviseReport
	var out string
	if !eventually(ctx, 2*time.Minute, func() bool {
		out = runAdvise(t, append([]string{"-o", "json"}, adviseArgs...)...)
		report = adviseReport{}
		if err := json.Unmarshal([]byte(out), &report); err != nil {
			t.Fatalf("advise -o json: %v\n%s", err, out)
		}
		for _, c := range report.Claims {
			if c.Advice.Kind == "refused" {
				return false
			}
		}
		return len(report.Claims) > 0
	}) {
		t.Fatalf("advice still refused after 2 min:\n%s", out)
	}
	t.Logf("gpu-dra advise:\n%s", runAdvise(t, adviseArgs...))
	var problems []string
	for _, c := range report.Claims {
		pod, _, _ := strings.Cut(strings.TrimPrefix(c.Claim, ns+"/"), "-gpu-")
		k := kindOf[pod]
		if c.Evidence == nil || c.Evidence.Samples < minSamples {
			problems = append(problems, fmt.Sprintf("%s: evidence %+v", c.Claim, c.Evidence))
			continue
		}
		if k.gpus > 1 {
			if c.Advice.Kind != "keep" || !strings.Contains(c.Advice.Reason, "multi-GPU") {
				problems = append(problems, fmt.Sprintf("%s: %+v, want keep (multi-GPU)", c.Claim, c.Advice))
			}
			continue
		}
		// MPS: the peak plus 20 % rounded up to a GiB; threads for the SM p95 plus 20 %, which
		// is more than that memory's share of the GPU.
		wantMem := math.Ceil(float64(k.holdGiB)*1.2) * (1 << 30)
		wantPct := int(math.Ceil(float64(k.sm) * 1.2))
		if c.Advice.Kind != "mps" || c.Advice.MemoryBytes != wantMem ||
			c.Advice.ActiveThreadPercentage < wantPct || c.Advice.ActiveThreadPercentage > wantPct+2 {
			problems = append(problems, fmt.Sprintf("%s: %+v, want mps of %v bytes and %d%% threads (+2)", c.Claim, c.Advice, wantMem, wantPct))
		}
	}
	if len(problems) > 0 {
		t.Fatalf("advice:\n  %s\n%s", strings.Join(problems, "\n  "), out)
	}
	// Packed per node: the training jobs' GPUs, and on each other node one GPU holds its
	// claims (at most 4 x 12 GiB and 4 x 18 % there).
	wantNeeded := 0
	for _, k := range sc.kinds {
		if k.gpus > 1 {
			wantNeeded += k.count * k.gpus
		}
	}
	wantNeeded += sc.nodes - wantNeeded/gpusPerWasteNode
	if report.Fleet.GPUsHeld != capacity || report.Fleet.GPUsNeeded != wantNeeded || len(report.MetricsErrors) > 0 {
		t.Fatalf("fleet: %+v (metrics errors %v), want %d held, %d needed", report.Fleet, report.MetricsErrors, capacity, wantNeeded)
	}

	// Applied as the output says: kubectl replace --force.
	yaml := runAdvise(t, append([]string{"-o", "yaml"}, adviseArgs...)...)
	t.Logf("gpu-dra advise -o yaml:\n%s", yaml)
	if n := strings.Count("\n"+yaml, "\n---\n"); n != 2 ||
		!strings.Contains(yaml, "kubectl replace --force") {
		t.Fatalf("advise -o yaml: %d documents, want the inference and notebook templates, and how to apply them", n)
	}
	file := filepath.Join(t.TempDir(), "advice.yaml")
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(kubectl, "replace", "--force", "-f", file)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+cluster.Kubeconfig)
	if res, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kubectl replace --force -f advice.yaml: %v: %s", err, res)
	} else {
		t.Logf("kubectl replace --force: %s", res)
	}
	for _, k := range sc.kinds {
		tmpl, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Get(ctx, k.template, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		capReq := tmpl.Spec.Spec.Devices.Requests[0].Exactly.Capacity
		if (capReq != nil) != (k.gpus == 1) {
			t.Errorf("template %s after the advice: capacity %+v", k.template, capReq)
		}
	}

	// The workloads recreated from the changed templates: all run, on fewer GPUs.
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		if err := cluster.Client.CoreV1().Pods(ns).Delete(ctx, pods.Items[i].Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range pods.Items {
		if err := cluster.WaitPodGone(ctx, ns, pods.Items[i].Name, 2*time.Minute); err != nil {
			t.Fatalf("pod %s not gone: %v", pods.Items[i].Name, err)
		}
	}
	create()
	running := settle(0)
	after := measure(running, 0)
	if after.gpusHeld != wantNeeded {
		t.Errorf("after: %d GPUs hold the workloads, want %d (what advise packed)", after.gpusHeld, wantNeeded)
	}

	// Wrong advice is caught: a program of an advised claim that allocates past its share
	// fails as CUDA does under an MPS pinned memory limit, and its own load goes on.
	for name, p := range running {
		k := kindOf[name]
		if k.gpus > 1 || !strings.HasPrefix(name, "inference") {
			continue
		}
		limit := int(math.Ceil(float64(k.holdGiB) * 1.2))
		// --seconds: were the allocation granted, the program would end rather than hold it.
		res, err := cluster.Node(p.Spec.NodeName).Exec(ctx, p, "ctr", "cuda-app", "--hold-memory", fmt.Sprintf("%dGi", limit+1), "--seconds", "1")
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode != 1 || !strings.Contains(res.Stdout+res.Stderr, "out of memory (cudaErrorMemoryAllocation)") ||
			!strings.Contains(res.Stdout, fmt.Sprintf("pinned memory limit %dG", limit)) {
			t.Errorf("pod %s: %d GiB under a %d GiB share: exit %d: %s%s; want CUDA's out of memory under the MPS limit",
				name, limit+1, limit, res.ExitCode, res.Stdout, res.Stderr)
		} else {
			t.Logf("pod %s: %d GiB under its %d GiB share: exit %d: %s%s", name, limit+1, limit, res.ExitCode, res.Stdout, res.Stderr)
		}
		break
	}

	table := wasteTable(sc, before, after, report.Fleet.GPUsNeeded, report.Fleet.HoursFreed)
	t.Logf("\n%s", table)
	if path := os.Getenv("E2E_ADVISE_TABLE"); path != "" {
		if err := os.WriteFile(path, []byte(table), 0o644); err != nil {
			t.Error(err)
		}
	}
	t.Logf("scenario took %s", time.Since(start).Round(time.Second))
}

// podUnschedulable says whether the scheduler marked the pod unschedulable.
func podUnschedulable(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse {
			return true
		}
	}
	return false
}

// wasteTable is the before/after table of the scenario.
func wasteTable(sc wasteScenario, before, after wastePhase, needed int, hoursFreed float64) string {
	var b strings.Builder
	var kinds []string
	for _, k := range sc.kinds {
		kinds = append(kinds, fmt.Sprintf("  %d %s x %d GPU (%d%% SM, %d GiB per GPU)", k.count, k.template, k.gpus, k.sm, k.holdGiB))
	}
	fmt.Fprintf(&b, "%d nodes x %d A100-SXM4-80GB = %d GPUs\n%s\n\n", sc.nodes, gpusPerWasteNode, sc.nodes*gpusPerWasteNode, strings.Join(kinds, "\n"))
	util := func(p wastePhase) string {
		if p.gpusHeld == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f %%", p.smSum/float64(p.gpusHeld))
	}
	rows := [][3]string{
		{"", "before", "after advice"},
		{"GPUs requested (whole)", strconv.Itoa(before.gpusRequested), wholeAfter(sc)},
		{"pods Running", strconv.Itoa(before.running), strconv.Itoa(after.running)},
		{"pods Pending", strconv.Itoa(before.pending), strconv.Itoa(after.pending)},
		{"GPUs held", strconv.Itoa(before.gpusHeld), strconv.Itoa(after.gpusHeld)},
		{"SM busy per GPU held", util(before), util(after)},
		{"GPUs needed (advise)", "", strconv.Itoa(needed)},
		{"GPU-hours/month freed (advise)", "", fmt.Sprintf("%.0f", hoursFreed)},
		{"GPUs free for more work", strconv.Itoa(sc.nodes*gpusPerWasteNode - before.gpusHeld), strconv.Itoa(sc.nodes*gpusPerWasteNode - after.gpusHeld)},
	}
	for _, r := range rows {
		fmt.Fprintf(&b, "%-32s %8s %14s\n", r[0], r[1], r[2])
	}
	return b.String()
}

// wholeAfter is how many whole GPUs the workloads ask for once advised (the multi-GPU ones).
func wholeAfter(sc wasteScenario) string {
	n := 0
	for _, k := range sc.kinds {
		if k.gpus > 1 {
			n += k.count * k.gpus
		}
	}
	return strconv.Itoa(n)
}
