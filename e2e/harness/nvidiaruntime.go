package harness

// NVIDIA's container runtime on a node (NodeOptions.NvidiaRuntime), as the
// GPU Operator sets up GPU nodes: containerd's default runtime there is
// `nvidia-container-runtime`, an OCI runtime that edits the bundle's
// config.json on `create` and then hands every command to runc. In `cdi`
// mode it reads NVIDIA_VISIBLE_DEVICES from the container's environment
// (where every CUDA image puts `all`, images.go) and injects those devices
// from the node's CDI specs: `all` and device names (`0`, a UUID, `0:1`) as
// `nvidia.com/gpu=<name>` (its default kind), qualified CDI names as they
// are; `void`, empty or unset adds nothing; `none` asks for
// `nvidia.com/gpu=none`, which a spec must define. It honours the variable
// in unprivileged containers too
// (`accept-nvidia-visible-devices-envvar-when-unprivileged`, default true).
// Later entries of the environment win, so a CDI spec that sets
// NVIDIA_VISIBLE_DEVICES=void (applied by containerd before the runtime
// runs) turns that off for the containers that get its devices.
//
// Here: the runtime is built from the toolkit's Go module at the version
// `make toolkit` pins; its config (<node>/nvidia-container-runtime/
// config.toml, NVIDIA_CTK_CONFIG_FILE_PATH) sets mode `cdi`, runc as the
// low-level runtime and the node's CDI root as the spec folder; the
// `nvidia.com/gpu` spec (`all`, each GPU and MIG device by index and UUID)
// is what `nvidia-ctk cdi generate` writes for the node's simulated driver
// root, as NVIDIA's toolkit container does when it starts. It is written
// into the CDI root before the node's first container starts after the CDI
// root was emptied (node added, reboot).
//
// The runtime edits the spec only on `create`, so these containers are not
// run with `runc run`: a shim does what containerd's runc shim does (this
// binary again, see the init below): it becomes the child subreaper, runs
// `<runtime> create`, then `<runtime> start`, and waits for the container's
// process, which is reparented to it; its exit status is the container's.
//
// On a real node (NodeOptions.RealKubelet, realnode.go) containerd itself
// runs it, as on a GPU Operator node: runtime `nvidia` (containerd's runc
// shim with this binary) is the default runtime, its config reaches it
// through containerd's environment, and the spec is written once the
// simulated driver is set up (Node.SetupSim), as the toolkit container
// writes it once the driver is there.
//
// Only nodes whose plugin runs as a process (LayoutProcess): the runtime
// reads the CDI root's host paths as they are.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// NvidiaSpecFile is the name of the toolkit's spec in the CDI root of a
// node with NVIDIA's runtime.
const NvidiaSpecFile = "nvidia.yaml"

// ociShimEnv makes a binary linking this package act as a container's shim
// (runShim) instead of doing its own work.
const ociShimEnv = "E2E_HARNESS_OCI_SHIM"

func init() {
	if os.Getenv(ociShimEnv) == "" {
		return
	}
	os.Exit(runShim(os.Args[1:]))
}

// nvidiaRuntime is a node's nvidia-container-runtime and its setup.
type nvidiaRuntime struct {
	bin    string // nvidia-container-runtime
	config string // its config.toml
	ctk    string // nvidia-ctk, to write the spec
	hook   string // nvidia-cdi-hook, named by the spec
	node   *Node

	mu sync.Mutex // one spec generation at a time
}

