package deployed

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpu-dra/e2e/harness"
)

// checkWorkload runs `gpu-dra check --workload --node node` and expects the
// workload check passed on that node with the UUID of the device its claim
// got, and its namespace gone afterwards.
func checkWorkload(ctx context.Context, t *testing.T, kubeconfig, node string) {
	t.Helper()
	report, code := cluster.CheckWith(t, kubeconfig, "--workload", "--node", node, "--workload-timeout", "90s")
	if code != 0 {
		t.Errorf("gpu-dra check --workload on a healthy install: exit %d, want 0", code)
	}
	var detail []string
	found := false
	for _, c := range report.Checks {
		if c.Name != "workload" {
			continue
		}
		found = true
		detail = c.Detail
		if c.Status != "passed" {
			t.Errorf("workload: %q, want passed: %v; fix: %s", c.Status, c.Detail, c.Fix)
		}
	}
	if !found {
		t.Fatal("no workload check in the report of gpu-dra check --workload")
	}
	joined := strings.Join(detail, "\n")
	if !strings.Contains(joined, "node "+node) {
		t.Errorf("workload detail %v does not name node %s", detail, node)
	}
	// The device line's UUID is the one the pod saw.
	var device, seen string
	for _, l := range detail {
		if _, rest, ok := strings.Cut(l, "(UUID "); ok && strings.HasPrefix(l, "device ") {
			device = strings.TrimSuffix(rest, ")")
		}
		if rest, ok := strings.CutPrefix(l, "UUID seen "); ok {
			seen = rest
		}
	}
	if !strings.HasPrefix(device, "GPU-") || device != seen {
		t.Errorf("workload detail %v: allocated UUID %q, seen %q; want the same GPU-... UUID", detail, device, seen)
	}
	// The check deletes its namespace.
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := cluster.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=gpu-dra-check"})
		return err == nil && len(l.Items) == 0, nil
	})
	if err != nil {
		t.Errorf("the workload's namespace stays after gpu-dra check: %v", err)
	}
}

// waitSlices waits until each node has our ResourceSlices.
func waitSlices(ctx context.Context, t *testing.T, nodes ...string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		for _, n := range nodes {
			l, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
				FieldSelector: "spec.nodeName=" + n + ",spec.driver=" + harness.DefaultDriver,
			})
			if err != nil || len(l.Items) == 0 {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("no ResourceSlices of %v: %v", nodes, err)
	}
}

