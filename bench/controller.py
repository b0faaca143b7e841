"""`make bench-controller` (`python -m bench.controller --write-docs`): the controller on the test bed (kwok nodes), three measurements.

1. A ramp of concurrent sandboxes (default 99, 500, 1000, 2000, 5000, 12000) paced at 25/s:
   acquired, leaked, achieved create rate, acquire latency p50/p99 with the queue included,
   controller and apiserver RSS at the peak. Every step fires all its acquires at once, holds
   them, releases them and waits until the namespace is empty (the paper's ramp).
2. Warm-hit acquire p50/p99 (sequential, one caller).
3. Acquire overhead against a bare `create_namespaced_pod` + watch-until-Ready loop, same run.
4. Authentication's and TLS's cost: warm-hit acquire p50 through four controllers side by side,
   `--auth none` over http and over https, `--auth kubernetes` over https (TokenReview +
   SubjectAccessReview, cached 10 s; what the chart runs) and `--auth kubernetes
   --auth-cache-ttl 0` over https (both reviews on every call), rounds interleaved; each
   caller keeps its connection (one TLS handshake per turn), as the SDK does.

Writes a markdown table to stdout (and `--out FILE`; `--write-docs`: its section of
docs/benchmarks.md, above the earlier runs' notes kept there), a plot of acquired-vs-time per
step (`--plot FILE`). Not a test: numbers are reported, not asserted. `--smoke`: one step of 3,
3 warm hits, 2 cold acquires, 2 acquires per authentication arm; on --kubeconfig's cluster
when given (tests/bench/test_smoke.py passes the suite's bed), else a bed of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
from kubernetes import client, config

from bench import docs
from bench.stats import percentile_or_nan as pct
from sandman import api
from testbed.cluster import Testbed, default_state_dir, delete_namespace, new_namespace
from testbed.controller import ControllerProc, local_tls_dir

IMAGE = "registry.invalid/bench/task:1"
SECTION = "## controller: `python -m bench.controller`"


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def fire(url: str, n: int, job: str, timeout_s: float) -> list[tuple]:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout_s + 60, limits=limits) as cl:
        async def one():
            t = time.monotonic()
            try:
                r = await cl.post(url + api.ACQUIRE.path, json={
                    "image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": job,
                    "timeout_s": timeout_s, "warm_ok": False})
                return r.status_code, r.json(), t - t0, time.monotonic() - t0
            except httpx.HTTPError as e:
                return 0, {"error": str(e)}, t - t0, time.monotonic() - t0

        return await asyncio.gather(*(one() for _ in range(n)))


async def release_all(url: str, ids: list[str]) -> None:
    sem = asyncio.Semaphore(200)
    async with httpx.AsyncClient(timeout=60) as cl:
        async def one(i):
            async with sem:
                await cl.delete(url + api.RELEASE.url(id=i))

        await asyncio.gather(*(one(i) for i in ids))


def count_pods(core, ns: str) -> tuple[int, int]:
    items = core.list_namespaced_pod(ns, _preload_content=False)
    pods = json.loads(items.data)["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return len(pods), len(live)


def ramp_step(ctl: ControllerProc, core, ns: str, n: int, apiserver_pid: int, timeout_s: float):
    t0 = time.monotonic()
    res = asyncio.run(fire(ctl.url, n, f"ramp-{n}", timeout_s))
    wall = time.monotonic() - t0
    ok = [r for r in res if r[0] == 201]
    peak_ctl, peak_api = rss_mb(ctl.proc.pid), rss_mb(apiserver_pid)
    _, live = count_pods(core, ns)
    lat = [r[3] - r[2] for r in ok]
    done_times = sorted(r[3] for r in ok)
    creates = [r[1]["timings"] for r in ok]
    asyncio.run(release_all(ctl.url, [r[1]["id"] for r in ok]))
    deadline = time.monotonic() + 600
    total = live
    while time.monotonic() < deadline:
        total, _ = count_pods(core, ns)
        if total == 0:
            break
        time.sleep(1)
    leaked = total
    achieved = (len(ok) - 1) / (done_times[-1] - done_times[0]) if len(ok) > 1 else float("nan")
    return {
        "n": n, "acquired": len(ok), "failed": n - len(ok), "leaked": leaked,
        "live_at_peak": live, "achieved_rate": achieved, "wall_s": wall,
        "p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
        "ready_ms_p50": pct([c["ready_ms"] for c in creates], 50),
        "ctl_rss_mb": peak_ctl, "apiserver_rss_mb": peak_api, "done_times": done_times,
        "errors": sorted({str(r[1].get("error"))[:120] for r in res if r[0] != 201})[:3],
    }


THINK_S = 0.05  # between sequential warm acquires: a caller's think time


def warm_hits(ctl: ControllerProc, n: int, core, ns: str) -> dict:
    """`n` sequential warm acquires, then the bare limit of one: the same number of single
    label patches (a warm hit's one API call) from a plain client, same think time, same run.
    On this VM a lone request after an idle gap is slow (4.7 ms back to back, 13.5 ms with
    50 ms gaps, 26.5 ms with 300 ms gaps, bare client, measured), so only the ratio means much.
    """
    spec = {"cpu": "100m", "memory": "128Mi", "egress": "deny"}
    httpx.post(ctl.url + api.PREWARM.path, json={"image": IMAGE, "spec": spec, "count": n,
                                              "idle_timeout_s": 600}).raise_for_status()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = httpx.get(ctl.url + api.STATS.path).json()["warm"]
        if sum(v["warm"] for v in st.values()) >= n:
            break
        time.sleep(0.5)
    lat, warm, ids, names = [], 0, [], []
    with httpx.Client(timeout=60) as cl:
        for _ in range(n):
            t = time.perf_counter()
            r = cl.post(ctl.url + api.ACQUIRE.path, json={"image": IMAGE, "job": "warm",
                                                         **spec})
            lat.append((time.perf_counter() - t) * 1000)
            body = r.json()
            warm += bool(body.get("warm"))
            ids.append(body["id"])
            names.append(body["pod"])
            time.sleep(THINK_S)  # the replacement create starts, as in a caller's think time
    httpx.post(ctl.url + api.PREWARM.path, json={"image": IMAGE, "spec": spec, "count": 0})
    time.sleep(2)  # the replacements settle
    bare = []
    for i, name in enumerate(names):  # leased to this bench: a label of ours is harmless
        t = time.perf_counter()
        core.patch_namespaced_pod(name, ns, {"metadata": {"labels": {"bench/touched": str(i)}}},
                                  _preload_content=False).read()
        bare.append((time.perf_counter() - t) * 1000)
        time.sleep(THINK_S)
    asyncio.run(release_all(ctl.url, ids))
    return {"n": n, "warm_hits": warm, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "bare_p50_ms": pct(bare, 50), "bare_p99_ms": pct(bare, 99)}


def bare_vs_controller(ctl: ControllerProc, core, ns: str, n: int) -> dict:
    """Sequential cold acquires through the controller vs. create + watch-until-Ready."""
    from kubernetes import watch

    bare = []
    for i in range(n):
        name = f"bare-{i}"
        t = time.perf_counter()
        core.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": {"bare": "1"}},
                                        "spec": {"containers": [{"name": "c", "image": IMAGE}],
                                                 "terminationGracePeriodSeconds": 0}})
        w = watch.Watch()
        for ev in w.stream(core.list_namespaced_pod, ns, field_selector=f"metadata.name={name}",
                           timeout_seconds=60):
            conds = ev["object"].status.conditions or []
            if any(c.type == "Ready" and c.status == "True" for c in conds):
                w.stop()
                break
        bare.append((time.perf_counter() - t) * 1000)
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    via = []
    ids = []
    with httpx.Client(timeout=120) as cl:
        for _ in range(n):
            t = time.perf_counter()
            r = cl.post(ctl.url + api.ACQUIRE.path, json={
                "image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "overhead",
                "warm_ok": False})
            via.append((time.perf_counter() - t) * 1000)
            ids.append(r.json()["id"])
    asyncio.run(release_all(ctl.url, ids))
    return {"n": n, "bare_p50_ms": pct(bare, 50), "bare_p99_ms": pct(bare, 99),
            "ctl_p50_ms": pct(via, 50), "ctl_p99_ms": pct(via, 99)}


# (name, flags, https). The first is the baseline of the ratios.
AUTH_ARMS = (("none, http", ["--auth", "none"], False),
             ("none, https", ["--auth", "none"], True),
             ("kubernetes, https (cache 10 s)", ["--auth", "kubernetes"], True),
             ("kubernetes, https (no cache)", ["--auth", "kubernetes", "--auth-cache-ttl", "0"],
              True))


def auth_overhead(kubeconfig: Path, core, state: Path, n: int, rounds: int, run: str,
                  made: list[str]) -> dict:
    """Warm-hit acquires (sequential, one caller, the pool prewarmed) through one controller
    per arm, each in its own sandbox namespace; the arms take turns, `n / rounds` acquires a
    turn, so the machine's noise falls on all of them. Callers are a real ServiceAccount with
    a token from the TokenRequest API (audience sandman), allowed by a ClusterRoleBinding."""
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    tenant = new_namespace(core, f"bench-tenant-{run}")
    made.append(tenant)
    core.create_namespaced_service_account(tenant, {"metadata": {"name": "trainer"}})
    role = f"bench-sandman-{tenant}"
    rbac.create_cluster_role({"metadata": {"name": role}, "rules": [
        # sandboxes/stats: the wait for the pools below reads /v1/stats.
        {"apiGroups": ["sandman.dev"],
         "resources": ["sandboxes", "sandboxes/prewarm", "sandboxes/stats"],
         "verbs": ["create", "get", "list", "delete"]}]})
    rbac.create_cluster_role_binding({
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": tenant}]})
    token = core.create_namespaced_service_account_token("trainer", tenant, {"spec": {
        "audiences": ["sandman"], "expirationSeconds": 3600}}).status.token
    headers = {"Authorization": f"Bearer {token}"}
    per = max(1, n // rounds)
    ctls, lat = [], {name: [] for name, _, _ in AUTH_ARMS}
    warm_hits = {name: 0 for name, _, _ in AUTH_ARMS}
    body = {"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "auth", "warm_ok": True}
    try:
        for i, (_name, flags, https) in enumerate(AUTH_ARMS):
            ns = new_namespace(core, f"bench-auth{i}-{run}")
            made.append(ns)
            ctl = ControllerProc(ns, kubeconfig, state / f"controller-auth{i}.log",
                                 ["--rate", "100", "--burst", "100", "--lease-name",
                                  f"bench-auth{i}-{run}", "--log-level", "WARNING", *flags],
                                 auth=None, tls=local_tls_dir() if https else None
                                 ).start(timeout=180)
            ctls.append(ctl)
            with httpx.Client(timeout=60, headers=headers, verify=ctl.verify()) as cl:
                r = cl.post(ctl.url + api.PREWARM.path, json={
                    "image": IMAGE, "count": per + 5,
                    "spec": {"cpu": "100m", "memory": "128Mi"}})
                r.raise_for_status()
        for (name, _flags, _https), ctl in zip(AUTH_ARMS, ctls, strict=True):  # pools filled
            deadline = time.monotonic() + 120
            with httpx.Client(timeout=60, headers=headers, verify=ctl.verify()) as cl:
                while True:
                    r = cl.get(ctl.url + api.STATS.path)
                    r.raise_for_status()  # a refusal is the bench's bug: never wait it out
                    pools = r.json().get("warm")
                    if pools and all(v["warm"] >= per for v in pools.values()):
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"bench.controller: the {name} arm's pool did not "
                                         f"fill to {per} in 120 s: {pools}")
                    time.sleep(0.2)
        for _ in range(rounds):
            for (name, _flags, _https), ctl in zip(AUTH_ARMS, ctls, strict=True):
                ids = []
                with httpx.Client(timeout=60, headers=headers, verify=ctl.verify()) as cl:
                    for _ in range(per):
                        t = time.perf_counter()
                        r = cl.post(ctl.url + api.ACQUIRE.path, json=body)
                        lat[name].append((time.perf_counter() - t) * 1000)
                        r.raise_for_status()
                        warm_hits[name] += bool(r.json()["warm"])
                        ids.append(r.json()["id"])
                        time.sleep(THINK_S)
                    for sid in ids:
                        cl.delete(ctl.url + api.RELEASE.url(id=sid))
                # Refill before the next turn (replacements run through the pacer).
                time.sleep(per / 100 + 1)
    finally:
        for ctl in ctls:
            ctl.stop()
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)
    return {"n": per * rounds, "rounds": rounds, "warm_hits": warm_hits,
            "p50_ms": {k: pct(v, 50) for k, v in lat.items()},
            "p99_ms": {k: pct(v, 99) for k, v in lat.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.controller")
    ap.add_argument("--steps", default="99,500,1000,2000,5000,12000")
    ap.add_argument("--rate", type=float, default=25.0)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--overhead", type=int, default=50)
    ap.add_argument("--auth", type=int, default=60,
                    help="warm acquires per arm of the authentication phase (0: skip)")
    ap.add_argument("--auth-rounds", type=int, default=5)
    ap.add_argument("--kubeconfig", default=None,
                    help="this cluster instead of a test bed of its own (no RSS figures)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--plot", default=None, help="PNG of acquired vs time per step")
    docs.add_flags(ap)
    args = ap.parse_args(argv)
    docs.check_flags(ap, args)
    if args.smoke:
        args.steps, args.warm, args.overhead, args.auth, args.auth_rounds = "3", 3, 2, 1, 1
    cmdline = docs.command("bench.controller", sys.argv[1:] if argv is None else argv)
    steps = [int(s) for s in args.steps.split(",") if s]
    state = default_state_dir("bench-controller")
    tb = None
    if args.kubeconfig:
        kubeconfig = Path(args.kubeconfig)
        state.mkdir(parents=True, exist_ok=True)
    else:
        tb = Testbed(state, nodes=20)
        print(f"# starting the test bed in {state}", file=sys.stderr)
        tb.start()
        kubeconfig = tb.kubeconfig
    ctl = None
    made: list[str] = []
    run = secrets.token_hex(3)
    try:
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 8
        core = client.CoreV1Api(client.ApiClient(cfg))
        ns = new_namespace(core, f"bench-{run}")
        made.append(ns)
        auth = auth_overhead(kubeconfig, core, state, args.auth, args.auth_rounds, run,
                             made) if args.auth else None
        ctl = ControllerProc(ns, kubeconfig, state / "controller.log",
                             ["--rate", str(args.rate), "--burst", str(int(args.rate)),
                              "--max-creating", "2000", "--max-live", "20000",
                              "--lease-name", f"bench-{run}",
                              "--sweep-interval", "60", "--log-level", "WARNING"]).start()
        api_pid = next((c.pid for c in tb.components if c.name == "kube-apiserver"), 0) \
            if tb else 0
        rows = []
        for n in steps:
            timeout_s = n / args.rate * 1.5 + 120
            print(f"# ramp step {n} (budget {timeout_s:.0f}s)", file=sys.stderr)
            row = ramp_step(ctl, core, ns, n, api_pid, timeout_s)
            print(f"#   {json.dumps({k: v for k, v in row.items() if k != 'done_times'})}",
                  file=sys.stderr)
            rows.append(row)
        warm = warm_hits(ctl, args.warm, core, ns) if args.warm else None
        over = bare_vs_controller(ctl, core, ns, args.overhead) if args.overhead else None
    finally:
        if ctl:
            ctl.stop()
        if tb:
            tb.stop()
        else:  # a cluster not ours: leave nothing of the bench in it
            for name in made:
                delete_namespace(client.CoreV1Api(client.ApiClient(cfg)), name)
    cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    md = [SECTION, "",
          f"Command: `make bench-controller` (`{cmdline}`), {cpu} cores, kwok nodes "
          f"({'20' if tb else 'of ' + str(kubeconfig)}), {time.strftime('%Y-%m-%d')}.",
          "",
          "| sandboxes | acquired | leaked | achieved create rate | vs pacing limit | acquire p50 "
          "(queue incl.) | acquire p99 | controller RSS | apiserver RSS |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['n']:,} | {r['acquired']:,} | {r['leaked']} | "
                  f"{r['achieved_rate']:.1f}/s | {r['achieved_rate'] / args.rate:.2f}x | "
                  f"{r['p50_s']:.1f} s | {r['p99_s']:.1f} s | {r['ctl_rss_mb']:.0f} MB | "
                  f"{r['apiserver_rss_mb']:.0f} MB |")
    if warm:
        md += ["", f"Warm hits: {warm['warm_hits']} of {warm['n']} sequential acquires; "
               f"acquire p50 {warm['p50_ms']:.1f} ms, p99 {warm['p99_ms']:.1f} ms "
               "(goal p50 <= 20 ms); the bare limit, one label patch from a plain client with "
               f"the same {THINK_S * 1000:.0f} ms think time: p50 {warm['bare_p50_ms']:.1f} ms, "
               f"p99 {warm['bare_p99_ms']:.1f} ms; warm hit p50 "
               f"{warm['p50_ms'] / warm['bare_p50_ms']:.2f}x the bare limit."]
    if over:
        md += ["", f"Cold acquire vs bare create + watch-until-Ready ({over['n']} sequential, "
               f"same run): controller p50 {over['ctl_p50_ms']:.0f} ms / p99 "
               f"{over['ctl_p99_ms']:.0f} ms; bare p50 {over['bare_p50_ms']:.0f} ms / p99 "
               f"{over['bare_p99_ms']:.0f} ms; ratio p50 "
               f"{over['ctl_p50_ms'] / over['bare_p50_ms']:.2f}x."]
    if auth:
        base = auth["p50_ms"][AUTH_ARMS[0][0]]
        md += ["", f"Authentication and TLS ({auth['n']} sequential warm acquires per arm, "
               f"{auth['rounds']} interleaved rounds, same run): " + "; ".join(
                   f"{k}: p50 {v:.1f} ms ({v / base:.2f}x {AUTH_ARMS[0][0]}), p99 "
                   f"{auth['p99_ms'][k]:.1f} ms, {auth['warm_hits'][k]} warm hits"
                   for k, v in auth["p50_ms"].items()) + "."]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.write_docs:
        print(f"wrote {docs.write_section(text)}", file=sys.stderr)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in rows:
            ts = r["done_times"]
            ax.plot(ts, range(1, len(ts) + 1), label=f"{r['n']:,}")
        t_max = max((r["done_times"][-1] for r in rows if r["done_times"]), default=1)
        ax.plot([0, t_max], [0, t_max * args.rate], "k--", lw=1,
                label=f"pacing limit {args.rate:g}/s")
        ax.set_xlabel("seconds since the step's acquires were fired")
        ax.set_ylabel("sandboxes acquired")
        ax.set_title("sandman controller ramp on kwok (acquired vs time)")
        ax.legend(title="step")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
