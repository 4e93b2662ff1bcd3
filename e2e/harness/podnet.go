package harness

// The `kubernetes` Service for a real node's pods, as kube-proxy provides
// it: the kubelet gives every container KUBERNETES_SERVICE_HOST/PORT, the
// Service's cluster IP (KubernetesServiceIP) and port 443, which in-cluster
// clients (our plugin, the uninstall Job) dial. No kube-proxy runs here, so
// per real node:
//   - the pods' CNI network routes the Service range (serviceCIDR) through
//     the node's bridge (realnode.go's CNI config);
//   - an iptables rule in the nat table's PREROUTING chain, for packets that
//     come in on that bridge only (so clusters and nodes on this machine do
//     not share it), rewrites the Service's address to the API server's
//     (127.0.0.1:<port>): kube-proxy's DNAT, to a loopback address, which
//     the kernel routes from the bridge once route_localnet is on there;
//   - the API server's certificate names the Service's IP, as kubeadm's does.
// The rule goes with the node (Node.Stop); RealNodeLeftovers reports one
// left behind.

import (
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

const (
	// KubernetesServiceIP is the `kubernetes` Service's cluster IP: the
	// first address of the API server's --service-cluster-ip-range.
	KubernetesServiceIP = "10.0.0.1"
	serviceCIDR         = "10.0.0.0/16"
)

// forwardAPIService adds the node's rule (see the file's doc).
func (r *realNode) forwardAPIService() error {
	api, err := url.Parse(r.n.cluster.Host)
	if err != nil {
		return err
	}
	iptables, err := exec.LookPath("iptables")
	if err != nil {
		return fmt.Errorf("%w: iptables, for the kubernetes Service of the node's pods", ErrMissing)
	}
	sysctl := filepath.Join("/proc/sys/net/ipv4/conf", r.bridge, "route_localnet")
	if err := os.WriteFile(sysctl, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("route_localnet on %s: %w", r.bridge, err)
	}
	rule := []string{"PREROUTING", "-i", r.bridge, "-d", KubernetesServiceIP + "/32", "-p", "tcp", "--dport", "443",
		"-j", "DNAT", "--to-destination", api.Host}
	args := append([]string{"-w", "-t", "nat", "-A"}, rule...)
	if out, err := exec.Command(iptables, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("iptables %s: %v: %s", strings.Join(args, " "), err, out)
	}
	r.service = rule
	return nil
}

// removeAPIService deletes the node's rule, if it was added.
func (r *realNode) removeAPIService() {
	if r.service == nil {
		return
	}
	_ = exec.Command("iptables", append([]string{"-w", "-t", "nat", "-D"}, r.service...)...).Run()
}

// apiServiceLeft names the node's rule if it is still there.
func (r *realNode) apiServiceLeft() []string {
	if r.service == nil {
		return nil
	}
	if exec.Command("iptables", append([]string{"-w", "-t", "nat", "-C"}, r.service...)...).Run() == nil {
		return []string{"iptables nat rule " + strings.Join(r.service, " ")}
	}
	return nil
}
