{{/* Names shared by every template. */}}

{{- define "kvpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.webhookServiceName" -}}
{{- printf "%s-webhook" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvpool.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecarImage.repository (default .Chart.AppVersion .Values.sidecarImage.tag) -}}
{{- end -}}

{{/*
The webhook's TLS material, computed once per render so the Secret and the webhook configuration's
caBundle agree. An existing Secret is reused on upgrade, so certificates do not rotate on every
`helm upgrade` (lookup answers nothing under `helm template`, which then generates a fresh set).
*/}}
{{- define "kvpool.webhookTLS" -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "kvpool.webhookSecretName" .) -}}
{{- if and $secret $secret.data (index $secret.data "ca.crt") (index $secret.data "tls.crt") (index $secret.data "tls.key") -}}
caCrt: {{ index $secret.data "ca.crt" }}
tlsCrt: {{ index $secret.data "tls.crt" }}
tlsKey: {{ index $secret.data "tls.key" }}
{{- else -}}
{{- $svc := include "kvpool.webhookServiceName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $days := int .Values.webhook.certValidityDays -}}
{{- $ca := genCA (printf "%s-ca" (include "kvpool.fullname" .)) $days -}}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc $ns) nil $dns $days $ca -}}
caCrt: {{ $ca.Cert | b64enc }}
tlsCrt: {{ $cert.Cert | b64enc }}
tlsKey: {{ $cert.Key | b64enc }}
{{- end -}}
{{- end -}}
