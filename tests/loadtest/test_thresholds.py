"""Thresholds become the exit code: a run against a deliberately broken or slow endpoint exits
non-zero, the same run against a healthy one exits 0. No cluster: a small fake controller on
127.0.0.1 answers the API."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testbed.stack import locust


class FakeController(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # 64 users connect within a second (the default backlog is 5)

    def __init__(self, mode: str, delay_s: float = 0.0):
        self.mode, self.delay_s, self.n = mode, delay_s, 0
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"rate": 20.0, "queue_depth": 0, "creating": 0, "live": 0})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        srv = self.server
        if srv.mode == "broken":
            self._send(500, {"error": {"type": "Internal", "message": "broken on purpose"}})
            return
        time.sleep(srv.delay_s)
        srv.n += 1
        self._send(201, {"id": f"sbx-{srv.n}", "pod": f"sbx-{srv.n}", "address": "127.0.0.1",
                         "port": 9, "token": "t", "warm": False,
                         "timings": {"queued_ms": 0, "create_ms": 1, "ready_ms": 1}})

    def do_DELETE(self):
        self._send(200, {"id": self.path.rsplit("/", 1)[-1], "released": True})


@pytest.fixture
def fake(request):
    mode, delay = request.param
    srv = FakeController(mode, delay)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run(tmp_path, url: str, *extra: str) -> tuple[int, str, dict]:
    log = tmp_path / "locust.log"
    code = locust("acquire_burst.py", ["--shape", "burst64", "--hold-s", "0", "--budget-s", "30",
                                       "--controller-url", url, "--max-leaked", "-1",
                                       "--csv", str(tmp_path / "run"), *extra], log, timeout=90)
    summary = json.loads((tmp_path / "run_sandman.json").read_text())
    return code, log.read_text(), summary


@pytest.mark.parametrize("fake", [("broken", 0.0)], indirect=True)
@pytest.mark.slow
def test_broken_endpoint_fails_the_run(fake, tmp_path):
    code, log, summary = run(tmp_path, fake.url)
    assert code == 1, log[-3000:]
    assert "threshold FAIL: error rate 1.0000 <= 0 (64 of 64)" in log
    assert summary["exit_code"] == 1
    assert summary["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 64


@pytest.mark.parametrize("fake", [("slow", 0.3)], indirect=True)
@pytest.mark.slow
def test_slow_endpoint_fails_the_p99_threshold_without_any_error(fake, tmp_path):
    code, log, summary = run(tmp_path, fake.url, "--max-p99-ms", "100")
    assert code == 1, log[-3000:]
    assert "threshold ok  : error rate 0.0000" in log
    assert "threshold FAIL: ACQUIRE /v1/sandboxes p99" in log


@pytest.mark.parametrize("fake", [("ok", 0.0)], indirect=True)
@pytest.mark.slow
def test_healthy_endpoint_passes_the_same_thresholds(fake, tmp_path):
    code, log, summary = run(tmp_path, fake.url, "--max-p99-ms", "2000")
    assert code == 0, log[-3000:]
    assert summary["stats"]["ACQUIRE /v1/sandboxes"]["requests"] == 64
    assert summary["stats"]["RELEASE /v1/sandboxes/{id}"]["requests"] == 64
    assert [s["label"] for s in summary["stages"]] == ["burst64"]
    assert not summary["stages"][0]["timed_out"]


@pytest.mark.parametrize("fake", [("ok", 0.0)], indirect=True)
@pytest.mark.slow
def test_run_users_scales_the_two_runs_shape(fake, tmp_path):
    code, log, summary = run(tmp_path, fake.url, "--shape", "two-runs", "--run-users", "3")
    assert code == 0, log[-3000:]
    assert summary["stats"]["ACQUIRE /v1/sandboxes"]["requests"] == 6
    assert [s["label"] for s in summary["stages"]] == ["two-runs"]


def test_run_users_below_one_is_refused_in_one_line(tmp_path):
    log = tmp_path / "locust.log"
    code = locust("acquire_burst.py", ["--run-users", "0", "--controller-url",
                                       "http://127.0.0.1:9"], log, timeout=60)
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "argument --run-users: must be >= 1, not 0" in text, text[-3000:]
    assert "Traceback" not in text


@pytest.mark.slow
def test_nothing_listening_fails_the_run(tmp_path):
    from testbed.procs import refused_port

    with refused_port() as dead:  # held: nothing listens there meanwhile
        code, log, _ = run(tmp_path, f"http://127.0.0.1:{dead}")
    assert code == 1, log[-3000:]
    assert "threshold FAIL: error rate" in log


RAISING = Path(__file__).parent / "files" / "raising.py"


@pytest.mark.parametrize("fake", [("ok", 0.0)], indirect=True)
@pytest.mark.slow
def test_a_task_that_raises_fails_the_run(fake, tmp_path):
    """Every request succeeds; the task raises after its cycle. locust's own exit code would say
    1, but the threshold hook used to overwrite it with 0."""
    log = tmp_path / "locust.log"
    code = locust(str(RAISING), ["--shape", "burst64", "--hold-s", "0", "--budget-s", "30",
                                 "--controller-url", fake.url, "--max-leaked", "-1",
                                 "--csv", str(tmp_path / "run")], log, timeout=90)
    text = log.read_text()
    summary = json.loads((tmp_path / "run_sandman.json").read_text())
    assert code == 1, text[-3000:]
    assert "threshold ok  : error rate 0.0000" in text
    assert "threshold FAIL: task exceptions" in text and "task raised on purpose" in text
    assert summary["exit_code"] == 1
    assert "task raised on purpose" in summary["exceptions"][0]["msg"]
    assert summary["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 0
