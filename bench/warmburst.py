"""Warm acquires in the two shapes agent-sandbox publishes, on the test bed.

    python -m bench.warmburst [--burst 300] [--rate-per-s 45] [--seconds 60]
                              [--kubeconfig KC] [--write-docs] [--smoke]

A script, not a test. The real controller (readiness from the pod's Ready condition: kwok
runs no execd; `--auth none`, as agent-sandbox's claims go to the API server with no layer of
their own) on kwok nodes, a warm pool prewarmed and full before each shape:

  burst      `--burst` acquires sent at once against a warm pool of that many
  sustained  acquires at `--rate-per-s`, open loop (each sent on its tick, whatever the ones
             before it did), for `--seconds`, against a warm pool holding all of them

Per shape: p50/p90/p99 of each acquire's latency (request sent -> answer read), the warm hits
(each answer's `warm`), errors, and agent-sandbox's published figures for the same shape
beside ours as a ratio (theirs / ours: above 1 is faster here). kwok starts no container, so
a hand-out here is the controller's own work: lease a Ready pod (one label patch) and answer;
agent-sandbox's figures come from its own cluster, so the ratio is a comparison of shapes on
different machines, said as such in the docs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

from bench import bed, docs
from bench.stats import percentile
from sandman import api

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SPEC = {"cpu": "100m", "memory": "128Mi"}
SECTION = "## Warm bursts: `python -m bench.warmburst`"
# agent-sandbox's published figures (its README's benchmark): a 300-claim burst against a warm
# pool, and claims sustained at 45/s for 60 s; ms.
THEIRS = {"burst": {"p50": 1470.0, "p90": 3200.0},
          "sustained": {"p50": 92.0, "p90": 182.0, "p99": 376.0}}


async def _acquire(h: httpx.AsyncClient, job: str, lat: list, warm: list, ids: list,
                   errors: list) -> None:
    t = time.perf_counter()
    try:
        r = await h.post(api.ACQUIRE.path, json={"image": IMAGE, "job": job, "timeout_s": 120,
                                                 **SPEC})
        took = (time.perf_counter() - t) * 1000
        if r.status_code not in (200, 201):
            errors.append(f"{r.status_code} {r.text[:200]}")
            return
        body = r.json()
        lat.append(took)
        warm.append(bool(body.get("warm")))
        ids.append(body["id"])
    except httpx.HTTPError as e:
        errors.append(f"{type(e).__name__}: {e}")


async def _release_all(url: str, ids: list[str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=64)) as h:
        sem = asyncio.Semaphore(64)

        async def one(sid: str) -> None:
            async with sem:
                await h.delete(api.RELEASE.url(id=sid))

        await asyncio.gather(*(one(s) for s in ids))


def prewarm(url: str, count: int, timeout_s: float = 600) -> float:
    """Ask for `count` warm sandboxes and wait until the pool holds them; seconds it took."""
    t = time.monotonic()
    httpx.post(url + api.PREWARM.path, json={"image": IMAGE, "spec": SPEC, "count": count,
                                             "idle_timeout_s": 3600},
               timeout=30).raise_for_status()
    while time.monotonic() - t < timeout_s:
        st = httpx.get(url + api.STATS.path, timeout=30).json()["warm"]
        if sum(v["warm"] for v in st.values()) >= count:
            return time.monotonic() - t
        time.sleep(1)
    raise RuntimeError(f"the warm pool did not reach {count} within {timeout_s:g}s")


def stop_pool(url: str) -> None:
    httpx.post(url + api.PREWARM.path, json={"image": IMAGE, "spec": SPEC, "count": 0},
               timeout=30).raise_for_status()


async def burst(url: str, n: int) -> dict:
    lat: list[float] = []
    warm: list[bool] = []
    ids: list[str] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=180,
                                 limits=httpx.Limits(max_connections=n)) as h:
        t0 = time.perf_counter()
        await asyncio.gather(*(_acquire(h, "burst", lat, warm, ids, errors) for _ in range(n)))
        wall = time.perf_counter() - t0
    await _release_all(url, ids)
    return {"n": n, "lat": lat, "warm": sum(warm), "errors": errors, "wall_s": wall}


async def sustained(url: str, rate: float, seconds: float) -> dict:
    lat: list[float] = []
    warm: list[bool] = []
    ids: list[str] = []
    errors: list[str] = []
    n = int(rate * seconds)
    late = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=180,
                                 limits=httpx.Limits(max_connections=512)) as h:
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            due = t0 + i / rate
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                late = max(late, -wait)
            tasks.append(asyncio.ensure_future(_acquire(h, "sustained", lat, warm, ids, errors)))
        await asyncio.gather(*tasks)
        sent_s = time.perf_counter() - t0
    await _release_all(url, ids)
    return {"n": n, "lat": lat, "warm": sum(warm), "errors": errors, "sent_s": sent_s,
            "late_ms": late * 1000}


def measure(cluster, workdir: Path, a: argparse.Namespace) -> dict:
    from testbed.controller import ControllerProc

    load0 = docs.load1()
    ns = cluster.new_namespace("bench-warmburst")
    need = max(a.burst, int(a.rate_per_s * a.seconds))
    ctl = None
    res: dict = {}
    try:
        ctl = ControllerProc(ns, cluster.kubeconfig, workdir / "controller.log",
                             ["--rate", "200", "--burst", "200", "--max-live", str(max(need * 2, 20000)),
                              "--log-level", "WARNING", "--lease-name", f"bench-{ns}"]).start()
        res["fill_burst_s"] = prewarm(ctl.url, a.burst)
        res["burst"] = asyncio.run(burst(ctl.url, a.burst))
        stop_pool(ctl.url)
        print(f"# burst: {len(res['burst']['lat'])} answered, {res['burst']['warm']} warm",
              file=sys.stderr)
        need_s = int(a.rate_per_s * a.seconds)
        res["fill_sustained_s"] = prewarm(ctl.url, need_s)
        res["sustained"] = asyncio.run(sustained(ctl.url, a.rate_per_s, a.seconds))
        stop_pool(ctl.url)
        print(f"# sustained: {len(res['sustained']['lat'])} answered, "
              f"{res['sustained']['warm']} warm", file=sys.stderr)
    finally:
        if ctl:
            ctl.stop()
        cluster.delete_namespace(ns)
    res["load"] = (load0, docs.load1() if a.smoke else docs.settle())
    return res


def run_bed(a: argparse.Namespace) -> dict:
    return bed.run("bench-warmburst", 4, measure, a)


def _row(what: str, r: dict, theirs: dict) -> str:
    cells = []
    for p in ("p50", "p90", "p99"):
        ours = percentile(r["lat"], int(p[1:])) if r["lat"] else float("nan")
        if p in theirs:
            cells.append(f"{ours:.0f} (theirs {theirs[p]:.0f}: {theirs[p] / ours:.1f}x)")
        else:
            cells.append(f"{ours:.0f}")
    return (f"| {what} | {len(r['lat'])} of {r['n']} | {r['warm']} | {len(r['errors'])} | "
            + " | ".join(cells) + " |")


def render(res: dict, a: argparse.Namespace, command: str) -> str:
    s = res["sustained"]
    return "\n".join([
        SECTION, "",
        f"`{command}`: the test bed (kwok, 4 nodes), the real controller (`--auth none`, "
        "readiness from the pod's Ready condition, creates paced at 200/s), a warm pool "
        f"prewarmed full before each shape ({res['fill_burst_s']:.0f} s and "
        f"{res['fill_sustained_s']:.0f} s to fill). Latency is each acquire's, request sent "
        "to answer read, in ms; agent-sandbox's published figures for the same shape beside "
        "ours (theirs / ours: above 1 is faster here). Load average "
        f"{res['load'][0]:.2f} at the start, {res['load'][1]:.2f} at the end.", "",
        "| shape | answered | warm hits | errors | p50 | p90 | p99 |",
        "|---|---|---|---|---|---|---|",
        _row(f"{a.burst} at once, warm pool of {a.burst}", res["burst"], THEIRS["burst"]),
        _row(f"{a.rate_per_s:g}/s for {a.seconds:g} s (open loop; sender at most "
             f"{s['late_ms']:.0f} ms late)", s, THEIRS["sustained"]),
        "",
        "agent-sandbox's figures come from its own cluster and a claim's path to a Ready "
        "sandbox; ours from one 2-core machine where the API server, etcd, kwok and the "
        "controller share the CPUs, and an acquire's path to a leased Ready pod. They compare "
        "the shapes, not the machines.", ""])


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m bench.warmburst",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--burst", type=int, default=300, help="acquires sent at once")
    ap.add_argument("--rate-per-s", type=float, default=45.0, help="sustained acquire rate")
    ap.add_argument("--seconds", type=float, default=60.0, help="sustained for this long")
    ap.add_argument("--kubeconfig", default=None,
                    help="this cluster instead of a test bed of its own")
    docs.add_flags(ap)
    a = ap.parse_args(argv)
    docs.check_flags(ap, a)
    if a.smoke:
        a.burst, a.rate_per_s, a.seconds = 10, 5.0, 2.0
    return ap, a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _, a = parse(argv)
    res = run_bed(a)
    section = render(res, a, docs.command("bench.warmburst", argv))
    print(section)
    bad = res["burst"]["errors"] + res["sustained"]["errors"]
    if bad:
        print(f"# {len(bad)} acquire(s) failed, first: {bad[0]}", file=sys.stderr)
        return 1
    if a.write_docs:
        refused = docs.docs_refusal(*res["load"])
        if refused:
            print(f"# {refused}", file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
