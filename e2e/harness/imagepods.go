package harness

// Pods that ask for the driver's own image (the chart's `image.repository`,
// any tag or digest), other than DaemonSet pods (daemonset.go), run on the
// driver's image content (`make image-rootfs`, ImageRootfs) instead of the
// test image, with the same translation of the pod spec as DaemonSet pods:
// user and privileges, env, hostPath volumes in the node's tree, the
// projected service-account token and the pod's network namespace with the
// API server forwarded. So the chart's hook Job and the pods it creates run
// our real binaries. Everything else (start, status, logs, exec, kill on
// deletion, never restarted) is the node runtime's (runtime.go). Only nodes
// with a host tree (a deployed Layout) run them.

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
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

// driverImageNets are the network namespaces of running driver-image pods.
var driverImageNets = struct {
	sync.Mutex
	byPod map[types.UID]*podNetwork
}{byPod: map[types.UID]*podNetwork{}}

// startOnDriverImage is runtime.start for a container of the driver's image.
func (r *runtime) startOnDriverImage(pod *v1.Pod, c *Container) error {
	if r.node.daemons == nil {
		return fmt.Errorf("pod %s/%s runs the driver's image: the harness runs it only on nodes with a host tree (a deployed Layout)", pod.Namespace, pod.Name)
	}
	image, err := ImageRootfs()
	if err != nil {
		return err
	}
	netns := ""
	if !pod.Spec.HostNetwork {
		api, err := url.Parse(r.node.cluster.Host)
		if err != nil {
			return err
		}
		network, err := newPodNetwork(api.Host)
		if err != nil {
			return fmt.Errorf("pod %s/%s network: %w", pod.Namespace, pod.Name, err)
		}
		driverImageNets.Lock()
		driverImageNets.byPod[pod.UID] = network
		driverImageNets.Unlock()
		netns = network.path()
	}
	spec, err := r.node.daemons.ociSpec(context.Background(), pod, netns)
	if err != nil {
		closeDriverImageNetwork(pod.UID)
		return err
	}
	key := podKey(pod)
	return r.run(c, spec, image, func() { r.changed(key) })
}

// closeDriverImageNetwork removes the pod's network namespace, if it has one.
func closeDriverImageNetwork(uid types.UID) {
	driverImageNets.Lock()
	network := driverImageNets.byPod[uid]
	delete(driverImageNets.byPod, uid)
	driverImageNets.Unlock()
	if network != nil {
		network.close()
	}
}
