"""The one in-memory `controller.kube.Kube`: it lags and fails on purpose, for pure-logic tests of
the books and the owner pipeline (tests/controller/test_pipeline.py) and of the image pre-pull
(test_prepull_ownership.py).

Not a stand-in for the API server's behaviour in general: the 25 ownership windows run against
the real one (test_windows.py). What it models is what the books must survive:
- lag: the informer's events and `list_pods` show the cluster as it was `lag` seconds ago
  (a stale cache); `read_pod` and the writes see the truth, as a quorum read does;
- a kubelet: a created pod turns Ready (Running, a pod IP) `start_s` seconds after its create
  (None: stays Pending until the test calls `start(name)`);
- a slow create: it is stored `create_s` seconds after the call (which runs on when its caller
  gives up waiting, as the real client's thread does);
- nodes: `nodes` is what `list_nodes` answers, whatever the selector;
- faults on any call, `fault(method, mode)`: "lost" (applied, then the answer is lost: a
  transport error), "500" (refused, not applied), "504-stored" (applied, then answered 504),
  "hold" (waits until `release_held()`, then applied).
Every call is recorded in `calls` as (method, name), every delete in `deletes` as (name, uid).
`put` and `remove` change the cluster behind the controller's back (another client's writes).
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import itertools
import uuid
from dataclasses import dataclass, field

from kubernetes import client

from controller.pods import slim_pod


@dataclass
class Fault:
    method: str
    mode: str
    count: int = 1


@dataclass
class FakeInformer:
    kube: FakeKube
    loop: asyncio.AbstractEventLoop
    on_event: object
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: bool = False

    def start(self) -> None:
        self.kube._informers.append(self)
        self.loop.call_soon(self.on_event, "SYNC", [slim_pod(p) for p in self.kube.view.values()])
        self.loop.call_soon(self.synced.set)

    def stop(self) -> None:
        self.stopped = True


class FakeKube:
    def __init__(self, lag: float = 0.0, start_s: float | None = 0.05, api_s: float = 0.001,
                 create_s: float = 0.0):
        self.lag = lag
        self.start_s = start_s
        self.api_s = api_s
        self.create_s = create_s
        self.nodes: list[dict] = []
        self.pods: dict[str, dict] = {}  # the truth
        self.view: dict[str, dict] = {}  # what the lagging list and watch have shown so far
        self.config_maps: dict[str, dict] = {}
        self.events: list[tuple[str, str, str]] = []  # (pod, reason, message)
        self.calls: list[tuple[str, str]] = []
        self.faults: list[Fault] = []
        self.created_names: list[str] = []  # every pod actually stored, in order
        self.created_uids: list[str] = []  # ...and its uid
        self.deletes: list[tuple[str, str | None]] = []
        self._informers: list[FakeInformer] = []
        self._rv = itertools.count(1)
        self._held = asyncio.Event()

    # ---- test controls ------------------------------------------------------------------------
    def fault(self, method: str, mode: str, count: int = 1) -> None:
        self.faults.append(Fault(method, mode, count))

    def release_held(self) -> None:
        self._held.set()

    def start(self, name: str) -> None:
        """The kubelet turns pod `name` Ready now: the pod moves when the test says."""
        self._kubelet(name, self.pods[name]["metadata"]["uid"])

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)

    def put(self, pod: dict) -> None:
        """`pod` (its uid given) is in the cluster, stored by someone else."""
        pod = copy.deepcopy(pod)
        self.pods[pod["metadata"]["name"]] = pod
        self._touch(pod, "ADDED")

    def remove(self, name: str) -> None:
        """The pod `name` is gone (someone else's delete finished)."""
        pod = self.pods.pop(name, None)
        if pod is not None:
            self._touch(pod, "DELETED")

    # ---- internals ----------------------------------------------------------------------------
    async def _enter(self, method: str, name: str) -> str | None:
        self.calls.append((method, name))
        await asyncio.sleep(self.api_s)
        for f in self.faults:
            if f.method == method and f.count > 0:
                f.count -= 1
                if f.mode == "hold":
                    await self._held.wait()
                    return None
                if f.mode == "500":
                    raise client.ApiException(status=500, reason="Internal Server Error")
                return f.mode  # applied first, then the answer is spoiled
        return None

    @staticmethod
    def _spoil(mode: str | None) -> None:
        if mode == "lost":
            raise ConnectionResetError("the answer was lost")
        if mode == "504-stored":
            raise client.ApiException(status=504, reason="Gateway Timeout")

    def _emit(self, kind: str, pod: dict) -> None:
        snap = copy.deepcopy(pod)
        loop = asyncio.get_running_loop()

        def deliver() -> None:
            name = snap["metadata"]["name"]
            if kind == "DELETED":
                self.view.pop(name, None)
            else:
                self.view[name] = snap
            for inf in self._informers:
                if not inf.stopped:
                    inf.on_event(kind, slim_pod(copy.deepcopy(snap)))

        loop.call_later(self.lag, deliver) if self.lag else loop.call_soon(deliver)

    def _touch(self, pod: dict, kind: str = "MODIFIED") -> dict:
        pod["metadata"]["resourceVersion"] = str(next(self._rv))
        self._emit(kind, pod)
        return copy.deepcopy(pod)

    def _kubelet(self, name: str, uid: str) -> None:
        pod = self.pods.get(name)
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        pod["status"] = {"phase": "Running", "podIP": f"127.64.0.{len(self.created_names) % 250}",
                         "conditions": [{"type": "Ready", "status": "True"}]}
        self._touch(pod)

    # ---- controller.kube.Kube -----------------------------------------------------------------
    async def create_pod(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        spoil = await self._enter("create", name)
        if self.create_s:
            await asyncio.sleep(self.create_s)
        if name in self.pods:
            raise client.ApiException(status=409, reason="AlreadyExists")
        pod = copy.deepcopy(body)
        pod["metadata"].update(
            uid=str(uuid.uuid4()),
            creationTimestamp=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod
        self.created_names.append(name)
        self.created_uids.append(pod["metadata"]["uid"])
        out = self._touch(pod, "ADDED")
        if self.start_s is not None:
            asyncio.get_running_loop().call_later(self.start_s, self._kubelet, name,
                                                  pod["metadata"]["uid"])
        self._spoil(spoil)
        return out

    async def read_pod(self, name: str) -> dict:
        await self._enter("read", name)
        if name not in self.pods:
            raise client.ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.pods[name])

    async def patch_pod(self, name: str, patch: dict) -> dict:
        spoil = await self._enter("patch", name)
        pod = self.pods.get(name)
        if pod is None:
            raise client.ApiException(status=404, reason="NotFound")
        meta = patch.get("metadata") or {}
        pod["metadata"].setdefault("labels", {}).update(meta.get("labels") or {})
        if "ownerReferences" in meta:
            pod["metadata"]["ownerReferences"] = meta["ownerReferences"]
        out = self._touch(pod)
        self._spoil(spoil)
        return out

    async def delete_pod(self, name: str, uid: str | None) -> dict:
        spoil = await self._enter("delete", name)
        self.deletes.append((name, uid))
        pod = self.pods.get(name)
        if pod is None:
            raise client.ApiException(status=404, reason="NotFound")
        if uid and pod["metadata"]["uid"] != uid:
            raise client.ApiException(status=409, reason="Conflict")
        del self.pods[name]
        self._touch(pod, "DELETED")
        self._spoil(spoil)
        return {"kind": "Status", "status": "Success"}

    async def list_pods(self, selector: str) -> list[dict]:
        await self._enter("list", "")
        k, eq, v = selector.partition("=")  # `key=value`, or `key`: the label is set
        return [copy.deepcopy(p) for p in self.view.values()
                if (p["metadata"].get("labels") or {}).get(k) == v
                or not eq and k in (p["metadata"].get("labels") or {})]

    async def list_pods_slim(self, selector: str) -> list[dict]:
        from controller.pods import slim_pod

        return [slim_pod(p) for p in await self.list_pods(selector)]

    async def list_nodes(self, selector: str) -> list[dict]:
        return copy.deepcopy(self.nodes)

    async def read_node(self, name: str) -> dict | None:
        return next((copy.deepcopy(n) for n in self.nodes
                     if (n.get("metadata") or {}).get("name") == name), None)

    async def pod_events(self, name: str, limit: int = 10) -> list[str]:
        return []

    async def pod_event(self, pod: dict, reason: str, message: str) -> None:
        self.events.append((pod["metadata"]["name"], reason, message))

    async def create_config_map(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        await self._enter("create_cm", name)
        if name in self.config_maps:
            raise client.ApiException(status=409, reason="AlreadyExists")
        cm = copy.deepcopy(body)
        cm["metadata"]["uid"] = str(uuid.uuid4())
        self.config_maps[name] = cm
        return copy.deepcopy(cm)

    async def read_config_map(self, name: str) -> dict:
        await self._enter("read_cm", name)
        if name not in self.config_maps:
            raise client.ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.config_maps[name])

    async def delete_config_map(self, name: str) -> dict:
        await self._enter("delete_cm", name)
        if self.config_maps.pop(name, None) is None:
            raise client.ApiException(status=404, reason="NotFound")
        return {"kind": "Status", "status": "Success"}

    async def patch_config_map(self, name: str, patch: dict) -> dict:
        await self._enter("patch_cm", name)
        if name not in self.config_maps:
            raise client.ApiException(status=404, reason="NotFound")
        cm = self.config_maps[name]
        data = cm.setdefault("data", {})
        for k, v in ((patch or {}).get("data") or {}).items():  # a merge patch: null deletes
            if v is None:
                data.pop(k, None)
            else:
                data[k] = v
        return copy.deepcopy(cm)

    def informer(self, loop, on_event) -> FakeInformer:
        return FakeInformer(self, loop, on_event)

    def event_watches(self, loop, on_event) -> list:
        return []  # the event signals are tested against the real API (test_capacity_signals)
