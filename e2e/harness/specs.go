package harness

// Other people's specs run as written: the runner behind `make e2e-specs`
// (e2e/tests/specs_test.go) and the examples test. A spec unit (one YAML
// file of a folder, or the files of one example folder) is applied as it is
// written: objects that name a namespace go there (the namespace is created
// when the unit does not define it, and deleted after), the others go to a
// fresh namespace. Any kind goes (Namespaces, DeviceClasses,
// ResourceClaimTemplates, ResourceClaims, Pods, Deployments, Jobs, ...):
// kube-controller-manager's controllers make the pods of workloads, as on a
// cluster.
//
// Only what holds for any spec is checked, so that a spec nobody here wrote
// needs no test-side edits:
//   - every pod of the unit's namespaces reaches Running or Succeeded, and
//     every workload has the pods it asks for;
//   - each container that claims devices sees exactly them: `nvidia-smi -L`
//     run in it through the API server's pods/exec (as `kubectl exec`) lists
//     the GPUs and MIG devices its claims were allocated (only the requests
//     it names), each resolved through our ResourceSlices to its UUID; a
//     dynamic MIG device, whose UUID exists only once prepare made it, is
//     matched by its parent GPU's UUID and its profile;
//   - after everything is deleted, every claim the pods used is gone from
//     the API (released) and no CDI claim spec file of it is left on its
//     node.
// A problem names the file, the object, the container and what was seen
// against what was expected.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
)

// SpecFile is one YAML file of a spec folder with its objects, in file order.
type SpecFile struct {
	Path    string
	Objects []*unstructured.Unstructured
}

