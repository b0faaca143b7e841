"""Parsing and checks without a server (the I/O-free half), plus a property test of
byte-exact files through a real execd."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandman.client import (
    ExecResult,
    IntegrityError,
    Lease,
    ProtocolError,
    RetryPolicy,
    Sandbox,
    _core,
)

from .conftest import Execd


def _lease(**over):
    d = {"id": "sb-1", "pod": "p", "address": "10.0.0.7", "port": 9470, "token": "s3cret",
         "warm": True, "timings": {"queued_ms": 1, "create_ms": 2.5, "ready_ms": None}}
    d.update(over)
    return d


def test_lease_parses_and_hides_the_token() -> None:
    lease = Lease.from_json(_lease())
    assert (lease.id, lease.port, lease.warm, lease.timings.create_ms) == ("sb-1", 9470, True,
                                                                           2.5)
    assert "s3cret" not in repr(lease) and "token" not in lease.raw


@pytest.mark.parametrize("bad", [{"port": "9470"}, {"port": True}, {"port": 0},
                                 {"token": ""}, {"id": None}, {"address": 7}])
def test_lease_refuses_malformed_answers(bad) -> None:
    with pytest.raises(ProtocolError):
        Lease.from_json(_lease(**bad))


def test_exec_result_timeout_needs_execds_note() -> None:
    base = {"exit_code": 124, "output": "", "truncated": False, "duration_ms": 1.0}
    assert not ExecResult.from_json(dict(base, error=None), "r").timed_out
    assert ExecResult.from_json(dict(base, error="timeout after 1s; killed"), "r").timed_out
    assert not ExecResult.from_json(dict(base, error="timeout x", timed_out=False), "r").timed_out
    with pytest.raises(ProtocolError):
        ExecResult.from_json(dict(base, exit_code=None), "r")


def test_check_read_fails_closed() -> None:
    data = b"abc\r\n"
    good = hashlib.sha256(data).hexdigest()
    ok = httpx.Response(200, content=data, headers={"X-Content-SHA256": good})
    assert _core.check_read("p", ok).data == data
    for headers in ({}, {"X-Content-SHA256": "0" * 64}, {"X-Content-SHA256": "nothex"}):
        with pytest.raises(IntegrityError):
            _core.check_read("p", httpx.Response(200, content=data, headers=headers))


def test_execd_url_brackets_ipv6() -> None:
    assert _core.execd_url("fd00::7", 9470) == "http://[fd00::7]:9470"
    assert _core.execd_url("10.1.2.3", 9470) == "http://10.1.2.3:9470"


def test_retry_schedule_is_bounded() -> None:
    a = _core.Attempts(RetryPolicy(attempts=3, backoff_s=0.01, budget_s=1), 0)
    delays = []
    while True:
        a.start()
        d = a.delay()
        if d is None:
            break
        delays.append(d)
    assert len(delays) == 2 and all(0 < d <= 0.02 for d in delays)
    # No time left: no retry, whatever the count.
    b = _core.Attempts(RetryPolicy(attempts=100, backoff_s=1, budget_s=0), 0)
    b.start()
    assert b.delay() is None


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), name=st.text(
    alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
    min_size=1, max_size=40).filter(lambda s: s not in (".", "..")))
def test_any_bytes_any_name_round_trip(execd: Execd, tmp_path_factory, data: bytes,
                                       name: str) -> None:
    d = tmp_path_factory.getbasetemp() / "prop"
    d.mkdir(exist_ok=True)
    path = str(d / name)
    with Sandbox.connect(execd.address, execd.port, execd.token) as sb:
        w = sb.write(path, data)
        assert w.sha256 == hashlib.sha256(data).hexdigest()
        assert sb.read(path) == data


@pytest.mark.parametrize("sync_cls,async_cls", [
    ("Client", "AsyncClient"), ("Sandbox", "AsyncSandbox")])
def test_twins_have_the_same_api(sync_cls: str, async_cls: str) -> None:
    """Mirrored files drift; this catches a method or argument added to one twin only."""
    import inspect

    import sandman.client as c

    renames = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
    s, a = getattr(c, sync_cls), getattr(c, async_cls)

    def api(cls, rename=None):
        out = {}
        for name, fn in inspect.getmembers(cls):
            dunder = name in renames or name in renames.values()
            if (name.startswith("_") and not dunder) or not callable(fn):
                continue
            params = [p.name for p in inspect.signature(fn).parameters.values()]
            out[(rename or {}).get(name, name)] = params
        return out

    assert api(s, renames) == api(a)
