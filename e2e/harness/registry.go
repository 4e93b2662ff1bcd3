package harness

// The cluster's image registry: a read-only OCI distribution endpoint on
// 127.0.0.1 that serves the catalogue's images by repository, any tag
// (nodeimages.go). Every real node's containerd sends every registry host
// there (its hosts.toml `_default`: server = this registry); containerd
// names the registry the reference was for in the `ns` query parameter, so
// `ubuntu:24.04` arrives as /v2/library/ubuntu/manifests/24.04?ns=docker.io.
// Anything else is answered 404 (MANIFEST_UNKNOWN, BLOB_UNKNOWN): the pull
// fails, as from a registry that does not have the image.
//
// Invariant: only GET and HEAD; blobs are served only by the digest of a
// layer, config or manifest of an image it has built.

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// imageRegistry is a running registry of one cluster.
type imageRegistry struct {
	c      *Cluster
	addr   string
	server *http.Server

	mu    sync.Mutex
	blobs map[string]string // digest -> file, for layers
	small map[string][]byte // digest -> content, for configs and manifests
}

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
	r := &imageRegistry{c: c, addr: ln.Addr().String(), blobs: map[string]string{}, small: map[string][]byte{}}
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
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		registryError(w, http.StatusMethodNotAllowed, "UNSUPPORTED", "read-only registry")
		return
	}
	path := strings.TrimPrefix(req.URL.Path, "/v2/")
	if path == "" || req.URL.Path == "/v2" {
		w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
		w.WriteHeader(http.StatusOK)
		return
	}
	if i := strings.LastIndex(path, "/manifests/"); i > 0 {
		r.manifest(w, req, path[:i], path[i+len("/manifests/"):])
		return
	}
	if i := strings.LastIndex(path, "/blobs/"); i > 0 {
		r.blob(w, req, path[i+len("/blobs/"):])
		return
	}
	registryError(w, http.StatusNotFound, "NAME_UNKNOWN", "no such endpoint")
}

func (r *imageRegistry) manifest(w http.ResponseWriter, req *http.Request, name, reference string) {
	host := req.URL.Query().Get("ns")
	if host == "" {
		host = "docker.io"
	}
	ref := host + "/" + name + ":" + reference
	if strings.HasPrefix(reference, "sha256:") {
		ref = host + "/" + name + "@" + reference
	}
	img, err := r.image(ref)
	if err != nil {
		registryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
		return
	}
	if img == nil || (strings.HasPrefix(reference, "sha256:") && reference != img.manifestDigest) {
		registryError(w, http.StatusNotFound, "MANIFEST_UNKNOWN", "manifest unknown: "+ref+" is not in the e2e image catalogue")
		return
	}
	w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
	w.Header().Set("Docker-Content-Digest", img.manifestDigest)
	w.Header().Set("Content-Length", fmt.Sprint(len(img.manifest)))
	if req.Method == http.MethodGet {
		_, _ = w.Write(img.manifest)
	}
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

func (r *imageRegistry) blob(w http.ResponseWriter, req *http.Request, digest string) {
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
			return
		}
		defer f.Close()
		w.Header().Set("Docker-Content-Digest", digest)
		w.Header().Set("Content-Type", "application/octet-stream")
		http.ServeContent(w, req, "", time.Time{}, f)
	default:
		registryError(w, http.StatusNotFound, "BLOB_UNKNOWN", "blob unknown: "+digest)
	}
}

func registryError(w http.ResponseWriter, status int, code, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = fmt.Fprintf(w, `{"errors":[{"code":%q,"message":%q}]}`, code, message)
}
