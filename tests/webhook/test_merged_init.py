"""A guarded sandbox has one injected init container: the guard, which installs execd once its
rules are in (`--install-execd`). What marks a pod as carrying sandman's install must follow
netguard's own parser, every spelling of the flag included: a guard that installs without the
sandbox label is refused, and its label can never be dropped."""

from __future__ import annotations

import contextlib
import io

import pytest

from netguard.cli import build_parser
from sandman.contract import EXECD_DIR, LABEL_SANDBOX, NETGUARD_CONTAINER
from sandman.podspec import (
    GUARD_EGRESS_DENY,
    INSTALL_EXECD_ARGS,
    INSTALL_FLAG_PREFIX,
    SandboxPolicy,
    check_sandbox,
    installs_execd,
    make_sandbox,
)
from tests.webhook.golden_cases import pod

FLAG = INSTALL_EXECD_ARGS[0]


def _parsed_install(args: list[str]):
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return build_parser().parse_args(["apply", *args]).install_execd
    except SystemExit:
        return "refused"


def test_every_spelling_netguards_parser_takes_starts_with_the_prefix():
    took = []
    for n in range(2, len(FLAG) + 1):
        spelling = FLAG[:n]
        for args in ([spelling, "/x"], [f"{spelling}=/x"]):
            if _parsed_install(args) == "/x":
                took.append(spelling)
                assert args[0].startswith(INSTALL_FLAG_PREFIX), args
    assert FLAG[:len(INSTALL_FLAG_PREFIX)] in took  # the prefix is itself a spelling it takes
    # One character shorter is ambiguous (--ingress-*): the parser refuses it.
    assert _parsed_install([INSTALL_FLAG_PREFIX[:-1], "/x"]) == "refused"


def test_a_sandbox_guard_installs_and_mounts_the_whole_volume():
    out = make_sandbox(pod(), SandboxPolicy())
    inits = out["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [NETGUARD_CONTAINER]
    assert inits[0]["args"][-2:] == [FLAG, EXECD_DIR]
    assert inits[0]["volumeMounts"] == [{"name": "sandman", "mountPath": EXECD_DIR}]
    assert installs_execd(out) and check_sandbox(out, SandboxPolicy()) == []


@pytest.mark.parametrize("spelling", [[FLAG, EXECD_DIR], [f"{FLAG}={EXECD_DIR}"],
                                      ["--inst", EXECD_DIR], ["--ins=/sandman"]])
def test_an_installing_guard_without_the_label_is_judged_a_sandbox_and_refused(spelling):
    out = make_sandbox(pod(), SandboxPolicy())
    out["metadata"]["labels"] = {"app": "x"}
    out["spec"]["initContainers"][0]["args"][-2:] = spelling
    assert installs_execd(out)
    rules = {r.rule for r in check_sandbox(out, SandboxPolicy())}
    assert "sandbox-label" in rules, rules


def test_an_unguarded_sandbox_keeps_the_install_container_and_the_guard_never_appears():
    policy = SandboxPolicy(guard=GUARD_EGRESS_DENY)
    out = make_sandbox(pod(), policy)
    assert [c["name"] for c in out["spec"]["initContainers"]] == ["sandman-execd-install"]
    assert installs_execd(out) and check_sandbox(out, policy) == []
    deny = make_sandbox(pod(labels={LABEL_SANDBOX: "true", "sandman.dev/egress": "deny"}), policy)
    assert [c["name"] for c in deny["spec"]["initContainers"]] == [NETGUARD_CONTAINER]
    assert deny["spec"]["initContainers"][0]["args"][-2:] == [FLAG, EXECD_DIR]
