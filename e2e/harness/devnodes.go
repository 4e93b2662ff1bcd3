package harness

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// `gpu-sim setup` lays out the simulated host's /dev with empty regular
// files. A container runtime passes only device nodes into a container (the
// CDI library refuses anything else: "not a device node"), so a node whose
// containers run turns them into character devices with the numbers of the
// simulated /proc/devices, as the kernel driver and nvidia-modprobe make them
// on a real host. Nothing can open them (no driver has those majors here);
// what a container can see is which of them it has.

var (
	gpuNode = regexp.MustCompile(`^nvidia([0-9]+)$`)
	capNode = regexp.MustCompile(`^nvidia-cap([0-9]+)$`)
)

// makeDeviceNodes replaces the regular files standing for device nodes under
// <simRoot>/dev with character devices (idempotent).
func makeDeviceNodes(simRoot string) error {
	majors, err := procDevices(filepath.Join(simRoot, "proc", "devices"))
	if err != nil {
		return err
	}
	number := func(rel string) (major, minor uint32, ok bool) {
		base := filepath.Base(rel)
		switch {
		case base == "nvidiactl":
			return majors["nvidiactl"], 255, true
		case base == "nvidia-uvm":
			return majors["nvidia-uvm"], 0, true
		case base == "nvidia-uvm-tools":
			return majors["nvidia-uvm"], 1, true
		case strings.HasPrefix(rel, "nvidia-caps/") && capNode.MatchString(base):
			m, _ := strconv.ParseUint(capNode.FindStringSubmatch(base)[1], 10, 32)
			return majors["nvidia-caps"], uint32(m), true
		case gpuNode.MatchString(base):
			m, _ := strconv.ParseUint(gpuNode.FindStringSubmatch(base)[1], 10, 32)
			return majors["nvidia"], uint32(m), true
		}
		return 0, 0, false
	}
	dev := filepath.Join(simRoot, "dev")
	return filepath.Walk(dev, func(path string, info os.FileInfo, err error) error {
		if err != nil || !info.Mode().IsRegular() {
			return err
		}
		rel, _ := filepath.Rel(dev, path)
		major, minor, ok := number(rel)
		if !ok || major == 0 {
			return nil
		}
		if err := os.Remove(path); err != nil {
			return err
		}
		if err := unix.Mknod(path, unix.S_IFCHR|0o666, int(unix.Mkdev(major, minor))); err != nil {
			return fmt.Errorf("mknod %s (c %d:%d): %w (containers need root)", path, major, minor, err)
		}
		return unix.Chmod(path, 0o666)
	})
}

// procDevices reads the character-device majors of a /proc/devices file.
func procDevices(path string) (map[string]uint32, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint32{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "Block devices:" {
			break
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			continue
		}
		if m, err := strconv.ParseUint(fields[0], 10, 32); err == nil {
			if _, seen := out[fields[1]]; !seen {
				out[fields[1]] = uint32(m)
			}
		}
	}
	return out, sc.Err()
}