// SpecFiles reads every *.yaml and *.yml file directly in dir (sorted by
// name; subfolders are not entered: they are other folders).
func SpecFiles(dir string) ([]SpecFile, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("spec folder: %w", err)
	}
	var out []SpecFile
	for _, e := range entries {
		ext := filepath.Ext(e.Name())
		if e.IsDir() || (ext != ".yaml" && ext != ".yml") {
			continue
		}
		path := filepath.Join(dir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		objs, err := ParseYAML(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, SpecFile{Path: path, Objects: objs})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	if len(out) == 0 {
		return nil, fmt.Errorf("spec folder %s has no .yaml or .yml file", dir)
	}
	return out, nil
}

// SpecOptions tune a spec run.
type SpecOptions struct {
	// NamespacePrefix names the fresh namespace of objects that name none.
	NamespacePrefix string
	// Timeout for the pods to run and for deletion (default 3 minutes).
	Timeout time.Duration
	// Logf reports progress (optional).
	Logf func(format string, args ...any)
	// DeleteGracePeriod, when set, shortens the pods' termination grace
	// period at deletion, as `kubectl delete --grace-period=<n>` does (for
	// specs whose containers ignore SIGTERM: busybox sleep as PID 1 has no
	// handler, and the kubelet waits the pod's whole grace period, 30 s by
	// default, before it kills it).
	DeleteGracePeriod *int64
}

// SpecRun is one spec unit applied to the cluster: what it made and the
// problems found. Teardown deletes it.
type SpecRun struct {
	// Namespace is the fresh namespace of objects that name none.
	Namespace string
	// Namespaces are all the namespaces the unit's objects live in.
	Namespaces []string
	// Pods are the unit's pods once they all ran (Running or Succeeded).
	Pods []*v1.Pod
	// Problems found so far, one line each, naming file, object and what
	// was seen against what was expected.
	Problems []string

	cluster *Cluster
	opts    SpecOptions
	applied []appliedObject
	// created are the namespaces this run created (deleted at Teardown).
	created []string
	// claims are the claims the unit's pods used: namespace/name -> use.
	claims map[string]claimUse
}

type appliedObject struct {
	file string
	obj  *unstructured.Unstructured
}

type claimUse struct {
	uid, node string
}

func (r *SpecRun) problemf(format string, args ...any) {
	r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
}

func (r *SpecRun) logf(format string, args ...any) {
	if r.opts.Logf != nil {
		r.opts.Logf(format, args...)
	}
}

// fileOf names the file an object of this run came from.
func (r *SpecRun) fileOf(kind, ns, name string) string {
	for _, a := range r.applied {
		if a.obj.GetKind() == kind && a.obj.GetName() == name && (ns == "" || a.obj.GetNamespace() == ns) {
			return filepath.Base(a.file)
		}
	}
	return ""
}

// podSource names where a pod came from: its own file, or its owner's.
func (r *SpecRun) podSource(pod *v1.Pod) string {
	if f := r.fileOf("Pod", pod.Namespace, pod.Name); f != "" {
		return fmt.Sprintf("%s: pod %s/%s", f, pod.Namespace, pod.Name)
	}
	files := map[string]bool{}
	for _, a := range r.applied {
		if a.obj.GetNamespace() == pod.Namespace && workloadKinds[a.obj.GetKind()] {
			files[filepath.Base(a.file)] = true
		}
	}
	names := make([]string, 0, len(files))
	for f := range files {
		names = append(names, f)
	}
	sort.Strings(names)
	return fmt.Sprintf("%s: pod %s/%s", strings.Join(names, ","), pod.Namespace, pod.Name)
}

// workloadKinds are the kinds whose controllers make pods.
var workloadKinds = map[string]bool{
	"Deployment": true, "ReplicaSet": true, "StatefulSet": true, "DaemonSet": true, "Job": true, "CronJob": true, "ReplicationController": true,
}

// RunSpec applies the objects of files (one unit), waits for its pods and
// checks what each container sees. The returned run always needs Teardown,
// problems or not; an error is one that stops the run (the API refused an
// object).
func (c *Cluster) RunSpec(ctx context.Context, files []SpecFile, opts SpecOptions) (*SpecRun, error) {
	if opts.Timeout == 0 {
		opts.Timeout = 3 * time.Minute
	}
	if opts.NamespacePrefix == "" {
		opts.NamespacePrefix = "spec"
	}
	r := &SpecRun{cluster: c, opts: opts, claims: map[string]claimUse{}}
	fresh, err := c.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: dnsLabel(opts.NamespacePrefix) + "-"},
	}, metav1.CreateOptions{})
	if err != nil {
		return r, fmt.Errorf("fresh namespace: %w", err)
	}
	r.Namespace = fresh.Name
	r.created = append(r.created, fresh.Name)

	// The unit's own namespaces first, whatever the file order.
	defined := map[string]bool{}
	for _, f := range files {
		for _, o := range f.Objects {
			if o.GetKind() == "Namespace" && o.GetAPIVersion() == "v1" {
				defined[o.GetName()] = true
			}
		}
	}
	ordered := make([]appliedObject, 0)
	for _, f := range files {
		for _, o := range f.Objects {
			if o.GetKind() == "Namespace" {
				ordered = append(ordered, appliedObject{f.Path, o})
			}
		}
	}
	for _, f := range files {
		for _, o := range f.Objects {
			if o.GetKind() != "Namespace" {
				ordered = append(ordered, appliedObject{f.Path, o})
			}
		}
	}
	namespaces := map[string]bool{fresh.Name: true}
	for _, a := range ordered {
		ns := a.obj.GetNamespace()
		if a.obj.GetKind() == "Namespace" {
			if exists, err := c.namespaceUsable(ctx, a.obj.GetName(), opts.Timeout); err != nil {
				return r, err
			} else if !exists {
				r.created = append(r.created, a.obj.GetName())
			}
			namespaces[a.obj.GetName()] = true
		} else if ns != "" && !namespaces[ns] && !defined[ns] {
			// A namespace the spec names but does not define: made for it,
			// removed after (an existing one is used and left).
			exists, err := c.namespaceUsable(ctx, ns, opts.Timeout)
			if err != nil {
				return r, err
			}
			if !exists {
				if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
					return r, fmt.Errorf("%s: namespace %s of %s %s: %w", filepath.Base(a.file), ns, a.obj.GetKind(), a.obj.GetName(), err)
				}
				r.created = append(r.created, ns)
			}
			namespaces[ns] = true
		}
		if err := c.Apply(ctx, []*unstructured.Unstructured{a.obj}, fresh.Name); err != nil {
			r.applied = append(r.applied, a)
			return r, fmt.Errorf("%s: %w", filepath.Base(a.file), err)
		}
		r.applied = append(r.applied, a)
		if a.obj.GetNamespace() != "" {
			namespaces[a.obj.GetNamespace()] = true
		}
	}
	for ns := range namespaces {
		r.Namespaces = append(r.Namespaces, ns)
	}
	sort.Strings(r.Namespaces)
	r.logf("applied %d objects into %v", len(r.applied), r.Namespaces)

	pods, err := r.waitPods(ctx)
	if err != nil {
		return r, err
	}
	for _, pod := range pods {
		if podRan(pod) {
			r.Pods = append(r.Pods, pod)
			r.checkPodDevices(ctx, pod)
		}
	}
	return r, nil
}

