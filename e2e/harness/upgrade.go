package harness

// A driver upgraded in place under a running node: `gpu-sim upgrade-driver`
// against the node's simulated driver root swaps the versioned files
// (libnvidia-ml.so.<version>, ...), repoints the soname links and reloads the
// simulated kernel module, as the GPU Operator's driver container restarting
// with a new version, or a host package upgrade and a module reload, do. The
// node's plugin, kubelet and containers keep running through it.

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"time"
)

// UpgradeStyle is the order in which an upgrade changes the files and the
// kernel module (`gpu-sim upgrade-driver --style`).
type UpgradeStyle string

const (
	// UpgradeContainer is the GPU Operator's driver container restarting:
	// module unloaded and no library for the window, then the new files and
	// module.
	UpgradeContainer UpgradeStyle = "container"
	// UpgradePackage is a package upgraded on the host, then the module
	// reloaded: the new files beside the old module for the window (NVML
	// answers with the version mismatch), then the new module.
	UpgradePackage UpgradeStyle = "package"
)

// UpgradeDriver swaps the driver of the node's simulated host to version, in
// the given style, with NVML out of reach for window (`gpu-sim
// upgrade-driver --root <SimRoot>`). It returns once the new module is
// loaded; whatever runs on the node meanwhile is left running. On a real
// host-driver node the node's namespace sees the new files at the host
// paths as the upgrade writes them into the tree (followDriverFiles).
func (n *Node) UpgradeDriver(ctx context.Context, version string, style UpgradeStyle, window time.Duration) error {
	sim, err := Binary("gpu-sim")
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, sim, "upgrade-driver", "--root", n.SimRoot(), "--version", version,
		"--style", string(style), "--window-seconds", strconv.FormatFloat(window.Seconds(), 'f', -1, 64))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("node %s: gpu-sim upgrade-driver: %w", n.Name, err)
	}
	done := make(chan error, 1)
	go func() {
		if err := cmd.Wait(); err != nil {
			done <- fmt.Errorf("node %s: gpu-sim upgrade-driver --version %s --style %s: %v: %s", n.Name, version, style, err, out.String())
			return
		}
		done <- nil
	}()
	// A host-driver real node sees the tree's new files as the upgrade
	// writes them, as a host sees a package's (realnode_ns.go).
	return n.real.followDriverFiles(ctx, done)
}

// DriverVersion is the version of the kernel module the node's simulated
// host has loaded (the simulator's state), which NVML and nvidia-smi report.
func (n *Node) DriverVersion() (string, error) {
	st, err := n.SimState()
	if err != nil {
		return "", fmt.Errorf("node %s: simulator state: %w", n.Name, err)
	}
	profile, _ := st["profile"].(map[string]any)
	v, _ := profile["driverVersion"].(string)
	if v == "" {
		return "", fmt.Errorf("node %s: simulator state has no profile.driverVersion", n.Name)
	}
	return v, nil
}
