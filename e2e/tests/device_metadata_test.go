package tests

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/devicemetadata"

	"github.com/gpu-dra/e2e/harness"
)

// Device metadata for workloads (KEP-5304): with --device-metadata the
// plugin writes a file per claim request and its CDI spec mounts it into the
// claim's containers. The containers here read it as any workload would, and
// Kubernetes' own Go decoder (k8s.io/dynamic-resource-allocation's
// devicemetadata, with validation) reads what they printed.

// metadataStream reads a metadata file from inside a running container and
// decodes it with the upstream decoder, validating it; it also returns the
// apiVersions of the stream's objects, in order.
func metadataStream(ctx context.Context, t *testing.T, pod *v1.Pod, ctr, path string) (*metadata.DeviceMetadata, schema.GroupVersionKind, []string) {
	t.Helper()
	res, err := execIn(ctx, pod, ctr, "cat", path)
	if err != nil {
		t.Fatalf("pod %s container %s: exec cat %s: %v", pod.Name, ctr, path, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("pod %s container %s: cat %s exited %d: %s", pod.Name, ctr, path, res.ExitCode, res.Stderr)
	}
	t.Logf("pod %s container %s: %s:\n%s", pod.Name, ctr, path, res.Stdout)
	var (
		dm       metadata.DeviceMetadata
		gvk      schema.GroupVersionKind
		validErr error
	)
	err = devicemetadata.DecodeMetadataFromStream(json.NewDecoder(strings.NewReader(res.Stdout)), &dm,
		devicemetadata.DecodeMetadataWithValidationResult(&validErr), devicemetadata.DecodeMetadataStoreGVKResult(&gvk))
	if err != nil {
		t.Fatalf("%s: upstream decoder: %v", path, err)
	}
	if validErr != nil {
		t.Errorf("%s: upstream validation: %v", path, validErr)
	}
	var versions []string
	dec := json.NewDecoder(strings.NewReader(res.Stdout))
	for dec.More() {
		var obj struct {
			APIVersion string `json:"apiVersion"`
		}
		if err := dec.Decode(&obj); err != nil {
			t.Fatalf("%s: not a JSON stream: %v", path, err)
		}
		versions = append(versions, obj.APIVersion)
	}
	return &dm, gvk, versions
}

// checkRequestMetadata checks one request's file against the claim's
// allocation and the node's ResourceSlices: the same devices, each with
// exactly the attributes its slice publishes. It returns the devices' UUIDs.
func checkRequestMetadata(ctx context.Context, t *testing.T, claim *resourceapi.ResourceClaim, dm *metadata.DeviceMetadata, request string) []string {
	t.Helper()
	if dm.Name != claim.Name || dm.Namespace != claim.Namespace || string(dm.UID) != string(claim.UID) || dm.Generation != 1 {
		t.Errorf("metadata names claim %s/%s uid %s generation %d, want %s/%s uid %s generation 1",
			dm.Namespace, dm.Name, dm.UID, dm.Generation, claim.Namespace, claim.Name, claim.UID)
	}
	if len(dm.Requests) != 1 || dm.Requests[0].Name != request {
		t.Fatalf("metadata requests %+v, want one named %q", dm.Requests, request)
	}
	var want []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Request == request {
			want = append(want, r.Pool+"/"+r.Device)
		}
	}
	var got, uuids []string
	for _, d := range dm.Requests[0].Devices {
		got = append(got, d.Pool+"/"+d.Name)
		if d.Driver != harness.DefaultDriver {
			t.Errorf("device %s: driver %q", d.Name, d.Driver)
		}
		published := sliceDevice(ctx, t, d.Pool, d.Name)
		if !reflect.DeepEqual(d.Attributes, published.Attributes) {
			t.Errorf("device %s: metadata attributes\n%v\nslice attributes\n%v", d.Name, d.Attributes, published.Attributes)
		}
		uuid := d.Attributes["uuid"].StringValue
		if uuid == nil || *uuid == "" {
			t.Errorf("device %s: no uuid in %v", d.Name, d.Attributes)
			continue
		}
		uuids = append(uuids, *uuid)
	}
	if strings.Join(sorted(got), " ") != strings.Join(sorted(want), " ") {
		t.Errorf("request %s: metadata devices %v, allocated %v", request, got, want)
	}
	return sorted(uuids)
}

