package harness

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/spf13/pflag"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apimachinery/pkg/util/wait"
	apimachineryversion "k8s.io/apimachinery/pkg/version"
	"k8s.io/apiserver/pkg/endpoints/request"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	basecompatibility "k8s.io/component-base/compatibility"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

// adminToken is the static bearer token of the cluster admin (group
// system:masters). It lives only as long as the in-process cluster.
const adminToken = "e2e-admin-token"

// apiserver is a running in-process kube-apiserver.
type apiserver struct {
	host     string // https://127.0.0.1:<port>
	errCh    chan error
	requests *requestCounter
}

// APIRequestKind is what the API server counts requests by: the client's
// User-Agent, the verb ("watch" for a watch stream's start, "list", "get",
// "create", "update", "patch", "delete", or the HTTP method of a
// non-resource request) and the resource ("resourceslices",
// "resourceclaims/status"; the path of a non-resource request).
type APIRequestKind struct {
	UserAgent string
	Verb      string
	Resource  string
}

// requestCounter counts the requests the API server served, by kind, from
// the innermost filter of its handler chain: authenticated requests only,
// each counted when it starts (a watch once, however long it stays open).
type requestCounter struct {
	mu     sync.Mutex
	counts map[APIRequestKind]int
}

func (rc *requestCounter) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kind := APIRequestKind{UserAgent: r.UserAgent(), Verb: strings.ToLower(r.Method), Resource: r.URL.Path}
		if info, ok := request.RequestInfoFrom(r.Context()); ok && info.IsResourceRequest {
			kind.Verb, kind.Resource = info.Verb, info.Resource
			if info.Subresource != "" {
				kind.Resource += "/" + info.Subresource
			}
		}
		rc.mu.Lock()
		rc.counts[kind]++
		rc.mu.Unlock()
		next.ServeHTTP(w, r)
	})
}

func (rc *requestCounter) snapshot() map[APIRequestKind]int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make(map[APIRequestKind]int, len(rc.counts))
	for k, v := range rc.counts {
		out[k] = v
	}
	return out
}

// admissionConfig is the API server's admission configuration: ResourceQuota
// limits pods of the critical priority classes as GKE's API server does, so
// such a pod is admitted outside kube-system only in a namespace whose
// ResourceQuota covers its class ("insufficient quota to match these
// scopes"). The chart's DaemonSet, MPS daemon and cleanup pods are
// system-node-critical; the chart ships the quota (priorityClassQuota).
const admissionConfig = `apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
  - name: ResourceQuota
    configuration:
      apiVersion: apiserver.config.k8s.io/v1
      kind: ResourceQuotaConfiguration
      limitedResources:
        - resource: pods
          matchScopes:
            - scopeName: PriorityClass
              operator: In
              values: ["system-node-critical", "system-cluster-critical"]
`

// apiServerArgs writes what kube-apiserver needs under dir (serving and
// kubelet-client certificates, the service-account signing key, the admin
// token, the admission configuration) and returns its flags, the same for
// the in-process server and one of another release run as a process
// (external.go): Node+RBAC authorization, service-account tokens signed with
// a fresh key (bound tokens carry the node name), the default admission
// chain (which includes NodeRestriction, ResourceQuota,
// ValidatingAdmissionWebhook and ValidatingAdmissionPolicy) with
// ResourceQuota configured as on GKE (admissionConfig), Services it calls
// reached at their endpoints (--enable-aggregator-routing), and the given
// feature gates.
func apiServerArgs(dir, etcdURL string, ca *CA, gates map[string]bool) ([]string, error) {
	// Pods of real nodes reach it as the `kubernetes` Service (podnet.go).
	certFile, keyFile, err := ca.issue(dir, "apiserver", certRequest{
		commonName: "apiserver", server: true,
		dnsNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		ips:      []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(KubernetesServiceIP)},
	})
	if err != nil {
		return nil, err
	}
	saKey := filepath.Join(dir, "sa-signing.key")
	if err := writeSigningKey(saKey); err != nil {
		return nil, err
	}
	tokens := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(adminToken+`,e2e-admin,e2e-admin,"system:masters"`+"\n"), 0o600); err != nil {
		return nil, err
	}

	// Real nodes (realnode.go): kubelets authenticate with client
	// certificates of the cluster CA, and the API server reaches their
	// servers (logs, exec) with one, verifying their serving certificates.
	caFile, err := ca.writeFile(dir)
	if err != nil {
		return nil, err
	}
	kubeletClientCert, kubeletClientKey, err := ca.issue(dir, "apiserver-kubelet-client", certRequest{
		commonName: "kube-apiserver-kubelet-client", groups: []string{"system:masters"}, client: true,
	})
	if err != nil {
		return nil, err
	}

	admission := filepath.Join(dir, "admission.yaml")
	if err := os.WriteFile(admission, []byte(admissionConfig), 0o600); err != nil {
		return nil, err
	}
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--etcd-prefix=/registry",
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--tls-cert-file=" + certFile,
		"--tls-private-key-file=" + keyFile,
		"--cert-dir=" + dir,
		"--service-cluster-ip-range=10.0.0.0/16",
		"--authorization-mode=Node,RBAC",
		"--token-auth-file=" + tokens,
		"--client-ca-file=" + caFile,
		"--kubelet-client-certificate=" + kubeletClientCert,
		"--kubelet-client-key=" + kubeletClientKey,
		"--kubelet-certificate-authority=" + caFile,
		// As kubeadm sets it: a node's hostname need not resolve.
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--enable-admission-plugins=NodeRestriction",
		"--admission-control-config-file=" + admission,
		// As kubeadm and every distribution set it: the node plugin's
		// DaemonSet is privileged.
		"--allow-privileged=true",
		"--endpoint-reconciler-type=none",
		// No kube-proxy runs here, so a Service's cluster IP leads nowhere
		// from this machine. As control planes without kube-proxy on their
		// own hosts run it, the API server dials a Service it calls
		// (admission webhooks, aggregated APIs) at the address of one of its
		// ready endpoints instead: a pod IP on a real node's bridge, which
		// this machine routes (podnet.go).
		"--enable-aggregator-routing=true",
		"--enable-priority-and-fairness=false",
	}
	if flag := featureGatesFlag(gates); flag != "" {
		args = append(args, flag)
	}
	return args, nil
}

