package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-dra/e2e/harness"
)

// What runs inside the containers: nvidia-smi -L lists exactly the devices
// a container was allocated, the driver library is where the loader finds
// it, and the container's own command saw its devices.

var (
	smiGPU = regexp.MustCompile(`(?m)^GPU [0-9]+: .* \(UUID: (GPU-[0-9a-fA-F-]+)\)$`)
	smiMIG = regexp.MustCompile(`(?m)^\s+MIG .* Device\s+[0-9]+: \(UUID: (MIG-[0-9a-fA-F-]+)\)$`)
)

// visibleDevices runs `nvidia-smi -L` in a running container and returns the
// GPU and MIG UUIDs it lists.
func visibleDevices(ctx context.Context, t *testing.T, pod *v1.Pod, ctr string) (gpus, migs []string) {
	t.Helper()
	res, err := execIn(ctx, pod, ctr, "nvidia-smi", "-L")
	if err != nil {
		t.Fatalf("pod %s container %s: exec nvidia-smi -L: %v", pod.Name, ctr, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("pod %s container %s: nvidia-smi -L exited %d: %s%s", pod.Name, ctr, res.ExitCode, res.Stdout, res.Stderr)
	}
	for _, m := range smiGPU.FindAllStringSubmatch(res.Stdout, -1) {
		gpus = append(gpus, m[1])
	}
	for _, m := range smiMIG.FindAllStringSubmatch(res.Stdout, -1) {
		migs = append(migs, m[1])
	}
	t.Logf("pod %s container %s: nvidia-smi -L:\n%s", pod.Name, ctr, strings.TrimRight(res.Stdout, "\n"))
	return sorted(gpus), sorted(migs)
}

// claimUse is a claim a container uses, and the one request of it that the
// container names ("" for all).
type claimUse struct {
	claim   *resourceapi.ResourceClaim
	request string
}

// containerClaims are the claims (and requests) a container names, and the
// claim generated for its extended resources.
func containerClaims(ctx context.Context, t *testing.T, pod *v1.Pod, ctr v1.Container) []claimUse {
	t.Helper()
	type ref struct{ claim, request string }
	var refs []ref
	claimOf := map[string]string{}
	for _, st := range pod.Status.ResourceClaimStatuses {
		if st.ResourceClaimName != nil {
			claimOf[st.Name] = *st.ResourceClaimName
		}
	}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.ResourceClaimName != nil {
			claimOf[pc.Name] = *pc.ResourceClaimName
		}
	}
	for _, c := range ctr.Resources.Claims {
		name, ok := claimOf[c.Name]
		if !ok {
			t.Fatalf("pod %s: claim %q of container %s has no ResourceClaim", pod.Name, c.Name, ctr.Name)
		}
		refs = append(refs, ref{name, c.Request})
	}
	if ext := pod.Status.ExtendedResourceClaimStatus; ext != nil {
		for _, m := range ext.RequestMappings {
			if m.ContainerName == ctr.Name {
				refs = append(refs, ref{ext.ResourceClaimName, m.RequestName})
			}
		}
	}
	var out []claimUse
	for _, r := range refs {
		claim, err := cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, r.claim, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if claim.Status.Allocation == nil {
			t.Fatalf("claim %s of pod %s not allocated", claim.Name, pod.Name)
		}
		out = append(out, claimUse{claim, r.request})
	}
	return out
}

