package harness

// Placement rounds: many multi-GPU claims at once on the real kube-scheduler,
// and whether the GPUs each claim got are NVLink peers. The answer is taken
// from the node's own `nvidia-smi topo -m` (the simulator's link table, what
// NVML reports), never from the driver's nvlinkDomain attribute, so a round
// without the constraint and a round with it are judged alike.
//
// A round's pods each have one claim from a ResourceClaimTemplate of the
// round's namespace: count whole GPUs of the chart's DeviceClass, with or
// without `matchAttribute: gpu.nvidia.com/nvlinkDomain`. The round ends when
// every pod is bound or marked Unschedulable by the scheduler and nothing was
// bound for a settle time; the pods left Unschedulable are reported, not
// failed: with the constraint a fleet may have no NVLink set left.

import (
	"bufio"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
)

// NVLinkDomainAttribute is the attribute our plugin publishes on whole GPUs:
// GPUs with the same value are pairwise NVLink peers.
const NVLinkDomainAttribute = resourceapi.FullyQualifiedName(DefaultDriver + "/nvlinkDomain")

// NVLinkPeers is a host's NVLink graph as `nvidia-smi topo -m` shows it: for
// every GPU UUID, the UUIDs it has a direct NVLink connection (NV#) to.
type NVLinkPeers map[string]map[string]bool

// Linked says whether every two of the GPUs are NVLink peers. A single GPU
// is linked; an unknown UUID is linked to nothing.
func (p NVLinkPeers) Linked(uuids []string) bool {
	for i, a := range uuids {
		for _, b := range uuids[i+1:] {
			if !p[a][b] {
				return false
			}
		}
	}
	return true
}

var (
	smiListLine = regexp.MustCompile(`^GPU (\d+): .*\(UUID: (GPU-[^)]+)\)`)
	topoGPU     = regexp.MustCompile(`^GPU(\d+)$`)
	topoNVLink  = regexp.MustCompile(`^NV\d+$`)
)

// ParseNVLinkPeers reads `nvidia-smi -L` (index -> UUID) and `nvidia-smi topo
// -m` (the connection matrix by index). Columns other than GPUs (NICs, CPU
// affinity) are ignored; the matrix ends at its first blank line.
func ParseNVLinkPeers(list, topo string) (NVLinkPeers, error) {
	uuid := map[string]string{}
	for _, line := range strings.Split(list, "\n") {
		if m := smiListLine.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			uuid[m[1]] = m[2]
		}
	}
	if len(uuid) == 0 {
		return nil, fmt.Errorf("nvidia-smi -L lists no GPU:\n%s", list)
	}
	peers := NVLinkPeers{}
	for _, u := range uuid {
		peers[u] = map[string]bool{}
	}
	sc := bufio.NewScanner(strings.NewReader(topo))
	var header []string
	rows := 0
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			if header != nil {
				break
			}
			continue
		}
		fields := strings.Split(line, "\t")
		if header == nil {
			header = fields
			continue
		}
		row := topoGPU.FindStringSubmatch(strings.TrimSpace(fields[0]))
		if row == nil {
			continue
		}
		a, ok := uuid[row[1]]
		if !ok {
			return nil, fmt.Errorf("nvidia-smi topo -m: row GPU%s: no such GPU in nvidia-smi -L", row[1])
		}
		rows++
		for i := 1; i < len(fields) && i < len(header); i++ {
			col := topoGPU.FindStringSubmatch(strings.TrimSpace(header[i]))
			if col == nil || !topoNVLink.MatchString(strings.TrimSpace(fields[i])) {
				continue
			}
			b, ok := uuid[col[1]]
			if !ok {
				return nil, fmt.Errorf("nvidia-smi topo -m: column GPU%s: no such GPU in nvidia-smi -L", col[1])
			}
			peers[a][b] = true
		}
	}
	if rows != len(uuid) {
		return nil, fmt.Errorf("nvidia-smi topo -m has %d GPU rows for %d GPUs of nvidia-smi -L:\n%s", rows, len(uuid), topo)
	}
	return peers, nil
}

