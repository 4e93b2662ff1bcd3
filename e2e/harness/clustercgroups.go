package harness

// The cluster's cgroups: every process the harness starts for a cluster
// (kubelet, containerd and through it the shims and containers of real
// nodes, plugins and the MPS daemons they start, runc and the containers of
// pod-loop nodes, the webhook) starts inside one cgroup of the cluster,
// e2e-<tag>, in every hierarchy of this machine, so that whatever they fork
// can be found and killed even after the harness itself died (reaper.go).
//
// Where: in each hierarchy the cgroup is a child of the harness's own cgroup
// there, so nothing the harness starts leaves a cgroup (a memory limit, say)
// that whoever runs the harness put it in. Real nodes' kubelets need one
// cgroupRoot that names the same path in every hierarchy; theirs is
// /e2e-<tag>/n<seq> (nodeCgroupRoot), at the top of each hierarchy, where
// the harness's own cgroup is "/" on a machine that does not confine it.
//
// How a process starts inside it before it can fork: cgroup v1 lets one
// thread change cgroups (its tid written to `tasks`), and a child starts
// in the cgroups of the thread that forks it. startProcess locks a thread,
// moves it into the cluster's cgroups, forks there and moves it back. In a
// cgroup v2 hierarchy (mounted next to the v1 ones, or alone) only whole
// processes move; there the child is created inside the cgroup with
// clone3's CLONE_INTO_CGROUP (SysProcAttr.UseCgroupFD).
//
// Rejected: moving the child after it started (it may have forked already:
// runc forks at once); a wrapper that moves itself and then execs the
// program (one more process start per container, and a shell or the harness
// binary on every container's path).

import (
	"bufio"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// cgroupMount is one mounted cgroup hierarchy.
type cgroupMount struct {
	// dir is where it is mounted; root is the hierarchy's path mounted there.
	dir, root string
	// controllers are a v1 hierarchy's controllers and name=<name>.
	controllers []string
	v2          bool
}

// cgroupMounts are this machine's cgroup hierarchies, each once.
func cgroupMounts() ([]cgroupMount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	known, err := v1Controllers()
	if err != nil {
		return nil, err
	}
	var out []cgroupMount
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := slices.Index(fields, "-")
		if sep < 5 || sep+3 >= len(fields) {
			continue
		}
		m := cgroupMount{dir: unescapeMountPath(fields[4]), root: unescapeMountPath(fields[3])}
		switch fields[sep+1] {
		case "cgroup2":
			m.v2 = true
		case "cgroup":
			for _, opt := range strings.Split(fields[sep+3], ",") {
				if known[opt] || strings.HasPrefix(opt, "name=") {
					m.controllers = append(m.controllers, opt)
				}
			}
		default:
			continue
		}
		key := strings.Join(m.controllers, ",")
		if m.v2 {
			key = "v2"
		}
		if seen[key] {
			continue
		}
		seen[key] = true
		out = append(out, m)
	}
	return out, sc.Err()
}

// v1Controllers are the kernel's cgroup controllers (/proc/cgroups): which
// options of a cgroup mount name its controllers.
func v1Controllers() (map[string]bool, error) {
	data, err := os.ReadFile("/proc/cgroups")
	if errors.Is(err, os.ErrNotExist) {
		return map[string]bool{}, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "#") {
			out[f[0]] = true
		}
	}
	return out, nil
}

// cgroupOf is where a /proc/<pid>/cgroup (or /proc/thread-self/cgroup)
// places the task in hierarchy m, as a folder under m.dir; "" if it does
// not name m or the path is outside what is mounted.
func cgroupOf(m cgroupMount, procCgroup string) string {
	for _, line := range strings.Split(strings.TrimSpace(procCgroup), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		match := m.v2 && parts[0] == "0" && parts[1] == ""
		if !m.v2 && parts[1] != "" {
			ctrls := strings.Split(parts[1], ",")
			slices.Sort(ctrls)
			mine := slices.Clone(m.controllers)
			slices.Sort(mine)
			match = slices.Equal(ctrls, mine)
		}
		if !match {
			continue
		}
		rel, ok := strings.CutPrefix(parts[2], m.root)
		if m.root == "/" {
			rel, ok = parts[2], true
		}
		if !ok || rel != "" && !strings.HasPrefix(rel, "/") {
			return ""
		}
		return filepath.Join(m.dir, rel)
	}
	return ""
}

// clusterTag names a cluster's machine-wide things (cgroups, bridges) after
// its folder.
func clusterTag(dir string) string {
	return fmt.Sprintf("%08x", crc32.ChecksumIEEE([]byte(dir)))
}

// clusterCgroupName is the cluster's cgroup, in every hierarchy.
func clusterCgroupName(dir string) string { return "e2e-" + clusterTag(dir) }

// bridgeName is the network bridge of a cluster's real node (at most 15
// bytes, Linux's limit, for seq < 1000).
func (c *Cluster) bridgeName(seq int) string { return fmt.Sprintf("e2e%sn%d", c.tag, seq) }

// bridgePrefix starts the name of every bridge of the cluster of dir.
func bridgePrefix(dir string) string { return "e2e" + clusterTag(dir) + "n" }

// nodeCgroupRoot is the kubelet's cgroupRoot for a cluster's real node: the
// same path in every hierarchy, under the cluster's cgroup.
func (c *Cluster) nodeCgroupRoot(seq int) string {
	return fmt.Sprintf("/%s/n%d", clusterCgroupName(c.Dir), seq)
}

