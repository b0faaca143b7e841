"""`python -m testbed build|up|down|status`: the test bed by hand (make testbed-*)."""

from __future__ import annotations

import argparse
import os
import sys

from testbed import build
from testbed.cluster import Testbed, TestbedError, default_state_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed", description=__doc__)
    ap.add_argument("--state-dir", default=None,
                    help="state dir (default .testbed/manual, or $SANDMAN_TESTBED_STATE/manual)")
    sub = ap.add_subparsers(dest="verb", required=True)
    env = os.environ.get("REAL_NODE", "")
    real_default = env == "1"
    b = sub.add_parser("build", help="build the binaries into the cache (once per pinned version)")
    b.add_argument("--real-node", action="store_true",
                   default=real_default or (env == "auto" and os.geteuid() == 0),
                   help="also the real node's kubelet, kube-proxy, CoreDNS, kube-router, crictl")
    b.add_argument("--only", action="append", default=[], choices=sorted(build.binaries()),
                   help="build just this binary (repeatable; `make deps`: helm)")
    up = sub.add_parser("up", help="start in the background and print the KUBECONFIG export")
    up.add_argument("--nodes", type=int, default=20, help="kwok nodes (default 20)")
    up.add_argument("--real-node", action="store_true", default=real_default,
                    help="add one node that runs real containers (default: $REAL_NODE)")
    up.add_argument("--wait", type=float, default=0.0,
                    help="seconds to wait while another test bed holds the machine's real node")
    sub.add_parser("down", help="stop what `up` started; waits for every process to exit")
    sub.add_parser("status", help="exit 0 when every component runs and the API is ready")
    args = ap.parse_args(argv)
    state = default_state_dir("manual") if args.state_dir is None else __import__("pathlib").Path(
        args.state_dir)
    try:
        if args.verb == "build":
            if args.only:
                bins = build.build(only=tuple(args.only))
            else:
                bins = dict(build.build(), **(build.build_realnode() if args.real_node else {}))
            for name, path in bins.items():
                print(f"{name}: {path}")
            return 0
        running = Testbed.attach(state)
        if args.verb == "up":
            if args.nodes < (0 if args.real_node else 1):
                print("testbed: --nodes must be >= 1 (>= 0 with --real-node)", file=sys.stderr)
                return 2
            if running and all(c.alive() for c in running.components):
                print(f"# test bed already up ({state})", file=sys.stderr)
                print(f"export KUBECONFIG={running.kubeconfig}")
                return 0
            if running:  # half-dead leftovers of an earlier run: clean them first
                running.stop()
            tb = Testbed(state, nodes=args.nodes, real_node=args.real_node,
                         real_node_wait=args.wait).start()
            real = ""
            if tb.realnode is not None:
                tb.realnode.set_owner(None)  # outlives this command: only `down` stops it
                rn = tb.realnode
                real = (f", real node {rn.node_ip} (pods {rn.pod_cidr}, CRI {rn.endpoint}) "
                        f"up in {rn.timings['prepare'] + rn.timings['start']:.1f}s")
            print(f"# test bed up: {tb.server}, {tb.nodes} kwok nodes{real}, logs in {tb.logs}",
                  file=sys.stderr)
            print(f"export KUBECONFIG={tb.kubeconfig}")
            return 0
        if args.verb == "down":
            if not running:
                from testbed import realnode

                rec = realnode.read_record()
                if rec and rec.get("state_dir") == str(state):  # a crashed `up`: clean anyway
                    left = realnode.cleanup(rec)
                    if left:
                        print(f"testbed: real node leftovers: {'; '.join(left[:6])}",
                              file=sys.stderr)
                        return 1
                    print("testbed: removed a crashed real node's leftovers", file=sys.stderr)
                    return 0
                print(f"testbed: not running ({state})", file=sys.stderr)
                return 0
            running.stop()
            print("testbed: stopped", file=sys.stderr)
            return 0
        if args.verb == "status":
            if not running:
                print(f"testbed: not running ({state})")
                return 1
            ok = True
            for c in running.components:
                alive = c.alive()
                ok &= alive
                print(f"{c.name:24} {'running' if alive else 'DEAD'}  pid {c.pid}  log {c.log}")
            try:
                ready = running._apiserver_ready() and running._nodes_ready()
            except Exception as e:  # noqa: BLE001 - status reports, never raises
                ready = False
                print(f"api: {e}")
            print(f"api {running.server}: {'ready' if ready else 'NOT ready'}")
            if running.realnode is not None:
                for part, part_ok, detail in running.realnode.status():
                    ok &= part_ok
                    print(f"real {part:28} {'ok' if part_ok else 'NOT ok'}  {detail}")
            print(f"export KUBECONFIG={running.kubeconfig}")
            return 0 if ok and ready else 1
    except (TestbedError, build.BuildError) as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
