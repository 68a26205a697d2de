{{/*
Names, labels and selectors shared by every template. All helpers are prefixed with the chart
name so that they cannot collide with a parent chart's.
*/}}

{{/* Chart name, overridable. */}}
{{- define "kunlun-inference.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified prefix: release + chart name, unless the release already contains it. */}}
{{- define "kunlun-inference.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Component names. */}}
{{- define "kunlun-inference.operator.fullname" -}}
{{- printf "%s-operator" (include "kunlun-inference.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "kunlun-inference.devicePlugin.fullname" -}}
{{- printf "%s-device-plugin" (include "kunlun-inference.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "kunlun-inference.webhook.fullname" -}}
{{- printf "%s-webhook" (include "kunlun-inference.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "kunlun-inference.compatibility.fullname" -}}
{{- printf "%s-compatibility" (include "kunlun-inference.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* ServiceAccount of the operator. */}}
{{- define "kunlun-inference.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "kunlun-inference.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Common labels on every object. */}}
{{- define "kunlun-inference.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kunlun-inference.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kunlun-inference
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "operator"). */}}
{{- define "kunlun-inference.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kunlun-inference.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Full labels of one component: common labels + component. */}}
{{- define "kunlun-inference.componentLabels" -}}
{{ include "kunlun-inference.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image reference: call with (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "kunlun-inference.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- printf "%s/%s:%s" .ctx.Values.global.imageRegistry .image.repository $tag -}}
{{- end -}}

{{/* Image pull secrets block for a pod spec. */}}
{{- define "kunlun-inference.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Labels of monitoring objects: component labels + monitoring.labels. */}}
{{- define "kunlun-inference.monitoringLabels" -}}
{{ include "kunlun-inference.componentLabels" . }}
{{- with .ctx.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Restricted-profile container security context shared by operator containers. */}}
{{- define "kunlun-inference.restrictedSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* URL path of the operator's validating webhook handler (kopf serves one path per handler id). */}}
{{- define "kunlun-inference.webhook.path" -}}
/validate-kis
{{- end -}}

{{/* Command-line arguments of the operator container (flags documented in docs/operator.md). */}}
{{- define "kunlun-inference.operator.args" -}}
- run
- --peering={{ .Values.operator.peering.name }}
- --liveness=http://0.0.0.0:{{ .Values.operator.health.port }}/healthz
- --metrics-port={{ .Values.operator.metrics.port }}
- --log-level={{ .Values.operator.logLevel }}
- --xpu-health-gate-grace-seconds={{ .Values.operator.xpuHealthGateGraceSeconds }}
{{- if .Values.operator.watchNamespaces }}
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if .Values.compatibility.enabled }}
- --compatibility-configmap={{ .Release.Namespace }}/{{ include "kunlun-inference.compatibility.fullname" . }}
{{- end }}
- --default-runtime-image={{ include "kunlun-inference.image" (dict "ctx" . "image" .Values.runtime.image) }}
{{- if not .Values.leaderWorkerSet.installed }}
- --no-leaderworkerset
{{- end }}
{{- if include "kunlun-inference.dra.enabled" . }}
- --dra
{{- end }}
{{- if .Values.routing.enabled }}
- --endpoint-picker-image={{ include "kunlun-inference.routing.image" .Values.routing.picker.image }}
- --precise-endpoint-picker-image={{ include "kunlun-inference.routing.image" .Values.routing.precisePicker.image }}
- --precise-tokenizer-image={{ include "kunlun-inference.routing.image" .Values.routing.precisePicker.tokenizerImage }}
{{- else }}
- --no-inference-pool
{{- end }}
{{- $preflight := .Values.runtime.preflight | default dict }}
{{- if (ne $preflight.hostMounts false) }}
- --preflight-kml-version-file={{ $preflight.kmlVersionFile | default (printf "%s/kml/VERSION" (trimSuffix "/" .Values.devicePlugin.hostPaths.kunlunHome)) }}
{{- with ($preflight.xpuSmi | default .Values.devicePlugin.hostPaths.xpuSmi) }}
- --preflight-xpu-smi={{ . }}
{{- end }}
{{- else }}
- --preflight-kml-version-file=
{{- end }}
- --admission-policy=/etc/kunlun-operator/policy/policy.yaml
{{- if .Values.operator.webhook.enabled }}
- --webhook-port={{ .Values.operator.webhook.port }}
- --webhook-cert-dir=/etc/kunlun-operator/webhook
{{- else }}
- --webhook-port=0
{{- end }}
{{- with .Values.operator.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* An Endpoint Picker image reference: call with .Values.routing.picker.image (registry/repository:tag). */}}
{{- define "kunlun-inference.routing.image" -}}
{{- printf "%s/%s:%s" .registry .repository .tag -}}
{{- end -}}

{{/*
The operator's rules for routed services (routing.enabled; docs/chart.md#prefix-aware-routing): the
InferencePools, HTTPRoutes and Endpoint Pickers it owns, and the rights it grants each picker's Role,
which Kubernetes lets only whoever holds them grant (rules marked `grant` in api_calls.yaml).
*/}}
{{- define "kunlun-inference.operator.routingRules" -}}
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{/*
The operator's ClusterRole rules: one rule per row of the API-call table in docs/operator.md
(machine-readable: kunlun_operator/api_calls.yaml); tests/chart/test_rbac.py keeps them equal.
*/}}
{{- define "kunlun-inference.operator.rules" -}}
- apiGroups: ["serving.kunlun.dev"]
  resources: ["kunluninferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.kunlun.dev"]
  resources: ["kunluninferenceservices/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "prometheusrules"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- /* kopf peers through ClusterKopfPeering when it serves every namespace, and through
KopfPeering objects in the served namespaces otherwise (peering.yaml renders the matching one). */}}
- apiGroups: ["kopf.dev"]
  resources: [{{ if .Values.operator.watchNamespaces }}"kopfpeerings"{{ else }}"clusterkopfpeerings"{{ end }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}

{{/* The node snapshot the plugin writes each round and the unprivileged labeler and exporter read
(an emptyDir shared by the DaemonSet's containers; docs/device-plugin.md). */}}
{{- define "kunlun-inference.devicePlugin.snapshotFile" -}}
/run/kunlun-snapshot/node.json
{{- end -}}

{{/* "true" when this container runs xpu-smi itself (the plugin and the DRA plugin always; the
labeler and the exporter with devicePlugin.<name>.privileged, or in a pool whose allocation is dra,
where no classic plugin writes the node snapshot), else "" (it reads the plugin's node snapshot).
Called with (dict "ctx" $ "command" NAME "allocation" devicePlugin|dra|both). */}}
{{- define "kunlun-inference.devicePlugin.readsHardware" -}}
{{- if or (has .command (list "plugin" "dra")) (index .ctx.Values.devicePlugin .command).privileged (eq (.allocation | default "devicePlugin") "dra") }}true{{ end -}}
{{- end -}}

{{/* "true" when any node pool (devicePlugin.allocation, devicePlugin.nodePools) hands out cards
through DRA: the DeviceClass, the DRA plugin's rights and the operator's --dra follow it. */}}
{{- define "kunlun-inference.dra.enabled" -}}
{{- $all := append (values .Values.devicePlugin.nodePools) .Values.devicePlugin.allocation -}}
{{- if or (has "dra" $all) (has "both" $all) }}true{{ end -}}
{{- end -}}

{{/* The containers of the device-plugin DaemonSet of a pool with allocation .allocation. */}}
{{- define "kunlun-inference.devicePlugin.containers" -}}
{{- $v := .ctx.Values.devicePlugin -}}
{{- $containers := list -}}
{{- if ne .allocation "dra" }}{{ $containers = append $containers "plugin" }}{{ end -}}
{{- if ne .allocation "devicePlugin" }}{{ $containers = append $containers "dra" }}{{ end -}}
{{- if $v.labeler.enabled }}{{ $containers = append $containers "labeler" }}{{ end -}}
{{- if $v.exporter.enabled }}{{ $containers = append $containers "exporter" }}{{ end -}}
{{- join " " $containers -}}
{{- end -}}

{{/* The DaemonSet affinity of one pool: devicePlugin.affinity with, where pools are defined, the
pool's own nodes (In) or, for the default DaemonSet, every node of no pool (NotIn) ANDed into each
required node-selector term. Call with (dict "ctx" $ "pool" NAME) ("" for the default). */}}
{{- define "kunlun-inference.devicePlugin.affinity" -}}
{{- $v := .ctx.Values.devicePlugin -}}
{{- $affinity := deepCopy ($v.affinity | default dict) -}}
{{- if $v.nodePools -}}
{{- $expr := dict "key" $v.nodePoolLabel "operator" "NotIn" "values" (keys $v.nodePools | sortAlpha) -}}
{{- if .pool }}{{ $expr = dict "key" $v.nodePoolLabel "operator" "In" "values" (list .pool) }}{{ end -}}
{{- $node := $affinity.nodeAffinity | default dict -}}
{{- $required := $node.requiredDuringSchedulingIgnoredDuringExecution | default dict -}}
{{- $terms := list -}}
{{- range ($required.nodeSelectorTerms | default (list dict)) -}}
{{- $terms = append $terms (merge (dict "matchExpressions" (append (.matchExpressions | default list) $expr)) .) -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- if $affinity }}{{ toYaml $affinity }}{{ end -}}
{{- end -}}

{{/* Arguments of one device-plugin container: (dict "ctx" $ "command" "plugin|labeler|exporter"). Flags: docs/device-plugin.md. */}}
{{- define "kunlun-inference.devicePlugin.args" -}}
{{- $v := .ctx.Values.devicePlugin -}}
- {{ .command }}
{{- if include "kunlun-inference.devicePlugin.readsHardware" . }}
- --xpu-smi={{ $v.xpuSmi }}
- --dev-root=/host
{{- else }}
- --source=snapshot:{{ include "kunlun-inference.devicePlugin.snapshotFile" . }}
{{- end }}
- --log-level={{ $v.logLevel }}
{{- if ne .command "labeler" }}
- --health-interval={{ $v.health.intervalSeconds }}
- --recovery-seconds={{ $v.health.recoverySeconds }}
- --temperature-warn-celsius={{ $v.health.temperatureWarnCelsius }}
- --temperature-critical-celsius={{ $v.health.temperatureCriticalCelsius }}
{{- end }}
{{- if eq .command "dra" }}
{{- /* the host's paths: kubelet dials the endpoint GetInfo names, a path the plugin builds from these */}}
- --plugins-dir={{ trimSuffix "/" $v.hostPaths.kubeletPlugins }}
- --registry-dir={{ trimSuffix "/" $v.hostPaths.kubeletPluginsRegistry }}
- --cdi-dir=/var/run/cdi
{{- else if eq .command "plugin" }}
- --kubelet-dir=/var/lib/kubelet/device-plugins
- --snapshot-file={{ include "kunlun-inference.devicePlugin.snapshotFile" . }}
{{- if $v.faults.enabled }}
- --respond-to-faults
- --pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock
- --quarantine-failures={{ $v.faults.quarantineFailures }}
- --quarantine-window-seconds={{ $v.faults.quarantineWindowSeconds }}
- --node-sync-seconds={{ $v.faults.nodeSyncSeconds }}
- --quarantine-file=/run/kunlun/quarantine.json
- --state-file=/var/lib/kunlun-device-plugin/state.json
{{- if $v.faults.taintWhenAllUnhealthy }}
- --taint-when-all-unhealthy
{{- end }}
{{- end }}
{{- else if eq .command "labeler" }}
- --interval={{ $v.labeler.intervalSeconds }}
{{- else if eq .command "exporter" }}
- --port={{ $v.exporter.port }}
- --pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock
{{- if and $v.faults.enabled (ne (.allocation | default "devicePlugin") "dra") }}
- --quarantine-file=/run/kunlun/quarantine.json
{{- end }}
{{- end }}
{{- end -}}

{{/* Volume mounts of one device-plugin container (host paths: docs/device-plugin.md). Only a
container that runs xpu-smi mounts the host's /dev, /sys and Kunlun home; the others mount the
node snapshot, read-only. */}}
{{- define "kunlun-inference.devicePlugin.mounts" -}}
{{- if include "kunlun-inference.devicePlugin.readsHardware" . }}
{{- if has .command (list "plugin" "dra") }}
- {name: host-dev, mountPath: /host/dev}
{{- else }}
- {name: host-dev, mountPath: /host/dev, readOnly: true}
{{- end }}
- {name: host-sys, mountPath: /host/sys, readOnly: true}
- {name: kunlun-home, mountPath: /host/usr/local/xpu, readOnly: true}
{{- if .ctx.Values.devicePlugin.hostPaths.xpuSmi }}
- {name: xpu-smi, mountPath: {{ .ctx.Values.devicePlugin.xpuSmi }}, readOnly: true}
{{- end }}
{{- end }}
{{- if eq .command "plugin" }}
- {name: node-snapshot, mountPath: /run/kunlun-snapshot}
{{- else if not (include "kunlun-inference.devicePlugin.readsHardware" .) }}
- {name: node-snapshot, mountPath: /run/kunlun-snapshot, readOnly: true}
{{- end }}
{{- if eq .command "plugin" }}
- {name: device-plugins, mountPath: /var/lib/kubelet/device-plugins}
{{- if .ctx.Values.devicePlugin.faults.enabled }}
- {name: pod-resources, mountPath: /var/lib/kubelet/pod-resources, readOnly: true}
- {name: fault-state, mountPath: /run/kunlun}
- {name: plugin-state, mountPath: /var/lib/kunlun-device-plugin}
{{- end }}
{{- else if eq .command "dra" }}
{{- $hosts := .ctx.Values.devicePlugin.hostPaths }}
{{- /* mounted at the host's own paths (as CSI registrars do): the endpoint the plugin gives kubelet is a host path */}}
- {name: kubelet-plugins-registry, mountPath: {{ trimSuffix "/" $hosts.kubeletPluginsRegistry }}}
- {name: dra-plugin, mountPath: {{ trimSuffix "/" $hosts.kubeletPlugins }}/xpu.kunlun.dev}
- {name: cdi, mountPath: /var/run/cdi}
{{- else if eq .command "exporter" }}
- {name: pod-resources, mountPath: /var/lib/kubelet/pod-resources, readOnly: true}
{{- if and .ctx.Values.devicePlugin.faults.enabled (ne (.allocation | default "devicePlugin") "dra") }}
- {name: fault-state, mountPath: /run/kunlun, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Security context of one device-plugin container. Only the plugin is privileged, as GPU device
plugins are: it is the one container that reads the hardware. Its health checks run xpu-smi, which
opens /dev/xpu* and /dev/xpuctrl, and a container that is not privileged cannot open host device
nodes (the device cgroup allows only the devices kubelet hands it); it also writes its socket into
kubelet's root-owned device-plugins directory. Each round it writes the node snapshot, which the
labeler and the exporter read by default: they mount no /dev at all, run with no capabilities, no
privilege escalation, RuntimeDefault seccomp and a read-only root filesystem. The labeler runs as
nobody (65534); the exporter as uid 0 only because kubelet's pod-resources socket is root-owned
(connecting needs write permission on it), and with every capability dropped that root cannot
bypass file permissions. devicePlugin.<labeler|exporter>.privileged: true is the opt-in for the
old way: that container runs xpu-smi itself, privileged, with the host's /dev read-only.
*/}}
{{- define "kunlun-inference.devicePlugin.securityContext" -}}
{{- if include "kunlun-inference.devicePlugin.readsHardware" . -}}
privileged: true
runAsUser: 0
runAsNonRoot: false
readOnlyRootFilesystem: true
{{- else -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
{{- if eq .command "exporter" }}
runAsUser: 0
runAsNonRoot: false
{{- else }}
runAsUser: 65534
runAsGroup: 65534
runAsNonRoot: true
{{- end }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
{{- end -}}

{{/* The admission policy file (the operator's --admission-policy). */}}
{{- define "kunlun-inference.admissionPolicy" -}}
{{- $p := .Values.admissionPolicy -}}
runtimeImages: {{ $p.runtimeImages | toJson }}
modelImages: {{ $p.modelImages | toJson }}
hostPaths: {{ $p.hostPaths | toJson }}
pickerImages: {{ $p.pickerImages | default list | toJson }}
allowFlagOverrides: {{ $p.allowFlagOverrides }}
{{- end -}}

{{/* The device plugin DaemonSet's ClusterRole rules: the labeler's node labels and, with
devicePlugin.faults.enabled, the plugin's pod conditions, Events and the node's quarantine
annotation and taint (docs/device-plugin.md lists each call). */}}
{{- define "kunlun-inference.labeler.rules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "patch"]
{{- if include "kunlun-inference.dra.enabled" . }}
{{- /* the DRA plugin (docs/device-plugin.md "DRA API calls"): its node's ResourceSlice (narrowed to
its own pool by devicePlugin.dra.nodeRestrictionPolicy) and the claims it prepares */}}
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceslices"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get"]
{{- end }}
{{- if .Values.devicePlugin.faults.enabled }}
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
{{- end -}}
