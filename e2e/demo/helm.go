package demo

// The driver installed as a user installs it: real nodes (kubelet and
// containerd, realnode.go) with simulated GPUs and no DRA driver, then the
// user's commands, each printed as typed and run: `helm install` of the
// chart, the DaemonSet's plugin pods and the webhook's Deployment, a claim
// with a bad GPU config refused by that webhook, example claims, `helm upgrade` with
// a value that changes what the slices publish, `kubectl logs` and `kubectl
// exec` on a plugin pod, `gpu-dra check` and `gpu-dra usage`. Nothing is
// applied behind helm's back: the plugin pods run the driver's image (`make
// image`'s, served to the nodes by the cluster's registry), so `helm
// upgrade` reaches them as on any cluster.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// HelmOptions says how the chart is installed and what the demo runs.
type HelmOptions struct {
	// Release and Namespace of the install (NVIDIA's docs use
	// dra-driver-nvidia-gpu for both).
	Release, Namespace string
	// Examples are the example folders the tour runs (comma-separated);
	// empty: HelmExamples.
	Examples string
	// Say prints the demo's lines.
	Say Say
}

// HelmNode is a GPU node of the demo: a real node with simulated GPUs of
// the profile, DynamicMIG emptied of their MIG instances and offered as
// dynamic MIG (the node's gpu.nvidia.com/dynamic-mig-gpus annotation).
type HelmNode struct {
	Name, Profile string
	DynamicMIG    []int
}

// HelmNodes are the demo's GPU nodes: an A100 node with dynamic MIG on GPUs
// 0-1, static MIG on GPUs 2-3 (the profile's) and whole GPUs 4-7, and a T4
// node.
var HelmNodes = []HelmNode{
	{Name: "gpu-node-a100", Profile: "dgx-a100-40gb", DynamicMIG: []int{0, 1}},
	{Name: "gpu-node-t4", Profile: "t4"},
}

// HelmExamples are the tour's examples by default: a whole GPU, a static
// MIG device, a dynamic MIG device, MPS, time-slicing.
const HelmExamples = "whole-gpu,mig-1g5gb,dynamic-mig,mps,time-slicing-shared"

// helmLayout is where the demo's nodes have their NVIDIA driver: in the GPU
// Operator's driver container (/run/nvidia/driver). A MIG device needs the
// driver's /proc/driver/nvidia capabilities, which with a driver on the
// host the plugin reads from its own procfs: here this machine's kernel,
// which has none.
const helmLayout = harness.LayoutContainerDriver

// PluginSelector selects the chart's node plugin pods.
const PluginSelector = "app.kubernetes.io/component=kubelet-plugin"

// UpgradeValue is the value the demo's `helm upgrade` sets: NVIDIA's
// consumable shares, every whole GPU published with a `shares` capacity of 4.
const UpgradeValue = "consumableShares=4"

// HelmResult is what the demo's steps saw, for the e2e test to check.
type HelmResult struct {
	// Installed and Upgraded are the plugin pods (by node) after the
	// install and after the upgrade.
	Installed, Upgraded map[string]*v1.Pod
	// Runs are the tour's examples, left running.
	Runs []*harness.SpecRun
	// Shares and SharesUpgraded are the `shares` capacities of the T4
	// node's devices before and after the upgrade, as kubectl printed them.
	Shares, SharesUpgraded string
	// Refusal is what `kubectl apply` of InvalidExample printed (it failed).
	Refusal string
	// Logs and Exec are the output of `kubectl logs` and `kubectl exec` on
	// a plugin pod.
	Logs, Exec string
	// Check is `gpu-dra check`'s output, CheckExit its exit status.
	Check     string
	CheckExit int
	// Usage is `gpu-dra usage`'s output.
	Usage string
}

