package harness

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestNodeToolsPinMatchesControlPlane: the real nodes' kubelet is built from
// e2e/nodetools, which must pin the Kubernetes release the control plane
// runs (e2e/go.mod), staging replacements included.
func TestNodeToolsPinMatchesControlPlane(t *testing.T) {
	read := func(rel string) (string, map[string]string) {
		p, err := RepoPath(rel)
		if err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		version := ""
		replaces := map[string]string{}
		require := regexp.MustCompile(`^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)`)
		replace := regexp.MustCompile(`^\s*(k8s\.io/\S+)\s+=>\s+(\S+\s+\S+)`)
		for _, line := range strings.Split(string(data), "\n") {
			if m := require.FindStringSubmatch(line); m != nil {
				version = m[1]
			}
			if m := replace.FindStringSubmatch(line); m != nil {
				replaces[m[1]] = m[2]
			}
		}
		if version == "" || len(replaces) == 0 {
			t.Fatalf("%s: no k8s.io/kubernetes requirement or no staging replacements", rel)
		}
		return version, replaces
	}
	wantVersion, wantReplaces := read("e2e/go.mod")
	gotVersion, gotReplaces := read("e2e/nodetools/go.mod")
	if gotVersion != wantVersion {
		t.Errorf("e2e/nodetools requires k8s.io/kubernetes %s, the control plane %s", gotVersion, wantVersion)
	}
	if !reflect.DeepEqual(gotReplaces, wantReplaces) {
		t.Errorf("e2e/nodetools replaces %v, e2e/go.mod %v", gotReplaces, wantReplaces)
	}
}

