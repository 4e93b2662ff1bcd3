package harness

// The sweep of a cluster (see reaper.go for who sweeps when): what it
// removes, in order, and Leftovers, which lists what a sweep would find.
//
// Invariant: a sweep acts only on what is named after the cluster's folder
// (clusterRecord.valid): processes in cgroups named e2e-<tag> or with their
// root or binary in the folder, mounts under the folder, bridges
// e2e<tag>n*, links into the folder; anything else on the machine is
// never touched, whatever a record says.

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// sweepReport counts what a sweep removed, and lists what it could not.
type sweepReport struct {
	processes, mounts, cgroups, bridges, files int
	left                                       []string
}

func (r sweepReport) String() string {
	return fmt.Sprintf("%d processes, %d mounts, %d cgroups, %d bridges, %d files", r.processes, r.mounts, r.cgroups, r.bridges, r.files)
}

// sweep removes everything of the cluster (see the file's doc); safe to
// repeat, and to run on a cluster that left nothing.
func (rec clusterRecord) sweep() sweepReport {
	var rep sweepReport
	if !rec.valid() {
		rep.left = append(rep.left, fmt.Sprintf("nothing swept: record of %q names things that are not a cluster's", rec.Dir))
		return rep
	}
	dir := realPath(rec.Dir)
	sockets := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		freeze(rec.Cgroups, "FROZEN")
		pids := rec.processes(dir)
		for _, s := range servedSockets(pids) {
			sockets[s] = true
		}
		for _, pid := range pids {
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				rep.processes++
			}
		}
		for _, d := range rec.Cgroups {
			// cgroup v2: kills the whole subtree, later forks included.
			_ = os.WriteFile(filepath.Join(d, "cgroup.kill"), []byte("1"), 0o644)
		}
		freeze(rec.Cgroups, "THAWED")
		if len(pids) == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	for round := 0; round < 10; round++ {
		mounts := mountsUnder(dir)
		if len(mounts) == 0 {
			break
		}
		for _, m := range mounts {
			if unix.Unmount(m, 0) == nil || unix.Unmount(m, unix.MNT_DETACH) == nil {
				rep.mounts++
			}
		}
	}
	for _, d := range rec.Cgroups {
		// A killed process leaves its cgroup a moment after the signal.
		for i := 0; i < 40 && isDir(d); i++ {
			rep.cgroups += removeCgroups(d)
			if isDir(d) {
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	for _, rule := range serviceRulesWithPrefix(rec.BridgePrefix) {
		_ = exec.Command("iptables", append([]string{"-w", "-t", "nat", "-D"}, rule...)...).Run()
	}
	for _, name := range bridgesWithPrefix(rec.BridgePrefix) {
		if exec.Command("ip", "link", "del", name).Run() == nil {
			rep.bridges++
		}
	}
	for s := range sockets {
		if !strings.HasPrefix(s, dir+"/") {
			if fi, err := os.Lstat(s); err == nil && fi.Mode()&os.ModeSocket != 0 && os.Remove(s) == nil {
				rep.files++
			}
		}
	}
	for _, l := range linksInto(dir) {
		if os.Remove(l) == nil {
			rep.files++
		}
	}
	if rec.RemoveDir {
		_ = os.RemoveAll(rec.Dir)
	}
	rep.left = rec.leftovers(dir)
	if rec.RemoveDir && isDir(rec.Dir) {
		rep.left = append(rep.left, "folder "+rec.Dir)
	}
	return rep
}

// valid says whether the record names only things of the cluster of its
// folder: an absolute folder other than "/" and the temporary folder,
// cgroups named after it, its bridges. A sweep trusts nothing else (a damaged record must not make it
// kill, unmount or remove what is not the cluster's).
func (rec clusterRecord) valid() bool {
	dir := filepath.Clean(rec.Dir)
	if !filepath.IsAbs(dir) || dir == "/" || dir == filepath.Clean(os.TempDir()) || rec.BridgePrefix != bridgePrefix(rec.Dir) {
		return false
	}
	for _, d := range rec.Cgroups {
		if filepath.Base(d) != clusterCgroupName(rec.Dir) || !isCgroupDir(filepath.Clean(d)) {
			return false
		}
	}
	return true
}

// isCgroupDir says whether dir lies in a mounted cgroup hierarchy.
func isCgroupDir(dir string) bool {
	mounts, _ := cgroupMounts()
	for _, m := range mounts {
		if strings.HasPrefix(dir, m.dir+"/") {
			return true
		}
	}
	return false
}

// Leftovers lists what a cluster whose folder is dir left on this machine
// (empty once it stopped or its reaper swept): processes in its cgroups or
// with their root or binary in its folder, mounts under the folder, its
// cgroups, bridges, links into the folder in the temporary folder, and its
// record. Run it in a process whose cgroups are those of the process that
// ran the cluster (a test and its child are).
func Leftovers(dir string) []string {
	dir, _ = filepath.Abs(dir)
	rec := clusterRecord{Dir: dir, Cgroups: clusterCgroupDirs(dir), BridgePrefix: bridgePrefix(dir)}
	left := rec.leftovers(realPath(dir))
	if p := filepath.Join(recordsDir(), clusterTag(dir)+".json"); isFile(p) {
		left = append(left, "record "+p)
	}
	return left
}

func (rec clusterRecord) leftovers(dir string) []string {
	var left []string
	if !rec.valid() {
		return []string{fmt.Sprintf("not a cluster's folder: %q", rec.Dir)}
	}
	for _, pid := range rec.processes(dir) {
		cmd, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		left = append(left, fmt.Sprintf("process %d: %s", pid, strings.TrimSpace(strings.ReplaceAll(string(cmd), "\x00", " "))))
	}
	for _, m := range mountsUnder(dir) {
		left = append(left, "mount "+m)
	}
	for _, d := range rec.Cgroups {
		if isDir(d) {
			left = append(left, "cgroup "+d)
		}
	}
	for _, b := range bridgesWithPrefix(rec.BridgePrefix) {
		left = append(left, "network link "+b)
	}
	for _, rule := range serviceRulesWithPrefix(rec.BridgePrefix) {
		left = append(left, "iptables nat rule "+strings.Join(rule, " "))
	}
	for _, l := range linksInto(dir) {
		left = append(left, "link "+l)
	}
	return left
}

// processes are the live processes of the cluster: in its cgroups, or
// with their root (containers) or binary (the simulated host's tools) in
// its folder. Never this process, whose threads pass through the cgroups
// while they start processes (startProcess).
func (rec clusterRecord) processes(dir string) []int {
	var out []int
	add := func(pid int) {
		if pid > 0 && pid != os.Getpid() && !slices.Contains(out, pid) && !isZombie(pid) {
			out = append(out, pid)
		}
	}
	for _, d := range rec.Cgroups {
		_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() || e.Name() != "cgroup.procs" {
				return nil
			}
			data, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil {
					add(pid)
				}
			}
			return nil
		})
	}
	for _, pid := range ContainerProcesses(dir) {
		add(pid)
	}
	for _, p := range Processes(dir) {
		add(p.Pid)
	}
	sort.Ints(out)
	return out
}

