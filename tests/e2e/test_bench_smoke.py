"""The real-node bench's smallest run (`python -m bench.realnode --smoke`: one round of one pod
per arm, a few echoes) on this suite's install, so it keeps running against the default
install's security (trainer label, bound namespace, projected token, https with the CA) without
an install of its own."""

from __future__ import annotations

import pytest

from bench import realnode


@pytest.mark.timeout(600)
def test_realnode_bench_smoke(sandman, capsys):
    args = realnode.parse(["--smoke"])
    leftovers: list[str] = []
    info, rounds, bench = realnode.measure(sandman.cluster.testbed, sandman.inst, args,
                                           leftovers)
    assert not bench.errors, bench.errors
    assert not leftovers, leftovers
    assert len(rounds) == 1
    for arm in realnode.ARMS:
        assert len(rounds[0]["pods"][arm]) == 1, (arm, rounds[0]["pods"][arm])
    assert len(rounds[0]["echo"]["trainer"]) == args.echo
    res = {**realnode.aggregate(rounds), **info, "setup_s": 0.0, "rounds": 1, "sandboxes": 1,
           "errors": "", "leftovers": "", "release_leftovers": "", "echo_cpu": bench.echo_cpu,
           "command": "python -m bench.realnode --smoke", "wall_s": 0.0,
           "machine": {"cpus": 2, "arch": "", "kernel": "", "python": "", "date": "",
                       "load_before": ""}}
    res["echo"].update(n_per_block=args.echo, warmup=20, blocks=args.echo_blocks)
    assert realnode.render_section(res).startswith(realnode.SECTION)