// TestDeviceMetadataInContainers runs a real node with --device-metadata on
// a simulated DGX A100 (GPU 0 in MIG mode). A claim with a whole GPU chosen
// through a subrequest and a MIG device is used by a pod's two containers,
// one with both requests and one with the MIG request only; a second pod
// gets its claim from a template. Inside the containers the files are where
// Kubernetes says (by claim name, or by the pod's name for a template's
// claim), read as v1beta1 by the upstream decoder with both versions in the
// stream, name exactly the allocated devices with the attributes their
// slices publish (so the MIG device's profile and parent), and their UUIDs
// are those nvidia-smi lists in the container; the MIG-only container has
// no file of the other request. Deleting the pods removes the files from the
// node.
func TestDeviceMetadataInContainers(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-metadata"
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb", []string{"--device-metadata=true"}, nil)
	ns := newNamespace(ctx, t, "metadata")

	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{
				{Name: "gpus", FirstAvailable: []resourceapi.DeviceSubRequest{{
					Name: "a100", DeviceClassName: "gpu.nvidia.com",
					AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				}}},
				{Name: "mig", Exactly: &resourceapi.ExactDeviceRequest{
					DeviceClassName: "mig.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				}},
			},
		}},
	}
	pod := claimPod(ns, "train", name, "train")
	all := pod.Spec.Containers[0]
	all.Name = "all"
	migOnly := all
	migOnly.Name = "mig-only"
	migOnly.Resources = v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu", Request: "mig"}}}
	pod.Spec.Containers = []v1.Container{all, migOnly}
	running, got := runClaimPod(ctx, t, claim, pod)

	dir := "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train"
	file := harness.DefaultDriver + "-metadata.json"
	gpus, gvk, versions := metadataStream(ctx, t, running, "all", filepath.Join(dir, "gpus", file))
	if gvk.GroupVersion().String() != "metadata.resource.k8s.io/v1beta1" || gvk.Kind != "DeviceMetadata" {
		t.Errorf("decoded %v, want metadata.resource.k8s.io/v1beta1 DeviceMetadata", gvk)
	}
	if strings.Join(versions, " ") != "metadata.resource.k8s.io/v1beta1 metadata.resource.k8s.io/v1alpha1" {
		t.Errorf("stream versions %v, want v1beta1 then v1alpha1", versions)
	}
	if gpus.PodClaimName != nil {
		t.Errorf("podClaimName %q for a claim the pod names", *gpus.PodClaimName)
	}
	gpuUUIDs := checkRequestMetadata(ctx, t, got, gpus, "gpus/a100")
	mig, _, _ := metadataStream(ctx, t, running, "all", filepath.Join(dir, "mig", file))
	migUUIDs := checkRequestMetadata(ctx, t, got, mig, "mig")
	// nvidia-smi lists a MIG device under its GPU.
	wantGPUs := gpuUUIDs
	for _, d := range mig.Requests[0].Devices {
		if p := d.Attributes["profile"].StringValue; p == nil || *p == "" {
			t.Errorf("MIG device %s: no profile in %v", d.Name, d.Attributes)
		}
		if p := d.Attributes["parentUUID"].StringValue; p != nil {
			wantGPUs = append(wantGPUs, *p)
		}
	}
	wantGPUs = sorted(wantGPUs)
	visibleGPUs, visibleMIGs := visibleDevices(ctx, t, running, "all")
	if strings.Join(visibleGPUs, " ") != strings.Join(wantGPUs, " ") {
		t.Errorf("container sees GPUs %v, metadata names %v (with the MIG device's parent)", visibleGPUs, wantGPUs)
	}
	if strings.Join(visibleMIGs, " ") != strings.Join(migUUIDs, " ") {
		t.Errorf("container sees MIG devices %v, metadata names %v", visibleMIGs, migUUIDs)
	}

	// The MIG-only container gets its request's file and not the other's.
	metadataStream(ctx, t, running, "mig-only", filepath.Join(dir, "mig", file))
	res, err := execIn(ctx, running, "mig-only", "cat", filepath.Join(dir, "gpus", file))
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode == 0 {
		t.Errorf("container mig-only reads the file of request gpus:\n%s", res.Stdout)
	}

	// A claim from a template: by the pod's name for it.
	tmplName := "one-gpu"
	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: tmplName, Namespace: ns},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: gpuClaim(t, ns, "unused", 1, nil).Spec},
	}
	if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tpod := claimPod(ns, "from-template", name, "")
	tpod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "accel", ResourceClaimTemplateName: &tmplName}}
	tpod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "accel"}}
	if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, tpod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	trunning, err := cluster.WaitPodRunning(ctx, ns, tpod.Name, 100*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(trunning.Status.ResourceClaimStatuses) != 1 || trunning.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
		t.Fatalf("pod from-template: claim statuses %+v", trunning.Status.ResourceClaimStatuses)
	}
	generated, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *trunning.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tdm, _, _ := metadataStream(ctx, t, trunning, "ctr",
		"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/accel/gpu/"+file)
	if tdm.PodClaimName == nil || *tdm.PodClaimName != "accel" {
		t.Errorf("podClaimName %v, want accel", tdm.PodClaimName)
	}
	checkRequestMetadata(ctx, t, generated, tdm, "gpu")

	// The node's files go with the claims.
	hostDir := filepath.Join(n.PluginDir(harness.DefaultDriver), "device-metadata")
	ours := func() []string {
		entries, _ := os.ReadDir(hostDir)
		var names []string
		for _, e := range entries {
			for _, uid := range []string{string(got.UID), string(generated.UID)} {
				if strings.HasPrefix(e.Name(), uid+"_") {
					names = append(names, e.Name())
				}
			}
		}
		sort.Strings(names)
		return names
	}
	if len(ours()) != 3 {
		t.Errorf("node holds metadata files %v, want 3 (two requests and a template's claim)", ours())
	}
	deletePod(ctx, t, running)
	deletePod(ctx, t, trunning)
	if !eventually(ctx, 60*time.Second, func() bool { return len(ours()) == 0 }) {
		t.Errorf("metadata files left on the node after the pods are gone: %v", ours())
	}
	if specs := claimSpecFiles(t, name, string(got.UID)); len(specs) != 0 {
		t.Errorf("CDI specs left: %v", specs)
	}
}
