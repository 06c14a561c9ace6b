{{/* Names, labels and small values shared by the templates. */}}

{{- define "fp8rl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object name: <release>-fp8rl, or the release when it says fp8rl. */}}
{{- define "fp8rl.fullname" -}}
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

{{- define "fp8rl.controlPlane.name" -}}
{{- printf "%s-api" (include "fp8rl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fp8rl.operator.name" -}}
{{- printf "%s-operator" (include "fp8rl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fp8rl.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "fp8rl.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "fp8rl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "fp8rl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fp8rl
{{- end }}

{{/* Selector labels of one component: include "fp8rl.selector" (list . "api") */}}
{{- define "fp8rl.selector" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "fp8rl.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* An image reference: include "fp8rl.image" (list . .Values.images.operator).
repository@digest when a digest is set (the image that was scanned is the one that runs; a tag
can be pushed again), else repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "fp8rl.image" -}}
{{- $ctx := index . 0 }}
{{- $img := index . 1 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default $ctx.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* The Kubernetes API credentials of a pod that calls the API server (the control plane with
store "kubernetes", the operator). The pods set automountServiceAccountToken: false and mount
this instead: the same files the kubelet's automount would put at the same path (a bound token
it refreshes, the cluster CA, the namespace), but only in the pods that need them. The in-cluster
clients (kubernetes, kopf) re-read the token file, so its rotation needs nothing of them. */}}
{{- define "fp8rl.apiAccessVolume" -}}
- name: kube-api-access
  projected:
    sources:
      - serviceAccountToken: {path: token, expirationSeconds: 3607}  # what the kubelet requests
      - configMap:
          name: kube-root-ca.crt
          items: [{key: ca.crt, path: ca.crt}]
      - downwardAPI:
          items:
            - {path: namespace, fieldRef: {apiVersion: v1, fieldPath: metadata.namespace}}
{{- end }}

{{- define "fp8rl.apiAccessMount" -}}
- {name: kube-api-access, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}
{{- end }}

{{/* Render the monitoring.coreos.com objects? "auto": when the API exists. */}}
{{- define "fp8rl.monitoring" -}}
{{- $on := .Values.monitoring.enabled }}
{{- if eq (toString $on) "auto" }}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- else if eq (toString $on) "true" }}true
{{- else if ne (toString $on) "false" }}
{{- fail (printf "monitoring.enabled must be auto, true or false, not %q" (toString $on)) }}
{{- end }}
{{- end }}

{{/* The tenants' namespaces, as a list. */}}
{{- define "fp8rl.tenantNamespaces" -}}
{{- range .Values.tenants }}
- {{ .name | quote }}
{{- end }}
{{- end }}

{{/* Fail early on values that cannot work, naming the key. */}}
{{- define "fp8rl.validate" -}}
{{- $store := .Values.controlPlane.store }}
{{- if not (has $store (list "kubernetes" "sql")) }}
{{- fail (printf "controlPlane.store must be \"kubernetes\" or \"sql\", not %q" $store) }}
{{- end }}
{{- if and (eq $store "sql") (gt (int .Values.controlPlane.replicas) 1) }}
{{- fail "controlPlane.replicas must be 1 with controlPlane.store=sql (one SQLite file); use store=kubernetes to scale" }}
{{- end }}
{{- if and .Values.controlPlane.enabled (not .Values.tenants) }}
{{- fail "tenants: list at least one tenant (a namespace), e.g. [{name: team-a, createNamespace: true}]" }}
{{- end }}
{{- range .Values.tenants }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" (toString .name)) }}
{{- fail (printf "tenants: %q is not a DNS label (a-z, 0-9, '-', at most 63 characters)" (toString .name)) }}
{{- end }}
{{- end }}
{{- range $name := list "controlPlane" "operator" "worker" }}
{{- $digest := (index $.Values.images $name).digest | default "" | toString }}
{{- if and $digest (not (regexMatch "^sha256:[a-f0-9]{64}$" $digest)) }}
{{- fail (printf "images.%s.digest must be sha256: and 64 lowercase hex digits (docker buildx imagetools inspect <image> prints it), not %q" $name $digest) }}
{{- end }}
{{- if regexMatch "^sha256:0{64}$" $digest }}
{{- fail (printf "images.%s.digest is the all-zero placeholder: build and push the image (docker/README.md), then set the digest `docker buildx imagetools inspect <image>` prints, or leave it empty to pull by tag" $name) }}
{{- end }}
{{- end }}
{{- if not (has .Values.images.pullPolicy (list "Always" "IfNotPresent" "Never")) }}
{{- fail (printf "images.pullPolicy must be Always, IfNotPresent or Never, not %q" (toString .Values.images.pullPolicy)) }}
{{- end }}
{{- range $token, $tenant := .Values.auth.tokens }}
{{- if lt (len $token) 16 }}
{{- fail (printf "auth.tokens: a token of tenant %q is shorter than 16 characters" $tenant) }}
{{- end }}
{{- end }}
{{- end }}
