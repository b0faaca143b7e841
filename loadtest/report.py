"""Plots and the summary table from headless runs' CSV and JSON.

    python -m loadtest.report OUT_DIR [--title T]

For every `<run>_sandman.json` in OUT_DIR (written by the locustfiles next to locust's
`<run>_stats.csv` and `<run>.html`) it writes, next to them:
  <run>_creates.png    creates per second over time (pods first seen by the watch, 1 s bins),
                       with the controller's pacing limit drawn in
  <run>_ready.png      create-to-Ready p50/p99 per stage (per ramp step: the paper's fig. 3a)
  <run>_acquire.png    acquire latency CDF (the pacing queue included)
and `report.html` (the table, the plots, links to locust's own HTML reports); prints the table.
With a `<run>_procs.json` beside a run (the stack's CPU and memory sampler, testbed/procstat.py)
it also tells, per ramp step and for the whole run, each process's CPU-seconds and share of the
machine's, and the controller's and the webhook's CPU per 1,000 sandboxes created and RSS per
1,000 live.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import math
import sys
from pathlib import Path


def pct(xs: list[float], q: float) -> float:
    """q in [0, 1]; NaN for no values. Linear interpolation between closest ranks, the one
    definition of docs/benchmarks.md (bench/stats.py; this package is shipped without bench/,
    tests/bench/test_stats.py checks the two agree)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def load(path: Path) -> dict:
    doc = json.loads(path.read_text())
    doc["run"] = path.name[: -len("_sandman.json")]
    doc["dir"] = path.parent
    return doc


def created(doc: dict) -> list[float]:
    """First-seen times of pods the run created (warm hand-outs excluded)."""
    return sorted(p[0] for p in doc["pods"].values() if p[1] != "warm")


def ready_ms(doc: dict) -> list[tuple[float, float]]:
    return [(p[0], (p[1] - p[0]) * 1000) for p in doc["pods"].values()
            if isinstance(p[1], (int, float))]


def stage_rate(doc: dict, st: dict) -> float:
    """Creates per second while a stage's creates were being served: (n - 1) / (last - first)
    of the pods first seen in it."""
    end = st["ended"] if st.get("ended") is not None else math.inf
    ts = [t for t in created(doc) if st["started"] <= t < end]
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 2 and ts[-1] > ts[0] else math.nan


def pacing_rate(doc: dict) -> float | None:
    nominal = (doc.get("pacing") or {}).get("rate")
    if nominal:
        return float(nominal)
    rates = [s[1] for s in doc.get("samples", []) if s[1] is not None]
    return max(rates) if rates else None


def summarize(doc: dict) -> dict:
    acq = doc.get("acquires", [])
    ok = [a for a in acq if a[2]]
    lat = [(a[1] - a[0]) * 1000 for a in ok]
    ts = created(doc)
    bins: dict[int, int] = {}
    for t in ts:
        bins[int(t)] = bins.get(int(t), 0) + 1
    rates = [r for r in (stage_rate(doc, st) for st in doc.get("stages") or [])
             if not math.isnan(r)]
    rd = [r for _, r in ready_ms(doc)]
    failures = sum(s["failures"] for s in doc["stats"].values() if s["type"] != "LEAK")
    requests_ = sum(s["requests"] for s in doc["stats"].values()
                    if s["type"] not in ("LEAK", "POD_READY"))
    st = doc.get("stages") or []
    top = None
    for s in st:
        if s.get("reached") is not None and not s.get("timed_out"):
            top = s["label"]
    return {
        "run": doc["run"], "shape": doc.get("shape") or doc.get("locustfile"),
        "requests": requests_, "acquired": len(ok), "acquire_failed": len(acq) - len(ok),
        "errors": failures, "creates": len(ts),
        "stage_rate": max(rates) if rates else math.nan,
        "peak_rate": max(bins.values()) if bins else 0, "pacing": pacing_rate(doc),
        "pacing_burst": (doc.get("pacing") or {}).get("burst"),
        "acq_p50": pct(lat, .5), "acq_p99": pct(lat, .99),
        "ready_p50": pct(rd, .5), "ready_p99": pct(rd, .99),
        "leaked": len(doc.get("leaked", [])), "audit": doc.get("audit"),
        "exit": doc.get("exit_code"), "top_step": top, "stop_reason": doc.get("stop_reason"),
        "duration_s": doc.get("duration_s"),
        "cotenant": cotenant_line(doc),
    }


def cotenant_line(doc: dict) -> str:
    """The co-tenant stop rule's line: why it stopped the run, or its readings; "" when off."""
    c = doc.get("cotenant") or {}
    if not c:
        return ""
    if c.get("stopped"):
        return f"STOPPED (exit {doc.get('exit_code')}): {c['stopped']}"
    return (f"co-tenant stop rule held: other tenants' pod failures peaked at "
            f"{c.get('peak_per_min', 0.0):.1f}/min against a threshold of "
            f"{c['threshold_per_min']:.1f}/min (idle baseline {c['baseline_per_min']:.1f}/min)")


