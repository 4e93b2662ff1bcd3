package harness

// kube-controller-manager, in-process: the release's own options, config and
// Run (k8s.io/kubernetes/cmd/kube-controller-manager/app) with its default
// controller set (every controller enabled by default: deployment,
// replicaset, daemonset, statefulset, job, cronjob, namespace, garbage
// collector, resourcequota, serviceaccount, root-ca-cert-publisher, node
// lifecycle with taint eviction, pod GC, resourceclaim, device taint
// eviction, endpoints, ...), as kubeadm runs it, with these differences and
// their reasons:
//   - no serving port (--secure-port=0): nothing here scrapes it, and a
//     fixed port would collide between clusters of one machine;
//   - no leader election: one instance per cluster;
//   - --root-ca-file is the cluster CA (root-ca-cert-publisher puts it in
//     every namespace's kube-root-ca.crt, which projected service account
//     token volumes read);
//   - no --service-account-private-key-file: the legacy token controller
//     (Secrets of type service-account-token) stays off; pods get bound
//     tokens from the API server;
//   - no --cluster-signing-*: no CSR is signed here (kubelets get their
//     certificates from the harness);
//   - the controllers that need a cloud provider (cloud-node-lifecycle,
//     service-lb, node-route) and node IPAM (--allocate-node-cidrs false)
//     do nothing, as on a cluster without a cloud provider.
//
// Invariant: it stops with Cluster.Stop (its context ends; Run returns).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/component-base/configz"
	"k8s.io/klog/v2"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	kcmoptions "k8s.io/kubernetes/cmd/kube-controller-manager/app/options"
)

// startControllerManager runs kube-controller-manager's controllers until
// ctx ends.
func (c *Cluster) startControllerManager(ctx context.Context) error {
	s, err := kcmoptions.NewKubeControllerManagerOptions()
	if err != nil {
		return fmt.Errorf("kube-controller-manager options: %w", err)
	}
	caFile := filepath.Join(c.Dir, "controller-manager-ca.crt")
	if err := os.WriteFile(caFile, c.CA.CertPEM, 0o644); err != nil {
		return err
	}
	s.Generic.ClientConnection.Kubeconfig = c.Kubeconfig
	s.Generic.ClientConnection.QPS = 1000
	s.Generic.ClientConnection.Burst = 2000
	s.Generic.LeaderElection.LeaderElect = false
	s.Generic.Controllers = []string{"*"}
	s.SecureServing.BindPort = 0
	s.SAController.RootCAFile = caFile
	config, err := s.Config(ctx, kcm.KnownControllers(), kcm.ControllersDisabledByDefault(), kcm.ControllerAliases())
	if err != nil {
		return fmt.Errorf("kube-controller-manager config: %w", err)
	}
	// /configz is process-wide; a second cluster of this process (a test's
	// own) registers it again.
	configz.Delete(kcm.ConfigzName)
	completed := config.Complete()
	ctx = klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "kube-controller-manager"))
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		if err := kcm.Run(ctx, completed); err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).Error(err, "kube-controller-manager stopped")
		}
	}()
	return nil
}