func newNvidiaRuntime(n *Node, runc string) (*nvidiaRuntime, error) {
	nr := &nvidiaRuntime{node: n, config: filepath.Join(n.Dir, "nvidia-container-runtime", "config.toml")}
	for _, t := range []struct {
		dst  *string
		name string
	}{{&nr.bin, "nvidia-container-runtime"}, {&nr.ctk, "nvidia-ctk"}, {&nr.hook, "nvidia-cdi-hook"}} {
		p, err := Tool(t.name)
		if err != nil {
			return nil, fmt.Errorf("%w (`make toolkit` builds it)", err)
		}
		*t.dst = p
	}
	// The GPU Operator's settings for a node in CDI mode; every other key
	// keeps the toolkit's default.
	config := fmt.Sprintf(`accept-nvidia-visible-devices-envvar-when-unprivileged = true

[nvidia-container-runtime]
log-level = "info"
mode = "cdi"
runtimes = [%q]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
spec-dirs = [%q]
`, runc, n.CDIRoot)
	if err := os.MkdirAll(filepath.Dir(nr.config), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(nr.config, []byte(config), 0o644); err != nil {
		return nil, err
	}
	return nr, nil
}

// ensureSpec writes the toolkit's spec into the node's CDI root unless it is
// there: `nvidia-ctk cdi generate` on the simulated driver root, in a private
// mount namespace where the host files the toolkit reads outside its
// --driver-root (the MIG minors table under /proc/driver/nvidia-caps, the
// kernel's firmware search path, PATH for the driver's binaries) show what a
// host with that driver shows (as crates/kubelet-plugin/tests/toolkit_cdi.rs
// runs it).
func (nr *nvidiaRuntime) ensureSpec() error {
	nr.mu.Lock()
	defer nr.mu.Unlock()
	out := filepath.Join(nr.node.CDIRoot, NvidiaSpecFile)
	if isFile(out) {
		return nil
	}
	sim := nr.node.SimRoot()
	if !isFile(filepath.Join(sim, "etc", "gpu-sim", "state.json")) {
		return fmt.Errorf("node %s: NVIDIA's runtime needs the simulated host (SetupSim) before containers start", nr.node.Name)
	}
	binDir, fwDir := "/usr/bin", "/lib/firmware"
	if isDir(filepath.Join(sim, "usr", "local", "nvidia", "bin")) {
		binDir, fwDir = "/usr/local/nvidia/bin", "/usr/local/nvidia/firmware"
	}
	fwFile := filepath.Join(nr.node.Dir, "nvidia-container-runtime", "firmware_class.path")
	if err := os.WriteFile(fwFile, []byte(fwDir), 0o644); err != nil {
		return err
	}
	const script = `set -e
mount -t tmpfs none /proc/driver
mkdir -p /proc/driver/nvidia-caps
cp "$1/proc/driver/nvidia-caps/mig-minors" /proc/driver/nvidia-caps/
if [ -e /sys/module/firmware_class/parameters/path ]; then
	mount --bind "$2" /sys/module/firmware_class/parameters/path
fi
PATH="$PATH:$3" exec "$4" cdi generate --driver-root "$1" --dev-root "$1" --nvidia-cdi-hook-path "$5" --output "$6"`
	tmp := filepath.Join(nr.node.Dir, "nvidia-container-runtime", NvidiaSpecFile)
	cmd := exec.Command("unshare", "-m", "sh", "-c", script, "sh", sim, fwFile, binDir, nr.ctk, nr.hook, tmp)
	if outText, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("node %s: nvidia-ctk cdi generate: %v: %s", nr.node.Name, err, outText)
	}
	// Into the CDI root in one step: a runtime never reads half a spec.
	return os.Rename(tmp, out)
}

// shimCommand is the command that runs one container through the node's
// runtime (see runShim); the harness treats it as it treats `runc run`.
func (nr *nvidiaRuntime) shimCommand(root, log, bundle, pidFile, id string) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, nr.bin, root, log, bundle, pidFile, id)
	cmd.Env = append(os.Environ(), ociShimEnv+"=1", "NVIDIA_CTK_CONFIG_FILE_PATH="+nr.config)
	return cmd, nil
}

// runShim runs one container with an OCI runtime as containerd's shim does,
// and returns the container's exit status (128+signal when killed), or 128
// when it could not be created or started (the runtime logged why, in json,
// to the log file, which the harness reads as it reads runc's). Arguments:
// runtime, runc root, log file, bundle, pid file (written once the
// container's process runs), container ID. The container's stdout and
// stderr are the shim's.
func runShim(args []string) int {
	if len(args) != 6 {
		fmt.Fprintf(os.Stderr, "oci shim: want runtime, root, log, bundle, pid file, id; got %q\n", args)
		return 128
	}
	runtimeBin, root, log, bundle, pidFile, id := args[0], args[1], args[2], args[3], args[4], args[5]
	fail := func(format string, a ...any) int {
		shimLog(log, fmt.Sprintf(format, a...))
		return 128
	}
	// The container's process outlives `create`; as its subreaper this
	// process gets it as a child, and its exit status.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fail("shim: become subreaper: %v", err)
	}
	runtime := func(cmdArgs ...string) error {
		cmd := exec.Command(runtimeBin, append([]string{"--root", root, "--log", log, "--log-format", "json"}, cmdArgs...)...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		return cmd.Run()
	}
	createdPid := filepath.Join(bundle, "created.pid")
	if err := runtime("create", "--bundle", bundle, "--pid-file", createdPid, id); err != nil {
		return 128
	}
	data, err := os.ReadFile(createdPid)
	pid, perr := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || perr != nil {
		return fail("shim: pid of %s: %v %v", id, err, perr)
	}
	if err := runtime("start", id); err != nil {
		return 128
	}
	if err := os.WriteFile(pidFile+".tmp", data, 0o644); err != nil {
		return fail("shim: %v", err)
	}
	if err := os.Rename(pidFile+".tmp", pidFile); err != nil {
		return fail("shim: %v", err)
	}
	for {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return fail("shim: wait for %s: %v", id, err)
		}
		if got != pid {
			continue // a process of the runtime's, reparented here
		}
		if ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ws.ExitStatus()
	}
}

// shimLog appends an error to the runtime's json log, where the harness
// looks for why a container did not start (runcError).
func shimLog(path, msg string) {
	line, _ := json.Marshal(map[string]string{"level": "error", "msg": msg})
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, msg)
		return
	}
	defer f.Close()
	_, _ = f.Write(append(line, '\n'))
}
