{{- /* The namespaced permissions of the operator (see rbac.yaml). */ -}}
{{- define "kvpool.namespacedRules" -}}
# The pools: kopf watches them, patches its finalizer and annotations, and writes status.
- apiGroups: [kvpool.dev]
  resources: [kvcachepools]
  verbs: [list, watch, patch]
- apiGroups: [kvpool.dev]
  resources: [kvcachepools/status]
  verbs: [patch]
# Pods: counted for status; their sidecars' /stats are scraped by pod IP.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# What a pool owns: the connector ConfigMap, its generated Secrets (created, never read: no get, list
# or watch on any Secret), the shared tier's Service and StatefulSet. The webhook also gets the
# ConfigMap a pod's vLLM --config file comes from, to see whether it sets a connector.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, create, patch]
# The webhook checks that a pod still fits its namespace's LimitRanges and ResourceQuotas with the
# sidecar (the API server refuses it otherwise).
- apiGroups: [""]
  resources: [limitranges, resourcequotas]
  verbs: [list]
# Events for what changed and what is wrong; the webhook's PodNotInjected events are counted up in
# place (one per pool, reason and owner), so it reads and patches its own.
- apiGroups: [""]
  resources: [events]
  verbs: [get, create, patch]
# The owned objects' ownerReferences set blockOwnerDeletion, which the API server allows only to
# who may update the owner's finalizers.
- apiGroups: [kvpool.dev]
  resources: [kvcachepools/finalizers]
  verbs: [update]
{{- if not .Values.watch.allNamespaces }}
# kopf's peering in each watched namespace.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  resourceNames: [{{ .Values.operator.peering | quote }}]
  verbs: [get, patch]
{{- end }}
{{- end -}}