// TestCheck: `gpu-dra check` on a healthy install (two nodes with the
// deployed plugin), run as a service account with only the chart's check
// role (checkRole, with workload and webhookSecret), fails no check and exits 0 (the role
// grants no write for the dry-run feature probe: the check says so and
// judges by the release); `--workload --node`, as that account too, runs a
// one-GPU pod on that node, on the chart's plugin image (the default: no
// shell, nvidia-smi from the claim's CDI spec), which lists exactly the GPU
// its claim was allocated, and removes its namespace; a pod whose claim the
// plugin refuses to prepare fails `stuck-claims` (checkStuckClaim); with the
// plugin gone from one GPU node (no longer selected by the DaemonSet, labeled
// as a GPU node as NVIDIA's GPU feature discovery labels them), `plugin-pods`
// fails naming the node, with its fix, and it exits 1.
//
// The chart's webhook runs as installed (its Deployment on the two nodes):
// `webhook-reachable` passes, the API server calling it at its pods'
// addresses as it calls admission webhooks (e2e/README.md), and a claim with
// a bad GPU config is refused at create by that Deployment
// (checkWebhookRefuses).
func TestCheck(t *testing.T) {
	ctx := context.Background()
	layout := harness.LayoutHostDriver
	a := addNode(t, "node-check-a", layout, "t4")
	b := addNode(t, "node-check-b", layout, "t4")
	install(t, append(layout.HelmValues(),
		// The chart's role for the check, bound to an account of the test's.
		"checkRole.enabled=true", "checkRole.workload=true", "checkRole.webhookSecret=true",
		"checkRole.subjects[0].kind=ServiceAccount", "checkRole.subjects[0].name="+checkerAccount,
		"checkRole.subjects[0].namespace="+checkerNamespace)...)
	checker := checkerKubeconfig(ctx, t)
	waitPlugin(ctx, t, a, "")
	waitPlugin(ctx, t, b, "")
	waitSlices(ctx, t, a.Name, b.Name)

	// Healthy: every check passed or warned. The webhook's pods become
	// ready after the plugin's: until then webhook-reachable fails.
	var report harness.CheckReport
	var code int
	// A plugin pod's readiness can trail its registration by a probe period.
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		report, code = cluster.CheckWith(t, checker)
		return code == 0, nil
	})
	if err != nil {
		t.Fatalf("gpu-dra check on a healthy install: exit %d, want 0", code)
	}
	status := map[string]string{}
	for _, c := range report.Checks {
		status[c.Name] = c.Status
		if c.Status == "failed" {
			t.Errorf("check %s failed on a healthy install: %v; fix: %s", c.Name, c.Detail, c.Fix)
		}
	}
	for _, name := range []string{"api-server", "resource-api", "dra-features", "device-classes", "plugin-pods", "resource-slices", "mps-daemons", "stuck-claims", "device-taints", "webhook-reachable", "webhook-certificate"} {
		if status[name] != "passed" {
			t.Errorf("check %s: %q, want passed", name, status[name])
		}
	}
	// The role grants no create on ResourceSlices: the dry-run probe is
	// refused and the check judges the features by the release, saying so.
	for _, c := range report.Checks {
		if c.Name == "dra-features" && !strings.Contains(strings.Join(c.Detail, "\n"), "no dry-run write") {
			t.Errorf("dra-features as %s: %v, want the probe refused", checkerAccount, c.Detail)
		}
	}
	checkWorkload(ctx, t, checker, a.Name)
	checkWebhookRefuses(ctx, t)
	checkStuckClaim(ctx, t, a.Name)

	// Broken: node b is a GPU node the DaemonSet no longer selects.
	patch := fmt.Sprintf(`{"metadata":{"labels":{"nvidia.com/gpu.present":"true",%q:null}}}`, harness.DeployedPluginLabel)
	if _, err := cluster.Client.CoreV1().Nodes().Patch(ctx, b.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(harness.DriverNamespace).List(ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/component=kubelet-plugin",
			FieldSelector: "spec.nodeName=" + b.Name,
		})
		return err == nil && len(pods.Items) == 0, nil
	})
	if err != nil {
		t.Fatalf("the plugin pod on %s stays: %v", b.Name, err)
	}
	report, code = cluster.Check(t)
	if code != 1 {
		t.Errorf("gpu-dra check with the plugin gone from %s: exit %d, want 1", b.Name, code)
	}
	if report.Status != "failed" {
		t.Errorf("report status %q, want failed", report.Status)
	}
	found := false
	for _, c := range report.Checks {
		if c.Name != "plugin-pods" {
			continue
		}
		found = true
		if c.Status != "failed" {
			t.Errorf("plugin-pods: %q, want failed", c.Status)
		}
		want := "node " + b.Name + ": no plugin pod"
		if !strings.Contains(strings.Join(c.Detail, "\n"), want) {
			t.Errorf("plugin-pods detail %v does not say %q", c.Detail, want)
		}
		if !strings.Contains(c.Fix, "describe daemonset") {
			t.Errorf("plugin-pods fix %q does not point at the DaemonSet", c.Fix)
		}
		if strings.Contains(strings.Join(c.Detail, "\n"), "node "+a.Name+":") {
			t.Errorf("plugin-pods blames the healthy node %s: %v", a.Name, c.Detail)
		}
	}
	if !found {
		t.Error("no plugin-pods check in the report")
	}
}

// The account TestCheck runs the healthy checks as, with only the chart's
// check role (checkRole) bound to it.
const checkerNamespace, checkerAccount = "check-rbac", "checker"

// checkerKubeconfig writes a kubeconfig for a token of the checker account.
func checkerKubeconfig(ctx context.Context, t *testing.T) string {
	t.Helper()
	if err := cluster.CreateNamespace(ctx, checkerNamespace); err != nil {
		t.Fatal(err)
	}
	accounts := cluster.Client.CoreV1().ServiceAccounts(checkerNamespace)
	if _, err := accounts.Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: checkerAccount}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = accounts.Delete(context.Background(), checkerAccount, metav1.DeleteOptions{}) })
	tr, err := accounts.CreateToken(ctx, checkerAccount, &authv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cluster.WriteKubeconfig(path, checkerAccount, tr.Status.Token); err != nil {
		t.Fatal(err)
	}
	return path
}

