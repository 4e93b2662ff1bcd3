package deployed

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	resourceclient "k8s.io/client-go/kubernetes/typed/resource/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-dra/e2e/harness"
)

// The chart's names for release harness.HelmRelease.
const (
	nodeRestrictionPolicy = harness.HelmRelease + "-gpu-dra-driver-node-restriction"
	pluginAccount         = harness.HelmRelease + "-gpu-dra-driver-kubelet-plugin"
	daemonAccount         = harness.HelmRelease + "-gpu-dra-driver-mps-daemon"
	webhookSecret         = harness.HelmRelease + "-gpu-dra-driver-webhook-tls"
)

// TestNodePluginCredentialsStayOnTheirNode: a node plugin's own credentials
// (its service-account token bound to its pod, which carries the node name)
// can do what the plugin does and nothing else, as the API server decides
// with the chart's node-restriction policy. The plugin creates an MPS
// daemon pod (with the chart's daemon account, no token, and the plugin
// pod's image pull secrets and pull policy); with the plugin's token a copy
// of that pod and its own node's slices are admitted, while a daemon pod
// with another service account, a Secret volume, a mounted token, another
// image, or any other change to the shape the plugin gives it (pull secrets,
// host namespaces, priority class, command, ports, mounts, environment), and
// a slice of another pool or driver, are each refused by the policy. Every request of the token is a dry run, so an admitted one
// changes nothing (and the test fails cleanly against a looser policy).
func TestNodePluginCredentialsStayOnTheirNode(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutContainerDriver
	n := addNode(t, "node-restricted", layout, "t4")
	install(t, append(layout.HelmValues(), "imagePullSecrets[0].name=registry-a", "image.pullPolicy=Always")...)
	plugin := waitPlugin(ctx, t, n, "")

	// The plugin's own daemon pod gets through the policy.
	pod, daemon, _ := runMPSWorkload(ctx, t, n, plugin, "restricted")
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{})
		_ = cluster.WaitPodGone(context.Background(), pod.Namespace, pod.Name, 60*time.Second)
	})
	spec := daemon.Spec
	secrets := []string{}
	for _, s := range spec.ImagePullSecrets {
		secrets = append(secrets, s.Name)
	}
	if spec.ServiceAccountName != daemonAccount || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken ||
		!slices.Equal(secrets, []string{"registry-a"}) || spec.Containers[0].ImagePullPolicy != v1.PullAlways {
		t.Errorf("daemon pod runs as %q (token mounted: %v) with pull secrets %v and pull policy %q; want %q, no token, [registry-a], Always",
			spec.ServiceAccountName, spec.AutomountServiceAccountToken, secrets, spec.Containers[0].ImagePullPolicy, daemonAccount)
	}
	for _, v := range spec.Volumes {
		if v.HostPath == nil {
			t.Errorf("daemon pod volume %s is not a hostPath volume: %+v", v.Name, v.VolumeSource)
		}
	}

	// The plugin's credentials, as its container has them: its account's
	// token bound to its pod.
	tr, err := cluster.Client.CoreV1().ServiceAccounts(harness.DriverNamespace).CreateToken(ctx, pluginAccount, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{BoundObjectRef: &authv1.BoundObjectReference{
			Kind: "Pod", APIVersion: "v1", Name: plugin.Pod.Name, UID: plugin.Pod.UID,
		}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	as, err := kubernetes.NewForConfig(cluster.TokenConfig(tr.Status.Token))
	if err != nil {
		t.Fatal(err)
	}
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}

	// Daemon pods: the plugin's own spec is admitted, each escape refused.
	pods := as.CoreV1().Pods(harness.DriverNamespace)
	variant := func(edit func(*v1.Pod)) *v1.Pod {
		p := &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{
				Name: daemon.Name + "-x", Namespace: daemon.Namespace,
				Labels: daemon.Labels, Annotations: daemon.Annotations,
			},
			Spec: *daemon.Spec.DeepCopy(),
		}
		if edit != nil {
			edit(p)
		}
		return p
	}
	// The API server starts enforcing a policy created with the chart a moment later (its
	// policy informer): wait until an escape is refused before checking each one.
	otherImage := func(p *v1.Pod) { p.Spec.Containers[0].Image = "busybox:latest" }
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := pods.Create(ctx, variant(otherImage), dryRun)
		return err != nil, nil
	}); err != nil {
		t.Errorf("the node-restriction policy is not enforced 30 s after the install")
	}
	if _, err := pods.Create(ctx, variant(nil), dryRun); err != nil {
		t.Errorf("the plugin's credentials may not create a daemon pod as the plugin makes it: %v", err)
	}
	for _, c := range []struct {
		what string
		edit func(*v1.Pod)
		want string
	}{
		{"the plugin's own service account", func(p *v1.Pod) { p.Spec.ServiceAccountName = pluginAccount; p.Spec.DeprecatedServiceAccount = "" },
			"only create pods with service account " + daemonAccount},
		{"a Secret volume (the webhook's TLS key)", func(p *v1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: "tls", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: webhookSecret}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, v1.VolumeMount{Name: "tls", MountPath: "/tls"})
		}, "whose volumes are hostPath volumes"},
		{"a mounted service account token", func(p *v1.Pod) { p.Spec.AutomountServiceAccountToken = new(true) },
			"automountServiceAccountToken: false"},
		{"another image", otherImage, "whose containers run "},
		// The rest of the shape the plugin makes (sharing/pods.rs): each change refused.
		{"a pull secret the chart does not name (the webhook's TLS key)", func(p *v1.Pod) {
			p.Spec.ImagePullSecrets = append(p.Spec.ImagePullSecrets, v1.LocalObjectReference{Name: webhookSecret})
		}, "image pull secrets are the chart's imagePullSecrets"},
		{"the host's network", func(p *v1.Pod) { p.Spec.HostNetwork = true }, "without hostNetwork, hostPID or hostIPC"},
		{"the host's PIDs", func(p *v1.Pod) { p.Spec.HostPID = true }, "without hostNetwork, hostPID or hostIPC"},
		{"the host's IPC", func(p *v1.Pod) { p.Spec.HostIPC = true }, "without hostNetwork, hostPID or hostIPC"},
		{"another priority class", func(p *v1.Pod) { p.Spec.PriorityClassName = "system-cluster-critical"; p.Spec.Priority = nil },
			"of priority class"},
		{"a shell of the driver root", func(p *v1.Pod) { p.Spec.Containers[0].Command = []string{"/driver-root/bin/sh", "-c", "id"} },
			"runs nvidia-cuda-mps-control -f [-M]"},
		{"arguments", func(p *v1.Pod) { p.Spec.Containers[0].Args = []string{"-d"} }, "nvidia-cuda-mps-control -f [-M]"},
		{"a port", func(p *v1.Pod) { p.Spec.Containers[0].Ports = []v1.ContainerPort{{ContainerPort: 22}} }, "no ports"},
		{"the driver root read-write", func(p *v1.Pod) {
			for i := range p.Spec.Containers[0].VolumeMounts {
				if p.Spec.Containers[0].VolumeMounts[i].Name == "driver-root" {
					p.Spec.Containers[0].VolumeMounts[i].ReadOnly = false
				}
			}
		}, "mount the driver root read-only"},
		{"the driver root as the MPS folder", func(p *v1.Pod) {
			for i := range p.Spec.Volumes {
				if p.Spec.Volumes[i].Name == "mps" && p.Spec.Volumes[i].HostPath != nil {
					p.Spec.Volumes[i].HostPath.Path = harness.ContainerDriverRoot
				}
			}
		}, "their MPS folder at its own path"},
		{"LD_PRELOAD of another library", func(p *v1.Pod) {
			p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, v1.EnvVar{Name: "LD_PRELOAD", Value: "/tmp/evil.so"})
		}, "LD_PRELOAD of the driver's libcuda"},
		{"another variable name", func(p *v1.Pod) {
			p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, v1.EnvVar{Name: "LD_LIBRARY_PATH", Value: "/tmp"})
		}, "of the MPS daemon's names"},
		{"a value of 5000 bytes", func(p *v1.Pod) {
			p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, v1.EnvVar{Name: "PATH", Value: strings.Repeat("x", 5000)})
		}, "each value at most 4096 bytes"},
	} {
		_, err := pods.Create(ctx, variant(c.edit), dryRun)
		checkRefused(t, "daemon pod with "+c.what, err, c.want)
	}

	// ResourceSlices: its own pool (the node's name) and driver only.
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + n.Name})
	if err != nil || len(list.Items) == 0 {
		t.Fatalf("no slice of %s: %v", n.Name, err)
	}
	own := list.Items[0]
	sliceAPI := as.ResourceV1().ResourceSlices()
	sliceVariant := func(edit func(*resourceapi.ResourceSlice)) *resourceapi.ResourceSlice {
		s := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: own.Name + "-x"}, Spec: *own.Spec.DeepCopy()}
		if edit != nil {
			edit(s)
		}
		return s
	}
	if _, err := sliceAPI.Create(ctx, sliceVariant(nil), dryRun); err != nil {
		t.Errorf("the plugin's credentials may not create a slice of its own pool: %v", err)
	}
	if err := updateSlice(ctx, sliceAPI, own.Name); err != nil {
		t.Errorf("the plugin's credentials may not update its own slice: %v", err)
	}
	other := "node-someone-else"
	_, err = sliceAPI.Create(ctx, sliceVariant(func(s *resourceapi.ResourceSlice) {
		s.Spec.Pool = resourceapi.ResourcePool{Name: other, Generation: 1 << 40, ResourceSliceCount: 1}
	}), dryRun)
	checkRefused(t, "a slice of another node's pool (with a high generation)", err,
		fmt.Sprintf("may only write ResourceSlices of pool %s (its node), not %q", n.Name, other))
	_, err = sliceAPI.Create(ctx, sliceVariant(func(s *resourceapi.ResourceSlice) { s.Spec.Driver = "other.example.com" }), dryRun)
	checkRefused(t, "a slice of another driver", err, "may only write ResourceSlices of driver "+harness.DefaultDriver)
	// (An update cannot move a slice to another pool or driver: the API
	// server's validation keeps both immutable.)

	checkClaimStatusWrites(ctx, t, as, n.Name)
}

