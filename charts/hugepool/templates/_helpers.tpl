{{/* Chart name, truncated to a DNS label. */}}
{{- define "hugepool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the release name when it already contains the chart name
(`helm install hugepool ...` gives `hugepool`), else release-chart.
Truncated so the longest suffix (-operator) still fits in 63 characters.
*/}}
{{- define "hugepool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hugepool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "hugepool.labels" -}}
helm.sh/chart: {{ include "hugepool.chart" . }}
app.kubernetes.io/name: {{ include "hugepool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hugepool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "operator"). */}}
{{- define "hugepool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hugepool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of one component's objects. */}}
{{- define "hugepool.componentLabels" -}}
{{ include "hugepool.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "hugepool.operator.fullname" -}}
{{- printf "%s-operator" (include "hugepool.fullname" .) }}
{{- end }}

{{- define "hugepool.agent.fullname" -}}
{{- printf "%s-agent" (include "hugepool.fullname" .) }}
{{- end }}

{{- define "hugepool.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "hugepool.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hugepool.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "hugepool.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "hugepool.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* KUBERNETES_SERVICE_HOST/PORT when apiServer.host is set: the in-cluster
client config reads them, and explicit env wins over the kubelet's. */}}
{{- define "hugepool.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | quote }}
{{- end }}
{{- end }}

{{/*
An alert's runbook: (list $ "AlertName") -> <runbookBaseUrl>#alertname, the
anchor of the heading named after the alert in docs/runbooks.md.
*/}}
{{- define "hugepool.runbookUrl" -}}
{{- $root := index . 0 -}}
{{- printf "%s#%s" (trimSuffix "/" $root.Values.monitoring.prometheusRule.runbookBaseUrl) (lower (index . 1)) -}}
{{- end }}

{{/*
The agents' nodeSelector as key=value,... (keys sorted): the operator gives
each of those Nodes a HugePageNode before a pool selects it, so that its
agent reports what a grow can get there.
*/}}
{{- define "hugepool.agentNodeLabels" -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.agent.nodeSelector -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