def _ms(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def _rate(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1f}"


def table(rows: list[dict]) -> str:
    head = ("| run | acquired | errors | creates | achieved creates/s (best stage / busiest 1 s) | "
            "pacing limit | acquire p50 / p99 | create-to-Ready p50 / p99 | leaked pods | exit |")
    out = [head, "|---" * 10 + "|"]
    for r in rows:
        pace = f"{r['pacing']:g}/s" if r["pacing"] else "-"
        if r["pacing"] and r.get("pacing_burst"):
            pace += f", burst {r['pacing_burst']}"
        mean = "-" if math.isnan(r["stage_rate"]) else f"{r['stage_rate']:.1f}"
        out.append(f"| {r['run']} | {r['acquired']:,} | {r['errors']} | {r['creates']:,} | "
                   f"{mean} / {r['peak_rate']} | {pace} | {_ms(r['acq_p50'])} / "
                   f"{_ms(r['acq_p99'])} | {_ms(r['ready_p50'])} / {_ms(r['ready_p99'])} | "
                   f"{r['leaked']} | {r['exit']} |")
    return "\n".join(out)


def step_table(doc: dict) -> str:
    """Per stage: users, reached after, create-to-Ready p50/p99 of the pods first seen in it."""
    st = doc.get("stages") or []
    if len(st) < 2:
        return ""
    rd = ready_ms(doc)
    lines = ["| step | reached | time to fill | pods created in step | creates/s | "
             "create-to-Ready p50 / p99 | peak live |", "|---|---|---|---|---|---|---|"]
    for s in st:
        end = s["ended"] if s.get("ended") is not None else math.inf
        xs = [r for t, r in rd if s["started"] <= t < end]
        fill = (f"{s['reached'] - s['started']:.1f} s" if s.get("reached") is not None
                else "not reached")
        lines.append(f"| {s['label']} | {'no (timed out)' if s.get('timed_out') else 'yes'} | "
                     f"{fill} | {len(xs)} | {_rate(stage_rate(doc, s))} | "
                     f"{_ms(pct(xs, .5))} / {_ms(pct(xs, .99))} | "
                     f"{s.get('peak_live', 0)} |")
    return "\n".join(lines)


# Where the CPU went: <run>_procs.json, written beside the run by the stack's sampler
# (testbed/procstat.py): counters since boot / process start, sampled every 1-2 s.
STACK_ORDER = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok",
               "webhook", "controller", "locust")
PER_SANDBOX = ("controller", "webhook")  # the figures that carry to a real cluster


def load_procs(doc: dict) -> dict | None:
    path = doc["dir"] / f"{doc['run']}_procs.json"
    return json.loads(path.read_text()) if path.exists() else None


def _interp(series: list[tuple[float, float]], t: float) -> float:
    """A counter's value at `t`, linear between its samples (the first or last outside)."""
    if t <= series[0][0]:
        return series[0][1]
    for (t0, v0), (t1, v1) in zip(series, series[1:], strict=False):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return series[-1][1]


class ProcSeries:
    """The sampler's file as series: machine CPU-seconds, idle, and per process CPU-seconds
    and RSS, each readable at any time of the run."""

    def __init__(self, procs: dict):
        sm = procs["samples"]
        self.cores = procs.get("cores")
        self.total = [(x[0], x[1]) for x in sm]
        self.idle = [(x[0], x[2]) for x in sm]
        present = {n for x in sm for n in x[3]}
        self.names = ([n for n in STACK_ORDER if n in present]
                      + sorted(n for n in present if n not in STACK_ORDER))
        self.cpu = {n: [(x[0], x[3][n][0]) for x in sm if n in x[3]] for n in self.names}
        self.rss = {n: [(x[0], x[3][n][1]) for x in sm if n in x[3]] for n in self.names}
        self.start, self.end = sm[0][0], sm[-1][0]

    def window(self, a: float, b: float) -> dict:
        """CPU-seconds in [a, b]: the machine's (all cores, idle included), busy, idle, and
        per process; RSS per process at `b`."""
        total = _interp(self.total, b) - _interp(self.total, a)
        idle = _interp(self.idle, b) - _interp(self.idle, a)
        cpu = {n: _interp(self.cpu[n], b) - _interp(self.cpu[n], a) for n in self.names}
        rss = {n: _interp(self.rss[n], b) for n in self.names}
        peak = {n: max([rss[n], _interp(self.rss[n], a),
                        *(v for t, v in self.rss[n] if a <= t <= b)]) for n in self.names}
        return {"s": b - a, "total": total, "idle": idle, "busy": total - idle, "cpu": cpu,
                "rss": rss, "rss_peak": peak}


