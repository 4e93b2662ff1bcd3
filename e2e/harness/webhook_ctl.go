package harness

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// RestartWebhook stops the running gpu-dra-webhook (if it still runs),
// starts a fresh one and points the registered webhook configurations at
// it, as a new pod behind the webhook's Service would take over. Outage
// tests stop the webhook with Driver().Webhook.Stop() and call this to
// bring it back.
func (c *Cluster) RestartWebhook(ctx context.Context) (*WebhookProcess, error) {
	d := c.Driver()
	if d == nil || d.Webhook == nil {
		return nil, fmt.Errorf("restart webhook: no webhook installed")
	}
	d.Webhook.Stop()
	wh, err := c.StartWebhook(ctx, d.Objects)
	if err != nil {
		return nil, err
	}
	var configs []*unstructured.Unstructured
	for _, o := range d.Objects {
		if o.GetKind() != "ValidatingWebhookConfiguration" {
			continue
		}
		o = o.DeepCopy()
		if err := pointWebhooksAt(o, wh.URL, c.CA.CertPEM); err != nil {
			return nil, err
		}
		configs = append(configs, o)
	}
	if err := c.replace(ctx, configs, DriverNamespace); err != nil {
		return nil, err
	}
	c.mu.Lock()
	d.Webhook = wh
	c.mu.Unlock()
	return wh, nil
}
