package harness

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
)

// DriverNamespace is where the driver's namespaced objects go (the Helm
// release namespace).
const DriverNamespace = "gpu-dra"

// ChartPath is the Helm chart, relative to the repository root.
const ChartPath = "deploy/helm/gpu-dra-driver"

// InstallOptions select how the driver is installed.
type InstallOptions struct {
	// Webhook starts gpu-dra-webhook and registers it.
	Webhook bool
	// HelmSet are extra `--set` values for `helm install`.
	HelmSet []string
}

// Driver is the cluster-side install of our driver.
type Driver struct {
	// FromChart says the objects came from `helm install` of the chart
	// (false: the harness's built-in minimal RBAC and DeviceClasses).
	FromChart bool
	// Identity is the node plugin's service account.
	Identity Identity
	// Objects are what was installed (the release's manifest).
	Objects []*unstructured.Unstructured
	// Webhook is the running webhook, if requested.
	Webhook *WebhookProcess
	// Notes say what was left out and why (missing chart, binary...).
	Notes []string
}

// Driver returns the installed driver, or nil.
func (c *Cluster) Driver() *Driver {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.driver
}

func (c *Cluster) pluginIdentity() *Identity {
	if d := c.Driver(); d != nil {
		id := d.Identity
		return &id
	}
	return &Identity{Namespace: DriverNamespace, ServiceAccount: "gpu-dra-kubelet-plugin"}
}

// InstallDriver installs the driver's cluster objects as an admin does,
// `helm install` of the chart (release HelmRelease in DriverNamespace), or
// applies a built-in minimal set while helm or the chart is missing, and
// optionally starts the webhook as a process and points the webhook
// registration at it (in a real cluster the chart's Deployment and Service
// serve it). The chart's DaemonSet is picked up by nodes whose plugin runs
// deployed (daemonset.go); other nodes run the plugin as a process.
func (c *Cluster) InstallDriver(ctx context.Context, opts InstallOptions) (*Driver, error) {
	if err := c.ensureNamespace(ctx, DriverNamespace); err != nil {
		return nil, err
	}
	d := &Driver{Identity: Identity{Namespace: DriverNamespace, ServiceAccount: "gpu-dra-kubelet-plugin"}}
	objs, err := c.helmInstallDriver(ctx, opts.HelmSet)
	switch {
	case err == nil:
		d.FromChart = true
	case errors.Is(err, ErrMissing):
		d.Notes = append(d.Notes, "chart not installed: "+err.Error()+"; using built-in RBAC and DeviceClasses")
		if objs, err = ParseYAML([]byte(builtinObjects)); err != nil {
			return nil, err
		}
		if err := c.Apply(ctx, objs, DriverNamespace); err != nil {
			return nil, err
		}
	default:
		return nil, err
	}
	var webhookConfigs []*unstructured.Unstructured
	for _, o := range objs {
		switch o.GetKind() {
		case "DaemonSet":
			if sa, ok, _ := unstructured.NestedString(o.Object, "spec", "template", "spec", "serviceAccountName"); ok && sa != "" {
				d.Identity.ServiceAccount = sa
			}
		case "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration":
			webhookConfigs = append(webhookConfigs, o)
		}
	}
	d.Objects = objs

	if opts.Webhook {
		wh, err := c.StartWebhook(ctx, objs)
		if err != nil {
			return nil, err
		}
		d.Webhook = wh
		if len(webhookConfigs) == 0 {
			d.Notes = append(d.Notes, "the chart has no webhook configuration; using the built-in one")
			webhookConfigs, err = ParseYAML([]byte(builtinWebhookConfig))
			if err != nil {
				return nil, err
			}
			d.Objects = append(d.Objects, webhookConfigs...)
		}
		for _, o := range webhookConfigs {
			if err := pointWebhooksAt(o, wh.URL, c.CA.CertPEM); err != nil {
				return nil, err
			}
		}
		// Replaced, not applied: the chart's service reference must go
		// (a webhook names exactly one of url and service).
		if err := c.replace(ctx, webhookConfigs, DriverNamespace); err != nil {
			return nil, err
		}
		// The process serves the webhook; the chart's Deployment would run
		// the webhook's image on nodes that run the test image
		// (kube-controller-manager's Deployment controller starts its pods).
		for _, o := range objs {
			if o.GetKind() != "Deployment" || o.GetLabels()["app.kubernetes.io/component"] != "webhook" {
				continue
			}
			ns := o.GetNamespace()
			if ns == "" {
				ns = DriverNamespace
			}
			deployments := c.Client.AppsV1().Deployments(ns)
			scale, err := deployments.GetScale(ctx, o.GetName(), metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("webhook Deployment %s: %w", o.GetName(), err)
			}
			scale.Spec.Replicas = 0
			if _, err := deployments.UpdateScale(ctx, o.GetName(), scale, metav1.UpdateOptions{}); err != nil {
				return nil, fmt.Errorf("scale webhook Deployment %s to 0: %w", o.GetName(), err)
			}
			d.Notes = append(d.Notes, "the chart's webhook Deployment scaled to 0: the webhook runs as a process")
		}
	} else if len(webhookConfigs) > 0 {
		d.Notes = append(d.Notes, "webhook not started: its registration points at the chart's Service, which nothing serves here")
	}
	c.mu.Lock()
	c.driver = d
	c.mu.Unlock()
	return d, nil
}

