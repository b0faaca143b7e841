"""The admission webhook (`python -m webhook serve`) as a local process over TLS on 127.0.0.1,
and its registration with the test bed's API server by `url:`.

    wh = start_webhook(workdir)                   # self-signed CA in workdir/certs
    reg = registration(admission_api, ns, wh.url, wh.ca.read_bytes()).create()
    wait_webhook_active(core, ns)                 # the API server calls it now
"""

from __future__ import annotations

import re
import secrets
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from sandman import contract
from testbed.procs import Proc
from webhook.manifests import Registration

WEBHOOK_NAMESPACE = "sandman-system"  # where the chart installs it: the configurations' service
_SERVING = re.compile(r"serving https://127\.0\.0\.1:(\d+)")


@dataclass
class Webhook:
    proc: Proc
    port: int
    ca: Path  # the caBundle for a registration
    certdir: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.proc.log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def client(self, **kw) -> httpx.Client:
        # Like the API server's Go client, which disables Nagle on its connections: otherwise
        # the client's own header/body writes stall 40 ms and hide what the server does.
        ctx = ssl.create_default_context(cafile=str(self.ca))
        transport = httpx.HTTPTransport(verify=ctx, socket_options=[
            (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        return httpx.Client(base_url=self.url, transport=transport, timeout=10, **kw)

    def stop(self) -> None:
        self.proc.stop(timeout=10)


def start_webhook(workdir: Path, *extra: str, certdir: Path | None = None,
                  ca: Path | None = None, args: list[str] | None = None,
                  wait_ready: bool = True, timeout: float = 30.0) -> Webhook:
    """`python -m webhook serve --host 127.0.0.1`, log in workdir/webhook.log.

    TLS: with `certdir` it serves certdir/tls.{crt,key} (caBundle `ca`, default
    certdir/ca.crt); else a self-signed CA and pair made in workdir/certs. `args` replaces the
    port and TLS arguments (a chart's rendered Deployment args); `extra` is appended. Returns
    once the server printed its address and, with `wait_ready`, /readyz answered 200 over TLS
    verified against the CA.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "webhook.log"
    if args is not None:
        tls = list(args)
        certdir = certdir or workdir
    elif certdir is None:
        certdir = workdir / "certs"
        tls = ["--port", "0", "--self-signed-dir", str(certdir), "--ip", "127.0.0.1"]
    else:
        tls = ["--port", "0", "--tls-cert", str(certdir / "tls.crt"),
               "--tls-key", str(certdir / "tls.key")]
    seen = log.stat().st_size if log.exists() else 0  # a reused workdir keeps older lines
    p = Proc("webhook", [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1",
                         *tls, *extra], log).start()
    deadline = time.monotonic() + timeout
    try:
        port = None
        while port is None:
            if not p.alive():
                raise RuntimeError(f"webhook exited {p.exit_code()}: {p.tail()}")
            m = _SERVING.search(log.read_bytes()[seen:].decode(errors="replace"))
            if m:
                port = int(m.group(1))
            elif time.monotonic() > deadline:
                raise RuntimeError(f"webhook did not start in {timeout:g} s: {p.tail()}")
            else:
                time.sleep(0.05)
        wh = Webhook(p, port, ca or certdir / "ca.crt", certdir)
        while wait_ready:
            try:
                with wh.client() as c:
                    if c.get("/readyz").status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"webhook not ready in {timeout:g} s: {p.tail()}")
            time.sleep(0.05)
        return wh
    except BaseException:
        p.stop(timeout=5)
        raise


def registration(admission_api, namespace: str, url: str, ca: bytes,
                 prefix: str = "sandman-tb") -> Registration:
    """Both webhook configurations by `url:` with the CA, scoped to `namespace` (a leftover
    Fail-policy configuration cannot hurt pods anywhere else). Unique name per call."""
    return Registration(admission_api, f"{prefix}-{namespace}-{secrets.token_hex(2)}", url, ca,
                        [namespace], WEBHOOK_NAMESPACE)


def probe_pod(namespace: str) -> dict:
    """A labelled sandbox pod as a trainer's own code would send it (the webhook completes it)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "lt-probe-",
                         "labels": {contract.LABEL_SANDBOX: contract.SANDBOX_TRUE,
                                    contract.LABEL_EGRESS: contract.EGRESS_DENY},
                         "annotations": {contract.ANNOTATION_TOKEN_SHA256: "0" * 64}},
            "spec": {"containers": [{"name": "task", "image": "registry.invalid/lt/task:1"}]}}


def wait_webhook_active(core, namespace: str, timeout: float = 20.0) -> None:
    """Until a dry-run create in `namespace` comes back mutated: the API server has picked up
    the configurations and calls the webhook."""
    from kubernetes.client.rest import ApiException

    deadline = time.monotonic() + timeout
    while True:
        try:
            got = core.create_namespaced_pod(namespace, probe_pod(namespace), dry_run="All")
            if got.spec.init_containers and got.spec.enable_service_links is False:
                return
        except ApiException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"webhook configurations not active after {timeout:g} s")
        time.sleep(0.2)