// namespaceUsable says whether a namespace a spec names exists; one still
// being deleted (an earlier unit's, whose Teardown does not wait for the
// namespace controller) is waited for until it is gone, up to timeout, as
// nothing can be created in it.
func (c *Cluster) namespaceUsable(ctx context.Context, name string, timeout time.Duration) (bool, error) {
	exists := false
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		ns, err := c.Client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			exists = false
			return true, nil
		}
		if err != nil {
			return false, err
		}
		exists = true
		return ns.DeletionTimestamp == nil, nil
	})
	if err != nil {
		return false, fmt.Errorf("namespace %s: still being deleted after %s: %w", name, timeout, err)
	}
	return exists, nil
}

var notDNS = regexp.MustCompile(`[^a-z0-9-]+`)

// dnsLabel makes a namespace name prefix of s (lowercase, dashes, short).
func dnsLabel(s string) string {
	s = strings.Trim(notDNS.ReplaceAllString(strings.ToLower(s), "-"), "-")
	if len(s) > 40 {
		s = strings.TrimRight(s[:40], "-")
	}
	if s == "" {
		s = "spec"
	}
	return s
}

// waitPods waits until the unit's workloads have their pods and every pod
// of its namespaces is Running (all containers started) or Succeeded. On
// timeout each pod and workload short of that is a problem.
func (r *SpecRun) waitPods(ctx context.Context) ([]*v1.Pod, error) {
	c := r.cluster
	var pods []*v1.Pod
	var short []string
	makesPods := false
	for _, a := range r.applied {
		makesPods = makesPods || a.obj.GetKind() == "Pod" || workloadKinds[a.obj.GetKind()]
	}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, r.opts.Timeout, true, func(ctx context.Context) (bool, error) {
		pods, short = nil, nil
		for _, ns := range r.Namespaces {
			list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				short = append(short, fmt.Sprintf("list pods of namespace %s: %v", ns, err))
				continue
			}
			for i := range list.Items {
				p := &list.Items[i]
				if p.DeletionTimestamp != nil {
					short = append(short, fmt.Sprintf("%s: being deleted: %s", r.podSource(p), PodProblem(p)))
					continue
				}
				pods = append(pods, p)
				if !podRan(p) {
					short = append(short, fmt.Sprintf("%s: not Running or Succeeded: %s", r.podSource(p), PodProblem(p)))
				}
			}
		}
		for _, a := range r.applied {
			if msg := r.workloadShort(ctx, a); msg != "" {
				short = append(short, msg)
			}
		}
		if makesPods && len(pods) == 0 && len(short) == 0 {
			short = append(short, fmt.Sprintf("no pod in namespaces %v, though the spec has pods or workloads", r.Namespaces))
		}
		return len(short) == 0, nil
	})
	sort.Slice(pods, func(i, j int) bool { return pods[i].Namespace+"/"+pods[i].Name < pods[j].Namespace+"/"+pods[j].Name })
	if err != nil {
		if ctx.Err() != nil {
			return pods, ctx.Err()
		}
		for _, s := range short {
			r.problemf("after %s: %s", r.opts.Timeout, s)
		}
		for _, p := range pods {
			if !podRan(p) {
				if ev := c.podWarnings(ctx, p); ev != "" {
					r.problemf("%s: warning events: %s", r.podSource(p), ev)
				}
			}
		}
		return pods, nil
	}
	return pods, nil
}

// podWarnings are the last warning events of a pod (the kubelet's prepare
// errors, the scheduler's reasons), for failure messages.
func (c *Cluster) podWarnings(ctx context.Context, pod *v1.Pod) string {
	events, err := c.Client.CoreV1().Events(pod.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.name=" + pod.Name + ",type=Warning",
	})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, e := range events.Items {
		out = append(out, fmt.Sprintf("%s (%s, x%d): %s", e.Reason, e.Source.Component, e.Count, e.Message))
	}
	if len(out) > 5 {
		out = out[len(out)-5:]
	}
	return strings.Join(out, "; ")
}

