"""The command-line client's own logic (sandman/client/cli.py): the lease directory that holds
execd tokens at rest, ids that are names and never paths, the `ID:/path` split, one-line
errors and an exit code per error type. Against the controller: tests/controller/
test_cli_on_testbed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandman.client import cli
from sandman.client import errors as E
from sandman.client.models import Lease

LEASE = {"id": "0123456789abcdef", "pod": "sbx-job-1", "address": "127.0.0.1", "port": 9470,
         "token": "t" * 43, "warm": False}


@pytest.fixture
def leases(tmp_path, monkeypatch):
    d = tmp_path / "leases"
    monkeypatch.setenv(cli.ENV_LEASE_DIR, str(d))
    return d


def test_a_saved_lease_is_private_and_comes_back(leases):
    path = cli.save_lease(Lease.from_json(LEASE))
    assert (os.stat(leases).st_mode & 0o777, os.stat(path).st_mode & 0o777) == (0o700, 0o600)
    got = cli.load_lease(LEASE["id"])
    assert (got.id, got.token, got.port) == (LEASE["id"], LEASE["token"], 9470)
    with pytest.raises(FileExistsError):  # never overwritten, never through a planted file
        cli.save_lease(Lease.from_json(LEASE))
    cli.drop_lease(LEASE["id"])
    with pytest.raises(cli.CliError) as e:
        cli.load_lease(LEASE["id"])
    assert e.value.code == cli.EXIT_NO_LEASE


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", ".hidden", "a/b", "", "x" * 200,
                                 "id\n", "id.json"])
def test_an_id_is_a_name_never_a_path(leases, bad):
    with pytest.raises(cli.CliError, match="is not a sandbox id") as e:
        cli.load_lease(bad) if leases.exists() else cli._lease_path(leases, bad)
    assert e.value.code == cli.EXIT_USAGE


def test_a_lease_directory_others_can_reach_is_refused(leases):
    leases.mkdir(mode=0o700)
    os.chmod(leases, 0o777)  # another local user could plant a lease or read a token
    with pytest.raises(cli.CliError, match="mode 0700"):
        cli.load_lease(LEASE["id"])
    os.chmod(leases, 0o700)
    planted = leases / f"{LEASE['id']}.json"
    planted.write_text(json.dumps(LEASE))
    os.chmod(planted, 0o644)
    with pytest.raises(cli.CliError, match="mode 0600"):
        cli.load_lease(LEASE["id"])
    planted.unlink()
    os.symlink("/etc/passwd", planted)  # a link in place of a lease is not followed
    with pytest.raises(cli.CliError, match="lease"):
        cli.load_lease(LEASE["id"])


def test_a_lease_file_that_is_not_an_answer_is_refused(leases):
    leases.mkdir(mode=0o700)
    p = leases / f"{LEASE['id']}.json"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b'{"id": 5}')
    os.close(fd)
    with pytest.raises(cli.CliError, match="not an acquire's answer"):
        cli.load_lease(LEASE["id"])


def test_remote_paths():
    assert cli._remote("abc:/tmp/x") == ("abc", "/tmp/x")
    assert cli._remote("./a:b") is None and cli._remote("/tmp/x") is None
    assert cli._remote("local.txt") is None
    with pytest.raises(cli.CliError, match="absolute"):
        cli._remote("abc:tmp/x")


def test_each_error_type_has_its_exit_code():
    assert cli.exit_code(E.ConfigurationError("x")) == cli.EXIT_CONFIG
    assert cli.exit_code(E.SandboxGone("x")) == cli.EXIT_NOT_FOUND
    assert cli.exit_code(E.ControllerUnreachable("x")) == cli.EXIT_UNREACHABLE
    assert cli.exit_code(E.AcquireTimeout("x")) == cli.EXIT_TIMEOUT == 124
    assert cli.exit_code(E.QueueFull("x")) == cli.EXIT_QUEUE_FULL
    assert cli.exit_code(E.UnsafeArchive("x")) == cli.EXIT_TREE
    assert cli.exit_code(E.SandmanError("x")) == cli.EXIT_OTHER
    # The CLI's own codes stay clear of the ones commands use for ordinary failures.
    assert min(cli.EXIT_TABLE) > 100 and len(set(cli.EXIT_TABLE)) == len(cli.EXIT_TABLE)
    # Subclasses come before their bases, or a specific code could never be reached.
    for i, (a, _) in enumerate(cli.EXIT_CODES):
        for b, _ in cli.EXIT_CODES[:i]:
            assert not issubclass(a, b), (a, b)


@pytest.mark.slow
def test_errors_are_one_line_with_their_code(leases, monkeypatch):
    # A controller that is not there: unreachable, one line, its code.
    env = {**os.environ, "SANDMAN_URL": "https://127.0.0.1:1", cli.ENV_LEASE_DIR: str(leases)}
    env.pop("SANDMAN_TOKEN_FILE", None)
    r = subprocess.run([sys.executable, "-m", "sandman.client", "--request-timeout", "2",
                        "get", "abc"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == cli.EXIT_UNREACHABLE, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("sandman: error: ")
    r = subprocess.run([sys.executable, "-m", "sandman.client", "exec", "nolease", "--", "true"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == cli.EXIT_NO_LEASE and "no lease for nolease" in r.stderr
    r = subprocess.run([sys.executable, "-m", "sandman.client", "--url", "ftp://x", "list"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == cli.EXIT_CONFIG and r.stderr.count("\n") == 1
