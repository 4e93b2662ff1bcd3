package harness

// The real nodes' image catalogue: every image a pod on a real node can
// use, one table (nodeImageCatalogue). No registry is reachable here, so
// each image is made from root filesystems the harness has (ociimage.go):
// the test image (busybox, glibc, the simulator's nvidia-smi and CUDA
// program), plus small trees on top where the real image has more: bash
// (the host's, with the libraries it needs that the test image lacks) and
// the CUDA sample's /tmp/sample (the simulated CUDA program).
//
// Two kinds of entries:
//   - name: one full reference, imported into every real node's containerd
//     before its kubelet starts (the sandbox image must be there at once);
//   - repository: any tag of it, served by the cluster's registry
//     (registry.go), which every real node's containerd uses for every
//     registry host; the kubelet pulls the image as on any cluster. A digest
//     reference resolves only to the catalogue's own manifest digest.
// The driver's own image is not in the catalogue: it is `make image`'s,
// pushed to the registry as users push it (imagepods.go).
// A reference matching no entry and not pushed is unknown to the registry:
// the pull fails and the kubelet reports ErrImagePull, then ImagePullBackOff.

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
)

// Images of the real nodes' catalogue imported by name.
const (
	// TestImageName is the test image (TestImage) as real nodes know it.
	// A pod asking for it runs the image's default command (a long sleep)
	// unless it says otherwise.
	TestImageName = "e2e.invalid/gpu-dra/test-image:1"
	// PauseImageName is the pod sandbox image of real nodes' containerd:
	// the test image's busybox sleeping (containerd kills a sandbox with
	// SIGKILL, so it needs no signal handling of its own).
	PauseImageName = "e2e.invalid/gpu-dra/pause:1"
)

// imagePath is the PATH of Debian's, Ubuntu's and busybox's images.
const imagePath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// nodeImage is one entry of the catalogue.
type nodeImage struct {
	// name is a full reference imported into every real node; repository
	// (normalized: docker.io/library/ubuntu) matches any tag of it, served
	// by the registry. One of the two.
	name, repository string
	// layers are the root filesystems the image is made of, lowest first.
	layers []imageLayer
	config ImageConfig
}

// imageLayer is a root filesystem the harness has or makes.
type imageLayer func(c *Cluster) (string, error)

func testImageLayer(*Cluster) (string, error) { return TestImage() }

// repo is the entry's normalized repository ("" for an entry by name).
func (img nodeImage) repo() string { return img.repository }

// nodeImageCatalogue is every image a real node's pods can use.
var nodeImageCatalogue = []nodeImage{
	{name: PauseImageName, layers: []imageLayer{testImageLayer}, config: ImageConfig{Entrypoint: []string{"/bin/sleep", "2147483647"}}},
	{name: TestImageName, layers: []imageLayer{testImageLayer}, config: ImageConfig{
		Cmd: []string{"sleep", "2147483647"}, Env: []string{imagePath},
	}},
	// Ubuntu's and Debian's images have bash and run it by default.
	{repository: "docker.io/library/ubuntu", layers: []imageLayer{testImageLayer, bashLayer},
		config: ImageConfig{Cmd: []string{"/bin/bash"}, Env: []string{imagePath}}},
	{repository: "docker.io/library/debian", layers: []imageLayer{testImageLayer, bashLayer},
		config: ImageConfig{Cmd: []string{"bash"}, Env: []string{imagePath}}},
	// busybox (the image of examples/): no bash, as the real one.
	{repository: "docker.io/library/busybox", layers: []imageLayer{testImageLayer},
		config: ImageConfig{Cmd: []string{"sh"}, Env: []string{imagePath}}},
	// NVIDIA's CUDA images (Ubuntu-based: bash) with the real image's
	// environment (images.go: NVIDIA_VISIBLE_DEVICES=all and friends).
	{repository: "nvcr.io/nvidia/cuda", layers: []imageLayer{testImageLayer, bashLayer},
		config: ImageConfig{Cmd: []string{"/bin/bash"}, Env: ImageEnv(CUDAImage)}},
	// NVIDIA's CUDA samples: the CUDA image plus the sample at /tmp/sample
	// (the simulated CUDA program), which NVIDIA's specs run.
	{repository: "nvcr.io/nvidia/k8s/cuda-sample", layers: []imageLayer{testImageLayer, bashLayer, sampleLayer},
		config: ImageConfig{Cmd: []string{"/tmp/sample"}, Env: ImageEnv(CUDAImage)}},
}

// normalizeImage is a reference as containerd names it: docker.io and
// library/ added where the reference leaves them out, :latest without a tag
// or digest.
func normalizeImage(ref string) string {
	name, rest := ref, ""
	if at := strings.Index(ref, "@"); at >= 0 {
		name, rest = ref[:at], ref[at:]
	} else if colon := strings.LastIndex(ref, ":"); colon > strings.LastIndex(ref, "/") {
		name, rest = ref[:colon], ref[colon:]
	} else {
		rest = ":latest"
	}
	first, _, found := strings.Cut(name, "/")
	if !found || (!strings.ContainsAny(first, ".:") && first != "localhost") {
		if !found {
			name = "library/" + name
		}
		name = "docker.io/" + name
	}
	return name + rest
}

