"""The real-node bench's pure parts (statistics, planning, parsing, the agent, the docs
section), without a node. Its smoke run on the installed product is
tests/e2e/test_bench_smoke.py; no timing is asserted here."""

from __future__ import annotations

import pytest

from bench import realnode as B
from bench import realnode_agent


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


def test_the_agent_is_the_modules_source_and_answers_each_request(capsys):
    compile(B.AGENT, "<agent>", "exec")
    assert B.AGENT.startswith('"""The real-node bench')

    class Client:  # the agent's ops that need no controller
        closed = False

        def close(self):
            Client.closed = True

    agent = realnode_agent.Agent(Client())
    agent.serve(['{"op": "release"}', '{"op": "nope"}', '{"op": "quit"}', '{"op": "release"}'])
    agent.close()
    answers = [B.parse_agent_line(ln) for ln in capsys.readouterr().out.splitlines()]
    assert answers == [{"released": 0}, {"error": "unknown op 'nope'"}, {"bye": True}]
    assert Client.closed


def test_the_trainer_pod_carries_what_the_default_install_requires():
    pod = B.trainer_pod("trainer", "img", "https://ctl.sandman.svc:8080")
    assert pod["metadata"]["labels"] == {"sandman.dev/trainer": "true"}
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SANDMAN_URL"].startswith("https://")
    assert {"SANDMAN_TOKEN_FILE", "SANDMAN_CA_FILE"} <= set(env)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    token = vols["sandman-token"]["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == "sandman"
    assert vols["sandman-ca"]["configMap"]["name"] == "sandman-ca"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert env["SANDMAN_TOKEN_FILE"].rsplit("/", 1)[0] in mounts
    assert env["SANDMAN_CA_FILE"].rsplit("/", 1)[0] in mounts


def test_smoke_is_the_smallest_run_and_writes_no_docs():
    a = B.parse(["--smoke"])
    assert (a.rounds, a.sandboxes, a.wave, a.echo_blocks) == (1, 1, 1, 1)
    with pytest.raises(SystemExit):
        B.parse(["--smoke", "--write-docs"])


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
               command="python -m bench.realnode", wall_s=900.0,
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
