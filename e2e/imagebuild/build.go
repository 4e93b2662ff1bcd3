package imagebuild

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Platform is one architecture of the image and the root filesystem it is
// made of.
type Platform struct {
	// Arch is the GOARCH-style architecture: amd64 or arm64.
	Arch string
	// Rootfs is the folder that becomes the image's one layer.
	Rootfs string
}

// Options say what an image is made of and how its containers run.
type Options struct {
	// Platforms: one image per entry, all in one index.
	Platforms []Platform
	// Created is the images' creation time (the source's commit time).
	Created time.Time
	// Version and Revision label the images and the index
	// (org.opencontainers.image.version, .revision); Source, when set, is
	// the source repository's address (.source).
	Version, Revision, Source string
	// Title and Description label them too.
	Title, Description string
	// Entrypoint, Cmd, Env, User and WorkingDir are the image config's.
	Entrypoint, Cmd, Env []string
	User, WorkingDir     string
	// BinDir is the folder of the binaries CheckRootfs checks; Static the
	// files in the image that must be linked statically.
	BinDir string
	Static []string
}

// DriverImage is how the driver's image runs, as the Dockerfile states it:
// the webhook as entrypoint (the chart's pods name their command), the
// unprivileged user 65532 (the chart runs the node plugin as root
// explicitly), no shell. nvidia-cdi-hook is static: the container runtime
// runs it on the host, under the host's libc.
func DriverImage(platforms []Platform, created time.Time, version, revision, source string) Options {
	return Options{
		Platforms: platforms, Created: created, Version: version, Revision: revision, Source: source,
		Title:       "gpu-dra-driver",
		Description: "Kubernetes DRA driver for NVIDIA GPUs: node plugin (gpu-kubelet-plugin), admission webhook (gpu-dra-webhook), CLI (gpu-dra)",
		Entrypoint:  []string{"/usr/local/bin/gpu-dra-webhook"},
		Env:         []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		User:        "65532:65532",
		WorkingDir:  "/",
		BinDir:      "/usr/local/bin",
		Static:      []string{"/usr/local/bin/nvidia-cdi-hook"},
	}
}

// labels are the OCI annotations of the image configs and the index.
func (o Options) labels() map[string]string {
	l := map[string]string{
		"org.opencontainers.image.created":  o.Created.UTC().Format(time.RFC3339),
		"org.opencontainers.image.version":  o.Version,
		"org.opencontainers.image.revision": o.Revision,
	}
	for k, v := range map[string]string{
		"org.opencontainers.image.source":      o.Source,
		"org.opencontainers.image.title":       o.Title,
		"org.opencontainers.image.description": o.Description,
	} {
		if v != "" {
			l[k] = v
		}
	}
	return l
}

// Build checks each platform's root filesystem (CheckRootfs) and makes the
// multi-architecture index of one image per platform. Layer tars are
// written into tmpDir, which must outlive the index's use.
func Build(o Options, tmpDir string) (v1.ImageIndex, error) {
	if len(o.Platforms) == 0 {
		return nil, fmt.Errorf("no platform to build")
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	created := v1.Time{Time: o.Created.UTC()}
	for _, p := range o.Platforms {
		if err := CheckRootfs(p.Rootfs, p.Arch, o.BinDir, o.Static, o.Entrypoint, o.User); err != nil {
			return nil, err
		}
		tarPath := filepath.Join(tmpDir, "layer-"+p.Arch+".tar")
		if err := writeLayerFile(tarPath, p.Rootfs); err != nil {
			return nil, fmt.Errorf("layer of %s: %w", p.Rootfs, err)
		}
		layer, err := tarball.LayerFromFile(tarPath, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
		if err != nil {
			return nil, err
		}
		img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
		img, err = mutate.Append(img, mutate.Addendum{
			Layer: layer, MediaType: types.OCILayer,
			History: v1.History{Created: created, CreatedBy: "make image-rootfs (deploy/image/build-rootfs.sh)"},
		})
		if err != nil {
			return nil, err
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		cf = cf.DeepCopy()
		cf.Architecture, cf.OS, cf.Variant = p.Arch, "linux", variant(p.Arch)
		cf.Created = created
		cf.Config = v1.Config{
			Entrypoint: o.Entrypoint, Cmd: o.Cmd, Env: o.Env, User: o.User, WorkingDir: o.WorkingDir,
			Labels: o.labels(),
		}
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return nil, err
		}
		img = mutate.Annotations(img, o.labels()).(v1.Image)
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: p.Arch, Variant: variant(p.Arch)},
		}})
	}
	return mutate.Annotations(idx, o.labels()).(v1.ImageIndex), nil
}

// variant is the architecture variant OCI indexes name (arm64: v8).
func variant(arch string) string {
	if arch == "arm64" {
		return "v8"
	}
	return ""
}

func writeLayerFile(path, rootfs string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = WriteLayer(f, rootfs)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// WriteLayout writes the index as an OCI image layout at dir (written
// beside it and renamed into place), its index.json naming it ref (the
// annotation org.opencontainers.image.ref.name, e.g. the version), and
// returns the index's digest.
func WriteLayout(dir, ref string, idx v1.ImageIndex) (v1.Hash, error) {
	tmp := dir + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return v1.Hash{}, err
	}
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": ref})); err != nil {
		return v1.Hash{}, err
	}
	if err := os.RemoveAll(dir); err != nil {
		return v1.Hash{}, err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return v1.Hash{}, err
	}
	return idx.Digest()
}

// LayoutIndex is the one image index an OCI layout written by WriteLayout
// holds.
func LayoutIndex(dir string) (v1.ImageIndex, error) {
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w (run `make image`)", dir, err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(m.Manifests) != 1 || !m.Manifests[0].MediaType.IsIndex() {
		return nil, fmt.Errorf("OCI layout %s: want one image index in index.json, have %d entries", dir, len(m.Manifests))
	}
	return top.ImageIndex(m.Manifests[0].Digest)
}

// ParseEpoch reads SOURCE_DATE_EPOCH's format: seconds since the epoch.
func ParseEpoch(s string) (time.Time, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("created time %q: want seconds since the epoch: %w", s, err)
	}
	return time.Unix(n, 0).UTC(), nil
}