// AddHelmNodes adds the demo's GPU nodes: real nodes, their simulated GPUs
// set up, no DRA driver yet.
func AddHelmNodes(ctx context.Context, c *harness.Cluster, say Say) ([]*harness.Node, error) {
	var nodes []*harness.Node
	for _, spec := range HelmNodes {
		n, err := c.AddNode(ctx, harness.NodeOptions{Name: spec.Name, Layout: helmLayout})
		if err != nil {
			return nodes, err
		}
		nodes = append(nodes, n)
		if err := EmptyGPUs(n, spec.Profile, spec.DynamicMIG); err != nil {
			return nodes, err
		}
		say("== node %s: kubelet and containerd, simulated %s GPUs, driver at %s", spec.Name, spec.Profile, harness.ContainerDriverRoot)
	}
	return nodes, nil
}

// RunHelm runs the user's commands against the nodes of AddHelmNodes. An
// error is a step that did not do what it says; the result holds what the
// steps before it saw.
func RunHelm(ctx context.Context, c *harness.Cluster, opts HelmOptions) (*HelmResult, error) {
	sh := shell{c: c, say: opts.Say}
	res := &HelmResult{}
	say := opts.Say
	nodes := make([]string, 0, len(HelmNodes))
	for _, spec := range HelmNodes {
		nodes = append(nodes, spec.Name)
	}
	examples := opts.Examples
	if examples == "" {
		examples = HelmExamples
	}

	for _, spec := range HelmNodes {
		if len(spec.DynamicMIG) > 0 {
			gpus := harness.JoinInts(spec.DynamicMIG, ",")
			say("")
			say("== GPUs %s of %s as dynamic MIG (nvidia-smi emptied them of their MIG instances)", gpus, spec.Name)
			if _, err := sh.kubectl(ctx, "annotate", "node", spec.Name, "gpu.nvidia.com/dynamic-mig-gpus="+gpus); err != nil {
				return res, err
			}
		}
	}

	say("")
	say("== install the driver")
	// With the chart's webhook: the API server calls it at its pods'
	// addresses (e2e/README.md).
	install, err := c.ChartCommand(ctx, "install", opts.Release, opts.Namespace, helmLayout.HelmValues()...)
	if err != nil {
		return res, err
	}
	if _, err := sh.helm(ctx, install...); err != nil {
		return res, err
	}
	if res.Installed, err = waitPlugins(ctx, c, opts.Namespace, nodes, nil); err != nil {
		return res, err
	}
	// Until a webhook replica is ready, claims are admitted unreviewed (the
	// chart's failurePolicy Ignore).
	if _, err := sh.kubectl(ctx, "wait", "deployment", "-n", opts.Namespace, "-l", "app.kubernetes.io/component=webhook",
		"--for=condition=Available", "--timeout=3m"); err != nil {
		return res, err
	}
	if _, err := sh.kubectl(ctx, "get", "pods", "-n", opts.Namespace, "-o", "wide"); err != nil {
		return res, err
	}
	if _, err := sh.kubectl(ctx, "get", "resourceslices"); err != nil {
		return res, err
	}

	say("")
	say("== a claim with a bad GPU config: the webhook refuses it at create, naming the field")
	ns, err := namespaceOf(InvalidExample)
	if err != nil {
		return res, err
	}
	if _, err := sh.kubectl(ctx, "create", "namespace", ns); err != nil {
		return res, err
	}
	apply := []string{"apply", "-f", InvalidExample}
	res.Refusal, err = sh.kubectl(ctx, apply...)
	if err == nil {
		return res, fmt.Errorf("kubectl %s: admitted, want refused by the webhook", quote(apply))
	}
	if _, err := sh.kubectl(ctx, "delete", "namespace", ns, "--wait=false"); err != nil {
		return res, err
	}

	say("")
	say("== a tour through examples/")
	runs, err := Tour(ctx, c, examples, nodes, say)
	res.Runs = runs
	if err != nil {
		return res, err
	}

	say("")
	say("== helm upgrade with a new value: every whole GPU shared by 4 claims (NVIDIA's consumableShares)")
	// The T4 node's devices: their `shares` capacity, none before.
	shares := []string{"get", "resourceslices", "--field-selector", "spec.nodeName=" + HelmNodes[1].Name,
		"-o", `jsonpath={range .items[*].spec.devices[*]}{.name}{" shares="}{.capacity.shares.value}{"\n"}{end}`}
	if res.Shares, err = sh.kubectl(ctx, shares...); err != nil {
		return res, err
	}
	upgrade := []string{"upgrade", opts.Release, harness.ChartPath, "-n", opts.Namespace, "--reuse-values", "--set", UpgradeValue}
	if _, err := sh.helm(ctx, upgrade...); err != nil {
		return res, err
	}
	if res.Upgraded, err = waitPlugins(ctx, c, opts.Namespace, nodes, res.Installed); err != nil {
		return res, err
	}
	// The new plugin republishes; the slices' generation moves on.
	err = wait.PollUntilContextTimeout(ctx, time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		out, err := sh.quiet(ctx, shares...)
		return err == nil && strings.Contains(out, "shares=4"), nil
	})
	if err != nil {
		return res, fmt.Errorf("the slices of %s publish no shares=4 after the upgrade: %w", HelmNodes[1].Name, err)
	}
	if res.SharesUpgraded, err = sh.kubectl(ctx, shares...); err != nil {
		return res, err
	}

	say("")
	say("== the plugin pod of %s: its log and a command in it", HelmNodes[1].Name)
	plugin := res.Upgraded[HelmNodes[1].Name]
	if res.Logs, err = sh.kubectl(ctx, "logs", "-n", opts.Namespace, plugin.Name, "--tail=5"); err != nil {
		return res, err
	}
	if res.Exec, err = sh.kubectl(ctx, "exec", "-n", opts.Namespace, plugin.Name, "--", "gpu-kubelet-plugin", "--version"); err != nil {
		return res, err
	}

	say("")
	say("== is the driver healthy? (gpu-dra check)")
	// A plugin pod's readiness can trail its registration by a probe period.
	err = wait.PollUntilContextTimeout(ctx, 2*time.Second, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		var runErr error
		res.Check, res.CheckExit, runErr = sh.gpuDra(ctx, "check", "-n", opts.Namespace)
		return runErr == nil && res.CheckExit == 0, runErr
	})
	sh.print(res.Check, []string{"check", "-n", opts.Namespace})
	if err != nil {
		return res, fmt.Errorf("gpu-dra check: exit %d: %w", res.CheckExit, err)
	}

	say("")
	say("== who holds what, and what they use (gpu-dra usage: the plugins' metrics through the API server's pod proxy)")
	// The plugins sample every 15 s (kubeletPlugin.usage.intervalSeconds):
	// until then a claim has no figures.
	err = wait.PollUntilContextTimeout(ctx, 2*time.Second, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		var runErr error
		res.Usage, _, runErr = sh.gpuDra(ctx, "usage")
		return runErr == nil && UsageHasColumns(res.Usage), runErr
	})
	sh.print(res.Usage, []string{"usage"})
	if err != nil {
		return res, fmt.Errorf("gpu-dra usage shows no usage columns: %w", err)
	}
	return res, nil
}