// podRan: the pod is Succeeded, or Running with every container running.
func podRan(p *v1.Pod) bool {
	switch p.Status.Phase {
	case v1.PodSucceeded:
		return true
	case v1.PodRunning:
		for _, s := range p.Status.ContainerStatuses {
			// A container whose program ran to its end (exit 0) and that
			// the kubelet restarts (restartPolicy Always) has run too.
			ended := s.State.Terminated
			if ended == nil {
				ended = s.LastTerminationState.Terminated
			}
			if s.State.Running == nil && (ended == nil || ended.ExitCode != 0) {
				return false
			}
		}
		return len(p.Status.ContainerStatuses) > 0
	}
	return false
}

// workloadShort says what a workload object still lacks ("" when it has
// the pods it asks for, or is no workload).
func (r *SpecRun) workloadShort(ctx context.Context, a appliedObject) string {
	if !workloadKinds[a.obj.GetKind()] {
		return ""
	}
	ri, err := r.cluster.resourceFor(a.obj, r.Namespace)
	if err != nil {
		return err.Error()
	}
	got, err := ri.Get(ctx, a.obj.GetName(), metav1.GetOptions{})
	if err != nil {
		return fmt.Sprintf("%s: %s %s: %v", filepath.Base(a.file), a.obj.GetKind(), a.obj.GetName(), err)
	}
	num := func(fields ...string) int64 {
		v, _, _ := unstructured.NestedInt64(got.Object, fields...)
		return v
	}
	want, found, _ := unstructured.NestedInt64(got.Object, "spec", "replicas")
	if !found {
		want = 1
	}
	var have int64
	what := "ready replicas"
	switch a.obj.GetKind() {
	case "Deployment", "ReplicaSet", "StatefulSet", "ReplicationController":
		have = num("status", "readyReplicas")
	case "DaemonSet":
		want, have, what = num("status", "desiredNumberScheduled"), num("status", "numberReady"), "ready pods"
	case "Job":
		// Done, or its pods all running (a Job of long-running pods).
		if num("status", "succeeded") > 0 && num("status", "active") == 0 {
			return ""
		}
		want, found, _ = unstructured.NestedInt64(got.Object, "spec", "parallelism")
		if !found {
			want = 1
		}
		have, what = num("status", "ready")+num("status", "succeeded"), "ready or succeeded pods"
	case "CronJob":
		return ""
	}
	if have < want {
		return fmt.Sprintf("%s: %s %s/%s has %d %s, wants %d", filepath.Base(a.file), a.obj.GetKind(), got.GetNamespace(), got.GetName(), have, what, want)
	}
	return ""
}

// expectedDevices are the devices a container's claims give it.
type expectedDevices struct {
	gpus []string // whole GPUs' UUIDs
	migs []string // static MIG devices' UUIDs, or "<parent UUID>/<profile>" of dynamic ones
}

// containerClaimResults are the allocation results of our driver that a
// container's claims (and requests, where it names them) give it.
func (r *SpecRun) containerClaimResults(ctx context.Context, pod *v1.Pod, ctr v1.Container) ([]resourceapi.DeviceRequestAllocationResult, error) {
	var out []resourceapi.DeviceRequestAllocationResult
	for _, ref := range ctr.Resources.Claims {
		name := ""
		for _, st := range pod.Status.ResourceClaimStatuses {
			if st.Name == ref.Name && st.ResourceClaimName != nil {
				name = *st.ResourceClaimName
			}
		}
		for _, pc := range pod.Spec.ResourceClaims {
			if pc.Name == ref.Name && pc.ResourceClaimName != nil {
				name = *pc.ResourceClaimName
			}
		}
		if name == "" {
			return nil, fmt.Errorf("claim %q of the pod has no ResourceClaim in its status", ref.Name)
		}
		claim, err := r.cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("claim %s: %w", name, err)
		}
		r.claims[pod.Namespace+"/"+name] = claimUse{uid: string(claim.UID), node: pod.Spec.NodeName}
		if claim.Status.Allocation == nil {
			return nil, fmt.Errorf("claim %s of the running pod is not allocated", name)
		}
		for _, res := range claim.Status.Allocation.Devices.Results {
			if res.Driver != DefaultDriver {
				continue
			}
			if ref.Request != "" && res.Request != ref.Request && !strings.HasPrefix(res.Request, ref.Request+"/") {
				continue
			}
			out = append(out, res)
		}
	}
	return out, nil
}