// catalogueEntry is the entry a reference names, if any.
func catalogueEntry(ref string) (nodeImage, bool) {
	full := normalizeImage(ref)
	for _, img := range nodeImageCatalogue {
		if img.name != "" && normalizeImage(img.name) == full {
			return img, true
		}
		if repo := img.repo(); repo != "" && imageRepository(full) == repo {
			return img, true
		}
	}
	return nodeImage{}, false
}

// builtImages are the catalogue's images of each cluster, made once.
var builtImages = struct {
	mu        sync.Mutex
	byCluster map[string]map[int]*ociImage
}{byCluster: map[string]map[int]*ociImage{}}

// catalogueImage makes (once per cluster) the image of catalogue entry i.
func (c *Cluster) catalogueImage(i int) (*ociImage, error) {
	builtImages.mu.Lock()
	defer builtImages.mu.Unlock()
	if img, ok := builtImages.byCluster[c.Dir][i]; ok {
		return img, nil
	}
	entry := nodeImageCatalogue[i]
	var dirs []string
	for _, l := range entry.layers {
		dir, err := l(c)
		if err != nil {
			return nil, fmt.Errorf("image %s%s: %w", entry.name, entry.repo(), err)
		}
		dirs = append(dirs, dir)
	}
	img, err := buildOCIImage(dirs, entry.config, filepath.Join(c.Dir, "images"))
	if err != nil {
		return nil, err
	}
	if builtImages.byCluster[c.Dir] == nil {
		builtImages.byCluster[c.Dir] = map[int]*ociImage{}
	}
	builtImages.byCluster[c.Dir][i] = img
	return img, nil
}

// nodeImageArchives writes (once per cluster) the OCI archive of every
// catalogue image imported by name and returns their paths.
func (c *Cluster) nodeImageArchives() ([]string, error) {
	imageArchives.mu.Lock()
	defer imageArchives.mu.Unlock()
	if paths, ok := imageArchives.byCluster[c.Dir]; ok {
		return paths, nil
	}
	dir := filepath.Join(c.Dir, "images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var paths []string
	for i, img := range nodeImageCatalogue {
		if img.name == "" {
			continue
		}
		var layers []string
		for _, l := range img.layers {
			d, err := l(c)
			if err != nil {
				return nil, fmt.Errorf("image %s: %w", img.name, err)
			}
			layers = append(layers, d)
		}
		p := filepath.Join(dir, fmt.Sprintf("%d.tar", i))
		if err := WriteOCIArchive(p, img.name, layers, img.config, dir); err != nil {
			return nil, err
		}
		paths = append(paths, p)
	}
	imageArchives.byCluster[c.Dir] = paths
	return paths, nil
}

var imageArchives = struct {
	mu        sync.Mutex
	byCluster map[string][]string
}{byCluster: map[string][]string{}}

var layerDirs sync.Mutex

// bashLayer is a tree with this machine's bash at /bin/bash and the shared
// libraries it loads that the test image does not have, at their paths
// (the test image's glibc and loader are the machine's too).
func bashLayer(c *Cluster) (string, error) {
	layerDirs.Lock()
	defer layerDirs.Unlock()
	dir := filepath.Join(c.Dir, "images", "bash-layer")
	if isFile(filepath.Join(dir, "bin", "bash")) {
		return dir, nil
	}
	base, err := TestImage()
	if err != nil {
		return "", err
	}
	bash, err := exec.LookPath("bash")
	if err != nil {
		return "", fmt.Errorf("%w: bash for the images that have it: %v", ErrMissing, err)
	}
	out, err := exec.Command("ldd", bash).Output()
	if err != nil {
		return "", fmt.Errorf("ldd %s: %w", bash, err)
	}
	if err := copyRegular(bash, filepath.Join(dir, "bin", "bash"), 0o755); err != nil {
		return "", err
	}
	for _, m := range lddPath.FindAllStringSubmatch(string(out), -1) {
		lib := m[1]
		if _, err := os.Stat(filepath.Join(base, lib)); err == nil {
			continue
		}
		if err := copyRegular(lib, filepath.Join(dir, lib), 0o644); err != nil {
			return "", err
		}
	}
	return dir, nil
}

var lddPath = regexp.MustCompile(`=> (/\S+) \(`)

// sampleLayer is a tree with the simulated CUDA program at /tmp/sample,
// where NVIDIA's CUDA sample images have their sample.
func sampleLayer(c *Cluster) (string, error) {
	layerDirs.Lock()
	defer layerDirs.Unlock()
	dir := filepath.Join(c.Dir, "images", "cuda-sample-layer")
	if isFile(filepath.Join(dir, "tmp", "sample")) {
		return dir, nil
	}
	base, err := TestImage()
	if err != nil {
		return "", err
	}
	if err := copyRegular(filepath.Join(base, "usr", "local", "bin", "cuda-app"), filepath.Join(dir, "tmp", "sample"), 0o755); err != nil {
		return "", err
	}
	// /tmp of the image is world-writable with the sticky bit, as usual.
	return dir, os.Chmod(filepath.Join(dir, "tmp"), 0o1777)
}

// copyRegular copies a file's content (symlinks followed) to dst with mode,
// creating dst's folders.
func copyRegular(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
