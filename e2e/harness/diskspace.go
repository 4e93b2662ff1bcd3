package harness

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// A cluster writes its etcd, logs and every real node's containerd store
// (the driver's image unpacked, about 360 MiB a node that runs it) under its
// folder. When that file system fills, the in-process etcd ends the whole
// test process on its first failed write, with no test failure printed, and
// containerd's unpacks fail on the nodes. So Start refuses to begin with too
// little space, and a watcher says on stderr when the space runs low.

// MinFreeEnv overrides the free space Start requires, in MiB.
const MinFreeEnv = "E2E_MIN_FREE_MIB"

const (
	defaultMinFree = 2 << 30   // what Start requires
	lowFree        = 512 << 20 // what the watcher warns under
	freeSpacePoll  = 2 * time.Second
)

// freeSpace is the space an unprivileged writer may still use on the file
// system holding dir.
func freeSpace(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize), nil
}

func minFreeSpace() (uint64, error) {
	v := os.Getenv(MinFreeEnv)
	if v == "" {
		return defaultMinFree, nil
	}
	mib, err := strconv.ParseUint(v, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("%s=%q: want a whole number of MiB (e.g. 1024)", MinFreeEnv, v)
	}
	return mib << 20, nil
}

// checkFreeSpace refuses a cluster folder whose file system has less free
// space than minFreeSpace.
func checkFreeSpace(dir string) error {
	want, err := minFreeSpace()
	if err != nil {
		return err
	}
	free, err := freeSpace(dir)
	if err != nil {
		return nil // nothing to judge by; the cluster's own writes will tell
	}
	if free < want {
		return fmt.Errorf("only %d MiB free on the file system of %s; a cluster needs at least %d MiB "+
			"(etcd, logs, and about 360 MiB for each real node running the driver's image): free some space, "+
			"or set TMPDIR to a folder on a larger file system (%s lowers the bound)",
			free>>20, dir, want>>20, MinFreeEnv)
	}
	return nil
}

// watchFreeSpace prints one line to stderr each time the free space of
// dir's file system drops under lowFree (again after it rose above twice
// that), until ctx ends: a test process that etcd ends then leaves the
// reason in the test output.
func watchFreeSpace(ctx context.Context, dir string) {
	warned := false
	t := time.NewTicker(freeSpacePoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		free, err := freeSpace(dir)
		if err != nil {
			continue
		}
		switch {
		case !warned && free < lowFree:
			warned = true
			fmt.Fprintf(os.Stderr, "e2e harness: cluster %s: only %d MiB left on its file system; "+
				"writes will fail (the in-process etcd then ends the test process with no test failure printed)\n",
				dir, free>>20)
		case warned && free > 2*lowFree:
			warned = false
		}
	}
}
