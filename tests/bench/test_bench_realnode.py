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
    t0 = 1000.0
    ready = t0 + c2r
    ctrs = {"task": {"created": ready - 0.9, "started": ready - 0.8, "finished": None}}
    inits = []
    if arm == "floor":
        inits = [B.FLOOR_INIT]
        ctrs[B.FLOOR_INIT] = {"created": t0 + 0.3, "started": t0 + 0.4, "finished": t0 + 0.45}
    elif arm != "bare":
        inits = ["sandman-netguard", "sandman-execd-install"]
        ctrs["sandman-netguard"] = {"created": t0 + 0.3, "started": t0 + 0.4, "finished": t0 + 1.0}
        ctrs["sandman-execd-install"] = {"created": t0 + 1.1, "started": t0 + 1.2,
                                         "finished": t0 + 1.4}
    return {"arm": arm, "pod": f"{arm}-x", "c2r": c2r, "node": "sandman-real-0", "t0": t0,
            "ready_at": ready, "scheduled": t0 + 0.05, "inits": inits,
            "cri": {"sandbox": t0 + 0.1, "containers": ctrs,
                    **({"listening": ready - 0.3} if arm not in ("bare", "floor") else {})},
            **kw}


def _round(scale: float, large: bool = False) -> dict:
    def arms(s: float) -> dict:
        ctl = [_pod("controller", 3.0 * s, acquire=3.1 * s, first=3.2 * s, t1=1000 + 3.1 * s,
                    t2=1000 + 3.2 * s,
                    timings={"queued_ms": 1.0, "create_ms": 20.0, "started_ms": 2500.0,
                             "ready_ms": 3000.0})
               for _ in range(4)]
        return {"bare": [_pod("bare", 1.0 * s) for _ in range(4)],
                "floor": [_pod("floor", 2.0 * s) for _ in range(4)],
                "webhook": [_pod("webhook", 2.5 * s) for _ in range(4)], "controller": ctl}

    rd = {"pods": arms(scale), "echo": {"trainer": [0.002] * 10, "host": [0.001] * 10}}
    if large:
        rd["large"] = arms(scale / 2)
    return rd


def test_cri_timestamps_in_both_of_crictls_spellings():
    assert B.cri_seconds("1700000000123456789") == pytest.approx(1700000000.123456789, abs=1e-6)
    assert B.cri_seconds(1700000000123456789) == pytest.approx(1700000000.1234568, abs=1e-6)
    assert B.cri_seconds("2023-11-14T22:13:20.123456789Z") == pytest.approx(
        1700000000.123456789, abs=1e-6)
    assert B.cri_seconds("2023-11-14T23:13:20.5+01:00") == pytest.approx(1700000000.5)
    assert B.cri_seconds("0001-01-01T00:00:00Z") is None  # Go's zero time: never happened
    assert B.cri_seconds("0") is None and B.cri_seconds("") is None and B.cri_seconds(None) is None
    with pytest.raises(ValueError):
        B.cri_seconds("yesterday")