// NVLinkPeers runs the node's simulated `nvidia-smi -L` and `nvidia-smi topo
// -m` (from its driver root, as an admin on the host would) and reads its
// NVLink graph from them.
func (n *Node) NVLinkPeers(ctx context.Context) (NVLinkPeers, error) {
	smi := filepath.Join(n.SimRoot(), "usr", "bin", "nvidia-smi")
	run := func(args ...string) (string, error) {
		out, err := exec.CommandContext(ctx, smi, args...).CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("%s on %s: %s %v: %s", smi, n.Name, strings.Join(args, " "), err, out)
		}
		return string(out), nil
	}
	list, err := run("-L")
	if err != nil {
		return nil, err
	}
	topo, err := run("topo", "-m")
	if err != nil {
		return nil, err
	}
	peers, err := ParseNVLinkPeers(list, topo)
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", n.Name, err)
	}
	return peers, nil
}

// PlacementRound is one batch of multi-GPU claims.
type PlacementRound struct {
	// Namespace holds the round's templates, pods and claims; it must exist
	// and hold no other pods or claims (DeletePlacement empties it).
	Namespace string
	// Name prefixes the round's pod names.
	Name string
	// GPUs is the size of each pod's claim, in creation order.
	GPUs []int64
	// NVLink constrains every claim with matchAttribute on nvlinkDomain.
	NVLink bool
	// NodeSelector is every pod's node selector (the fleet's nodes).
	NodeSelector map[string]string
	// Parallel is how many pods are created at once; 1 creates each pod only
	// once the one before is bound or Unschedulable, which fixes the order in
	// which the nodes fill.
	Parallel int
	// Settle is how long nothing more must be bound, once every pod is bound
	// or Unschedulable, for the round to end (default 5 s).
	Settle time.Duration
	// Timeout bounds the whole round (default 10 minutes).
	Timeout time.Duration
}

// Placed is a pod the scheduler bound, and what its claim got.
type Placed struct {
	Pod, Node string
	// GPUs is the claim's count; Devices the allocated devices' names.
	GPUs    int
	Devices []string
	// NVLink: every two of the allocated GPUs are NVLink peers, by the
	// node's nvidia-smi topo -m.
	NVLink bool
	// Scheduled is the time from the pod's creation to its binding.
	Scheduled time.Duration
}

// PlacementResult is what a round placed and what it left.
type PlacementResult struct {
	Placed []Placed
	// Pending names the pods the scheduler left Unschedulable, with their
	// claims' sizes.
	Pending map[string]int
	// AllScheduled is the time from the first creation to the last binding.
	AllScheduled time.Duration
}

// templateName is the round's ResourceClaimTemplate for count GPUs.
func templateName(count int64, nvlink bool) string {
	if nvlink {
		return fmt.Sprintf("gpus-%d-nvlink", count)
	}
	return fmt.Sprintf("gpus-%d", count)
}

func (c *Cluster) ensureTemplate(ctx context.Context, ns string, count int64, nvlink bool) error {
	spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{{Name: "gpus", Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
		}}},
	}}
	if nvlink {
		attr := NVLinkDomainAttribute
		spec.Devices.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: &attr}}
	}
	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: templateName(count, nvlink), Namespace: ns},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: spec},
	}
	_, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

// placementLabel marks a round's pods with the round's name.
const placementLabel = "e2e.gpu-dra/placement-round"

// unschedulable says whether the scheduler marked the pod Unschedulable.
func unschedulable(pod *v1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}

