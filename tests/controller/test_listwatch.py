"""The controller's one list + watch loop (controller/kube.py `ListWatch`), which the pod informer
and the capacity signals' event watches both are, against a scripted API server: what it
delivers, where it resumes, when it relists, how it backs off, and that it stops. On the real
API server it runs in every test-bed test (the books' informer) and test_capacity_signals.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from kubernetes import client

from controller.kube import ListWatch


class Stream:
    """A watch answer: JSON lines, then the end (or, with `hold`, nothing until closed)."""

    def __init__(self, events: list[dict], hold: threading.Event | None = None):
        self.lines = [json.dumps(e).encode() + b"\n" for e in events]
        self.hold = hold
        self.released = False

    def stream(self, amt=None, decode_content=False):
        yield from self.lines
        if self.hold is not None:
            self.hold.wait(10)

    def release_conn(self) -> None:
        self.released = True


class Listed:
    def __init__(self, rv: str, items: list[dict]):
        self.data = json.dumps({"metadata": {"resourceVersion": rv}, "items": items}).encode()


def pod(name: str, rv: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv}}


class Server:
    """Answers the calls in `script` order (an exception is raised), then holds the last watch
    open until stopped; records each call's resourceVersion (None: a list)."""

    def __init__(self, script: list):
        self.script = list(script)
        self.calls: list[str | None] = []
        self.stopped = threading.Event()
        self.streams: list[Stream] = []

    def __call__(self, **kw):
        self.calls.append(kw.get("resource_version") if kw.get("watch") else None)
        answer = self.script.pop(0) if self.script else Stream([], hold=self.stopped)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Stream):
            self.streams.append(answer)
        return answer


def run(script: list, until, **kw) -> tuple[list[tuple], Server, ListWatch]:
    """Start a ListWatch on `script`; return what it delivered once `until(delivered)`."""
    server = Server(script)
    got: list[tuple] = []

    async def main() -> ListWatch:
        loop = asyncio.get_running_loop()
        w = ListWatch("test-watch", server, lambda o: o["metadata"]["name"], loop,
                      lambda *a: got.append(a), **kw)
        w.start()
        deadline = time.monotonic() + 10
        while not until(got) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        w.stop()
        server.stopped.set()
        w._thread.join(5)
        assert not w._thread.is_alive()
        return w

    return got, server, asyncio.run(main())


def test_a_list_then_the_changes_resumed_from_the_last_resource_version():
    script = [Listed("10", [pod("a", "9")]),
              Stream([{"type": "ADDED", "object": pod("b", "11")},
                      {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
                      {"type": "MODIFIED", "object": pod("a", "13")}]),  # then the watch ends
              Stream([{"type": "DELETED", "object": pod("b", "14")}])]
    got, server, w = run(script, lambda g: len(g) >= 4)
    assert got == [("SYNC", ["a"]), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert server.calls[:3] == [None, "10", "13"]  # the bookmark's version, then a later one
    assert w.synced.is_set() and w.tried.is_set()
    assert all(s.released for s in server.streams)


def test_a_version_too_old_relists_whether_it_comes_as_an_event_or_an_answer():
    script = [Listed("10", [pod("a", "9")]),
              Stream([{"type": "ERROR", "object": {"code": 410}}]),
              Listed("20", [pod("b", "19")]),
              client.ApiException(status=410),
              Listed("30", [])]
    got, server, _ = run(script, lambda g: len(g) >= 3, prime=True)
    assert got == [("SYNC", ["a"], True), ("SYNC", ["b"], False), ("SYNC", [], False)]
    assert server.calls[:5] == [None, "10", None, "20", None]


def test_a_refusal_is_retried_after_its_own_wait_and_does_not_hold_up_tried():
    script = [client.ApiException(status=403, reason="Forbidden"), Listed("5", [])]
    t0 = time.monotonic()
    got, server, w = run(script, lambda g: len(g) >= 1, retry_s=5.0, forbidden_retry_s=0.2)
    assert got == [("SYNC", [])]
    assert 0.2 <= time.monotonic() - t0 < 5.0  # the 403's wait, not the other failures'
    assert w.tried.is_set() and w.synced.is_set()


def test_a_list_that_never_succeeds_sets_tried_but_never_synced():
    server = Server([client.ApiException(status=500, reason="boom")] * 1000)
    seen: list[tuple] = []

    async def main() -> ListWatch:
        w = ListWatch("test-watch", server, lambda o: o, asyncio.get_running_loop(),
                      lambda *a: seen.append(a), retry_s=0.01)
        w.start()
        await asyncio.wait_for(w.tried.wait(), 5)
        while len(server.calls) < 3:
            await asyncio.sleep(0.01)
        w.stop()
        w._thread.join(5)
        return w

    w = asyncio.run(main())
    assert seen == [] and w.tried.is_set() and not w.synced.is_set()
    assert server.calls[:3] == [None, None, None]  # each retry is a list again
