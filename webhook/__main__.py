"""python3 -m webhook serve|certs|manifests (see docs/webhook.md)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys

from sandman import egress, logs
from sandman.api import DEFAULT_CPU, DEFAULT_MEMORY
from sandman.contract import KUBERNETES_SERVICE_HOST_ENV, SANDMAN_IMAGE
from sandman.podspec import GUARD_MODES, SandboxPolicy, gpu_args, gpu_policy

# A drain past the pod's termination grace period (30 s by default) ends in SIGKILL.
MAX_DRAIN_SECONDS = 60.0


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", default=SANDMAN_IMAGE,
                   help="the sandman image: netguard init container and execd.py source")
    p.add_argument("--default-cpu", default=DEFAULT_CPU, help="cpu for containers that set none")
    p.add_argument("--default-memory", default=DEFAULT_MEMORY,
                   help="memory for containers that set none")
    p.add_argument("--guard", choices=GUARD_MODES, default="always",
                   help="always: netguard in every sandbox; egress-deny: only egress=deny pods")
    p.add_argument("--ingress-from", action="append", default=None, metavar="CIDR",
                   help="who may reach execd when the pod has no ingress-from annotation "
                        "(repeatable; default 0.0.0.0/0)")
    p.add_argument("--egress-ceiling", action="append", default=None, metavar="ENTRY",
                   help="egress allowlist entries a pod's sandman.dev/egress-allow may stay "
                        "within (repeatable or comma-separated; CIDR:PORT, svc/NAME.NS:PORT, "
                        "* for a port or a Service name); none: every allowlist is refused")
    p.add_argument("--egress-never", action="append", default=None, metavar="CIDR",
                   help="never reachable through an allowlist, carved out of wider entries "
                        "(repeatable or comma-separated; besides link-local, the metadata "
                        "addresses and the API server)")
    p.add_argument("--allow-secrets", action="store_true",
                   help="admit Secret volumes and env from Secrets in sandboxes (refused by "
                        "default: a legacy service-account-token Secret looks like any other)")
    gpu_args(p)


def _split(items: list[str] | None) -> tuple[str, ...]:
    return tuple(p.strip() for item in items or () for p in item.split(",") if p.strip())


def api_server_addresses() -> tuple[str, ...]:
    """The API server's address as the kubelet gives it to every container (the `kubernetes`
    Service's ClusterIP); () when unset or not an address: allowlists are then refused."""
    host = os.environ.get(KUBERNETES_SERVICE_HOST_ENV, "").strip()
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        return ()