// replace creates objects or replaces them whole (an update, not a merge).
func (c *Cluster) replace(ctx context.Context, objs []*unstructured.Unstructured, namespace string) error {
	for _, obj := range objs {
		ri, err := c.resourceFor(obj, namespace)
		if err != nil {
			return err
		}
		live, err := ri.Get(ctx, obj.GetName(), metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := ri.Create(ctx, obj, metav1.CreateOptions{FieldManager: "e2e"}); err != nil {
				return fmt.Errorf("create %s %s: %w", obj.GetKind(), obj.GetName(), err)
			}
			continue
		}
		if err != nil {
			return err
		}
		obj.SetResourceVersion(live.GetResourceVersion())
		if _, err := ri.Update(ctx, obj, metav1.UpdateOptions{FieldManager: "e2e"}); err != nil {
			return fmt.Errorf("replace %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}

// helmInstallDriver runs `helm install` and returns the release's manifest.
func (c *Cluster) helmInstallDriver(ctx context.Context, set []string) ([]*unstructured.Unstructured, error) {
	if _, err := RepoPath(ChartPath); err != nil {
		return nil, err
	}
	if _, err := Tool("helm"); err != nil {
		return nil, err
	}
	if err := c.HelmInstall(ctx, set...); err != nil {
		return nil, err
	}
	manifest, err := c.Helm(ctx, "get", "manifest", HelmRelease, "--namespace", DriverNamespace)
	if err != nil {
		return nil, err
	}
	return ParseYAML([]byte(manifest))
}

// pointWebhooksAt rewrites every webhook's clientConfig to the local URL.
func pointWebhooksAt(o *unstructured.Unstructured, url string, caPEM []byte) error {
	hooks, _, err := unstructured.NestedSlice(o.Object, "webhooks")
	if err != nil {
		return err
	}
	for i := range hooks {
		h, ok := hooks[i].(map[string]any)
		if !ok {
			continue
		}
		path := "/validate"
		if svc, ok, _ := unstructured.NestedString(h, "clientConfig", "service", "path"); ok && svc != "" {
			path = svc
		}
		h["clientConfig"] = map[string]any{
			"url":      url + path,
			"caBundle": base64.StdEncoding.EncodeToString(caPEM),
		}
	}
	return unstructured.SetNestedSlice(o.Object, hooks, "webhooks")
}

// WebhookProcess is a running gpu-dra-webhook.
type WebhookProcess struct {
	// URL is https://127.0.0.1:<port> (no path).
	URL string
	// LogPath receives its output.
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{}
}

// StartWebhook starts gpu-dra-webhook with a certificate from the cluster
// CA and waits until it answers /readyz. Where the installed objects (the
// chart's) run the webhook counting pods per node (its Deployment's
// MAX_DAEMON_PODS_PER_NODE and DAEMON_PODS_NAMESPACE), the process does so
// too, reading pods with the admin's kubeconfig.
func (c *Cluster) StartWebhook(ctx context.Context, installed []*unstructured.Unstructured) (*WebhookProcess, error) {
	bin, err := Binary("gpu-dra-webhook")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(c.Dir, "webhook")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	certFile, keyFile, err := c.CA.IssueServing(dir, "webhook", "gpu-dra-webhook", "gpu-dra-webhook."+DriverNamespace+".svc")
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	w := &WebhookProcess{URL: fmt.Sprintf("https://127.0.0.1:%d", port), LogPath: filepath.Join(dir, "webhook.log"), done: make(chan struct{})}
	log, err := os.Create(w.LogPath)
	if err != nil {
		return nil, err
	}
	w.cmd = exec.Command(bin,
		fmt.Sprintf("--bind-address=127.0.0.1:%d", port),
		"--tls-cert-file="+certFile, "--tls-key-file="+keyFile,
		"--log-level=info")
	w.cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig)
	for _, o := range installed {
		if o.GetKind() != "Deployment" {
			continue
		}
		containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		for _, ct := range containers {
			m, _ := ct.(map[string]any)
			if cmd, _, _ := unstructured.NestedStringSlice(m, "command"); len(cmd) == 0 || !strings.HasSuffix(cmd[0], "/gpu-dra-webhook") {
				continue
			}
			env, _, _ := unstructured.NestedSlice(m, "env")
			for _, e := range env {
				kv, _ := e.(map[string]any)
				name, _ := kv["name"].(string)
				value, _ := kv["value"].(string)
				if name == "MAX_DAEMON_PODS_PER_NODE" || name == "DAEMON_PODS_NAMESPACE" {
					w.cmd.Env = append(w.cmd.Env, name+"="+value)
				}
			}
		}
	}
	w.cmd.Stdout, w.cmd.Stderr = log, log
	if err := c.startProcess(w.cmd); err != nil { // in the cluster's cgroups (clustercgroups.go)
		log.Close()
		return nil, err
	}
	go func() { _ = w.cmd.Wait(); log.Close(); close(w.done) }()
	c.mu.Lock()
	c.stops = append(c.stops, w.Stop)
	c.mu.Unlock()

	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.CA.CertPEM)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		select {
		case <-w.done:
			return false, fmt.Errorf("gpu-dra-webhook exited")
		default:
		}
		resp, err := client.Get(w.URL + "/readyz")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		logText, _ := os.ReadFile(w.LogPath)
		return nil, fmt.Errorf("gpu-dra-webhook not ready: %w; log:\n%s", err, logText)
	}
	return w, nil
}

// Stop terminates the webhook.
func (w *WebhookProcess) Stop() {
	_ = w.cmd.Process.Signal(os.Interrupt)
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
		_ = w.cmd.Process.Kill()
		<-w.done
	}
}