// clusterCgroupDirs are every folder that may hold a cgroup of the cluster
// of dir: e2e-<tag> at the top of each hierarchy (real nodes' cgroups) and
// under this process's own cgroup there (where processes start).
func clusterCgroupDirs(dir string) []string {
	mounts, err := cgroupMounts()
	if err != nil {
		return nil
	}
	self, _ := os.ReadFile("/proc/self/cgroup")
	name := clusterCgroupName(dir)
	var out []string
	for _, m := range mounts {
		for _, d := range []string{filepath.Join(m.dir, name), filepath.Join(cgroupOf(m, string(self)), name)} {
			if strings.HasPrefix(d, m.dir+"/") && !slices.Contains(out, d) {
				out = append(out, d)
			}
		}
	}
	return out
}

// placement is where a cluster's processes start: the tasks files of the
// cluster's cgroups in the v1 hierarchies, and the cluster's v2 cgroup.
type placement struct {
	mu     sync.RWMutex
	closed bool
	v1     []string // <cgroup>/tasks, one per v1 hierarchy
	v2     *os.File // the cluster's cgroup in the v2 hierarchy; nil: none
}

// newPlacement creates the cluster's cgroups (in every hierarchy, under the
// harness's own cgroup and at the top, see the file's doc) and says where
// processes start. Without the rights to create cgroups (not root), nil:
// processes then start where the harness runs, and only those found by
// their root or binary under the cluster's folder are killed after a
// crash.
func newPlacement(dir string) (*placement, error) {
	mounts, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	name := clusterCgroupName(dir)
	p := &placement{}
	for _, m := range mounts {
		own := cgroupOf(m, string(self))
		if own == "" {
			continue
		}
		for _, d := range []string{filepath.Join(m.dir, name), filepath.Join(own, name)} {
			if err := makeCgroup(m.dir, d); err != nil {
				p.close()
				if errors.Is(err, os.ErrPermission) || errors.Is(err, unix.EROFS) {
					return nil, nil
				}
				return nil, err
			}
		}
		at := filepath.Join(own, name)
		if !m.v2 {
			p.v1 = append(p.v1, filepath.Join(at, "tasks"))
			continue
		}
		if cloneIntoCgroupWorks(at) {
			p.v2, err = os.OpenFile(at, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				p.close()
				return nil, err
			}
		}
	}
	return p, nil
}

// makeCgroup creates dir (under the hierarchy at top) and its missing
// parents; a new cpuset cgroup gets its parent's CPUs and memory nodes
// (it starts with none, and a task cannot join it then).
func makeCgroup(top, dir string) error {
	rel, err := filepath.Rel(top, dir)
	if err != nil || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("cgroup %s is not under %s", dir, top)
	}
	at := top
	for _, part := range strings.Split(rel, "/") {
		parent := at
		at = filepath.Join(at, part)
		if err := os.Mkdir(at, 0o755); err != nil {
			if errors.Is(err, os.ErrExist) {
				continue
			}
			return err
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if data, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
				if err := os.WriteFile(filepath.Join(at, f), data, 0o644); err != nil {
					return fmt.Errorf("%s: %w", filepath.Join(at, f), err)
				}
			}
		}
	}
	return nil
}

// cloneIntoCgroupWorks starts `true` inside the v2 cgroup at dir with
// CLONE_INTO_CGROUP: kernels before 5.7, or a seccomp filter refusing
// clone3, cannot.
func cloneIntoCgroupWorks(dir string) bool {
	bin, err := exec.LookPath("true")
	if err != nil {
		return false
	}
	fd, err := os.OpenFile(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer fd.Close()
	cmd := exec.Command(bin)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	return cmd.Run() == nil
}

// close stops placing processes (the cluster is stopping) and waits for
// starts under way.
func (p *placement) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.v2 != nil {
		p.v2.Close()
		p.v2 = nil
	}
}

// startProcess starts cmd inside the cluster's cgroups (see the file's
// doc); cmd.Start where the cluster has none.
func (c *Cluster) startProcess(cmd *exec.Cmd) error {
	if c == nil || c.placement == nil {
		return cmd.Start()
	}
	p := c.placement
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return fmt.Errorf("cluster %s is stopping: not starting %s", c.Dir, cmd.Path)
	}
	if p.v2 != nil {
		if cmd.SysProcAttr == nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{}
		}
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(p.v2.Fd())
	}
	if len(p.v1) == 0 {
		return cmd.Start()
	}
	errc := make(chan error, 1)
	go func() {
		// Never unlocked unless the thread is back where it was: a thread
		// left inside the cluster's cgroups ends with this goroutine.
		goruntime.LockOSThread()
		home, err := threadTasksFiles()
		if err != nil {
			goruntime.UnlockOSThread()
			errc <- err
			return
		}
		tid := []byte(strconv.Itoa(unix.Gettid()))
		for _, tasks := range p.v1 {
			if err = os.WriteFile(tasks, tid, 0o644); err != nil {
				err = fmt.Errorf("join cgroup %s: %w", filepath.Dir(tasks), err)
				break
			}
		}
		if err == nil {
			err = cmd.Start()
		}
		for _, tasks := range home {
			if backErr := os.WriteFile(tasks, tid, 0o644); backErr != nil {
				if err == nil && cmd.Process != nil {
					// This thread's children get their parent-death signal
					// when it ends; the process cannot be kept.
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
				}
				errc <- fmt.Errorf("leave cgroup for %s: %w", filepath.Dir(tasks), backErr)
				return
			}
		}
		goruntime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// threadTasksFiles are the `tasks` files of the calling thread's cgroups in
// the v1 hierarchies.
func threadTasksFiles() ([]string, error) {
	mounts, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	self, err := os.ReadFile("/proc/thread-self/cgroup")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range mounts {
		if d := cgroupOf(m, string(self)); !m.v2 && d != "" {
			out = append(out, filepath.Join(d, "tasks"))
		}
	}
	return out, nil
}
