"""Agent turns against execd: many users, each bound to one sandbox for the whole run.

Each user acquires one sandbox through the controller (ACQUIRE), then plays turns: small shell
commands (EXEC), file writes (FILE_WRITE) and reads of what it wrote (FILE_READ, the bytes are
compared), and releases the sandbox when stopped (RELEASE).

kwok nodes run no container: start `python -m loadtest.kubelet` next to the controller (real
execd processes on each pod's loopback IP) and run the controller with `--ready-check execd`.

    locust -f loadtest/execd_storm.py --headless -u 20 -r 20 -t 60s \
        --controller-url http://127.0.0.1:8080 --kubeconfig KC --namespace sandboxes \
        --max-p99-ms 500 --max-leaked 0
"""

from __future__ import annotations

import secrets

import gevent
from locust import User, between, events, task

from loadtest import common
from loadtest.common import RUN, RequestFailed

common.install([common.EXEC, common.FILE_WRITE, common.FILE_READ])


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("execd_storm")
    g.add_argument("--file-bytes", type=int, default=4096, help="size of each file written")


class AgentUser(User):
    wait_time = between(0.05, 0.3)  # an agent's think time between tool calls, scaled down

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.ctl = common.ControllerClient(self.environment, o.controller_url)
        self.sid = None
        self.ex = None
        self.n = 0
        lease = self.ctl.acquire(common.acquire_body(self.environment,
                                                     common.job_of(self.environment)),
                                 o.acquire_timeout_s)
        if lease:
            self.sid = lease["id"]
            self.ex = common.ExecdClient(self.environment, lease["address"], lease["port"],
                                         lease["token"])
            self.dir = f"/tmp/sandman-lt-{lease['pod']}"
            self.ex.exec(f"mkdir -p {self.dir} && cd {self.dir}", name="/exec (setup)")
        RUN.extra.update({"locustfile": "execd_storm"})

    @task(5)
    def command(self) -> None:
        if self.ex is None:
            self._no_sandbox()
            return
        self.n += 1
        out = self.ex.exec(f"echo turn {self.n} && ls -la . | wc -l")
        if out is not None and out.get("exit_code") != 0:
            common.fire(self.environment, common.EXEC, "/exec (exit code)", 0,
                        RequestFailed(f"exit {out.get('exit_code')}"), ms=0)

    @task(2)
    def write_read(self) -> None:
        if self.ex is None:
            self._no_sandbox()
            return
        data = secrets.token_bytes(self.environment.parsed_options.file_bytes)
        path = f"{self.dir}/f{self.n % 8}.bin"
        if self.ex.write(path, data):
            got = self.ex.read(path)
            if got is not None and got != data:
                common.fire(self.environment, common.FILE_READ, "/files (content)", 0,
                            RequestFailed("read back different bytes"), ms=0)

    def _no_sandbox(self) -> None:
        gevent.sleep(1.0)

    def on_stop(self) -> None:
        # In its own greenlet: stopping the run cannot interrupt the clean-up half way.
        sid, ex, self.sid = self.sid, self.ex, None

        def cleanup() -> None:
            if ex is not None:
                ex.exec(f"rm -rf {self.dir}", name="/exec (cleanup)")
            if sid:
                self.ctl.release(sid)

        common._PENDING.append(gevent.spawn(cleanup))
