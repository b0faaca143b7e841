"""`python3 -m sandman.selftest`: acquire one sandbox, use it as this pod may, release it.

What `helm test` runs (charts/sandman/templates/tests/controller-pod.yaml), and what an
operator can run from a trainer pod. Exit 0 with one `ok: ...` line, or 1 with `FAIL: ...`.

netguard admits only `sandbox.ingressFrom` (plus the node and the controller that built the
pod) to execd's port. When this pod's own IP is inside those sources, it runs `echo ok` in the
sandbox. When it is not (ingress narrowed to the trainers' CIDR, and this is not a trainer),
running a command is impossible by design, so it checks the guard instead: a connection from
here to execd must not get through. With the controller's default `--ready-check execd` the
acquire itself has then shown that execd answered through the same guard from the controller.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from sandman.client import Client, SandmanError
from sandman.client._core import ENV_URL

# A guard that drops answers nothing: a connect that has not succeeded within this is dropped.
REFUSAL_WAIT_S = 3.0


def admitted(own_ip: str | None, sources: list[str]) -> bool:
    """Whether netguard lets `own_ip` in: no sources given means the default (anywhere)."""
    if not sources or not own_ip:
        return True
    ip = ipaddress.ip_address(own_ip)
    for s in sources:
        net = ipaddress.ip_network(s.strip(), strict=False)
        if net.version == ip.version and ip in net:
            return True
    return False


def connects(address: str, port: int, timeout: float = REFUSAL_WAIT_S) -> bool:
    fam = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((address, port))
            return True
        except OSError:  # timeout (dropped), refused, unreachable: not through
            return False


def run(controller: str | None, image: str, job: str, timeout_s: float, own_ip: str | None,
        sources: list[str]) -> str:
    """The one-line success message; raises SystemExit("FAIL: ...") otherwise."""
    inside = admitted(own_ip, sources)
    # None: the in-cluster configuration ($SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE).
    with Client(controller) as client:
        with client.acquire(image=image, job=job, cpu="500m", memory="512Mi",
                            timeout_s=timeout_s) as sb:
            if inside:
                r = sb.exec("echo ok", timeout=60)
                print(f"sandbox {sb.id}: exit {r.exit_code}: {r.output.strip()!r}")
                if not r.ok or r.output.strip() != "ok":
                    raise SystemExit(f"FAIL: expected 'ok', got exit {r.exit_code}: "
                                     f"{r.output!r} {r.error}")
                done = "ran `echo ok`"
            else:
                if connects(sb.address, sb.port):
                    raise SystemExit(
                        f"FAIL: execd at {sb.address}:{sb.port} accepted a connection from "
                        f"{own_ip}, which is outside the sandbox ingress sources "
                        f"{','.join(sources)}: the in-pod guard is not in place")
                done = (f"execd refused this pod ({own_ip} is outside {','.join(sources)}, "
                        "as configured; run this from a trainer pod to exec)")
        if not sb.released:
            raise SystemExit(f"FAIL: the controller did not confirm the release of {sb.id}")
    return f"ok: acquired, {done}, released"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m sandman.selftest", description=__doc__)
    p.add_argument("--controller-url", default=None,
                   help="controller URL (default: $SANDMAN_URL; the token is read from "
                        "$SANDMAN_TOKEN_FILE, the CA from $SANDMAN_CA_FILE)")
    p.add_argument("--image", default="python:3.12-slim")
    p.add_argument("--job", default="selftest")
    p.add_argument("--timeout", type=float, default=300.0, help="acquire timeout_s")
    p.add_argument("--own-ip", default=os.environ.get("SANDMAN_POD_IP") or None,
                   help="this pod's IP (default: $SANDMAN_POD_IP)")
    p.add_argument("--ingress-from", action="append", default=[], metavar="CIDR",
                   help="the sandbox ingress sources (the chart's sandbox.ingressFrom); "
                        "none: anywhere")
    args = p.parse_args(argv)
    if not (args.controller_url or os.environ.get(ENV_URL)):
        p.error(f"--controller-url or ${ENV_URL} is required")
    sources = [s for x in args.ingress_from for s in x.split(",") if s.strip()]
    try:
        print(run(args.controller_url, args.image, args.job, args.timeout, args.own_ip, sources))
    except SandmanError as e:
        print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
