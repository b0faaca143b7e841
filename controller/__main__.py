"""`python3 -m controller serve --namespace NS --listen 0.0.0.0:8080 [options]`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import socket
import sys

import uvicorn

from controller import auth as A
from controller import tls as T
from controller import tracing
from controller.core import Controller
from controller.demand import Budget
from controller.forward import ForwardToLeader
from controller.kube import KubeClient, load_api_client
from controller.leader import LeaderElector
from controller.oci import AuthFile
from controller.pacer import Limits
from controller.prepull import check_images
from controller.routes import build_app
from controller.settings import Settings, load_pod_template
from sandman import contract, egress, logs
from sandman.podspec import GUARD_MODES, SandboxPolicy, gpu_args, gpu_policy

log = logging.getLogger("controller")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m controller")
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("serve", help="run the controller (leader election + API)")
    s.add_argument("--namespace", required=True, help="namespace of the sandbox pods")
    s.add_argument("--listen", default="0.0.0.0:8080",
                   help="API address host:port; port 0 picks a free port (printed)")
    s.add_argument("--kubeconfig", default=None, help="default: in-cluster config")
    # Pacing. The paper's campaigns averaged 1.8 creates/s with bursts of 64-132/s; an unpaced
    # 4,096-trajectory evaluation took a shared webhook down. 20/s with a burst of 40 keeps a
    # 64-trajectory run start under 3 s of queueing.
    s.add_argument("--rate", type=float, default=20.0, help="creates/s (token bucket)")
    s.add_argument("--burst", type=int, default=40, help="token bucket size")
    s.add_argument("--max-creating", type=int, default=200,
                   help="creates in flight + pods not yet Ready, cluster-wide")
    s.add_argument("--max-live", type=int, default=20000, help="pods that exist, cluster-wide")
    s.add_argument("--job-max-creating", type=int, default=0, help="per job (0: none)")
    s.add_argument("--job-max-live", type=int, default=0, help="per job (0: none)")
    # A tenant is the namespace an authenticated caller acquires for (the job key's prefix).
    s.add_argument("--tenant-max-creating", type=int, default=0, help="per tenant (0: none)")
    s.add_argument("--tenant-max-live", type=int, default=0, help="per tenant (0: none)")
    s.add_argument("--tenant-weight", action="append", default=[], metavar="NAMESPACE=N",
                   help="a tenant's share of the create rate while several wait (default 1; "
                        "repeatable)")
    s.add_argument("--ready-check", choices=("execd", "pod"), default="execd",
                   help="execd: Ready and execd /ready passes; pod: Ready only (kwok)")
    s.add_argument("--node-pool-label", default=Settings.node_pool_label,
                   help="key=value node selector for a node POOL (never an instance type); "
                        "empty: none")
    s.add_argument("--sweep-interval", type=float, default=30.0, help="seconds between sweeps")
    s.add_argument("--sweep-grace", type=float, default=120.0,
                   help="unowned pods younger than this are left to their create")
    s.add_argument("--idle-timeout", type=float, default=300.0,
                   help="warm pool idle timeout per key (s); 300 s was the paper's sweet spot")
    # Demand sizing (controller/demand.py, docs/controller.md "Demand-sized warm pools"). The
    # paper's checked-reuse A/B ran a global budget of 96 pods (98.4% hits with 78 idle warm
    # pods); budgets of 16-64 did far worse in its replays. Off by default: pools then hold
    # only what an admin prewarms.
    s.add_argument("--warm-budget-pods", type=int, default=0,
                   help="global warm budget in pods that demand sizing may fill, admin "
                        "floors included (0: demand sizing off)")
    s.add_argument("--warm-budget-cpu", type=float, default=0.0,
                   help="global warm budget in requested cores (0: bounded by pods only)")
    s.add_argument("--warm-max-per-key", type=int, default=Budget.per_key,
                   help="most warm pods demand sizing gives one key (8: one GRPO group)")
    s.add_argument("--warm-demand-roles", default=",".join(Budget.roles),
                   help="comma-separated roles whose keys are sized by demand "
                        f"({', '.join(contract.ROLES)})")
    s.add_argument("--ready-budget", type=float, default=120.0,
                   help="seconds an owner waits for Ready (+ execd /ready) after its create, "
                        "whatever the caller's timeout_s (late pods are then parked, not lost)")
    s.add_argument("--conditions-attempts", type=int, default=Settings.conditions_attempts,
                   help="pods tried per acquire with declared conditions before it fails "
                        "ConditionsRefused (within its timeout_s)")
    s.add_argument("--conditions-egress-probe", default=None, metavar="HOST:PORT",
                   help="an address a pod with outbound network reaches: an acquire declaring "
                        "egress has the pod try it (default: netguard's status only)")
    s.add_argument("--egress-ceiling", action="append", default=[], metavar="ENTRY",
                   help="what egress allowlists may name (CIDR:PORT or svc/NAME.NAMESPACE:PORT,"
                        " * for any port or Service name; repeatable or comma-separated); "
                        "none: every allowlist is refused (chart sandbox.egressCeiling)")
    s.add_argument("--egress-never", action="append", default=[], metavar="CIDR",
                   help="ranges no allowlist may name, besides the metadata and link-local "
                        "ones and the API server's address (repeatable or comma-separated; "
                        "chart sandbox.egressNever)")
    s.add_argument("--api-timeout", type=float, default=15.0,
                   help="seconds per API server call before it counts as failed and is retried")
    s.add_argument("--default-lifetime", type=float, default=Settings.default_lifetime,
                   help="seconds a handed-out sandbox lives unless renewed (acquire's "
                        "lifetime_s; the SDK renews while the handle is open)")
    s.add_argument("--min-lifetime", type=float, default=Settings.min_lifetime,
                   help="smallest lifetime_s accepted (tests lower it)")
    s.add_argument("--max-lifetime", type=float, default=Settings.max_lifetime,
                   help="largest lifetime_s accepted by acquire and renew (400 above)")
    s.add_argument("--pod-template-file", default=None,
                   help="YAML/JSON: tolerations, affinity, priorityClassName, "
                        "runtimeClassName, imagePullSecrets, annotations, labels for every "
                        "sandbox pod (checked at startup; the chart mounts sandbox.podTemplate)")
    s.add_argument("--lease-name", default="sandman-controller")
    s.add_argument("--lease-duration", type=float, default=10.0,
                   help="a standby takes over this long after the leader's last renewal")
    s.add_argument("--lease-renew", type=float, default=2.0)
    s.add_argument("--advertise-address", default="",
                   help="this replica's pod IP: the leader writes it into the Lease, so a "
                        "standby can forward API calls to it, and every pod this replica "
                        "builds admits it to execd's port (its --ready-check execd source) "
                        "even when --ingress-from is narrowed; default: the --listen host "
                        "unless it is a wildcard (then nothing is admitted besides "
                        "--ingress-from)")
    s.add_argument("--image", default=SandboxPolicy.image, help="the sandman image (execd, guard)")
    s.add_argument("--guard", choices=GUARD_MODES, default=SandboxPolicy.guard)
    gpu_args(s)
    s.add_argument("--ingress-from", action="append", default=None,
                   help="CIDR allowed to reach execd (repeatable); default anywhere")
    s.add_argument("--auth", choices=A.MODES, default="kubernetes",
                   help="kubernetes: callers send a ServiceAccount token (TokenReview) and "
                        "need RBAC on sandboxes.sandman.dev in their tenant namespace "
                        "(SubjectAccessReview); none: anyone who reaches the port may do "
                        "anything, for local use only")
    s.add_argument("--auth-audience", default=A.DEFAULT_AUDIENCE,
                   help="the audience callers' tokens must be issued for")
    s.add_argument("--auth-cache-ttl", type=float, default=10.0,
                   help="seconds a TokenReview/SubjectAccessReview answer is reused (a revoked "
                        "binding or deleted ServiceAccount takes effect within it)")
    s.add_argument("--caller-label-prefix", action="append", default=[], metavar="PREFIX",
                   help="a label-key prefix (e.g. example.com) callers may use on their "
                        "sandboxes besides unprefixed keys (repeatable); Kubernetes' and "
                        "sandman's own prefixes are always refused")
    s.add_argument("--max-reuse", type=int, default=Settings.max_reuse,
                   help="a grading pod released with reuse goes back to its pool at most this "
                        "many times, then it is deleted (0: never reused)")
    s.add_argument("--snapshot-base", choices=("on", "off"), default="on",
                   help="on: agent pods' execd records a snapshot base at start (one stat walk "
                        "of the image before the pod is ready), which fork, checkpoints and "
                        "pause need; off: they are refused (docs/controller.md \"Fork\")")
    s.add_argument("--baseline-scope", choices=contract.BASELINE_SCOPES,
                   default=Settings.baseline_scope,
                   help="what execd watches in grading pods for checked reuse: root, the whole "
                        "root filesystem (a change outside its copied roots retires the pod), "
                        "or listed, its listed roots only (docs/execd.md)")
    s.add_argument("--books-key-file", default=None,
                   help="a secret of at least 16 bytes (a mounted Secret): the controller marks "
                        "each pod it creates with its HMAC, and adopts on a restart only pods "
                        "whose mark checks out (docs/controller.md); shared by the replicas")
    s.add_argument("--prepull-image", action="append", default=[], metavar="REF@sha256:HEX",
                   help="an image, pinned by digest, pulled onto every node of the sandbox "
                        "node pool at start and onto nodes that join it (repeatable; "
                        "docs/controller.md \"Pre-pull\")")
    s.add_argument("--image-pinning", choices=("resolve", "require", "off"), default="resolve",
                   help="resolve: a job's tag is resolved to its digest once, through the "
                        "registry, and the job's pods run that digest (a tag that cannot be "
                        "resolved is refused); require: tags refused, digests only; off: "
                        "references as given, unpinned (docs/controller.md \"Image pinning\")")
    s.add_argument("--registry-insecure", action="append", default=[], metavar="HOST[:PORT]",
                   help="a registry image pinning asks over plain http (repeatable)")
    s.add_argument("--checkpoint-registry", default=None, metavar="HOST[:PORT]/PREFIX",
                   help="where checkpoints are stored, one repository per tenant under PREFIX "
                        "(default: checkpoints off)")
    s.add_argument("--checkpoint-insecure", action="store_true",
                   help="ask the checkpoint registry over plain http (a test bed's)")
    s.add_argument("--checkpoint-auth-file", default=None, metavar="CONFIG_JSON",
                   help="a docker config.json (a dockerconfigjson Secret's) holding the "
                        "checkpoint registry's credentials; default: anonymous")
    s.add_argument("--checkpoint-ttl", type=float, default=Settings.checkpoint_ttl,
                   help="seconds a checkpoint is kept before the sweep deletes it")
    s.add_argument("--checkpoint-max-bytes", type=int, default=Settings.checkpoint_max_bytes,
                   help="the most state bytes one checkpoint holds (all its sandboxes)")
    s.add_argument("--checkpoint-sweep-interval", type=float,
                   default=Settings.checkpoint_sweep_interval,
                   help="seconds between sweeps of expired checkpoints")
    s.add_argument("--pause-idle-after", type=float, default=Settings.pause_idle_after,
                   metavar="SECONDS",
                   help="pause (checkpoint, then release) a handed-out agent sandbox whose "
                        "holder made no execd call for SECONDS; 0: off (needs "
                        "--checkpoint-registry)")
    s.add_argument("--node-lost-after", type=float, default=Settings.node_lost_after,
                   metavar="SECONDS",
                   help="end a handed-out sandbox, with a reason, once its Node has been "
                        "not Ready for SECONDS (one whose Node is deleted: at once); 0: only "
                        "deleted Nodes (default %(default)g)")
    s.add_argument("--tls-cert-file", default=None,
                   help="PEM serving certificate: the API is served over https; the file is "
                        "re-read when it changes (a renewed Secret), no restart")
    s.add_argument("--tls-key-file", default=None, help="PEM key of --tls-cert-file")
    s.add_argument("--tls-ca-file", default=None,
                   help="PEM CA bundle a standby verifies the leader's certificate with "
                        "(default: the system CAs); also what --ca-configmap publishes")
    s.add_argument("--tls-server-name", default="",
                   help="the name the leader's certificate is verified for (SNI): the "
                        "Service's DNS name, since a standby reaches the leader by pod IP")
    s.add_argument("--tls-reload-interval", type=float, default=T.RELOAD_INTERVAL_S,
                   help="seconds between checks of the TLS files for a renewal")
    s.add_argument("--ca-configmap", default="", metavar="NAMESPACE/NAME",
                   help="keep --tls-ca-file's bundle in this ConfigMap (key ca.crt), for "
                        "trainers' $SANDMAN_CA_FILE")
    s.add_argument("--insecure-http", action="store_true",
                   help="serve plain http although --auth kubernetes: ServiceAccount and "
                        "sandbox tokens then cross the network in clear text (refused "
                        "otherwise; local use only)")
    s.add_argument("--otlp-endpoint", default="", metavar="URL",
                   help="export traces over OTLP/HTTP to URL (http(s)://host:port, the "
                        "receiver's base: /v1/traces is added); empty: no traces")
    s.add_argument("--trace-sample-ratio", type=float, default=1.0,
                   help="the share of traces the controller starts that are kept; a "
                        "caller's own sampling decision is followed")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one object per line (time, level, logger, message)")
    return ap.parse_args(argv)


def check_tls_flags(args: argparse.Namespace) -> bool:
    """True when the API is served over https; ValueError (one line) on a bad combination.
    Fail closed: tokens never cross the network in clear text unless explicitly asked for."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    tls = bool(args.tls_cert_file)
    if tls and args.insecure_http:
        raise ValueError("--insecure-http contradicts --tls-cert-file")
    if args.auth == "kubernetes" and not tls and not args.insecure_http:
        raise ValueError("--auth kubernetes needs TLS (--tls-cert-file, --tls-key-file): "
                         "callers' tokens would cross the network in clear text; "
                         "--insecure-http allows that explicitly (local use only)")
    if args.ca_configmap and (not args.tls_ca_file or args.ca_configmap.count("/") != 1):
        raise ValueError("--ca-configmap NAMESPACE/NAME needs --tls-ca-file")
    return tls


