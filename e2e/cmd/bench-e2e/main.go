// Command bench-e2e measures the driver at cluster scale on the in-process
// control plane: N simulated nodes with G GPUs each (our node plugin on the
// simulator, one process per node; the nodes run no containers: a pod is
// Running once its claims are prepared), then P one-GPU pods from a claim
// template, then their deletion. It prints pods/s, create -> Running
// percentiles, what the apiserver holds of our slices, the API requests our
// plugins send (counted by the API server per user agent) at rest and per
// prepared and unprepared pod against all requests, and the plugins' resident
// memory.
//
// The node and pod counts come from flags or BENCH_NODES / BENCH_PODS (flags
// win); BENCH_REST_SECONDS is the window at rest. `make bench-e2e` runs the
// default, 100 nodes; `BENCH_NODES=1000 make bench-e2e` the large one.
// BENCH_PROFILE (debug or release) names the cargo profile whose binaries
// E2E_BIN_DIR holds (the Makefile builds that profile and points there), and
// is printed with the figures, which depend on it. BENCH_PLUGIN_ARGS are
// extra flags of every plugin, split at spaces (e.g. one periodic task
// switched off, to measure what it costs at rest).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/gpu-dra/e2e/harness"
)

func main() {
	nodes := flag.Int("nodes", harness.EnvIntOrExit("bench-e2e", "BENCH_NODES", 100), "simulated nodes (env BENCH_NODES)")
	pods := flag.Int("pods", harness.EnvIntOrExit("bench-e2e", "BENCH_PODS", 800), "one-GPU pods (env BENCH_PODS)")
	rest := flag.Duration("rest", time.Duration(harness.EnvIntOrExit("bench-e2e", "BENCH_REST_SECONDS", 30))*time.Second, "window at rest in which the plugins' API requests are counted (env BENCH_REST_SECONDS)")
	profile := flag.String("profile", "dgx-h100", "simulator profile of every node (dgx-h100: 8 GPUs)")
	parallel := flag.Int("parallel", 32, "concurrent pod creations")
	driver := flag.String("driver", "plugin", "plugin: our gpu-kubelet-plugin on the simulator; reference: the upstream Go helper in-process (baseline)")
	gpus := flag.Int("gpus", 8, "GPUs per node of the reference driver")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *nodes < 1 || *pods < 1 || *pods > *nodes**gpus {
		fmt.Fprintf(os.Stderr, "bench-e2e: --nodes %d, --pods %d: want at least one of each and at most 8 pods per node\n", *nodes, *pods)
		os.Exit(2)
	}
	if err := run(ctx, *nodes, *pods, *parallel, *rest, *profile, *driver, *gpus); err != nil {
		fmt.Fprintln(os.Stderr, "bench-e2e:", err)
		os.Exit(1)
	}
}

