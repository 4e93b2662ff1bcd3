package tests

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-dra/e2e/harness"
)

// realNodeTaint keeps the suite's other pods (examples without a node
// selector) off the real node; its test pods tolerate it.
var realNodeTaint = v1.Taint{Key: "e2e.gpu-dra/real-node", Effect: v1.TaintEffectNoSchedule}

// TestRealKubeletRunsAClaimPod runs a node with the real kubelet and
// containerd (harness/realnode.go) and our plugin as a process on a
// simulated T4: the kubelet's own plugin watcher registers the plugin, a pod
// with a one-GPU claim is prepared by the kubelet's DRA manager and started
// by containerd with the claim's CDI device; its log (the API server's
// pods/log, served by the kubelet) and an exec through the API server show
// exactly the allocated GPU; deleting the pod unprepares the claim (its CDI
// spec goes); removing the node while another pod still runs leaves no
// process, mount, cgroup or network link behind.
func TestRealKubeletRunsAClaimPod(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const nodeName = "real-t4"
	started := time.Now()
	n, err := cluster.AddNode(ctx, harness.NodeOptions{Name: nodeName, RealKubelet: true, Taints: []v1.Taint{realNodeTaint}})
	if err != nil {
		t.Fatal(err)
	}
	removed := false
	t.Cleanup(func() {
		if !removed {
			_ = cluster.RemoveNode(ctx, nodeName)
		}
	})
	t.Logf("real node Ready after %s", time.Since(started).Round(time.Millisecond))
	node, err := cluster.Client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := node.Status.NodeInfo.ContainerRuntimeVersion; !strings.HasPrefix(got, "containerd://") {
		t.Errorf("node reports runtime %q, want containerd://...", got)
	}
	if got, want := node.Status.NodeInfo.KubeletVersion, harness.ModuleKubernetesVersion(); got != want {
		t.Errorf("node reports kubelet %q, want the control plane's %q", got, want)
	}

	if _, err := n.StartPlugin(ctx, harness.PluginOptions{Profile: "t4"}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		slices, err := nodeSlices(ctx, nodeName)
		return n.DriverRegistered(harness.DefaultDriver) && err == nil && len(slices) > 0, nil
	})
	if err != nil {
		t.Fatalf("plugin not registered with the real kubelet or no slices: %v; plugin log:\n%s\nkubelet log (end):\n%s",
			err, n.Plugin.Log(), lastLines(n.KubeletLog(), 30))
	}

	ns := newNamespace(ctx, t, "real-kubelet")
	claim := gpuClaim(t, ns, "gpu", 1, nil)
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "smi", Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": nodeName},
			Tolerations:  []v1.Toleration{{Key: realNodeTaint.Key, Operator: v1.TolerationOpExists, Effect: realNodeTaint.Effect}},
			// The container ignores SIGTERM (sleep as PID 1 has no handler).
			TerminationGracePeriodSeconds: new(int64(1)),
			Containers: []v1.Container{{
				Name: "ctr", Image: harness.TestImageName,
				Command:   []string{"sh", "-c", "nvidia-smi -L; exec sleep 2147483647"},
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim.Name}},
		},
	}
	running, allocated := runClaimPod(ctx, t, claim, pod)
	if id := running.Status.ContainerStatuses[0].ContainerID; !strings.HasPrefix(id, "containerd://") {
		t.Errorf("container ID %q: not run by containerd", id)
	}
	results := allocated.Status.Allocation.Devices.Results
	if len(results) != 1 {
		t.Fatalf("claim allocated %d devices, want 1", len(results))
	}
	uuid := attrString(sliceDevice(ctx, t, results[0].Pool, results[0].Device), "uuid")
	if uuid == "" {
		t.Fatalf("device %s/%s has no uuid attribute", results[0].Pool, results[0].Device)
	}
	gpuLine := regexp.MustCompile(`(?m)^GPU [0-9]+: .*\(UUID: (GPU-[^)]+)\)$`)
	checkGPUs := func(what, out string) {
		t.Helper()
		var got []string
		for _, m := range gpuLine.FindAllStringSubmatch(out, -1) {
			got = append(got, m[1])
		}
		if len(got) != 1 || got[0] != uuid {
			t.Errorf("%s: nvidia-smi -L lists %v, want exactly the allocated %s; output:\n%s", what, got, uuid, out)
		}
	}

	// kubectl logs: the API server asks the kubelet's server.
	var logs string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		raw, err := cluster.Client.CoreV1().Pods(ns).GetLogs(pod.Name, &v1.PodLogOptions{Container: "ctr"}).DoRaw(ctx)
		if err != nil {
			logs = err.Error()
			return false, nil
		}
		logs = string(raw)
		return gpuLine.MatchString(logs), nil
	})
	if err != nil {
		t.Fatalf("pod log through the API server: %v; last: %s", err, logs)
	}
	checkGPUs("pods/log", logs)

	// kubectl exec: the API server upgrades to the kubelet, which streams
	// from containerd.
	out, err := podExec(ctx, ns, pod.Name, "ctr", "nvidia-smi", "-L")
	if err != nil {
		t.Fatalf("exec through the API server: %v (output %q)", err, out)
	}
	checkGPUs("pods/exec", out)
	devs, err := podExec(ctx, ns, pod.Name, "ctr", "ls", "/dev")
	if err != nil {
		t.Fatalf("exec ls /dev: %v", err)
	}
	var gpuNodes []string
	for _, f := range strings.Fields(devs) {
		if regexp.MustCompile(`^nvidia[0-9]+$`).MatchString(f) {
			gpuNodes = append(gpuNodes, f)
		}
	}
	if len(gpuNodes) != 1 || !strings.Contains(devs, "nvidiactl") || !strings.Contains(devs, "nvidia-uvm") {
		t.Errorf("container /dev has GPU nodes %v (want one) and lacks nvidiactl or nvidia-uvm? /dev: %s", gpuNodes, devs)
	}

	// The service account token volume: its CA is the kube-root-ca.crt
	// ConfigMap that kube-controller-manager's root-ca-cert-publisher
	// writes into every namespace.
	ca, err := podExec(ctx, ns, pod.Name, "ctr", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
	if err != nil || strings.TrimSpace(ca) != strings.TrimSpace(string(cluster.CA.CertPEM)) {
		t.Errorf("service account token volume's ca.crt is not the cluster CA (err %v): %q", err, ca)
	}
	if files := claimSpecFiles(t, nodeName, string(allocated.UID)); len(files) == 0 {
		t.Errorf("no CDI spec of claim %s on the node while its pod runs", allocated.UID)
	}
	// A pod still running when the node stops: its sandbox, network,
	// shim, mounts and cgroups must go with the node.
	idle := pod.DeepCopy()
	idle.Name = "idle"
	idle.Spec.ResourceClaims = nil
	idle.Spec.Containers[0].Resources = v1.ResourceRequirements{}
	idle.Spec.Containers[0].Command = nil
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, idle, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cluster.WaitPodRunning(ctx, ns, idle.Name, 60*time.Second); err != nil {
		t.Fatal(err)
	}

	deletePod(ctx, t, pod)
	if !eventually(ctx, 30*time.Second, func() bool { return len(claimSpecFiles(t, nodeName, string(allocated.UID))) == 0 }) {
		t.Errorf("CDI spec of claim %s still there after its pod was deleted: %v", allocated.UID, claimSpecFiles(t, nodeName, string(allocated.UID)))
	}

	stopping := time.Now()
	if err := cluster.RemoveNode(ctx, nodeName); err != nil {
		t.Fatal(err)
	}
	removed = true
	// Its kubelet is gone: nothing finalizes the pod object any more.
	_ = cluster.Client.CoreV1().Pods(ns).Delete(ctx, idle.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64(0))})
	t.Logf("real node stopped in %s; whole test %s", time.Since(stopping).Round(time.Millisecond), time.Since(started).Round(time.Millisecond))
	if left := n.RealNodeLeftovers(); len(left) > 0 {
		t.Errorf("left behind by the stopped real node:\n%s", strings.Join(left, "\n"))
	}
}

