package harness

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The pod phase and container states the kubelet would report, from the
// runtime's containers: Running while one runs, then Succeeded or Failed
// where the restart policy lets the pod end; where it asks for a restart,
// Running with the exited containers waiting in CrashLoopBackOff (their
// exit in lastState), so that a workload controller keeps the pod.
func TestPodStatusFollowsContainers(t *testing.T) {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "uid-1"},
		Spec:       v1.PodSpec{Containers: []v1.Container{{Name: "a"}, {Name: "b"}}},
	}
	type state struct {
		phase ContainerPhase
		code  int32
		msg   string
	}
	for _, tc := range []struct {
		name   string
		policy v1.RestartPolicy
		states map[string]state
		want   v1.PodPhase
	}{
		{"not started", v1.RestartPolicyNever, nil, v1.PodPending},
		{"both running", v1.RestartPolicyNever, map[string]state{"a": {ContainerRunning, 0, ""}, "b": {ContainerRunning, 0, ""}}, v1.PodRunning},
		{"one done, one running", v1.RestartPolicyNever, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerRunning, 0, ""}}, v1.PodRunning},
		{"one failed, one running", v1.RestartPolicyNever, map[string]state{"a": {ContainerExited, 2, ""}, "b": {ContainerRunning, 0, ""}}, v1.PodRunning},
		{"all exited 0", v1.RestartPolicyNever, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 0, ""}}, v1.PodSucceeded},
		{"one exited 3", v1.RestartPolicyNever, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 3, ""}}, v1.PodFailed},
		{"start failed", v1.RestartPolicyNever, map[string]state{"a": {ContainerStartFailed, 128, "hook failed"}, "b": {ContainerExited, 0, ""}}, v1.PodFailed},
		{"on failure, all exited 0", v1.RestartPolicyOnFailure, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 0, ""}}, v1.PodSucceeded},
		{"on failure, one exited 3", v1.RestartPolicyOnFailure, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 3, ""}}, v1.PodRunning},
		{"always, all exited 0", v1.RestartPolicyAlways, map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 0, ""}}, v1.PodRunning},
		{"default policy, one exited 3", "", map[string]state{"a": {ContainerExited, 0, ""}, "b": {ContainerExited, 3, ""}}, v1.PodRunning},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := pod.DeepCopy()
			pod.Spec.RestartPolicy = tc.policy
			r := &runtime{pods: map[types.UID][]*Container{}, byKey: map[string]types.UID{}}
			if tc.states != nil {
				for _, name := range []string{"a", "b"} {
					s := tc.states[name]
					r.pods[pod.UID] = append(r.pods[pod.UID], &Container{Name: name, ID: string(pod.UID) + "_" + name,
						phase: s.phase, exitCode: s.code, message: s.msg, done: make(chan struct{})})
				}
			}
			phase, statuses := r.podStatus(pod)
			if phase != tc.want {
				t.Errorf("phase %s, want %s", phase, tc.want)
			}
			if len(statuses) != 2 {
				t.Fatalf("%d container statuses, want 2", len(statuses))
			}
			for _, st := range statuses {
				s, ok := tc.states[st.Name]
				switch {
				case !ok:
					if st.State.Waiting == nil {
						t.Errorf("%s: %+v, want waiting", st.Name, st.State)
					}
				case s.phase == ContainerRunning:
					if st.State.Running == nil || !st.Ready {
						t.Errorf("%s: %+v, want running and ready", st.Name, st)
					}
				case s.phase == ContainerStartFailed:
					if tt := st.State.Terminated; tt == nil || tt.Reason != "StartError" || tt.Message != s.msg || tt.ExitCode != 128 {
						t.Errorf("%s: %+v, want terminated StartError %q", st.Name, st.State, s.msg)
					}
				case tc.policy != v1.RestartPolicyNever && tc.want == v1.PodRunning:
					if w, tt := st.State.Waiting, st.LastTerminationState.Terminated; w == nil || w.Reason != "CrashLoopBackOff" || tt == nil || tt.ExitCode != s.code {
						t.Errorf("%s: %+v, want waiting in CrashLoopBackOff after exiting with %d", st.Name, st, s.code)
					}
				default:
					if tt := st.State.Terminated; tt == nil || tt.ExitCode != s.code {
						t.Errorf("%s: %+v, want terminated with %d", st.Name, st.State, s.code)
					}
				}
			}
		})
	}
}

// Only phase and container states decide whether the status is written
// again, not timestamps (which the API server rounds to seconds).
func TestStatusSignatureIgnoresTimes(t *testing.T) {
	at := func(d time.Duration) metav1.Time { return metav1.NewTime(time.Unix(1000, 0).Add(d)) }
	running := func(ts metav1.Time) []v1.ContainerStatus {
		return []v1.ContainerStatus{{Name: "a", State: v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: ts}}}}
	}
	if statusSignature(v1.PodRunning, running(at(0))) != statusSignature(v1.PodRunning, running(at(time.Second))) {
		t.Error("signature depends on the start time")
	}
	if statusSignature(v1.PodRunning, running(at(0))) == statusSignature(v1.PodPending, running(at(0))) {
		t.Error("signature ignores the phase")
	}
	exited := []v1.ContainerStatus{{Name: "a", State: v1.ContainerState{Terminated: &v1.ContainerStateTerminated{ExitCode: 1}}}}
	if statusSignature(v1.PodRunning, running(at(0))) == statusSignature(v1.PodRunning, exited) {
		t.Error("signature ignores the container state")
	}
}
