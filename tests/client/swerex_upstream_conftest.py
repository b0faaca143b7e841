"""The conftest.py under which SWE-ReX's own runtime tests (tests/test_execution.py of its sdist
at the locked version, tools/swerex_tests.py) run against sandman's adapter: the fixtures their
conftest (in SWE-ReX's repository, not its sdist) gives them, `remote_runtime` and
`runtime_with_default_session`, are a `SandmanRuntime` here, and its `_Action`/`_Command` are
restated. tests/controller/test_swerex_upstream.py copies both files into one folder and runs
pytest there.

The sandbox: $SANDMAN_URL set, one `SandmanDeployment` for the session (the real controller on
the test bed); else $SWEREX_EXECD (ADDRESS:PORT:TOKEN), a runtime on that execd (a run
without a bed, while debugging).

SWE-ReX's tests are coroutines run by pytest-asyncio, which this venv does not have: each runs
under its own `asyncio.run()` (as SWE-agent runs each runtime call), the fixtures are plain.
`EXPECTED_FAILURES` names the tests that cannot pass on one execd shell, each with its reason,
as strict xfails: one that starts passing fails the run, so the list stays true.
"""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
)

from sandman.client.swerex import SandmanDeploymentConfig, SandmanRuntime

# test name -> why it cannot pass against one execd (docs/sdk.md "SWE-agent / SWE-ReX").
EXPECTED_FAILURES = {
    # A RemoteRuntime against a host that does not resolve: not our runtime at all, and a DNS
    # query for a public name, which a test here never sends.
    "test_server_dead": "SKIP",
    # Two named sessions open at once: execd has one persistent shell, and the adapter refuses
    # a second with SessionLimitError rather than share it.
    "test_multiple_isolated_shells": "one shell per sandbox: a second named session is "
                                     "refused (SessionLimitError)",
    # `less` needs a terminal to wait: a command runs with stdin /dev/null and its output to
    # a pipe, where less prints and exits at once, so nothing times out.
    "test_interrupt_pager": "no terminal for non-interactive commands: less exits at once",
    # Marked xfail by SWE-ReX itself: LocalRuntime strips an interactive answer's output, so
    # "hello world\n" comes back "hello world" there as here. Strict here, so a pass is seen.
    "test_run_in_shell_multiple_interactive_and_normal_commands":
        "xfail upstream too: interactive output is stripped (LocalRuntime's rule)",
}


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5


@pytest.fixture(scope="session")
def _sandman_runtime():
    if os.environ.get("SANDMAN_URL"):
        deployment = SandmanDeploymentConfig(
            image=os.environ.get("SWEREX_IMAGE", "registry.invalid/swerex/upstream:1"),
            job="swerex-upstream", acquire_timeout_s=60).get_deployment()
        asyncio.run(deployment.start())
        try:
            yield deployment.runtime
        finally:
            asyncio.run(deployment.stop())
        return
    address, port, token = os.environ["SWEREX_EXECD"].split(":", 2)
    rt = SandmanRuntime.connect(address, int(port), token)
    try:
        yield rt
    finally:
        asyncio.run(rt.close())


@pytest.fixture
def remote_runtime(_sandman_runtime: SandmanRuntime):
    yield _sandman_runtime
    # A test that left its session open must not decide the next one's create_session.
    for name in list(_sandman_runtime.sessions):
        asyncio.run(_sandman_runtime.close_session(CloseBashSessionRequest(session=name)))


@pytest.fixture
def runtime_with_default_session(remote_runtime: SandmanRuntime):
    asyncio.run(remote_runtime.create_session(CreateBashSessionRequest()))
    yield remote_runtime


def pytest_collection_modifyitems(items):
    for item in items:
        why = EXPECTED_FAILURES.get(item.name)
        if why == "SKIP":
            item.add_marker(pytest.mark.skip(reason="sends a DNS query for a public name"))
        elif why:
            # First, before any xfail of its own (the first one found decides).
            item.add_marker(pytest.mark.xfail(reason=why, strict=True), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(fn(**args))
    return True
