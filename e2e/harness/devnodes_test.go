package harness

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// The simulated host's regular files become character devices with the
// numbers of its /proc/devices; other files stay as they are.
func TestMakeDeviceNodes(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"proc/devices":                 "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n195 nvidiactl\n236 nvidia-caps\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
		"dev/nvidia3":                  "",
		"dev/nvidiactl":                "",
		"dev/nvidia-uvm-tools":         "",
		"dev/nvidia-caps/nvidia-cap13": "",
		"dev/other":                    "",
	}
	for rel, content := range files {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 { // idempotent
		if err := makeDeviceNodes(root); err != nil {
			t.Fatal(err)
		}
	}
	for rel, want := range map[string][2]uint32{
		"dev/nvidia3":                  {195, 3},
		"dev/nvidiactl":                {195, 255},
		"dev/nvidia-uvm-tools":         {508, 1},
		"dev/nvidia-caps/nvidia-cap13": {236, 13},
	} {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(root, rel), &st); err != nil {
			t.Fatal(err)
		}
		got := [2]uint32{unix.Major(st.Rdev), unix.Minor(st.Rdev)}
		if st.Mode&unix.S_IFMT != unix.S_IFCHR || got != want {
			t.Errorf("%s: mode %o rdev %v, want a character device %v", rel, st.Mode, got, want)
		}
	}
	if info, err := os.Stat(filepath.Join(root, "dev/other")); err != nil || !info.Mode().IsRegular() {
		t.Errorf("dev/other: %v %v, want it left a regular file", info, err)
	}
}