def test_inspect_output_as_one_object_per_id_or_a_list():
    assert B.json_values('{"a": 1}\n{"a": 2}\n') == [{"a": 1}, {"a": 2}]
    assert B.json_values('[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]
    assert B.json_values("  ") == []
    with pytest.raises(ValueError):
        B.json_values('{"a": 1} nope')


def test_execd_listening_from_its_log_timestamps():
    log = ("2023-11-14T22:13:19.900000000Z execd: no reuse baseline: x\n"
           "2023-11-14T22:13:20.250000000Z execd 1.2 listening on 0.0.0.0:9470 (pid 7, ...)\n")
    assert B.listening_at(log) == pytest.approx(1700000000.25)
    assert B.listening_at("2023-11-14T22:13:20Z hello listening on x\n") is None
    assert B.listening_at("") is None


def test_phase_intervals_chain_each_pods_steps():
    ph = B.phase_intervals(_pod("webhook", 4.0))
    assert ph["create call -> scheduled"] == pytest.approx(0.05)
    assert ph["pod sandbox created -> sandman-netguard created"] == pytest.approx(0.2)
    assert ph["sandman-netguard started -> sandman-netguard exited"] == pytest.approx(0.6)
    assert ph["sandman-netguard exited -> sandman-execd-install created"] == pytest.approx(0.1)
    assert ph["sandman-execd-install exited -> main created"] == pytest.approx(1.7)
    assert ph["main started -> execd listening"] == pytest.approx(0.5)
    assert ph["execd listening -> Ready seen"] == pytest.approx(0.3)
    assert ph["whole: create call -> Ready seen"] == pytest.approx(4.0)
    steps = [k for k in ph if not k.startswith("whole")]
    assert sum(ph[k] for k in steps) == pytest.approx(ph["whole: create call -> Ready seen"])
    bare = B.phase_intervals(_pod("bare", 1.0))
    assert "pod sandbox created -> main created" in bare and "main started -> Ready seen" in bare
    assert not any("netguard" in k for k in bare)
    ctl = B.phase_intervals(_pod("controller", 3.0, t1=1002.9, t2=1003.0))
    assert ctl["execd listening -> acquire answered"] == pytest.approx(0.2)
    assert ctl["acquire answered -> first command answered"] == pytest.approx(0.1)
    assert ctl["(execd listening -> pod Ready seen)"] == pytest.approx(0.3)
    # A pod the runtime could not describe keeps only the steps that were seen.
    assert B.phase_intervals({"arm": "bare", "t0": 1.0, "ready_at": 3.0, "cri": None}) == {
        "create call -> Ready seen": 2.0, "whole: create call -> Ready seen": 2.0}


def test_docs_are_refused_when_the_machine_was_not_quiet():
    assert B.docs_refusal(0.3, 1.5) is None
    assert "start 1.60" in B.docs_refusal(1.6, 0.2)
    why = B.docs_refusal(2.0, 3.0)
    assert "start 2.00" in why and "end 3.00" in why and "not written" in why


def test_sizes_are_the_tiny_pods_in_waves_and_the_largest_one_that_fits():
    a = B.parse([])
    tiny, large = B.plan_sizes(a, alloc=2.0, used=1.25, fit=7, mem_free=8 * 2**30)
    assert (tiny["cpu"], tiny["memory"], tiny["wave"], tiny["n"]) == ("100m", "128Mi", 4, 12)
    assert (large["cpu"], large["memory"], large["wave"], large["n"]) == ("700m", "716Mi", 1, 4)
    assert len(B.plan_sizes(B.parse(["--large-sandboxes", "0"]), 2.0, 1.25, 7, 2**33)) == 1
    assert len(B.plan_sizes(a, 2.0, 1.85, 1, 2**33)) == 1  # no room above the tiny size
    with pytest.raises(B.BenchError, match="no room"):
        B.plan_sizes(a, 2.0, 1.95, 0, 2**33)


def test_section_renders_ratios_and_replaces_only_its_own_part(tmp_path):
    res = B.aggregate([_round(1.0), _round(2.0), _round(1.0)])
    assert res["create_to_ready"]["bare"]["p50"] == 1.0
    assert res["create_to_ready"]["webhook"]["p50_range"] == (2.5, 5.0)
    res.update(alloc_cpu=2.0, used_cpu=1.2, wave=8, setup_s=60.0, rounds=3, sandboxes=4,
               errors="", leftovers="", release_leftovers="", echo_cpu="800m",
               command="python -m bench.realnode", wall_s=900.0, load_last_wave=2.5,
               machine={"cpus": 2, "arch": "x86_64", "kernel": "k", "python": "3.11",
                        "date": "d", "load_before": "1 1 1",
                        "load1_start": 0.4, "load1_end": 0.9})
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
                        "load_before": "1"},
            "echo": {"n_per_block": 200, "warmup": 20, "blocks": 2}}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"meta": meta, "rounds": [_round(1.0)]}))
    B.render(raw, update=False)
    out = capsys.readouterr().out
    assert out.startswith(B.SECTION) and "`helm uninstall` left lease x" in out


