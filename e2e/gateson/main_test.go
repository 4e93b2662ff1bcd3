// Package gateson runs the driver on a control plane with the DRA alpha
// feature its list-type attribute forms need, DRAListTypeAttributes, turned
// on (off by default in every release so far): the API server stores the
// lists, the scheduler allocates by them, and the plugin prepares what it
// published. The control plane runs in this process, whose feature gates are
// global: hence a package of its own.
package gateson

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/gpu-dra/e2e/harness"
)

var (
	cluster *harness.Cluster
	// setupErr says why the driver's binaries are missing (nil: built).
	setupErr error
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "e2e gateson: "+format+"\n", args...) }
	c, err := harness.Start(ctx, harness.Options{Logf: logf, FeatureGates: map[string]bool{"DRAListTypeAttributes": true}})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e gateson: start control plane:", err)
		return 1
	}
	defer c.Stop()
	cluster = c
	if _, err := c.InstallDriver(ctx, harness.InstallOptions{}); err != nil {
		fmt.Fprintln(os.Stderr, "e2e gateson: install driver:", err)
		return 1
	}
	for _, bin := range []string{"gpu-kubelet-plugin", "gpu-sim"} {
		if _, err := harness.Binary(bin); err != nil && setupErr == nil {
			setupErr = err
		}
	}
	code := m.Run()
	for _, n := range c.Nodes() {
		n.Stop()
	}
	return code
}
