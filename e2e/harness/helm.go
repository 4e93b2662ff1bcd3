package harness

// The driver gets into a cluster as an admin installs it: `helm install` of
// the chart against the cluster's API server (its admin kubeconfig), `helm
// upgrade` and `helm uninstall` after. kube-controller-manager's DaemonSet
// controller places the plugin's pods on the nodes whose plugin runs
// deployed (DeployedPluginSelector), whose kubelets run them.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// HelmRelease is the release name the harness installs the chart as.
const HelmRelease = "gpu-dra"

// Helm runs the helm binary (.tools/bin, `make e2e-tools`) against the
// cluster and returns its combined output.
func (c *Cluster) Helm(ctx context.Context, args ...string) (string, error) {
	helm, err := Tool("helm")
	if err != nil {
		return "", err
	}
	home := filepath.Join(c.Dir, "helm")
	cmd := exec.CommandContext(ctx, helm, append(args, "--kubeconfig", c.Kubeconfig)...)
	// In the repository's root, as its README's commands are typed: the
	// chart is its folder there (ChartCommand).
	if root, err := RepoRoot(); err == nil {
		cmd.Dir = root
	}
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("helm %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// HelmInstall installs the chart as HelmRelease in DriverNamespace with the
// given `--set` values.
func (c *Cluster) HelmInstall(ctx context.Context, set ...string) error {
	return c.helmChart(ctx, "install", set)
}

// HelmUpgrade upgrades the release to the chart with these values (not
// reusing the last ones, as `helm upgrade` without --reuse-values).
func (c *Cluster) HelmUpgrade(ctx context.Context, set ...string) error {
	return c.helmChart(ctx, "upgrade", set)
}

// HelmUninstall removes the release and what it installed.
func (c *Cluster) HelmUninstall(ctx context.Context) error {
	_, err := c.Helm(ctx, "uninstall", HelmRelease, "--namespace", DriverNamespace, "--wait")
	return err
}

func (c *Cluster) helmChart(ctx context.Context, verb string, set []string) error {
	// The plugin's DaemonSet on the nodes whose plugin runs deployed only
	// (realnode_ns.go), as admins select their GPU nodes; a later --set of
	// the caller wins.
	args, err := c.ChartCommand(ctx, verb, HelmRelease, DriverNamespace, append([]string{DeployedPluginSelector}, set...)...)
	if err != nil {
		return err
	}
	_, err = c.Helm(ctx, args...)
	return err
}

// ChartCommand is the `helm install` or `helm upgrade` (verb) of the chart as
// a user types it in the repository's root, without the kubeconfig (Helm
// adds it): the release, the chart's folder, the namespace (created by
// install), the image this cluster's nodes are served, then each of set as
// a --set.
func (c *Cluster) ChartCommand(ctx context.Context, verb, release, namespace string, set ...string) ([]string, error) {
	if _, err := RepoPath(ChartPath); err != nil {
		return nil, err
	}
	args := []string{verb, release, ChartPath, "-n", namespace}
	if verb == "install" {
		args = append(args, "--create-namespace")
	}
	// The image `make image` built, pushed to the cluster's registry and
	// pinned by digest as a release pins it (imagepods.go): the nodes'
	// containerd pulls the chart's repository from that registry. Without
	// it (not built) the chart names its default tag, which the registry
	// does not have: the deployed plugin's pods fail to pull, and the
	// deployed tests say to run `make image` (DriverImage).
	ref, err := c.DriverImage(ctx)
	switch {
	case err == nil:
		_, digest, _ := strings.Cut(ref, "@")
		args = append(args, "--set", "image.digest="+digest)
	case !errors.Is(err, ErrMissing):
		return nil, err
	}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return args, nil
}