// featureGatesFlag is `--feature-gates=A=true,B=false` for gates, sorted; ""
// for none.
func featureGatesFlag(gates map[string]bool) string {
	if len(gates) == 0 {
		return ""
	}
	var set []string
	for name, on := range gates {
		set = append(set, fmt.Sprintf("%s=%t", name, on))
	}
	sort.Strings(set)
	return "--feature-gates=" + strings.Join(set, ",")
}

// startAPIServer starts kube-apiserver in this process, configured like a
// production control plane as far as our driver can tell (apiServerArgs),
// with every GA resource.k8s.io API.
func startAPIServer(ctx context.Context, dir, etcdURL string, ca *CA, gates map[string]bool) (*apiserver, error) {
	args, err := apiServerArgs(dir, etcdURL, ca, gates)
	if err != nil {
		return nil, err
	}
	s := options.NewServerRunOptions()
	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, f := range s.Flags().FlagSets {
		fs.AddFlagSet(f)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	s.SecureServing.Listener = ln
	s.SecureServing.BindPort = port
	s.SecureServing.ExternalAddress = net.ParseIP("127.0.0.1")
	if err := fs.Parse(args); err != nil {
		return nil, fmt.Errorf("kube-apiserver flags: %w", err)
	}
	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return nil, err
	}
	completed, err := s.Complete(ctx)
	if err != nil {
		return nil, fmt.Errorf("complete kube-apiserver options: %w", err)
	}
	if errs := completed.Validate(); len(errs) != 0 {
		return nil, fmt.Errorf("kube-apiserver options: %w", utilerrors.NewAggregate(errs))
	}
	cfg, err := app.NewConfig(completed)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver config: %w", err)
	}
	if v := ModuleKubernetesVersion(); v != "" {
		// /version is answered by each server of the chain (aggregator
		// first); all of them report the Kubernetes release built in.
		for _, g := range []*genericapiserver.Config{cfg.KubeAPIs.ControlPlane.Generic, &cfg.ApiExtensions.GenericConfig.Config, &cfg.Aggregator.GenericConfig.Config} {
			g.EffectiveVersion = releaseVersion{EffectiveVersion: g.EffectiveVersion, gitVersion: v}
		}
	}
	// The aggregator's chain is the outermost: every request passes its
	// filters once (the servers it delegates to do not filter again).
	counter := &requestCounter{counts: map[APIRequestKind]int{}}
	buildChain := cfg.Aggregator.GenericConfig.BuildHandlerChainFunc
	cfg.Aggregator.GenericConfig.BuildHandlerChainFunc = func(h http.Handler, c *genericapiserver.Config) http.Handler {
		return buildChain(counter.wrap(h), c)
	}
	cc, err := cfg.Complete()
	if err != nil {
		return nil, err
	}
	server, err := app.CreateServerChain(cc)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver server chain: %w", err)
	}
	prepared, err := server.PrepareRun()
	if err != nil {
		return nil, err
	}
	a := &apiserver{host: fmt.Sprintf("https://127.0.0.1:%d", port), errCh: make(chan error, 1), requests: counter}
	go func() {
		a.errCh <- prepared.Run(ctx)
		close(a.errCh)
	}()
	return a, nil
}

// waitHealthy waits until /readyz answers ok (all post-start hooks done,
// bootstrap RBAC roles and the default namespace in place).
func (a *apiserver) waitHealthy(ctx context.Context, cfg *rest.Config) error {
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	var last string
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		select {
		case err := <-a.errCh:
			return false, fmt.Errorf("kube-apiserver exited: %v", err)
		default:
		}
		body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			last = string(body) + err.Error()
			return false, nil
		}
		if _, err := client.CoreV1().Namespaces().Get(ctx, "default", metav1GetOptions); err != nil {
			last = err.Error()
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("kube-apiserver not ready: %w (last: %s)", err, last)
	}
	return nil
}

// ModuleKubernetesVersion is the version of k8s.io/kubernetes built in:
// from the binary's build info, else (test binaries carry no module list)
// from the require line in e2e/go.mod; "" if neither says.
func ModuleKubernetesVersion() string {
	const module = "k8s.io/kubernetes"
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, d := range info.Deps {
			if d.Path == module && d.Replace != nil {
				return d.Replace.Version
			}
			if d.Path == module {
				return d.Version
			}
		}
	}
	path, err := RepoPath("e2e/go.mod")
	if err != nil {
		return ""
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(data), "\n") {
		fields := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "require "))
		if len(fields) >= 2 && fields[0] == module {
			return fields[1]
		}
	}
	return ""
}

// releaseVersion reports a release's git version from /version. A
// kube-apiserver built from Go modules, without the release build's
// -ldflags, reports "v0.0.0-master+$Format:%H$", which kubectl and client
// libraries refuse to parse.
type releaseVersion struct {
	basecompatibility.EffectiveVersion
	gitVersion string
}

// Info is the wrapped version's, with the release's git version.
func (v releaseVersion) Info() *apimachineryversion.Info {
	info := v.EffectiveVersion.Info()
	info.GitVersion = v.gitVersion
	return info
}