// allocatedDevices are the GPU and MIG UUIDs a container was allocated: the
// results of the claims (and requests) it names, and of the extended
// resources it asks for, looked up in the published slices. A MIG device's
// parent GPU is listed too, as nvidia-smi shows a MIG device under its GPU.
func allocatedDevices(ctx context.Context, t *testing.T, pod *v1.Pod, ctr v1.Container) (gpus, migs []string) {
	t.Helper()
	seen := map[string]bool{}
	add := func(list *[]string, uuid string) {
		if uuid != "" && !seen[uuid] {
			seen[uuid] = true
			*list = append(*list, uuid)
		}
	}
	for _, use := range containerClaims(ctx, t, pod, ctr) {
		for _, res := range use.claim.Status.Allocation.Devices.Results {
			request, _, _ := strings.Cut(res.Request, "/")
			if res.Driver != harness.DefaultDriver || (use.request != "" && request != use.request) {
				continue
			}
			d := sliceDevice(ctx, t, res.Pool, res.Device)
			if attrString(d, "type") == "mig" {
				uuid := attrString(d, "uuid")
				if uuid == "" {
					// A dynamic MIG device: its instance exists since prepare.
					uuid = dynamicMIGUUID(t, res.Pool, attrString(d, "parentUUID"), attrString(d, "profile"))
				}
				add(&migs, uuid)
				add(&gpus, attrString(d, "parentUUID"))
			} else {
				add(&gpus, attrString(d, "uuid"))
			}
		}
	}
	return sorted(gpus), sorted(migs)
}

// checkMPSControl checks the MPS control daemon of the container's claim
// through a CUDA program in the container, which finds the daemon through the
// pipe directory and CUDA_MPS_PIPE_DIRECTORY its CDI devices give it: its
// server's active thread percentage must be the claim's
// defaultActiveThreadPercentage (else MPS's 100) and, for a one-device claim,
// its pinned memory limit of device 0 the claim's
// defaultPerDevicePinnedMemoryLimit["0"] or else
// defaultPinnedDeviceMemoryLimit, as MPS prints them ("50.0", "4G"). The
// container has no nvidia-cuda-mps-control: MPS clients get no control tool.
func checkMPSControl(ctx context.Context, t *testing.T, pod *v1.Pod, ctr v1.Container) {
	t.Helper()
	wantPct, wantMem := "", ""
	devices := 0
	// A share of a memory-share GPU: the daemon is the GPU's, shared with
	// other claims and without defaults; the client's own limits come from
	// its environment (its share, unless the config says less).
	var share, total int64
	for _, use := range containerClaims(ctx, t, pod, ctr) {
		devices += len(use.claim.Status.Allocation.Devices.Results)
		for _, res := range use.claim.Status.Allocation.Devices.Results {
			if q, ok := res.ConsumedCapacity["memory"]; ok && res.ShareID != nil && res.Driver == harness.DefaultDriver {
				capacity := sliceDevice(ctx, t, res.Pool, res.Device).Capacity["memory"]
				share, total = q.Value(), capacity.Value.Value()
			}
		}
		for _, cfg := range use.claim.Status.Allocation.Devices.Config {
			if cfg.Opaque == nil || cfg.Opaque.Driver != harness.DefaultDriver {
				continue
			}
			var params struct {
				Sharing struct {
					MPSConfig struct {
						DefaultActiveThreadPercentage     *int              `json:"defaultActiveThreadPercentage"`
						DefaultPinnedDeviceMemoryLimit    string            `json:"defaultPinnedDeviceMemoryLimit"`
						DefaultPerDevicePinnedMemoryLimit map[string]string `json:"defaultPerDevicePinnedMemoryLimit"`
					} `json:"mpsConfig"`
				} `json:"sharing"`
			}
			if err := json.Unmarshal(cfg.Opaque.Parameters.Raw, &params); err != nil {
				t.Fatalf("claim %s opaque config: %v", use.claim.Name, err)
			}
			mps := params.Sharing.MPSConfig
			if mps.DefaultActiveThreadPercentage != nil {
				wantPct = fmt.Sprintf("%d.0", *mps.DefaultActiveThreadPercentage)
			}
			limit := mps.DefaultPinnedDeviceMemoryLimit
			if l, ok := mps.DefaultPerDevicePinnedMemoryLimit["0"]; ok {
				limit = l
			}
			if limit != "" {
				q, err := resource.ParseQuantity(limit)
				if err != nil {
					t.Fatalf("claim %s: memory limit %q: %v", use.claim.Name, limit, err)
				}
				if mib := q.Value() >> 20; mib%1024 == 0 {
					wantMem = fmt.Sprintf("%dG", mib/1024)
				} else {
					wantMem = fmt.Sprintf("%dM", mib)
				}
			}
		}
	}
	if share > 0 {
		if wantPct == "" {
			wantPct = fmt.Sprintf("%d.0", max(share*100/total, 1))
		}
		if wantMem == "" {
			if mib := share >> 20; mib%1024 == 0 {
				wantMem = fmt.Sprintf("%dG", mib/1024)
			} else {
				wantMem = fmt.Sprintf("%dM", mib)
			}
		}
		t.Logf("pod %s container %s: a memory share of %d of %d bytes: want %s%% of the threads and %s pinned memory", pod.Name, ctr.Name, share, total, wantPct, wantMem)
		checkMPSClient(ctx, t, pod, ctr, wantPct, wantMem, devices == 1)
		return
	}
	res, err := execIn(ctx, pod, ctr.Name, "sh", "-c", "command -v nvidia-cuda-mps-control")
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode == 0 {
		t.Errorf("pod %s container %s: an MPS client has the control tool: %s", pod.Name, ctr.Name, res.Stdout)
	}
	if wantPct == "" {
		wantPct = "100.0"
	}
	checkMPSClient(ctx, t, pod, ctr, wantPct, wantMem, devices == 1)
}