// sliceDevice finds a device of our driver's ResourceSlices by pool and name.
func (c *Cluster) sliceDevice(ctx context.Context, pool, name string) (*resourceapi.Device, error) {
	slices, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + DefaultDriver})
	if err != nil {
		return nil, err
	}
	for _, s := range slices.Items {
		if s.Spec.Pool.Name != pool {
			continue
		}
		for i := range s.Spec.Devices {
			if s.Spec.Devices[i].Name == name {
				return &s.Spec.Devices[i], nil
			}
		}
	}
	return nil, fmt.Errorf("no device %s in pool %s of %s's ResourceSlices", name, pool, DefaultDriver)
}

func deviceAttr(d *resourceapi.Device, name string) string {
	for k, v := range d.Attributes {
		if (string(k) == name || strings.HasSuffix(string(k), "/"+name)) && v.StringValue != nil {
			return *v.StringValue
		}
	}
	return ""
}

// expected resolves allocation results through the ResourceSlices.
func (r *SpecRun) expected(ctx context.Context, results []resourceapi.DeviceRequestAllocationResult) (expectedDevices, error) {
	var e expectedDevices
	for _, res := range results {
		d, err := r.cluster.sliceDevice(ctx, res.Pool, res.Device)
		if err != nil {
			return e, err
		}
		uuid, typ := deviceAttr(d, "uuid"), deviceAttr(d, "type")
		switch {
		case typ == "mig" && uuid != "":
			e.migs = append(e.migs, uuid)
		case typ == "mig":
			parent, profile := deviceAttr(d, "parentUUID"), deviceAttr(d, "profile")
			if parent == "" || profile == "" {
				return e, fmt.Errorf("MIG device %s/%s has no uuid and no parentUUID and profile", res.Pool, res.Device)
			}
			e.migs = append(e.migs, parent+"/"+profile)
		case uuid != "":
			e.gpus = append(e.gpus, uuid)
		default:
			return e, fmt.Errorf("device %s/%s (type %q) has no uuid attribute", res.Pool, res.Device, typ)
		}
	}
	e.gpus, e.migs = uniqueSorted(e.gpus), uniqueSorted(e.migs)
	return e, nil
}

func uniqueSorted(s []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	sort.Strings(out)
	return out
}

// SMIDevice is one device `nvidia-smi -L` lists.
type SMIDevice struct {
	// UUID of the GPU or MIG device.
	UUID string
	// Parent is a MIG device's GPU UUID; Profile its profile (1g.5gb).
	Parent, Profile string
}

var (
	smiGPULine = regexp.MustCompile(`^GPU [0-9]+: .*\(UUID: (GPU-[^)]+)\)\s*$`)
	smiMIGLine = regexp.MustCompile(`^\s+MIG ([0-9a-z.+]+)\s+Device\s+[0-9]+: \(UUID: (MIG-[^)]+)\)\s*$`)
)

// ParseSMIList reads `nvidia-smi -L` output: whole GPUs (those listed with
// no MIG device under them) and MIG devices with their parent and profile.
func ParseSMIList(out string) (gpus []string, migs []SMIDevice) {
	parent := ""
	withMIG := map[string]bool{}
	var all []string
	for _, line := range strings.Split(out, "\n") {
		if m := smiGPULine.FindStringSubmatch(line); m != nil {
			parent = m[1]
			all = append(all, parent)
		} else if m := smiMIGLine.FindStringSubmatch(line); m != nil && parent != "" {
			withMIG[parent] = true
			migs = append(migs, SMIDevice{UUID: m[2], Parent: parent, Profile: m[1]})
		}
	}
	for _, g := range all {
		if !withMIG[g] {
			gpus = append(gpus, g)
		}
	}
	return gpus, migs
}

