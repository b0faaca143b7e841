"""`python -m testbed build|up|down|status`: the test bed by hand (make testbed-*)."""

from __future__ import annotations

import argparse
import sys

from testbed import build
from testbed.cluster import Testbed, TestbedError, default_state_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed", description=__doc__)
    ap.add_argument("--state-dir", default=None,
                    help="state dir (default .testbed/manual, or $SANDMAN_TESTBED_STATE/manual)")
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("build", help="build the binaries into the cache (once per pinned version)")
    up = sub.add_parser("up", help="start in the background and print the KUBECONFIG export")
    up.add_argument("--nodes", type=int, default=20, help="kwok nodes (default 20)")
    sub.add_parser("down", help="stop what `up` started; waits for every process to exit")
    sub.add_parser("status", help="exit 0 when every component runs and the API is ready")
    args = ap.parse_args(argv)
    state = default_state_dir("manual") if args.state_dir is None else __import__("pathlib").Path(
        args.state_dir)
    try:
        if args.verb == "build":
            for name, path in build.build().items():
                print(f"{name}: {path}")
            return 0
        running = Testbed.attach(state)
        if args.verb == "up":
            if args.nodes < 1:
                print("testbed: --nodes must be >= 1", file=sys.stderr)
                return 2
            if running and all(c.alive() for c in running.components):
                print(f"# test bed already up ({state})", file=sys.stderr)
                print(f"export KUBECONFIG={running.kubeconfig}")
                return 0
            if running:  # half-dead leftovers of an earlier run: clean them first
                running.stop()
            tb = Testbed(state, nodes=args.nodes).start()
            print(f"# test bed up: {tb.server}, {tb.nodes} kwok nodes, logs in {tb.logs}",
                  file=sys.stderr)
            print(f"export KUBECONFIG={tb.kubeconfig}")
            return 0
        if args.verb == "down":
            if not running:
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
            print(f"export KUBECONFIG={running.kubeconfig}")
            return 0 if ok and ready else 1
    except (TestbedError, build.BuildError) as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
