"""The real-node bench's pure parts (statistics, planning, parsing, the docs section), without a
node. `make bench-realnode` runs the bench itself; no timing is asserted here."""

from __future__ import annotations

import pytest

from testbed import bench_realnode as B


def test_percentile_interpolates_between_closest_ranks():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert B.percentile(xs, 50) == 3.0
    assert B.percentile(xs, 0) == 1.0
    assert B.percentile(xs, 100) == 5.0
    assert B.percentile(xs, 99) == pytest.approx(4.96)
    assert B.percentile([7.0], 99) == 7.0
    # 64 values: p99 lies between the two largest.
    assert B.percentile([float(i) for i in range(64)], 99) == pytest.approx(62.37)


@pytest.mark.parametrize("values,q", [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_refuses_bad_input(values, q):
    with pytest.raises(ValueError):
        B.percentile(values, q)


def test_across_rounds_takes_the_median_and_range_of_each_rounds_figures():
    rounds = [B.summarize([1.0, 2.0, 3.0]), B.summarize([10.0, 20.0, 30.0]),
              B.summarize([2.0, 4.0, 6.0])]
    agg = B.across_rounds(rounds)
    assert agg["p50"] == 4.0 and agg["p50_range"] == (2.0, 20.0)
    assert agg["n"] == 9
    assert agg["p99"] == pytest.approx(rounds[2]["p99"])


def test_waves_cover_the_total_in_waves_no_larger_than_the_room():
    assert B.waves(64, 8) == [8] * 8
    assert B.waves(64, 7) == [7] * 9 + [1]
    assert B.waves(3, 8) == [3]
    with pytest.raises(ValueError):
        B.waves(64, 0)


def test_each_arm_goes_first_in_turn():
    firsts = [B.arm_order(w)[0] for w in range(len(B.ARMS))]
    assert sorted(firsts) == sorted(B.ARMS)
    for w in range(6):
        assert sorted(B.arm_order(w)) == sorted(B.ARMS)


def test_quantities_and_the_schedulers_pod_request():
    assert B.quantity("100m") == pytest.approx(0.1)
    assert B.quantity("128Mi") == 128 * 2**20
    assert B.quantity("2") == 2.0
    assert B.quantity(1.5) == 1.5
    with pytest.raises(ValueError):
        B.quantity("12 cores")
    init = {"resources": {"requests": {"cpu": "100m"}, "limits": {"cpu": "100m"}}}
    sandbox = {"initContainers": [init, init],
               "containers": [{"resources": {"limits": {"cpu": "25m"}}}]}
    assert B.pod_request(sandbox, "cpu") == pytest.approx(0.1)  # the init containers' floor
    big = {"initContainers": [init], "containers": [
        {"resources": {"requests": {"cpu": "250m"}}}, {"resources": {"requests": {"cpu": "1"}}}]}
    assert B.pod_request(big, "cpu") == pytest.approx(1.25)
    assert B.pod_request({"containers": [{}]}, "memory") == 0.0


def test_agent_lines_are_found_among_other_output():
    assert B.parse_agent_line("some log line") is None
    assert B.parse_agent_line('BENCH {"released": 3}') == {"released": 3}
    with pytest.raises(ValueError):
        B.parse_agent_line("BENCH [1, 2]")


def test_the_agent_script_compiles():
    compile(B.AGENT, "<agent>", "exec")


def _pod(arm: str, c2r: float, **kw) -> dict:
    ready = 1000.0 + c2r
    return {"arm": arm, "pod": f"{arm}-x", "c2r": c2r, "node": "sandman-real-0",
            "ready_at": ready,
            "phases": {"created": 1000.0, "init": {"sandman-netguard": [1001.0, 1003.0]}
                       if arm != "bare" else {}, "main_started": ready - 0.5}, **kw}


def _round(scale: float) -> dict:
    ctl = [_pod("controller", 3.0 * scale, acquire=3.1 * scale, first=3.2 * scale,
                timings={"queued_ms": 1.0, "create_ms": 20.0, "ready_ms": 3000.0})
           for _ in range(4)]
    return {"pods": {"bare": [_pod("bare", 1.0 * scale) for _ in range(4)],
                     "webhook": [_pod("webhook", 2.5 * scale) for _ in range(4)],
                     "controller": ctl},
            "echo": {"trainer": [0.002] * 10, "host": [0.001] * 10}}


def test_phase_breakdown_takes_medians_per_phase():
    ph = B.phase_breakdown([_pod("webhook", 4.0), _pod("webhook", 6.0)])
    assert ph["init sandman-netguard"] == 2.0
    assert ph["create -> first container started"] == 1.0
    assert ph["main container started -> Ready"] == 0.5
    assert "init sandman-netguard" not in B.phase_breakdown([_pod("bare", 1.0)])


def test_section_renders_ratios_and_replaces_only_its_own_part(tmp_path):
    res = B.aggregate([_round(1.0), _round(2.0), _round(1.0)])
    assert res["create_to_ready"]["bare"]["p50"] == 1.0
    assert res["create_to_ready"]["webhook"]["p50_range"] == (2.5, 5.0)
    res.update(alloc_cpu=2.0, used_cpu=1.2, wave=8, setup_s=60.0, rounds=3, sandboxes=4,
               errors="", leftovers="", release_leftovers="", echo_cpu="800m",
               command=".venv/bin/python -m testbed.bench_realnode", wall_s=900.0,
               machine={"cpus": 2, "arch": "x86_64", "kernel": "k", "python": "3.11",
                        "date": "d", "load_before": "1 1 1", "load_after": "2 2 2"})
    res["echo"].update(n_per_block=200, warmup=20, blocks=2)
    section = B.render_section(res)
    assert section.startswith(B.SECTION + "\n")
    assert "| 2.50x | 2.50x |" in section  # webhook vs bare
    assert "| 3.00x | 3.00x |" in section  # controller vs bare
    assert "Trainer / host p50: 2.00x" in section
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## netguard\n\nkept\n\n## webhook\n\nalso kept\n")
    B.update_docs(section, doc)
    B.update_docs(section.replace("2.50x", "9.99x"), doc)
    text = doc.read_text()
    assert text.count(B.SECTION) == 1 and "9.99x" in text and "2.50x |" not in text
    assert "## netguard\n\nkept\n" in text and "## webhook\n\nalso kept\n" in text


def test_a_raw_results_file_renders_again(tmp_path, capsys):
    import json

    meta = {"alloc_cpu": 2.0, "used_cpu": 1.2, "wave": 8, "setup_s": 60.0, "rounds": 1,
            "sandboxes": 4, "errors": "", "leftovers": "", "release_leftovers": "lease x",
            "echo_cpu": "800m", "command": "c", "wall_s": 1.0,
            "machine": {"cpus": 2, "arch": "a", "kernel": "k", "python": "p", "date": "d",
                        "load_before": "1", "load_after": "2"},
            "echo": {"n_per_block": 200, "warmup": 20, "blocks": 2}}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"meta": meta, "rounds": [_round(1.0)]}))
    B.render(raw, update=False)
    out = capsys.readouterr().out
    assert out.startswith(B.SECTION) and "`helm uninstall` left lease x" in out
