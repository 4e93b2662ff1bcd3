package harness

// The driver's own image (the chart's `image.repository`, any tag or
// digest): real nodes pull it from the cluster's registry like any image of
// the catalogue (nodeimages.go), made from `make image-rootfs`'s content; the
// pod loop's runtime (runtime.go) refuses it.

import (
	"fmt"
	"os"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

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
