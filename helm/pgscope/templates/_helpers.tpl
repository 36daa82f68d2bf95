{{- define "pgscope.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pgscope.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pgscope.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pgscope.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pgscope.labels" -}}
{{ include "pgscope.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pgscope.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pgscope.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding Pyroscope credentials: the user's, or the one rendered from values. */}}
{{- define "pgscope.secretName" -}}
{{- if .Values.pyroscope.existingSecret -}}
{{- .Values.pyroscope.existingSecret -}}
{{- else -}}
{{- include "pgscope.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pgscope.hasSecret" -}}
{{- if or .Values.pyroscope.existingSecret .Values.pyroscope.basicAuth.username .Values.pyroscope.bearerToken .Values.pyroscope.tenantId -}}true{{- end -}}
{{- end -}}

{{/* A TOML filter table: { data_dir = "...", port = N, binary = "..." } */}}
{{- define "pgscope.filter" -}}
{ {{- $first := true -}}
{{- range $key := list "data_dir" "port" "binary" -}}
{{- $value := index $ $key -}}
{{- if $value -}}
{{- if not $first }}, {{ else }} {{ end -}}
{{- if eq $key "port" -}}{{ $key }} = {{ $value }}{{- else -}}{{ $key }} = {{ $value | toString | quote }}{{- end -}}
{{- $first = false -}}
{{- end -}}
{{- end }} }
{{- end -}}