// checkClaimStatusWrites: with the plugin's credentials, device status of
// our driver in a claim allocated on its node and pool is admitted (as the
// plugin writes it: server-side apply of the status by its node's field
// manager, here as a dry run); another node's claim, an entry of another
// node's pool in a claim of its node, another driver's entry and a change of
// status.reservedFor are refused.
func checkClaimStatusWrites(ctx context.Context, t *testing.T, as kubernetes.Interface, node string) {
	t.Helper()
	const ns = "default"
	other := "node-someone-else"
	// A claim allocated (by the admin, as the scheduler would) on nodeName
	// with these results.
	allocated := func(name, nodeName string, results []resourceapi.DeviceRequestAllocationResult) *resourceapi.ResourceClaim {
		t.Helper()
		claims := cluster.Client.ResourceV1().ResourceClaims(ns)
		c, err := claims.Create(ctx, &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com"},
			}}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = claims.Delete(context.Background(), name, metav1.DeleteOptions{}) })
		c.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: results},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
				Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{nodeName},
			}}}}},
		}
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p", UID: "1f0f7a6c-0000-4000-8000-000000000001"}}
		if c, err = claims.UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		return c
	}
	result := func(driver, pool, device string) resourceapi.DeviceRequestAllocationResult {
		return resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: driver, Pool: pool, Device: device}
	}
	own := allocated("status-own-node", node, []resourceapi.DeviceRequestAllocationResult{
		result(harness.DefaultDriver, node, "gpu-0"),
		result(harness.DefaultDriver, other, "gpu-0"),
		result("other.example.com", node, "nic-0"),
	})
	theirs := allocated("status-other-node", other, []resourceapi.DeviceRequestAllocationResult{
		result(harness.DefaultDriver, other, "gpu-0"),
	})
	entry := func(driver, pool, device string) string {
		return fmt.Sprintf(`{"driver":%q,"pool":%q,"device":%q,"data":{"uuid":"GPU-0"},`+
			`"conditions":[{"type":"Ready","status":"True","reason":"Prepared","message":"","lastTransitionTime":"2026-01-01T00:00:00Z"}]}`,
			driver, pool, device)
	}
	apply := func(c *resourceapi.ResourceClaim, status string) error {
		patch := fmt.Sprintf(`{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{"name":%q,"namespace":%q,"uid":%q},"status":%s}`,
			c.Name, ns, c.UID, status)
		_, err := as.ResourceV1().ResourceClaims(ns).Patch(ctx, c.Name, types.ApplyPatchType, []byte(patch), metav1.PatchOptions{
			FieldManager: harness.DefaultDriver + "/" + node, Force: ptr.To(true), DryRun: []string{metav1.DryRunAll},
		}, "status")
		return err
	}
	devices := func(entries ...string) string { return `{"devices":[` + strings.Join(entries, ",") + `]}` }

	if err := apply(own, devices(entry(harness.DefaultDriver, node, "gpu-0"))); err != nil {
		t.Errorf("the plugin's credentials may not write its device status in a claim of its node: %v", err)
	}
	// The API server itself checks the driver and the claim's node (its
	// resourceclaims/driver authorization, before admission); the policy
	// refuses the same where that check is off. Either refusal counts.
	checkStatusRefused(t, "a claim allocated on another node", apply(theirs, devices(entry(harness.DefaultDriver, other, "gpu-0"))),
		"may only write status.devices entries of pool "+node)
	checkStatusRefused(t, "another driver's entry", apply(own, devices(entry("other.example.com", node, "nic-0"))),
		"may only write status.devices entries of driver "+harness.DefaultDriver)
	checkStatusRefused(t, "a consumer added to status.reservedFor",
		apply(own, `{"reservedFor":[{"resource":"pods","name":"q","uid":"1f0f7a6c-0000-4000-8000-000000000002"}]}`),
		"not status.allocation or status.reservedFor")
	// A claim of its node with a device of another node's pool passes the API
	// server's own check (our driver, the claim's node is the plugin's): the
	// policy alone refuses it.
	checkRefused(t, "an entry of another node's pool in a claim of its node",
		apply(own, devices(entry(harness.DefaultDriver, other, "gpu-0"))),
		fmt.Sprintf("may only write status.devices entries of pool %s (the devices of its node), not %s/%s/gpu-0", node, harness.DefaultDriver, other))
}

