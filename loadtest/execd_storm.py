"""Agent turns against execd: many users, each bound to one sandbox for the whole run.

Each user acquires one sandbox through the controller (ACQUIRE), then plays turns: small shell
commands (EXEC), file writes (FILE_WRITE) and reads of what it wrote (FILE_READ, the bytes are
compared), and releases the sandbox when stopped (RELEASE); all through the SDK
(`sandman.client`), whose `on_request` hook reports each call to locust (loadtest/users.py).

kwok nodes run no container: start `python -m testbed.standin` next to the controller (real
execd processes on each pod's loopback IP) and run the controller with `--ready-check execd`.

    locust -f loadtest/execd_storm.py --headless -u 20 -r 20 -t 60s \
        --controller-url http://127.0.0.1:8080 --kubeconfig KC --namespace sandboxes \
        --max-p99-ms 500 --max-leaked 0
"""

from __future__ import annotations

import secrets

import gevent
from locust import User, between, events, task

from loadtest import common, users
from loadtest.run import EXEC, FILE_READ, FILE_WRITE, RUN, RequestFailed, fire
from sandman import execd_api

common.install([EXEC, FILE_WRITE, FILE_READ])


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("execd_storm")
    g.add_argument("--file-bytes", type=int, default=4096, help="size of each file written")


class AgentUser(User):
    wait_time = between(0.05, 0.3)  # an agent's think time between tool calls, scaled down

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.sandboxes = users.Sandboxes(self.environment, o.controller_url)
        self.n = 0
        self.sb = self.sandboxes.acquire(common.job_of(self.environment))
        if self.sb is not None:
            self.dir = f"/tmp/sandman-lt-{self.sb.pod}"
            self.sandboxes.exec(self.sb, f"mkdir -p {self.dir} && cd {self.dir}", label="setup")
        RUN.extra.update({"locustfile": "execd_storm"})

    @task(5)
    def command(self) -> None:
        if self.sb is None:
            self._no_sandbox()
            return
        self.n += 1
        code = self.sandboxes.exec(self.sb, f"echo turn {self.n} && ls -la . | wc -l")
        if code is not None and code != 0:
            fire(self.environment, EXEC, f"{execd_api.EXEC.path} (exit code)", 0,
                 RequestFailed(f"exit {code}"), ms=0)

    @task(2)
    def write_read(self) -> None:
        if self.sb is None:
            self._no_sandbox()
            return
        data = secrets.token_bytes(self.environment.parsed_options.file_bytes)
        path = f"{self.dir}/f{self.n % 8}.bin"
        if self.sandboxes.write(self.sb, path, data):
            got = self.sandboxes.read(self.sb, path)
            if got is not None and got != data:
                fire(self.environment, FILE_READ, f"{execd_api.FILE_READ.path} (content)", 0,
                     RequestFailed("read back different bytes"), ms=0)

    def _no_sandbox(self) -> None:
        gevent.sleep(1.0)

    def on_stop(self) -> None:
        sb, self.sb = self.sb, None
        if sb is None:
            return

        def cleanup() -> None:
            users.idle(sb)  # still busy after it: the refusal is reported as one
            self.sandboxes.exec(sb, f"rm -rf {self.dir}", label="cleanup")
            users.release(sb)

        users.later(cleanup)
