package harness

// Fleets for the benchmarks: many simulated nodes without containers, each
// with a driver started on it, added a few at a time while the machine has
// memory to spare, then awaited until every driver registered and published.
// bench-e2e (one profile, hundreds of nodes) and bench-topology (a mix of
// host shapes) share this.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// FleetOptions say which nodes AddFleet adds and how each is started.
type FleetOptions struct {
	// Count is how many nodes are asked for.
	Count int
	// Node is the options of node i (0 <= i < Count).
	Node func(i int) NodeOptions
	// Start starts the driver on node i once the node is added (our plugin,
	// the reference driver, ...).
	Start func(ctx context.Context, i int, n *Node) error
	// MinFreeMiB: no further node is added once the kernel's MemAvailable is
	// below it (every node costs a plugin process); 0 adds them all.
	MinFreeMiB int
	// Logf reports progress; nil is quiet.
	Logf func(format string, args ...any)
}

// AddFleet adds up to opts.Count nodes, 8 at a time, and starts each. It
// first makes room for the nodes' inotify instances (EnsureInotifyInstances).
// It returns the nodes added, fewer than asked when memory ran short (said
// through Logf), in no particular order; the first error of any node stops
// it.
func (c *Cluster) AddFleet(ctx context.Context, opts FleetOptions) ([]*Node, error) {
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if err := EnsureInotifyInstances(opts.Count, logf); err != nil {
		return nil, err
	}
	var mu sync.Mutex
	var nodes []*Node
	var firstErr error
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for i := range opts.Count {
		if free := MemAvailableMiB(); opts.MinFreeMiB > 0 && free >= 0 && free < opts.MinFreeMiB {
			wg.Wait()
			logf("stopped adding nodes at %d of %d: %d MiB of memory available, the floor is %d MiB", len(nodes), opts.Count, free, opts.MinFreeMiB)
			break
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			n, err := c.AddNode(ctx, opts.Node(i))
			if err == nil {
				err = opts.Start(ctx, i, n)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil && firstErr == nil {
				firstErr = err
			}
			if n != nil {
				nodes = append(nodes, n)
			}
		}()
	}
	wg.Wait()
	return nodes, firstErr
}

// WaitFleetPublished waits until driver is registered with every node's
// kubelet side and every node has a pool of slices, at most timeout, and
// returns how many devices the slices hold. Progress goes to logf every 30 s.
func (c *Cluster) WaitFleetPublished(ctx context.Context, nodes []*Node, driver string, timeout time.Duration, logf func(string, ...any)) (int, error) {
	start := time.Now()
	var devices, registered, published int
	lastReport := time.Now()
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		registered = 0
		for _, n := range nodes {
			if n.DriverRegistered(driver) {
				registered++
			}
		}
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + driver})
		if err != nil {
			return false, nil
		}
		devices = 0
		pools := map[string]bool{}
		for _, s := range list.Items {
			devices += len(s.Spec.Devices)
			pools[s.Spec.Pool.Name] = true
		}
		published = len(pools)
		if logf != nil && time.Since(lastReport) >= 30*time.Second {
			lastReport = time.Now()
			logf("  %s waiting: %d of %d drivers registered, %d pools published", time.Since(start).Round(time.Second), registered, len(nodes), published)
		}
		return registered == len(nodes) && published >= len(nodes), nil
	})
	if err != nil {
		return devices, fmt.Errorf("drivers not all registered with slices after %s: %d of %d registered with their node's kubelet side, %d pools published: %w", timeout, registered, len(nodes), published, err)
	}
	return devices, nil
}

// EnsureInotifyInstances makes room for the inotify instances the nodes take:
// every simulated node's kubelet side watches its registration folder (the
// kubelet's plugin watcher, fsnotify), one instance each, and all run in this
// process, under one user, whose instances the kernel caps at
// fs.inotify.max_user_instances (often 128 or 512; a real node has a kernel of
// its own). A node past the cap never sees its plugin register. The cap is
// raised when this process may write it; otherwise the error says what to run.
func EnsureInotifyInstances(nodes int, logf func(string, ...any)) error {
	const knob = "/proc/sys/fs/inotify/max_user_instances"
	data, err := os.ReadFile(knob)
	if err != nil {
		return nil // not Linux's procfs: nothing to check
	}
	limit, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return fmt.Errorf("%s: %q is not a number", knob, strings.TrimSpace(string(data)))
	}
	// What the machine's processes hold now, and some room for what starts
	// meanwhile (the test binaries' own watchers, other tools).
	need := inotifyInstancesInUse() + nodes + 128
	if limit >= need {
		return nil
	}
	if err := os.WriteFile(knob, []byte(strconv.Itoa(need)), 0o644); err != nil {
		return fmt.Errorf("%d nodes need %d inotify instances (one per node's plugin watcher, plus those in use) and fs.inotify.max_user_instances is %d: run `sysctl -w fs.inotify.max_user_instances=%d` as root, or ask for fewer nodes (%v)", nodes, need, limit, need, err)
	}
	logf("raised fs.inotify.max_user_instances from %d to %d: every simulated node's plugin watcher holds one instance", limit, need)
	return nil
}

// inotifyInstancesInUse counts the inotify instances open in the processes
// this one can see, all users together (an upper bound of this user's).
func inotifyInstancesInUse() int {
	links, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	n := 0
	for _, l := range links {
		if target, err := os.Readlink(l); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// MemAvailableMiB is the kernel's MemAvailable in MiB, -1 when unknown.
func MemAvailableMiB() int {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			var kb int
			if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d", &kb); err == nil {
				return kb / 1024
			}
		}
	}
	return -1
}

// EnvInt is the integer in environment variable name, or def when it is
// unset (the benchmarks' BENCH_* settings); a value that is not an integer is
// an error naming it.
func EnvInt(name string, def int) (int, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("%s=%q: want an integer", name, v)
	}
	return n, nil
}

// EnvIntOrExit is EnvInt for a command's settings: a value that is not an
// integer ends the process with status 2, the error after the command's name.
func EnvIntOrExit(command, name string, def int) int {
	n, err := EnvInt(name, def)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", command, err)
		os.Exit(2)
	}
	return n
}

// JoinInts writes ns with sep between them ([0 1], "," -> "0,1"): GPU
// indexes for a plugin flag, a Node annotation or a chart value.
func JoinInts(ns []int, sep string) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, sep)
}
