package harness

import (
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A pod on NVIDIA's CUDA image (any tag or digest) gets that image's
// environment, other images the test image's; the pod's env overrides the
// image's in place and adds the rest, as containerd layers them.
func TestContainerEnvIsTheImagesUnderThePods(t *testing.T) {
	for _, image := range []string{CUDAImage, "nvcr.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04", "nvcr.io/nvidia/cuda@sha256:0123", "nvcr.io/nvidia/cuda"} {
		env := ImageEnv(image)
		for _, want := range []string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
			"LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64"} {
			if !slices.Contains(env, want) {
				t.Errorf("%s: env lacks %s: %v", image, want, env)
			}
		}
	}
	for _, image := range []string{"busybox:1.37", "nvcr.io/nvidia/cuda-samples:vectoradd", "registry:5000/nvcr.io/nvidia/cuda:12"} {
		if env := ImageEnv(image); strings.Join(env, " ") != strings.Join(testImageEnv, " ") {
			t.Errorf("%s: env %v, want the test image's %v", image, env, testImageEnv)
		}
	}

	r := &runtime{node: &Node{simRoot: "/sim"}}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p"}}
	ctr := &v1.Container{Image: CUDAImage, Env: []v1.EnvVar{
		{Name: "NVIDIA_VISIBLE_DEVICES", Value: "0"}, {Name: "MINE", Value: "1"}, {Name: "PATH", Value: "/bin"},
	}}
	env := r.ociSpec(pod, ctr).Process.Env
	count := func(name string) int {
		n := 0
		for _, e := range env {
			if strings.HasPrefix(e, name+"=") {
				n++
			}
		}
		return n
	}
	for _, want := range []string{"NVIDIA_VISIBLE_DEVICES=0", "MINE=1", "PATH=/bin", "HOSTNAME=p", "CUDA_VERSION=12.0.0"} {
		if !slices.Contains(env, want) {
			t.Errorf("container env lacks %s: %v", want, env)
		}
	}
	if count("NVIDIA_VISIBLE_DEVICES") != 1 || count("PATH") != 1 {
		t.Errorf("container env repeats a variable the pod overrides: %v", env)
	}
}
