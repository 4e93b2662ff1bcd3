package harness

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
)

// TestRealNodePowerCycle: a real node (kubelet and containerd) runs a pod
// with a one-GPU claim; PowerOff leaves no process of the node, no mount,
// cgroup, containerd or runc state nor CDI spec, and keeps the disk (the
// kubelet's DRA checkpoint, the container's log, containerd's images);
// while off, the node lifecycle controller marks the same Node not ready;
// PowerOn brings the kubelet back, which makes a new sandbox and container
// for the pod (restartPolicy Always) after the plugin prepared the claim
// again (its CDI spec is back), and `nvidia-smi -L` through the API
// server's exec lists the same GPU; removing the node then leaves nothing.
func TestRealNodePowerCycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if _, err := c.InstallDriver(ctx, InstallOptions{}); err != nil {
		t.Fatal(err)
	}
	const name = "real-reboot"
	// The chart's webhook Deployment stays off the node (its image is not
	// in the catalogue; the node would only retry pulling it).
	taint := v1.Taint{Key: "e2e.gpu-dra/real-node", Effect: v1.TaintEffectNoSchedule}
	n, err := c.AddNode(ctx, NodeOptions{Name: name, RealKubelet: true, Taints: []v1.Taint{taint}})
	if err != nil {
		t.Fatal(err)
	}
	removed := false
	defer func() {
		if !removed {
			_ = c.RemoveNode(context.Background(), name)
		}
	}()
	if err := n.WriteBootID(NewBootID()); err != nil {
		t.Fatal(err)
	}
	if _, err := n.StartPlugin(ctx, PluginOptions{Profile: "t4", BootIDFile: n.BootIDFile()}); err != nil {
		t.Fatal(err)
	}
	var slices *resourceapi.ResourceSliceList
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		slices, err = c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		return n.DriverRegistered(DefaultDriver) && err == nil && len(slices.Items) > 0, nil
	}); err != nil {
		t.Fatalf("plugin not registered or no slices: %v; plugin log:\n%s", err, n.Plugin.Log())
	}

	const ns = "default"
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu", Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com"},
		}}}},
	}
	if claim, err = c.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "smi", Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:  map[string]string{"kubernetes.io/hostname": name},
			Tolerations:   []v1.Toleration{{Key: taint.Key, Operator: v1.TolerationOpExists, Effect: taint.Effect}},
			RestartPolicy: v1.RestartPolicyAlways,
			// sleep as PID 1 has no SIGTERM handler.
			TerminationGracePeriodSeconds: new(int64(1)),
			Containers: []v1.Container{{
				Name: "ctr", Image: TestImageName,
				Command:   []string{"sh", "-c", "nvidia-smi -L; exec sleep 2147483647"},
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim.Name}},
		},
	}
	if _, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if pod, err = c.WaitPodRunning(ctx, ns, pod.Name, 100*time.Second); err != nil {
		t.Fatalf("%v; kubelet log:\n%s", err, tail(filepath.Join(n.Dir, "kubelet.log"), 30))
	}
	if claim, err = c.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	uuid := allocatedUUID(t, claim, slices.Items)
	checkSMI := func(when string) {
		t.Helper()
		out, err := execThroughAPIServer(ctx, c, pod, "ctr", "nvidia-smi", "-L")
		got := regexp.MustCompile(`\(UUID: (GPU-[^)]+)\)`).FindAllStringSubmatch(out, -1)
		if err != nil || len(got) != 1 || got[0][1] != uuid {
			t.Errorf("%s: nvidia-smi -L through the API server (err %v) lists %q, want exactly %s", when, err, out, uuid)
		}
	}
	checkSMI("before the power cycle")
	sandboxesBefore, err := n.PodSandboxes(ctx, pod)
	if err != nil || len(sandboxesBefore) != 1 || !sandboxesBefore[0].Ready {
		t.Fatalf("sandboxes of the running pod: %+v (%v), want one ready", sandboxesBefore, err)
	}
	containerBefore := pod.Status.ContainerStatuses[0].ContainerID
	specsOfClaim := func() []string {
		t.Helper()
		specs, err := ReadCDISpecs(n.CDIRoot)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, s := range specs {
			named := strings.Contains(s.Path, string(claim.UID))
			for _, d := range s.Devices {
				named = named || strings.Contains(d.Name, string(claim.UID))
			}
			if named {
				out = append(out, s.Path)
			}
		}
		return out
	}
	if len(specsOfClaim()) == 0 {
		t.Fatalf("no CDI spec of claim %s while its pod runs", claim.UID)
	}
	draCheckpoint := filepath.Join(n.real.kubeletRoot, "dra_manager_state")
	checkpointBefore, err := os.ReadFile(draCheckpoint)
	if err != nil || !bytes.Contains(checkpointBefore, []byte(claim.UID)) {
		t.Fatalf("the kubelet's DRA checkpoint %s does not hold claim %s (%v): %s", draCheckpoint, claim.UID, err, checkpointBefore)
	}
	logsBefore, _ := filepath.Glob(filepath.Join(n.Dir, "pod-logs", ns+"_"+pod.Name+"_*", "ctr", "*.log"))
	if len(logsBefore) == 0 {
		t.Fatalf("no log file of the container under %s", filepath.Join(n.Dir, "pod-logs"))
	}
	nodeBefore, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}

	off := time.Now()
	if err := n.PowerOff(); err != nil {
		t.Fatal(err)
	}
	t.Logf("powered off in %s", time.Since(off).Round(time.Millisecond))
	if left := n.PoweredOffLeftovers(); len(left) > 0 {
		t.Errorf("left after power-off:\n%s", strings.Join(left, "\n"))
	}
	if containerdSocket := filepath.Join(n.real.dir, "containerd.sock"); isFile(containerdSocket) {
		t.Errorf("containerd's socket %s survived the power loss", containerdSocket)
	}
	if got, err := os.ReadFile(draCheckpoint); err != nil || !bytes.Equal(got, checkpointBefore) {
		t.Errorf("the kubelet's DRA checkpoint changed or went with the power loss (%v)", err)
	}
	for _, f := range logsBefore {
		if !isFile(f) {
			t.Errorf("container log %s went with the power loss", f)
		}
	}
	if entries, err := os.ReadDir(filepath.Join(n.real.dir, "root")); err != nil || len(entries) == 0 {
		t.Errorf("containerd's root (images, snapshots) went with the power loss (%v)", err)
	}
	// The Node object stays; kube-controller-manager's node lifecycle
	// controller notices the silent kubelet after its grace period.
	notReady := ""
	if err := wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if node.UID != nodeBefore.UID {
			return false, nil
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == v1.NodeReady && cond.Status != v1.ConditionTrue {
				notReady = string(cond.Status) + " " + cond.Reason
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Errorf("Node %s (uid %s) not marked not ready while off: %v", name, nodeBefore.UID, err)
	}
	t.Logf("Node marked Ready=%s after %s off", notReady, time.Since(off).Round(time.Second))

	on := time.Now()
	if err := n.PowerOn(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("powered on, Node Ready after %s", time.Since(on).Round(time.Millisecond))
	var last string
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		if len(p.Status.ContainerStatuses) != 1 {
			return false, nil
		}
		st := p.Status.ContainerStatuses[0]
		last = st.String()
		return st.State.Running != nil && st.ContainerID != containerBefore, nil
	}); err != nil {
		t.Fatalf("pod's container not running again after power-on: %v; last status %s; kubelet log:\n%s", err, last,
			tail(filepath.Join(n.Dir, "kubelet.log"), 40))
	}
	t.Logf("pod running again %s after power-on (restartCount %d)", time.Since(on).Round(time.Millisecond), pod.Status.ContainerStatuses[0].RestartCount)
	if pod.Spec.NodeName != name || pod.UID == "" {
		t.Errorf("pod moved: node %q", pod.Spec.NodeName)
	}
	sandboxes, err := n.PodSandboxes(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	var ready []PodSandbox
	for _, s := range sandboxes {
		if s.Ready {
			ready = append(ready, s)
		}
	}
	if len(ready) != 1 || ready[0].ID == sandboxesBefore[0].ID {
		t.Errorf("sandboxes after power-on %+v, before %+v: want one new ready sandbox", sandboxes, sandboxesBefore)
	}
	if len(specsOfClaim()) == 0 {
		t.Errorf("no CDI spec of claim %s after power-on: not prepared again", claim.UID)
	}
	if got := strings.Count(n.Plugin.Log(), "the node rebooted since it was prepared"); got != 1 {
		t.Errorf("plugin log names the reboot as the reason to prepare again %d times, want 1", got)
	}
	checkSMI("after the power cycle")
	node, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil || node.UID != nodeBefore.UID {
		t.Errorf("Node after power-on: uid %v (%v), before %s", node.UID, err, nodeBefore.UID)
	}

	if err := c.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitPodGone(ctx, ns, pod.Name, time.Minute); err != nil {
		t.Fatal(err)
	}
	if left := specsOfClaim(); len(left) > 0 {
		t.Errorf("CDI spec of claim %s left after its pod went: %v", claim.UID, left)
	}
	// The sandbox and container from before the power loss, which
	// containerd still knew from its root, go with the node as well.
	removed = true
	if err := c.RemoveNode(ctx, name); err != nil {
		t.Fatal(err)
	}
	if left := n.RealNodeLeftovers(); len(left) > 0 {
		t.Errorf("left behind by the node after its power cycle:\n%s", strings.Join(left, "\n"))
	}
}

