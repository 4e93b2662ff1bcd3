package harness

// The Job controller of kube-controller-manager, so that Jobs run: the
// chart's pre-delete hook is a Job, and `helm uninstall` waits for it to
// complete. Started with the other controllers (cluster.go) on their
// informer factory.

import (
	"context"
	"fmt"

	"k8s.io/client-go/informers"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/job"
)

// startJobController builds the Job controller on factory (started by the
// caller) and runs it until ctx ends.
func (c *Cluster) startJobController(ctx context.Context, factory informers.SharedInformerFactory) error {
	jobs, err := job.NewController(klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "job-controller")),
		c.Client, factory.Core().V1().Pods(), factory.Batch().V1().Jobs(), nil, nil)
	if err != nil {
		return fmt.Errorf("job controller: %w", err)
	}
	c.wg.Add(1)
	go func() { defer c.wg.Done(); jobs.Run(ctx, 2) }()
	return nil
}
