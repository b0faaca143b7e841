"""A component's command line run in-process: `main(argv)` with stdout and stderr captured, as
`python -m <component>` would run it, without a new interpreter importing the component (about
2 s for the controller). One subprocess test per component proves that `python -m` reaches the
same `main`."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str],
             stdin: str | None = None) -> Ran:
    """`main(argv)`'s exit status (its return value, or SystemExit's code as the interpreter
    reads it) and what it wrote."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:
                rc = e.code
    finally:
        sys.stdin = old_stdin
    if rc is None:
        rc = 0
    elif not isinstance(rc, int):  # sys.exit("message"): printed, status 1
        err.write(f"{rc}\n")
        rc = 1
    return Ran(rc, out.getvalue(), err.getvalue())


def run_module(module: str, argv: Sequence[str], timeout: float = 60) -> Ran:
    """`python -m module argv` in a new interpreter."""
    p = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                       timeout=timeout)
    return Ran(p.returncode, p.stdout, p.stderr)
