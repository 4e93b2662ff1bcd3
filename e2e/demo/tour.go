// Package demo holds the steps of `make demo` and `make demo-helm`
// (cmd/demo) that the e2e suites run too: the tour through a few examples,
// and the chart installed as a user installs it (helm.go).
package demo

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// Say prints one line of the demo (a format and its arguments).
type Say func(format string, args ...any)

// EmptyGPUs sets up the node's simulated host and destroys the MIG
// instances of gpus with the host's nvidia-smi, as an admin does before
// handing GPUs to dynamic MIG.
func EmptyGPUs(n *harness.Node, profile string, gpus []int) error {
	if err := n.SetupSim(profile); err != nil {
		return err
	}
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	for _, gpu := range gpus {
		for _, op := range []string{"-dci", "-dgi"} {
			if out, err := exec.Command(smi, "mig", "-i", fmt.Sprint(gpu), op).CombinedOutput(); err != nil {
				return fmt.Errorf("nvidia-smi mig -i %d %s: %v: %s", gpu, op, err, out)
			}
		}
	}
	return nil
}

// ShowSlices lists every ResourceSlice: its node, pool, generation and
// devices.
func ShowSlices(ctx context.Context, c *harness.Cluster, say Say) {
	list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		say("list slices: %v", err)
		return
	}
	say("== ResourceSlices published")
	for _, s := range list.Items {
		node := ""
		if s.Spec.NodeName != nil {
			node = *s.Spec.NodeName
		}
		var names []string
		for _, d := range s.Spec.Devices {
			names = append(names, d.Name)
		}
		say("   %s  node=%s pool=%s gen=%d devices=%d %s", s.Name, node, s.Spec.Pool.Name, s.Spec.Pool.Generation, len(names), abbreviate(names, 6))
	}
}

func abbreviate(items []string, n int) string {
	if len(items) <= n {
		return strings.Join(items, " ")
	}
	return strings.Join(items[:n], " ") + fmt.Sprintf(" ... (+%d)", len(items)-n)
}

