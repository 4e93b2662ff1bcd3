package harness

// A control plane of another Kubernetes release, run as processes: the
// release's own kube-apiserver, kube-controller-manager and kube-scheduler
// binaries (built from its Go module, e2e/release-<minor>: `make e2e-1.34`,
// `e2e-1.35`, `e2e-1.36`),
// with the flags the in-process control plane gets (apiServerArgs,
// controllermanager.go), and the release's kubelet on real nodes. The
// in-process control plane is the newest release's; this one shows what a
// cluster of an older supported release does with the driver.
//
// Differences from the in-process control plane: the API server's requests
// are not counted (APIRequests is empty); the three processes log to
// Dir/<name>.log. etcd stays in-process (one etcd serves every supported
// release). Pod-loop nodes keep the harness module's kubelet code (its
// plugin watcher and DRA manager); only real nodes run the release's
// kubelet.
//
// Invariant: the processes run in the cluster's cgroups (its reaper kills
// them if this process dies) and stop with Cluster.Stop, after the nodes.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"time"
)

// ReleaseDirEnv names a directory holding kube-apiserver,
// kube-controller-manager, kube-scheduler and kubelet of another Kubernetes
// release: set, every Cluster of the process runs that release (Options.ReleaseDir).
const ReleaseDirEnv = "E2E_K8S_RELEASE_DIR"

// releaseBinaries are what a release directory must hold.
var releaseBinaries = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"}

// checkReleaseDir says which release binary is missing from dir, naming the
// make target that builds them.
func checkReleaseDir(dir string) error {
	for _, b := range releaseBinaries {
		if !isFile(filepath.Join(dir, b)) {
			return fmt.Errorf("%w: %s not in %s (%s=%s; `make e2e-1.34-tools`, `e2e-1.35-tools` or `e2e-1.36-tools` builds a release's binaries)", ErrMissing, b, dir, ReleaseDirEnv, dir)
		}
	}
	return nil
}

// startExternalAPIServer starts the release's kube-apiserver as a process
// with apiServerArgs on a free port of 127.0.0.1.
func (c *Cluster) startExternalAPIServer(dir, etcdURL string, gates map[string]bool) (*apiserver, error) {
	args, err := apiServerArgs(dir, etcdURL, c.CA, gates)
	if err != nil {
		return nil, err
	}
	port, err := freePortOn(net.ParseIP("127.0.0.1"))
	if err != nil {
		return nil, err
	}
	args = append([]string{filepath.Join(c.releaseDir, "kube-apiserver")}, append(args, "--secure-port="+strconv.Itoa(port))...)
	d, err := c.startReleaseProcess("kube-apiserver", args)
	if err != nil {
		return nil, err
	}
	a := &apiserver{host: fmt.Sprintf("https://127.0.0.1:%d", port), errCh: make(chan error, 1)}
	go func() {
		<-d.done
		a.errCh <- fmt.Errorf("kube-apiserver exited (%s); its log: %s", d.cmd.ProcessState, filepath.Join(c.Dir, "kube-apiserver.log"))
		close(a.errCh)
	}()
	return a, nil
}

// startExternalControllers starts the release's kube-controller-manager
// and kube-scheduler as processes, configured as the in-process ones
// (controllermanager.go says why each setting), with the same feature gates
// as the API server.
func (c *Cluster) startExternalControllers(gates map[string]bool) error {
	caFile := filepath.Join(c.Dir, "controller-manager-ca.crt")
	if err := os.WriteFile(caFile, c.CA.CertPEM, 0o644); err != nil {
		return err
	}
	common := []string{"--kubeconfig=" + c.Kubeconfig, "--kube-api-qps=1000", "--kube-api-burst=2000", "--leader-elect=false", "--secure-port=0"}
	if flag := featureGatesFlag(gates); flag != "" {
		common = append(common, flag)
	}
	kcm := append([]string{filepath.Join(c.releaseDir, "kube-controller-manager"), "--controllers=*", "--root-ca-file=" + caFile}, common...)
	if _, err := c.startReleaseProcess("kube-controller-manager", kcm); err != nil {
		return err
	}
	sched := append([]string{filepath.Join(c.releaseDir, "kube-scheduler")}, common...)
	_, err := c.startReleaseProcess("kube-scheduler", sched)
	return err
}

// startReleaseProcess starts one of the release's control-plane binaries,
// logging to Dir/<name>.log, stopped by Cluster.Stop after the nodes.
func (c *Cluster) startReleaseProcess(name string, args []string) (*daemon, error) {
	d, err := startDaemon(c, name, filepath.Join(c.Dir, name+".log"), nil, args...)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.stops = append(c.stops, func() { d.stop(10 * time.Second) })
	c.mu.Unlock()
	return d, nil
}

// releasePattern finds a Kubernetes 1.x release in a version string.
var releasePattern = regexp.MustCompile(`v1\.(\d+)\.\d+`)

// ReleaseMinor is the minor version of the Kubernetes release a version
// string names ("v1.34.12", "Kubernetes v1.34.12" -> 34); -1 if it names none.
func ReleaseMinor(version string) int {
	m := releasePattern.FindStringSubmatch(version)
	if m == nil {
		return -1
	}
	minor, _ := strconv.Atoi(m[1])
	return minor
}

// binaryMinors caches releaseMinorOf: a binary's release does not change
// while the process runs, and every real node's start asks its kubelet's.
var binaryMinors sync.Map // path -> int

// releaseMinorOf is the minor version of the release a Kubernetes binary
// reports with --version ("Kubernetes v1.34.12" -> 34).
func releaseMinorOf(binary string) (int, error) {
	if minor, ok := binaryMinors.Load(binary); ok {
		return minor.(int), nil
	}
	out, err := exec.Command(binary, "--version").CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("%s --version: %v: %s", binary, err, out)
	}
	minor := ReleaseMinor(string(out))
	if minor < 0 {
		return 0, fmt.Errorf("%s --version: no Kubernetes 1.x release in %q", binary, out)
	}
	binaryMinors.Store(binary, minor)
	return minor, nil
}

// waitControllersUp waits until the release's controller manager runs: its
// serviceaccount controller has made the default namespace's `default`
// ServiceAccount, which pods there need.
func (c *Cluster) waitControllersUp(ctx context.Context) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if _, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1GetOptions); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			return fmt.Errorf("kube-controller-manager made no default ServiceAccount in 2m (log %s): %w", filepath.Join(c.Dir, "kube-controller-manager.log"), err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Release is the Kubernetes release the cluster runs ("v1.34.12"): its API
// server's /version, which a release built by the make targets reports.
func (c *Cluster) Release(ctx context.Context) (string, error) {
	v, err := c.Client.Discovery().ServerVersion()
	if err != nil {
		return "", err
	}
	return v.GitVersion, nil
}

// ReleaseDir is the directory of the release the cluster runs as processes
// (Options.ReleaseDir); "" for the in-process control plane.
func (c *Cluster) ReleaseDir() string { return c.releaseDir }
