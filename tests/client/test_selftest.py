"""`python3 -m sandman.selftest` (what `helm test` runs) against the fake controller and a real
execd on 127.0.0.1. With `sandbox.ingressFrom` narrowed to the trainers, the test pod is not a
trainer: it must not fail for being refused (it used to: `echo ok` could never connect), and it
must fail if execd lets it in anyway."""

from __future__ import annotations

import socket

import pytest

from sandman import selftest

from .conftest import LOOPBACK, FakeController


def _closed_port() -> int:
    s = socket.socket()
    s.bind((LOOPBACK, 0))  # bound, never listening: connections are refused
    port = s.getsockname()[1]
    s.close()
    return port


def _run(ctl: FakeController, *args: str, capsys) -> tuple[int, str, str]:
    rc = selftest.main(["--controller", ctl.url, "--job", "helm-test", "--timeout", "30", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_default_ingress_runs_echo_ok(controller, capsys):
    rc, out, err = _run(controller, "--own-ip", "10.9.0.5", capsys=capsys)
    assert rc == 0, err
    assert "ok: acquired, ran `echo ok`, released" in out
    assert controller.sandboxes == {}  # released


def test_inside_a_narrowed_ingress_runs_echo_ok(controller, capsys):
    rc, out, err = _run(controller, "--own-ip", "10.33.0.5", "--ingress-from", "10.32.0.0/12",
                        capsys=capsys)
    assert rc == 0 and "ran `echo ok`" in out, err


def test_outside_a_narrowed_ingress_passes_when_execd_refuses_this_pod(controller, capsys):
    controller.target_port = _closed_port()  # the guard: nothing gets through from here
    rc, out, err = _run(controller, "--own-ip", "10.200.0.9", "--ingress-from", "10.32.0.0/12",
                        capsys=capsys)
    assert rc == 0, err
    assert "execd refused this pod (10.200.0.9 is outside 10.32.0.0/12" in out
    assert controller.sandboxes == {} and controller.calls("DELETE")


def test_outside_a_narrowed_ingress_fails_when_execd_lets_this_pod_in(controller, capsys):
    rc, _out, err = _run(controller, "--own-ip", "10.200.0.9", "--ingress-from", "10.32.0.0/12",
                         capsys=capsys)
    assert rc == 1
    assert "accepted a connection from 10.200.0.9" in err and "guard is not in place" in err
    assert controller.sandboxes == {}  # released all the same


def test_no_controller_fails_loudly(capsys):
    rc = selftest.main(["--controller", f"http://{LOOPBACK}:{_closed_port()}", "--timeout", "5"])
    assert rc == 1 and capsys.readouterr().err.startswith("FAIL: ")


@pytest.mark.parametrize("ip,sources,want", [
    (None, ["10.0.0.0/8"], True),  # own address unknown: try the exec
    ("10.1.2.3", [], True),  # no sources: the default, anywhere
    ("10.1.2.3", ["10.0.0.0/8"], True),
    ("10.1.2.3", ["10.2.0.0/16", "fd00::/8"], False),
    ("10.1.2.3", ["::/0"], False),  # an IPv6 wildcard does not admit IPv4
    ("fd00::5", ["fd00::/8"], True),
])
def test_admitted(ip, sources, want):
    assert selftest.admitted(ip, sources) is want