func isZombie(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true // gone
	}
	i := strings.LastIndexByte(string(stat), ')')
	return i > 0 && i+2 < len(stat) && (stat[i+2] == 'Z' || stat[i+2] == 'X')
}

// freeze sets the freezer state of the cluster's freezer cgroups: FROZEN
// (waiting briefly until they are) or THAWED (each descendant too: a
// cgroup frozen on its own, as runc pauses a container, stays frozen when
// only its parent thaws).
func freeze(cgroups []string, state string) {
	for _, d := range cgroups {
		if !isFile(filepath.Join(d, "freezer.state")) {
			continue
		}
		if state == "THAWED" {
			_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
				if err == nil && e.Name() == "freezer.state" {
					_ = os.WriteFile(p, []byte(state), 0o644)
				}
				return nil
			})
			continue
		}
		_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte(state), 0o644)
		// A task in uninterruptible sleep holds FREEZING; the kill goes on.
		for i := 0; i < 20; i++ {
			got, err := os.ReadFile(filepath.Join(d, "freezer.state"))
			if err != nil || strings.TrimSpace(string(got)) == state {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// removeCgroups removes a cgroup and its descendants, deepest first, and
// counts the removed ones.
func removeCgroups(dir string) int {
	n := 0
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	for _, e := range entries {
		if e.IsDir() {
			n += removeCgroups(filepath.Join(dir, e.Name()))
		}
	}
	if os.Remove(dir) == nil {
		n++
	}
	return n
}

// bridgesWithPrefix are the network links whose names start with prefix.
func bridgesWithPrefix(prefix string) []string {
	ifs, err := net.Interfaces()
	if err != nil || prefix == "" {
		return nil
	}
	var out []string
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, prefix) {
			out = append(out, i.Name)
		}
	}
	return out
}

// linksInto are the symbolic links in the temporary folder that point into
// dir (a node's short link to its host tree, shortHostRoot).
func linksInto(dir string) []string {
	entries, err := os.ReadDir(os.TempDir())
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		if e.Type()&os.ModeSymlink == 0 {
			continue
		}
		p := filepath.Join(os.TempDir(), e.Name())
		if to, err := os.Readlink(p); err == nil && (to == dir || strings.HasPrefix(to, dir+"/")) {
			out = append(out, p)
		}
	}
	return out
}

// servedSockets are the paths of the Unix sockets the processes have bound
// (listening, or accepted from a listener of theirs).
func servedSockets(pids []int) []string {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return nil
	}
	defer f.Close()
	byInode := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 8 && strings.HasPrefix(fields[7], "/") {
			byInode[fields[6]] = fields[7]
		}
	}
	var out []string
	for _, pid := range pids {
		fds, _ := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "fd"))
		for _, fd := range fds {
			to, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(pid), "fd", fd.Name()))
			if inode, ok := strings.CutPrefix(to, "socket:["); err == nil && ok {
				if p, ok := byInode[strings.TrimSuffix(inode, "]")]; ok && !slices.Contains(out, p) {
					out = append(out, p)
				}
			}
		}
	}
	return out
}

// realPath is dir with symbolic links resolved, as mount tables and
// /proc/<pid>/root show it; dir itself once it is gone.
func realPath(dir string) string {
	if p, err := filepath.EvalSymlinks(dir); err == nil {
		return p
	}
	return dir
}

// serviceRulesWithPrefix are the nat PREROUTING rules (podnet.go) for
// packets coming in on a bridge whose name starts with prefix, as iptables
// -S prints them less the -A: what `iptables -D` takes. None without
// iptables.
func serviceRulesWithPrefix(prefix string) [][]string {
	out, err := exec.Command("iptables", "-w", "-t", "nat", "-S", "PREROUTING").Output()
	if err != nil {
		return nil
	}
	var rules [][]string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "-A" {
			continue
		}
		for i := 1; i+1 < len(f); i++ {
			if f[i] == "-i" && strings.HasPrefix(f[i+1], prefix) {
				rules = append(rules, f[1:])
				break
			}
		}
	}
	return rules
}