// matchSMI compares what nvidia-smi -L listed with what was allocated.
func matchSMI(out string, want expectedDevices) (ok bool, seen string) {
	gpus, migs := ParseSMIList(out)
	gpus = uniqueSorted(gpus)
	var migKeys []string
	remaining := map[string]bool{}
	for _, m := range want.migs {
		remaining[m] = true
	}
	for _, m := range migs {
		switch {
		case remaining[m.UUID]:
			delete(remaining, m.UUID)
			migKeys = append(migKeys, m.UUID)
		case remaining[m.Parent+"/"+m.Profile]:
			delete(remaining, m.Parent+"/"+m.Profile)
			migKeys = append(migKeys, m.Parent+"/"+m.Profile)
		default:
			migKeys = append(migKeys, m.UUID+" ("+m.Profile+" on "+m.Parent+")")
		}
	}
	sort.Strings(migKeys)
	seen = fmt.Sprintf("GPUs %v, MIG devices %v", gpus, migKeys)
	return strings.Join(gpus, " ") == strings.Join(want.gpus, " ") && strings.Join(migKeys, " ") == strings.Join(want.migs, " "), seen
}

// checkPodDevices: each container of a running pod that claims devices
// lists exactly them with nvidia-smi -L.
func (r *SpecRun) checkPodDevices(ctx context.Context, pod *v1.Pod) {
	src := r.podSource(pod)
	for _, ctr := range pod.Spec.Containers {
		if len(ctr.Resources.Claims) == 0 {
			continue
		}
		results, err := r.containerClaimResults(ctx, pod, ctr)
		if err != nil {
			r.problemf("%s container %s: %v", src, ctr.Name, err)
			continue
		}
		if pod.Status.Phase != v1.PodRunning {
			continue // Succeeded: nothing to exec into.
		}
		want, err := r.expected(ctx, results)
		if err != nil {
			r.problemf("%s container %s: %v", src, ctr.Name, err)
			continue
		}
		if len(want.gpus)+len(want.migs) == 0 {
			r.problemf("%s container %s claims devices but none of %s's is allocated to it", src, ctr.Name, DefaultDriver)
			continue
		}
		out, err := r.cluster.ExecInContainer(ctx, pod, ctr.Name, r.opts.Timeout, "nvidia-smi", "-L")
		if err != nil {
			r.problemf("%s container %s: nvidia-smi -L: %v", src, ctr.Name, err)
			continue
		}
		ok, seen := matchSMI(out.Stdout, want)
		if !ok || out.ExitCode != 0 {
			r.problemf("%s container %s: nvidia-smi -L (exit %d) lists %s; allocated GPUs %v, MIG devices %v; output:\n%s%s",
				src, ctr.Name, out.ExitCode, seen, want.gpus, want.migs, out.Stdout, out.Stderr)
			continue
		}
		r.logf("%s container %s on %s sees %s", src, ctr.Name, pod.Spec.NodeName, seen)
	}
}

// ExecInContainer runs a command in a container through the API server's
// pods/exec (the kubelet's server streams it from the runtime), as kubectl
// exec does. A container between two runs (its program ended and the
// kubelet restarts it) is waited for, up to timeout. The exit code of the
// command is in the result; err is for the exec itself.
func (c *Cluster) ExecInContainer(ctx context.Context, pod *v1.Pod, container string, timeout time.Duration, command ...string) (ExecResult, error) {
	var res ExecResult
	var last error
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		var err error
		res, err = c.execOnce(ctx, pod, container, command)
		if err == nil {
			return true, nil
		}
		// An attempt cut short by the wait's own deadline fails in its dial
		// ("i/o timeout") and says nothing about the container: keep the
		// error of the attempt before it (say, the container not found while
		// the kubelet restarts it).
		if last == nil || ctx.Err() == nil {
			last = err
		}
		p, err := c.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil || p.Status.Phase != v1.PodRunning {
			return false, fmt.Errorf("%w (pod: %s)", last, PodProblem(p))
		}
		return false, nil
	})
	if err != nil {
		if last != nil {
			return res, last
		}
		return res, err
	}
	return res, nil
}

