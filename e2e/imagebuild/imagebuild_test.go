package imagebuild

import (
	"context"
	"encoding/base64"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// fixtureRootfs is a small root filesystem as build-rootfs.sh lays it out:
// this machine's `true` as the webhook (a dynamic ELF), its loader and
// libc, /etc/passwd with 65532; mtime sets every file's time.
func fixtureRootfs(t *testing.T, mtime time.Time) string {
	t.Helper()
	if runtime.GOARCH != "amd64" {
		t.Skip("the fixture copies this machine's amd64 binaries")
	}
	root := t.TempDir()
	copyFile := func(src, dst string, mode os.FileMode) {
		t.Helper()
		data, err := os.ReadFile(src)
		if err != nil {
			t.Skipf("fixture: %v", err)
		}
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(dst)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, dst), data, mode); err != nil {
			t.Fatal(err)
		}
	}
	copyFile("/bin/true", "/usr/local/bin/gpu-dra-webhook", 0o755)
	copyFile("/lib64/ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2", 0o755)
	copyFile("/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6", 0o644)
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0::/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chtimes(p, mtime, mtime)
	})
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func fixtureOptions(rootfs string) Options {
	o := DriverImage([]Platform{{Arch: "amd64", Rootfs: rootfs}}, time.Unix(1767225600, 0), "0.1.0", "abc123", "")
	o.Static = nil // the fixture has no nvidia-cdi-hook
	return o
}

func buildLayout(t *testing.T, o Options) (string, string) {
	t.Helper()
	idx, err := Build(o, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "oci")
	digest, err := WriteLayout(dir, o.Version, idx)
	if err != nil {
		t.Fatal(err)
	}
	return dir, digest.String()
}

// Same content, other file times and folders: the same digest; another
// revision: another digest.
func TestBuildIsReproducible(t *testing.T) {
	a := fixtureRootfs(t, time.Unix(1000, 0))
	b := fixtureRootfs(t, time.Now())
	dirA, digestA := buildLayout(t, fixtureOptions(a))
	dirB, digestB := buildLayout(t, fixtureOptions(b))
	if digestA != digestB {
		t.Fatalf("same content, two digests: %s and %s", digestA, digestB)
	}
	indexA, _ := os.ReadFile(filepath.Join(dirA, "index.json"))
	indexB, _ := os.ReadFile(filepath.Join(dirB, "index.json"))
	if string(indexA) != string(indexB) || !strings.Contains(string(indexA), `"org.opencontainers.image.ref.name": "0.1.0"`) {
		t.Fatalf("index.json differs or names no version:\n%s\n%s", indexA, indexB)
	}
	o := fixtureOptions(a)
	o.Revision = "def456"
	if _, digestC := buildLayout(t, o); digestC == digestA {
		t.Fatalf("another revision, the same digest %s", digestA)
	}

	idx, err := LayoutIndex(dirA)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := idx.IndexManifest()
	if len(m.Manifests) != 1 || m.Manifests[0].Platform.Architecture != "amd64" || m.Annotations["org.opencontainers.image.revision"] != "abc123" {
		t.Fatalf("index: %+v", m)
	}
	img, _ := idx.Image(m.Manifests[0].Digest)
	cf, _ := img.ConfigFile()
	if cf.Config.User != "65532:65532" || cf.Config.Entrypoint[0] != "/usr/local/bin/gpu-dra-webhook" ||
		cf.Config.Labels["org.opencontainers.image.version"] != "0.1.0" || cf.Created.Unix() != 1767225600 {
		t.Fatalf("config: %+v, created %v", cf.Config, cf.Created)
	}
}

