// Command demo starts a local cluster (in-process control plane, an A100
// node with MIG and a T4 node with simulated GPUs), puts the driver on it,
// takes a short tour through a few examples, and stays up for kubectl until
// interrupted (or, with --exit, stops).
//
// Two ways to put the driver there: by default (`make demo`) the chart's
// objects are applied and the node plugins and the webhook run as processes
// next to the nodes, quick to start and their CDI specs shown; with --helm
// (`make demo-helm`) the user's own commands are printed and run: `helm
// install` of the chart onto real nodes, whose kubelets run the plugin's
// DaemonSet pods on the driver's image, `helm upgrade`, `kubectl logs` and
// `exec`, `gpu-dra check` and `gpu-dra usage` (package demo).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/demo"
	"github.com/gpu-dra/e2e/harness"
)

func main() {
	dir := flag.String("dir", "", "state directory (default: a new temporary directory)")
	examples := flag.String("examples", "", "comma-separated example folders for the tour (default: a few picked from examples/)")
	tour := flag.Bool("tour", true, "apply a few examples and show what happened")
	helm := flag.Bool("helm", false, "install the driver as a user does: helm install of the chart onto real nodes (make demo-helm)")
	release := flag.String("release", "dra-driver-nvidia-gpu", "with --helm: the release name")
	namespace := flag.String("namespace", "dra-driver-nvidia-gpu", "with --helm: the release namespace")
	exit := flag.Bool("exit", false, "stop once the demo's steps ran instead of staying up for kubectl; a failed step exits 1")
	flag.Parse()
	// The first Ctrl-C stops the cluster gracefully, a second one at once
	// (the cluster's reaper then removes what is left).
	ctx, stop := harness.InterruptContext(context.Background(), say)
	defer stop()
	var err error
	if *helm {
		err = runHelm(ctx, *dir, demo.HelmOptions{Release: *release, Namespace: *namespace, Examples: *examples, Say: say}, *exit)
	} else {
		err = run(ctx, *dir, *examples, *tour, *exit)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

func run(ctx context.Context, dir, examples string, tour, exit bool) error {
	say("== starting the control plane (etcd, kube-apiserver, kube-scheduler, controllers)")
	c, err := harness.Start(ctx, harness.Options{Dir: dir, Logf: func(f string, a ...any) { say("   "+f, a...) }})
	if err != nil {
		return err
	}
	defer c.Stop()
	dir = c.Dir
	say("   state in %s (removed on exit unless given with --dir or E2E_KEEP_DIR=1)", dir)

	_, webhookErr := harness.Binary("gpu-dra-webhook")
	drv, err := c.InstallDriver(ctx, harness.InstallOptions{Webhook: webhookErr == nil})
	if err != nil {
		return err
	}
	say("== driver objects applied (%d, from the Helm chart: %v)", len(drv.Objects), drv.FromChart)
	for _, o := range drv.Objects {
		say("   %s %s", o.GetKind(), o.GetName())
	}
	if webhookErr != nil {
		say("   webhook not started: %v", webhookErr)
	} else {
		say("   webhook at %s (log %s)", drv.Webhook.URL, drv.Webhook.LogPath)
	}
	for _, n := range drv.Notes {
		say("   note: %s", n)
	}

	// The A100 node: static MIG instances on GPUs 2 and 3 (the profile's),
	// GPUs 0 and 1 emptied and offered as dynamic MIG (as an admin sets it
	// up), whole GPUs 4-7; so every example of the tour finds its devices.
	nodes := []struct {
		name, profile string
		dynamicMIG    []int
	}{{"gpu-node-a100", "dgx-a100-40gb", []int{0, 1}}, {"gpu-node-t4", "t4", nil}}
	plugins := true
	for _, spec := range nodes {
		n, err := c.AddNode(ctx, harness.NodeOptions{Name: spec.name})
		if err != nil {
			return err
		}
		var extra []string
		if len(spec.dynamicMIG) > 0 {
			if err := demo.EmptyGPUs(n, spec.profile, spec.dynamicMIG); err != nil {
				return err
			}
			var ids []string
			for _, g := range spec.dynamicMIG {
				ids = append(ids, fmt.Sprint(g))
			}
			extra = []string{"--dynamic-mig-gpus=" + strings.Join(ids, ",")}
		}
		if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: spec.profile, ExtraArgs: extra}); err != nil {
			if !errors.Is(err, harness.ErrMissing) {
				return err
			}
			say("== node %s: no node plugin (%v)", spec.name, err)
			plugins = false
			continue
		}
		say("== node %s (%s): plugin pid %d, log %s", spec.name, spec.profile, n.Plugin.Pid(), n.Plugin.LogPath)
	}
	if plugins {
		for _, spec := range nodes {
			n := c.Node(spec.name)
			err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
				return n.DriverRegistered(harness.DefaultDriver), nil
			})
			if err != nil {
				return fmt.Errorf("plugin on %s did not register: %w; log:\n%s", spec.name, err, n.Plugin.Log())
			}
		}
		time.Sleep(time.Second)
		demo.ShowSlices(ctx, c, say)
		if tour {
			names := make([]string, len(nodes))
			for i, spec := range nodes {
				names[i] = spec.name
			}
			if _, err := demo.Tour(ctx, c, examples, names, say); err != nil {
				say("tour stopped: %v", err)
			}
		}
	}
	return stayUp(ctx, c, exit)
}

// runHelm starts the control plane and the demo's GPU nodes without a
// driver, then runs the user's commands (demo.RunHelm).
func runHelm(ctx context.Context, dir string, opts demo.HelmOptions, exit bool) error {
	say("== starting the control plane (etcd, kube-apiserver, kube-scheduler, controllers)")
	c, err := harness.Start(ctx, harness.Options{Dir: dir, Logf: func(f string, a ...any) { say("   "+f, a...) }})
	if err != nil {
		return err
	}
	defer c.Stop()
	say("   state in %s (removed on exit unless given with --dir or E2E_KEEP_DIR=1)", c.Dir)
	if _, err := demo.AddHelmNodes(ctx, c, say); err != nil {
		return err
	}
	say("")
	say("== the GPU nodes have no DRA driver yet. What follows is what you would type, in the repository's root:")
	say("$ export KUBECONFIG=%s", c.Kubeconfig)
	if _, err := demo.RunHelm(ctx, c, opts); err != nil {
		if exit {
			return err
		}
		say("demo stopped: %v", err)
	}
	return stayUp(ctx, c, exit)
}

// stayUp prints how to reach the cluster and waits for Ctrl-C, or returns at
// once with exit.
func stayUp(ctx context.Context, c *harness.Cluster, exit bool) error {
	if exit {
		say("== done (--exit): stopping the cluster")
		return nil
	}
	say("")
	say("== cluster is up. In another shell:")
	say("   export KUBECONFIG=%s", c.Kubeconfig)
	if k, err := harness.Tool("kubectl"); err == nil {
		say("   %s get resourceslices,deviceclasses,resourceclaims -A", k)
	} else {
		say("   kubectl get resourceslices,deviceclasses,resourceclaims -A   (no kubectl? `make e2e-kubectl`)")
	}
	say("   control-plane log: %s", filepath.Join(c.Dir, "control-plane.log"))
	say("Ctrl-C stops everything (a second Ctrl-C at once).")
	<-ctx.Done()
	return nil
}
