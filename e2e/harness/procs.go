package harness

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Proc is a process seen in /proc.
type Proc struct {
	Pid  int
	Args []string
	Env  map[string]string
}

// Processes lists processes whose executable path (argv[0]) lies under dir:
// the simulated host's tools (MPS control daemons) that belong to one node.
func Processes(dir string) []Proc {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []Proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(raw) == 0 {
			continue
		}
		args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		if !strings.HasPrefix(args[0], dir+string(filepath.Separator)) {
			continue
		}
		// A zombie keeps its cmdline until reaped; it is not a live daemon.
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil {
			if i := bytes.LastIndexByte(stat, ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
				continue
			}
		}
		p := Proc{Pid: pid, Args: args, Env: map[string]string{}}
		if env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ")); err == nil {
			for _, kv := range strings.Split(string(env), "\x00") {
				if k, v, ok := strings.Cut(kv, "="); ok {
					p.Env[k] = v
				}
			}
		}
		out = append(out, p)
	}
	return out
}

// MPSDaemons are the node's running nvidia-cuda-mps-control processes.
func (n *Node) MPSDaemons() []Proc {
	var out []Proc
	for _, p := range Processes(n.SimRoot()) {
		if filepath.Base(p.Args[0]) == "nvidia-cuda-mps-control" {
			out = append(out, p)
		}
	}
	return out
}

// SimState is the simulator's state file of this node, decoded.
func (n *Node) SimState() (map[string]any, error) {
	data, err := os.ReadFile(filepath.Join(n.SimRoot(), "etc", "gpu-sim", "state.json"))
	if err != nil {
		return nil, err
	}
	var out map[string]any
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// SimStateRaw is the simulator's state file of this node, as text.
func (n *Node) SimStateRaw() string {
	data, _ := os.ReadFile(filepath.Join(n.SimRoot(), "etc", "gpu-sim", "state.json"))
	return string(data)
}

// ContainerProcesses are the processes whose root directory lies under dir:
// what is left of the containers of nodes in dir (each container's root is
// its bundle's rootfs there).
func ContainerProcesses(dir string) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		root, err := os.Readlink(filepath.Join("/proc", e.Name(), "root"))
		if err == nil && strings.HasPrefix(root, dir+string(filepath.Separator)) {
			out = append(out, pid)
		}
	}
	return out
}

// Nodes are the nodes added to the cluster (and not yet stopped with it).
func (c *Cluster) Nodes() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*Node, 0, len(c.nodes))
	for _, n := range c.nodes {
		out = append(out, n)
	}
	return out
}
