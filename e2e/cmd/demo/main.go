// Command demo starts a local cluster (in-process control plane, an A100
// node with MIG and a T4 node, our node plugin and webhook on the
// simulator), takes a short tour through a few examples, and stays up for
// kubectl until interrupted.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

func main() {
	dir := flag.String("dir", "", "state directory (default: a new temporary directory)")
	examples := flag.String("examples", "", "comma-separated example folders for the tour (default: a few picked from examples/)")
	tour := flag.Bool("tour", true, "apply a few examples and show what happened")
	flag.Parse()
	// The first Ctrl-C stops the cluster gracefully, a second one at once
	// (the cluster's reaper then removes what is left).
	ctx, stop := harness.InterruptContext(context.Background(), say)
	defer stop()
	if err := run(ctx, *dir, *examples, *tour); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

func run(ctx context.Context, dir, examples string, tour bool) error {
	say("== starting the control plane (etcd, kube-apiserver, kube-scheduler, controllers)")
	c, err := harness.Start(ctx, harness.Options{Dir: dir, Logf: func(f string, a ...any) { say("   "+f, a...) }})
	if err != nil {
		return err
	}
	defer c.Stop()
	dir = c.Dir
	say("   state in %s (removed on exit unless given with --dir or E2E_KEEP_DIR=1)", dir)

	_, webhookErr := harness.Binary("gpu-dra-webhook")
	drv, err := c.InstallDriver(ctx, harness.InstallOptions{Webhook: webhookErr == nil})
	if err != nil {
		return err
	}
	say("== driver objects applied (%d, from the Helm chart: %v)", len(drv.Objects), drv.FromChart)
	for _, o := range drv.Objects {
		say("   %s %s", o.GetKind(), o.GetName())
	}
	if webhookErr != nil {
		say("   webhook not started: %v", webhookErr)
	} else {
		say("   webhook at %s (log %s)", drv.Webhook.URL, drv.Webhook.LogPath)
	}
	for _, n := range drv.Notes {
		say("   note: %s", n)
	}

	// The A100 node: static MIG instances on GPUs 2 and 3 (the profile's),
	// GPUs 0 and 1 emptied and offered as dynamic MIG (as an admin sets it
	// up), whole GPUs 4-7; so every example of the tour finds its devices.
	nodes := []struct {
		name, profile string
		dynamicMIG    []int
	}{{"gpu-node-a100", "dgx-a100-40gb", []int{0, 1}}, {"gpu-node-t4", "t4", nil}}
	plugins := true
	for _, spec := range nodes {
		n, err := c.AddNode(ctx, harness.NodeOptions{Name: spec.name})
		if err != nil {
			return err
		}
		var extra []string
		if len(spec.dynamicMIG) > 0 {
			if err := emptyGPUs(n, spec.profile, spec.dynamicMIG); err != nil {
				return err
			}
			var ids []string
			for _, g := range spec.dynamicMIG {
				ids = append(ids, fmt.Sprint(g))
			}
			extra = []string{"--dynamic-mig-gpus=" + strings.Join(ids, ",")}
		}
		if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: spec.profile, ExtraArgs: extra}); err != nil {
			if !errors.Is(err, harness.ErrMissing) {
				return err
			}
			say("== node %s: no node plugin (%v)", spec.name, err)
			plugins = false
			continue
		}
		say("== node %s (%s): plugin pid %d, log %s", spec.name, spec.profile, n.Plugin.Pid(), n.Plugin.LogPath)
	}
	if plugins {
		for _, spec := range nodes {
			n := c.Node(spec.name)
			err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
				return n.DriverRegistered(harness.DefaultDriver), nil
			})
			if err != nil {
				return fmt.Errorf("plugin on %s did not register: %w; log:\n%s", spec.name, err, n.Plugin.Log())
			}
		}
		time.Sleep(time.Second)
		showSlices(ctx, c)
		if tour {
			if err := runTour(ctx, c, examples); err != nil {
				say("tour stopped: %v", err)
			}
		}
	}

	say("")
	say("== cluster is up. In another shell:")
	say("   export KUBECONFIG=%s", c.Kubeconfig)
	if k, err := harness.Tool("kubectl"); err == nil {
		say("   %s get resourceslices,deviceclasses,resourceclaims -A", k)
	} else {
		say("   kubectl get resourceslices,deviceclasses,resourceclaims -A   (no kubectl? `make e2e-kubectl`)")
	}
	say("   control-plane log: %s", filepath.Join(dir, "control-plane.log"))
	say("Ctrl-C stops everything (a second Ctrl-C at once).")
	<-ctx.Done()
	return nil
}

// emptyGPUs sets up the node's simulated host and destroys the MIG
// instances of gpus with the host's nvidia-smi, as an admin does before
// handing GPUs to dynamic MIG.
func emptyGPUs(n *harness.Node, profile string, gpus []int) error {
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

func showSlices(ctx context.Context, c *harness.Cluster) {
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

// pickExamples takes the requested folders, or one of each kind the tour
// wants to show: a whole GPU, MIG, MPS, time-slicing.
func pickExamples(root, requested string) []string {
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

func runTour(ctx context.Context, c *harness.Cluster, requested string) error {
	root, err := harness.RepoPath("examples")
	if err != nil {
		say("== tour skipped: %v", err)
		return nil
	}
	for _, name := range pickExamples(root, requested) {
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
		for _, n := range []string{"gpu-node-a100", "gpu-node-t4"} {
			for _, d := range c.Node(n).MPSDaemons() {
				say("   MPS control daemon on %s: pid %d, CUDA_VISIBLE_DEVICES=%s", n, d.Pid, d.Env["CUDA_VISIBLE_DEVICES"])
				pipe := d.Env["CUDA_MPS_PIPE_DIRECTORY"]
				say("     pipe %s: active thread percentage %s", pipe, mpsQuery(d.Args[0], pipe, "get_default_active_thread_percentage"))
			}
		}
	}
	return nil
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
