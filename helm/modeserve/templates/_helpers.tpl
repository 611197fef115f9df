{{/* Full name of the release's objects. */}}
{{- define "modeserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "modeserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "modeserve.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "modeserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "modeserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "modeserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* ServiceAccount the routers run as, in each watched namespace (the operator names it in their pods). */}}
{{- define "modeserve.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create -}}
{{- default (printf "%s-router" (include "modeserve.fullname" .)) .Values.router.serviceAccount.name -}}
{{- else -}}
{{- required "router.serviceAccount.name: the routers' existing ServiceAccount (router.serviceAccount.create is false)" .Values.router.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the operator watches and gets rights in. */}}
{{- define "modeserve.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- join "," .Values.operator.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Restricted pod security, shared by every modeserve container. */}}
{{- define "modeserve.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The TLS Secret (tls.crt, tls.key, ca.crt): the one given, or the chart's Certificate's. */}}
{{- define "modeserve.tlsSecretName" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "modeserve.fullname" .) -}}
{{- else -}}
{{- fail "tls.enabled: give tls.secretName (an existing Secret) or turn tls.certManager.enabled on" -}}
{{- end -}}
{{- end -}}