def policy_from(args: argparse.Namespace, api_server: tuple[str, ...] | None = None
                ) -> SandboxPolicy:
    """The policy of the flags; `api_server`: the API server's addresses (serve reads them),
    None where no pod is judged against them."""
    ceiling = egress.Ceiling.parse(_split(args.egress_ceiling))  # ValueError: one line
    return SandboxPolicy(image=args.image, default_cpu=args.default_cpu,
                         default_memory=args.default_memory, guard=args.guard,
                         ingress_from=tuple(args.ingress_from or ("0.0.0.0/0",)),
                         allow_secrets=args.allow_secrets,
                         egress_ceiling=tuple(e.text for e in ceiling.entries),
                         egress_never=_split(args.egress_never), api_server=api_server,
                         **gpu_policy(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m webhook")
    sub = parser.add_subparsers(dest="verb", required=True)

    serve = sub.add_parser("serve", help="serve /mutate, /validate, /healthz, /readyz, /metrics")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8443, help="0 picks a free port (printed)")
    serve.add_argument("--tls-cert", help="PEM certificate (reloaded when the file changes)")
    serve.add_argument("--tls-key", help="PEM key (reloaded when the file changes)")
    serve.add_argument("--self-signed-dir", metavar="DIR",
                       help="make (or reuse) a CA and serving pair in DIR; DIR/ca.crt is the "
                            "caBundle")
    serve.add_argument("--dns", action="append", default=[], help="SAN for --self-signed-dir")
    serve.add_argument("--ip", action="append", default=[], help="SAN for --self-signed-dir")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--log-format", choices=("text", "json"), default="text",
                       help="json: one object per line (time, level, logger, message)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="larger reviews are answered 413 unread (default 1 MiB)")
    serve.add_argument("--drain-seconds", type=float, default=0.0,
                       help="on SIGTERM, keep serving this long with /readyz failing and "
                            "every response closing its connection, then shut down (0: at "
                            "once; the chart sets 5)")
    serve.add_argument("--request-read-seconds", type=float, default=None,
                       help="a request not received whole this long after its first byte "
                            "closes its connection (default 5)")
    _policy_args(serve)

    certs = sub.add_parser("certs", help="CA and serving certificate in a Secret, caBundle")
    certs.add_argument("action", choices=["ensure", "self-signed"])
    certs.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    certs.add_argument("--namespace", default="sandman-system")
    certs.add_argument("--service", default="sandman-webhook")
    certs.add_argument("--secret", default="sandman-webhook-tls")
    certs.add_argument("--mutating-config", action="append", default=[])
    certs.add_argument("--validating-config", action="append", default=[])
    certs.add_argument("--dns", action="append", default=[], help="extra SAN")
    certs.add_argument("--ip", action="append", default=[], help="extra SAN")
    certs.add_argument("--no-service-names", action="store_true",
                       help="do not add the service's DNS names (url: client configs)")
    certs.add_argument("--force-ca-rotation", action="store_true")
    certs.add_argument("--propagation-seconds", type=float, default=10.0,
                       help="wait after patching caBundle before serving a new CA's certificate")
    certs.add_argument("--write-dir", help="also write tls.crt, tls.key, ca.crt here")
    certs.add_argument("--dir", help="self-signed: the directory")

    man = sub.add_parser("manifests", help="print the webhook configurations as JSON")
    man.add_argument("--name", default="sandman-webhook")
    man.add_argument("--namespace", default="sandman-system")
    man.add_argument("--service", default="sandman-webhook")
    man.add_argument("--port", type=int, default=443)
    man.add_argument("--url", help="use url: client config (base URL) instead of service:")
    man.add_argument("--ca-file", help="PEM bundle for caBundle")

    guard = sub.add_parser("guard", help="print an egress-deny pod (no sandbox label) with "
                                         "sandman's guard and NET_RAW drops, as admitted")
    guard.add_argument("-f", "--file", default="-", help="the pod as JSON ('-': stdin)")
    _policy_args(guard)

    args = parser.parse_args(argv)
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))

    if args.verb == "serve":
        from webhook import certs as certs_mod
        from webhook.server import serve as run

        if not 0 <= args.drain_seconds <= MAX_DRAIN_SECONDS:
            parser.error(f"--drain-seconds must be between 0 and {MAX_DRAIN_SECONDS:g}")
        try:
            policy = policy_from(args, api_server_addresses())
        except ValueError as e:
            parser.error(str(e))  # one line and exit 2, like the flags argparse checks
        if args.self_signed_dir:
            d = certs_mod.self_signed_dir(args.self_signed_dir, args.dns or ["localhost"],
                                          args.ip or ["127.0.0.1", "::1"])
            cert, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        elif args.tls_cert and args.tls_key:
            cert, key = args.tls_cert, args.tls_key
        else:
            parser.error("serve needs --tls-cert and --tls-key, or --self-signed-dir")
        from webhook.app import MAX_BODY_BYTES
        from webhook.server import REQUEST_READ_SECONDS

        max_body = MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
        read_s = (REQUEST_READ_SECONDS if args.request_read_seconds is None
                  else args.request_read_seconds)
        if max_body < 1 or read_s <= 0:
            parser.error("--max-body-bytes and --request-read-seconds must be positive")
        run(policy, args.host, args.port, cert, key, log_level=args.log_level.lower(),
            max_body=max_body, read_seconds=read_s, drain_seconds=args.drain_seconds,
            log_format=args.log_format)
        return 0

    if args.verb == "certs":
        from webhook import certs as certs_mod

        names = [] if args.no_service_names else certs_mod.service_dns_names(args.service,
                                                                             args.namespace)
        names += args.dns
        if args.action == "self-signed":
            if not args.dir:
                parser.error("certs self-signed needs --dir")
            certs_mod.self_signed_dir(args.dir, names or ["localhost"], args.ip)
            print(os.path.join(args.dir, "ca.crt"))
            return 0
        from kubernetes import client, config

        if args.kubeconfig:
            config.load_kube_config(args.kubeconfig)
        else:
            config.load_incluster_config()
        res = certs_mod.ensure(client.CoreV1Api(), client.AdmissionregistrationV1Api(),
                               args.namespace, args.secret, names, args.ip,
                               args.mutating_config, args.validating_config,
                               args.force_ca_rotation, args.propagation_seconds, args.write_dir)
        print(json.dumps({"ca_rotated": res.ca_rotated, "bundle_patched": res.bundle_patched,
                          "leaf_issued": res.leaf_issued}))
        return 0

    if args.verb == "guard":
        from sandman.podspec import SandboxError, guarded_pod

        try:
            text = sys.stdin.read() if args.file == "-" else open(args.file).read()
            print(json.dumps(guarded_pod(json.loads(text), policy_from(args)), indent=2))
        except (OSError, ValueError, SandboxError, AttributeError) as e:
            print(f"webhook guard: {e}", file=sys.stderr)
            return 1
        return 0

    if args.verb == "manifests":
        from webhook.manifests import configurations

        bundle = open(args.ca_file, "rb").read() if args.ca_file else None
        service = None if args.url else (args.namespace, args.service, args.port)
        m, v = configurations(args.name, args.namespace, bundle, url=args.url, service=service)
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": [m, v]}, indent=2))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
