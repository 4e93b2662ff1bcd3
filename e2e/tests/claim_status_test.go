package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/gpu-dra/e2e/harness"
)

// deviceStatusData is the `data` the node plugin writes into a claim's
// status.devices entry (api/src/device_status.rs).
type deviceStatusData struct {
	UUID             string  `json:"uuid"`
	Type             string  `json:"type"`
	ProductName      string  `json:"productName"`
	Profile          *string `json:"profile"`
	ParentUUID       *string `json:"parentUUID"`
	MemoryShareBytes *int64  `json:"memoryShareBytes"`
	SharingStrategy  *string `json:"sharingStrategy"`
}

// ourEntries are the claim's status.devices entries of our driver.
func ourEntries(ctx context.Context, t *testing.T, ns, name string) ([]resourceapi.AllocatedDeviceStatus, *resourceapi.ResourceClaim) {
	t.Helper()
	claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []resourceapi.AllocatedDeviceStatus
	for _, d := range claim.Status.Devices {
		if d.Driver == harness.DefaultDriver {
			out = append(out, d)
		}
	}
	return out, claim
}

// preparedEntry waits (the plugin writes status in the background) for the
// one entry of our driver on a prepared claim, checks that it names the
// claim's allocated device (pool, device, shareID), is Ready and written by
// the node's field manager, and returns its data.
func preparedEntry(ctx context.Context, t *testing.T, n *harness.Node, ns, name string) deviceStatusData {
	t.Helper()
	var entries []resourceapi.AllocatedDeviceStatus
	var claim *resourceapi.ResourceClaim
	if !eventually(ctx, 30*time.Second, func() bool {
		entries, claim = ourEntries(ctx, t, ns, name)
		return len(entries) > 0
	}) {
		t.Fatalf("claim %s/%s: no status.devices entry of %s 30 s after its pod runs: %+v\nplugin log:\n%s",
			ns, name, harness.DefaultDriver, claim.Status.Devices, n.Plugin.Log())
	}
	if len(entries) != 1 {
		t.Fatalf("claim %s: %d entries, want 1: %+v", name, len(entries), entries)
	}
	e := entries[0]
	res := claim.Status.Allocation.Devices.Results[0]
	entryShare, allocatedShare := "<none>", "<none>"
	if e.ShareID != nil {
		entryShare = *e.ShareID
	}
	if res.ShareID != nil {
		allocatedShare = string(*res.ShareID)
	}
	if e.Pool != res.Pool || e.Device != res.Device || entryShare != allocatedShare {
		t.Errorf("claim %s: entry %s/%s share %s, allocated %s/%s share %s", name, e.Pool, e.Device, entryShare, res.Pool, res.Device, allocatedShare)
	}
	ready := false
	for _, c := range e.Conditions {
		ready = ready || (c.Type == "Ready" && c.Status == metav1.ConditionTrue)
	}
	if !ready {
		t.Errorf("claim %s: entry not Ready: %+v", name, e.Conditions)
	}
	manager := harness.DefaultDriver + "/" + n.Name
	owned := false
	for _, m := range claim.ManagedFields {
		owned = owned || (m.Manager == manager && m.Subresource == "status")
	}
	if !owned {
		t.Errorf("claim %s: no status fields of field manager %s: %+v", name, manager, claim.ManagedFields)
	}
	if e.Data == nil {
		t.Fatalf("claim %s: entry has no data", name)
	}
	var data deviceStatusData
	if err := json.Unmarshal(e.Data.Raw, &data); err != nil {
		t.Fatalf("claim %s: data %s: %v", name, e.Data.Raw, err)
	}
	t.Logf("claim %s: %s/%s %s", name, e.Pool, e.Device, e.Data.Raw)
	return data
}

func str(p *string) string {
	if p == nil {
		return "<none>"
	}
	return *p
}