// TestOCIArchive: an archive of a root filesystem is an OCI image layout
// whose index names the image, whose config lists the layer's digest as its
// diff ID, and whose layer holds the tree as it is (a hard link as a link);
// two images of one tree share one layer.
func TestOCIArchive(t *testing.T) {
	dir := t.TempDir()
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "etc"} {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(rootfs, "bin", "busybox"), []byte("binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("busybox", filepath.Join(rootfs, "bin", "sh")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(rootfs, "bin", "busybox"), filepath.Join(rootfs, "bin", "sleep")); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(dir, "cache")
	cfg := ImageConfig{Cmd: []string{"sleep", "1"}, Env: []string{"PATH=/bin"}}
	a, b := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	if err := WriteOCIArchive(a, "e2e.invalid/a:1", []string{rootfs}, cfg, cache); err != nil {
		t.Fatal(err)
	}
	if err := WriteOCIArchive(b, "e2e.invalid/b:1", []string{rootfs}, ImageConfig{Entrypoint: []string{"/bin/sleep"}}, cache); err != nil {
		t.Fatal(err)
	}

	files := readTar(t, a)
	if got := string(files["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout: %s", got)
	}
	var index struct {
		Manifests []struct {
			Digest      string
			Annotations map[string]string
		}
	}
	mustJSON(t, files["index.json"], &index)
	if len(index.Manifests) != 1 || index.Manifests[0].Annotations["io.containerd.image.name"] != "e2e.invalid/a:1" {
		t.Fatalf("index.json: %s", files["index.json"])
	}
	blob := func(digest string) []byte {
		t.Helper()
		data, ok := files["blobs/sha256/"+strings.TrimPrefix(digest, "sha256:")]
		if !ok {
			t.Fatalf("blob %s missing", digest)
		}
		if got := digestOf(data); got != digest {
			t.Fatalf("blob %s has digest %s", digest, got)
		}
		return data
	}
	var manifest struct {
		Config struct{ Digest string }
		Layers []struct{ Digest, MediaType string }
	}
	mustJSON(t, blob(index.Manifests[0].Digest), &manifest)
	var config struct {
		Config struct{ Cmd, Env []string }
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	mustJSON(t, blob(manifest.Config.Digest), &config)
	if len(manifest.Layers) != 1 || len(config.RootFS.DiffIDs) != 1 || config.RootFS.DiffIDs[0] != manifest.Layers[0].Digest {
		t.Fatalf("manifest layers %v, config diff IDs %v: want one uncompressed layer, its digest as diff ID", manifest.Layers, config.RootFS.DiffIDs)
	}
	if !reflect.DeepEqual(config.Config.Cmd, cfg.Cmd) || !reflect.DeepEqual(config.Config.Env, cfg.Env) {
		t.Errorf("config %+v, want %+v", config.Config, cfg)
	}
	layer := tar.NewReader(bytes.NewReader(blob(manifest.Layers[0].Digest)))
	entries := map[string]*tar.Header{}
	for {
		h, err := layer.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		entries[h.Name] = h
	}
	if h := entries["bin/sh"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "busybox" {
		t.Errorf("bin/sh: %+v, want a symlink to busybox", h)
	}
	if h := entries["bin/busybox"]; h == nil || h.Typeflag != tar.TypeReg || h.Mode&0o111 == 0 {
		t.Errorf("bin/busybox: %+v, want an executable file", h)
	}
	if h := entries["bin/sleep"]; h == nil || h.Typeflag != tar.TypeLink || h.Linkname != "bin/busybox" {
		t.Errorf("bin/sleep: %+v, want a hard link to bin/busybox", h)
	}
	if entries["etc/"] == nil {
		t.Errorf("etc/ missing from the layer: %v", entries)
	}

	var indexB struct{ Manifests []struct{ Digest string } }
	filesB := readTar(t, b)
	mustJSON(t, filesB["index.json"], &indexB)
	var manifestB struct{ Layers []struct{ Digest string } }
	mustJSON(t, filesB["blobs/sha256/"+strings.TrimPrefix(indexB.Manifests[0].Digest, "sha256:")], &manifestB)
	if manifestB.Layers[0].Digest != manifest.Layers[0].Digest {
		t.Errorf("two images of one tree have layers %s and %s", manifest.Layers[0].Digest, manifestB.Layers[0].Digest)
	}
}

func readTar(t *testing.T, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = data
	}
}

func mustJSON(t *testing.T, data []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("%v: %s", err, data)
	}
}

// References resolve to catalogue entries as containerd normalizes them:
// docker.io and library/ added, any tag of a repository entry, exact names
// for the imported ones; other repositories (the driver's own image among
// them), registries or hosts with a port are not in the catalogue.
func TestImageCatalogueMatches(t *testing.T) {
	for ref, want := range map[string]string{
		"ubuntu:24.04":                         "docker.io/library/ubuntu",
		"ubuntu":                               "docker.io/library/ubuntu",
		"docker.io/library/debian:bookworm":    "docker.io/library/debian",
		"busybox:1.37":                         "docker.io/library/busybox",
		"busybox@sha256:0123":                  "docker.io/library/busybox",
		"nvcr.io/nvidia/cuda:12.4.1-base":      "nvcr.io/nvidia/cuda",
		"nvcr.io/nvidia/k8s/cuda-sample:nbody": "nvcr.io/nvidia/k8s/cuda-sample",
		TestImageName:                          TestImageName,
		// The driver's own image is not the catalogue's: it is pushed
		// (make image's), so only what was pushed resolves.
		"ghcr.io/gpu-dra/gpu-dra-driver:0.1.0":       "",
		"ghcr.io/gpu-dra/gpu-dra-driver@sha256:0123": "",
		"nvcr.io/nvidia/cuda-samples:vectoradd":      "",
		"quay.io/library/ubuntu:24.04":               "",
		"registry:5000/ubuntu:24.04":                 "",
		"e2e.invalid/gpu-dra/test-image:2":           "",
	} {
		entry, ok := catalogueEntry(ref)
		got := entry.repo() + entry.name
		if !ok {
			got = ""
		}
		if got != want {
			t.Errorf("%s: catalogue entry %q, want %q", ref, got, want)
		}
	}
	if got := normalizeImage("ubuntu"); got != "docker.io/library/ubuntu:latest" {
		t.Errorf("normalizeImage(ubuntu) = %s", got)
	}
}

// The kubelet's CRI log files read back as the text written: partial lines
// joined, an empty line kept, both streams in file order.
func TestDecodeCRILog(t *testing.T) {
	in := "2026-11-25T23:00:00.000000001Z stdout F hello from ok\n" +
		"2026-11-25T23:00:00.000000002Z stderr P part one, \n" +
		"2026-11-25T23:00:00.000000003Z stderr F part two\n" +
		"2026-11-25T23:00:00.000000004Z stdout F \n" +
		"2026-11-25T23:00:00.000000005Z stdout F last\n"
	want := "hello from ok\npart one, part two\n\nlast\n"
	if got := decodeCRILog(in); got != want {
		t.Errorf("decodeCRILog:\n got %q\nwant %q", got, want)
	}
}

// The kubelet's unprepare failures are found in its log by pod, other
// failed syncs are not.
func TestUnprepareErrors(t *testing.T) {
	log := `E1125 23:01:02.000000  100 pod_workers.go:1338] "Error syncing pod, skipping" err="unprepare dynamic resources: NodeUnprepareResources failed for ResourceClaim c: boom" pod="ns1/p1" podUID="u1"` + "\n" +
		`E1125 23:01:03.000000  100 pod_workers.go:1338] "Error syncing pod, skipping" err="failed to \"StartContainer\" for \"ctr\" with CrashLoopBackOff" pod="ns1/p2" podUID="u2"` + "\n" +
		`I1125 23:01:04.000000  100 kubelet.go:1] "SyncLoop ADD" source="api" pods=["ns1/p3"]` + "\n"
	got := unprepareErrors(log)
	want := []string{`unprepare ns1/p1: unprepare dynamic resources: NodeUnprepareResources failed for ResourceClaim c: boom`}
	if !slices.Equal(got, want) {
		t.Errorf("unprepareErrors:\n got %q\nwant %q", got, want)
	}
}
