package tests

import (
	"testing"

	"k8s.io/apimachinery/pkg/util/version"

	"github.com/gpu-dra/e2e/harness"
)

// The apiserver reports the Kubernetes release it is built from (go.mod's
// pin), in a form kubectl and client libraries parse.
func TestServerVersion(t *testing.T) {
	want := harness.ModuleKubernetesVersion()
	if want == "" {
		t.Fatal("no k8s.io/kubernetes version in the build info nor in e2e/go.mod")
	}
	if harness.KubernetesVersion != want {
		t.Errorf("harness.KubernetesVersion %q (helm's --kube-version, the nodes' kubelet version) differs from go.mod's %q", harness.KubernetesVersion, want)
	}
	info, err := cluster.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if info.GitVersion != want {
		t.Errorf("server version %q, want %q", info.GitVersion, want)
	}
	v, err := version.ParseSemantic(info.GitVersion)
	if err != nil {
		t.Fatalf("server version %q does not parse: %v", info.GitVersion, err)
	}
	if info.Major != "1" || info.Minor != version.Itoa(v.Minor()) {
		t.Errorf("server version major %q minor %q do not match %s", info.Major, info.Minor, info.GitVersion)
	}
	t.Logf("server version %s (%s/%s)", info.GitVersion, info.Major, info.Minor)
}
