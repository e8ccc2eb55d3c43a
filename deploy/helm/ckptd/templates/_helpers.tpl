{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "ckptd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name; the release name alone when it already contains the chart name. */}}
{{- define "ckptd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ckptd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ckptd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of the daemon pods (kept free of chart version labels, so a chart bump alone does not restart daemons). */}}
{{- define "ckptd.podLabels" -}}
{{ include "ckptd.selectorLabels" . }}
app.kubernetes.io/component: daemon
{{- end -}}

{{- define "ckptd.labels" -}}
{{ include "ckptd.podLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ckptd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "ckptd.socketPath" -}}
{{ .Values.socket.hostPath }}/{{ .Values.socket.name }}
{{- end -}}

{{/* Memory request and limit: staging budget + overhead (staging pages are charged to the daemon's cgroup). */}}
{{- define "ckptd.memory" -}}
{{ add (mul (int .Values.staging.sizeGiB) 1024) (int .Values.staging.overheadMiB) }}Mi
{{- end -}}

{{- define "ckptd.s3SecretName" -}}
{{- .Values.storage.s3.existingSecret | default (printf "%s-s3-credentials" (include "ckptd.fullname" .)) -}}
{{- end -}}
