package harness

// Nothing left behind: whatever ends the process that runs a cluster (Stop,
// a failed test, Ctrl-C, a second Ctrl-C during shutdown, a test timeout, a
// SIGKILL), no process, mount, cgroup or bridge of the cluster survives it.
//
// The pieces:
//   - every process the harness starts for the cluster runs inside the
//     cluster's cgroups (clustercgroups.go), and so does everything they
//     start: containerd's shims and the containers of real nodes, runc and
//     the containers of pod-loop nodes, MPS daemons;
//   - sweep removes everything of a cluster: it freezes the cluster's
//     cgroups (cgroup v1's freezer: a forking tree cannot outrun the kill),
//     SIGKILLs every process in them (and any whose root or binary lies in
//     the cluster's folder), thaws them, unmounts everything under the
//     folder (deepest first, detached if busy), removes the cluster's
//     cgroups, its bridges, the links into its folder in the temporary
//     folder and the Unix sockets its processes served outside the folder
//     (containerd's shims serve theirs in a machine-wide folder), and the
//     folder itself when the cluster made it. Cluster.Stop sweeps after
//     stopping everything gracefully;
//   - Start starts a reaper: this binary again (any binary linking the
//     harness: tests, the demo, benchmarks), recognised by reaperEnv in an
//     init before main, in its own process group (a Ctrl-C in a terminal
//     reaches the harness, not it), holding the read end of a pipe whose
//     only writer is the harness. When the harness ends in any way the pipe
//     closes and the reaper sweeps; after a clean Stop the harness writes
//     reaperDone first and the reaper exits without sweeping;
//   - a record per cluster in a well-known folder (recordsDir) says what to
//     sweep. The harness and its reaper hold a shared lock on it while they
//     live; a cluster start sweeps every record that no one holds (a cluster
//     whose harness and reaper both died: kill -9 of both, a machine crash),
//     so one dead reaper leaves nothing behind for long.
//
// Interrupts: InterruptContext makes the first SIGINT or SIGTERM a graceful
// stop and the second an exit at once, which hands the rest to the reaper.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// reaperEnv makes a binary linking this package the reaper of the cluster
// whose record it names, instead of doing its own work.
const reaperEnv = "E2E_HARNESS_REAPER"

// reaperDone is what the harness writes to its reaper after a clean Stop.
const reaperDone = 'D'

func init() {
	path := os.Getenv(reaperEnv)
	if path == "" {
		return
	}
	os.Exit(runReaper(path))
}

// clusterRecord is what a sweep of one cluster needs, kept in recordsDir.
type clusterRecord struct {
	// Dir is the cluster's folder.
	Dir string `json:"dir"`
	// Cgroups are the folders of the cluster's cgroups (clusterCgroupDirs).
	Cgroups []string `json:"cgroups"`
	// BridgePrefix starts the name of each of the cluster's bridges.
	BridgePrefix string `json:"bridgePrefix"`
	// RemoveDir: the cluster made Dir and it goes with the cluster.
	RemoveDir bool `json:"removeDir"`
	// Pid is the harness process's, for people reading the folder.
	Pid int `json:"pid"`
}

// recordsDir holds a record per cluster of this machine (per temporary
// folder): <tag>.json.
func recordsDir() string { return filepath.Join(os.TempDir(), "e2e-harness-clusters") }

// reaper is the harness's side of its reaper.
type reaper struct {
	cmd    *exec.Cmd
	exited chan struct{}
	pipe   *os.File // the write end
	lock   *os.File // the record, locked shared
	path   string
}

// startReaper writes the cluster's record and starts its reaper.
func startReaper(rec clusterRecord) (*reaper, error) {
	if err := os.MkdirAll(recordsDir(), 0o755); err != nil {
		return nil, err
	}
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return nil, err
	}
	r := &reaper{path: filepath.Join(recordsDir(), clusterTag(rec.Dir)+".json")}
	// Locked before it has its name: a start sweeping dead clusters never
	// sees the record of a live one unlocked.
	tmp, err := os.CreateTemp(recordsDir(), ".new-")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*reaper, error) {
		tmp.Close()
		os.Remove(tmp.Name())
		return nil, err
	}
	if err := unix.Flock(int(tmp.Fd()), unix.LOCK_SH); err != nil {
		return fail(err)
	}
	if _, err := tmp.Write(data); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp.Name(), r.path); err != nil {
		return fail(err)
	}
	r.lock = tmp
	self, err := os.Executable()
	if err != nil {
		r.removeRecord()
		return nil, err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		r.removeRecord()
		return nil, err
	}
	r.cmd = exec.Command(self)
	r.cmd.Env = append(os.Environ(), reaperEnv+"="+r.path)
	r.cmd.ExtraFiles = []*os.File{pr}
	// Its own messages go where the harness's go: after a crash, the only
	// word on what was removed.
	r.cmd.Stderr = os.Stderr
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = r.cmd.Start()
	pr.Close()
	if err != nil {
		pw.Close()
		r.removeRecord()
		return nil, fmt.Errorf("start reaper: %w", err)
	}
	r.pipe = pw
	r.exited = make(chan struct{})
	go func() { _ = r.cmd.Wait(); close(r.exited) }()
	return r, nil
}