def _windows(doc: dict, ps: ProcSeries) -> list[tuple[str, dict, dict | None]]:
    """(label, window, stage) per ramp step, then the whole run (stage None)."""
    t0 = doc["started"]
    out = []
    for st in doc.get("stages") or []:
        end = st["ended"] if st.get("ended") is not None else doc.get("duration_s") or 0
        out.append((st["label"], ps.window(t0 + st["started"], t0 + end), st))
    out.append(("whole run", ps.window(t0, t0 + (doc.get("duration_s") or ps.end - t0)), None))
    return out


def _cpu_cell(cpu: float, total: float) -> str:
    return f"{cpu:.1f} ({cpu / total:.0%})" if total > 0 else f"{cpu:.1f}"


def cpu_table(doc: dict, procs: dict) -> str:
    """Per step: each process's CPU-seconds and its share of the machine's CPU-seconds (every
    core, idle included), the rest of the machine's busy time, and idle."""
    ps = ProcSeries(procs)
    head = (["step", "s", f"machine CPU-s ({ps.cores} cores)"] + ps.names
            + ["other processes", "idle"])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, w, _ in _windows(doc, ps):
        other = w["busy"] - sum(w["cpu"].values())
        cells = [label, f"{w['s']:.0f}", f"{w['total']:.0f}"]
        cells += [_cpu_cell(w["cpu"][n], w["total"]) for n in ps.names]
        cells += [_cpu_cell(max(other, 0.0), w["total"]), _cpu_cell(w["idle"], w["total"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mb(b: float) -> str:
    return f"{b / 2**20:.0f} MB"


def per_sandbox_table(doc: dict, procs: dict) -> str:
    """The controller's and the webhook's cost per 1,000 sandboxes, per step: CPU-seconds per
    1,000 created in the step; RSS at the step's end (the whole run: its peak), and its growth
    since the run's start per 1,000 live sandboxes (the whole run: the most live)."""
    ps = ProcSeries(procs)
    names = [n for n in PER_SANDBOX if n in ps.names]
    if not names:
        return ""
    t0 = doc["started"]
    base = {n: _interp(ps.rss[n], t0) for n in names}
    ts = created(doc)
    head = ["step", "created in step", "live at end"]
    for n in names:
        head += [f"{n} CPU-s per 1,000 created", f"{n} RSS (growth per 1,000 live)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, w, st in _windows(doc, ps):
        if st is not None:
            end = st["ended"] if st.get("ended") is not None else math.inf
            made = sum(1 for t in ts if st["started"] <= t < end)
            live = st.get("peak_live") or 0
        else:
            made = len(ts)
            live = max((s.get("peak_live") or 0 for s in doc.get("stages") or []), default=0)
        rss = w["rss"] if st is not None else w["rss_peak"]
        cells = [label, f"{made:,}", f"{live:,}"]
        for n in names:
            cells.append(f"{w['cpu'][n] / made * 1000:.1f}" if made else "-")
            grow = (f"{(rss[n] - base[n]) / live * 1000 / 2**20:+.1f} MB" if live
                    else "-")
            cells.append(f"{_mb(rss[n])} ({grow})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(doc: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, run = doc["dir"], doc["run"]
    out = []
    ts = created(doc)
    # creates per second with the pacing limit
    fig, ax = plt.subplots(figsize=(8, 3.2))
    if ts:
        n = int(max(ts)) + 1
        counts = [0] * n
        for t in ts:
            counts[int(t)] += 1
        ax.bar(range(n), counts, width=1.0, align="edge", color="#4c72b0", label="creates/s")
    samples = [s for s in doc.get("samples", []) if s[1] is not None]
    if samples:
        ax.step([s[0] for s in samples], [s[1] for s in samples], where="post", color="#c44e52",
                label="pacing limit (controller's current rate)")
    elif pacing_rate(doc):
        ax.axhline(pacing_rate(doc), color="#c44e52", label="pacing limit")
    for s in doc.get("stages") or []:
        ax.axvline(s["started"], color="#999", lw=0.6, ls=":")
    creating = [s for s in doc.get("samples", []) if isinstance(s[3], int)]
    if creating:  # creates in flight (create call + not yet Ready): the --max-creating cap
        ax2 = ax.twinx()
        ax2.plot([s[0] for s in creating], [s[3] for s in creating], color="#55a868", lw=1,
                 label="creating (in flight, right axis)")
        ax2.set_ylabel("creating")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("s since start")
    ax.set_ylabel("pod creates per second")
    ax.set_title(f"{run}: creates per second")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    p = d / f"{run}_creates.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p)
    # create-to-Ready per stage
    st = doc.get("stages") or []
    rd = ready_ms(doc)
    if st and rd:
        labels, p50, p99 = [], [], []
        for s in st:
            end = s["ended"] if s.get("ended") is not None else math.inf
            xs = [r for t, r in rd if s["started"] <= t < end]
            if xs:
                labels.append(s["label"])
                p50.append(pct(xs, .5) / 1000)
                p99.append(pct(xs, .99) / 1000)
        if labels:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            x = range(len(labels))
            ax.plot(x, p50, "o-", label="p50")
            ax.plot(x, p99, "s--", label="p99")
            ax.set_xticks(list(x), labels)
            ax.set_xlabel("stage (ramp: concurrent sandboxes)")
            ax.set_ylabel("create-to-Ready (s)")
            ax.set_title(f"{run}: create-to-Ready per stage")
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = d / f"{run}_ready.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            out.append(p)
    # acquire latency CDF
    lat = sorted((a[1] - a[0]) for a in doc.get("acquires", []) if a[2])
    if lat:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))])
        ax.set_xlabel("acquire latency (s, pacing queue included)")
        ax.set_ylabel("fraction of acquires")
        ax.set_title(f"{run}: acquire latency CDF ({len(lat)} acquires)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = d / f"{run}_acquire.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out


def locust_stats(d: Path, run: str) -> list[dict]:
    p = d / f"{run}_stats.csv"
    if not p.exists():
        return []
    with p.open() as f:
        return list(csv.DictReader(f))


def build(out_dir: Path, title: str = "sandman load test") -> tuple[str, Path]:
    docs = [load(p) for p in sorted(out_dir.glob("*_sandman.json"),
                                    key=lambda p: p.stat().st_mtime)]
    if not docs:
        raise SystemExit(f"no *_sandman.json in {out_dir}")
    rows = [summarize(d) for d in docs]
    text = [table(rows)]
    body = [f"<h1>{html.escape(title)}</h1>", _html_table(text[0])]
    for doc, row in zip(docs, rows, strict=True):
        if row["cotenant"]:
            text += ["", f"{doc['run']}: {row['cotenant']}"]
        steps = step_table(doc)
        if steps:
            text += ["", f"{doc['run']} per step ({row['stop_reason']}):", steps]
        procs = load_procs(doc)
        usage = []
        if procs and procs.get("samples"):
            usage = [("where the CPU went: CPU-seconds per process (share of the machine's "
                      "CPU-seconds, every core, idle included)", cpu_table(doc, procs))]
            per = per_sandbox_table(doc, procs)
            if per:
                usage.append(("the controller and the webhook per 1,000 sandboxes", per))
        for what, tab in usage:
            text += ["", f"{doc['run']}, {what}:", tab]
        pngs = plots(doc)
        body.append(f"<h2>{html.escape(doc['run'])}</h2>")
        if (doc["dir"] / f"{doc['run']}.html").exists():
            body.append(f"<p><a href='{doc['run']}.html'>locust report</a> &middot; "
                        f"<a href='{doc['run']}_stats.csv'>stats CSV</a></p>")
        body.append(f"<p>job {html.escape(doc['job'])}; {html.escape(str(row['audit']))}; "
                    f"{html.escape(row['stop_reason'] or '')}</p>")
        if row["cotenant"]:
            body.append(f"<p><b>{html.escape(row['cotenant'])}</b></p>")
        if steps:
            body.append(_html_table(steps))
        for what, tab in usage:
            body += [f"<p>{html.escape(what)}</p>", _html_table(tab)]
        body.append("<ul>" + "".join(f"<li>{html.escape(t['check'])}: "
                                     f"{'ok' if t['ok'] else '<b>FAIL</b>'}</li>"
                                     for t in doc.get("thresholds", [])) + "</ul>")
        for s in locust_stats(doc["dir"], doc["run"]):
            if s.get("Name") == "Aggregated":
                body.append(f"<p>locust aggregated: {s['Request Count']} requests, "
                            f"{s['Failure Count']} failures</p>")
        body += [f"<img src='{p.name}' style='max-width:100%'>" for p in pngs]
    page = out_dir / "report.html"
    page.write_text("<!doctype html><meta charset='utf-8'><title>sandman load test</title>"
                    "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}"
                    "td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:"
                    "collapse}</style>" + "\n".join(body))
    return "\n".join(text), page


def _html_table(md: str) -> str:
    lines = [ln for ln in md.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    if not rows:
        return ""
    h = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    b = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                for r in rows[1:])
    return f"<table><tr>{h}</tr>{b}</table>"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.report")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--title", default="sandman load test")
    a = ap.parse_args(argv)
    text, page = build(a.out_dir, a.title)
    print(text)
    print(f"\nHTML report: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
