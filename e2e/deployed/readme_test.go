package deployed

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gpu-dra/e2e/harness"
	"github.com/gpu-dra/e2e/imagebuild"
)

// TestReadmeInstall follows the README's "Install on your cluster" as
// written, on a real node (simulated T4, driver on the host) of this
// cluster: its shell blocks run one after the other in the repository's
// root with kubectl and helm of .tools/bin and the cluster's kubeconfig;
// only the values the README says to set are this cluster's: REGISTRY is
// the cluster's registry (no credentials: an empty DOCKER_CONFIG) and
// IMAGE_PROFILE=debug (the build e2e already has). `make image` and `make
// image-push` run as written (from a clean tree at the same revision, the
// digest must be the one e2e already had: the build is reproducible); the
// node's kubelet pulls the pushed image by the digest the README keeps, and
// the first claim's pod must list the node's GPU. Last the README's removal
// block runs.
func TestReadmeInstall(t *testing.T) {
	ctx := context.Background()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	kubectl, err := harness.Tool("kubectl")
	if err != nil {
		t.Fatalf("%v (run `make e2e-kubectl`)", err)
	}
	helm, err := harness.Tool("helm")
	if err != nil {
		t.Fatal(err)
	}
	// The layout e2e runs (`make image`'s, which the harness pushed): the
	// README's `make image` rebuilds it, from the same sources when the
	// tree is clean and its revision unchanged, so with the same digest.
	layout, err := harness.ImageLayout()
	if err != nil {
		t.Fatal(err)
	}
	digestBefore, revisionBefore := layoutDigest(t, layout)
	n := addNode(t, "readme-t4", harness.LayoutHostDriver, "t4")
	addr, err := cluster.RegistryAddress()
	if err != nil {
		t.Fatal(err)
	}

	blocks := readmeInstallBlocks(t, filepath.Join(root, "README.md"))
	if len(blocks) < 5 {
		t.Fatalf("README's install section has %d shell blocks, want settings, build, install, claim, removal", len(blocks))
	}
	settings := blocks[0]
	for _, set := range []struct{ re, value string }{
		{`(?m)^export REGISTRY=.*$`, "export REGISTRY=" + addr + "/gpu-dra"},
		{`(?m)^export IMAGE_PROFILE=.*$`, "export IMAGE_PROFILE=debug"},
	} {
		re := regexp.MustCompile(set.re)
		if !re.MatchString(settings) {
			t.Fatalf("README's first install block has no line matching %s:\n%s", set.re, settings)
		}
		settings = re.ReplaceAllString(settings, set.value)
	}
	run := func(name, script string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
		cmd.Dir = root
		cmd.Env = append(os.Environ(),
			"KUBECONFIG="+cluster.Kubeconfig,
			"PATH="+filepath.Dir(kubectl)+":"+filepath.Dir(helm)+":"+os.Getenv("PATH"),
			"DOCKER_CONFIG="+t.TempDir(),
			"HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir(),
		)
		start := time.Now()
		out, err := cmd.CombinedOutput()
		t.Logf("README %s (%s):\n%s", name, time.Since(start).Round(time.Second), out)
		if err != nil {
			t.Fatalf("README %s: %v", name, err)
		}
		return string(out)
	}
	removed := false
	t.Cleanup(func() {
		if !removed {
			_, _ = cluster.Helm(context.Background(), "uninstall", "gpu-dra", "--namespace", "gpu-dra", "--wait")
		}
	})
	// Settings, build and push, install, first claim: one shell, as a user
	// types them (the exports carry over).
	out := run("build, push, install, first claim", strings.Join(append([]string{settings}, blocks[1:len(blocks)-1]...), "\n"))

	// make image-push printed the pushed reference; the node's plugin pod
	// runs exactly that, pulled by its digest from the registry.
	pushed := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(addr+"/gpu-dra/gpu-dra-driver@") + `(sha256:[0-9a-f]{64})$`).FindStringSubmatch(out)
	if pushed == nil {
		t.Fatalf("make image-push printed no %s/gpu-dra/gpu-dra-driver@sha256:... line", addr)
	}
	digest := pushed[1]
	if after, revision := layoutDigest(t, layout); digest != after {
		t.Errorf("pushed %s, the layout has %s", digest, after)
	} else if revision == revisionBefore && !strings.HasSuffix(revision, "-dirty") && digest != digestBefore {
		t.Errorf("make image is not reproducible: revision %s gave %s before and %s now", revision, digestBefore, digest)
	}
	pods := n.DaemonPods()
	if len(pods) == 0 {
		t.Fatal("no plugin pod on the node")
	}
	st := pods[0].Pod.Status.ContainerStatuses
	if len(st) == 0 || !strings.HasSuffix(st[0].ImageID, "@"+digest) || pods[0].Pod.Spec.Containers[0].Image != addr+"/gpu-dra/gpu-dra-driver@"+digest {
		t.Errorf("plugin pod runs %s (status %v), want %s/gpu-dra/gpu-dra-driver@%s", pods[0].Pod.Spec.Containers[0].Image, st, addr, digest)
	}
	// The claim's pod listed the node's one GPU.
	if !regexp.MustCompile(`(?m)^GPU 0: .* \(UUID: GPU-[0-9a-f-]+\)$`).MatchString(out) {
		t.Errorf("the first claim's log has no `GPU 0: ... (UUID: GPU-...)` line")
	}
	run("removal", blocks[len(blocks)-1])
	removed = true
}

// layoutDigest is the digest of the OCI layout's index and its source
// revision label.
func layoutDigest(t *testing.T, dir string) (digest, revision string) {
	t.Helper()
	idx, err := imagebuild.LayoutIndex(dir)
	if err != nil {
		t.Fatal(err)
	}
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String(), m.Annotations["org.opencontainers.image.revision"]
}

// readmeInstallBlocks are the ```sh blocks of the README's "Install on your
// cluster" section, in order.
func readmeInstallBlocks(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	start := strings.Index(text, "\n## Install on your cluster\n")
	if start < 0 {
		t.Fatal("README.md has no section \"## Install on your cluster\"")
	}
	section := text[start+1:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	var blocks []string
	for _, m := range regexp.MustCompile("(?s)\n```sh\n(.*?)\n```\n").FindAllStringSubmatch(section, -1) {
		blocks = append(blocks, m[1])
	}
	return blocks
}
