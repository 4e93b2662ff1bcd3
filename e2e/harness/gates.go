package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
)

// RunWithFeatureGates is the TestMain of a package whose control plane has
// its own feature gates (Options.FeatureGates: this process's gates are
// global, so such clusters get a package of their own). It starts the
// control plane, installs the driver's cluster objects, hands the cluster
// and why the driver's binaries are missing (nil: built) to set, runs the
// tests and stops every node.
func RunWithFeatureGates(m *testing.M, name string, gates map[string]bool, set func(*Cluster, error)) int {
	ctx := context.Background()
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "e2e "+name+": "+format+"\n", args...) }
	c, err := Start(ctx, Options{Logf: logf, FeatureGates: gates})
	if err != nil {
		logf("start control plane: %v", err)
		return 1
	}
	defer c.Stop()
	if _, err := c.InstallDriver(ctx, InstallOptions{}); err != nil {
		logf("install driver: %v", err)
		return 1
	}
	var missing error
	for _, bin := range []string{"gpu-kubelet-plugin", "gpu-sim"} {
		if _, err := Binary(bin); err != nil && missing == nil {
			missing = err
		}
	}
	set(c, missing)
	code := m.Run()
	for _, n := range c.Nodes() {
		n.Stop()
	}
	return code
}

// AddSimNode adds node name with a simulated host of profile and a boot ID,
// removed when the test ends; before runs on the node before its plugin
// starts with the extra flags. missing is what RunWithFeatureGates handed
// over: the test fails naming it.
func (c *Cluster) AddSimNode(ctx context.Context, t testing.TB, missing error, name, profile string, before func(*Node), args ...string) *Node {
	t.Helper()
	if missing != nil {
		if errors.Is(missing, ErrMissing) {
			t.Fatalf("driver binaries not built: %v", missing)
		}
		t.Fatal(missing)
	}
	n, err := c.AddNode(ctx, NodeOptions{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.RemoveNode(context.Background(), name); err != nil {
			t.Errorf("remove node %s: %v", name, err)
		}
	})
	if err := n.SetupSim(profile); err != nil {
		t.Fatal(err)
	}
	if err := n.WriteBootID(NewBootID()); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(n)
	}
	if _, err := n.StartPlugin(ctx, PluginOptions{Profile: profile, BootIDFile: n.BootIDFile(), ExtraArgs: args}); err != nil {
		t.Fatal(err)
	}
	return n
}