// finish tells the reaper that Stop swept and waits (a while) for it to exit,
// then removes the record.
func (r *reaper) finish() {
	if r == nil {
		return
	}
	_, _ = r.pipe.Write([]byte{reaperDone})
	r.pipe.Close()
	select {
	case <-r.exited:
	case <-time.After(10 * time.Second):
	}
	r.removeRecord()
}

func (r *reaper) removeRecord() {
	os.Remove(r.path)
	r.lock.Close()
}

// runReaper is the reaper process (see the file's doc): it waits on fd 3
// and sweeps unless the harness said it did.
func runReaper(path string) int {
	os.Unsetenv(reaperEnv)
	// Terminal signals are for the harness; the harness's stderr may be a
	// pipe nobody reads any more.
	signal.Ignore(syscall.SIGINT, syscall.SIGQUIT, syscall.SIGHUP, syscall.SIGPIPE)
	f, err := os.Open(path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e harness reaper: %v\n", err)
		return 1
	}
	defer f.Close()
	_ = unix.Flock(int(f.Fd()), unix.LOCK_SH)
	var rec clusterRecord
	if err := json.NewDecoder(f).Decode(&rec); err != nil {
		fmt.Fprintf(os.Stderr, "e2e harness reaper: %s: %v\n", path, err)
		return 1
	}
	pipe := os.NewFile(3, "harness")
	var b [1]byte
	for {
		n, err := pipe.Read(b[:])
		if n == 1 && b[0] == reaperDone {
			return 0
		}
		if err != nil {
			break
		}
	}
	started := time.Now()
	rep := rec.sweep()
	os.Remove(path)
	fmt.Fprintf(os.Stderr, "e2e harness: cluster %s ended without Stop; its reaper removed %s in %s\n",
		rec.Dir, rep, time.Since(started).Round(time.Millisecond))
	if len(rep.left) > 0 {
		fmt.Fprintf(os.Stderr, "e2e harness: left on this machine: %s\n", strings.Join(rep.left, "; "))
		return 1
	}
	return 0
}

// sweepStale sweeps the clusters whose harness and reaper are both gone
// (their records unlocked), and reports each.
func sweepStale(logf func(string, ...any)) {
	entries, err := os.ReadDir(recordsDir())
	if err != nil {
		return
	}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		path := filepath.Join(recordsDir(), e.Name())
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		// Someone holds it: that cluster's harness or reaper lives, or
		// another start sweeps it now.
		if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil || !samePath(f, path) {
			f.Close()
			continue
		}
		var rec clusterRecord
		if err := json.NewDecoder(f).Decode(&rec); err == nil && rec.Dir != "" {
			rep := rec.sweep()
			logf("removed what a dead cluster (harness pid %d, %s) left: %s", rec.Pid, rec.Dir, rep)
			if len(rep.left) > 0 {
				logf("still left of it: %s", strings.Join(rep.left, "; "))
			}
		}
		os.Remove(path)
		f.Close()
	}
	// Records that a start never finished writing.
	stale, _ := filepath.Glob(filepath.Join(recordsDir(), ".new-*"))
	for _, p := range stale {
		if f, err := os.Open(p); err == nil {
			if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
				os.Remove(p)
			}
			f.Close()
		}
	}
}

// samePath says whether f is still what path names (a sweep may have
// removed it since it was opened).
func samePath(f *os.File, path string) bool {
	a, err := f.Stat()
	if err != nil {
		return false
	}
	b, err := os.Stat(path)
	return err == nil && os.SameFile(a, b)
}

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
// folder: an absolute folder other than "/", cgroups named after it, its
// bridges. A sweep trusts nothing else (a damaged record must not make it
// kill, unmount or remove what is not the cluster's).
func (rec clusterRecord) valid() bool {
	if !filepath.IsAbs(rec.Dir) || filepath.Clean(rec.Dir) == "/" || rec.BridgePrefix != bridgePrefix(rec.Dir) {
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

// InterruptContext is a context that the first SIGINT or SIGTERM cancels
// (the program then stops its clusters gracefully); a second one ends the
// process at once with status 130, and each cluster's reaper removes what
// is left. say reports both (nil: nothing is said). The returned function
// releases the context; the signals stay handled until the process ends.
func InterruptContext(parent context.Context, say func(format string, args ...any)) (context.Context, context.CancelFunc) {
	if say == nil {
		say = func(string, ...any) {}
	}
	ctx, cancel := context.WithCancel(parent)
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-signals
		say("%s: stopping (once more to stop at once)", s)
		cancel()
		s = <-signals
		say("%s: stopping at once; the clusters' reapers remove what is left", s)
		os.Exit(130)
	}()
	return ctx, cancel
}
