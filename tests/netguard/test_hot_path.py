"""What keeps an injected guard's start cheap (no argparse, re, json, subprocess or socket
module on its path) without changing what it does: the fast apply reader against argparse,
the JSON writer against json, and the process runner against real programs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netguard import jsontext, proc
from netguard.cli import APPLY_DEFAULTS, build_parser, fast_apply_args
from sandman import podspec
from sandman.contract import NETGUARD_APPLY_OPTIONS as APPLY_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("argparse", "re", "json", "_json", "subprocess", "socket", "enum", "selectors",
         "threading", "gettext", "locale", "signal", "typing", "dataclasses", "hashlib",
         "shutil", "contextlib", "importlib.util")


def _argparse(argv: list[str]):
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return vars(build_parser().parse_args(argv))
    except SystemExit:
        return None


def _same(a: dict, b: dict | None) -> bool:
    """Equal, NaN included (`--verify-timeout nan` reads as NaN either way)."""
    return b is not None and repr(sorted(a.items())) == repr(sorted(b.items()))


def test_an_injected_guard_imports_none_of_the_heavy_modules(tmp_path):
    """The args the webhook renders for a guarded, allowlisted sandbox, read and turned into
    the guard's Config as apply does, and execd installed: none of HEAVY is imported."""
    args = ["apply", "--egress", "deny", "--ingress-port", "9470", "--ingress-from",
            "10.0.0.0/8", "--allow-egress", "10.1.0.0/16:443/tcp", "--never-egress",
            "10.1.2.0/24", *podspec.GUARD_ARGS_TAIL[:2], "--ingress-from-gateway",
            "--install-execd", str(tmp_path)]
    args[args.index(podspec.GUARD_ARGS_TAIL[1])] = "10.9.9.9"
    code = ("import sys, netguard.cli as c, execd.install\n"
            f"a = c.fast_apply_args({args!r})\n"
            "assert a is not None\n"
            "c._config(a, gateways=[])\n"
            "c.jsontext.dumps({'a': [1.5, None]}, indent=2)\n"
            f"execd.install.install({str(tmp_path)!r})\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    # -S: only this checkout's modules (the dev venv's site hooks import some of HEAVY).
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_injected_command_runs_the_package_file_without_runpy_or_site(tmp_path):
    """podspec's guard command, its path pointed at this checkout's netguard/__main__.py
    through a link as in the image, from a directory holding a hostile `netguard` package
    and with PYTHONPATH at it: the real netguard runs (-I), and neither runpy (-m) nor site
    is imported; its output is `python3 -m netguard`'s."""
    assert podspec.NETGUARD_COMMAND[-2:] == [podspec.NETGUARD_PATH, "apply"]
    link = tmp_path / "netguard.py"
    link.symlink_to(ROOT / "netguard" / "__main__.py")
    evil = tmp_path / "netguard"
    evil.mkdir()
    (evil / "__init__.py").write_text("raise SystemExit('the hostile netguard ran')\n")
    (evil / "cli.py").write_text("raise SystemExit('the hostile netguard ran')\n")
    argv = [sys.executable if a == "python3" else str(link) if a == podspec.NETGUARD_PATH
            else a for a in podspec.NETGUARD_COMMAND[:-1]]
    argv[1:1] = ["-X", "importtime"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    render = ["render", "--egress", "deny", "--allow-egress", "10.1.0.0/16:443"]
    out = subprocess.run([*argv, *render], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "netguard.cli" in imported
    assert not imported & {"runpy", "site", "_json", "importlib.util"}, imported
    want = subprocess.run([sys.executable, "-m", "netguard", *render], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert want.returncode == 0 and out.stdout == want.stdout


def test_the_fast_reader_knows_exactly_argparses_apply_options():
    apply = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
                 if a[0] == "apply")[1]
    seen = set()
    for action in apply._actions:
        if action.dest == "help":
            continue
        name = action.option_strings[0]
        assert action.option_strings == [name]
        dest, kind, extra, _ = APPLY_OPTIONS[name]
        seen.add(name)
        assert dest == action.dest
        default = [] if action.dest == "verify_blocked" else action.default
        assert (APPLY_DEFAULTS[dest] or None) == (default or None), name
        if action.choices is not None:
            assert tuple(extra) == tuple(action.choices), name
    assert seen == set(APPLY_OPTIONS)
    # The webhook judges a guard's args with its own parser of the table: the same spellings
    # (abbreviations are unique prefixes of these), the same readings.
    webhook = podspec._guard_apply_parser()
    assert set(webhook._option_string_actions) == set(apply._option_string_actions)
    for argv in (["--egr", "deny", "--allow=10.0.0.0/8", "--ins", "/x"], []):
        assert vars(webhook.parse_args(argv)) == {
            k: v for k, v in vars(apply.parse_args(argv)).items() if k != "cmd"}


VALUES = ["deny", "allow", "json", "text", "nft", "legacy", "auto", "9470", " 12", "1_0", "x",
          "1.5", "nan", "10.0.0.0/8:443", "a,b", "", "=", "-1", "--egress", "-", "--", "é"]


def _random_argv(rng: random.Random) -> list[str]:
    opts = list(APPLY_OPTIONS) + ["--egr", "--no-v", "--ingress-from-g", "-h", "--help",
                                  "--bogus", "--", "deny"]
    argv = ["apply"]
    for _ in range(rng.randrange(0, 7)):
        opt = rng.choice(opts)
        r = rng.random()
        if r < 0.3:
            argv.append(f"{opt}={rng.choice(VALUES)}")
        elif r < 0.8:
            argv += [opt, rng.choice(VALUES)]
        else:
            argv.append(opt)
    return argv


@pytest.mark.slow
def test_the_fast_reader_reads_as_argparse_does_or_not_at_all():
    """Fuzzed apply command lines (abbreviations, `=` forms, option-like values, bad values,
    repeats): whatever the fast reader returns is what argparse returns; when argparse would
    refuse, so does the fast reader (returns None, and argparse answers)."""
    rng = random.Random(1234)
    taken = 0
    for _ in range(3000):
        argv = _random_argv(rng)
        fast = fast_apply_args(argv)
        if fast is None:
            continue
        taken += 1
        assert _same(vars(fast), _argparse(argv)), argv
    assert taken > 300  # the fuzz reached the fast path often, not only its refusals


@pytest.mark.parametrize("argv", [
    ["apply", "--egress", "deny", "--ingress-port", "9470", "--ingress-from", "1.2.3.4",
     "--ingress-from-gateway", "--install-execd", "/sandman"],
    ["apply", "--allow-egress=10.0.0.0/8:443/tcp", "--allow-egress", "svc/m.infra:3141/tcp",
     "--never-egress", "10.1.0.0/16", "--no-verify", "--verify-timeout", "2.5"],
    ["apply", "--verify-blocked", "1.2.3.4:80", "--verify-blocked", "[::1]:80",
     "--status-file", "", "--log-format", "json", "--backend", "legacy"],
    ["apply"],
])
def test_command_lines_the_webhook_renders_take_the_fast_path(argv):
    fast = fast_apply_args(argv)
    assert fast is not None and _same(vars(fast), _argparse(argv))


@pytest.mark.parametrize("argv", [
    ["apply", "--egr", "deny"],  # an abbreviation: argparse's business
    ["apply", "-h"], ["apply", "--ingress-port", "-1"], ["apply", "--egress", "sideways"],
    ["apply", "--no-verify=1"], ["apply", "--ingress-port"], ["render"], [],
    ["apply", "--", "--egress"], ["apply", "extra"],
])
def test_anything_else_goes_to_argparse(argv):
    assert fast_apply_args(argv) is None


STATUSES = [
    {"version": 1, "ok": False, "error": "cannot guard ipv6: \"x\"\n\ttab \u2028 é \x00 \U0001f600",
     "timings_ms": {"total": 12.34, "detect": 0.1, "x": 1e-07, "big": 1e22, "n": -0.0},
     "probes": [], "options": {}, "families": ["ipv4", "ipv6"], "pod_ips": [],
     "cpu_ms": {"self": 31.0, "children": 7}, "verified": True, "nested": [[{"b": 1, "a": [True, None]}]]},
    [], {}, "s", 0, -5, 10 ** 30, 1.5, float("inf"), float("-inf"),
]


@pytest.mark.parametrize("obj", STATUSES)
@pytest.mark.parametrize("indent", [None, 2])
def test_json_text_is_what_json_writes(obj, indent):
    assert jsontext.dumps(obj, indent) == json.dumps(obj, indent=indent, sort_keys=True)


@settings(max_examples=500, deadline=None)
@given(st.text())
def test_json_text_strings_are_what_json_writes(s):
    assert jsontext.dumps({s: [s]}) == json.dumps({s: [s]}, sort_keys=True)


def test_json_text_nan_and_refusals():
    assert jsontext.dumps(float("nan")) == json.dumps(float("nan"))
    for bad in ({1: 2}, {"a": object()}, b"x", {"a": {1, 2}}):
        with pytest.raises(TypeError):
            jsontext.dumps(bad)


def test_run_feeds_reads_and_reports_the_exit_status():
    data = "".join(f"line {i} " + "x" * 100 + "\n" for i in range(20000))  # ~2 MiB: past any pipe
    code, out, err = proc.run(["/bin/sh", "-c", "cat; echo done >&2; exit 3"], data, 30)
    assert (code, out, err) == (3, data, "done\n")
    assert proc.run(["/bin/sh", "-c", "kill -9 $$"], "", 30)[0] == -9


def test_run_with_a_child_that_stops_reading_does_not_hang():
    code, out, _ = proc.run(["/bin/sh", "-c", "head -c 5; exit 0"], "y" * (1 << 20), 30)
    assert (code, out) == (0, "yyyyy")


def test_the_child_gets_the_default_sigpipe():
    """The interpreter ignores SIGPIPE; a tool writing into a closed pipe must still die of it
    (as under subprocess), not loop on EPIPE."""
    code, _, _ = proc.run(["/bin/sh", "-c", "trap - PIPE; yes | head -c 1 >/dev/null; "
                           "kill -0 $$; echo ok"], "", 30)
    assert code == 0
    out = proc.run(["/bin/sh", "-c", "grep SigIgn /proc/self/status"], "", 30)[1]
    assert int(out.split()[1], 16) & (1 << 12) == 0  # bit 13 (SIGPIPE) not ignored


def _zombies_of(pid: int) -> list[str]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [k for k in kids if Path(f"/proc/{k}/stat").exists()]


def test_a_child_past_its_deadline_is_killed_and_reaped():
    t0 = time.monotonic()
    with pytest.raises(proc.Timeout):
        proc.run(["/bin/sleep", "30"], "", 0.3)
    assert time.monotonic() - t0 < 5
    assert _zombies_of(os.getpid()) == []


def test_a_child_that_closes_its_output_but_lingers_is_bounded_too():
    with pytest.raises(proc.Timeout):
        proc.run(["/bin/sh", "-c", "exec >&- 2>&-; sleep 30"], "", 0.3)
    assert _zombies_of(os.getpid()) == []


def test_a_missing_program_is_an_oserror_and_leaks_no_descriptor():
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(OSError):
            proc.run(["/nonexistent/iptables-save"], "", 5)
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_childs_descriptors_are_its_three_pipes_only():
    """As subprocess's close_fds: even a descriptor left inheritable does not reach the tool."""
    r, w = os.pipe()
    try:
        os.set_inheritable(r, True)
        out = proc.run(["/bin/sh", "-c", "ls /proc/$$/fd"], "", 30)[1].split()
    finally:
        os.close(r)
        os.close(w)
    assert str(r) not in out and {"0", "1", "2"} <= set(out), out
