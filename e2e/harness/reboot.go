package harness

// A reboot of a simulated node, and the node state a fresh boot brings.
//
// What a real reboot keeps and loses decides what Reboot does:
//   - lost: every process (containers, the node plugin, MPS control daemons),
//     runc's state (/run), the CDI specs (/var/run/cdi is tmpfs), the GPUs'
//     runtime settings (compute mode, time-slice, persistence mode are reset
//     by the driver at load), and the kernel's boot ID changes;
//   - kept: the API server's objects (pods stay bound, claims stay allocated
//     and reserved), /var/lib/kubelet (the kubelet's DRA checkpoint, the
//     plugin folder with our checkpoint and the MPS folders, whose sockets are
//     then stale files), the driver's files.
//
// After it the kubelet starts again with its DRA manager's claim cache read
// from the checkpoint, every claim marked not prepared: for each pod it
// starts again it calls NodePrepareResources, as the real kubelet does.
//
// On a real node (NodeOptions.RealKubelet) the same happens to the real
// kubelet and containerd: realnode_reboot.go says what their power loss
// kills, wipes and keeps. This file keeps what both kinds share: the checks,
// the GPUs' boot settings and the boot ID.

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// BootIDFile is the node's stand-in for /proc/sys/kernel/random/boot_id:
// pass it as PluginOptions.BootIDFile after WriteBootID, and Reboot writes a
// new ID into it.
func (n *Node) BootIDFile() string { return filepath.Join(n.Dir, "boot_id") }

// WriteBootID writes id (NewBootID) into BootIDFile.
func (n *Node) WriteBootID(id string) error {
	return os.WriteFile(n.BootIDFile(), []byte(id+"\n"), 0o644)
}

// BootID is the ID in BootIDFile ("" when none was written).
func (n *Node) BootID() string {
	b, _ := os.ReadFile(n.BootIDFile())
	return strings.TrimSpace(string(b))
}

// NewBootID is a random ID in the kernel's format (a version 4 UUID).
func NewBootID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Reboot power-cycles the node: PowerOff, then PowerOn.
func (n *Node) Reboot(ctx context.Context) error {
	if err := n.PowerOff(); err != nil {
		return err
	}
	return n.PowerOn(ctx)
}

// PowerOff is the first half of a reboot (see the top of this file): the
// kubelet's pieces stop, containers, the plugin and the MPS daemons die, the
// CDI root is emptied, the simulated GPUs get their boot settings and the
// boot ID file a new ID. The plugin must have been started with
// PluginOptions.BootIDFile set to BootIDFile. Nothing runs until PowerOn.
// On a real node everything of the node is SIGKILLed at once, as a power
// loss (realnode_reboot.go).
func (n *Node) PowerOff() error {
	if n.real == nil && (n.Layout != LayoutProcess || n.runtime == nil) {
		return fmt.Errorf("node %s: a reboot needs a node whose plugin runs as a process and which runs containers", n.Name)
	}
	if n.Plugin == nil || !containsArg(n.Plugin.Args, "--boot-id-file="+n.BootIDFile()) {
		return fmt.Errorf("node %s: plugin not started with PluginOptions.BootIDFile = Node.BootIDFile(); it would not see the reboot", n.Name)
	}
	old := n.BootID()
	if n.real != nil {
		if err := n.real.powerOff(); err != nil {
			return err
		}
	} else if err := n.powerOffPodLoop(); err != nil {
		return err
	}
	if err := n.bootGPUs(); err != nil {
		return err
	}
	id := NewBootID()
	for id == old {
		id = NewBootID()
	}
	return n.WriteBootID(id)
}

// powerOffPodLoop stops a pod-loop node's kubelet pieces, runtime, plugin
// and MPS daemons and empties its CDI root.
func (n *Node) powerOffPodLoop() error {
	// The kubelet goes first, so nothing reacts to the dying containers.
	n.cancel()
	n.wg.Wait()
	n.dra.Stop()
	n.runtime.stop()
	n.Plugin.Stop()
	for _, p := range Processes(n.SimRoot()) {
		_ = syscall.Kill(p.Pid, syscall.SIGKILL)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(Processes(n.SimRoot())) > 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("node %s: processes of the simulated host still alive: %v", n.Name, Processes(n.SimRoot()))
		}
		time.Sleep(50 * time.Millisecond)
	}

	if err := emptyDir(n.CDIRoot); err != nil {
		return fmt.Errorf("node %s: empty the CDI root: %w", n.Name, err)
	}
	return nil
}

// PowerOn is the second half of a reboot: the kubelet starts again (its DRA
// checkpoint read back, every claim not prepared), then, as the DaemonSet
// pod the kubelet runs, the plugin with its earlier command line. It
// returns once both run; the kubelet prepares the pods' claims again and
// starts their containers on its own. A real node's containerd and kubelet
// start again on the same folders, port and IP, and PowerOn returns once
// the kubelet reported the Node Ready.
func (n *Node) PowerOn(ctx context.Context) error {
	if n.real != nil {
		return n.real.powerOn(ctx)
	}
	if err := n.startKubelet(ctx); err != nil {
		return fmt.Errorf("node %s: kubelet after reboot: %w", n.Name, err)
	}
	if err := n.Plugin.Restart(); err != nil {
		return fmt.Errorf("node %s: plugin after reboot: %w", n.Name, err)
	}
	return nil
}

func containsArg(args []string, want string) bool {
	for _, a := range args {
		if a == want {
			return true
		}
	}
	return false
}

// emptyDir removes everything in dir, keeping dir.
func emptyDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// bootGPUs gives every simulated GPU the settings the driver sets when it
// loads: compute mode Default, time-slice Default, persistence off. It edits
// the simulator's state file under the simulator's own lock
// (state.json.lock, an exclusive flock) and keeps every other field as it is,
// MIG layout included (the suite reboots only nodes without MIG).
func (n *Node) bootGPUs() error {
	path := filepath.Join(n.SimRoot(), "etc", "gpu-sim", "state.json")
	lock, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", path, err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var state map[string]json.RawMessage
	if err := json.Unmarshal(data, &state); err != nil {
		return fmt.Errorf("simulator state %s: %w", path, err)
	}
	var gpus []map[string]json.RawMessage
	if err := json.Unmarshal(state["gpus"], &gpus); err != nil {
		return fmt.Errorf("simulator state %s: gpus: %w", path, err)
	}
	for _, g := range gpus {
		g["computeMode"] = json.RawMessage(`"DEFAULT"`)
		g["timeslice"] = json.RawMessage(`0`)
		g["persistence"] = json.RawMessage(`false`)
	}
	if state["gpus"], err = json.Marshal(gpus); err != nil {
		return err
	}
	out, err := json.MarshalIndent(state, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".boot"
	if err := os.WriteFile(tmp, append(out, '\n'), 0o666); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