// checkMPSClient: a CUDA program (the simulator's cuda-app) in the container
// joins an MPS server through the pipe directory alone (the container keeps
// its own PID, IPC and mount namespaces and a private /dev/shm) and runs with
// active thread percentage pct and, when oneDevice, pinned memory wantMem
// (unless empty).
func checkMPSClient(ctx context.Context, t *testing.T, pod *v1.Pod, ctr v1.Container, pct, wantMem string, oneDevice bool) {
	t.Helper()
	res, err := execIn(ctx, pod, ctr.Name, "cuda-app")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod %s container %s: cuda-app says:\n%s", pod.Name, ctr.Name, res.Stdout)
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "MPS server ") {
		t.Errorf("pod %s container %s: the CUDA program did not join an MPS server (exit %d): %s%s", pod.Name, ctr.Name, res.ExitCode, res.Stdout, res.Stderr)
		return
	}
	if want := "active thread percentage " + pct + "\n"; !strings.Contains(res.Stdout, want) {
		t.Errorf("pod %s container %s: the CUDA program's MPS server does not run with %q: %s", pod.Name, ctr.Name, want, res.Stdout)
	}
	if oneDevice && wantMem != "" && !strings.Contains(res.Stdout, "pinned memory limit "+wantMem+"\n") {
		t.Errorf("pod %s container %s: the CUDA program's MPS server does not limit pinned memory to %s: %s", pod.Name, ctr.Name, wantMem, res.Stdout)
	}
}

func sorted(s []string) []string {
	sort.Strings(s)
	return s
}

// checkContainerSees asserts that nvidia-smi -L in the container lists
// exactly the GPUs and MIG devices allocated to it.
func checkContainerSees(ctx context.Context, t *testing.T, pod *v1.Pod, ctr v1.Container) {
	t.Helper()
	wantGPUs, wantMIGs := allocatedDevices(ctx, t, pod, ctr)
	if len(wantGPUs)+len(wantMIGs) == 0 {
		t.Errorf("pod %s container %s asks for devices but none of ours is allocated to it", pod.Name, ctr.Name)
	}
	gpus, migs := visibleDevices(ctx, t, pod, ctr.Name)
	if strings.Join(gpus, " ") != strings.Join(wantGPUs, " ") {
		t.Errorf("pod %s container %s: nvidia-smi -L lists GPUs %v, allocated %v", pod.Name, ctr.Name, gpus, wantGPUs)
	}
	if strings.Join(migs, " ") != strings.Join(wantMIGs, " ") {
		t.Errorf("pod %s container %s: nvidia-smi -L lists MIG devices %v, allocated %v", pod.Name, ctr.Name, migs, wantMIGs)
	}
}

// libnvidiaML is the NVML library's soname, the name programs dlopen.
const libnvidiaML = "libnvidia-ml.so.1"

