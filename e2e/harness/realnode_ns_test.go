package harness

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestDriverFilesLookSeesWhatAnOverlayMisses: the look that decides when a
// host-driver node's driver overlays are mounted anew changes with what an
// overlay keeps stale (a link repointed, a file replaced by another inode, a
// file added or removed) and only then; a file rewritten in place is the
// same inode, which the overlay reads through.
func TestDriverFilesLookSeesWhatAnOverlayMisses(t *testing.T) {
	root := t.TempDir()
	lib := filepath.Join(root, "usr/lib/x86_64-linux-gnu")
	bin := filepath.Join(root, "usr/bin")
	for _, d := range []string{lib, bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, text string) {
		t.Helper()
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(lib, "libnvidia-ml.so.580.95.05"), "old")
	write(filepath.Join(lib, "libnvidia-ml.so.580.105.08"), "new")
	write(filepath.Join(bin, "nvidia-smi"), "tool")
	if err := os.Symlink("libnvidia-ml.so.580.95.05", filepath.Join(lib, "libnvidia-ml.so.1")); err != nil {
		t.Fatal(err)
	}
	r := &realNode{n: &Node{Name: "n", HostRoot: root}}
	look := r.driverFilesLook()
	same := func(what string, want bool) {
		t.Helper()
		now := r.driverFilesLook()
		if (now == look) != want {
			t.Errorf("%s: look unchanged = %v, want %v:\nbefore:\n%s\nafter:\n%s", what, now == look, want, look, now)
		}
		look = now
	}
	same("nothing done", true)

	write(filepath.Join(bin, "nvidia-smi"), "tool, rewritten in place")
	same("a file rewritten in place", true)

	tmp := filepath.Join(lib, ".link")
	if err := os.Symlink("libnvidia-ml.so.580.105.08", tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(lib, "libnvidia-ml.so.1")); err != nil {
		t.Fatal(err)
	}
	same("the soname link repointed", false)

	write(filepath.Join(bin, ".nvidia-smi"), "tool, new")
	if err := os.Rename(filepath.Join(bin, ".nvidia-smi"), filepath.Join(bin, "nvidia-smi")); err != nil {
		t.Fatal(err)
	}
	same("a tool replaced by a new file", false)

	if err := os.Remove(filepath.Join(lib, "libnvidia-ml.so.580.95.05")); err != nil {
		t.Fatal(err)
	}
	same("the old library removed", false)
}

// TestFollowDriverFilesWithoutHostTree: on a node without a host-driver
// namespace (pod-loop node, container-driver layout) an upgrade's result
// passes through untouched.
func TestFollowDriverFilesWithoutHostTree(t *testing.T) {
	failed := errors.New("upgrade failed")
	for _, r := range []*realNode{nil, {n: &Node{Name: "n", Layout: LayoutHostDriver}}} {
		done := make(chan error, 1)
		done <- failed
		if err := r.followDriverFiles(context.Background(), done); !errors.Is(err, failed) {
			t.Errorf("node %+v: followDriverFiles = %v, want the upgrade's error", r, err)
		}
	}
}
