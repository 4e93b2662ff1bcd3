package harness

// The cluster's image registry on 127.0.0.1, in two parts behind one
// address. Every real node's containerd sends every registry host there
// (its hosts.toml `_default`: server = this registry, plain HTTP);
// containerd names the registry the reference was for in the `ns` query
// parameter, so `ubuntu:24.04` arrives as
// /v2/library/ubuntu/manifests/24.04?ns=docker.io.
//   - The catalogue (nodeimages.go): its images by repository, any tag,
//     read-only, made by the harness.
//   - Everything else: go-containerregistry's registry (pkg/registry, a
//     full OCI distribution endpoint: pushes, tags, digests, indexes), its
//     blobs on disk in the cluster's folder. The driver's image is pushed
//     there as users push it (imagepods.go), so nodes pull exactly what
//     `make image` built; a pull of what nobody pushed is answered 404
//     (MANIFEST_UNKNOWN): the pull fails, as from any registry without the
//     image.
//
// Invariant: catalogue repositories are answered by the catalogue only;
// blobs are served by the catalogue when it has built them, else by the
// pushed part.

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

// imageRegistry is a running registry of one cluster.
type imageRegistry struct {
	c      *Cluster
	addr   string
	server *http.Server
	// pushed serves whatever is not the catalogue's, and takes pushes.
	pushed http.Handler

	mu    sync.Mutex
	blobs map[string]string // digest -> file, for layers
	small map[string][]byte // digest -> content, for configs and manifests
}

// RegistryAddress is the cluster's registry (host:port, plain HTTP): the
// nodes pull from it, and anyone may push to it as to their own registry.
func (c *Cluster) RegistryAddress() (string, error) { return c.registry() }

// registry starts the cluster's registry on first use and returns its
// address (host:port).
func (c *Cluster) registry() (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.imageRegistry != nil {
		return c.imageRegistry.addr, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	blobDir := filepath.Join(c.Dir, "registry-blobs")
	if err := os.MkdirAll(blobDir, 0o755); err != nil {
		ln.Close()
		return "", err
	}
	r := &imageRegistry{c: c, addr: ln.Addr().String(), blobs: map[string]string{}, small: map[string][]byte{},
		pushed: registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithBlobHandler(registry.NewDiskBlobHandler(blobDir)))}
	r.server = &http.Server{Handler: r, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = r.server.Serve(ln) }()
	c.imageRegistry = r
	c.stops = append(c.stops, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.server.Shutdown(ctx)
	})
	return r.addr, nil
}

func (r *imageRegistry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	path := strings.TrimPrefix(req.URL.Path, "/v2/")
	if req.Method == http.MethodGet || req.Method == http.MethodHead {
		if i := strings.LastIndex(path, "/manifests/"); i > 0 && r.manifest(w, req, path[:i], path[i+len("/manifests/"):]) {
			return
		}
		if i := strings.LastIndex(path, "/blobs/"); i > 0 && r.blob(w, req, path[i+len("/blobs/"):]) {
			return
		}
	}
	r.pushed.ServeHTTP(w, req)
}

// manifest answers a manifest request for a catalogue repository and says
// whether it did (false: not a catalogue repository).
func (r *imageRegistry) manifest(w http.ResponseWriter, req *http.Request, name, reference string) bool {
	host := req.URL.Query().Get("ns")
	if host == "" {
		host = "docker.io"
	}
	ref := host + "/" + name + ":" + reference
	if strings.HasPrefix(reference, "sha256:") {
		ref = host + "/" + name + "@" + reference
	}
	if entry, ok := catalogueEntry(ref); !ok || entry.repo() == "" {
		return false
	}
	img, err := r.image(ref)
	if err != nil {
		registryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
		return true
	}
	if img == nil || (strings.HasPrefix(reference, "sha256:") && reference != img.manifestDigest) {
		registryError(w, http.StatusNotFound, "MANIFEST_UNKNOWN", "manifest unknown: "+ref+" is not in the e2e image catalogue")
		return true
	}
	w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
	w.Header().Set("Docker-Content-Digest", img.manifestDigest)
	w.Header().Set("Content-Length", fmt.Sprint(len(img.manifest)))
	if req.Method == http.MethodGet {
		_, _ = w.Write(img.manifest)
	}
	return true
}

// image is the catalogue's image for a normalized reference, built on
// first use (nil: not in the catalogue).
func (r *imageRegistry) image(ref string) (*ociImage, error) {
	entry, ok := catalogueEntry(ref)
	if !ok || entry.repo() == "" {
		return nil, nil
	}
	for i := range nodeImageCatalogue {
		if nodeImageCatalogue[i].repo() != entry.repo() {
			continue
		}
		img, err := r.c.catalogueImage(i)
		if err != nil {
			return nil, err
		}
		r.mu.Lock()
		for _, l := range img.layers {
			r.blobs[l.digest] = l.path
		}
		r.small[img.configDigest] = img.config
		r.small[img.manifestDigest] = img.manifest
		r.mu.Unlock()
		return img, nil
	}
	return nil, nil
}

// blob serves a blob the catalogue has built and says whether it did.
func (r *imageRegistry) blob(w http.ResponseWriter, req *http.Request, digest string) bool {
	r.mu.Lock()
	path, isFile := r.blobs[digest]
	data, isSmall := r.small[digest]
	r.mu.Unlock()
	switch {
	case isSmall:
		w.Header().Set("Content-Length", fmt.Sprint(len(data)))
		w.Header().Set("Docker-Content-Digest", digest)
		if req.Method == http.MethodGet {
			_, _ = w.Write(data)
		}
	case isFile:
		f, err := os.Open(path)
		if err != nil {
			registryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
			return true
		}
		defer f.Close()
		w.Header().Set("Docker-Content-Digest", digest)
		w.Header().Set("Content-Type", "application/octet-stream")
		http.ServeContent(w, req, "", time.Time{}, f)
	default:
		return false
	}
	return true
}

func registryError(w http.ResponseWriter, status int, code, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = fmt.Fprintf(w, `{"errors":[{"code":%q,"message":%q}]}`, code, message)
}