func (c *Cluster) execOnce(ctx context.Context, pod *v1.Pod, container string, command []string) (ExecResult, error) {
	req := c.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(pod.Namespace).Name(pod.Name).SubResource("exec").
		VersionedParams(&v1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exec, err := remotecommand.NewSPDYExecutor(c.AdminConfig, "POST", req.URL())
	if err != nil {
		return ExecResult{}, err
	}
	var stdout, stderr bytes.Buffer
	err = exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	res := ExecResult{Stdout: stdout.String(), Stderr: stderr.String()}
	var exit interface{ ExitStatus() int }
	if errors.As(err, &exit) {
		res.ExitCode = exit.ExitStatus()
		return res, nil
	}
	return res, err
}

// Teardown deletes what the unit made (its objects, then the namespaces
// this run created) and checks that every pod of the unit's namespaces is
// gone (its node's kubelet stopped it), that every claim its pods used is
// released (gone from the API) and that its node has no CDI claim spec file
// of it left. Problems are added to the run.
//
// The namespaces themselves are left to the namespace controller: once
// their pods and claims are gone nothing of the unit holds a device or runs
// on a node, and the controller's finalization (requeued with back-off
// while content remains) only adds wall time. A later unit that names one
// of them waits for it to go before making it again (RunSpec). Claims are
// checked concurrently, each with the run's timeout.
func (r *SpecRun) Teardown(ctx context.Context) {
	c := r.cluster
	background, orphan := metav1.DeletePropagationBackground, metav1.DeletePropagationOrphan
	for i := len(r.applied) - 1; i >= 0; i-- {
		a := r.applied[i]
		if a.obj.GetKind() == "Namespace" {
			continue
		}
		ri, err := c.resourceFor(a.obj, r.Namespace)
		if err != nil {
			r.problemf("%s: delete %s %s: %v", filepath.Base(a.file), a.obj.GetKind(), a.obj.GetName(), err)
			continue
		}
		opts := metav1.DeleteOptions{PropagationPolicy: &background}
		if r.opts.DeleteGracePeriod != nil {
			// The grace period must go with a pod's first deletion: the
			// kubelet stops its containers with the period it sees first,
			// and a shorter one sent after does not cut that stop short.
			// So pods are deleted here with it, and workloads orphan
			// theirs (the garbage collector would delete them with their
			// own period); stopControllers and the loop below finish.
			switch {
			case a.obj.GetKind() == "Pod" && a.obj.GetAPIVersion() == "v1":
				opts.GracePeriodSeconds = r.opts.DeleteGracePeriod
			case workloadKinds[a.obj.GetKind()] && slices.Contains(r.created, a.obj.GetNamespace()):
				opts.PropagationPolicy = &orphan
			}
		}
		if err := ri.Delete(ctx, a.obj.GetName(), opts); err != nil && !apierrors.IsNotFound(err) {
			r.problemf("%s: delete %s %s: %v", filepath.Base(a.file), a.obj.GetKind(), a.obj.GetName(), err)
		}
	}
	if r.opts.DeleteGracePeriod != nil {
		r.stopControllers(ctx)
		for _, ns := range r.Namespaces {
			pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				r.problemf("list pods of namespace %s: %v", ns, err)
				continue
			}
			for _, p := range pods.Items {
				err := c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: r.opts.DeleteGracePeriod})
				if err != nil && !apierrors.IsNotFound(err) {
					r.problemf("delete pod %s/%s: %v", ns, p.Name, err)
				}
			}
		}
	}
	for _, ns := range r.created {
		if err := c.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			r.problemf("delete namespace %s: %v", ns, err)
		}
	}
	// Every pod of a namespace the run made is the unit's; in one that was
	// there before, the pods that ran for it.
	created := map[string]bool{}
	for _, ns := range r.created {
		created[ns] = true
	}
	ran := map[types.UID]bool{}
	for _, p := range r.Pods {
		ran[p.UID] = true
	}
	for _, ns := range r.Namespaces {
		var left []string
		err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, r.opts.Timeout, true, func(ctx context.Context) (bool, error) {
			pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				left = []string{err.Error()}
				return false, nil
			}
			left = left[:0]
			for _, p := range pods.Items {
				if created[ns] || ran[p.UID] {
					left = append(left, p.Name+": "+PodProblem(&p))
				}
			}
			return len(left) == 0, nil
		})
		if err != nil {
			r.problemf("namespace %s: pods not gone after %s: %v", ns, r.opts.Timeout, left)
		}
	}
	names := make([]string, 0, len(r.claims))
	for k := range r.claims {
		names = append(names, k)
	}
	sort.Strings(names)
	problems := make([][]string, len(names))
	var wg sync.WaitGroup
	for i, key := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			problems[i] = r.checkClaimGone(ctx, key, r.claims[key])
		}()
	}
	wg.Wait()
	for _, ps := range problems {
		r.Problems = append(r.Problems, ps...)
	}
}

