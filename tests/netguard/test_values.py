"""netguard's value classes (netguard/values.py) keep what @dataclass gave them, and netguard's
hot path stays free of the imports they replace (their CPU is measured by make bench-netguard)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from netguard.config import Config, ConfigError, EgressAllow
from netguard.netlink import Route
from netguard.verify import Probe


def test_frozen_values_refuse_assignment_and_deletion():
    c = Config()
    with pytest.raises(AttributeError, match="frozen"):
        c.egress = "allow"
    with pytest.raises(AttributeError, match="frozen"):
        del c.ingress_port
    assert c.egress == "deny"


def test_defaults_positional_keyword_and_bad_arguments():
    net = ipaddress.ip_network("10.0.0.10/32")
    assert EgressAllow(net) == EgressAllow(net, None, None) == EgressAllow(network=net)
    assert EgressAllow(net, 53) != EgressAllow(net, 53, "udp")
    with pytest.raises(TypeError, match="missing required argument 'network'"):
        EgressAllow()
    with pytest.raises(TypeError, match="unexpected keyword argument 'host'"):
        EgressAllow(net, host="x")
    with pytest.raises(TypeError, match="multiple values for argument 'network'"):
        EgressAllow(net, network=net)
    with pytest.raises(TypeError, match="at most 4 positional"):
        EgressAllow(net, 53, "udp", "svc/a.b:53/udp", "extra")


def test_hash_and_equality_follow_the_compared_fields():
    a, b = Config(), Config(lockdown=True)
    assert a == b and hash(a) == hash(b)  # lockdown is not compared
    assert Config(egress="allow") != a
    assert len({Config(), Config(), Config(egress="allow")}) == 2
    assert (a == "deny") is False
    with pytest.raises(TypeError):
        hash(Probe("10.0.0.1:80", "blocked", "timeout", 1.0))  # mutable: unhashable


def test_factories_give_each_instance_its_own_list():
    r1, r2 = Route(2, 0, 254, 1), Route(2, 0, 254, 1)
    r1.gateways.append("10.0.0.1")
    assert r2.gateways == [] and r1 != r2


def test_replace_validates_again():
    c = Config(ingress_from_gateway=True)
    assert c.with_gateways(["10.0.0.1"]).ingress_gateways == (
        ipaddress.ip_network("10.0.0.1/32"),)
    with pytest.raises(ConfigError):
        Config().replace(egress="sideways")
    assert "Config(egress='deny'" in repr(Config())


def test_hot_path_imports_neither_dataclasses_nor_hashlib():
    code = ("import sys, netguard.cli; print(sorted(m for m in ('dataclasses', 'inspect', "
            "'hashlib', 'datetime', 'shutil', 'tempfile') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "[]"


def _loaded_after(args: list[str], modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` are imported once the guard's Config is built from `args` as apply
    builds it (netguard.cli._config; no resolver is asked: no svc/ entry reaches it)."""
    code = ("import sys, netguard.cli as c\n"
            f"a = c.build_parser().parse_args(['apply', *{args!r}])\n"
            "c._config(a, gateways=[])\n"
            f"print(sorted(m for m in {modules!r} if m in sys.modules))")
    return eval(subprocess.run([sys.executable, "-S", "-c", code], capture_output=True,
                               text=True, check=True, timeout=60,
                               cwd=Path(__file__).resolve().parents[2]).stdout)


def test_a_guard_without_an_allowlist_imports_no_allowlist_code():
    """The allowlist's parser and the Service resolver cost nothing on a plain guard's start
    (bench-netguard's CPU budget), and the resolver nothing on a CIDR-only allowlist's."""
    mods = ("sandman.egress", "netguard.resolve", "typing", "dataclasses")
    assert _loaded_after(["--egress", "deny", "--ingress-from", "10.0.0.0/8"], mods) == []
    assert _loaded_after(["--egress", "allow"], mods) == []
    assert _loaded_after(["--allow-egress", "10.0.0.0/8:443/tcp", "--never-egress",
                          "10.1.0.0/16"], mods) == ["sandman.egress"]


def test_utc_now_spells_time_as_datetime_does():
    """netguard's own timestamp (no `datetime` on the hot path) reads back as the same instant
    datetime would have written, in the same spelling."""
    import datetime as dt

    from netguard.cli import utc_now

    before = dt.datetime.now(dt.UTC)
    got = utc_now()
    after = dt.datetime.now(dt.UTC)
    parsed = dt.datetime.fromisoformat(got)
    assert before.replace(microsecond=before.microsecond // 1000 * 1000) <= parsed <= after
    assert len(got) == len(before.isoformat(timespec="milliseconds")) and got.endswith("+00:00")
    assert utc_now("Z").endswith("Z") and dt.datetime.fromisoformat(utc_now("Z")[:-1])


def test_parsing_and_installing_import_no_shutil_nor_importlib_util(tmp_path):
    """argparse's default formatter imports shutil (fnmatch, bz2, lzma) at the first
    add_argument, and execd's install used importlib.util: both were CPU on every guarded
    start. The guard's own formatter and the install's bytecode_path keep them out."""
    code = ("import sys, netguard.cli, execd.install\n"
            "a = netguard.cli.build_parser().parse_args(['apply', '--egress', 'deny'])\n"
            f"execd.install.install({str(tmp_path)!r})\n"
            "print(sorted(m for m in ('shutil', 'fnmatch', 'bz2', 'lzma', 'importlib.util')"
            " if m in sys.modules))")
    # -S: the modules from this checkout only (the dev venv's editable-install finder, run
    # by site, imports importlib.util and fnmatch itself; no pod has it).
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stderr
    assert (tmp_path / "execd.py").exists()


def test_the_guards_help_is_as_wide_as_argparses(monkeypatch):
    import argparse

    from netguard.args import _Formatter

    for cols in ("100", "0", "junk", None):
        if cols is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", cols)
        assert _Formatter("p")._width == argparse.HelpFormatter("p")._width, cols
