// Command bench-e2e measures the driver at cluster scale on the in-process
// control plane: N simulated nodes with G GPUs each (our node plugin on the
// simulator), then P one-GPU pods from a claim template. It prints pods/s,
// create -> Running percentiles, and what the apiserver holds of our slices.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
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
	nodes := flag.Int("nodes", 100, "simulated nodes")
	pods := flag.Int("pods", 800, "one-GPU pods")
	profile := flag.String("profile", "dgx-h100", "simulator profile of every node (dgx-h100: 8 GPUs)")
	parallel := flag.Int("parallel", 32, "concurrent pod creations")
	driver := flag.String("driver", "plugin", "plugin: our gpu-kubelet-plugin on the simulator; reference: the upstream Go helper in-process (baseline)")
	gpus := flag.Int("gpus", 8, "GPUs per node of the reference driver")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *nodes, *pods, *parallel, *profile, *driver, *gpus); err != nil {
		fmt.Fprintln(os.Stderr, "bench-e2e:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, nodeCount, podCount, parallel int, profile, driver string, gpus int) error {
	if driver != "plugin" && driver != "reference" {
		return fmt.Errorf("--driver %q: want plugin or reference", driver)
	}
	if driver == "reference" {
		profile = fmt.Sprintf("reference driver, %d GPUs", gpus)
	}
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
	var nodes []*harness.Node
	var firstErr error
	var refs []*harness.RefDriver
	defer func() {
		for _, r := range refs {
			r.Stop()
		}
	}()
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for i := range nodeCount {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			n, err := c.AddNode(ctx, harness.NodeOptions{Name: fmt.Sprintf("node-%03d", i), NoContainers: true})
			if err == nil && driver == "plugin" {
				_, err = n.StartPlugin(ctx, harness.PluginOptions{Profile: profile})
			} else if err == nil {
				var ref *harness.RefDriver
				ref, err = n.StartRefDriver(ctx, harness.DefaultDriver, gpus)
				if err == nil {
					mu.Lock()
					refs = append(refs, ref)
					mu.Unlock()
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil && firstErr == nil {
				firstErr = err
			}
			if n != nil {
				nodes = append(nodes, n)
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	fmt.Printf("%d nodes with plugins started in %s\n", nodeCount, time.Since(start).Round(time.Millisecond))

	var devices int
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, n := range nodes {
			if !n.DriverRegistered(harness.DefaultDriver) {
				return false, nil
			}
		}
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + harness.DefaultDriver})
		if err != nil {
			return false, nil
		}
		devices = 0
		pools := map[string]bool{}
		for _, s := range list.Items {
			devices += len(s.Spec.Devices)
			pools[s.Spec.Pool.Name] = true
		}
		return len(pools) >= nodeCount, nil
	})
	if err != nil {
		return fmt.Errorf("plugins not all registered with slices: %w", err)
	}
	fmt.Printf("all %d plugins registered and published (%d devices) %s after start\n", nodeCount, devices, time.Since(start).Round(time.Millisecond))
	reportSlices(ctx, c)

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
	created := map[string]time.Time{}
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
				created[name] = time.Now()
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
		return fmt.Errorf("only %d of %d pods running after 10 minutes", n, podCount)
	case <-ctx.Done():
		return ctx.Err()
	}
	total := time.Since(t0)

	rmu.Lock()
	var lat []time.Duration
	for name, t := range running {
		lat = append(lat, t.Sub(created[name]))
	}
	rmu.Unlock()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }
	fmt.Printf("\n== %d one-GPU pods on %d nodes x %s\n", podCount, nodeCount, profile)
	fmt.Printf("created in %s; all Running after %s: %.1f pods/s\n", createdIn.Round(time.Millisecond), total.Round(time.Millisecond), float64(podCount)/total.Seconds())
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
	reportPlugins(nodes)
	return nil
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

// reportPlugins prints the node plugins' resident memory.
func reportPlugins(nodes []*harness.Node) {
	var rss []int
	for _, n := range nodes {
		if n.Plugin == nil || !n.Plugin.Running() {
			continue
		}
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", n.Plugin.Pid()))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(line, "VmRSS:") {
				var kb int
				fmt.Sscanf(strings.TrimSpace(strings.TrimPrefix(line, "VmRSS:")), "%d", &kb)
				rss = append(rss, kb)
			}
		}
	}
	if len(rss) == 0 {
		return
	}
	sort.Ints(rss)
	fmt.Printf("node plugin RSS: median %d KiB, max %d KiB (%d processes)\n", rss[len(rss)/2], rss[len(rss)-1], len(rss))
}
