{{/* Chart name, at most 63 characters. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: "<release>-tandem", or the release name when it already
contains the chart name. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the release. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "operator"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Tandem image reference: repository@digest, else repository:tag (appVersion by default). */}}
{{- define "tandem.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The control image (operator and routers, no torch): controlImage, else the Tandem image. */}}
{{- define "tandem.controlImage" -}}
{{- with .Values.controlImage }}
{{- if and .repository .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else if .repository }}
{{- printf "%s:%s" .repository (default $.Chart.AppVersion .tag) }}
{{- else }}
{{- include "tandem.image" $ }}
{{- end }}
{{- end }}
{{- end }}

{{/* The CPU pools' image: workerImage (repository and tag default to image's), else the Tandem image. */}}
{{- define "tandem.workerImage" -}}
{{- $w := .Values.workerImage | default dict }}
{{- $repo := default .Values.image.repository $w.repository }}
{{- if $w.digest }}
{{- printf "%s@%s" $repo $w.digest }}
{{- else if or $w.repository $w.tag }}
{{- printf "%s:%s" $repo (default (default .Chart.AppVersion .Values.image.tag) $w.tag) }}
{{- else }}
{{- include "tandem.image" . }}
{{- end }}
{{- end }}

{{/* The GPU pools' image (the Dockerfile's worker-cuda target): workerImage.cudaDigest, else repository:cudaTag, by default the CPU tag + "-cu128". */}}
{{- define "tandem.workerCudaImage" -}}
{{- $w := .Values.workerImage | default dict }}
{{- $repo := default .Values.image.repository $w.repository }}
{{- if $w.cudaDigest }}
{{- printf "%s@%s" $repo $w.cudaDigest }}
{{- else }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) $w.tag }}
{{- printf "%s:%s" $repo (default (printf "%s-cu128" $tag) $w.cudaTag) }}
{{- end }}
{{- end }}

{{- define "tandem.redisName" -}}
{{- printf "%s-redis" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The routers' Redis URL (the Service's cluster DNS name: routers run in other namespaces). */}}
{{- define "tandem.redisURL" -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "tandem.redisName" .) .Release.Namespace (int .Values.redis.port) }}
{{- end }}