var versionedNVML = regexp.MustCompile(`^/usr/lib/x86_64-linux-gnu/libnvidia-ml\.so\.[0-9]+\.[0-9.]+$`)

// checkDriverLibrary asserts the driver's NVML library, as the container's
// CDI devices mount it (libnvidia-ml.so.<driver version>, the file the driver
// installs), is in the container, and looks at how the loader would find it.
func checkDriverLibrary(ctx context.Context, t *testing.T, pod *v1.Pod, ctr string, devices []harness.ResolvedDevice) {
	t.Helper()
	lib := ""
	for _, r := range devices {
		for _, m := range r.Mounts() {
			if versionedNVML.MatchString(m.ContainerPath) {
				lib = m.ContainerPath
			}
		}
	}
	if lib == "" {
		t.Errorf("pod %s container %s: its CDI devices mount no libnvidia-ml.so.<version>", pod.Name, ctr)
		return
	}
	res, err := execIn(ctx, pod, ctr, "test", "-s", lib)
	if err != nil || res.ExitCode != 0 {
		t.Errorf("pod %s container %s: %s not in the container (%v, exit %d)", pod.Name, ctr, lib, err, res.ExitCode)
	}
	cache, err := execIn(ctx, pod, ctr, "ldconfig", "-p")
	if err != nil || cache.ExitCode != 0 {
		t.Fatalf("pod %s container %s: ldconfig -p: %v (exit %d) %s", pod.Name, ctr, err, cache.ExitCode, cache.Stderr)
	}
	if !strings.Contains(cache.Stdout, "libc.so.6") {
		t.Errorf("pod %s container %s: ldconfig -p does not read the image's cache: %s", pod.Name, ctr, cache.Stdout)
	}
	soname, err := execIn(ctx, pod, ctr, "test", "-e", "/usr/lib/x86_64-linux-gnu/"+libnvidiaML)
	if err != nil {
		t.Fatal(err)
	}
	// The specs' hooks (NVIDIA's nvidia-cdi-hook: create-symlinks, then
	// update-ldcache) ran in the container: the soname link sits next to the
	// versioned file and the loader cache lists it, so a program that dlopens
	// "libnvidia-ml.so.1" (every NVML and CUDA user) finds it.
	if !strings.Contains(cache.Stdout, libnvidiaML) {
		t.Errorf("pod %s container %s: the loader cache does not list %s (update-ldcache hook did not run): %s", pod.Name, ctr, libnvidiaML, cache.Stdout)
	}
	if soname.ExitCode != 0 {
		t.Errorf("pod %s container %s: no /usr/lib/x86_64-linux-gnu/%s link (create-symlinks hook did not run)", pod.Name, ctr, libnvidiaML)
	}
}

// checkNoGPU asserts a container without devices has no nvidia-smi and no
// GPU device node.
func checkNoGPU(ctx context.Context, t *testing.T, pod *v1.Pod, ctr string) {
	t.Helper()
	res, err := execIn(ctx, pod, ctr, "sh", "-c", "ls /dev/nvidia* 2>/dev/null; command -v nvidia-smi")
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(res.Stdout) != "" {
		t.Errorf("pod %s container %s has no devices but sees: %s", pod.Name, ctr, res.Stdout)
	}
}

// checkContainerLog waits until the container's own output contains want.
func checkContainerLog(ctx context.Context, t *testing.T, pod *v1.Pod, ctr, want string) {
	t.Helper()
	var logs string
	if !eventually(ctx, 10*time.Second, func() bool {
		logs, _ = containerLogs(ctx, pod, ctr)
		return strings.Contains(logs, want)
	}) {
		t.Errorf("pod %s container %s: log lacks %q:\n%s", pod.Name, ctr, want, logs)
	}
}

// mpsPipeDir is the CUDA_MPS_PIPE_DIRECTORY a container's CDI devices set.
func mpsPipeDir(rs []harness.ResolvedDevice) string {
	for _, r := range rs {
		if v, ok := envValue(r.Env(), "CUDA_MPS_PIPE_DIRECTORY"); ok {
			return v
		}
	}
	return ""
}
