{{/* Common names and labels. */}}

{{/* The chart's name in object names and labels; nameOverride (as in NVIDIA's chart) replaces it. */}}
{{- define "gpu-dra.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object's name: fullnameOverride, else <release>-<name> (just the
release name when it already contains the name). 50 characters leave room for suffixes. */}}
{{- define "gpu-dra.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "gpu-dra.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The namespace of every namespaced object: namespaceOverride (as in NVIDIA's chart), else
the release's. */}}
{{- define "gpu-dra.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end -}}

{{- define "gpu-dra.labels" -}}
app.kubernetes.io/name: {{ include "gpu-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The label NVIDIA's chart selects each component's pods by, which its users' runbooks and
dashboards look for: `<name>-component: <component>`, where <name> is nameOverride or
dra-driver-nvidia-gpu (its chart's name). Only on pod templates, never in a selector:
selectors are immutable, and an upgrade from an earlier release of this chart must keep
them. Call with (list $ "<component>").
*/}}
{{- define "gpu-dra.nvidiaComponentLabel" -}}
{{- $root := index . 0 -}}
{{ printf "%s-component" ($root.Values.nameOverride | default "dra-driver-nvidia-gpu") }}: {{ index . 1 }}
{{- end -}}

{{/* "true" when the node plugin is deployed: kubeletPlugin.enabled and NVIDIA's
resources.gpus.enabled (true when unset); "" otherwise. */}}
{{- define "gpu-dra.pluginEnabled" -}}
{{- if and .Values.kubeletPlugin.enabled (dig "gpus" "enabled" true (.Values.resources | default dict)) -}}
true
{{- end -}}
{{- end -}}

{{/* The image's repository when none is set, and what an image of NVIDIA's driver is replaced
by (its image has none of this chart's binaries). Same as image.repository in values.yaml. */}}
{{- define "gpu-dra.defaultRepository" -}}
ghcr.io/gpu-dra/gpu-dra-driver
{{- end -}}

{{/* "true" when image.repository names NVIDIA's driver image (a values file written for
NVIDIA's chart); "" otherwise. */}}
{{- define "gpu-dra.nvidiaImage" -}}
{{- if regexMatch "(^|/)(dra-driver-nvidia-gpu|k8s-dra-driver-gpu)$" .Values.image.repository -}}
true
{{- end -}}
{{- end -}}

{{/* The image every pod of the chart runs: repository@digest when image.digest is set (the
release sets it to the digest it was tested with: `make image-push` prints it), else
repository:tag (the chart's appVersion when no tag is set). */}}
{{- define "gpu-dra.image" -}}
{{- $repository := .Values.image.repository -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if include "gpu-dra.nvidiaImage" . -}}
{{- $repository = include "gpu-dra.defaultRepository" . -}}
{{- $tag = .Chart.AppVersion -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{ $repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "gpu-dra.pluginServiceAccount" -}}
{{- .Values.kubeletPlugin.serviceAccount.name | default (printf "%s-kubelet-plugin" (include "gpu-dra.fullname" .)) -}}
{{- end -}}

{{/* MPS control daemon pods run as this account: no RBAC, its token never mounted. */}}
{{- define "gpu-dra.mpsDaemonServiceAccount" -}}
{{- printf "%s-mps-daemon" (include "gpu-dra.fullname" .) -}}
{{- end -}}

{{/*
The kubelet's folders on the host. NVIDIA's values kubeletPlugin.kubeletPluginsDirectoryPath
and kubeletPlugin.kubeletRegistrarDirectoryPath (k0s, microk8s and other kubelets with their
own root), when set, win over the folders under kubeletPlugin.kubeletRoot: they name the
folder exactly, kubeletRoot only its parent.
*/}}
{{- define "gpu-dra.pluginsDir" -}}
{{- $p := .Values.kubeletPlugin -}}
{{- $p.kubeletPluginsDirectoryPath | default (printf "%s/plugins" (trimSuffix "/" $p.kubeletRoot)) | trimSuffix "/" -}}
{{- end -}}

{{/* The plugin's own folder on the host (PLUGIN_DIR); MPS daemon folders are under <it>/mps. */}}
{{- define "gpu-dra.pluginDir" -}}
{{- printf "%s/%s" (include "gpu-dra.pluginsDir" .) .Values.driverName -}}
{{- end -}}

{{/* The kubelet's plugin registration folder on the host (REGISTRAR_DIR). */}}
{{- define "gpu-dra.registrarDir" -}}
{{- $p := .Values.kubeletPlugin -}}
{{- $p.kubeletRegistrarDirectoryPath | default (printf "%s/plugins_registry" (trimSuffix "/" $p.kubeletRoot)) | trimSuffix "/" -}}
{{- end -}}

{{/* The host folder of the kubelet's PodResources socket; "" when the plugin does not ask it.
Next to the plugins folder by default: under kubeletRoot, or under the root of a kubelet whose
plugins folder is named (k0s: /var/lib/k0s/kubelet/pod-resources). */}}
{{- define "gpu-dra.podResourcesDir" -}}
{{- $p := .Values.kubeletPlugin -}}
{{- if dig "podResources" "enabled" true $p -}}
{{- dig "podResources" "directoryPath" "" $p | default (printf "%s/pod-resources" (dir (include "gpu-dra.pluginsDir" .))) | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-dra.webhookName" -}}
{{- printf "%s-webhook" (include "gpu-dra.fullname" .) -}}
{{- end -}}

{{/* The webhook's service account: NVIDIA's webhook.serviceAccount.name when set, else
<fullname>-webhook; with NVIDIA's webhook.serviceAccount.create false it is not created (and
"default" when no name is given, as in NVIDIA's chart). */}}
{{- define "gpu-dra.webhookServiceAccount" -}}
{{- $sa := .Values.webhook.serviceAccount | default dict -}}
{{- if include "gpu-dra.createWebhookServiceAccount" . -}}
{{- $sa.name | default (include "gpu-dra.webhookName" .) -}}
{{- else -}}
{{- $sa.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-dra.createWebhookServiceAccount" -}}
{{- if dig "create" true (.Values.webhook.serviceAccount | default dict) -}}
true
{{- end -}}
{{- end -}}

{{- define "gpu-dra.webhookSecret" -}}
{{- if eq .Values.webhook.tls.mode "secret" -}}
{{- .Values.webhook.tls.secret.name -}}
{{- else -}}
{{- printf "%s-tls" (include "gpu-dra.webhookName" .) -}}
{{- end -}}
{{- end -}}

{{/* The most pods per node a node plugin may create, when the webhook counts them (plugin,
its node restriction and the webhook on, kubeletPlugin.nodeRestriction.maxPodsPerNode > 0);
"" otherwise. */}}
{{- define "gpu-dra.podLimit" -}}
{{- $r := .Values.kubeletPlugin.nodeRestriction -}}
{{- if and (include "gpu-dra.pluginEnabled" .) $r.enabled .Values.webhook.enabled (gt (int ($r.maxPodsPerNode | default 0)) 0) -}}
{{ int $r.maxPodsPerNode }}
{{- end -}}
{{- end -}}

{{/* The user name the API server gives the node plugin's pods (their service account). */}}
{{- define "gpu-dra.pluginUserName" -}}
{{- printf "system:serviceaccount:%s:%s" (include "gpu-dra.namespace" .) (include "gpu-dra.pluginServiceAccount" .) -}}
{{- end -}}

{{/* Non-empty when the value holds anything: a scalar that is not empty, false or zero, or a
map or list holding one (NVIDIA's default `containers.init: {securityContext: {}}` holds
nothing). */}}
{{- define "gpu-dra.holdsValue" -}}
{{- if kindIs "map" . -}}
{{- range $_, $v := . }}{{ include "gpu-dra.holdsValue" $v }}{{ end -}}
{{- else if kindIs "slice" . -}}
{{- range . }}{{ include "gpu-dra.holdsValue" . }}{{ end -}}
{{- else if . -}}
true
{{- end -}}
{{- end -}}

{{/*
The Kubernetes feature gates the driver's values need: per gate the minor release (1.x) in
which it first exists (alpha) and from which it is on by default (onByDefault: 0 when it is off by
default in every release up to 1.37). Source: the versioned defaults of
pkg/features/kube_features.go (Kubernetes 1.37.1); the table per release, with links, is in
docs/kubernetes-versions.md. `gpu-dra check` keeps the same table
(crates/core/src/feature_gates.rs); a repository test keeps the two equal.
*/}}
{{- define "gpu-dra.clusterGates" -}}
DRAConsumableCapacity: {alpha: 34, onByDefault: 36}
DRAPartitionableDevices: {alpha: 33, onByDefault: 36}
DRADeviceTaints: {alpha: 33, onByDefault: 36}
ResourceHealthStatus: {alpha: 31, onByDefault: 36}
DRADeviceBindingConditions: {alpha: 34, onByDefault: 36}
DRAListTypeAttributes: {alpha: 36, onByDefault: 0}
{{- end -}}

{{/* The cluster's minor version (1.x): .Capabilities.KubeVersion, the API server's on install
and upgrade, --kube-version for `helm template`. "35+" (GKE, EKS) reads as 35. */}}
{{- define "gpu-dra.kubeMinor" -}}
{{- regexReplaceAll "[^0-9].*$" (toString .Capabilities.KubeVersion.Minor) "" | default "0" -}}
{{- end -}}

{{/* "true" when `gate` (call with (list $ "<gate>")) is on in the cluster: on by default in
its version, or listed in clusterFeatureGates; "" otherwise. */}}
{{- define "gpu-dra.gateOn" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $g := get (fromYaml (include "gpu-dra.clusterGates" $root)) $name -}}
{{- $minor := int (include "gpu-dra.kubeMinor" $root) -}}
{{- if or (has $name ($root.Values.clusterFeatureGates | default list)) (and (gt (int $g.onByDefault) 0) (ge $minor (int $g.onByDefault))) -}}
true
{{- end -}}
{{- end -}}