// RunPlacement runs a round: creates its pods, waits until the scheduler
// placed what it can, and judges every placement by its node's NVLink graph.
func (c *Cluster) RunPlacement(ctx context.Context, r PlacementRound) (*PlacementResult, error) {
	if r.Parallel < 1 {
		r.Parallel = 1
	}
	if r.Settle == 0 {
		r.Settle = 5 * time.Second
	}
	if r.Timeout == 0 {
		r.Timeout = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, r.Timeout)
	defer cancel()
	sizes := map[string]int64{}
	for i, n := range r.GPUs {
		if err := c.ensureTemplate(ctx, r.Namespace, n, r.NVLink); err != nil {
			return nil, fmt.Errorf("claim template for %d GPUs: %w", n, err)
		}
		sizes[fmt.Sprintf("%s-%04d", r.Name, i)] = n
	}

	// Bindings and Unschedulable marks come from a watch: times are when
	// the apiserver saw them, not when a poll noticed.
	var mu sync.Mutex
	created := map[string]time.Time{}
	bound := map[string]time.Time{}
	onNode := map[string]string{}
	pending := map[string]bool{}
	var lastBind time.Time
	changed := make(chan struct{}, 1)
	record := func(obj any) {
		pod, ok := obj.(*v1.Pod)
		if !ok || pod.Labels[placementLabel] != r.Name {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if pod.Spec.NodeName != "" {
			delete(pending, pod.Name)
			if _, seen := bound[pod.Name]; !seen {
				bound[pod.Name] = time.Now()
				onNode[pod.Name] = pod.Spec.NodeName
				lastBind = bound[pod.Name]
			}
		} else if unschedulable(pod) {
			pending[pod.Name] = true
		}
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	factory := informers.NewSharedInformerFactoryWithOptions(c.Client, 0, informers.WithNamespace(r.Namespace))
	if _, err := factory.Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: record, UpdateFunc: func(_, o any) { record(o) },
	}); err != nil {
		return nil, err
	}
	// Shutdown waits for the informer to stop: its stop channel closes first.
	stop := make(chan struct{})
	factory.Start(stop)
	defer func() { close(stop); factory.Shutdown() }()
	factory.WaitForCacheSync(ctx.Done())
	decided := func(name string) bool {
		mu.Lock()
		defer mu.Unlock()
		_, b := bound[name]
		return b || pending[name]
	}

	t0 := time.Now()
	work := make(chan int)
	errs := make(chan error, len(r.GPUs))
	var wg sync.WaitGroup
	for range r.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				name := fmt.Sprintf("%s-%04d", r.Name, i)
				tmpl := templateName(r.GPUs[i], r.NVLink)
				pod := &v1.Pod{
					ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: r.Namespace, Labels: map[string]string{placementLabel: r.Name}},
					Spec: v1.PodSpec{
						NodeSelector:                  r.NodeSelector,
						TerminationGracePeriodSeconds: new(int64),
						Containers: []v1.Container{{Name: "ctr", Image: TestImageName,
							Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpus"}}}}},
						ResourceClaims: []v1.PodResourceClaim{{Name: "gpus", ResourceClaimTemplateName: &tmpl}},
					},
				}
				mu.Lock()
				created[name] = time.Now()
				mu.Unlock()
				if _, err := c.Client.CoreV1().Pods(r.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
					errs <- fmt.Errorf("create pod %s: %w", name, err)
					continue
				}
				if r.Parallel == 1 {
					err := wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(context.Context) (bool, error) { return decided(name), nil })
					if err != nil {
						errs <- fmt.Errorf("pod %s neither bound nor Unschedulable: %w", name, err)
					}
				}
			}
		}()
	}
	for i := range r.GPUs {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, err
	}

	// Done once every pod is decided and no binding came for Settle.
	for {
		mu.Lock()
		done := len(bound)+len(pending) == len(r.GPUs) && time.Since(lastBind) >= r.Settle
		b, p := len(bound), len(pending)
		mu.Unlock()
		if done {
			break
		}
		select {
		case <-changed:
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return nil, fmt.Errorf("round %s after %s: %d of %d pods bound, %d Unschedulable, the rest undecided: %w", r.Name, time.Since(t0).Round(time.Second), b, len(r.GPUs), p, ctx.Err())
		}
	}

	res := &PlacementResult{Pending: map[string]int{}}
	mu.Lock()
	for name := range pending {
		res.Pending[name] = int(sizes[name])
	}
	if len(bound) > 0 {
		res.AllScheduled = lastBind.Sub(t0)
	}
	binds := map[string]time.Duration{}
	for name, t := range bound {
		binds[name] = t.Sub(created[name])
	}
	mu.Unlock()

	placed, err := c.judgePlacements(ctx, r.Namespace, onNode, sizes, binds)
	if err != nil {
		return nil, err
	}
	res.Placed = placed
	return res, nil
}

