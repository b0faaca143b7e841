"""Snapshots: the holder's changes to the root filesystem (against a stat-only base recorded at
start), with the shell's cwd and exported environment, as one tar; and their application in a
fresh pod of the same image (docs/execd.md, "Snapshots")."""

from .wire import HTTPError

EXECD_SNAPSHOT_ENV = "SANDMAN_SNAPSHOT"  # copy of sandman/contract.py: "on" in agent pods
SNAPSHOT_MAX_BYTES = 1 << 30  # content bytes of one snapshot; --max-snapshot-bytes
SNAPSHOT_MAX_ENTRIES = 200000  # members of one snapshot, either way


def _r_snapshot(handler, query):
    raise HTTPError(409, "this sandbox records no snapshot base (%s); it cannot be forked"
                    % EXECD_SNAPSHOT_ENV)


def _r_snapshot_apply(handler, query):
    raise HTTPError(409, "this sandbox records no snapshot base (%s); it cannot be forked"
                    % EXECD_SNAPSHOT_ENV)
