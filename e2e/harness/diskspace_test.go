package harness

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

func TestStartRefusesAFileSystemWithoutSpace(t *testing.T) {
	dir := t.TempDir()
	free, err := freeSpace(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A bound above what is free: Start refuses before anything runs, naming
	// the folder, both figures and the way out.
	t.Setenv(MinFreeEnv, fmt.Sprint(free>>20+1024))
	_, err = Start(context.Background(), Options{Dir: dir})
	if err == nil {
		t.Fatal("Start began a cluster with less free space than required")
	}
	for _, want := range []string{dir, "MiB free", "TMPDIR", MinFreeEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	t.Setenv(MinFreeEnv, "0")
	if err := checkFreeSpace(dir); err != nil {
		t.Errorf("with no bound: %v", err)
	}
	t.Setenv(MinFreeEnv, "2GiB")
	if err := checkFreeSpace(dir); err == nil || !strings.Contains(err.Error(), "whole number of MiB") {
		t.Errorf("a bound that is not a number: %v", err)
	}
}
