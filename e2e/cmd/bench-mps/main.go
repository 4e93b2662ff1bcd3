// Command bench-mps measures how long an MPS claim takes from its creation to
// its pod Running, on the in-process control plane with one simulated node
// whose containers run for real (runc, CDI): the scheduler allocates, the
// kubelet's DRA manager calls our plugin, which starts the claim's MPS control
// daemon, applies and confirms its limits, and writes the CDI spec; then the
// container starts. Claims go one at a time (each pod is deleted, and its
// claim unprepared, before the next), so the figures are latencies, not
// queueing. The same run with whole-GPU claims without sharing is the
// baseline; the report gives p50/p90/p99/max of both and the ratio of medians.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/gpu-dra/e2e/harness"
)

func main() {
	claims := flag.Int("claims", 24, "claims measured per kind (at least 20 for a p99 worth reading)")
	profile := flag.String("profile", "dgx-h100", "simulator profile of the node")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *claims, *profile); err != nil {
		fmt.Fprintln(os.Stderr, "bench-mps:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, count int, profile string) error {
	c, err := harness.Start(ctx, harness.Options{Logf: func(string, ...any) {}})
	if err != nil {
		return err
	}
	defer c.Stop()
	if _, err := c.InstallDriver(ctx, harness.InstallOptions{}); err != nil {
		return err
	}
	n, err := c.AddNode(ctx, harness.NodeOptions{Name: "bench-mps"})
	if err != nil {
		return err
	}
	if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: profile}); err != nil {
		return err
	}
	for !n.DriverRegistered(harness.DefaultDriver) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	ns := "bench-mps"
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	// A first claim warms the caches (slices in the scheduler, images, the
	// plugin's first NVML calls); it is not counted.
	if _, err := measure(ctx, c, n, ns, "warmup", nil); err != nil {
		return err
	}
	mps := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": map[string]any{
			"defaultActiveThreadPercentage":  50,
			"defaultPinnedDeviceMemoryLimit": "10Gi",
		}},
	}
	kinds := []struct {
		name   string
		config map[string]any
	}{{"whole GPU, no sharing", nil}, {"MPS (50% threads, 10Gi pinned)", mps}}
	medians := map[string]time.Duration{}
	fmt.Printf("claim created -> pod Running, %d claims each, one at a time, node %s (%s), containers run with runc\n", count, n.Name, profile)
	for k, kind := range kinds {
		var d []time.Duration
		for i := range count {
			took, err := measure(ctx, c, n, ns, fmt.Sprintf("k%d-%02d", k, i), kind.config)
			if err != nil {
				return fmt.Errorf("%s, claim %d: %w", kind.name, i, err)
			}
			d = append(d, took)
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		medians[kind.name] = pct(d, 50)
		fmt.Printf("%-32s p50 %7s  p90 %7s  p99 %7s  max %7s\n", kind.name,
			ms(pct(d, 50)), ms(pct(d, 90)), ms(pct(d, 99)), ms(d[len(d)-1]))
	}
	base, withMPS := medians[kinds[0].name], medians[kinds[1].name]
	if base > 0 {
		fmt.Printf("MPS p50 / whole-GPU p50 = %.2f (the MPS daemon's start and limit confirmation: +%s)\n",
			float64(withMPS)/float64(base), ms(withMPS-base))
	}
	return nil
}

// measure creates a claim (with the GpuConfig if given) and a pod using it,
// returns the time from the claim's creation to the pod Running, then
// deletes both and waits until the node has unprepared the claim.
func measure(ctx context.Context, c *harness.Cluster, n *harness.Node, ns, name string, config map[string]any) (time.Duration, error) {
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			}}},
		}},
	}
	if config != nil {
		raw, err := json.Marshal(config)
		if err != nil {
			return 0, err
		}
		claim.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{
			Requests: []string{"gpu"},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: harness.DefaultDriver, Parameters: runtime.RawExtension{Raw: raw},
			}},
		}}
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": n.Name},
			Containers: []v1.Container{{
				Name: "ctr", Image: "cuda-sample",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &name}},
		},
	}
	start := time.Now()
	if _, err := c.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return 0, err
	}
	if _, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return 0, err
	}
	if _, err := c.WaitPodRunning(ctx, ns, name, 60*time.Second); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if err := c.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return 0, err
	}
	if err := c.WaitPodGone(ctx, ns, name, 60*time.Second); err != nil {
		return 0, err
	}
	if err := c.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return 0, err
	}
	return took, nil
}

// pct is the p-th percentile of sorted durations (nearest rank).
func pct(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p + 99) / 100
	if i < 1 {
		i = 1
	}
	return sorted[i-1]
}

func ms(d time.Duration) string {
	return d.Round(100 * time.Microsecond).String()
}
