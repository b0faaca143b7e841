"""`python -m loadtest <locustfile> [locust options]`: one headless locust run of a locustfile
shipped in this package (`acquire_burst`, `execd_storm`) or of a path (a
`.py` file, e.g. mounted from a ConfigMap), as the in-cluster Job runs it (loadtest/job.py,
docs/loadtest.md "In the cluster"). The exit code is locust's (the thresholds' verdict); after
the run, the summary's verdict is printed as one `SANDMAN-SUMMARY {json}` line, so `kubectl
logs` of the Job has it without a volume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCUSTFILES = ("acquire_burst", "execd_storm")
SUMMARY_KEYS = ("job", "shape", "duration_s", "stop_reason", "audit", "leaked", "stats",
                "thresholds", "exceptions", "exit_code", "cotenant")


def locustfile(name: str) -> Path:
    if name.endswith(".py"):
        return Path(name)
    if name not in LOCUSTFILES:
        raise SystemExit(f"loadtest: unknown locustfile {name!r}; one of "
                         f"{', '.join(LOCUSTFILES)} or a path ending in .py")
    return HERE / f"{name}.py"


def summary_path(args: list[str]) -> Path | None:
    """Where loadtest/run.py writes the summary: --sandman-json, else <--csv>_sandman.json."""
    opts: dict[str, str] = {}
    for i, a in enumerate(args):
        for flag in ("--sandman-json", "--csv"):
            if a == flag and i + 1 < len(args):
                opts[flag] = args[i + 1]
            elif a.startswith(flag + "="):
                opts[flag] = a.split("=", 1)[1]
    if opts.get("--sandman-json"):
        return Path(opts["--sandman-json"])
    return Path(opts["--csv"] + "_sandman.json") if opts.get("--csv") else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    path = locustfile(argv[0])
    if not path.is_file():
        raise SystemExit(f"loadtest: no locustfile at {path}")
    args = argv[1:]
    code = subprocess.call([sys.executable, "-m", "locust", "-f", str(path), "--headless",
                            *args])
    out = summary_path(args)
    if out is not None and out.is_file():
        doc = json.loads(out.read_text())
        print("SANDMAN-SUMMARY " + json.dumps({k: doc.get(k) for k in SUMMARY_KEYS}),
              flush=True)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