// allocatedUUID is the uuid attribute of a one-device claim's device.
func allocatedUUID(t *testing.T, claim *resourceapi.ResourceClaim, slices []resourceapi.ResourceSlice) string {
	t.Helper()
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim %s: allocation %+v, want one device", claim.Name, claim.Status.Allocation)
	}
	res := claim.Status.Allocation.Devices.Results[0]
	for _, s := range slices {
		if s.Spec.Pool.Name != res.Pool {
			continue
		}
		for _, d := range s.Spec.Devices {
			if d.Name == res.Device && d.Attributes["uuid"].StringValue != nil {
				return *d.Attributes["uuid"].StringValue
			}
		}
	}
	t.Fatalf("device %s/%s of claim %s has no uuid in the node's slices", res.Pool, res.Device, claim.Name)
	return ""
}

// execThroughAPIServer runs a command in a pod's container through the API
// server's pods/exec, which the kubelet serves: what `kubectl exec` does.
func execThroughAPIServer(ctx context.Context, c *Cluster, pod *v1.Pod, container string, command ...string) (string, error) {
	req := c.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(pod.Namespace).Name(pod.Name).SubResource("exec").
		VersionedParams(&v1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exec, err := remotecommand.NewSPDYExecutor(c.AdminConfig, "POST", req.URL())
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	if err := exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr}); err != nil {
		return stdout.String(), err
	}
	return stdout.String(), nil
}
