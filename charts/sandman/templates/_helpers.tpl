{{- /* Names. Cluster-scoped objects carry the release's full name, so two releases never
collide (a leftover webhook configuration of another release would refuse its sandboxes). */ -}}
{{- define "sandman.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sandman.fullname" -}}
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

{{- define "sandman.webhook.fullname" -}}{{ include "sandman.fullname" . }}-webhook{{- end -}}
{{- define "sandman.controller.fullname" -}}{{ include "sandman.fullname" . }}-controller{{- end -}}
{{- define "sandman.controller.clusterName" -}}
{{- printf "%s-%s" (include "sandman.controller.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "sandman.webhook.secret" -}}{{ include "sandman.webhook.fullname" . }}-tls{{- end -}}
{{- /* The controller's serving certificate (tls.crt, tls.key, ca.crt), its Service's DNS name
(what the certificate names, and what a standby verifies the leader as) and the ConfigMap that
publishes the CA bundle to trainers (key ca.crt; docs/install.md, "Trainers: the CA"). */ -}}
{{- define "sandman.controller.secret" -}}{{ include "sandman.controller.fullname" . }}-tls{{- end -}}
{{- define "sandman.controller.host" -}}{{ include "sandman.controller.fullname" . }}.{{ .Release.Namespace }}.svc{{- end -}}
{{- define "sandman.caConfigMap" -}}{{ include "sandman.fullname" . }}-ca{{- end -}}

{{- /* Where sandbox pods live: the controller's Role, its --namespace and the sandbox
NetworkPolicies go there. Never a namespace the webhooks exclude: sandboxes other clients made
there would be admitted unchecked, and the controller's Role there would reach the webhook's
Secrets' namespace. */ -}}
{{- define "sandman.sandboxNamespace" -}}
{{- $ns := .Values.sandboxNamespace -}}
{{- if has $ns (include "sandman.webhook.excludedNamespaces" . | fromJsonArray) -}}
{{- fail (printf "sandboxNamespace %q is excluded from admission (the release namespace, kube-system and webhook.excludedNamespaces never reach the webhooks): sandboxes there would be admitted unchecked; use a namespace of their own (default: sandboxes)" $ns) -}}
{{- end -}}
{{- $ns -}}
{{- end -}}

{{- /* Namespaces never sent to the webhooks, as a JSON list. */ -}}
{{- define "sandman.webhook.excludedNamespaces" -}}
{{- concat (list "kube-system" .Release.Namespace) .Values.webhook.excludedNamespaces | uniq | sortAlpha | toJson -}}
{{- end -}}

{{- define "sandman.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (toString $img.tag) -}}
{{- end -}}
{{- end -}}

{{- /* A component's image (webhook, controller, certificate pods, cleanup, helm test): its own
`image` values when any of repository, tag or digest is set (repository defaulting to
image.repository, tag to image.tag), else the global image. The netguard image that webhook and
controller inject into sandboxes (--image, sandman.policyArgs) is always the global one.
Called with (list $ <the component's image values>). */ -}}
{{- define "sandman.componentImage" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 | default dict -}}
{{- if or $own.repository $own.tag $own.digest -}}
{{- $repo := $own.repository | default $root.Values.image.repository -}}
{{- if $own.digest -}}
{{- printf "%s@%s" $repo $own.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (toString ($own.tag | default $root.Values.image.tag)) -}}
{{- end -}}
{{- else -}}
{{- include "sandman.image" $root -}}
{{- end -}}
{{- end -}}
{{- define "sandman.componentPullPolicy" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 | default dict -}}
{{- $own.pullPolicy | default $root.Values.image.pullPolicy -}}
{{- end -}}

{{- /* A user map (podLabels, podAnnotations, serviceAccount.annotations) as YAML, after the
chart's own keys. A key the chart sets itself, or one under the reserved prefix, fails the
render with one line instead of being silently dropped or overriding the chart's. Called with
(list "<values path>" <the map> (list <the chart's own keys>) "<reserved prefix or empty>"
"<why they are reserved>"). */ -}}
{{- define "sandman.userKeys" -}}
{{- $path := index . 0 -}}
{{- $user := index . 1 | default dict -}}
{{- $own := index . 2 -}}
{{- $prefix := index . 3 -}}
{{- range $k, $_ := $user -}}
{{- if or (has $k $own) (and $prefix (hasPrefix $prefix $k)) -}}
{{- fail (printf "%s sets %q, which the chart reserves (%s): choose a key of your own" $path $k (index $ 4)) -}}
{{- end -}}
{{- end -}}
{{- with $user }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{- /* The labels of every pod the chart renders: the full app.kubernetes.io set (the
selector's name and instance, component, version, part-of, managed-by), then the component's
podLabels. No podLabels key may be an app.kubernetes.io/ one (sandman.userKeys fails), so no
value can move a pod out of its Deployment's selector, Service or NetworkPolicy. Called with
(list $ "<component>" "<values path of podLabels>" <podLabels>). */ -}}
{{- define "sandman.podLabels" -}}
{{- $root := index . 0 -}}
{{ include "sandman.selectorLabels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: sandman
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- with include "sandman.userKeys" (list (index . 2) (index . 3) (list) "app.kubernetes.io/" "the app.kubernetes.io/ labels, which selectors and NetworkPolicies match") }}
{{ . }}
{{- end }}
{{- end -}}

{{- define "sandman.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sandman.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sandman
{{- end -}}

{{- define "sandman.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sandman.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sandman.webhook.labels" -}}
{{ include "sandman.labels" . }}
app.kubernetes.io/component: webhook
{{- end -}}
{{- define "sandman.webhook.selectorLabels" -}}
{{ include "sandman.selectorLabels" . }}
app.kubernetes.io/component: webhook
{{- end -}}

{{- define "sandman.controller.labels" -}}
{{ include "sandman.labels" . }}
app.kubernetes.io/component: controller
{{- end -}}
{{- define "sandman.controller.selectorLabels" -}}
{{ include "sandman.selectorLabels" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{- /* Certificates come from the webhook's own `certs ensure` unless cert-manager or a
development URL is used. */ -}}
{{- define "sandman.webhook.ownCerts" -}}
{{- if and (not .Values.certManager.enabled) (not .Values.webhook.development.url) -}}true{{- end -}}
{{- end -}}
{{- /* The certificate Job runs unless cert-manager issues: the controller's certificate is
needed even with a development webhook URL. */ -}}
{{- define "sandman.certsJob" -}}
{{- if not .Values.certManager.enabled -}}true{{- end -}}
{{- end -}}

{{- /* The one namespaceSelector of every webhook: kube-system and the release namespace are
always excluded (a broken webhook can then never block its own recovery), plus the user's. */ -}}
{{- define "sandman.webhook.namespaceSelector" -}}
{{- $excluded := include "sandman.webhook.excludedNamespaces" . | fromJsonArray -}}
{{- $sel := .Values.webhook.namespaceSelector -}}
{{- with $sel.matchLabels }}
matchLabels:
  {{- toYaml . | nindent 2 }}
{{- end }}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values:
      {{- toYaml $excluded | nindent 6 }}
  {{- with $sel.matchExpressions }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{- define "sandman.webhook.clientConfig" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- if $root.Values.webhook.development.url }}
url: {{ printf "%s%s" (trimSuffix "/" $root.Values.webhook.development.url) $path | quote }}
{{- with $root.Values.webhook.development.caBundle }}
caBundle: {{ . | quote }}
{{- end }}
{{- else }}
service:
  namespace: {{ $root.Release.Namespace }}
  name: {{ include "sandman.webhook.fullname" $root }}
  port: {{ $root.Values.webhook.service.port }}
  path: {{ $path }}
{{- end }}
{{- end -}}

{{- define "sandman.webhook.annotations" -}}
{{- if .Values.certManager.enabled }}
cert-manager.io/inject-ca-from: {{ printf "%s/%s" .Release.Namespace (include "sandman.webhook.fullname" .) }}
{{- end }}
{{- end -}}

{{- /* Sandbox policy flags shared by webhook and controller: both run the same pod function
(sandman.podspec.make_sandbox), so they must be given the same policy. */ -}}
{{- define "sandman.policyArgs" -}}
- --image={{ include "sandman.image" . }}
- --guard={{ .Values.sandbox.guard }}
{{- range .Values.sandbox.ingressFrom }}
- --ingress-from={{ . }}
{{- end }}
{{- if .Values.sandbox.gpu.enabled }}
- --gpu-max={{ int .Values.sandbox.gpu.max }}
{{- end }}
- --gpu-resource={{ .Values.sandbox.gpu.resource }}
{{- range .Values.sandbox.gpu.tolerations }}
- --gpu-toleration={{ . }}
{{- end }}
{{- range (include "sandman.egressCeilingEntries" . | fromJsonArray) }}
{{- if not (hasPrefix "svc/" .) }}
{{- include "sandman.noHostBits" (list (regexReplaceAll "^\\[?([^\\]]*?)\\]?:[^:]*$" . "${1}") (printf "sandbox.egressCeiling entry %s" .)) }}
{{- end }}
- --egress-ceiling={{ . }}
{{- end }}
{{- range .Values.sandbox.egressNever }}
{{- include "sandman.noHostBits" (list . (printf "sandbox.egressNever entry %s" .)) }}
- --egress-never={{ . }}
{{- end }}
{{- end -}}

{{- /* Fails the render when CIDR (list CIDR WHAT) has host bits set: the webhook and the
controller refuse such a value at start (sandman/egress.py), so no install gets that far. */ -}}
{{- define "sandman.noHostBits" -}}
{{- $parts := splitList "/" (index . 0) -}}
{{- if eq (len $parts) 2 -}}
{{- $p := atoi (index $parts 1) -}}
{{- $ok := true -}}
{{- if contains ":" (index $parts 0) -}}
{{- $hex := include "sandman.ipv6Hex" (index $parts 0) -}}
{{- $n := div $p 4 | int -}}
{{- $r := mod $p 4 | int -}}
{{- $rest := substr (ternary $n (add1 $n | int) (eq $r 0)) 32 $hex -}}
{{- if ne (trimAll "0" $rest) "" }}{{ $ok = false }}{{ end -}}
{{- if gt $r 0 -}}
{{- $digits := dict "0" 0 "1" 1 "2" 2 "3" 3 "4" 4 "5" 5 "6" 6 "7" 7 "8" 8 "9" 9 "a" 10 "b" 11 "c" 12 "d" 13 "e" 14 "f" 15 -}}
{{- if ne (mod (index $digits (substr $n (add1 $n | int) $hex)) (index (list 16 8 4 2) $r)) 0 }}{{ $ok = false }}{{ end -}}
{{- end -}}
{{- else -}}
{{- $size := 1 -}}
{{- range until (sub 32 $p | int) }}{{ $size = mul $size 2 }}{{ end -}}
{{- if ne (mod (include "sandman.ipv4Int" (index $parts 0) | atoi) $size) 0 }}{{ $ok = false }}{{ end -}}
{{- end -}}
{{- if not $ok -}}
{{- fail (printf "%s has host bits set: write the network address" (index . 1)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* sandbox.egressCeiling as entry strings (a Service's object form gives its `entry`), as
JSON: the webhook's and the controller's --egress-ceiling and the policy's CEL read the same. */ -}}
{{- define "sandman.egressCeilingEntries" -}}
{{- $out := list -}}
{{- range .Values.sandbox.egressCeiling -}}
{{- if kindIs "map" . -}}
{{- $out = append $out .entry -}}
{{- else -}}
{{- $out = append $out . -}}
{{- end -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{- /* Cluster-scoped objects (webhook configurations, ClusterRole, binding, PriorityClass):
release name AND namespace, so releases of the same name in two namespaces never collide. */ -}}
{{- define "sandman.clusterName" -}}
{{- printf "%s-%s" (include "sandman.webhook.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The FlowSchema and PriorityLevelConfiguration: cluster-scoped, so named after release AND
namespace, like the webhook configurations. */ -}}
{{- define "sandman.flowcontrol.name" -}}
{{- printf "%s-%s" (include "sandman.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sandman.webhook.sandboxObjectSelector" -}}
{{- if .Values.webhook.sandboxObjectSelector -}}
{{- toYaml .Values.webhook.sandboxObjectSelector -}}
{{- else -}}
matchExpressions:
  - key: {{ include "sandman.contract.LABEL_SANDBOX" . }}
    operator: In
    values: [{{ include "sandman.contract.SANDBOX_TRUE" . | quote }}]
{{- end -}}
{{- end -}}

{{- define "sandman.webhook.egressObjectSelector" -}}
{{- if .Values.webhook.egressObjectSelector -}}
{{- toYaml .Values.webhook.egressObjectSelector -}}
{{- else -}}
matchExpressions:
  - key: {{ include "sandman.contract.LABEL_EGRESS" . }}
    operator: Exists
  - key: {{ include "sandman.contract.LABEL_SANDBOX" . }}
    operator: NotIn
    values: [{{ include "sandman.contract.SANDBOX_TRUE" . | quote }}]
{{- end -}}
{{- end -}}

{{- /* Fields every webhook of both configurations shares (webhook/manifests.py renders the
same; a test compares them). */ -}}
{{- define "sandman.webhook.common" -}}
namespaceSelector:
  {{- include "sandman.webhook.namespaceSelector" . | trim | nindent 2 }}
failurePolicy: {{ .Values.webhook.failurePolicy }}
matchPolicy: {{ .Values.webhook.matchPolicy }}
sideEffects: {{ .Values.webhook.sideEffects }}
timeoutSeconds: {{ .Values.webhook.timeoutSeconds }}
admissionReviewVersions: [v1]
{{- end -}}

{{- /* The pod that runs `python3 -m webhook certs ensure` (Job at install, CronJob for
renewal). Idempotent: a run with nothing to renew changes nothing. `certs ensure` writes its two
Secrets without an owner, so Helm would leave them behind on uninstall; the second step makes
the webhook's ServiceAccount (a Helm object) their owner, and the garbage collector removes
them with the release. It runs after every ensure, which replaces the Secrets whole. */ -}}
{{- define "sandman.webhook.certsPod" -}}
metadata:
  labels:
    {{- include "sandman.podLabels" (list . "webhook-certs" "webhook.certs.podLabels" .Values.webhook.certs.podLabels) | nindent 4 }}
  {{- with include "sandman.userKeys" (list "webhook.certs.podAnnotations" .Values.webhook.certs.podAnnotations (list) "" "") }}
  annotations:
    {{- . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "sandman.webhook.fullname" . }}
  automountServiceAccountToken: true
  enableServiceLinks: false
  restartPolicy: OnFailure
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.webhook.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.webhook.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  initContainers:
    {{- if include "sandman.webhook.ownCerts" . }}
    - name: certs
      image: {{ include "sandman.componentImage" (list . .Values.webhook.certs.image) }}
      imagePullPolicy: {{ include "sandman.componentPullPolicy" (list . .Values.webhook.certs.image) }}
      command: [python3, -m, webhook, certs, ensure]
      args:
        - --namespace={{ .Release.Namespace }}
        - --service={{ include "sandman.webhook.fullname" . }}
        - --secret={{ include "sandman.webhook.secret" . }}
        - --mutating-config={{ include "sandman.clusterName" . }}
        {{- if .Values.webhook.validating.enabled }}
        - --validating-config={{ include "sandman.clusterName" . }}
        {{- end }}
        - --propagation-seconds={{ .Values.webhook.certs.propagationSeconds }}
      {{- with .Values.webhook.certs.extraEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "sandman.webhook.certsContainerTail" . | nindent 6 }}
    {{- end }}
    # The controller's own CA and serving pair (Secrets <controller>-tls and -tls-ca), by the
    # same command: a CA of its own, so trusting it (trainers) trusts nothing else. The
    # controller publishes the bundle to trainers itself (--ca-configmap).
    - name: controller-certs
      image: {{ include "sandman.componentImage" (list . .Values.webhook.certs.image) }}
      imagePullPolicy: {{ include "sandman.componentPullPolicy" (list . .Values.webhook.certs.image) }}
      command: [python3, -m, webhook, certs, ensure]
      args:
        - --namespace={{ .Release.Namespace }}
        - --service={{ include "sandman.controller.fullname" . }}
        - --secret={{ include "sandman.controller.secret" . }}
      {{- with .Values.webhook.certs.extraEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "sandman.webhook.certsContainerTail" . | nindent 6 }}
  containers:
    - name: own-secrets
      image: {{ include "sandman.componentImage" (list . .Values.webhook.certs.image) }}
      imagePullPolicy: {{ include "sandman.componentPullPolicy" (list . .Values.webhook.certs.image) }}
      env:
        - name: NAMESPACE
          value: {{ .Release.Namespace }}
        - name: OWNER
          value: {{ include "sandman.webhook.fullname" . }}
        - name: SECRETS
          value: {{ if include "sandman.webhook.ownCerts" . }}{{ include "sandman.webhook.secret" . }},{{ include "sandman.webhook.secret" . }}-ca,{{ end }}{{ include "sandman.controller.secret" . }},{{ include "sandman.controller.secret" . }}-ca
        {{- with .Values.webhook.certs.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      command:
        - python3
        - -c
        - |
          import os
          from kubernetes import client, config
          if os.environ.get("KUBECONFIG"):
              config.load_kube_config()
          else:
              config.load_incluster_config()
          core, ns, owner = client.CoreV1Api(), os.environ["NAMESPACE"], os.environ["OWNER"]
          uid = core.read_namespaced_service_account(owner, ns).metadata.uid
          ref = {"apiVersion": "v1", "kind": "ServiceAccount", "name": owner, "uid": uid}
          for name in os.environ["SECRETS"].split(","):
              core.patch_namespaced_secret(name, ns, {"metadata": {"ownerReferences": [ref]}})
              print(f"secret/{name}: owned by serviceaccount/{owner}, removed with the release")
      {{- include "sandman.webhook.certsContainerTail" . | nindent 6 }}
{{- end -}}

{{- define "sandman.webhook.certsContainerTail" -}}
resources:
  requests: {cpu: 100m, memory: 128Mi}
  limits: {cpu: 100m, memory: 128Mi}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end -}}

{{- /* `helm uninstall` leaves nothing: a post-delete hook Job (python3 -m controller.cleanup)
removes what the controller made at run time and Helm never knew about: its sandbox pods and
per-job ConfigMaps (label app.kubernetes.io/managed-by=sandman-controller) and its leader Lease
in the sandbox namespace, and the `helm test` pod. It first waits for the release's controller
pods to be gone, so nothing recreates them. Its account, Roles and bindings are hooks too,
created just before it and deleted with it when it succeeds; a failed run keeps all of them
(and the Job's pod) for `kubectl logs`. docs/install.md, "Uninstall". */ -}}
{{- define "sandman.cleanup.name" -}}{{ include "sandman.fullname" . }}-cleanup{{- end -}}
{{- define "sandman.cleanup.hook" -}}
helm.sh/hook: post-delete
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{- /* "true" when IPv4 CIDR (list INNER OUTER) lies strictly inside OUTER (a never range to
except from a ceiling entry's ipBlock); Helm has no CIDR functions, so by integer arithmetic. */ -}}
{{- define "sandman.ipv4Inside" -}}
{{- $in := splitList "/" (index . 0) -}}
{{- $out := splitList "/" (index . 1) -}}
{{- $pin := atoi (index $in 1) -}}
{{- $pout := atoi (index $out 1) -}}
{{- $size := 1 -}}
{{- range until (sub 32 $pout | int) -}}{{- $size = mul $size 2 -}}{{- end -}}
{{- $a := include "sandman.ipv4Int" (index $in 0) | atoi -}}
{{- $b := include "sandman.ipv4Int" (index $out 0) | atoi -}}
{{- and (gt $pin $pout) (eq (div $a $size) (div $b $size)) -}}
{{- end -}}

{{- /* The NAT64 images (64:ff9b::/96) of sandbox.egressNever's IPv4 ranges, as a JSON list:
never reached either (sandman/egress.py never_ranges); the ceiling NetworkPolicy excepts them
and the policy refuses entries inside them. */ -}}
{{- define "sandman.egressNeverNat64" -}}
{{- $out := list -}}
{{- range (.Values.sandbox.egressNever | default list) -}}
{{- if not (contains ":" .) -}}
{{- $parts := splitList "/" . -}}
{{- $ip := include "sandman.ipv4Int" (index $parts 0) | atoi -}}
{{- $bits := 32 -}}
{{- if eq (len $parts) 2 }}{{ $bits = index $parts 1 | atoi }}{{ end -}}
{{- $out = append $out (printf "64:ff9b::%x:%x/%d" (div $ip 65536) (mod $ip 65536) (add 96 $bits)) -}}
{{- end -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{- define "sandman.ipv4Int" -}}
{{- $o := splitList "." . -}}
{{- add (mul (atoi (index $o 0)) 16777216) (mul (atoi (index $o 1)) 65536) (mul (atoi (index $o 2)) 256) (atoi (index $o 3)) -}}
{{- end -}}

{{- /* The same for IPv6 (list INNER OUTER): both spelled out as 32 hex digits, compared on the
outer prefix's whole nibbles, then on the leading bits of the next one. */ -}}
{{- define "sandman.ipv6Inside" -}}
{{- $in := splitList "/" (index . 0) -}}
{{- $out := splitList "/" (index . 1) -}}
{{- $pin := atoi (index $in 1) -}}
{{- $pout := atoi (index $out 1) -}}
{{- $hi := include "sandman.ipv6Hex" (index $in 0) -}}
{{- $ho := include "sandman.ipv6Hex" (index $out 0) -}}
{{- $n := div $pout 4 | int -}}
{{- $r := mod $pout 4 | int -}}
{{- $same := eq (substr 0 $n $hi) (substr 0 $n $ho) -}}
{{- if and $same (gt $r 0) -}}
{{- $hex := dict "0" 0 "1" 1 "2" 2 "3" 3 "4" 4 "5" 5 "6" 6 "7" 7 "8" 8 "9" 9 "a" 10 "b" 11 "c" 12 "d" 13 "e" 14 "f" 15 -}}
{{- $step := index (list 16 8 4 2) $r -}}
{{- $vi := index $hex (substr $n (add1 $n | int) $hi) -}}
{{- $vo := index $hex (substr $n (add1 $n | int) $ho) -}}
{{- $same = eq (div $vi $step) (div $vo $step) -}}
{{- end -}}
{{- and (gt $pin $pout) $same -}}
{{- end -}}

{{- define "sandman.ipv6Hex" -}}
{{- $halves := splitList "::" (lower .) -}}
{{- $head := list -}}
{{- if index $halves 0 }}{{ $head = splitList ":" (index $halves 0) }}{{ end -}}
{{- $tail := list -}}
{{- if and (gt (len $halves) 1) (index $halves 1) }}{{ $tail = splitList ":" (index $halves 1) }}{{ end -}}
{{- $groups := $head -}}
{{- range until (sub 8 (add (len $head) (len $tail)) | int) }}{{ $groups = append $groups "0" }}{{ end -}}
{{- range (concat $groups $tail) }}{{ printf "%04s" . }}{{ end -}}
{{- end -}}