// realNodePod is a pod pinned to a real node (tolerating its taint) whose
// one container runs command in the test image and uses claims.
func realNodePod(ns, name, node string, command []string, claims map[string]string) *v1.Pod {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": node},
			Tolerations:  []v1.Toleration{{Key: realNodeTaint.Key, Operator: v1.TolerationOpExists, Effect: realNodeTaint.Effect}},
			// sleep as PID 1 has no SIGTERM handler.
			TerminationGracePeriodSeconds: new(int64(1)),
			Containers:                    []v1.Container{{Name: "ctr", Image: harness.TestImageName, Command: command}},
		},
	}
	names := keys(claims)
	sort.Strings(names)
	for _, ref := range names {
		claim := claims[ref]
		pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{Name: ref, ResourceClaimName: &claim})
		pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, v1.ResourceClaim{Name: ref})
	}
	return pod
}

// TestRealKubeletPodResources reads the real kubelet's PodResources API (the
// socket dcgm-exporter reads to put pod names on GPU metrics) for a running
// pod with a whole-GPU claim and a static MIG claim, on a real node with a
// simulated DGX A100 (MIG on four GPUs): Get and List name both claims with
// our driver, the pool and device each was allocated, and CDI devices whose
// specs are on the node; the pool and device names resolve through our
// ResourceSlices to the GPU UUID and to the MIG device's UUID, parent UUID
// and profile, as dcgm-exporter resolves them; the UUIDs are the ones the
// container's nvidia-smi -L lists. The KubeletPodResourcesDynamicResources
// and KubeletPodResourcesGet gates are GA and locked on since 1.36, so the
// kubelet configuration needs nothing for them.
func TestRealKubeletPodResources(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const nodeName = "real-a100"
	n := addPluginNodeWith(ctx, t, harness.NodeOptions{Name: nodeName, RealKubelet: true, Taints: []v1.Taint{realNodeTaint}},
		"dgx-a100-40gb", nil, nil)
	var static resourceapi.Device
	for _, d := range poolDevices(ctx, t, nodeName) {
		if attrString(d, "type") == "mig" && attrString(d, "uuid") != "" && (static.Name == "" || d.Name < static.Name) {
			static = d
		}
	}
	if static.Name == "" {
		t.Fatal("no static MIG device published")
	}
	ns := newNamespace(ctx, t, "podresources")
	whole := gpuClaim(t, ns, "whole", 1, nil)
	mig := pinnedClaim(ns, "mig", "mig.nvidia.com", attrString(static, "uuid"))
	if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, whole, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := realNodePod(ns, "metrics-target", nodeName, []string{"sh", "-c", "nvidia-smi -L; exec sleep 2147483647"},
		map[string]string{"gpu": whole.Name, "mig": mig.Name})
	runClaimPod(ctx, t, mig, pod)
	t.Cleanup(func() { deletePod(ctx, t, pod) })

	allocated := map[string]resourceapi.DeviceRequestAllocationResult{}
	for _, name := range []string{whole.Name, mig.Name} {
		c, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if c.Status.Allocation == nil || len(c.Status.Allocation.Devices.Results) != 1 {
			t.Fatalf("claim %s: allocation %+v, want one device", name, c.Status.Allocation)
		}
		allocated[name] = c.Status.Allocation.Devices.Results[0]
	}

	conn, err := grpc.NewClient("unix://"+n.PodResourcesSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	lister := podresourcesv1.NewPodResourcesListerClient(conn)
	got, err := lister.Get(ctx, &podresourcesv1.GetPodResourcesRequest{PodName: pod.Name, PodNamespace: ns})
	if err != nil {
		t.Fatalf("PodResources Get %s/%s: %v", ns, pod.Name, err)
	}
	list, err := lister.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		t.Fatalf("PodResources List: %v", err)
	}
	var listed *podresourcesv1.PodResources
	for _, p := range list.PodResources {
		if p.Namespace == ns && p.Name == pod.Name {
			listed = p
		}
	}
	if listed == nil {
		t.Fatalf("PodResources List has no %s/%s: %v", ns, pod.Name, list.PodResources)
	}

	logs := ""
	if !eventually(ctx, 30*time.Second, func() bool {
		raw, err := cluster.Client.CoreV1().Pods(ns).GetLogs(pod.Name, &v1.PodLogOptions{Container: "ctr"}).DoRaw(ctx)
		logs = string(raw)
		return err == nil && strings.Contains(logs, "UUID: MIG-")
	}) {
		t.Fatalf("container's nvidia-smi -L lists no MIG device: %q", logs)
	}

	node := cluster.Node(nodeName)
	for what, res := range map[string]*podresourcesv1.PodResources{"Get": got.PodResources, "List": listed} {
		if len(res.Containers) != 1 || res.Containers[0].Name != "ctr" {
			t.Errorf("%s: containers %v, want [ctr]", what, res.Containers)
			continue
		}
		t.Logf("PodResources %s: %v", what, res.Containers[0].DynamicResources)
		seen := map[string]bool{}
		for _, dr := range res.Containers[0].DynamicResources {
			want, ok := allocated[dr.ClaimName]
			if !ok || dr.ClaimNamespace != ns {
				t.Errorf("%s: dynamic resource of claim %s/%s, not one of the pod's", what, dr.ClaimNamespace, dr.ClaimName)
				continue
			}
			seen[dr.ClaimName] = true
			if len(dr.ClaimResources) != 1 {
				t.Errorf("%s: claim %s has %d resources, want 1: %v", what, dr.ClaimName, len(dr.ClaimResources), dr.ClaimResources)
				continue
			}
			cr := dr.ClaimResources[0]
			if cr.DriverName != harness.DefaultDriver || cr.PoolName != want.Pool || cr.DeviceName != want.Device {
				t.Errorf("%s: claim %s is %s/%s/%s, allocated %s/%s/%s", what, dr.ClaimName,
					cr.DriverName, cr.PoolName, cr.DeviceName, want.Driver, want.Pool, want.Device)
				continue
			}
			if len(cr.CdiDevices) == 0 {
				t.Errorf("%s: claim %s has no CDI devices", what, dr.ClaimName)
			}
			for _, cdi := range cr.CdiDevices {
				if _, err := harness.ResolveCDI(node.CDIRoot, cdi.Name); err != nil {
					t.Errorf("%s: claim %s CDI device %s: %v", what, dr.ClaimName, cdi.Name, err)
				}
			}
			// What dcgm-exporter does with them: the device of the slice
			// named by pool and device carries the identity NVML reports.
			d := sliceDevice(ctx, t, cr.PoolName, cr.DeviceName)
			uuid := attrString(d, "uuid")
			if uuid == "" || !strings.Contains(logs, "(UUID: "+uuid+")") {
				t.Errorf("%s: claim %s resolves to device %s with uuid %q, not one the container lists:\n%s", what, dr.ClaimName, d.Name, uuid, logs)
			}
			switch dr.ClaimName {
			case whole.Name:
				if attrString(d, "type") != "gpu" || !strings.HasPrefix(uuid, "GPU-") {
					t.Errorf("%s: claim %s resolves to %s (type %q, uuid %q), want a whole GPU", what, dr.ClaimName, d.Name, attrString(d, "type"), uuid)
				}
			case mig.Name:
				parent, profile := attrString(d, "parentUUID"), attrString(d, "profile")
				if uuid != attrString(static, "uuid") || !strings.HasPrefix(uuid, "MIG-") || profile != attrString(static, "profile") ||
					parent == "" || !strings.Contains(logs, "(UUID: "+parent+")") {
					t.Errorf("%s: claim %s resolves to %s: uuid %q parentUUID %q profile %q; pinned %s (profile %q); container lists:\n%s",
						what, dr.ClaimName, d.Name, uuid, parent, profile, attrString(static, "uuid"), attrString(static, "profile"), logs)
				}
			}
		}
		if len(seen) != len(allocated) {
			t.Errorf("%s: dynamic resources of claims %v, want %v: %v", what, keys(seen), keys(allocated), res.Containers[0].DynamicResources)
		}
	}
}

