package harness

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// nvidia-smi -L of a container with a whole GPU and a MIG device of
// another GPU, as the tool prints it (the MIG device's parent line too).
const smiList = `GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb)
  MIG 1g.5gb      Device  0: (UUID: MIG-cccc)
`

func TestParseSMIListSeparatesWholeGPUsFromMIGParents(t *testing.T) {
	gpus, migs := ParseSMIList(smiList)
	if strings.Join(gpus, " ") != "GPU-aaaa" {
		t.Errorf("whole GPUs %v, want [GPU-aaaa] (GPU-bbbb is only a MIG device's parent)", gpus)
	}
	if len(migs) != 1 || migs[0] != (SMIDevice{UUID: "MIG-cccc", Parent: "GPU-bbbb", Profile: "1g.5gb"}) {
		t.Errorf("MIG devices %+v", migs)
	}
}

func TestMatchSMIWantsExactlyTheAllocation(t *testing.T) {
	for _, tc := range []struct {
		name string
		want expectedDevices
		ok   bool
	}{
		{"static MIG by UUID", expectedDevices{gpus: []string{"GPU-aaaa"}, migs: []string{"MIG-cccc"}}, true},
		{"dynamic MIG by parent and profile", expectedDevices{gpus: []string{"GPU-aaaa"}, migs: []string{"GPU-bbbb/1g.5gb"}}, true},
		{"a GPU too many", expectedDevices{migs: []string{"MIG-cccc"}}, false},
		{"a MIG device too many", expectedDevices{gpus: []string{"GPU-aaaa"}}, false},
		{"another profile", expectedDevices{gpus: []string{"GPU-aaaa"}, migs: []string{"GPU-bbbb/2g.10gb"}}, false},
		{"a device missing", expectedDevices{gpus: []string{"GPU-aaaa", "GPU-dddd"}, migs: []string{"MIG-cccc"}}, false},
	} {
		ok, seen := matchSMI(smiList, tc.want)
		if ok != tc.ok {
			t.Errorf("%s: match %t, want %t (seen %s)", tc.name, ok, tc.ok, seen)
		}
	}
}

func TestPodRanCountsOnlyRunningOrSucceeded(t *testing.T) {
	if podRan(&podWithPhase("Pending").Pod) || podRan(&podWithPhase("Failed").Pod) {
		t.Error("a Pending or Failed pod counts as run")
	}
	running := podWithPhase("Running")
	if podRan(&running.Pod) {
		t.Error("a Running pod without container statuses counts as run")
	}
	running.withContainer(true, 0, false)
	if !podRan(&running.Pod) {
		t.Error("a Running pod with its container running does not count as run")
	}
	ended := podWithPhase("Running").withContainer(false, 0, true)
	if !podRan(&ended.Pod) {
		t.Error("a container that ended with 0 and is restarted does not count as run")
	}
	crashing := podWithPhase("Running").withContainer(false, 1, true)
	if podRan(&crashing.Pod) {
		t.Error("a container that ended with 1 counts as run")
	}
}

func TestSpecFilesReadsEveryYAMLFileInOrder(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("b.yml", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: b\n")
	write("a.yaml", "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  namespace: a\n")
	write("README.md", "not a spec")
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	write("sub/c.yaml", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: c\n")
	files, err := SpecFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || filepath.Base(files[0].Path) != "a.yaml" || len(files[0].Objects) != 2 || filepath.Base(files[1].Path) != "b.yml" {
		t.Fatalf("files %+v", files)
	}
	if _, err := SpecFiles(filepath.Join(dir, "sub", "none")); err == nil {
		t.Error("a missing folder is no error")
	}
	empty := t.TempDir()
	if _, err := SpecFiles(empty); err == nil || !strings.Contains(err.Error(), "no .yaml") {
		t.Errorf("a folder without YAML: %v", err)
	}
}

func TestDNSLabelMakesANamespacePrefix(t *testing.T) {
	for in, want := range map[string]string{
		"gpu-test1":             "gpu-test1",
		"Gpu_Test.1":            "gpu-test-1",
		"--":                    "spec",
		strings.Repeat("a", 50): strings.Repeat("a", 40),
	} {
		if got := dnsLabel(in); got != want {
			t.Errorf("dnsLabel(%q) = %q, want %q", in, got, want)
		}
	}
}

// testPod builds pods for podRan.
type testPod struct{ v1.Pod }

func podWithPhase(phase string) *testPod {
	return &testPod{v1.Pod{Status: v1.PodStatus{Phase: v1.PodPhase(phase)}}}
}

// withContainer adds a container status: running, or ended with exit
// (restarted when restarted).
func (p *testPod) withContainer(running bool, exit int32, restarted bool) *testPod {
	st := v1.ContainerStatus{Name: "ctr"}
	switch {
	case running:
		st.State.Running = &v1.ContainerStateRunning{}
	case restarted:
		st.RestartCount = 1
		st.State.Waiting = &v1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}
		st.LastTerminationState.Terminated = &v1.ContainerStateTerminated{ExitCode: exit}
	default:
		st.State.Terminated = &v1.ContainerStateTerminated{ExitCode: exit}
	}
	p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, st)
	return p
}
