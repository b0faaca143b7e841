"""What execd imports before it serves. Every sandbox start pays its CPU from exec to the
listening line under the pod's CPU quota (100m: 10 ms of CPU is 0.1 s of wall time), so
modules that only some request needs are imported by that request, not at start
(bench/execd.py measures the start's CPU; this keeps the set from growing back unseen).

The real daemon in a subprocess with PYTHONPROFILEIMPORTTIME: the interpreter reports each
import on stderr as it completes, so every report before the listening line is the start's."""

from __future__ import annotations

import re

# Each one is only needed by some requests (json: the first reply; tempfile: file writes;
# glob: the reuse baseline; tarfile: the tree routes) or by nothing execd does (hashlib: execd
# uses the builtin SHA-256; encodings.idna: http.server's reverse lookup of the listen
# address, not done; subprocess: execd starts processes with os.posix_spawn).
NOT_AT_START = ("json", "tempfile", "glob", "hashlib", "encodings.idna", "subprocess",
                "tarfile")


def start_imports(log: str) -> set[str]:
    head, sep, _ = log.partition(" listening on ")
    assert sep, log
    return set(re.findall(r"^import time:[^|]*\|[^|]*\| *(\S+)$", head, re.M))


def test_modules_only_a_request_needs_are_not_imported_before_execd_listens(execd_factory):
    d = execd_factory(env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = start_imports(d.log.read_text())
    assert {"http.server", "argparse"} <= imported  # the reports were read
    assert imported.isdisjoint(NOT_AT_START), sorted(imported & set(NOT_AT_START))
    # ...and a request that needs one imports it then: /health answers JSON.
    r = d.get("/health")
    assert r.status_code == 200 and r.json()["ok"] is True, r.text