// envInt is harness.EnvInt; a value that is not an integer stops the
// benchmark naming it.
func run(ctx context.Context, nodeCount, podCount, parallel int, rest time.Duration, profile, driver string, gpus int) error {
	if driver != "plugin" && driver != "reference" {
		return fmt.Errorf("--driver %q: want plugin or reference", driver)
	}
	if driver == "reference" {
		profile = fmt.Sprintf("reference driver, %d GPUs", gpus)
	}
	bin, err := harness.Binary("gpu-kubelet-plugin")
	if err != nil {
		return err
	}
	buildProfile := os.Getenv("BENCH_PROFILE")
	if buildProfile == "" {
		buildProfile = "debug"
	}
	pluginArgs := strings.Fields(os.Getenv("BENCH_PLUGIN_ARGS"))
	fmt.Printf("plugin: %s build, %s %s\n", buildProfile, bin, strings.Join(pluginArgs, " "))
	c, err := harness.Start(ctx, harness.Options{Logf: func(f string, a ...any) { fmt.Printf(f+"\n", a...) }})
	if err != nil {
		return err
	}
	defer c.Stop()
	_, webhookErr := harness.Binary("gpu-dra-webhook")
	if _, err := c.InstallDriver(ctx, harness.InstallOptions{Webhook: webhookErr == nil}); err != nil {
		return err
	}

	start := time.Now()
	var mu sync.Mutex
	var refs []*harness.RefDriver
	defer func() {
		for _, r := range refs {
			r.Stop()
		}
	}()
	asked := nodeCount
	nodes, err := c.AddFleet(ctx, harness.FleetOptions{
		Count: nodeCount,
		Node: func(i int) harness.NodeOptions {
			return harness.NodeOptions{Name: fmt.Sprintf("node-%03d", i), NoContainers: true}
		},
		Start: func(ctx context.Context, _ int, n *harness.Node) error {
			if driver == "plugin" {
				_, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: profile, ExtraArgs: pluginArgs})
				return err
			}
			ref, err := n.StartRefDriver(ctx, harness.DefaultDriver, gpus)
			if err == nil {
				mu.Lock()
				refs = append(refs, ref)
				mu.Unlock()
			}
			return err
		},
		// Every node costs a plugin process: stop adding nodes before the
		// machine runs short of memory, and measure with those that fit.
		MinFreeMiB: minFreeMiB,
		Logf:       func(f string, a ...any) { fmt.Printf(f+"\n", a...) },
	})
	if err != nil {
		return err
	}
	nodeCount = len(nodes)
	if nodeCount < asked {
		fmt.Printf("measuring with the %d nodes of %d that fit (BENCH_MIN_FREE_MIB is %d)\n", nodeCount, asked, minFreeMiB)
	}
	fmt.Printf("%d nodes with plugins started in %s\n", nodeCount, time.Since(start).Round(time.Millisecond))
	if podCount > nodeCount*gpus {
		podCount = nodeCount * gpus
		fmt.Printf("pods: %d, what the nodes that fit hold\n", podCount)
	}

	// Registration and publishing take longer the more plugins start at once on
	// this machine: 5 minutes, and a further minute per 100 nodes above 100.
	registerWait := 5*time.Minute + time.Duration(max(nodeCount-100, 0))*600*time.Millisecond
	devices, err := c.WaitFleetPublished(ctx, nodes, harness.DefaultDriver, registerWait, func(f string, a ...any) { fmt.Printf(f+"\n", a...) })
	if err != nil {
		return err
	}
	fmt.Printf("all %d plugins registered and published (%d devices) %s after start\n", nodeCount, devices, time.Since(start).Round(time.Millisecond))
	reportSlices(ctx, c)
	// At rest before any claim: what a plugin costs with nothing prepared
	// (its periodic work alone), once the plugins' start is over: they still
	// read their Node and slices for a while after every pool has a slice.
	settled, err := settle(ctx, c)
	if err != nil {
		return err
	}
	fmt.Printf("plugins quiet (no request but watches for 5 s) %s after start\n", settled.Sub(start).Round(time.Second))
	if err := restWindow(ctx, c, nodes, rest, "at rest, no claim prepared"); err != nil {
		return err
	}

	ns := "bench"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		return err
	}
	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com"}}},
		}}},
	}
	if _, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		return err
	}

	// Running times come from a watch, so they are when the apiserver saw
	// the transition, not when a poll noticed it.
	var rmu sync.Mutex
	running := map[string]time.Time{}
	createdAt := map[string]time.Time{}
	done := make(chan struct{})
	factory := informers.NewSharedInformerFactoryWithOptions(c.Client, 0, informers.WithNamespace(ns))
	record := func(obj any) {
		pod, ok := obj.(*v1.Pod)
		if !ok || pod.Status.Phase != v1.PodRunning {
			return
		}
		rmu.Lock()
		defer rmu.Unlock()
		if _, seen := running[pod.Name]; !seen {
			running[pod.Name] = time.Now()
			if len(running) == podCount {
				close(done)
			}
		}
	}
	if _, err := factory.Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: record, UpdateFunc: func(_, o any) { record(o) },
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())

	beforeCreate := c.APIRequests()
	t0 := time.Now()
	work := make(chan int)
	var cwg sync.WaitGroup
	for range parallel {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			for i := range work {
				name := fmt.Sprintf("pod-%04d", i)
				pod := &v1.Pod{
					ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
					Spec: v1.PodSpec{
						Containers:     []v1.Container{{Name: "ctr", Image: "cuda", Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
						ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: new("one-gpu")}},
					},
				}
				rmu.Lock()
				createdAt[name] = time.Now()
				rmu.Unlock()
				if _, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
					fmt.Fprintf(os.Stderr, "create %s: %v\n", name, err)
				}
			}
		}()
	}
	for i := range podCount {
		work <- i
	}
	close(work)
	cwg.Wait()
	createdIn := time.Since(t0)
	select {
	case <-done:
	case <-time.After(10 * time.Minute):
		rmu.Lock()
		n := len(running)
		rmu.Unlock()
		if n == 0 {
			return fmt.Errorf("no pod of %d running after 10 minutes", podCount)
		}
		// The figures of the pods that made it still say something; the
		// stragglers are named by count so the run is not read as a clean one.
		fmt.Printf("\nWARNING: only %d of %d pods Running after 10 minutes; figures below are over those\n", n, podCount)
	case <-ctx.Done():
		return ctx.Err()
	}
	total := time.Since(t0)
	created := c.APIRequests()

	rmu.Lock()
	var lat []time.Duration
	for name, t := range running {
		lat = append(lat, t.Sub(createdAt[name]))
	}
	rmu.Unlock()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }
	fmt.Printf("\n== %d one-GPU pods on %d nodes x %s (%s plugins)\n", podCount, nodeCount, profile, buildProfile)
	fmt.Printf("created in %s; %d Running after %s: %.1f pods/s\n", createdIn.Round(time.Millisecond), len(lat), total.Round(time.Millisecond), float64(len(lat))/total.Seconds())
	fmt.Printf("create -> Running: p50 %s  p90 %s  p99 %s  max %s\n",
		pct(0.50).Round(time.Millisecond), pct(0.90).Round(time.Millisecond), pct(0.99).Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond))

	perNode := map[string]int{}
	list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err == nil {
		for _, p := range list.Items {
			perNode[p.Spec.NodeName]++
		}
	}
	maxPer := 0
	for _, v := range perNode {
		maxPer = max(maxPer, v)
	}
	fmt.Printf("pods spread over %d nodes (max %d on one node)\n", len(perNode), maxPer)
	reportSlices(ctx, c)
	reportRequests("pods created until all Running (prepare)", beforeCreate, created, total, podCount)

	// At rest: the claims' status writes of the last prepares are done after
	// a short settle; then nothing changes.
	select {
	case <-time.After(5 * time.Second):
	case <-ctx.Done():
		return ctx.Err()
	}
	if err := restWindow(ctx, c, nodes, rest, fmt.Sprintf("at rest, %d pods Running", podCount)); err != nil {
		return err
	}

	// Churn, the other half: every pod deleted, until the generated claims
	// are gone (each unprepared by its node and deleted by the controller).
	beforeDelete := c.APIRequests()
	t1 := time.Now()
	// One request per pod, as many at once as the creations: a DeleteCollection
	// of hundreds of pods outlives the API server's request timeout.
	dels := make(chan int)
	var dwg sync.WaitGroup
	for range parallel {
		dwg.Add(1)
		go func() {
			defer dwg.Done()
			for i := range dels {
				name := fmt.Sprintf("pod-%04d", i)
				if err := c.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
					fmt.Fprintf(os.Stderr, "delete %s: %v\n", name, err)
				}
			}
		}()
	}
	for i := range podCount {
		dels <- i
	}
	close(dels)
	dwg.Wait()
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 10*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) > 0 {
			return false, nil
		}
		claims, err := c.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(claims.Items) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("pods and claims not gone 10 minutes after their deletion: %w", err)
	}
	deleted := time.Since(t1)
	fmt.Printf("\n%d pods deleted and their claims gone in %s: %.1f pods/s\n", podCount, deleted.Round(time.Millisecond), float64(podCount)/deleted.Seconds())
	reportRequests("pods deleted until their claims are gone (unprepare)", beforeDelete, c.APIRequests(), deleted, podCount)
	return nil
}