// judgePlacements reads each bound pod's allocated GPUs and checks them
// against its node's NVLink graph.
func (c *Cluster) judgePlacements(ctx context.Context, ns string, onNode map[string]string, sizes map[string]int64, binds map[string]time.Duration) ([]Placed, error) {
	slices, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + DefaultDriver})
	if err != nil {
		return nil, err
	}
	uuidOf := map[string]string{} // pool/device -> UUID
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if a, ok := d.Attributes["uuid"]; ok && a.StringValue != nil {
				uuidOf[s.Spec.Pool.Name+"/"+d.Name] = *a.StringValue
			}
		}
	}
	graphs := map[string]NVLinkPeers{}
	var out []Placed
	names := make([]string, 0, len(onNode))
	for name := range onNode {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		node := onNode[name]
		peers, ok := graphs[node]
		if !ok {
			n := c.Node(node)
			if n == nil {
				return nil, fmt.Errorf("pod %s bound to %s, which is no node of the harness", name, node)
			}
			if peers, err = n.NVLinkPeers(ctx); err != nil {
				return nil, err
			}
			graphs[node] = peers
		}
		devices, uuids, err := c.allocatedGPUs(ctx, ns, name, uuidOf)
		if err != nil {
			return nil, err
		}
		if len(devices) != int(sizes[name]) {
			return nil, fmt.Errorf("pod %s: its claim asked for %d GPUs and got %v", name, sizes[name], devices)
		}
		out = append(out, Placed{Pod: name, Node: node, GPUs: int(sizes[name]), Devices: devices, NVLink: peers.Linked(uuids), Scheduled: binds[name]})
	}
	return out, nil
}

// allocatedGPUs is the devices (pool/name) and UUIDs a bound pod's one claim
// got. The claim's allocation is written before the binding, so it is there.
func (c *Cluster) allocatedGPUs(ctx context.Context, ns, pod string, uuidOf map[string]string) ([]string, []string, error) {
	p, err := c.Client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		return nil, nil, err
	}
	if len(p.Status.ResourceClaimStatuses) != 1 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
		return nil, nil, fmt.Errorf("pod %s: status.resourceClaimStatuses %v: want its one generated claim", pod, p.Status.ResourceClaimStatuses)
	}
	claimName := *p.Status.ResourceClaimStatuses[0].ResourceClaimName
	claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claimName, metav1.GetOptions{})
	if err != nil {
		return nil, nil, err
	}
	if claim.Status.Allocation == nil {
		return nil, nil, fmt.Errorf("claim %s/%s of bound pod %s: status.allocation is empty", ns, claimName, pod)
	}
	var devices, uuids []string
	for _, res := range claim.Status.Allocation.Devices.Results {
		id := res.Pool + "/" + res.Device
		uuid, ok := uuidOf[id]
		if !ok {
			return nil, nil, fmt.Errorf("claim %s/%s: allocated device %s is in no slice with a uuid attribute", ns, claimName, id)
		}
		devices = append(devices, id)
		uuids = append(uuids, uuid)
	}
	sort.Strings(devices)
	return devices, uuids, nil
}

// DeletePlacement deletes every pod of the namespace (8 requests at a time)
// and waits until the pods and their claims are gone, so the next round
// finds the devices free.
func (c *Cluster) DeletePlacement(ctx context.Context, ns string, timeout time.Duration) error {
	pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	work := make(chan string)
	var wg sync.WaitGroup
	var firstErr error
	var mu sync.Mutex
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range work {
				err := c.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{})
				if err != nil && !apierrors.IsNotFound(err) {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("delete pod %s/%s: %w", ns, name, err)
					}
					mu.Unlock()
				}
			}
		}()
	}
	for _, p := range pods.Items {
		work <- p.Name
	}
	close(work)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	var left, claims int
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		cl, err := c.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		left, claims = len(pods.Items), len(cl.Items)
		return left == 0 && claims == 0, nil
	})
	if err != nil {
		return fmt.Errorf("namespace %s after %s: %d pods and %d claims left: %w", ns, timeout, left, claims, err)
	}
	return nil
}
