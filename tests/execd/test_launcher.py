"""The pod's launcher (execd/execd.py, written to /sandman/execd.py when execd is installed) listens before it imports the daemon: a probe that connects while the imports
run waits in the backlog and is answered, where it used to be refused and retried a probe period
later. Real sockets on 127.0.0.1, the real daemon in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from execd import install
from execd.execd_daemon import main as E
from testbed.procs import reserve_port

from .conftest import run_pids

DELAY_S = 1.5


def _launcher_port() -> int:
    """The launcher binds --listen itself and the test must connect before execd reports
    anything: a port given to nothing else on the machine (testbed/procs.py)."""
    return reserve_port()


def _pod_layout(tmp_path: Path, delay: float) -> Path:
    """/sandman as the install leaves it, with the daemon's import made `delay` s slow."""
    d = tmp_path / "sandman"
    d.mkdir()
    install.install(str(d))
    main = d / install.DAEMON / "main.py"
    slow = f"import time\ntime.sleep({delay})\n" + main.read_text()
    main.chmod(0o644)
    main.write_text(slow)
    for pyc in (d / install.DAEMON).glob("__pycache__/main.*"):
        pyc.chmod(0o644)
        pyc.unlink()
    return d / "execd.py"


def test_a_connection_made_during_the_daemons_imports_is_answered_not_refused(tmp_path):
    launcher = _pod_layout(tmp_path, DELAY_S)
    port = _launcher_port()
    log = tmp_path / "execd.log"
    run_id = os.urandom(6).hex()
    env = {**os.environ, "EXECD_TEST_RUN": run_id, "SANDMAN_EXECD_INSTANCE": run_id,
           "SANDMAN_NETGUARD_STATUS": str(tmp_path / "netguard.json")}
    env.pop("SANDMAN_TOKEN_SHA256", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(launcher), "--listen", f"127.0.0.1:{port}",
                                 "--insecure-no-token"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=tmp_path, start_new_session=True)
    try:
        t0 = time.monotonic()
        conn = None
        while conn is None and time.monotonic() - t0 < DELAY_S:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
            except ConnectionRefusedError:
                time.sleep(0.01)
        assert conn is not None, "nothing listened while the daemon was still importing"
        connected = time.monotonic() - t0
        assert b"listening on" not in log.read_bytes()  # the daemon itself was not up yet
        with conn:
            conn.settimeout(20)
            conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200"), answer
        assert connected < DELAY_S
        # The daemon serves on the launcher's socket: the same port, one listener.
        assert f"listening on 127.0.0.1:{port}".encode() in log.read_bytes()
    finally:
        proc.terminate()
        proc.wait(10)
        for pid in run_pids(run_id):
            os.kill(pid, 9)


def test_a_handed_socket_that_is_not_the_listen_address_is_closed_and_not_used():
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(1)
    port = other.getsockname()[1]
    assert E.adopt_listener(other, "127.0.0.1", port) is other
    assert E.adopt_listener(other, "127.0.0.1", 0) is other  # --listen host:0: any port
    assert E.adopt_listener(other, "127.0.0.1", port + 1) is None and other.fileno() == -1
    bound_only = socket.socket()
    bound_only.bind(("127.0.0.1", 0))
    assert E.adopt_listener(bound_only, "127.0.0.1", 0) is None and bound_only.fileno() == -1
    udp = socket.socket(type=socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    assert E.adopt_listener(udp, "127.0.0.1", 0) is None
    v6 = socket.socket()
    v6.bind(("127.0.0.1", 0))
    v6.listen(1)
    assert E.adopt_listener(v6, "::1", 0) is None  # wrong family
    assert E.adopt_listener(None, "127.0.0.1", 1) is None


def test_the_task_images_python_setup_cannot_reach_into_execd(tmp_path):
    """A task image's PYTHONPATH (SWE-bench images set it to the repository), its
    sitecustomize and its .pth files run in every python3 of the image. execd runs with
    podspec's interpreter flags (-I -S): a PYTHONPATH holding a package named like one execd
    imports, and a sitecustomize that ends the process, change nothing. Without the flags the
    same environment takes execd down (the attack is real)."""
    from sandman.podspec import EXECD_PYTHON_FLAGS

    launcher = _pod_layout(tmp_path, 0)
    evil = tmp_path / "repo"
    (evil / "http").mkdir(parents=True)
    (evil / "http" / "__init__.py").write_text("raise SystemExit(13)\n")
    (evil / "sitecustomize.py").write_text("import os\nos._exit(14)\n")

    def start(flags):
        port = _launcher_port()
        run_id = os.urandom(6).hex()
        env = {**os.environ, "PYTHONPATH": str(evil), "EXECD_TEST_RUN": run_id,
               "SANDMAN_EXECD_INSTANCE": run_id,
               "SANDMAN_NETGUARD_STATUS": str(tmp_path / "netguard.json")}
        env.pop("SANDMAN_TOKEN_SHA256", None)
        proc = subprocess.Popen([sys.executable, *flags, str(launcher), "--listen",
                                 f"127.0.0.1:{port}", "--insecure-no-token"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                cwd=tmp_path, start_new_session=True)
        return proc, port, run_id

    def health(proc, port) -> bytes | None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                    conn.settimeout(10)
                    conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    answer = b""
                    while chunk := conn.recv(65536):
                        answer += chunk
                    if answer:
                        return answer
            except OSError:
                time.sleep(0.05)
        return None

    for flags, serves in ((EXECD_PYTHON_FLAGS, True), ((), False)):
        proc, port, run_id = start(flags)
        try:
            answer = health(proc, port)
            if serves:
                assert answer is not None and answer.split(b" ")[1] == b"200", answer
            else:
                assert answer is None and proc.wait(10) in (13, 14), answer
        finally:
            proc.terminate()
            proc.wait(10)
            for pid in run_pids(run_id):
                os.kill(pid, 9)