// checkStatusRefused asserts that a claim status write was refused, by the
// node-restriction policy (saying want) or by the API server's own
// authorization of status.devices and status.reservedFor writes.
func checkStatusRefused(t *testing.T, what string, err error, want string) {
	t.Helper()
	if err != nil && apierrors.IsInvalid(err) &&
		(strings.Contains(err.Error(), `resourceclaims/driver`) || strings.Contains(err.Error(), `resourceclaims/binding`)) {
		t.Logf("%s: refused by the API server's authorization: %v", what, err)
		return
	}
	checkRefused(t, what, err, want)
}

// updateSlice reads the slice (as the admin) and writes it back unchanged
// through client as a dry run, again when the publisher changed it meanwhile.
func updateSlice(ctx context.Context, client resourceclient.ResourceSliceInterface, name string) error {
	var err error
	for range 5 {
		var s *resourceapi.ResourceSlice
		s, err = cluster.Client.ResourceV1().ResourceSlices().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		_, err = client.Update(ctx, s, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		if !apierrors.IsConflict(err) {
			return err
		}
	}
	return err
}

// checkRefused asserts that err is the node-restriction policy's refusal
// carrying want.
func checkRefused(t *testing.T, what string, err error, want string) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s: admitted for the plugin's credentials, want the node-restriction policy's refusal", what)
	case !apierrors.IsForbidden(err):
		t.Errorf("%s: refused, but not by admission: %v", what, err)
	case !strings.Contains(err.Error(), nodeRestrictionPolicy) || !strings.Contains(err.Error(), want):
		t.Errorf("%s: refused with %q, want the policy %s saying %q", what, err, nodeRestrictionPolicy, want)
	default:
		t.Logf("%s: refused: %v", what, err)
	}
}

