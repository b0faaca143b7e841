"""The real-node bench's program in the trainer pod (bench/realnode.py runs it there with
`kubectl exec -i ... python3 -u -c <this file's source>`: the image ships no bench/).

It reads one JSON request a line on stdin and answers each with one line `BENCH {json}` on
stdout, so one process serves the whole run and its connection pools stay warm. It imports
only the standard library and the SDK; `Client()` finds the controller, the projected token
and the CA from $SANDMAN_URL, $SANDMAN_TOKEN_FILE and $SANDMAN_CA_FILE (testbed/trainer.py).

Requests: {"op": "wave", "n", "image", "job", "cpu", "memory", "timeout_s"} acquires n
sandboxes at once (cold: warm_ok=False) and sends each a first `echo`; {"op": "release"}
releases what the waves hold; {"op": "echo", "address", "port", "token", "n", "warmup"} times
n echo round trips to one sandbox on a kept connection; {"op": "quit"}.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PREFIX = "BENCH "
TIMINGS = ("queued_ms", "create_ms", "started_ms", "ready_ms")


def say(obj) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Agent:
    def __init__(self, client) -> None:
        self.client = client
        self.held: list = []
        self.conns: dict = {}

    def one(self, req: dict) -> dict:
        t0 = time.time()
        try:
            sb = self.client.acquire(image=req["image"], job=req["job"], cpu=req["cpu"],
                                     memory=req["memory"], timeout_s=req["timeout_s"],
                                     warm_ok=False)
        except Exception as e:  # noqa: BLE001 - reported as this sandbox's failure
            return {"error": f"acquire: {type(e).__name__}: {e}"[:300], "t0": t0}
        t1 = time.time()
        self.held.append(sb)
        out = {"pod": sb.pod, "warm": sb.warm, "t0": t0, "t1": t1,
               "timings": {k: getattr(sb.timings, k) for k in TIMINGS
                           if hasattr(sb.timings, k)}}
        try:
            r = sb.exec("echo hi", timeout=30)
            out["t2"] = time.time()
            if r.exit_code != 0 or r.output != "hi\n":
                out["error"] = f"first command answered {r.exit_code!r} {r.output[:100]!r}"
        except Exception as e:  # noqa: BLE001
            out["error"] = f"first command: {type(e).__name__}: {e}"[:300]
        return out

    def echo(self, req: dict) -> dict:
        from sandman.client import Sandbox

        key = (req["address"], req["port"])
        sb = self.conns.get(key)
        if sb is None:
            sb = self.conns[key] = Sandbox.connect(req["address"], req["port"], req["token"])
            for _ in range(req["warmup"]):
                sb.exec("echo hi", timeout=30)
        rtts = []
        for _ in range(req["n"]):
            t = time.perf_counter()
            r = sb.exec("echo hi", timeout=30)
            rtts.append(time.perf_counter() - t)
            if r.output != "hi\n":
                return {"error": f"echo answered {r.output[:100]!r}"}
        return {"rtt_s": rtts}

    def handle(self, req: dict) -> tuple[dict, bool]:
        """The answer to one request, and whether to go on."""
        op = req.get("op")
        if op == "wave":
            with ThreadPoolExecutor(req["n"]) as ex:
                return {"results": list(ex.map(self.one, [req] * req["n"]))}, True
        if op == "release":
            n = len(self.held)
            with ThreadPoolExecutor(max(1, n)) as ex:
                list(ex.map(lambda sb: sb.release(), self.held))
            del self.held[:]
            return {"released": n}, True
        if op == "echo":
            return self.echo(req), True
        if op == "quit":
            return {"bye": True}, False
        return {"error": f"unknown op {op!r}"}, True

    def serve(self, lines) -> None:
        for line in lines:
            req = json.loads(line)
            try:
                answer, go_on = self.handle(req)
            except Exception as e:  # noqa: BLE001 - one failed request, the agent goes on
                answer, go_on = {"error": f"{req.get('op')}: {type(e).__name__}: {e}"[:500]}, True
            say(answer)
            if not go_on:
                break

    def close(self) -> None:
        for sb in self.conns.values():
            sb.close()
        self.client.close()  # releases whatever is still held


def main() -> None:
    from sandman.client import Client

    agent = Agent(Client(timeout_s=60))
    try:
        agent.serve(sys.stdin)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
