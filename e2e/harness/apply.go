package harness

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

// ParseYAML splits a multi-document YAML stream into objects, dropping
// empty documents and List wrappers' emptiness (items are flattened).
func ParseYAML(data []byte) ([]*unstructured.Unstructured, error) {
	r := yaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out []*unstructured.Unstructured
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(doc, &obj.Object); err != nil {
			return nil, fmt.Errorf("parse YAML document: %w", err)
		}
		if len(obj.Object) == 0 {
			continue
		}
		if obj.IsList() {
			list, err := obj.ToList()
			if err != nil {
				return nil, err
			}
			for i := range list.Items {
				out = append(out, &list.Items[i])
			}
			continue
		}
		out = append(out, obj)
	}
}

// resourceFor resolves an object's REST endpoint, defaulting the namespace of
// namespaced objects.
func (c *Cluster) resourceFor(obj *unstructured.Unstructured, namespace string) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	mapping, err := c.Mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		c.Mapper.Reset()
		mapping, err = c.Mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", gvk, obj.GetName(), err)
	}
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		if obj.GetNamespace() == "" {
			obj.SetNamespace(namespace)
		}
		return c.Dynamic.Resource(mapping.Resource).Namespace(obj.GetNamespace()), nil
	}
	return c.Dynamic.Resource(mapping.Resource), nil
}

// Create creates one object (through admission, so webhook refusals come
// back as the error).
func (c *Cluster) Create(ctx context.Context, obj *unstructured.Unstructured, namespace string) (*unstructured.Unstructured, error) {
	ri, err := c.resourceFor(obj, namespace)
	if err != nil {
		return nil, err
	}
	return ri.Create(ctx, obj, metav1.CreateOptions{FieldManager: "e2e"})
}

// Apply server-side-applies objects (create or update), in order.
func (c *Cluster) Apply(ctx context.Context, objs []*unstructured.Unstructured, namespace string) error {
	for _, obj := range objs {
		ri, err := c.resourceFor(obj, namespace)
		if err != nil {
			return err
		}
		data, err := obj.MarshalJSON()
		if err != nil {
			return err
		}
		if _, err := ri.Patch(ctx, obj.GetName(), "application/apply-patch+yaml", data,
			metav1.PatchOptions{FieldManager: "e2e", Force: new(true)}); err != nil {
			return fmt.Errorf("apply %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}

// warningCollector keeps the apiserver's warnings (admission webhook warnings among them).
type warningCollector struct {
	mu       sync.Mutex
	messages []string
}

func (w *warningCollector) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.messages = append(w.messages, text)
}

// CreateWithWarnings is Create that also returns the warnings the apiserver
// sent back (admission webhooks' warnings included).
func (c *Cluster) CreateWithWarnings(ctx context.Context, obj *unstructured.Unstructured, namespace string) ([]string, error) {
	w := &warningCollector{}
	cfg := rest.CopyConfig(c.AdminConfig)
	cfg.WarningHandler = w
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	gvk := obj.GroupVersionKind()
	mapping, err := c.Mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, err
	}
	var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		if obj.GetNamespace() == "" {
			obj.SetNamespace(namespace)
		}
		ri = dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace())
	}
	_, err = ri.Create(ctx, obj, metav1.CreateOptions{FieldManager: "e2e"})
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.messages, err
}