// podExec runs a command in a pod's container through the API server's
// pods/exec (SPDY, as kubectl falls back to) and returns its stdout.
func podExec(ctx context.Context, ns, pod, container string, command ...string) (string, error) {
	req := cluster.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&v1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exec, err := remotecommand.NewSPDYExecutor(cluster.AdminConfig, "POST", req.URL())
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	err = exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		return stdout.String(), fmt.Errorf("%w; stderr: %s", err, stderr.String())
	}
	return stdout.String(), nil
}

// lastLines is the end of a log, for failure messages.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// TestRealKubeletWorkloads is what a user does with a cluster, on a real
// node with a simulated DGX H100 (8 GPUs): a Deployment of 2 replicas whose
// pods each get a GPU from a ResourceClaimTemplate becomes Available (the
// Deployment and ReplicaSet controllers of kube-controller-manager, the
// kubelet's readiness), scales to 3 and back to 2 (the pod that goes has its
// generated claim deleted and its CDI spec removed); a pod with
// restartPolicy Always whose container exits is restarted by the kubelet
// (restartCount grows, the last exit is in lastState); the kubelet's events
// for these pods are in the API, as `kubectl get events` lists them.
func TestRealKubeletWorkloads(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const nodeName = "real-h100"
	addPluginNodeWith(ctx, t, harness.NodeOptions{Name: nodeName, RealKubelet: true, Taints: []v1.Taint{realNodeTaint}},
		"dgx-h100", nil, nil)
	ns := newNamespace(ctx, t, "real-workloads")

	template := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: ns},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: gpuClaim(t, ns, "", 1, nil).Spec},
	}
	if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	podSpec := realNodePod(ns, "", nodeName, nil, nil).Spec
	podSpec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template.Name}}
	podSpec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu"}}
	labels := map[string]string{"app": "gpu-workers"}
	deploy := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu-workers", Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: new(int32(2)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: v1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: podSpec},
		},
	}
	deployments := cluster.Client.AppsV1().Deployments(ns)
	if _, err := deployments.Create(ctx, deploy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	// available waits until the Deployment has exactly n available replicas
	// and n pods, each with its own allocated claim, and returns the claims.
	available := func(n int32) []resourceapi.ResourceClaim {
		t.Helper()
		var last string
		var claims []resourceapi.ResourceClaim
		ok := eventually(ctx, 90*time.Second, func() bool {
			d, err := deployments.Get(ctx, deploy.Name, metav1.GetOptions{})
			if err != nil {
				last = err.Error()
				return false
			}
			pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=gpu-workers"})
			if err != nil {
				return false
			}
			list, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false
			}
			claims = list.Items
			last = fmt.Sprintf("replicas %d, available %d, ready %d, pods %d, claims %d; conditions %v",
				d.Status.Replicas, d.Status.AvailableReplicas, d.Status.ReadyReplicas, len(pods.Items), len(claims), d.Status.Conditions)
			allocated := 0
			for _, c := range claims {
				if c.Status.Allocation != nil {
					allocated++
				}
			}
			return d.Status.AvailableReplicas == n && d.Status.Replicas == n && len(pods.Items) == int(n) &&
				len(claims) == int(n) && allocated == int(n)
		})
		if !ok {
			t.Fatalf("Deployment not at %d available replicas: %s", n, last)
		}
		return claims
	}
	available(2)
	t.Logf("Deployment of 2 available after %s", time.Since(started).Round(time.Millisecond))
	scale := func(n int32) {
		t.Helper()
		s, err := deployments.GetScale(ctx, deploy.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		s.Spec.Replicas = n
		if _, err := deployments.UpdateScale(ctx, deploy.Name, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	scale(3)
	three := available(3)
	scale(2)
	two := available(2)
	kept := map[string]bool{}
	for _, c := range two {
		kept[string(c.UID)] = true
	}
	for _, c := range three {
		if !kept[string(c.UID)] {
			if !eventually(ctx, 30*time.Second, func() bool { return len(claimSpecFiles(t, nodeName, string(c.UID))) == 0 }) {
				t.Errorf("CDI spec of the removed replica's claim %s still there: %v", c.Name, claimSpecFiles(t, nodeName, string(c.UID)))
			}
		}
	}
	t.Logf("scaled to 3 and back to 2 after %s", time.Since(started).Round(time.Millisecond))

	// restartPolicy Always: the kubelet starts the exited container again.
	crash := realNodePod(ns, "crash", nodeName, []string{"sh", "-c", "echo run; sleep 1; exit 3"}, nil)
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, crash, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var st v1.ContainerStatus
	if !eventually(ctx, 60*time.Second, func() bool {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, crash.Name, metav1.GetOptions{})
		if err != nil || len(p.Status.ContainerStatuses) != 1 {
			return false
		}
		st = p.Status.ContainerStatuses[0]
		return p.Status.Phase == v1.PodRunning && st.RestartCount >= 2
	}) {
		t.Fatalf("container not restarted twice: %+v", st)
	}
	if last := st.LastTerminationState.Terminated; last == nil || last.ExitCode != 3 {
		t.Errorf("lastState %+v, want terminated with exit code 3", st.LastTerminationState)
	}
	t.Logf("restartCount %d after %s", st.RestartCount, time.Since(started).Round(time.Millisecond))

	// kubectl get events: the kubelet's events for the crashing pod.
	reasons := map[string]bool{}
	if !eventually(ctx, 30*time.Second, func() bool {
		events, err := cluster.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
			FieldSelector: "involvedObject.name=" + crash.Name + ",source=kubelet",
		})
		if err != nil {
			return false
		}
		for _, e := range events.Items {
			if e.Source.Host == nodeName {
				reasons[e.Reason] = true
			}
		}
		return reasons["Started"] && reasons["BackOff"] && (reasons["Pulled"] || reasons["Created"])
	}) {
		t.Errorf("kubelet events for pod %s: reasons %v, want Started, BackOff and Pulled or Created", crash.Name, keys(reasons))
	}
}

