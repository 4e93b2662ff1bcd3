// Package gateson runs the driver on a control plane with the DRA alpha
// feature its list-type attribute forms need, DRAListTypeAttributes, turned
// on (off by default in every release so far): the API server stores the
// lists, the scheduler allocates by them, and the plugin prepares what it
// published. The control plane runs in this process, whose feature gates are
// global: hence a package of its own.
package gateson

import (
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
	os.Exit(harness.RunWithFeatureGates(m, "gateson", map[string]bool{"DRAListTypeAttributes": true}, func(c *harness.Cluster, missing error) {
		cluster, setupErr = c, missing
	}))
}