// TestCriticalPodsNeedTheQuota: the API server limits the critical priority
// classes as GKE's does (ResourceQuota admission, limitedResources), so
// without the chart's quota the plugin's DaemonSet pod is refused ("insufficient
// quota to match these scopes"); with it (the default) the plugin runs.
func TestCriticalPodsNeedTheQuota(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutContainerDriver
	n := addNode(t, "node-quota", layout, "t4")
	install(t, append(layout.HelmValues(), "priorityClassQuota.enabled=false")...)
	ds := harness.DriverNamespace + "/" + harness.HelmRelease + "-gpu-dra-driver-kubelet-plugin"
	var last error
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		last = n.DaemonPodError(ds)
		return last != nil && strings.Contains(last.Error(), "insufficient quota to match these scopes"), nil
	})
	if err != nil {
		t.Fatalf("without the quota the plugin pod was not refused for it (last error: %v, pods: %d)", last, len(n.DaemonPods()))
	}
	t.Logf("without the quota: %v", last)
	if len(n.DaemonPods()) != 0 {
		t.Fatalf("a plugin pod runs without the quota")
	}
	if err := cluster.HelmUpgrade(ctx, layout.HelmValues()...); err != nil {
		t.Fatal(err)
	}
	waitPlugin(ctx, t, n, "")
}