// builtinObjects stand in for the chart until it lands: the plugin's
// service account and the least rights it needs, and the two DeviceClasses
// with the NVIDIA driver's selectors.
const builtinObjects = `
apiVersion: v1
kind: ServiceAccount
metadata:
  name: gpu-dra-kubelet-plugin
  namespace: ` + DriverNamespace + `
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: gpu-dra-kubelet-plugin
rules:
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceslices"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims/status"]
  verbs: ["update", "patch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: gpu-dra-kubelet-plugin
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: gpu-dra-kubelet-plugin
subjects:
- kind: ServiceAccount
  name: gpu-dra-kubelet-plugin
  namespace: ` + DriverNamespace + `
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu.nvidia.com
spec:
  selectors:
  - cel:
      expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: mig.nvidia.com
spec:
  selectors:
  - cel:
      expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
`

// builtinWebhookConfig registers the webhook for what carries opaque
// configs: claims, claim templates and DeviceClasses.
const builtinWebhookConfig = `
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: gpu-dra-webhook
webhooks:
- name: validate.gpu.nvidia.com
  admissionReviewVersions: ["v1"]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 10
  clientConfig:
    service: {name: gpu-dra-webhook, namespace: ` + DriverNamespace + `, path: /validate}
  rules:
  - apiGroups: ["resource.k8s.io"]
    apiVersions: ["v1", "v1beta1", "v1beta2"]
    operations: ["CREATE", "UPDATE"]
    resources: ["resourceclaims", "resourceclaimtemplates", "deviceclasses"]
`

// KubernetesVersion is the release the harness runs (e2e/go.mod pins it).
const KubernetesVersion = "v1.37.1"
