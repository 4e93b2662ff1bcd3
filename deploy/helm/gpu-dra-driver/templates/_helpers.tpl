{{/* Common names and labels. */}}

{{- define "gpu-dra.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-dra.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpu-dra.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "gpu-dra.pluginServiceAccount" -}}
{{- .Values.kubeletPlugin.serviceAccount.name | default (printf "%s-kubelet-plugin" (include "gpu-dra.fullname" .)) -}}
{{- end -}}

{{/* MPS control daemon pods run as this account: no RBAC, its token never mounted. */}}
{{- define "gpu-dra.mpsDaemonServiceAccount" -}}
{{- printf "%s-mps-daemon" (include "gpu-dra.fullname" .) -}}
{{- end -}}

{{/* The plugin folder on the host (PLUGIN_DIR); MPS daemon folders are under <it>/mps. */}}
{{- define "gpu-dra.pluginDir" -}}
{{- printf "%s/plugins/%s" .Values.kubeletPlugin.kubeletRoot .Values.driverName -}}
{{- end -}}

{{- define "gpu-dra.webhookName" -}}
{{- printf "%s-webhook" (include "gpu-dra.fullname" .) -}}
{{- end -}}

{{- define "gpu-dra.webhookSecret" -}}
{{- if eq .Values.webhook.tls.mode "secret" -}}
{{- .Values.webhook.tls.secret.name -}}
{{- else -}}
{{- printf "%s-tls" (include "gpu-dra.webhookName" .) -}}
{{- end -}}
{{- end -}}

{{/* The user name the API server gives the node plugin's pods (their service account). */}}
{{- define "gpu-dra.pluginUserName" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpu-dra.pluginServiceAccount" .) -}}
{{- end -}}
