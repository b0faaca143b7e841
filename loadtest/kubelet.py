"""An "execd kubelet" for kwok nodes: a real execd for every Ready pod of a namespace.

kwok runs no container, but the test bed gives pods loopback IPs (127.64.0.0/16). This process
watches the namespace and starts `execd/execd.py` on each pod's IP and port 9470 with the token
hash from the pod's annotation (what the pod itself would run), and kills it when the pod goes.
It refuses any pod IP outside 127.0.0.0/8: nothing here listens on a real network.

    python -m loadtest.kubelet --kubeconfig KC --namespace NS [--max-procs 200] [--max-s 3600]
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kubernetes import client, config, watch

from sandman import contract

EXECD = Path(__file__).resolve().parents[1] / "execd" / "execd.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.kubelet")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--max-procs", type=int, default=200,
                    help="execd processes at most (each is ~15 MB plus its bash)")
    ap.add_argument("--max-s", type=float, default=3600.0)
    a = ap.parse_args(argv)
    cfg = client.Configuration()
    config.load_kube_config(config_file=a.kubeconfig, client_configuration=cfg)
    core = client.CoreV1Api(client.ApiClient(cfg))
    root = Path(tempfile.mkdtemp(prefix="sandman-kubelet-"))
    procs: dict[str, subprocess.Popen] = {}
    stop = {"now": False}

    def on_term(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    def kill(name: str) -> None:
        p = procs.pop(name, None)
        if p and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    print(f"kubelet: watching {a.namespace}", flush=True)
    deadline = time.monotonic() + a.max_s
    try:
        while not stop["now"] and time.monotonic() < deadline:
            w = watch.Watch()
            try:
                for ev in w.stream(core.list_namespaced_pod, a.namespace, timeout_seconds=2,
                                   deserialize=False):
                    pod = ev["object"]
                    md, st = pod.get("metadata") or {}, pod.get("status") or {}
                    name = md.get("name")
                    if ev["type"] == "DELETED" or md.get("deletionTimestamp"):
                        kill(name)
                    elif st.get("podIP") and name not in procs and len(procs) < a.max_procs:
                        sha = (md.get("annotations") or {}).get(contract.ANNOTATION_TOKEN_SHA256)
                        if sha and ipaddress.ip_address(st["podIP"]).is_loopback:
                            procs[name] = subprocess.Popen(
                                [sys.executable, str(EXECD), "--listen",
                                 f"{st['podIP']}:{contract.EXECD_PORT}", "--token-sha256", sha,
                                 "--netguard-status", str(root / "none.json"), "--root", "/tmp"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, cwd=root)
                    if stop["now"]:
                        w.stop()
                        break
            except Exception as e:  # noqa: BLE001 - a broken watch restarts, bounded above
                print(f"kubelet: watch restarts: {e}", flush=True)
                time.sleep(0.5)
    finally:
        for name in list(procs):
            kill(name)
        shutil.rmtree(root, ignore_errors=True)
    print("kubelet: stopped, every execd killed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
