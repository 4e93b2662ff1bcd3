package harness

// OCI images made from root filesystems the harness has: no registry is
// reachable, so a real node's containerd gets its images either by `ctr
// images import` of archives written here or from the harness's own
// registry (registry.go), which serves the same manifests and blobs. An
// image has one uncompressed layer per root filesystem it is made of (the
// test image, then small trees added on top: bash, a sample program); an
// archive is an OCI image layout (oci-layout, index.json, blobs/sha256/...)
// in a tar stream, its index naming the image with containerd's
// `io.containerd.image.name` annotation, which `ctr images import` takes as
// the image's name.
//
// Invariant: a layer is deterministic (imagebuild.WriteLayer: entries
// sorted, times zeroed, owners root), so two images made from one root
// filesystem share its layer blob, and the same content always gets the
// same digest.

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/gpu-dra/e2e/imagebuild"
)

// ImageConfig is what an image says about how its containers run.
type ImageConfig struct {
	// Entrypoint and Cmd, as in a Dockerfile.
	Entrypoint, Cmd []string
	// Env is the image's environment (KEY=value).
	Env []string
	// User is the user the image runs as (uid[:gid]; empty: root).
	User string
}

// ociImage is an image's manifest, config and layer blobs, as a registry
// serves them and an OCI layout holds them.
type ociImage struct {
	config, manifest             []byte
	configDigest, manifestDigest string
	layers                       []ociLayer
}

// ociLayer is a layer blob: an uncompressed tar in the layer cache.
type ociLayer struct {
	path, digest string
	size         int64
}

// buildOCIImage makes the image of root filesystem layers (lowest first,
// each a directory whose tree is one layer) and cfg; layer tars are written
// once into cache.
func buildOCIImage(layers []string, cfg ImageConfig, cache string) (*ociImage, error) {
	img := &ociImage{}
	diffIDs := []string{}
	descs := []map[string]any{}
	for _, dir := range layers {
		path, digest, size, err := rootfsLayer(dir, cache)
		if err != nil {
			return nil, err
		}
		img.layers = append(img.layers, ociLayer{path: path, digest: digest, size: size})
		diffIDs = append(diffIDs, digest)
		descs = append(descs, map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size})
	}
	var err error
	img.config, err = json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config": map[string]any{
			"Entrypoint": cfg.Entrypoint,
			"Cmd":        cfg.Cmd,
			"Env":        cfg.Env,
			"User":       cfg.User,
			"WorkingDir": "/",
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	if err != nil {
		return nil, err
	}
	img.configDigest = digestOf(img.config)
	img.manifest, err = json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{
			"mediaType": "application/vnd.oci.image.config.v1+json", "digest": img.configDigest, "size": len(img.config),
		},
		"layers": descs,
	})
	if err != nil {
		return nil, err
	}
	img.manifestDigest = digestOf(img.manifest)
	return img, nil
}

// WriteOCIArchive writes an OCI image layout archive of the root filesystem
// layers (lowest first) to path, naming the image name (a full reference:
// host/path:tag). layerCache is a directory where the layer of each root
// filesystem is kept between calls (several images of one root filesystem,
// several nodes).
func WriteOCIArchive(path, name string, layers []string, cfg ImageConfig, layerCache string) error {
	img, err := buildOCIImage(layers, cfg, layerCache)
	if err != nil {
		return err
	}
	config, configDigest, manifest, manifestDigest := img.config, img.configDigest, img.manifest, img.manifestDigest
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []map[string]any{{
			"mediaType": "application/vnd.oci.image.manifest.v1+json",
			"digest":    manifestDigest,
			"size":      len(manifest),
			"platform":  map[string]string{"architecture": "amd64", "os": "linux"},
			"annotations": map[string]string{
				"io.containerd.image.name":          name,
				"org.opencontainers.image.ref.name": name,
			},
		}},
	})
	if err != nil {
		return err
	}

	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	tw := tar.NewWriter(f)
	addBytes := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	blob := func(digest string) string { return "blobs/sha256/" + digest[len("sha256:"):] }
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Name: dir, Mode: 0o755, Typeflag: tar.TypeDir}); err != nil {
			f.Close()
			return err
		}
	}
	err = addBytes("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	if err == nil {
		err = addBytes(blob(configDigest), config)
	}
	if err == nil {
		err = addBytes(blob(manifestDigest), manifest)
	}
	if err == nil {
		err = addBytes("index.json", index)
	}
	written := map[string]bool{}
	for _, l := range img.layers {
		if err == nil && !written[l.digest] {
			written[l.digest] = true
			err = copyFileInto(tw, blob(l.digest), l.path, l.size)
		}
	}
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write image %s to %s: %w", name, path, err)
	}
	return os.Rename(tmp, path)
}

func copyFileInto(tw *tar.Writer, name, src string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: size, Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	_, err = io.Copy(tw, in)
	return err
}

func digestOf(data []byte) string {
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// rootfsLayer writes (once per root filesystem and cache) the layer tar of
// rootfs and returns its path, digest and size.
func rootfsLayer(rootfs, cache string) (path, digest string, size int64, err error) {
	abs, err := filepath.Abs(rootfs)
	if err != nil {
		return "", "", 0, err
	}
	key := sha256.Sum256([]byte(abs))
	path = filepath.Join(cache, "layer-"+hex.EncodeToString(key[:8])+".tar")
	meta := path + ".digest"
	if d, err := os.ReadFile(meta); err == nil {
		if st, err := os.Stat(path); err == nil {
			return path, string(d), st.Size(), nil
		}
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", "", 0, err
	}
	f, err := os.Create(path)
	if err != nil {
		return "", "", 0, err
	}
	h := sha256.New()
	cw := &countingWriter{w: io.MultiWriter(f, h)}
	err = imagebuild.WriteLayer(cw, abs)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return "", "", 0, fmt.Errorf("layer of %s: %w", rootfs, err)
	}
	digest = "sha256:" + hex.EncodeToString(h.Sum(nil))
	if err := os.WriteFile(meta, []byte(digest), 0o644); err != nil {
		return "", "", 0, err
	}
	return path, digest, cw.n, nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
