package harness

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// WaitPodRunning waits until the pod is Running and returns it. On timeout
// the error carries what the pod was waiting for (scheduler condition or
// the DRA manager's prepare error).
func (c *Cluster) WaitPodRunning(ctx context.Context, ns, name string, timeout time.Duration) (*v1.Pod, error) {
	var pod *v1.Pod
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pod = p
		if p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed {
			return false, fmt.Errorf("pod ended (%s)", p.Status.Phase)
		}
		return p.Status.Phase == v1.PodRunning, nil
	})
	if err != nil {
		return pod, fmt.Errorf("pod %s/%s not running after %s (%v): %s", ns, name, timeout, err, PodProblem(pod))
	}
	return pod, nil
}

// PodProblem summarises why a pod is not running.
func PodProblem(pod *v1.Pod) string {
	if pod == nil {
		return "pod not found"
	}
	msg := fmt.Sprintf("phase %q node %q", pod.Status.Phase, pod.Spec.NodeName)
	for _, c := range pod.Status.Conditions {
		if c.Status != v1.ConditionTrue && c.Message != "" {
			msg += fmt.Sprintf("; %s: %s", c.Type, c.Message)
		}
	}
	for _, s := range pod.Status.ContainerStatuses {
		if s.State.Waiting != nil && s.State.Waiting.Message != "" {
			msg += fmt.Sprintf("; container %s waiting: %s", s.Name, s.State.Waiting.Message)
		}
		if t := s.State.Terminated; t != nil {
			msg += fmt.Sprintf("; container %s terminated: exit %d %s %s", s.Name, t.ExitCode, t.Reason, t.Message)
		}
	}
	return msg
}

// WaitPodGone waits until the pod object no longer exists.
func (c *Cluster) WaitPodGone(ctx context.Context, ns, name string, timeout time.Duration) error {
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}