// podControllers are the resources whose controllers make pods, or make the
// objects that do (a Deployment's ReplicaSets, a CronJob's Jobs).
var podControllers = []schema.GroupVersionResource{
	{Group: "apps", Version: "v1", Resource: "deployments"},
	{Group: "apps", Version: "v1", Resource: "replicasets"},
	{Group: "apps", Version: "v1", Resource: "statefulsets"},
	{Group: "apps", Version: "v1", Resource: "daemonsets"},
	{Group: "batch", Version: "v1", Resource: "cronjobs"},
	{Group: "batch", Version: "v1", Resource: "jobs"},
	{Version: "v1", Resource: "replicationcontrollers"},
}

// stopControllers deletes, orphaning their dependents, every pod-making
// object left in the namespaces the run created: what the unit's workloads
// made (a ReplicaSet orphaned by its Deployment's deletion still keeps its
// replicas). Once each is marked deleted its controller makes no pod, so
// the pods can be deleted with the run's grace period and none comes back.
// Namespaces that were there before are left alone: their objects need
// not be the unit's.
func (r *SpecRun) stopControllers(ctx context.Context) {
	orphan := metav1.DeletePropagationOrphan
	for _, ns := range r.created {
		for _, gvr := range podControllers {
			ri := r.cluster.Dynamic.Resource(gvr).Namespace(ns)
			list, err := ri.List(ctx, metav1.ListOptions{})
			if err != nil {
				r.problemf("list %s of namespace %s: %v", gvr.Resource, ns, err)
				continue
			}
			for _, o := range list.Items {
				if o.GetDeletionTimestamp() != nil {
					continue
				}
				err := ri.Delete(ctx, o.GetName(), metav1.DeleteOptions{PropagationPolicy: &orphan})
				if err != nil && !apierrors.IsNotFound(err) {
					r.problemf("delete %s %s/%s: %v", o.GetKind(), ns, o.GetName(), err)
				}
			}
		}
	}
}

// checkClaimGone waits for a claim the unit's pods used to be released
// (gone from the API, or replaced by one of another UID) and for its
// node's CDI claim spec files to be removed; it returns the problems.
func (r *SpecRun) checkClaimGone(ctx context.Context, key string, use claimUse) []string {
	c := r.cluster
	var problems []string
	ns, name, _ := strings.Cut(key, "/")
	var state string
	released := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, r.opts.Timeout, true, func(ctx context.Context) (bool, error) {
		claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && string(claim.UID) != use.uid) {
			return true, nil
		}
		if err == nil {
			state = fmt.Sprintf("allocated %t, reserved for %d", claim.Status.Allocation != nil, len(claim.Status.ReservedFor))
		}
		return false, nil
	}) == nil
	if !released {
		problems = append(problems, fmt.Sprintf("claim %s (uid %s) not released after deletion: %s", key, use.uid, state))
	}
	node := c.Node(use.node)
	if node == nil {
		return problems
	}
	var files []string
	gone := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		var err error
		if files, err = ClaimSpecFiles(node.CDIRoot, use.uid); err != nil {
			files = []string{err.Error()}
		}
		return len(files) == 0, nil
	}) == nil
	if !gone {
		problems = append(problems, fmt.Sprintf("claim %s (uid %s): CDI spec files left on %s after deletion: %v", key, use.uid, use.node, files))
	}
	return problems
}

// ClaimSpecFiles are the CDI spec files under root that belong to a claim
// (its UID in the file name or a device name).
func ClaimSpecFiles(root, uid string) ([]string, error) {
	specs, err := ReadCDISpecs(root)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, s := range specs {
		if strings.Contains(s.Path, uid) {
			out = append(out, s.Path)
			continue
		}
		for _, d := range s.Devices {
			if strings.Contains(d.Name, uid) {
				out = append(out, s.Path)
				break
			}
		}
	}
	return out, nil
}
