package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// RefDriver is a minimal DRA driver built on the upstream Go helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin), running in this
// process. It proves the harness independently of our plugin and gives the
// scale benchmark a baseline. Like any driver whose containers start, it
// writes a CDI spec per claim into the node's CDI root (kind "<driver>/dev",
// devices "<claim uid>-<device>", each setting REF_DEVICE=<device> in the
// container) and removes it on unprepare.
type RefDriver struct {
	// Driver is its driver name.
	Driver string
	helper *kubeletplugin.Helper
	// cdiRoot is the node's CDI spec directory.
	cdiRoot string

	mu         sync.Mutex
	prepared   map[types.UID]bool
	unprepared map[types.UID]bool
}

// StartRefDriver starts the reference driver on a node, registering through
// the node's plugin watcher; with gpus > 0 it publishes that many devices
// (gpu-0..) of type "gpu" in the node's pool.
func (n *Node) StartRefDriver(ctx context.Context, driver string, gpus int) (*RefDriver, error) {
	dir := filepath.Join(n.PluginsDir, driver)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, err
	}
	d := &RefDriver{Driver: driver, cdiRoot: n.CDIRoot, prepared: map[types.UID]bool{}, unprepared: map[types.UID]bool{}}
	h, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.KubeClient(n.cluster.Client),
		kubeletplugin.NodeName(n.Name),
		kubeletplugin.DriverName(driver),
		kubeletplugin.RegistrarDirectoryPath(n.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(dir),
	)
	if err != nil {
		return nil, fmt.Errorf("reference driver on %s: %w", n.Name, err)
	}
	d.helper = h
	if gpus > 0 {
		var devices []resourceapi.Device
		for i := range gpus {
			devices = append(devices, resourceapi.Device{
				Name: fmt.Sprintf("gpu-%d", i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					"type": {StringValue: new("gpu")},
					"uuid": {StringValue: new(fmt.Sprintf("GPU-%s-%d", n.Name, i))},
				},
			})
		}
		err := h.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
			n.Name: {Slices: []resourceslice.Slice{{Devices: devices}}},
		}})
		if err != nil {
			h.Stop()
			return nil, err
		}
	}
	return d, nil
}

// Stop stops the driver's gRPC servers and slice publishing.
func (d *RefDriver) Stop() { d.helper.Stop() }

// Prepared says whether a claim was prepared (and not since unprepared).
func (d *RefDriver) Prepared(uid types.UID) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.prepared[uid] && !d.unprepared[uid]
}

// Unprepared says whether a claim was unprepared.
func (d *RefDriver) Unprepared(uid types.UID) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.unprepared[uid]
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *RefDriver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, c := range claims {
		var devs []kubeletplugin.Device
		var specDevices []map[string]any
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver != d.Driver {
				continue
			}
			name := string(c.UID) + "-" + r.Device
			devs = append(devs, kubeletplugin.Device{
				Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
				CDIDeviceIDs: []string{d.Driver + "/dev=" + name},
			})
			specDevices = append(specDevices, map[string]any{
				"name":           name,
				"containerEdits": map[string]any{"env": []string{"REF_DEVICE=" + r.Device}},
			})
		}
		if err := d.writeSpec(c.UID, specDevices); err != nil {
			out[c.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		d.prepared[c.UID] = true
		delete(d.unprepared, c.UID)
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs}
	}
	return out, nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *RefDriver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[types.UID]error{}
	for _, c := range claims {
		err := os.Remove(d.specPath(c.UID))
		if err != nil && !os.IsNotExist(err) {
			out[c.UID] = err
			continue
		}
		d.unprepared[c.UID] = true
		out[c.UID] = nil
	}
	return out, nil
}

func (d *RefDriver) specPath(uid types.UID) string {
	return filepath.Join(d.cdiRoot, strings.ReplaceAll(d.Driver, "/", "_")+"-ref_"+string(uid)+".json")
}

// writeSpec writes the claim's CDI spec atomically (temp file, rename).
func (d *RefDriver) writeSpec(uid types.UID, devices []map[string]any) error {
	if len(devices) == 0 {
		return nil
	}
	spec, err := json.Marshal(map[string]any{
		"cdiVersion": "0.6.0",
		"kind":       d.Driver + "/dev",
		"devices":    devices,
	})
	if err != nil {
		return err
	}
	path := d.specPath(uid)
	tmp := filepath.Join(d.cdiRoot, "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, spec, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// HandleError implements kubeletplugin.DRAPlugin: background errors (slice
// publishing) are retried by the helper; nothing here is fatal.
func (d *RefDriver) HandleError(context.Context, error, string) {}

// WatchHealthStatus implements kubeletplugin.DRAPlugin.
func (d *RefDriver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
