{{/* Full name of the release's objects. */}}
{{- define "disagg.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "disagg.labels" -}}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: disagg
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The PriorityClass every deployment's router and managed Redis run under ("" for none). */}}
{{- define "disagg.servingPriorityClass" -}}
{{- if .Values.servingPriorityClass.create -}}
{{- default (printf "%s-serving" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-") .Values.servingPriorityClass.name -}}
{{- else -}}
{{- .Values.servingPriorityClass.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace the operator serves when not cluster-wide. */}}
{{- define "disagg.watchNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}

{{/* Exactly the calls the operator makes (tests/operator/test_operator_rbac.py derives them from
the code and fails on any rule beyond them): children are applied (patch, and create: an apply that
creates an object is authorized as create), watched and read once when not yet seen (get, list,
watch); only kinds that can leave the desired set are deleted (pruning). Secrets and Jobs are create-only: the operator never reads a
Secret. The same rules namespaced (Role) or cluster-wide (ClusterRole). */}}
{{- define "disagg.workloadRules" -}}
- apiGroups: [disagg.dev]
  resources: [inferencedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [disagg.dev]
  resources: [inferencedeployments/status]
  verbs: [patch]
# Children carry blockOwnerDeletion owner references: the OwnerReferencesPermissionEnforcement
# admission plugin, where enabled, checks this right on the owner.
- apiGroups: [disagg.dev]
  resources: [inferencedeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
# A role whose ranks span nodes runs as a LeaderWorkerSet (when the cluster serves the API).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [secrets, events]
  verbs: [create]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [create]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
{{- end -}}

{{/* What kopf needs cluster-wide whatever it serves: it discovers resources by watching CRDs, and
a namespaced kopf lists and watches the namespaces it serves. */}}
{{- define "disagg.discoveryRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if not .Values.clusterWide }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end -}}
