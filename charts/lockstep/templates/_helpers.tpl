{{/* Labels of every object (manifests/ carries the first two; helm adds its own). */}}
{{- define "lockstep.labels" -}}
app.kubernetes.io/name: {{ .Values.name }}
app.kubernetes.io/part-of: lockstep
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "lockstep.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "lockstep.jobImage" -}}
{{ .root.Values.jobImages.registry }}/lockstep-{{ .name }}:{{ .root.Values.jobImages.tag | default .root.Chart.AppVersion }}
{{- end -}}

{{/*
The operator's rights in the namespaces it reconciles: exactly the verbs its reconciles and kopf use
(e2e/test_operator_manifests.py runs the operator with them). A cluster-wide install grants them in a
ClusterRole, a namespaced one in a Role per watched namespace.
*/}}
{{- define "lockstep.namespacedRules" -}}
# Our kinds: watched (kopf), server-side applied and created (reconciles), status written.
- apiGroups: [rl.lockstep.dev]
  resources: [rljobs, rolloutpools, trainergroups, weightchannels]
  verbs: [get, list, watch, create, patch]
- apiGroups: [rl.lockstep.dev]
  resources: [rljobs/status, rolloutpools/status, trainergroups/status, weightchannels/status]
  verbs: [patch]
# Pods of the jobs (engines, ranks, driver): watched (by label, on the server), created, replaced.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The engines' readiness gate (condition rl.lockstep.dev/weights-current on pods/status).
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
# The progress ConfigMaps are watched (by label) and read; the job's ConfigMaps applied.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
# Applied, never read: Services, the driver's and ranks' ServiceAccounts, the NetworkPolicies of
# the ranks (only the driver reaches rank 0's control port), engines and driver.
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
# Each job's API-key Secret: created once, never read, listed or watched (the pods mount it).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The driver's and ranks' narrow Roles and bindings (the operator holds what they grant, so it may
# grant them without the escalate or bind verbs).
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch]
# Jobs with spec.agent.sandbox (kubernetes-sigs/agent-sandbox, docs/sandbox.md): the job's
# SandboxTemplate and SandboxWarmPool (server-side applied: create and patch; never read, listed or
# deleted: owner references delete them with the job), and exactly what the driver's claim Role
# grants (the operator may only grant what it holds; lockstep_operator.resources.sandbox.CLAIM_RULES,
# kept equal by operator/tests/test_sandbox_rbac.py).
- apiGroups: [extensions.agents.x-k8s.io]
  resources: [sandboxtemplates, sandboxwarmpools]
  verbs: [create, patch]
- apiGroups: [extensions.agents.x-k8s.io]
  resources: [sandboxclaims]
  verbs: [create, get, list, watch, delete]
- apiGroups: [""]
  resources: [pods/exec]
  verbs: [create, get]
# Agent jobs: the driver's session server lists the pool's router EndpointSlices to keep each
# session on one live engine (resources.config.SESSION_ROUTING_RULE; the operator may only grant
# what it holds).
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list]
# Gang scheduling objects (only used when that scheduler is installed and chosen).
- apiGroups: [scheduling.volcano.sh, scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [create, patch]
# Events: the operator's (a repeat raises the count of the first: patch) and kopf's.
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/* Placement and topology: node labels and allocatable resources (read, never watched). */}}
{{- define "lockstep.nodeRule" -}}
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list]
{{- end -}}