// InvalidExample is the claim the demo shows refused (a path in the
// repository, as the user types it from its root).
const InvalidExample = "examples/invalid/mps-zero-percent.yaml"

// namespaceOf is the namespace of the first object of a YAML file in the
// repository.
func namespaceOf(rel string) (string, error) {
	path, err := harness.RepoPath(rel)
	if err != nil {
		return "", err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	objs, err := harness.ParseYAML(data)
	if err != nil {
		return "", fmt.Errorf("%s: %w", rel, err)
	}
	if len(objs) == 0 || objs[0].GetNamespace() == "" {
		return "", fmt.Errorf("%s: its first object names no namespace", rel)
	}
	return objs[0].GetNamespace(), nil
}

// UsageHasColumns says whether `gpu-dra usage`'s text has its usage columns
// and read every plugin's metrics.
func UsageHasColumns(out string) bool {
	return strings.Contains(out, "ALLOCATED") && strings.Contains(out, "USED") && !strings.Contains(out, "metrics not read")
}

// waitPlugins waits until every node runs a Running, ready plugin pod of
// the release other than those in not (by node) and the plugin registered
// with the node's kubelet and published its slices; old pods (in not) gone.
func waitPlugins(ctx context.Context, c *harness.Cluster, ns string, nodes []string, not map[string]*v1.Pod) (map[string]*v1.Pod, error) {
	var got map[string]*v1.Pod
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: PluginSelector})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		got = map[string]*v1.Pod{}
		for i := range pods.Items {
			p := &pods.Items[i]
			if old := not[p.Spec.NodeName]; old != nil && old.UID == p.UID {
				last = fmt.Sprintf("old plugin pod %s still there", p.Name)
				return false, nil
			}
			if p.DeletionTimestamp == nil && p.Status.Phase == v1.PodRunning && ready(p) {
				got[p.Spec.NodeName] = p
			}
		}
		for _, name := range nodes {
			if got[name] == nil {
				last = "no ready plugin pod on " + name
				return false, nil
			}
			if !c.Node(name).DriverRegistered(harness.DefaultDriver) {
				last = "the plugin on " + name + " is not registered with the kubelet"
				return false, nil
			}
			slices, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
			if err != nil || len(slices.Items) == 0 {
				last = "no ResourceSlices of " + name
				return false, nil
			}
		}
		return true, nil
	})
	if err == nil {
		return got, nil
	}
	msg := []string{last}
	for _, name := range nodes {
		n := c.Node(name)
		for _, d := range n.DaemonPods() {
			if d.Pod.Namespace == ns {
				msg = append(msg, fmt.Sprintf("%s on %s: %v; log:\n%s", d.Pod.Name, name, n.DaemonPodError(ns+"/"+d.DaemonSet), d.Log()))
			}
		}
	}
	return nil, fmt.Errorf("plugin pods of %s: %w: %s", ns, err, strings.Join(msg, "\n"))
}

