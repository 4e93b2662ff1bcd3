// Package tests is the end-to-end suite: one in-process control plane for
// the whole run, an A100 (MIG) node and a T4 node, each with our node plugin
// on the simulator, the driver's cluster objects from the Helm chart and the
// webhook. Each test works in its own namespace.
//
// A test needing a part of the product that is not built or not in the
// repository yet skips, naming what is missing; anything else that goes
// wrong fails.
package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// The simulated nodes of the suite.
const (
	nodeA100 = "node-a100"
	nodeT4   = "node-t4"
)

var nodeProfiles = map[string]string{nodeA100: "dgx-a100-40gb", nodeT4: "t4"}

var (
	cluster *harness.Cluster
	driver  *harness.Driver
	// pluginErr says why our node plugins are not running (nil: they are).
	pluginErr error
	// slicesErr says why the plugins' slices are missing (nil: published).
	slicesErr error
	// webhookErr says why the webhook is not running (nil: it is).
	webhookErr error
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "e2e: "+format+"\n", args...) }
	c, err := harness.Start(ctx, harness.Options{Logf: logf})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: start control plane:", err)
		return 1
	}
	defer c.Stop()
	cluster = c

	_, webhookErr = harness.Binary("gpu-dra-webhook")
	driver, err = c.InstallDriver(ctx, harness.InstallOptions{Webhook: webhookErr == nil})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: install driver:", err)
		return 1
	}
	for _, note := range driver.Notes {
		logf("%s", note)
	}

	_, pluginErr = harness.Binary("gpu-kubelet-plugin")
	if pluginErr == nil {
		_, pluginErr = harness.Binary("gpu-sim")
	}
	for _, name := range []string{nodeA100, nodeT4} {
		n, err := c.AddNode(ctx, harness.NodeOptions{Name: name})
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e: add node:", err)
			return 1
		}
		if pluginErr != nil {
			continue
		}
		if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: nodeProfiles[name]}); err != nil {
			pluginErr = fmt.Errorf("start plugin on %s: %w", name, err)
		}
	}
	if pluginErr == nil {
		pluginErr = waitPluginsReady(ctx, c)
	}
	if pluginErr != nil {
		logf("node plugins not running: %v", pluginErr)
	}
	if slicesErr != nil {
		logf("%v", slicesErr)
	}
	code := m.Run()
	if err := checkContainersCleanedUp(c); err != nil {
		logf("%v", err)
		code = 1
	}
	return code
}

// checkContainersCleanedUp stops every node and fails the run if runc still
// keeps a container of it or a container process is left (on a real node
// also its kubelet, containerd, shims, mounts, cgroups or bridge).
func checkContainersCleanedUp(c *harness.Cluster) error {
	var left []string
	for _, n := range c.Nodes() {
		n.Stop()
		ids, err := n.RuncList()
		if err != nil {
			return fmt.Errorf("runc list on %s: %w", n.Name, err)
		}
		left = append(left, ids...)
		for _, pid := range harness.ContainerProcesses(n.Dir) {
			left = append(left, fmt.Sprintf("process %d", pid))
		}
		left = append(left, n.RealNodeLeftovers()...)
	}
	if len(left) > 0 {
		return fmt.Errorf("containers left after the nodes stopped: %v", left)
	}
	return nil
}

// waitPluginsReady waits until every node's plugin registered through the
// kubelet's plugin watcher (error returned) and published slices (slicesErr).
func waitPluginsReady(ctx context.Context, c *harness.Cluster) error {
	for _, name := range []string{nodeA100, nodeT4} {
		n := c.Node(name)
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			if !n.Plugin.Running() {
				return false, fmt.Errorf("plugin exited")
			}
			return n.DriverRegistered(harness.DefaultDriver), nil
		})
		if err != nil {
			return fmt.Errorf("plugin on %s not registered with the kubelet: %w; plugin log:\n%s", name, err, n.Plugin.Log())
		}
	}
	for _, name := range []string{nodeA100, nodeT4} {
		n := c.Node(name)
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			slices, err := nodeSlices(ctx, name)
			return err == nil && len(slices) > 0, nil
		})
		if err != nil {
			slicesErr = fmt.Errorf("plugin on %s registered but published no ResourceSlices: %w; plugin log:\n%s", name, err, n.Plugin.Log())
			return nil
		}
	}
	return nil
}

// requireRegistered skips while the plugin binaries are not built and fails
// if they are but did not register with the kubelet.
func requireRegistered(t *testing.T) {
	t.Helper()
	if pluginErr == nil {
		return
	}
	if errors.Is(pluginErr, harness.ErrMissing) {
		t.Fatalf("node plugin not running: %v", pluginErr)
	}
	t.Fatal(pluginErr)
}

// requirePlugins is requireRegistered plus the plugins' own ResourceSlices.
func requirePlugins(t *testing.T) {
	t.Helper()
	requireRegistered(t)
	if slicesErr != nil {
		t.Fatal(slicesErr)
	}
}

// requireWebhook skips while the webhook binary is not built.
func requireWebhook(t *testing.T) {
	t.Helper()
	if webhookErr != nil {
		t.Fatalf("webhook not running: %v", webhookErr)
	}
}

// requireChart skips while the Helm chart (or helm) is absent.
func requireChart(t *testing.T) {
	t.Helper()
	if !driver.FromChart {
		t.Fatalf("Helm chart not rendered (`make e2e-tools` builds helm): %v", driver.Notes)
	}
}