// checkWebhookRefuses: a claim whose GPU config is invalid on any device
// (150 % of the threads) is refused at create by the chart's webhook
// Deployment, through the API server: the refusal names the chart's
// registration, the object and the field path, with the `api` crate's
// message, the one the node plugin gives at prepare. Nothing is stored.
func checkWebhookRefuses(ctx context.Context, t *testing.T) {
	t.Helper()
	const ns, name = "check-webhook", "bad-threads"
	if err := cluster.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	claims := cluster.Client.ResourceV1().ResourceClaims(ns)
	_, err := claims.Create(ctx, gpuClaim(ns, name, mpsParams(t, map[string]any{"defaultActiveThreadPercentage": 150})), metav1.CreateOptions{})
	if err == nil {
		t.Fatal("a claim with defaultActiveThreadPercentage 150 was admitted with the webhook installed")
	}
	for _, want := range []string{
		`admission webhook "resourceclaims.opaque-config.` + harness.DefaultDriver + `" denied the request`,
		"ResourceClaim " + ns + "/" + name + " is invalid (1 problem): " +
			"spec.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: 150 is out of range 1..=100",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
	}
	if _, err := claims.Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the refused claim: %v, want not found", err)
	}
}

// mpsParams are the opaque parameters of a GpuConfig sharing with MPS with
// the given mpsConfig.
func mpsParams(t *testing.T, mps map[string]any) []byte {
	t.Helper()
	params, err := json.Marshal(map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mpsConfig": mps},
	})
	if err != nil {
		t.Fatal(err)
	}
	return params
}

// checkStuckClaim: a pod on node whose claim carries a GPU config the plugin
// refuses at prepare (a pinned-memory limit for device index 1 of a
// one-GPU claim: only the allocation shows the claim has no second device,
// so the webhook admits it) waits in Pending while the kubelet reports
// FailedPrepareDynamicResources; `gpu-dra check --only stuck-claims` fails
// naming the pod, its claim, the node and the kubelet's message (the
// plugin's error), with its fix, and exits 1. Once the pod is deleted
// the check passes again: the events stay, but no pod waits on them.
func checkStuckClaim(ctx context.Context, t *testing.T, node string) {
	t.Helper()
	const ns, name = "check-stuck", "stuck"
	if err := cluster.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	params := mpsParams(t, map[string]any{"defaultPerDevicePinnedMemoryLimit": map[string]any{"1": "1Gi"}})
	pod, err := createClaimPod(ctx, ns, name, node, params)
	if err != nil {
		t.Fatal(err)
	}
	deleted := false
	deletePod := func() {
		if deleted {
			return
		}
		deleted = true
		_ = cluster.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{})
		if err := cluster.WaitPodGone(ctx, ns, name, 60*time.Second); err != nil {
			t.Errorf("the stuck pod stays: %v", err)
		}
		_ = cluster.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, name, metav1.DeleteOptions{})
	}
	t.Cleanup(deletePod)

	// The kubelet's first attempt comes once the claim is allocated and the
	// pod bound; its event a moment later.
	var r harness.CheckResult
	var code int
	err = wait.PollUntilContextTimeout(ctx, time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		r, code = cluster.CheckOnly(t, "stuck-claims")
		return r.Status != "passed", nil
	})
	if err != nil {
		t.Fatalf("stuck-claims still passes with pod %s/%s refused at prepare: %v", ns, name, r.Detail)
	}
	harness.ExpectCheckFailed(t, r, code,
		[]string{"pod " + ns + "/" + pod.Name + " on " + node + " (claim " + name + "):", "defaultPerDevicePinnedMemoryLimit[1]: device index 1 is out of range: the config applies to 1 device(s)"},
		[]string{"gpu-dra explain", "kubectl describe pod"})

	deletePod()
	r, code = cluster.CheckOnly(t, "stuck-claims")
	harness.ExpectCheckPassed(t, r, code)
}