def test_the_larger_size_and_the_phase_table_are_in_the_section():
    res = B.aggregate([_round(1.0, large=True), _round(2.0, large=True)])
    assert res["large"]["create_to_ready"]["bare"]["p50"] == pytest.approx(0.75)
    sizes = [{"key": "pods", "cpu": "100m", "memory": "128Mi", "wave": 4, "n": 4},
             {"key": "large", "cpu": "700m", "memory": "716Mi", "wave": 1, "n": 4}]
    res.update(alloc_cpu=2.0, used_cpu=1.2, wave=4, sizes=sizes, setup_s=60.0, rounds=2,
               sandboxes=4, errors="", leftovers="", release_leftovers="", echo_cpu="800m",
               command="c", wall_s=9.0, load_last_wave=2.5,
               machine={"cpus": 2, "arch": "a", "kernel": "k", "python": "p", "date": "d",
                        "load_before": "1", "load1_start": 0.4, "load1_end": 0.9})
    res["echo"].update(n_per_block=200, warmup=20, blocks=2)
    section = B.render_section(res)
    assert "**100m CPU / 128Mi**" in section and "**700m CPU / 716Mi**" in section
    assert "| sandman-netguard started -> sandman-netguard exited | - | - | 600 / 600 | 600 / 600 |" \
        in section
    assert "| floor-init started -> floor-init exited | - | 50 / 50 | - | - |" in section
    assert "1-minute load 0.40 at the start" in section and "0.90 at the end" in section
    assert "started 2500 ms" in section  # the acquire answer's own timings


def test_write_docs_from_a_raw_file_of_a_busy_run_is_refused(tmp_path, capsys):
    import json

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"meta": {"machine": {"load1_start": 0.2, "load1_end": 2.4}},
                               "rounds": []}))
    assert B.main(["--render", str(raw), "--write-docs"]) == 1
    assert "end 2.40" in capsys.readouterr().err


def test_goals_and_what_each_init_container_adds():
    res = B.aggregate([_round(1.0)])
    lines = B.goal_lines(res)
    assert lines[0].startswith("plain client: create -> Ready p50 2.50x") and "not met" in lines[0]
    assert "3.20x" in lines[1] and "not met" in lines[1]
    costs = B.container_costs(res["phases"]["webhook"])
    # netguard: created -> started 100 + run 600 + exit -> the install's create 100; the
    # install: 100 + 200 + exit -> the main container's create 200.
    assert costs == pytest.approx({"sandman-netguard": 800.0, "sandman-execd-install": 500.0})
    # Within every goal: plain client 1.8x, first command 1.4x at p50, both <= 2x at p99.
    within = {"create_to_ready": {"bare": {"p50": 1.0, "p99": 2.0},
                                  "webhook": {"p50": 1.8, "p99": 4.0}},
              "first_command": {"p50": 1.4, "p99": 3.9}}
    lines = B.goal_lines(within)
    assert [ln.rsplit(": ", 1)[1] for ln in lines] == ["met"] * 4, lines
    assert "1.80x" in lines[0] and "1.40x" in lines[1]
    within["first_command"]["p50"] = 1.6  # just over 1.5x
    assert B.goal_lines(within)[1].endswith("**not met**")


def test_the_kubelets_waits_are_told_apart_from_work():
    res = B.aggregate([_round(1.0)])
    waits = B.kubelet_waits(res["phases"])
    assert waits == pytest.approx({
        "sandman-netguard exited -> sandman-execd-install created": 100.0,
        "sandman-execd-install exited -> main created": 200.0,
        "execd listening -> Ready seen": 300.0,
        "volume mount wait (over the bare pod's)": 0.0})


def test_the_floor_says_which_goal_is_above_the_kubelet():
    res = B.aggregate([_round(1.0)])
    lines = B.ceiling_lines(res)
    # floor 2.0 s over bare 1.0 s: exactly the 2.0x goal, still within; the plain client
    # 2.5 s is 1.25x the floor, 500 ms of work over it.
    assert lines[0].startswith("floor p50 2.00x") and "within what this kubelet allows" in lines[0]
    assert lines[2].startswith("plain client p50 1.25x the floor's (500 ms")
    res["create_to_ready"]["floor"]["p50"] = 2.1
    assert "**above what this kubelet allows**" in B.ceiling_lines(res)[0]


def test_the_floor_pod_has_a_sandboxs_shape_and_the_bare_pods_request():
    bare, floor = B.bare_pod("b"), B.floor_pod("f")
    for r in ("cpu", "memory"):
        assert B.pod_request(floor["spec"], r) == B.pod_request(bare["spec"], r)
    spec = floor["spec"]
    assert [c["name"] for c in spec["initContainers"]] == [B.FLOOR_INIT]
    assert spec["initContainers"][0]["command"] == ["true"]
    assert spec["containers"][0]["readinessProbe"]["periodSeconds"] == 1
    assert spec["volumes"] == [{"name": "floor", "emptyDir": {}}]
    assert "sandbox" not in str(floor["metadata"])  # no label: the webhook leaves it alone
