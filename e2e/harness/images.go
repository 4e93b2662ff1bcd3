package harness

// The images a node's runtime stands in for. No registry is reachable here,
// so every container runs on the test image (runtime.go) and the pod's
// `image:` selects only the environment the image's config would give the
// container: what a CRI runtime puts in front of the pod's own env. An image
// of the table gets its real environment; any other image gets the test
// image's own (a PATH). Pod env overrides image env by name, as containerd
// does (replace in place, else append). The chart's image is not here: its
// pods run on the driver's image content (imagepods.go).
//
// Invariant: one table, imageConfigs; a new stand-in is one entry.

import (
	"strings"
)

// CUDAImage is a tag of NVIDIA's CUDA base image; any tag of its repository
// gets the environment of imageConfigs' entry.
const CUDAImage = "nvcr.io/nvidia/cuda:12.0.0-base-ubuntu22.04"

// testImageEnv is the test image's own environment (busybox's PATH).
var testImageEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// imageConfig is the environment an image's config sets.
type imageConfig struct {
	// repository matches the image reference with any tag or digest.
	repository string
	// env is the image config's Env, in its order.
	env []string
}

var imageConfigs = []imageConfig{
	{
		// NVIDIA's CUDA images. The environment is that of
		// nvcr.io/nvidia/cuda:12.0.0-base-ubuntu22.04 (NVIDIA's Dockerfile
		// dist/12.0.0/ubuntu2204/base) for every tag: versions differ by tag;
		// NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES for NVIDIA's
		// container runtime, the PATH and LD_LIBRARY_PATH of the driver folders
		// (/usr/local/nvidia) are the same in every CUDA image.
		repository: "nvcr.io/nvidia/cuda",
		env: []string{
			"PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"NVARCH=x86_64",
			"NVIDIA_REQUIRE_CUDA=cuda>=12.0 brand=tesla,driver>=450,driver<451 brand=tesla,driver>=470,driver<471 " +
				"brand=unknown,driver>=470,driver<471 brand=nvidia,driver>=470,driver<471 brand=nvidiartx,driver>=470,driver<471 " +
				"brand=geforce,driver>=470,driver<471 brand=geforcertx,driver>=470,driver<471 brand=quadro,driver>=470,driver<471 " +
				"brand=quadrortx,driver>=470,driver<471 brand=titan,driver>=470,driver<471 brand=titanrtx,driver>=470,driver<471 " +
				"brand=tesla,driver>=510,driver<511 brand=unknown,driver>=510,driver<511 brand=nvidia,driver>=510,driver<511 " +
				"brand=nvidiartx,driver>=510,driver<511 brand=geforce,driver>=510,driver<511 brand=geforcertx,driver>=510,driver<511 " +
				"brand=quadro,driver>=510,driver<511 brand=quadrortx,driver>=510,driver<511 brand=titan,driver>=510,driver<511 " +
				"brand=titanrtx,driver>=510,driver<511 brand=tesla,driver>=515,driver<516 brand=unknown,driver>=515,driver<516 " +
				"brand=nvidia,driver>=515,driver<516 brand=nvidiartx,driver>=515,driver<516 brand=geforce,driver>=515,driver<516 " +
				"brand=geforcertx,driver>=515,driver<516 brand=quadro,driver>=515,driver<516 brand=quadrortx,driver>=515,driver<516 " +
				"brand=titan,driver>=515,driver<516 brand=titanrtx,driver>=515,driver<516 brand=tesla,driver>=520,driver<521 " +
				"brand=unknown,driver>=520,driver<521 brand=nvidia,driver>=520,driver<521 brand=nvidiartx,driver>=520,driver<521 " +
				"brand=geforce,driver>=520,driver<521 brand=geforcertx,driver>=520,driver<521 brand=quadro,driver>=520,driver<521 " +
				"brand=quadrortx,driver>=520,driver<521 brand=titan,driver>=520,driver<521 brand=titanrtx,driver>=520,driver<521",
			"NV_CUDA_CUDART_VERSION=12.0.107-1",
			"NV_CUDA_COMPAT_PACKAGE=cuda-compat-12-0",
			"CUDA_VERSION=12.0.0",
			"LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
			"NVIDIA_VISIBLE_DEVICES=all",
			"NVIDIA_DRIVER_CAPABILITIES=compute,utility",
		},
	},
}

// imageRepository is an image reference without its tag or digest.
func imageRepository(image string) string {
	if at := strings.Index(image, "@"); at >= 0 {
		image = image[:at]
	}
	if colon := strings.LastIndex(image, ":"); colon > strings.LastIndex(image, "/") {
		image = image[:colon]
	}
	return image
}

// ImageEnv is the environment the config of image gives a container, before
// the pod's env: an entry of imageConfigs, else the test image's own.
func ImageEnv(image string) []string {
	repo := imageRepository(image)
	for _, c := range imageConfigs {
		if c.repository == repo {
			return append([]string(nil), c.env...)
		}
	}
	return append([]string(nil), testImageEnv...)
}

// mergeEnv is env with each of overrides ("NAME=value") replacing the entry
// of the same name in place, or appended: how containerd layers the pod's env
// over the image's.
func mergeEnv(env []string, overrides ...string) []string {
	out := append([]string(nil), env...)
	index := map[string]int{}
	for i, e := range out {
		name, _, _ := strings.Cut(e, "=")
		index[name] = i
	}
	for _, e := range overrides {
		name, _, _ := strings.Cut(e, "=")
		if i, ok := index[name]; ok {
			out[i] = e
			continue
		}
		index[name] = len(out)
		out = append(out, e)
	}
	return out
}