// TestRealNodeImageCatalogue runs pods of the real nodes' image catalogue
// (harness/nodeimages.go) on a real node with a simulated T4, pulled by the
// kubelet from the cluster's registry under tags nothing here names: Ubuntu
// and Debian run bash, busybox has none (as the real images), a CUDA image
// has the real image's environment, a CUDA sample's /tmp/sample (the
// simulated CUDA program) finds the claimed GPU; an image outside the
// catalogue fails with ErrImagePull.
func TestRealNodeImageCatalogue(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const nodeName = "real-images"
	addPluginNodeWith(ctx, t, harness.NodeOptions{Name: nodeName, RealKubelet: true, Taints: []v1.Taint{realNodeTaint}},
		"t4", nil, nil)
	ns := newNamespace(ctx, t, "real-images")
	claim := gpuClaim(t, ns, "gpu", 1, nil)
	if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	const hold = "; exec sleep 2147483647"
	cases := []struct {
		name, image string
		command     []string
		claims      map[string]string
		want        []string // lines the log must have
	}{
		{"ubuntu", "ubuntu:24.04", []string{"bash", "-c", `echo "bash ${BASH_VERSION%%.*}"` + hold}, nil, []string{"bash 5"}},
		{"debian", "debian:bookworm-slim", []string{"bash", "-c", `echo "bash ${BASH_VERSION%%.*}"` + hold}, nil, []string{"bash 5"}},
		{"busybox", "busybox:1.37", []string{"sh", "-c", "command -v bash || echo no bash" + hold}, nil, []string{"no bash"}},
		{"cuda", "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04", []string{"bash", "-c", `echo "$NVIDIA_VISIBLE_DEVICES $NVIDIA_DRIVER_CAPABILITIES $CUDA_VERSION"` + hold},
			nil, []string{"all compute,utility 12.0.0"}},
		{"sample", "nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0", nil, map[string]string{"gpu": claim.Name}, nil},
	}
	for _, tc := range cases {
		pod := realNodePod(ns, tc.name, nodeName, tc.command, tc.claims)
		pod.Spec.Containers[0].Image = tc.image
		pod.Spec.RestartPolicy = v1.RestartPolicyNever
		if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	unknown := realNodePod(ns, "unknown", nodeName, nil, nil)
	unknown.Spec.Containers[0].Image = "quay.io/e2e/not-in-the-catalogue:1"
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, unknown, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	for _, tc := range cases {
		var logs string
		if !eventually(ctx, 60*time.Second, func() bool {
			raw, err := cluster.Client.CoreV1().Pods(ns).GetLogs(tc.name, &v1.PodLogOptions{}).DoRaw(ctx)
			logs = string(raw)
			if err != nil || logs == "" {
				return false
			}
			for _, w := range tc.want {
				if !strings.Contains(logs, w+"\n") {
					return false
				}
			}
			return true
		}) {
			p, _ := cluster.Client.CoreV1().Pods(ns).Get(ctx, tc.name, metav1.GetOptions{})
			t.Errorf("%s (%s): log %q, want lines %q; %s", tc.name, tc.image, logs, tc.want, harness.PodProblem(p))
			continue
		}
		if tc.name == "sample" {
			got, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
			if err != nil || got.Status.Allocation == nil || len(got.Status.Allocation.Devices.Results) != 1 {
				t.Fatalf("claim %s not allocated: %v", claim.Name, err)
			}
			res := got.Status.Allocation.Devices.Results[0]
			uuid := attrString(sliceDevice(ctx, t, res.Pool, res.Device), "uuid")
			if !strings.Contains(logs, uuid) {
				t.Errorf("/tmp/sample of the CUDA sample image does not see the claimed GPU %s: %q", uuid, logs)
			}
		}
	}
	var state v1.ContainerState
	if !eventually(ctx, 60*time.Second, func() bool {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, unknown.Name, metav1.GetOptions{})
		if err != nil || len(p.Status.ContainerStatuses) != 1 {
			return false
		}
		state = p.Status.ContainerStatuses[0].State
		return state.Waiting != nil && (state.Waiting.Reason == "ErrImagePull" || state.Waiting.Reason == "ImagePullBackOff")
	}) {
		t.Errorf("pod of an image outside the catalogue: state %+v, want waiting with ErrImagePull", state)
	} else {
		t.Logf("image outside the catalogue: %s: %s", state.Waiting.Reason, state.Waiting.Message)
	}
}
