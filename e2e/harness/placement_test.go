package harness

import (
	"strings"
	"testing"
)

// A host with bridged pairs 0-3 and 1-2 (not index-adjacent) and a NIC
// column, as real `nvidia-smi topo -m` prints on hosts with ConnectX cards.
const (
	topoList = `GPU 0: NVIDIA H100 PCIe (UUID: GPU-a)
GPU 1: NVIDIA H100 PCIe (UUID: GPU-b)
GPU 2: NVIDIA H100 PCIe (UUID: GPU-c)
GPU 3: NVIDIA H100 PCIe (UUID: GPU-d)
`
	topoMatrix = "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n" +
		"GPU0\t X \tNODE\tSYS\tNV12\tPIX\t0-31\t0\t\tN/A\n" +
		"GPU1\tNODE\t X \tNV12\tSYS\tNODE\t0-31\t0\t\tN/A\n" +
		"GPU2\tSYS\tNV12\t X \tSYS\tSYS\t32-63\t1\t\tN/A\n" +
		"GPU3\tNV12\tSYS\tSYS\t X \tSYS\t32-63\t1\t\tN/A\n" +
		"NIC0\tPIX\tNODE\tSYS\tSYS\t X \n" +
		"\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)

func TestParseNVLinkPeers(t *testing.T) {
	peers, err := ParseNVLinkPeers(topoList, topoMatrix)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		gpus []string
		want bool
	}{
		{[]string{"GPU-a", "GPU-d"}, true},
		{[]string{"GPU-d", "GPU-a"}, true},
		{[]string{"GPU-b", "GPU-c"}, true},
		{[]string{"GPU-a", "GPU-b"}, false}, // NODE: same socket, no bridge
		{[]string{"GPU-a", "GPU-c"}, false},
		{[]string{"GPU-a", "GPU-b", "GPU-c", "GPU-d"}, false},
		{[]string{"GPU-a", "GPU-x"}, false},
		{[]string{"GPU-a"}, true},
	} {
		if got := peers.Linked(tc.gpus); got != tc.want {
			t.Errorf("Linked(%v) = %v, want %v", tc.gpus, got, tc.want)
		}
	}
}

func TestParseNVLinkPeersRefusesMismatch(t *testing.T) {
	// GPUs in the matrix that nvidia-smi -L does not list.
	if _, err := ParseNVLinkPeers("GPU 0: X (UUID: GPU-a)\n", topoMatrix); err == nil || !strings.Contains(err.Error(), "no such GPU in nvidia-smi -L") {
		t.Errorf("matrix of 4 GPUs against a list of 1: err %v, want one naming the GPU missing from the list", err)
	}
	// Fewer rows than GPUs.
	short := strings.Join(strings.Split(topoMatrix, "\n")[:3], "\n") + "\n\n"
	if _, err := ParseNVLinkPeers(topoList, short); err == nil || !strings.Contains(err.Error(), "2 GPU rows for 4 GPUs") {
		t.Errorf("matrix of 2 rows: err %v, want a row count", err)
	}
	if _, err := ParseNVLinkPeers("No devices were found\n", topoMatrix); err == nil {
		t.Error("empty list: no error")
	}
}