def tenant_weights(items: list[str]) -> dict[str, int]:
    """--tenant-weight NAMESPACE=N, each once; a bad one is a ValueError of one line."""
    out: dict[str, int] = {}
    for item in items:
        tenant, eq, n = item.partition("=")
        if not eq or not contract.is_dns_label(tenant) or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--tenant-weight {item!r}: expected NAMESPACE=N, N an integer >= 1")
        if tenant in out:
            raise ValueError(f"--tenant-weight: {tenant} given twice")
        out[tenant] = int(n)
    return out


def settings_from(args: argparse.Namespace) -> Settings:
    """The controller's Settings from its flags (tests build pods exactly as `serve` would)."""
    return Settings(
        namespace=args.namespace,
        limits=Limits(rate=args.rate, burst=args.burst, max_creating=args.max_creating,
                      max_live=args.max_live, job_max_creating=args.job_max_creating,
                      job_max_live=args.job_max_live,
                      tenant_max_creating=args.tenant_max_creating,
                      tenant_max_live=args.tenant_max_live,
                      tenant_weights=tenant_weights(args.tenant_weight)),
        ready_check=args.ready_check, node_pool_label=args.node_pool_label,
        sweep_interval=args.sweep_interval, sweep_grace=args.sweep_grace,
        default_idle_timeout=args.idle_timeout, ready_budget=args.ready_budget,
        warm_budget=Budget(pods=args.warm_budget_pods, cpu=args.warm_budget_cpu,
                           per_key=args.warm_max_per_key,
                           roles=tuple(r for r in args.warm_demand_roles.split(",") if r)),
        api_timeout=args.api_timeout, default_lifetime=args.default_lifetime,
        conditions_attempts=args.conditions_attempts,
        conditions_egress_probe=args.conditions_egress_probe,
        # The API server's Service address (the kubelet sets it in every pod) is never
        # allowed either; netguard carves it out of wider entries at apply time.
        api_server=_api_server(),
        min_lifetime=args.min_lifetime, max_lifetime=args.max_lifetime,
        pod_template=(load_pod_template(args.pod_template_file) if args.pod_template_file
                      else {}),
        tenants=args.auth == "kubernetes",
        max_reuse=args.max_reuse,
        baseline_scope=args.baseline_scope,
        snapshot_base=args.snapshot_base == "on",
        books_key=_read_key(args.books_key_file),
        prepull_images=tuple(check_images(args.prepull_image, "--prepull-image")),
        image_pinning=args.image_pinning,
        registry_insecure=tuple(args.registry_insecure),
        checkpoint_registry=args.checkpoint_registry,
        checkpoint_insecure=args.checkpoint_insecure,
        checkpoint_credentials=_registry_creds(args.checkpoint_auth_file,
                                               args.checkpoint_registry),
        checkpoint_ttl=args.checkpoint_ttl, checkpoint_max_bytes=args.checkpoint_max_bytes,
        checkpoint_sweep_interval=args.checkpoint_sweep_interval,
        pause_idle_after=args.pause_idle_after,
        node_lost_after=args.node_lost_after,
        policy=SandboxPolicy(image=args.image, guard=args.guard,
                             ingress_from=tuple(args.ingress_from or ("0.0.0.0/0",)),
                             # The pods this replica builds admit its execd check's source.
                             controller_ip=_ip_or_none(args.advertise_address),
                             # As the webhook's: its netguard args carry egress_never.
                             egress_ceiling=tuple(e.text for e in egress.Ceiling.parse(
                                 _split(args.egress_ceiling)).entries),
                             egress_never=tuple(_split(args.egress_never)),
                             **gpu_policy(args)))


