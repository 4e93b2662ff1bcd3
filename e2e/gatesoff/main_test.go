// Package gatesoff runs the driver on a control plane whose DRA beta features
// are off, as on Kubernetes 1.34 and 1.35 by default: consumable capacity,
// partitionable devices, device binding conditions and device health in pod
// status (device taints are GA and locked on in the pinned release, so their
// fallback is tested only against a fake API server). The control plane runs
// in this process, whose feature gates are global: hence a package of its own.
package gatesoff

import (
	"os"
	"testing"

	"github.com/gpu-dra/e2e/harness"
)

// gatesOff are the DRA beta gates of the pinned release that can be turned
// off, all off.
var gatesOff = map[string]bool{
	"DRAConsumableCapacity":       false,
	"DRAPartitionableDevices":     false,
	"DRADeviceBindingConditions":  false,
	"ResourceHealthStatus":        false,
	"ResourceHealthStatusMessage": false,
}

var (
	cluster *harness.Cluster
	// setupErr says why the driver's binaries are missing (nil: built).
	setupErr error
)

func TestMain(m *testing.M) {
	os.Exit(harness.RunWithFeatureGates(m, "gatesoff", gatesOff, func(c *harness.Cluster, missing error) {
		cluster, setupErr = c, missing
	}))
}
