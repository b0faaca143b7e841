"""The command lines the docs may name, as their parsers know them (tests/test_docs_names.py).

Each component's argparse parser is built in-process by the very function its `python -m`
entry runs (`main`, `parse_args`, `build_parser`), stopped at its first parse, so a flag added,
renamed or removed in the code is what the docs are checked against. locust's parser (its
own options plus the ones each locustfile and loadtest/common.py add) is built in a process of
its own: importing locust patches the standard library for gevent.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]

# `python -m <name>` -> (module, function). The function either returns the parser or builds it
# and parses its argv, which is stopped there (nothing runs).
ENTRIES: dict[str, tuple[str, str]] = {
    "webhook": ("webhook.__main__", "main"),
    "controller": ("controller.__main__", "parse_args"),
    "controller.cleanup": ("controller.cleanup", "parse_args"),
    "netguard": ("netguard.cli", "build_parser"),
    "execd": ("execd.execd_daemon.main", "main"),  # in pods: python3 /sandman/execd.py (the launcher)
    "loadtest.job": ("loadtest.job", "main"),
    "loadtest.report": ("loadtest.report", "main"),
    "sandman.selftest": ("sandman.selftest", "main"),
    "sandman.client": ("sandman.client.cli", "main"),  # also the `sandman` entry point
    "testbed": ("testbed.__main__", "main"),
    "testbed.demo": ("testbed.demo", "main"),
    "testbed.install": ("testbed.install", "main"),
    "testbed.standin": ("testbed.standin", "main"),
    "testbed.images": ("testbed.images", "main"),
    "testbed.kind_up": ("testbed.kind_up", "main"),
    **{f"bench.{b}": (f"bench.{b}", "main")
       for b in ("controller", "execd", "fork", "loadtest", "minisweagent", "netguard", "realnode",
                 "replay", "reuse", "swerex", "trees", "webhook", "group", "warmburst")},
}
# Entry points that read their argv by hand and take no flag at all.
NO_FLAGS = {"execd.install"}  # python3 -m execd.install DIR
# The locustfiles `python -m loadtest NAME` and `locust -f PATH` run.
LOCUSTFILES = ("loadtest/acquire_burst.py", "loadtest/execd_storm.py",
               "testbed/locustfiles/admission_storm.py")


@dataclass
class Cli:
    """The option strings of a parser: its own, and each subcommand's."""

    options: set[str] = field(default_factory=set)
    verbs: dict[str, set[str]] = field(default_factory=dict)

    def allowed(self, verb: str | None) -> set[str]:
        """What may follow `<cli> [verb]`: the parser's own options and the verb's; with no
        verb named, any verb's."""
        if verb in self.verbs:
            return self.options | self.verbs[verb]
        return self.options.union(*self.verbs.values())

    def every(self) -> set[str]:
        return self.allowed(None)


def _long(action: argparse.Action) -> set[str]:
    return {s for s in action.option_strings if s.startswith("--")}


def cli_of(parser: argparse.ArgumentParser) -> Cli:
    cli = Cli()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                cli.verbs[verb] = cli_of(sub).every()
        else:
            cli.options |= _long(action)
    return cli


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _stop(self: argparse.ArgumentParser, *args: object, **kwargs: object):
    raise _Built(self)


def parser_of(module: str, function: str) -> argparse.ArgumentParser:
    fn = getattr(importlib.import_module(module), function)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", _stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_intermixed_args", _stop):
        try:
            got = fn() if function == "build_parser" else fn([])
        except _Built as b:
            return b.parser
    if isinstance(got, argparse.ArgumentParser):
        return got
    raise AssertionError(f"{module}.{function} built no argparse parser")


def component_clis() -> dict[str, Cli]:
    clis = {name: cli_of(parser_of(mod, fn)) for name, (mod, fn) in ENTRIES.items()}
    clis.update({name: Cli() for name in NO_FLAGS})
    return clis


def locust_clis(files: tuple[str, ...] = LOCUSTFILES, timeout: float = 120) -> dict[str, Cli]:
    """locust's parser as `locust -f FILE` builds it, for each file (in a new process)."""
    r = subprocess.run([sys.executable, "-m", "tests.docs_cli", "locust", *files], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"building locust's parsers failed: {r.stderr[-2000:]}")
    return {f: Cli(options=set(opts)) for f, opts in json.loads(r.stdout).items()}


def _locust_options(files: list[str]) -> dict[str, list[str]]:
    import locust.argument_parser as lap  # patches the stdlib for gevent: this process only
    from locust import events

    hook = events.init_command_line_parser
    base = list(hook._handlers)
    out = {}
    for i, rel in enumerate(files):
        # Each file on its own: its imports (loadtest/common.py's options) registered afresh.
        hook._handlers[:] = base
        for name in [m for m in sys.modules if m.split(".")[0] in ("loadtest", "testbed")]:
            del sys.modules[name]
        spec = importlib.util.spec_from_file_location(f"_locustfile_{i}", REPO / rel)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parser = lap.get_parser(default_config_files=[])
        out[rel] = sorted({s for a in parser._actions for s in a.option_strings
                           if s.startswith("--")})
    return out


def script_flags(path: Path) -> set[str]:
    """The flags a script that reads its argv by hand (tools/*.py) compares its arguments with:
    string constants starting with `--` in comparisons and `startswith()` calls."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        parts: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "startswith":
            parts = list(node.args)
        for part in parts:
            for c in ast.walk(part):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) \
                        and c.value.startswith("--") and len(c.value) > 2:
                    found.add(c.value.split("=")[0])
    return found


if __name__ == "__main__":
    if sys.argv[1:2] != ["locust"]:
        sys.exit("usage: python -m tests.docs_cli locust FILE...")
    print(json.dumps(_locust_options(sys.argv[2:])))