def _split(items: list[str]) -> list[str]:
    return [x.strip() for item in items for x in item.split(",") if x.strip()]


def _api_server() -> tuple[str, ...]:
    ip = _ip_or_none(os.environ.get(contract.KUBERNETES_SERVICE_HOST_ENV, ""))
    return (ip,) if ip else ()


def _read_key(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read().strip()


def _registry_creds(path: str | None, registry: str | None) -> AuthFile | None:
    """The checkpoint registry's credentials from a docker config.json, read again whenever
    the file changes (a rotated Secret); a file without them stops the start in one line."""
    if not path or not registry:
        return None
    return AuthFile(path, registry.partition("/")[0])


def _ip_or_none(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip().strip("[]"))) if text else None
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    try:
        host, port = args.listen.rsplit(":", 1)
        provider = tracing.configure(args.otlp_endpoint, args.trace_sample_ratio)
        settings = settings_from(args)
        https = check_tls_flags(args)
        serving_tls = T.ServingTLS(args.tls_cert_file, args.tls_key_file) if https else None
        peer_ca = T.PeerCA(args.tls_ca_file)
        labels = label_policy(args.caller_label_prefix)
        threads = max(32, min(256, args.max_creating))
        # One kept-alive connection per API thread: a smaller pool re-did TLS handshakes under
        # bursts (seen in a profile at 50 creates/s).
        api = load_api_client(args.kubeconfig, pool=threads + 8)
        # Bound here, before anything starts: a port in use is a one-line refusal, and port 0
        # is the kernel's choice, advertised and printed as the port it is.
        sock = bind(host, int(port))
        port = sock.getsockname()[1]
        elector = LeaderElector(KubeClient(api, args.namespace, threads=4), args.lease_name,
                                args.lease_duration, args.lease_renew,
                                advertise_url=advertise_url(args.advertise_address, host, port,
                                                            https))
    except Exception as e:  # noqa: BLE001 - bad flags or config: one line, exit 2
        logs.say(args.log_format, "controller", f"controller: {e}", "ERROR")
        return 2
    if elector.advertise_url is None:
        log.warning("no --advertise-address: as leader, standbys cannot forward API calls "
                    "here and answer NotLeader (retried by the SDK) instead")
    if args.image_pinning == "off":
        log.warning("*** --image-pinning off: tags are used as given; a tag that moves "
                    "changes the image under a running job (and its grading). ***")
    if args.insecure_http:
        log.warning("*** --insecure-http: the API is plain http, so ServiceAccount tokens and "
                    "sandbox tokens cross the network in clear text. For local use only; the "
                    "chart always serves https. ***")
    if args.auth == "none":
        log.warning("*** --auth none: NO AUTHENTICATION. Anyone who reaches %s can acquire, "
                    "list, release and drain every sandbox and read their tokens. For local "
                    "use only; the chart always runs --auth kubernetes. ***", f"{host}:{port}")
        auth: A.NoAuth | A.KubeAuth = A.NoAuth()
    else:
        auth = A.KubeAuth(api, audience=args.auth_audience, ttl=args.auth_cache_ttl,
                          timeout=min(5.0, args.api_timeout))
    state: dict = {"elector": elector}
    app = build_app(state, auth, labels, tracer_provider=provider)

    def serving() -> bool:
        c = state.get("controller")
        return c is not None and c.ready

    def target() -> tuple[str, str] | None:
        # Only a fresh view of the Lease (read within its duration) names a leader to forward to.
        # (The elector sets holder and URL together: a URL always has its holder.)
        if (elector.is_leader or not elector.connected() or not elector.leader_url
                or elector.holder is None):
            return None
        return elector.holder, elector.leader_url

    # Over https a standby verifies the leader (CA file, Service name) and never forwards a
    # caller's token to a plain-http leader.
    forwarder = ForwardToLeader(app, serving, target, identity=elector.identity,
                                verify=peer_ca.context if https else None,
                                server_name=args.tls_server_name or None, require_https=https)
    publisher = None
    if args.ca_configmap:
        from kubernetes import client as kclient

        cm_ns, cm_name = args.ca_configmap.split("/")
        publisher = T.CAPublisher(kclient.CoreV1Api(api), cm_ns, cm_name).publish
    kube = KubeClient(api, args.namespace, threads=threads, request_timeout=settings.api_timeout)

    async def on_started():
        c = Controller(kube, settings)
        await c.start()
        state["controller"] = c

    async def on_lost():
        # Crash-only: a replica that lost the lease must not act; it restarts as a standby.
        # Deleting the pre-pull's own pullers (by uid) is no act on the new leader's; bounded
        # by half the margin left before a standby may take over (--lease-renew).
        log.error("exiting: leadership lost")
        c = state.get("controller")
        if c is not None:
            try:
                await c.prepull.stop(timeout=args.lease_renew / 2)
            except Exception as ex:  # noqa: BLE001 - exit regardless
                log.warning("pre-pull stop failed: %s", ex)
        os._exit(3)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        task = loop.create_task(elector.run(on_started, on_lost))
        tls_task = (loop.create_task(T.watch(serving_tls, peer_ca if https else None, publisher,
                                             args.tls_reload_interval))
                    if https else None)
        try:
            yield
        finally:
            task.cancel()
            if tls_task is not None:
                tls_task.cancel()
            c = state.get("controller")
            if c is not None:
                await c.stop()
            await elector.release()
            await forwarder.aclose()
            kube.shutdown()
            auth.close()
            tracing.shutdown(provider)

    app.router.lifespan_context = lifespan
    # The ~65k objects of the imported libraries never die: freeze them out of the collector,
    # so a full collection during a burst scans only the live books (it paused the event loop
    # for 50-90 ms, and the pacer's token bucket lost those create slots).
    gc.collect()
    gc.freeze()
    # A run start fires thousands of acquires at once: a short accept backlog would turn the
    # burst into SYN retries (1 s each) before the queue even sees them.
    config = uvicorn.Config(
        forwarder, host=host, port=port, log_level="warning", access_log=False,
        log_config=logs.uvicorn_log_config(args.log_format),
        backlog=BACKLOG, timeout_keep_alive=120, loop="uvloop", http="httptools",
        # The same SSLContext object for the whole run: ServingTLS reloads it in place.
        ssl_context_factory=((lambda _config, _default: serving_tls.context)
                             if serving_tls else None))
    logs.say(args.log_format, "controller",
             f"controller: serving {'https' if https else 'http'}://{args.listen.rsplit(':', 1)[0]}"
             f":{port}")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


BACKLOG = 4096


def bind(host: str, port: int) -> socket.socket:
    """The API's listening socket on `host` ("0.0.0.0", "[::]", an address) and `port`."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("", "::"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def label_policy(prefixes: list[str]) -> A.LabelPolicy:
    """The caller-label allowlist from --caller-label-prefix; a reserved prefix is a bad flag."""
    out = []
    for p in prefixes:
        p = p.strip().rstrip("/")
        if not p or A.reserved_prefix(p):
            raise ValueError(f"--caller-label-prefix {p!r}: empty or reserved (Kubernetes' and "
                             "sandman's own prefixes are never a caller's)")
        out.append(p)
    return A.LabelPolicy(tuple(out))


def advertise_url(address: str, listen_host: str, port: int, https: bool = False) -> str | None:
    """http(s)://ADDRESS:PORT for the Lease; None when nothing routable is known."""
    host = address or ("" if listen_host in ("", "0.0.0.0", "::", "[::]") else listen_host)
    if not host:
        return None
    host = host.strip("[]")
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