// TestClaimDeviceStatus: after a claim's pod runs, the claim's
// status.devices carries our entry for its device with the physical
// device's identity: a static MIG device's UUID (as its slice publishes it),
// a dynamic MIG device's UUID (its slice has none; nvidia-smi -L on the node
// names the instance prepare created) with profile and parent GPU, and a
// memory share's GPU UUID with the bytes it consumes and its MPS strategy;
// once the pods are gone, no entry of ours is left on any of the claims.
func TestClaimDeviceStatus(t *testing.T) {
	requirePlugins(t)
	ctx := context.Background()
	const name = "node-claimstatus"
	empty := func(n *harness.Node) { destroyInstances(t, n, 0) }
	n := addPluginNode(ctx, t, name, "dgx-a100-40gb",
		[]string{"--dynamic-mig-gpus=0", "--memory-share-gpus=" + memoryShareGPU}, empty)
	devices := poolDevices(ctx, t, name)
	const dynamic = "gpu-0-mig-1g5gb-19-0"
	gpu0 := attrString(devices[dynamic], "parentUUID")
	if gpu0 == "" {
		t.Fatalf("dynamic device %s not published: %v", dynamic, keys(devices))
	}
	var static resourceapi.Device
	for _, d := range devices {
		if attrString(d, "type") == "mig" && attrString(d, "uuid") != "" && (static.Name == "" || d.Name < static.Name) {
			static = d
		}
	}
	if static.Name == "" {
		t.Fatalf("no static MIG device published: %v", keys(devices))
	}
	share := devices[memoryShareGPU]
	ns := newNamespace(ctx, t, "claimstatus")

	var pods []*v1.Pod
	run := func(claim *resourceapi.ResourceClaim) {
		pod, _ := runClaimPod(ctx, t, claim, claimPod(ns, claim.Name, name, claim.Name))
		pods = append(pods, pod)
	}
	run(pinnedClaim(ns, "static", "mig.nvidia.com", attrString(static, "uuid")))
	run(migClaim(ns, "dynamic", "1g.5gb", gpu0))
	run(shareClaim(t, ns, "share", attrString(share, "uuid"), "2Gi", nil))

	// Static MIG: the slice's UUID, profile and parent.
	got := preparedEntry(ctx, t, n, ns, "static")
	if got.UUID != attrString(static, "uuid") || got.Type != "mig" ||
		str(got.Profile) != attrString(static, "profile") || str(got.ParentUUID) != attrString(static, "parentUUID") ||
		got.ProductName != attrString(static, "productName") {
		t.Errorf("static MIG %s: status data %+v (profile %s, parent %s), want uuid %s, profile %s, parent %s, product %q",
			static.Name, got, str(got.Profile), str(got.ParentUUID), attrString(static, "uuid"),
			attrString(static, "profile"), attrString(static, "parentUUID"), attrString(static, "productName"))
	}

	// Dynamic MIG: the instance prepare created, as the node's driver lists it.
	want := dynamicMIGUUID(t, name, gpu0, "1g.5gb")
	got = preparedEntry(ctx, t, n, ns, "dynamic")
	if got.UUID != want || got.Type != "mig" || str(got.Profile) != "1g.5gb" || str(got.ParentUUID) != gpu0 || got.ProductName == "" {
		t.Errorf("dynamic MIG: status data %+v (profile %s, parent %s), want uuid %s (nvidia-smi -L), profile 1g.5gb, parent %s",
			got, str(got.Profile), str(got.ParentUUID), want, gpu0)
	}

	// Memory share: the whole GPU's UUID, the bytes consumed, MPS.
	got = preparedEntry(ctx, t, n, ns, "share")
	if got.UUID != attrString(share, "uuid") || got.Type != "gpu" || got.MemoryShareBytes == nil ||
		*got.MemoryShareBytes != 2<<30 || str(got.SharingStrategy) != "MPS" || got.Profile != nil {
		t.Errorf("memory share: status data %+v (share %v, strategy %s), want uuid %s, 2Gi (%d bytes), MPS",
			got, got.MemoryShareBytes, str(got.SharingStrategy), attrString(share, "uuid"), 2<<30)
	}

	// The removal as the plugin sends it at unprepare (an apply of the claim
	// without status by the node's field manager) drops the entry while the
	// claim is still allocated; the API server would also drop it at
	// deallocation, which follows a pod's deletion.
	_, static0 := ourEntries(ctx, t, ns, "static")
	removal := fmt.Sprintf(`{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{"name":"static","namespace":%q,"uid":%q}}`, ns, static0.UID)
	if _, err := cluster.Client.ResourceV1().ResourceClaims(ns).Patch(ctx, "static", types.ApplyPatchType, []byte(removal),
		metav1.PatchOptions{FieldManager: harness.DefaultDriver + "/" + name, Force: ptr.To(true)}, "status"); err != nil {
		t.Fatalf("the removal apply: %v", err)
	}
	if left, after := ourEntries(ctx, t, ns, "static"); len(left) != 0 || after.Status.Allocation == nil {
		t.Errorf("after the removal apply: entries %+v, allocated %v; want none, still allocated", left, after.Status.Allocation != nil)
	}

	// Unprepared: nothing of ours is left (the claims themselves stay).
	for _, pod := range pods {
		deletePod(ctx, t, pod)
	}
	for _, claim := range []string{"static", "dynamic", "share"} {
		var left []resourceapi.AllocatedDeviceStatus
		if !eventually(ctx, 30*time.Second, func() bool {
			left, _ = ourEntries(ctx, t, ns, claim)
			return len(left) == 0
		}) {
			t.Errorf("claim %s: entries left 30 s after its pod is gone: %+v\nplugin log:\n%s", claim, left, n.Plugin.Log())
		}
	}
}