// Each way a root filesystem can be broken is refused, by name.
func TestCheckRootfsNamesWhatIsBroken(t *testing.T) {
	cases := []struct {
		name   string
		break_ func(root string, o *Options)
		want   string
	}{
		{"missing library", func(root string, _ *Options) {
			os.Remove(filepath.Join(root, "lib/x86_64-linux-gnu/libc.so.6"))
		}, "needs libc.so.6"},
		{"missing loader", func(root string, _ *Options) {
			os.Remove(filepath.Join(root, "lib64/ld-linux-x86-64.so.2"))
		}, "loader /lib64/ld-linux-x86-64.so.2"},
		{"wrong architecture", func(_ string, o *Options) { o.Platforms[0].Arch = "arm64" }, "ELF machine EM_X86_64, want EM_AARCH64"},
		{"wrong entrypoint", func(_ string, o *Options) { o.Entrypoint = []string{"/usr/local/bin/gpu-dra-webhok"} }, "entrypoint /usr/local/bin/gpu-dra-webhok"},
		{"wrong user", func(_ string, o *Options) { o.User = "1000:1000" }, "user 1000:1000: no such user"},
		{"dynamic hook", func(_ string, o *Options) { o.Static = []string{"/usr/local/bin/gpu-dra-webhook"} }, "must be linked statically"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := fixtureRootfs(t, time.Unix(0, 0))
			o := fixtureOptions(root)
			o.Platforms = []Platform{{Arch: "amd64", Rootfs: root}}
			if _, err := Build(o, t.TempDir()); err != nil {
				t.Fatalf("intact fixture refused: %v", err)
			}
			tc.break_(root, &o)
			_, err := Build(o, t.TempDir())
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want an error with %q, got %v", tc.want, err)
			}
		})
	}
}

// Push sends the layout's index to a registry that asks for the
// credentials of $DOCKER_CONFIG/config.json and returns its digest; the
// registry then serves the same index.
func TestPushWithDockerConfigCredentials(t *testing.T) {
	dir, digest := buildLayout(t, fixtureOptions(fixtureRootfs(t, time.Unix(0, 0))))
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte("pusher:secret"))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != want {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")

	config := t.TempDir()
	auth := base64.StdEncoding.EncodeToString([]byte("pusher:secret"))
	if err := os.WriteFile(filepath.Join(config, "config.json"), []byte(`{"auths":{"`+host+`":{"auth":"`+auth+`"}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", config)

	ref, err := Push(context.Background(), dir, host+"/gpu-dra/gpu-dra-driver:0.1.0", false)
	if err != nil {
		t.Fatal(err)
	}
	if ref.DigestStr() != digest || ref.Context().String() != host+"/gpu-dra/gpu-dra-driver" {
		t.Fatalf("pushed %s, want %s@%s", ref, host+"/gpu-dra/gpu-dra-driver", digest)
	}
	tag, _ := name.NewTag(host + "/gpu-dra/gpu-dra-driver:0.1.0")
	desc, err := remote.Get(tag, remote.WithAuth(nil), remote.WithTransport(authTransport{want}))
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest.String() != digest || !desc.MediaType.IsIndex() {
		t.Fatalf("registry has %s (%s) under the tag, want the index %s", desc.Digest, desc.MediaType, digest)
	}

	t.Setenv("DOCKER_CONFIG", t.TempDir())
	if _, err := Push(context.Background(), dir, host+"/gpu-dra/gpu-dra-driver:0.1.1", false); err == nil {
		t.Fatal("pushed without credentials")
	}
}

type authTransport struct{ header string }

func (a authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", a.header)
	return http.DefaultTransport.RoundTrip(r)
}

// The Dockerfile (for those who build with Docker) and DriverImage state
// the same entrypoint and user.
func TestDockerfileAgreesWithDriverImage(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	o := DriverImage(nil, time.Time{}, "", "", "")
	var user, entrypoint string
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "USER "); ok {
			user = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "ENTRYPOINT "); ok {
			entrypoint = strings.TrimSpace(v)
		}
	}
	if user != o.User || entrypoint != `["`+strings.Join(o.Entrypoint, `", "`)+`"]` {
		t.Fatalf("Dockerfile: USER %q, ENTRYPOINT %s; DriverImage: user %q, entrypoint %q", user, entrypoint, o.User, o.Entrypoint)
	}
}
