{{/*
Names, labels and the kvmesh.yaml the chart renders. Every object is named
<fullname>-<component>; selectors use name, instance and component.
*/}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "kvmesh.selectorLabels" (list $ "controller") */}}
{{- define "kvmesh.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvmesh.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of one component's objects and pods. */}}
{{- define "kvmesh.componentLabels" -}}
{{ include "kvmesh.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvmesh.workerImage" -}}
{{- printf "%s:%s" .Values.worker.image.repository (default .Chart.AppVersion .Values.worker.image.tag) -}}
{{- end -}}

{{/* In-cluster DNS names and URLs the components use to find each other. */}}
{{- define "kvmesh.controllerUrl" -}}
{{- printf "tcp://%s-controller:%d" (include "kvmesh.fullname" .) (int .Values.controller.ports.zmq) -}}
{{- end -}}

{{- define "kvmesh.cacheserverUrl" -}}
{{- printf "kvmesh://%s-cacheserver:%d" (include "kvmesh.fullname" .) (int .Values.cacheserver.ports.zmq) -}}
{{- end -}}

{{/* The pod's DNS name under a StatefulSet's headless Service: (list $ "decoder" 0) */}}
{{- define "kvmesh.podHost" -}}
{{- $root := index . 0 -}}
{{- $full := include "kvmesh.fullname" $root -}}
{{- printf "%s-%s-%d.%s-%s-headless.%s.svc" $full (index . 1) (int (index . 2)) $full (index . 1) $root.Release.Namespace -}}
{{- end -}}

{{/*
engine.remote.url for the chosen remote.backend ("" = no remote tier). The Redis
password is not part of it: it comes from a Secret, through the environment
(kvmesh.remoteEnv).
*/}}
{{- define "kvmesh.remoteUrl" -}}
{{- $r := .Values.remote -}}
{{- if eq $r.backend "cacheserver" -}}
{{- if not .Values.cacheserver.enabled -}}
{{- fail "remote.backend is cacheserver but cacheserver.enabled is false: enable the cache-server or pick another remote.backend" -}}
{{- end -}}
{{- include "kvmesh.cacheserverUrl" . -}}
{{- else if or (eq $r.backend "redis") (eq $r.backend "redis-cluster") -}}
{{- if not $r.redis.hosts -}}
{{- fail (printf "remote.redis.hosts: list at least one host:port when remote.backend is %s" $r.backend) -}}
{{- end -}}
{{- if eq $r.backend "redis" -}}
{{- if gt (len $r.redis.hosts) 1 -}}
{{- fail "remote.redis.hosts: remote.backend redis takes one host:port (use redis-cluster for several)" -}}
{{- end -}}
{{- printf "redis://%s/%d" (first $r.redis.hosts) (int $r.redis.db) -}}
{{- else -}}
{{- printf "redis-cluster://%s" (join "," $r.redis.hosts) -}}
{{- end -}}
{{- else if eq $r.backend "url" -}}
{{- required "remote.url: set it when remote.backend is url" $r.url -}}
{{- end -}}
{{- end -}}

{{/*
Keys of kvmesh.yaml the chart sets from other values: the value to use instead.
The config: block may not set them (they must agree with Services, ports and volumes).
*/}}
{{- define "kvmesh.ownedKeys" -}}
controller.host: "the chart (0.0.0.0)"
controller.port: controller.ports.zmq
controller.http_port: controller.ports.http
controller.events_port: controller.ports.events
controller.events_replay_port: controller.ports.eventsReplay
controller.snapshot_path: controller.persistence
lookup.host: "the chart (0.0.0.0)"
lookup.port: lookup.ports.zmq
lookup.metrics_port: lookup.ports.metrics
lookup.controller_url: "the chart (the controller's Service)"
cacheserver.host: "the chart (0.0.0.0)"
cacheserver.port: cacheserver.ports.zmq
cacheserver.metrics_port: cacheserver.ports.metrics
cacheserver.lm_enabled: cacheserver.lm.enabled
cacheserver.lm_port: cacheserver.lm.port
cacheserver.data_port: cacheserver.ports.data
cacheserver.spill_path: cacheserver.spill
bridge.host: "the chart (0.0.0.0)"
bridge.port: bridge.ports.http
bridge.metrics_port: bridge.ports.metrics
engine.metrics_port: worker.ports.metrics
engine.metrics_host: "the chart (0.0.0.0)"
engine.lookup_endpoint: worker.ports.lookup
engine.p2p.host: "the chart (the pod's IP)"
engine.p2p.port: worker.ports.p2p
engine.controller.enabled: controller.enabled
engine.controller.url: "the chart (the controller's Service)"
engine.remote.enabled: remote.backend
engine.remote.url: remote.backend and remote.url or remote.redis
engine.disk.enabled: worker.disk.enabled
engine.disk.path: worker.disk
engine.pd.role: "pd.enabled (set per StatefulSet)"
{{- if .Values.security.existingSecret }}
security.server_key: "security.existingSecret (the chart mounts its keys)"
security.client_key: "security.existingSecret (the chart mounts its keys)"
security.allowed_clients: "security.existingSecret (the chart mounts its keys)"
{{- end }}
{{- if .Values.security.httpTokenSecret.name }}
security.http_token_file: security.httpTokenSecret
{{- end }}
{{- if .Values.pd.enabled }}
bridge.prefillers: pd.prefiller.replicas
bridge.decoders: pd.decoder.replicas
{{- end }}
{{- end -}}

{{/* Fail, naming the key, when the config: block sets a key the chart owns. */}}
{{- define "kvmesh.checkOwnedKeys" -}}
{{- $owned := include "kvmesh.ownedKeys" . | fromYaml -}}
{{- range $path := keys $owned | sortAlpha -}}
{{- $cur := $.Values.config -}}
{{- $found := true -}}
{{- range $seg := splitList "." $path -}}
{{- if and $found (kindIs "map" $cur) (hasKey $cur $seg) -}}
{{- $cur = index $cur $seg -}}
{{- else -}}
{{- $found = false -}}
{{- end -}}
{{- end -}}
{{- if $found -}}
{{- fail (printf "config.%s is set by the chart; set %s instead" $path (index $owned $path)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Paths inside the containers. */}}
{{- define "kvmesh.configPath" -}}/etc/kvmesh/kvmesh.yaml{{- end -}}
{{- define "kvmesh.snapshotDir" -}}/var/lib/kvmesh{{- end -}}
{{- define "kvmesh.spillDir" -}}/var/cache/kvmesh-cacheserver{{- end -}}
{{- define "kvmesh.diskDir" -}}/var/cache/kvmesh{{- end -}}
{{- /* Not under /etc/kvmesh: that is the ConfigMap's (read-only) volume. */ -}}
{{- define "kvmesh.keysDir" -}}/etc/kvmesh-keys{{- end -}}
{{- define "kvmesh.tokenDir" -}}/etc/kvmesh-token{{- end -}}
{{- /* The images' HOME (docker/Dockerfile): XDG_CACHE_HOME is under it. */ -}}
{{- define "kvmesh.homeDir" -}}/home/kvmesh{{- end -}}

{{/*
The security: section for the mounted Secrets: CURVE keys from security.existingSecret
(the mesh's server key pair, the clients' key pair, and every *.key in it as an
allowed client), the HTTP admin token from security.httpTokenSecret.
*/}}
{{- define "kvmesh.securityConfig" -}}
{{- $s := .Values.security -}}
{{- $out := dict -}}
{{- if $s.existingSecret -}}
{{- $dir := include "kvmesh.keysDir" . -}}
{{- $_ := set $out "server_key" (printf "%s/server.key_secret" $dir) -}}
{{- $_ := set $out "client_key" (printf "%s/client.key_secret" $dir) -}}
{{- $_ := set $out "allowed_clients" $dir -}}
{{- end -}}
{{- if $s.httpTokenSecret.name -}}
{{- $_ := set $out "http_token_file" (printf "%s/%s" (include "kvmesh.tokenDir" .) $s.httpTokenSecret.key) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
kvmesh.yaml: the config: block, plus the keys the chart owns. Per-pod keys (the pod's
IP, the PD role) come from KVMESH_* variables set on the pods (kvmesh.engineEnv).
*/}}
{{- define "kvmesh.config" -}}
{{- include "kvmesh.checkOwnedKeys" . -}}
{{- $v := .Values -}}
{{- $cfg := deepCopy ($v.config | default dict) -}}
{{- $engineIn := $cfg.engine | default dict -}}
{{- $lookupIn := $cfg.lookup | default dict -}}
{{- $controller := dict "host" "0.0.0.0" "port" (int $v.controller.ports.zmq) "http_port" (int $v.controller.ports.http) "events_port" (int ($v.controller.ports.events | default 0)) "events_replay_port" (int ($v.controller.ports.eventsReplay | default 0)) -}}
{{- if $v.controller.persistence.enabled -}}
{{- $_ := set $controller "snapshot_path" (printf "%s/controller.snapshot" (include "kvmesh.snapshotDir" .)) -}}
{{- end -}}
{{- $lookup := dict "host" "0.0.0.0" "port" (int $v.lookup.ports.zmq) "metrics_port" (int $v.lookup.ports.metrics) "controller_url" (include "kvmesh.controllerUrl" .) -}}
{{- /* The lookup-server hashes tokens as the engines do unless told otherwise. */ -}}
{{- if and (hasKey $engineIn "chunk_size") (not (hasKey $lookupIn "chunk_size")) -}}
{{- $_ := set $lookup "chunk_size" $engineIn.chunk_size -}}
{{- end -}}
{{- if and (hasKey $engineIn "hash_algorithm") (not (hasKey $lookupIn "hash_algorithm")) -}}
{{- $_ := set $lookup "hash_algorithm" $engineIn.hash_algorithm -}}
{{- end -}}
{{- $cacheserver := dict "host" "0.0.0.0" "port" (int $v.cacheserver.ports.zmq) "metrics_port" (int $v.cacheserver.ports.metrics) "lm_enabled" $v.cacheserver.lm.enabled "lm_port" (int $v.cacheserver.lm.port) "data_port" (int $v.cacheserver.ports.data) -}}
{{- if $v.cacheserver.spill.enabled -}}
{{- $_ := set $cacheserver "spill_path" (include "kvmesh.spillDir" .) -}}
{{- end -}}
{{- $bridge := dict "host" "0.0.0.0" "port" (int $v.bridge.ports.http) "metrics_port" (int $v.bridge.ports.metrics) -}}
{{- if $v.pd.enabled -}}
{{- /* instance_id: the pod's name, which is each vLLM pod's connector instance_id
($(POD_NAME)); KV-aware routing (config.bridge.lookup_url) needs it on every backend. */ -}}
{{- $full := include "kvmesh.fullname" . -}}
{{- $prefillers := list -}}
{{- range $i := until (int $v.pd.prefiller.replicas) -}}
{{- $prefillers = append $prefillers (dict "url" (printf "http://%s:%d" (include "kvmesh.podHost" (list $ "prefiller" $i)) (int $v.worker.ports.http)) "instance_id" (printf "%s-prefiller-%d" $full $i)) -}}
{{- end -}}
{{- $decoders := list -}}
{{- range $i := until (int $v.pd.decoder.replicas) -}}
{{- $host := include "kvmesh.podHost" (list $ "decoder" $i) -}}
{{- $decoders = append $decoders (dict "url" (printf "http://%s:%d" $host (int $v.worker.ports.http)) "kv_endpoints" (list (printf "tcp://%s:%d" $host (int $v.worker.ports.p2p))) "instance_id" (printf "%s-decoder-%d" $full $i)) -}}
{{- end -}}
{{- $_ := set $bridge "prefillers" $prefillers -}}
{{- $_ := set $bridge "decoders" $decoders -}}
{{- end -}}
{{- $remoteUrl := include "kvmesh.remoteUrl" . -}}
{{- $engine := dict
      "metrics_port" (int $v.worker.ports.metrics)
      "metrics_host" "0.0.0.0"
      "p2p" (dict "port" (int $v.worker.ports.p2p))
      "controller" (dict "enabled" $v.controller.enabled "url" (include "kvmesh.controllerUrl" .))
      "remote" (dict "enabled" (ne $remoteUrl "") "url" $remoteUrl)
      "disk" (dict "enabled" $v.worker.disk.enabled "path" (ternary (include "kvmesh.diskDir" .) "" $v.worker.disk.enabled)) -}}
{{- $owned := dict "controller" $controller "lookup" $lookup "cacheserver" $cacheserver "bridge" $bridge "engine" $engine -}}
{{- $security := include "kvmesh.securityConfig" . | fromYaml -}}
{{- if $security -}}
{{- $_ := set $owned "security" $security -}}
{{- end -}}
{{- toYaml (mergeOverwrite $cfg $owned) -}}
{{- end -}}

{{/*
A kvmesh.yaml volume and its mount, for every pod; with them the security Secrets
(CURVE keys, the HTTP token), read-only, where the security: section points.
The files are 0440: readable by root and, under a non-root runAsUser, by the pod's
fsGroup (set podSecurityContext.fsGroup then).
*/}}
{{- define "kvmesh.configVolume" -}}
- name: config
  configMap:
    name: {{ include "kvmesh.fullname" . }}-config
{{- with .Values.security.existingSecret }}
- name: curve-keys
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with .Values.security.httpTokenSecret }}
{{- if .name }}
- name: http-token
  secret:
    secretName: {{ .name }}
    defaultMode: 0440
    items:
      - key: {{ .key }}
        path: {{ .key }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvmesh.configMount" -}}
- name: config
  mountPath: /etc/kvmesh
  readOnly: true
{{- if .Values.security.existingSecret }}
- name: curve-keys
  mountPath: {{ include "kvmesh.keysDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.security.httpTokenSecret.name }}
- name: http-token
  mountPath: {{ include "kvmesh.tokenDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The writable directories of a read-only root filesystem (securityContext's
readOnlyRootFilesystem), as emptyDirs: /tmp in every container (tmp), and HOME in the
vLLM containers (worker.home), where vLLM, torch, triton and Hugging Face cache.
The snapshot, spill, disk tier and /dev/shm volumes are the components' own.
  include "kvmesh.scratchVolumes" (list $ false)    true: a vLLM pod
*/}}
{{- define "kvmesh.emptyDir" -}}
{{- $spec := dict -}}
{{- with .medium }}{{ $_ := set $spec "medium" . }}{{ end -}}
{{- with .sizeLimit }}{{ $_ := set $spec "sizeLimit" . }}{{ end -}}
{{- toJson $spec -}}
{{- end -}}

{{- define "kvmesh.scratchVolumes" -}}
{{- $root := index . 0 -}}
{{- if (($root.Values.securityContext | default dict).readOnlyRootFilesystem) -}}
{{- if not $root.Values.tmp.enabled -}}
{{- fail "tmp.enabled false with securityContext.readOnlyRootFilesystem true: nothing could write /tmp (Python's tempfile, vLLM's RPC sockets); enable tmp or set readOnlyRootFilesystem false" -}}
{{- end -}}
{{- if and (index . 1) (not $root.Values.worker.home.enabled) -}}
{{- fail "worker.home.enabled false with securityContext.readOnlyRootFilesystem true: vLLM could not write its caches under HOME; enable worker.home or set readOnlyRootFilesystem false" -}}
{{- end -}}
{{- end -}}
{{- if $root.Values.tmp.enabled }}
- name: tmp
  emptyDir: {{ include "kvmesh.emptyDir" $root.Values.tmp }}
{{- end }}
{{- if and (index . 1) $root.Values.worker.home.enabled }}
- name: home
  emptyDir: {{ include "kvmesh.emptyDir" $root.Values.worker.home }}
{{- end }}
{{- end -}}

{{- define "kvmesh.scratchMounts" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.tmp.enabled }}
- name: tmp
  mountPath: /tmp
{{- end }}
{{- if and (index . 1) $root.Values.worker.home.enabled }}
- name: home
  mountPath: {{ include "kvmesh.homeDir" $root }}
{{- end }}
{{- end -}}

{{/* Environment every kvmesh container gets; then the component's extraEnv. */}}
{{- define "kvmesh.baseEnv" -}}
- name: KVMESH_CONFIG
  value: {{ include "kvmesh.configPath" . }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
{{- if .Values.podIP }}
  value: {{ .Values.podIP | quote }}
{{- else }}
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- end -}}

{{/*
The pod's own address inside other env values: $(POD_IP), or podIP as written when it
is set (runtimes that expand no $(VAR) references, like podman 4's kube play).
*/}}
{{- define "kvmesh.podIPRef" -}}
{{- .Values.podIP | default "$(POD_IP)" -}}
{{- end -}}

{{/* The Redis password, when remote.redis.passwordSecret names a Secret. */}}
{{- define "kvmesh.remoteEnv" -}}
{{- $r := .Values.remote -}}
{{- if and (or (eq $r.backend "redis") (eq $r.backend "redis-cluster")) $r.redis.passwordSecret.name }}
- name: KVMESH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $r.redis.passwordSecret.name }}
      key: {{ $r.redis.passwordSecret.key }}
- name: KVMESH_ENGINE__REMOTE__URL
  {{- $url := include "kvmesh.remoteUrl" . }}
  {{- $scheme := index (splitList "://" $url) 0 }}
  value: {{ printf "%s://:$(KVMESH_REDIS_PASSWORD)@%s" $scheme (trimPrefix (printf "%s://" $scheme) $url) | quote }}
{{- end }}
{{- end -}}

{{/* Scheduling and pod settings shared by every component: (list $ .Values.controller) */}}
{{- define "kvmesh.podSpecCommon" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $root.Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $root.Values.hostAliases }}
hostAliases:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations: a checksum of kvmesh.yaml (a config change restarts the pods). */}}
{{- define "kvmesh.podAnnotations" -}}
{{- $root := index . 0 -}}
checksum/config: {{ include "kvmesh.config" $root | sha256sum }}
{{- with (index . 1).podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A volumeClaimTemplate / PVC spec from a {size, storageClassName, accessModes} value. */}}
{{- define "kvmesh.pvcSpec" -}}
accessModes:
  {{- toYaml .accessModes | nindent 2 }}
{{- with .storageClassName }}
storageClassName: {{ . | quote }}
{{- end }}
resources:
  requests:
    storage: {{ .size | quote }}
{{- end -}}
