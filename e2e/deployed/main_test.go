// Package deployed installs the driver as an admin does, with `helm install`
// of the chart, and runs the node plugin as deployed: kube-controller-manager's
// DaemonSet controller creates the chart's DaemonSet pods on real nodes, whose
// kubelet and containerd run them on the driver's image (`make image`'s,
// pushed to the cluster's registry and pinned by digest), in the node's mount namespace where its
// host tree is mounted at the host paths (see harness/realnode_ns.go). One
// control plane for the package; each test adds its own node and removes it.
package deployed

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/gpu-dra/e2e/harness"
)

var cluster *harness.Cluster

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "e2e deployed: "+format+"\n", args...) }
	c, err := harness.Start(ctx, harness.Options{Logf: logf})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e deployed: start control plane:", err)
		return 1
	}
	defer c.Stop()
	cluster = c
	return m.Run()
}