func ready(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodReady {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}

// shell runs the user's commands against the cluster, each printed as
// typed (KUBECONFIG exported) with its output.
type shell struct {
	c   *harness.Cluster
	say Say
}

// helm runs helm.
func (s shell) helm(ctx context.Context, args ...string) (string, error) {
	s.say("$ helm %s", quote(args))
	out, err := s.c.Helm(ctx, args...)
	s.output(out)
	return out, err
}

// kubectl runs kubectl (`make e2e-kubectl`) and fails on a non-zero exit.
func (s shell) kubectl(ctx context.Context, args ...string) (string, error) {
	s.say("$ kubectl %s", quote(args))
	out, err := s.quiet(ctx, args...)
	s.output(out)
	return out, err
}

// quiet runs kubectl without printing.
func (s shell) quiet(ctx context.Context, args ...string) (string, error) {
	kubectl, err := harness.Tool("kubectl")
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, kubectl, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.c.Kubeconfig)
	// In the repository's root, as the commands are typed (the files they
	// name are its).
	if root, err := harness.RepoRoot(); err == nil {
		cmd.Dir = root
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %v: %s", quote(args), err, out)
	}
	return string(out), nil
}

// gpuDra runs the gpu-dra CLI (target/debug/gpu-dra; `kubectl gpu-dra` once
// installed as the kubectl plugin) without printing (print shows the run
// kept): its output and exit status; an error only when it could not run.
func (s shell) gpuDra(ctx context.Context, args ...string) (string, int, error) {
	bin, err := harness.Binary("gpu-dra")
	if err != nil {
		return "", 0, err
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.c.Kubeconfig)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	code := 0
	if errors.As(err, &exit) {
		code, err = exit.ExitCode(), nil
	}
	return string(out), code, err
}

// print shows a gpu-dra command and its output.
func (s shell) print(out string, args []string) {
	s.say("$ gpu-dra %s", quote(args))
	s.output(out)
}

func (s shell) output(out string) {
	for _, l := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		if l != "" {
			s.say("  %s", l)
		}
	}
}

// quote joins args as a shell line, single-quoting those a shell would split
// or expand.
func quote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\n\"'{}[]*$\\|&;<>()!?~`#") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		q[i] = a
	}
	return strings.Join(q, " ")
}
