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
//   - sweep (sweep.go) removes everything of a cluster: it freezes the cluster's
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
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
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
	if errors.Is(err, os.ErrNotExist) {
		return 0 // Stop came first (it removes the record after its sweep)
	}
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
	// It waits for the whole life of the cluster: what the binary's package
	// initialisation left as garbage goes back to the system.
	debug.FreeOSMemory()
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
	// The harness is this process's parent until it ends; a pipe that
	// closes while it runs is no end of the cluster (nothing closes it but
	// the harness's end, but a sweep under a live cluster would kill it).
	for os.Getppid() == rec.Pid {
		time.Sleep(100 * time.Millisecond)
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