// TestCheckWebhookCertificate: `gpu-dra check --only webhook-certificate` on
// the chart's webhook in its default TLS mode (helm: the chart generates a
// CA and a serving certificate, keeps them in a Secret across upgrades and
// registers that CA as the caBundle). It passes as installed, and fails, with
// the fix for each fault, when the Secret holds
//   - an expired pair (its CA registered by `helm upgrade`, as the chart
//     does with the Secret it keeps): a new certificate is needed;
//   - a valid certificate of another CA than the registered one;
//   - a certificate of the registered CA for another name than the Service's;
//
// and passes again after the fix it names for helm mode: delete the Secret
// and `helm upgrade`. No node: the webhook's pods stay Pending, so
// webhook-reachable fails there, naming the Service without a ready endpoint
// and how to look at its pods (--only keeps each run's exit status to its
// one check).
func TestCheckWebhookCertificate(t *testing.T) {
	ctx := context.Background()
	const check = "webhook-certificate"
	// The webhook alone: no node plugin, so no uninstall Job, whose pod could
	// not run without a node (`helm uninstall` would wait for it).
	values := []string{"kubeletPlugin.enabled=false"}
	install(t, values...)
	r, code := cluster.CheckOnly(t, check)
	harness.ExpectCheckPassed(t, r, code)

	svc := harness.HelmRelease + "-gpu-dra-driver-webhook"
	r, code = cluster.CheckOnly(t, "webhook-reachable")
	harness.ExpectCheckFailed(t, r, code,
		[]string{"Service " + harness.DriverNamespace + "/" + svc, "the Service has no ready endpoint"},
		[]string{"no webhook pod is ready", "app.kubernetes.io/component=webhook", "logs deploy/" + svc})
	dns := svc + "." + harness.DriverNamespace + ".svc"
	secretRef := "Secret " + harness.DriverNamespace + "/" + webhookSecret
	now := time.Now()
	ca := newTestCA(t)
	setSecret := func(pair testPair, caPEM []byte) {
		t.Helper()
		data := map[string]string{
			"tls.crt": base64.StdEncoding.EncodeToString(pair.cert),
			"tls.key": base64.StdEncoding.EncodeToString(pair.key),
		}
		if caPEM != nil {
			data["ca.crt"] = base64.StdEncoding.EncodeToString(caPEM)
		}
		patch, err := json.Marshal(map[string]any{"data": data})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cluster.Client.CoreV1().Secrets(harness.DriverNamespace).Patch(ctx, webhookSecret, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Expired a day ago, its CA registered by `helm upgrade`.
	setSecret(ca.issue(t, dns, now.Add(-48*time.Hour), now.Add(-24*time.Hour)), ca.pem)
	if err := cluster.HelmUpgrade(ctx, values...); err != nil {
		t.Fatal(err)
	}
	r, code = cluster.CheckOnly(t, check)
	harness.ExpectCheckFailed(t, r, code,
		[]string{"certificate for " + dns + " expired 1 days ago", "it has expired"},
		[]string{"issue a new certificate", "delete " + secretRef + " and run `helm upgrade`", "renewed certificate for " + dns})
	if strings.Contains(r.Fix, "caBundle") {
		t.Errorf("the fix for an expired certificate points at the caBundle: %s", r.Fix)
	}

	// Valid, but signed by a CA the registration does not trust.
	setSecret(newTestCA(t).issue(t, dns, now.Add(-time.Hour), now.Add(24*time.Hour)), nil)
	r, code = cluster.CheckOnly(t, check)
	harness.ExpectCheckFailed(t, r, code,
		[]string{"it is not signed by the caBundle's CA"},
		[]string{"caBundle the CA that signed the certificate", "delete " + secretRef})

	// Signed by the registered CA, for another name.
	setSecret(ca.issue(t, "other."+harness.DriverNamespace+".svc", now.Add(-time.Hour), now.Add(24*time.Hour)), nil)
	r, code = cluster.CheckOnly(t, check)
	harness.ExpectCheckFailed(t, r, code,
		[]string{"it does not name " + dns},
		[]string{"issue a certificate for " + dns, "delete " + secretRef})

	// The fix for helm mode: the chart issues a new pair.
	if err := cluster.Client.CoreV1().Secrets(harness.DriverNamespace).Delete(ctx, webhookSecret, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.HelmUpgrade(ctx, values...); err != nil {
		t.Fatal(err)
	}
	r, code = cluster.CheckOnly(t, check)
	harness.ExpectCheckPassed(t, r, code)
}

// testCA signs the certificates a test puts in the webhook's Secret, with
// validity periods of the test's choosing.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

// testPair is a PEM certificate and its PEM key.
type testPair struct{ cert, key []byte }

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "check-test-ca"},
		NotBefore:             time.Now().Add(-72 * time.Hour),
		NotAfter:              time.Now().Add(72 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue is a serving certificate for dnsName valid from notBefore to notAfter.
func (ca *testCA) issue(t *testing.T, dnsName string, notBefore, notAfter time.Time) testPair {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: dnsName},
		DNSNames:     []string{dnsName},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return testPair{
		cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		key:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}
}
