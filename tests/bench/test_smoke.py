"""Each bench's smallest configuration (`--smoke`), so none rots: it runs, prints its section
and writes no docs. Benches on the test bed use the suite's `cluster`; the real-node bench's
smoke is tests/e2e/test_bench_smoke.py (the installed product); netguard's is
tests/bench/test_bench_netguard.py (netns)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from bench import (
    controller,
    execd,
    fork,
    group,
    loadtest,
    minisweagent,
    reuse,
    reuse_controller,
    swerex,
    warmburst,
    webhook,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def docs_untouched():
    path = REPO / "docs" / "benchmarks.md"
    before = path.read_text()
    yield
    assert path.read_text() == before, "a smoke run wrote docs/benchmarks.md"


@pytest.mark.timeout(120)
def test_execd(capsys, docs_untouched):
    assert execd.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(execd.SECTION) and "| execd |" in out and "| bare limit |" in out


@pytest.mark.timeout(120)
def test_swerex(capsys, docs_untouched):
    assert swerex.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(swerex.SECTION) and "| sandman adapter, one loop |" in out


@pytest.mark.timeout(120)
def test_minisweagent(capsys, docs_untouched):
    assert minisweagent.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(minisweagent.SECTION) and "| sandman environment, bash -c |" in out
    assert "| 0 of 3 |" in out and "| 1 of 3 |" not in out


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_reuse_execd_part(capsys, docs_untouched):
    assert reuse.main(["--smoke", "--part", "execd"]) == 0
    out = capsys.readouterr().out
    assert reuse.SECTION in out and "`POST /restore` of it" in out


def test_smoke_never_writes_docs():
    for bench in (execd, swerex, minisweagent, reuse, webhook, controller, loadtest, fork, group):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", "--write-docs"])


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_reuse_controller_part(cluster, tmp_path, docs_untouched):
    res = reuse_controller.measure(cluster, tmp_path, rounds=1)
    assert len(res["fresh"]) == len(res["reused"]) == len(res["give_back"]) == 1
    assert reuse_controller.render(res).startswith(reuse_controller.SECTION)


@pytest.mark.testbed
@pytest.mark.timeout(400)
def test_fork(cluster, tmp_path, docs_untouched):
    a = fork.parse(["--smoke"])
    res = fork.measure(cluster, tmp_path, a)
    assert res["checks"] == a.children and res["checkpoint"]["checks"] == a.checkpoint_count
    assert res["checkpoint_checks"] == a.checkpoint_count and len(res["checkpoint_ratios"]) == 1
    # The controller's restore phases, read from its /metrics: each ran, and together they
    # fit in the call the client timed.
    ph, ck = res["checkpoint"]["phases"], res["checkpoint"]
    assert all(ph[k] > 0 for k in ("read", "fetch", "sandboxes")), ph
    assert sum(ph.values()) <= ck["restore"], (ph, ck["restore"])
    section = fork.render(res, a, "python -m bench.fork --smoke", ("0", "0"))
    assert section.startswith(fork.SECTION) and "goal <= 2x" in section


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_group(cluster, tmp_path, docs_untouched):
    _, a = group.parse(["--smoke"])
    res = group.measure(cluster, tmp_path, a)
    assert [r["calls"] for r in res["group"]] == [1]
    assert [r["calls"] for r in res["parallel"]] == [a.count]
    assert all(r["creates"] == a.count for arm in group.ARMS for r in res[arm])
    assert group.render(res, a, "python -m bench.group --smoke").startswith(group.SECTION)


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_warmburst(cluster, tmp_path, docs_untouched):
    _, a = warmburst.parse(["--smoke"])
    res = warmburst.measure(cluster, tmp_path, a)
    for shape, n in (("burst", a.burst), ("sustained", int(a.rate_per_s * a.seconds))):
        r = res[shape]
        assert r["errors"] == [] and len(r["lat"]) == n and r["warm"] == n, (shape, r)
    section = warmburst.render(res, a, "python -m bench.warmburst --smoke")
    assert section.startswith(warmburst.SECTION) and "theirs 1470" in section


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_webhook(cluster, capsys, docs_untouched):
    assert webhook.main(["--smoke", "--kubeconfig", str(cluster.kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert webhook.SECTION in out and "handler, identical pods" in out


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_controller(cluster, capsys, docs_untouched):
    assert controller.main(["--smoke", "--kubeconfig", str(cluster.kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert out.count(controller.SECTION) == 1 and "| 3 | 3 | 0 |" in out, out[-3000:]
    assert "Authentication and TLS" in out


@pytest.mark.testbed
@pytest.mark.timeout(400)
def test_loadtest_ramp(cluster, namespace, tmp_path, docs_untouched):
    """The ramp on the suite's bed: the webhook registered for a fresh namespace and a
    controller there, as `make demo`'s stack has them."""
    from testbed.controller import start_controller
    from testbed.webhook import registration, start_webhook, wait_webhook_active

    wh = start_webhook(tmp_path / "webhook", "--log-level", "warning")
    reg = registration(cluster.admissionregistration, namespace, wh.url, wh.ca.read_bytes(),
                       "sandman-bench-lt").create()
    ctl = None
    try:
        wait_webhook_active(cluster.core, namespace)
        ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                               ["--lease-name", f"lt-{namespace}", "--rate", "20",
                                "--burst", "40", "--log-level", "WARNING"], "pod")
        # The stack's processes for the CPU and memory sampler, by the pids started here.
        comps = cluster.testbed.components if cluster.testbed is not None else []
        pids = {c.name: c.pid for c in comps}
        pids.update(webhook=wh.proc.pid, controller=ctl.proc.pid)
        stack = types.SimpleNamespace(controller_url=ctl.url, kubeconfig=cluster.kubeconfig,
                                      namespace=namespace, pids=lambda: pids)
        a = types.SimpleNamespace(ramp_max=3, rate=20.0, burst=40, nodes=0)
        out = tmp_path / "report"
        out.mkdir()
        code = loadtest.measure(stack, out, a)
        section = loadtest.render(out, a, "python -m bench.loadtest --smoke", code, 1.0)
        assert code == 0, (out / "ramp.log").read_text()[-3000:]
        assert section.startswith(loadtest.SECTION)
        cpu = section.split("where the CPU went", 1)[1]
        assert "| webhook | controller | locust |" in cpu, section
        assert not comps or "| kube-apiserver | etcd | kube-scheduler |" in cpu, section
        assert "\n| 3 | 3 | 3 | " in section.split("per 1,000 sandboxes", 1)[1], section
    finally:
        if ctl is not None:
            ctl.stop()
        reg.delete()
        wh.stop()