// PickExamples takes the requested folders, or one of each kind the tour
// wants to show: a whole GPU, MIG, MPS, time-slicing.
func PickExamples(root, requested string) []string {
	if requested != "" {
		return strings.Split(requested, ",")
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil
	}
	var all []string
	for _, e := range entries {
		if e.IsDir() && e.Name() != "invalid" {
			all = append(all, e.Name())
		}
	}
	sort.Strings(all)
	var picked []string
	for _, want := range []string{"whole", "mig", "mps", "time"} {
		for _, name := range all {
			if strings.Contains(strings.ToLower(name), want) && !contains(picked, name) {
				picked = append(picked, name)
				break
			}
		}
	}
	if len(picked) == 0 && len(all) > 0 {
		picked = all[:min(3, len(all))]
	}
	return picked
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Tour applies each example folder (requested, comma-separated, or
// PickExamples's), waits for its pods, and shows for each pod its claims'
// devices, their CDI specs and what its containers see; the MPS daemons of
// nodes after each. The pods are left running for kubectl: the runs
// returned are for the caller to tear down.
func Tour(ctx context.Context, c *harness.Cluster, requested string, nodes []string, say Say) ([]*harness.SpecRun, error) {
	root, err := harness.RepoPath("examples")
	if err != nil {
		say("== tour skipped: %v", err)
		return nil, nil
	}
	var runs []*harness.SpecRun
	for _, name := range PickExamples(root, requested) {
		say("")
		say("== example %s", name)
		if readme, err := os.ReadFile(filepath.Join(root, name, "README.md")); err == nil {
			say("   %s", strings.SplitN(strings.TrimSpace(string(readme)), "\n", 2)[0])
		}
		files, err := harness.SpecFiles(filepath.Join(root, name))
		if err != nil {
			say("   %v", err)
			continue
		}
		for _, f := range files {
			for _, o := range f.Objects {
				say("   apply %s %s (%s)", o.GetKind(), o.GetName(), filepath.Base(f.Path))
			}
		}
		// Applied as written (workloads get their pods from the controller
		// manager), waited for, and each claiming container's nvidia-smi -L
		// checked against its allocation; left running for kubectl.
		start := time.Now()
		grace := int64(1)
		run, err := c.RunSpec(ctx, files, harness.SpecOptions{
			NamespacePrefix: "demo-" + name, Timeout: 2 * time.Minute, DeleteGracePeriod: &grace,
		})
		if err != nil {
			say("   %v", err)
		}
		if run == nil {
			continue
		}
		runs = append(runs, run)
		for _, p := range run.Problems {
			say("   problem: %s", p)
		}
		for _, pod := range run.Pods {
			say("   pod %s/%s %s on %s (%s after apply)", pod.Namespace, pod.Name, pod.Status.Phase, pod.Spec.NodeName, time.Since(start).Round(time.Millisecond))
			ns := pod.Namespace
			for _, st := range pod.Status.ResourceClaimStatuses {
				if st.ResourceClaimName == nil {
					continue
				}
				claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *st.ResourceClaimName, metav1.GetOptions{})
				if err != nil {
					say("     claim %s: %v", *st.ResourceClaimName, err)
					continue
				}
				if claim.Status.Allocation == nil {
					say("     claim %s: not allocated", claim.Name)
					continue
				}
				for _, r := range claim.Status.Allocation.Devices.Results {
					say("     claim %s: request %s -> %s/%s", claim.Name, r.Request, r.Pool, r.Device)
				}
			}
			node := c.Node(pod.Spec.NodeName)
			ids, err := node.CDIDevices(ctx, pod)
			if err != nil {
				say("     CDI devices: %v", err)
			}
			for ctr, list := range ids {
				for _, id := range list {
					say("     container %s: CDI %s", ctr, id)
					r, err := harness.ResolveCDI(node.CDIRoot, id)
					if err != nil {
						say("       %v", err)
						continue
					}
					var nodes []string
					for _, dn := range r.DeviceNodes() {
						nodes = append(nodes, dn.Path)
					}
					say("       spec %s", r.Spec.Path)
					say("       device nodes: %s", strings.Join(nodes, " "))
					if env := r.Env(); len(env) > 0 {
						say("       env: %s", strings.Join(env, " "))
					}
				}
				if len(list) > 0 {
					// What the container itself sees, from inside.
					res, err := node.Exec(ctx, pod, ctr, "nvidia-smi", "-L")
					if err != nil {
						say("       nvidia-smi -L in the container: %v", err)
						continue
					}
					say("       nvidia-smi -L in the container (exit %d):", res.ExitCode)
					for _, line := range strings.Split(strings.TrimRight(res.Stdout+res.Stderr, "\n"), "\n") {
						say("         %s", line)
					}
					// An MPS client: the limits its CUDA program runs with, seen from
					// inside through the pipe directory.
					if mps := mpsClient(node, list); mps {
						res, err := node.Exec(ctx, pod, ctr, "cuda-app")
						if err != nil {
							say("       cuda-app in the container: %v", err)
							continue
						}
						say("       cuda-app (a CUDA program) in the container (exit %d):", res.ExitCode)
						for _, line := range strings.Split(strings.TrimRight(res.Stdout+res.Stderr, "\n"), "\n") {
							say("         %s", line)
						}
					}
				}
			}
		}
		for _, n := range nodes {
			for _, d := range c.Node(n).MPSDaemons() {
				say("   MPS control daemon on %s: pid %d, CUDA_VISIBLE_DEVICES=%s", n, d.Pid, d.Env["CUDA_VISIBLE_DEVICES"])
				pipe := d.Env["CUDA_MPS_PIPE_DIRECTORY"]
				say("     pipe %s: active thread percentage %s", pipe, mpsQuery(d.Args[0], pipe, "get_default_active_thread_percentage"))
			}
		}
	}
	return runs, nil
}

// mpsClient says whether the CDI devices give the container an MPS pipe
// directory.
func mpsClient(node *harness.Node, ids []string) bool {
	for _, id := range ids {
		r, err := harness.ResolveCDI(node.CDIRoot, id)
		if err != nil {
			continue
		}
		for _, e := range r.Env() {
			if strings.HasPrefix(e, "CUDA_MPS_PIPE_DIRECTORY=") {
				return true
			}
		}
	}
	return false
}

func mpsQuery(bin, pipe, command string) string {
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "CUDA_MPS_PIPE_DIRECTORY="+pipe)
	cmd.Stdin = strings.NewReader(command + "\n")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Sprintf("(%v: %s)", err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out))
}
