package harness

// The driver's own image: `make image`'s OCI layout (target/image/oci, the
// multi-architecture index users push), pushed by the harness to its
// cluster's registry with `make image-push`'s code (package imagebuild) as
// the chart's `image.repository` at the chart's appVersion; every `helm
// install`/`upgrade` of the harness sets `image.digest` to the pushed digest,
// so the kubelets of real nodes pull exactly that artifact (containerd picks
// the amd64 image of the index) and a broken image (a missing library, a
// wrong entrypoint or user) fails their pods. The pod loop's runtime
// (runtime.go) refuses the image.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/gpu-dra/e2e/imagebuild"
	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// ImageLayout is the driver's image as `make image` writes it: an OCI
// layout, E2E_IMAGE_LAYOUT, else <repo>/target/image/oci.
func ImageLayout() (string, error) {
	dir := os.Getenv("E2E_IMAGE_LAYOUT")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "target", "image", "oci")
	}
	if !isFile(filepath.Join(dir, "index.json")) {
		return "", fmt.Errorf("%w: the driver's image %s (run `make image`)", ErrMissing, dir)
	}
	return dir, nil
}

// DriverImage pushes (once per cluster) the driver's image (ImageLayout)
// to the cluster's registry as the chart's image.repository:appVersion and
// returns the reference by digest the nodes pull
// (<image.repository>@sha256:...).
func (c *Cluster) DriverImage(ctx context.Context) (string, error) {
	c.driverImageOnce.Do(func() {
		c.driverImageRef, c.driverImageErr = c.pushDriverImage(ctx)
	})
	return c.driverImageRef, c.driverImageErr
}

func (c *Cluster) pushDriverImage(ctx context.Context) (string, error) {
	dir, err := ImageLayout()
	if err != nil {
		return "", err
	}
	repo, err := ChartImageRepository()
	if err != nil {
		return "", err
	}
	version, err := chartAppVersion()
	if err != nil {
		return "", err
	}
	addr, err := c.registry()
	if err != nil {
		return "", err
	}
	// The registry answers for every host: the repository's path under
	// its own address is what containerd asks for ghcr.io's.
	full := normalizeImage(repo)
	_, path, _ := strings.Cut(imageRepository(full), "/")
	pushed, err := imagebuild.Push(ctx, dir, addr+"/"+path+":"+version, true)
	if err != nil {
		return "", fmt.Errorf("push the driver's image to the cluster's registry: %w", err)
	}
	return repo + "@" + pushed.DigestStr(), nil
}

// chartAppVersion is the chart's appVersion (Chart.yaml).
func chartAppVersion() (string, error) {
	path, err := RepoPath(ChartPath + "/Chart.yaml")
	if err != nil {
		return "", err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(data, &chart); err != nil || chart.AppVersion == "" {
		return "", errors.Join(fmt.Errorf("%s: no appVersion", path), err)
	}
	return chart.AppVersion, nil
}

var chartImage struct {
	once sync.Once
	repo string
	err  error
}

// ChartImageRepository is the chart's `image.repository` (values.yaml).
func ChartImageRepository() (string, error) {
	chartImage.once.Do(func() {
		path, err := RepoPath(ChartPath + "/values.yaml")
		if err != nil {
			chartImage.err = err
			return
		}
		data, err := os.ReadFile(path)
		if err != nil {
			chartImage.err = err
			return
		}
		var values struct {
			Image struct {
				Repository string `json:"repository"`
			} `json:"image"`
		}
		if err := yaml.Unmarshal(data, &values); err != nil {
			chartImage.err = fmt.Errorf("%s: %w", path, err)
			return
		}
		if values.Image.Repository == "" {
			chartImage.err = fmt.Errorf("%s: no image.repository", path)
			return
		}
		chartImage.repo = values.Image.Repository
	})
	return chartImage.repo, chartImage.err
}

// RunsOnDriverImage says whether a container image is the chart's.
func RunsOnDriverImage(image string) bool {
	repo, err := ChartImageRepository()
	if err != nil {
		return false
	}
	return image == repo || strings.HasPrefix(image, repo+":") || strings.HasPrefix(image, repo+"@")
}

// errDriverImageOnPodLoop is why a pod-loop node does not run a container
// of the driver's image: only real nodes with a host tree (a deployed
// Layout) have the image and the host paths its pods mount.
func errDriverImageOnPodLoop(pod *v1.Pod) error {
	return fmt.Errorf("pod %s/%s runs the driver's image: only real nodes of a deployed Layout run it", pod.Namespace, pod.Name)
}
