package harness

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

// CDISpec is the part of a CDI spec file the tests look at.
type CDISpec struct {
	// Path is the file it was read from.
	Path           string            `json:"-"`
	CDIVersion     string            `json:"cdiVersion"`
	Kind           string            `json:"kind"`
	Devices        []CDIDevice       `json:"devices"`
	ContainerEdits CDIContainerEdits `json:"containerEdits"`
}

// CDIDevice is one named device of a spec.
type CDIDevice struct {
	Name           string            `json:"name"`
	ContainerEdits CDIContainerEdits `json:"containerEdits"`
}

// CDIContainerEdits are the edits a runtime applies for a device.
type CDIContainerEdits struct {
	Env         []string        `json:"env"`
	DeviceNodes []CDIDeviceNode `json:"deviceNodes"`
	Mounts      []CDIMount      `json:"mounts"`
	Hooks       []any           `json:"hooks"`
}

// CDIDeviceNode is a device node edit.
type CDIDeviceNode struct {
	Path     string `json:"path"`
	HostPath string `json:"hostPath"`
}

// CDIMount is a mount edit.
type CDIMount struct {
	HostPath      string `json:"hostPath"`
	ContainerPath string `json:"containerPath"`
}

// ResolvedDevice is a CDI device ID resolved against a CDI root the way a
// container runtime does: spec-wide edits plus the device's own.
type ResolvedDevice struct {
	ID     string
	Spec   *CDISpec
	Device CDIDevice
}

// Env is every environment edit (spec-wide, then the device's).
func (r ResolvedDevice) Env() []string {
	return append(append([]string{}, r.Spec.ContainerEdits.Env...), r.Device.ContainerEdits.Env...)
}

// DeviceNodes is every device node path (spec-wide, then the device's).
func (r ResolvedDevice) DeviceNodes() []CDIDeviceNode {
	return append(append([]CDIDeviceNode{}, r.Spec.ContainerEdits.DeviceNodes...), r.Device.ContainerEdits.DeviceNodes...)
}

// Mounts is every mount (spec-wide, then the device's).
func (r ResolvedDevice) Mounts() []CDIMount {
	return append(append([]CDIMount{}, r.Spec.ContainerEdits.Mounts...), r.Device.ContainerEdits.Mounts...)
}

// ReadCDISpecs reads every *.yaml / *.json spec under root.
func ReadCDISpecs(root string) ([]*CDISpec, error) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	var specs []*CDISpec
	for _, e := range entries {
		ext := filepath.Ext(e.Name())
		if e.IsDir() || (ext != ".yaml" && ext != ".json") {
			continue
		}
		p := filepath.Join(root, e.Name())
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		s := &CDISpec{Path: p}
		if err := yaml.Unmarshal(data, s); err != nil {
			return nil, fmt.Errorf("CDI spec %s: %w", p, err)
		}
		specs = append(specs, s)
	}
	return specs, nil
}

// ResolveCDI resolves a fully qualified CDI device ID (vendor/class=name)
// against the spec files in root.
func ResolveCDI(root, id string) (ResolvedDevice, error) {
	kind, name, ok := strings.Cut(id, "=")
	if !ok || !strings.Contains(kind, "/") {
		return ResolvedDevice{}, fmt.Errorf("CDI ID %q is not vendor/class=name", id)
	}
	specs, err := ReadCDISpecs(root)
	if err != nil {
		return ResolvedDevice{}, err
	}
	var found []ResolvedDevice
	for _, s := range specs {
		if s.Kind != kind {
			continue
		}
		for _, d := range s.Devices {
			if d.Name == name {
				found = append(found, ResolvedDevice{ID: id, Spec: s, Device: d})
			}
		}
	}
	switch len(found) {
	case 0:
		return ResolvedDevice{}, fmt.Errorf("CDI ID %q: no spec in %s defines it", id, root)
	case 1:
		return found[0], nil
	default:
		return ResolvedDevice{}, fmt.Errorf("CDI ID %q defined by %d specs (%s, %s): a runtime refuses that", id, len(found), found[0].Spec.Path, found[1].Spec.Path)
	}
}