// settle waits until our plugins sent no request but watches for 5 s, at most
// 2 minutes (then it goes on, saying so), and returns when.
func settle(ctx context.Context, c *harness.Cluster) (time.Time, error) {
	deadline := time.Now().Add(2 * time.Minute)
	last := ourRequests(c.APIRequests())
	for time.Now().Before(deadline) {
		select {
		case <-time.After(5 * time.Second):
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
		now := ourRequests(c.APIRequests())
		if now == last {
			return time.Now(), nil
		}
		last = now
	}
	fmt.Println("WARNING: our plugins still sending requests 2 minutes after start; measuring at rest anyway")
	return time.Now(), nil
}

// ourRequests is how many requests but watches our plugins sent so far.
func ourRequests(counts map[harness.APIRequestKind]int) int {
	n := 0
	for k, v := range counts {
		if strings.HasPrefix(k.UserAgent, pluginAgent) && k.Verb != "watch" {
			n += v
		}
	}
	return n
}

// restWindow counts our plugins' API requests and CPU over a window of
// length rest in which nothing changes, and prints them with the plugins'
// memory and threads.
func restWindow(ctx context.Context, c *harness.Cluster, nodes []*harness.Node, rest time.Duration, what string) error {
	restStart, cpuStart := c.APIRequests(), pluginCPU(nodes)
	select {
	case <-time.After(rest):
	case <-ctx.Done():
		return ctx.Err()
	}
	reportRequests(what, restStart, c.APIRequests(), rest, 0)
	cpu := pluginCPU(nodes) - cpuStart
	fmt.Printf("  our plugins' CPU at rest: %.3f cores together, %.2f ms/s per plugin\n", cpu.Seconds()/rest.Seconds(), 1e3*cpu.Seconds()/rest.Seconds()/float64(max(len(nodes), 1)))
	reportPlugins(nodes)
	return nil
}

// pluginAgent is the user agent prefix of our node plugins' requests
// (`gpu-kubelet-plugin/<version> (<subcommand>; <node>)`).
const pluginAgent = "gpu-kubelet-plugin/"

// reportRequests prints the API requests of a window: our plugins' (watch
// starts apart), per second, per pod when pods is not 0, by verb and
// resource, and against all requests the API server served in the window.
func reportRequests(what string, before, after map[harness.APIRequestKind]int, window time.Duration, pods int) {
	var ours, watches, all int
	byCall := map[string]int{}
	for k, n := range after {
		n -= before[k]
		if n == 0 {
			continue
		}
		all += n
		if !strings.HasPrefix(k.UserAgent, pluginAgent) {
			continue
		}
		if k.Verb == "watch" {
			watches += n
			continue
		}
		ours += n
		byCall[k.Verb+" "+k.Resource] += n
	}
	calls := make([]string, 0, len(byCall))
	for k, n := range byCall {
		calls = append(calls, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(calls)
	secs := window.Seconds()
	fmt.Printf("API requests, %s, over %s:\n", what, window.Round(time.Millisecond))
	perPod := ""
	if pods > 0 {
		perPod = fmt.Sprintf(", %.2f per pod", float64(ours)/float64(pods))
	}
	fmt.Printf("  our plugins: %d (%.2f/s%s) + %d watch starts; all clients: %d (%.1f/s), ours %.1f%%\n",
		ours, float64(ours)/secs, perPod, watches, all, float64(all)/secs, 100*float64(ours+watches)/float64(max(all, 1)))
	if len(calls) > 0 {
		fmt.Printf("  ours by call: %s\n", strings.Join(calls, ", "))
	}
}

// reportSlices prints the apiserver's view of our slices.
func reportSlices(ctx context.Context, c *harness.Cluster) {
	t := time.Now()
	list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + harness.DefaultDriver})
	if err != nil {
		fmt.Printf("list slices: %v\n", err)
		return
	}
	listTook := time.Since(t)
	devices, bytes := 0, 0
	pools := map[string]bool{}
	for _, s := range list.Items {
		devices += len(s.Spec.Devices)
		pools[s.Spec.Pool.Name] = true
		bytes += s.Size()
	}
	fmt.Printf("apiserver: %d ResourceSlices, %d pools, %d devices, %d KiB protobuf; LIST took %s\n",
		len(list.Items), len(pools), devices, bytes/1024, listTook.Round(time.Millisecond))
}

// minFreeMiB is the memory (MemAvailable) below which no further node is
// added (env BENCH_MIN_FREE_MIB, default 3072).
var minFreeMiB = harness.EnvIntOrExit("bench-e2e", "BENCH_MIN_FREE_MIB", 3072)

// pluginCPU is the CPU time (user and system) the running node plugins have
// used so far, from /proc/<pid>/stat in clock ticks (100 per second on Linux).
func pluginCPU(nodes []*harness.Node) time.Duration {
	var ticks int64
	for _, n := range nodes {
		if n.Plugin == nil || !n.Plugin.Running() {
			continue
		}
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", n.Plugin.Pid()))
		if err != nil {
			continue
		}
		// The command name may hold spaces: fields are counted after its ')'.
		s := string(data)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(fields) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(fields[11], 10, 64)
		k, _ := strconv.ParseInt(fields[12], 10, 64)
		ticks += u + k
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}

// reportPlugins prints the node plugins' resident memory and threads.
func reportPlugins(nodes []*harness.Node) {
	var rss, anon, threads []int
	for _, n := range nodes {
		if n.Plugin == nil || !n.Plugin.Running() {
			continue
		}
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", n.Plugin.Pid()))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			for field, into := range map[string]*[]int{"VmRSS:": &rss, "RssAnon:": &anon, "Threads:": &threads} {
				if v, ok := strings.CutPrefix(line, field); ok {
					var n int
					if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d", &n); err == nil {
						*into = append(*into, n)
					}
				}
			}
		}
	}
	if len(rss) == 0 {
		return
	}
	sort.Ints(rss)
	sort.Ints(threads)
	sort.Ints(anon)
	sum, anonSum := 0, 0
	for _, kb := range rss {
		sum += kb
	}
	for _, kb := range anon {
		anonSum += kb
	}
	fmt.Printf("node plugin RSS: sum %.1f MiB over %d processes; per plugin median %d KiB, min %d KiB, max %d KiB\n",
		float64(sum)/1024, len(rss), rss[len(rss)/2], rss[0], rss[len(rss)-1])
	// RSS counts the pages of the binary and libraries every plugin maps from the same
	// files, once per process; RssAnon is what each plugin adds on its own.
	if len(anon) > 0 {
		fmt.Printf("node plugin private memory (RssAnon): sum %.1f MiB; per plugin median %d KiB, max %d KiB\n",
			float64(anonSum)/1024, anon[len(anon)/2], anon[len(anon)-1])
	}
	if len(threads) > 0 {
		fmt.Printf("node plugin threads: median %d, min %d, max %d\n", threads[len(threads)/2], threads[0], threads[len(threads)-1])
	}
}
