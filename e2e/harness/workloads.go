package harness

import (
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// WorkloadKinds are the controller-managed kinds whose pod templates are
// turned into bare Pods: no workload controllers run in this control plane.
var WorkloadKinds = map[string]bool{"Deployment": true, "Job": true, "DaemonSet": true, "StatefulSet": true, "ReplicaSet": true}

// PodsFromWorkload turns a workload's pod template into bare Pods, one per
// replica (default 1), named <workload>-<i>, as its controller would create.
func PodsFromWorkload(o *unstructured.Unstructured) ([]*unstructured.Unstructured, error) {
	tmpl, ok, err := unstructured.NestedMap(o.Object, "spec", "template")
	if err != nil || !ok {
		return nil, fmt.Errorf("%s %s: no spec.template", o.GetKind(), o.GetName())
	}
	spec, ok := tmpl["spec"].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s %s: no spec.template.spec", o.GetKind(), o.GetName())
	}
	replicas, ok, _ := unstructured.NestedInt64(o.Object, "spec", "replicas")
	if !ok {
		replicas = 1
	}
	var out []*unstructured.Unstructured
	for i := range replicas {
		p := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Pod"}}
		if md, ok := tmpl["metadata"].(map[string]any); ok {
			p.Object["metadata"] = deepCopy(md)
		}
		p.Object["spec"] = deepCopy(spec)
		p.SetName(fmt.Sprintf("%s-%d", o.GetName(), i))
		p.SetNamespace(o.GetNamespace())
		out = append(out, p)
	}
	return out, nil
}

func deepCopy(m map[string]any) map[string]any {
	return (&unstructured.Unstructured{Object: m}).DeepCopy().Object
}
