{{/* The operator's namespaces and the checks of its values. */}}

{{/* The namespaces the operator watches, as a JSON list: operator.watchNamespaces, else the
tenants' namespaces; [] with operator.clusterWide (it watches every namespace). Read it with
include "fp8rl.operator.namespaces" . | fromJsonArray */}}
{{- define "fp8rl.operator.namespaces" -}}
{{- $ns := list }}
{{- if not .Values.operator.clusterWide }}
{{- $ns = .Values.operator.watchNamespaces | default list }}
{{- if not $ns }}
{{- range .Values.tenants }}
{{- $ns = append $ns .name }}
{{- end }}
{{- end }}
{{- end }}
{{- $ns | uniq | toJson }}
{{- end }}

{{/* Fail early on operator values that cannot work or would grant more than asked, naming the key. */}}
{{- define "fp8rl.operator.validate" -}}
{{- $op := .Values.operator }}
{{- if and (not $op.clusterWide) (not (include "fp8rl.operator.namespaces" . | fromJsonArray)) }}
{{- fail "operator.watchNamespaces: list the namespaces the operator watches (or list tenants), or set operator.clusterWide: true to let it write RayJobs, ConfigMaps and NetworkPolicies in every namespace" }}
{{- end }}
{{- range $op.watchNamespaces }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" (toString .)) }}
{{- fail (printf "operator.watchNamespaces: %q is not a namespace name (a DNS label)" (toString .)) }}
{{- end }}
{{- end }}
{{- if not (has .Values.jobDefaults.rayAuth (list "kuberay" "secret")) }}
{{- fail (printf "jobDefaults.rayAuth must be \"kuberay\" (KubeRay >= 1.5.1) or \"secret\" (older KubeRay), not %q" (toString .Values.jobDefaults.rayAuth)) }}
{{- end }}
{{- if .Values.networkPolicy.enabled }}
{{- range $key := list "metricsFrom" "dashboardFrom" }}
{{- range (index $.Values.networkPolicy.jobs $key | default list) }}
{{- if not .namespaceSelector }}
{{- fail (printf "networkPolicy.jobs.%s: give each peer a namespaceSelector naming its namespace (e.g. {matchLabels: {kubernetes.io/metadata.name: monitoring}}); an empty one admits pods of every namespace" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
