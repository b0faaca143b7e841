"""Run pytest for `make test`; a run that collects no test is a failure, said in one line."""

import sys

import pytest

rc = pytest.main(sys.argv[1:])
if rc == pytest.ExitCode.NO_TESTS_COLLECTED:
    print("make test: pytest collected no tests (exit 5); refusing to call that a pass",
          file=sys.stderr)
    sys.exit(1)
sys.exit(int(rc))
