"""The Kubernetes of `python -m bench.replay`: an in-memory `controller.kube.Kube` in virtual
time, whose pods turn Ready after a create-to-Ready delay drawn from a stated distribution.

Create-to-Ready: lognormal with median READY_MEDIAN_S and shape READY_SIGMA (p99 about 40 s),
clipped to [READY_MIN_S, READY_MAX_S]. The paper's rollout pods on Verified images reached
Ready in 5.13-5.97 s at the median, p99 24.4-60.5 s. Each draw comes from its own generator
seeded by (seed, image, how many pods of that image were created before), so a pod of one image
gets the same delay whatever else the run creates (the burst probe compares two runs).

Every API call takes API_S of virtual time (the informer's events follow at once). Only what
the controller's books and pipeline call is implemented; nothing is ever refused.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
import random

from kubernetes import client

from controller.pods import slim_pod, spec_of

READY_MEDIAN_S = 5.5
READY_SIGMA = 0.85
READY_MIN_S = 1.0
READY_MAX_S = 300.0
API_S = 0.02


def ready_delay(seed: int, image: str, n: int) -> float:
    rng = random.Random(f"{seed}:{image}:{n}")
    d = READY_MEDIAN_S * math.exp(rng.gauss(0.0, READY_SIGMA))
    return min(READY_MAX_S, max(READY_MIN_S, d))


class _Informer:
    def __init__(self, kube: ReplayKube, loop, on_event):
        self.kube, self.loop, self.on_event = kube, loop, on_event
        self.synced = asyncio.Event()
        self.stopped = False

    def start(self) -> None:
        self.kube._informers.append(self)
        self.loop.call_soon(self.on_event, "SYNC", [])
        self.loop.call_soon(self.synced.set)

    def stop(self) -> None:
        self.stopped = True


class ReplayKube:
    def __init__(self, seed: int):
        self.seed = seed
        self.pods: dict[str, dict] = {}
        self.config_maps: dict[str, dict] = {}
        self.creates = 0
        self._per_image: dict[str, int] = {}
        self._informers: list[_Informer] = []
        self._ids = itertools.count(1)

    def _emit(self, kind: str, pod: dict) -> None:
        pod["metadata"]["resourceVersion"] = str(next(self._ids))
        for inf in self._informers:
            if not inf.stopped:
                inf.on_event(kind, slim_pod(copy.deepcopy(pod)))

    def _kubelet(self, name: str, uid: str) -> None:
        pod = self.pods.get(name)
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        pod["status"] = {"phase": "Running", "podIP": "127.0.0.1",
                         "conditions": [{"type": "Ready", "status": "True"}]}
        self._emit("MODIFIED", pod)

    async def create_pod(self, body: dict) -> dict:
        await asyncio.sleep(API_S)
        name = body["metadata"]["name"]
        if name in self.pods:
            raise client.ApiException(status=409, reason="AlreadyExists")
        pod = copy.deepcopy(body)
        pod["metadata"].update(uid=f"uid-{next(self._ids)}",
                               creationTimestamp="2026-01-01T00:00:00Z")
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod
        self.creates += 1
        image = spec_of(pod).image
        n = self._per_image.get(image, 0)
        self._per_image[image] = n + 1
        self._emit("ADDED", pod)
        asyncio.get_running_loop().call_later(ready_delay(self.seed, image, n), self._kubelet,
                                              name, pod["metadata"]["uid"])
        return copy.deepcopy(pod)

    async def read_pod(self, name: str) -> dict:
        await asyncio.sleep(API_S)
        if name not in self.pods:
            raise client.ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.pods[name])

    async def patch_pod(self, name: str, patch: dict) -> dict:
        await asyncio.sleep(API_S)
        pod = self.pods.get(name)
        if pod is None:
            raise client.ApiException(status=404, reason="NotFound")
        meta = patch.get("metadata") or {}
        labels = pod["metadata"].setdefault("labels", {})
        for k, v in (meta.get("labels") or {}).items():
            if v is None:
                labels.pop(k, None)
            else:
                labels[k] = v
        self._emit("MODIFIED", pod)
        return copy.deepcopy(pod)

    async def delete_pod(self, name: str, uid: str | None) -> dict:
        await asyncio.sleep(API_S)
        pod = self.pods.get(name)
        if pod is None:
            raise client.ApiException(status=404, reason="NotFound")
        if uid and pod["metadata"]["uid"] != uid:
            raise client.ApiException(status=409, reason="Conflict")
        del self.pods[name]
        self._emit("DELETED", pod)
        return {"kind": "Status", "status": "Success"}

    async def list_pods(self, selector: str) -> list[dict]:
        await asyncio.sleep(API_S)
        k, _, v = selector.partition("=")
        return [copy.deepcopy(p) for p in self.pods.values()
                if (p["metadata"].get("labels") or {}).get(k) == v]

    async def pod_events(self, name: str, limit: int = 10) -> list[str]:
        return []

    async def read_node(self, name: str) -> dict | None:
        # Every replayed node is up: no lease is ever lost to one.
        return {"metadata": {"name": name},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    async def pod_event(self, pod: dict, reason: str, message: str) -> None:
        return None

    async def create_config_map(self, body: dict) -> dict:
        await asyncio.sleep(API_S)
        name = body["metadata"]["name"]
        if name in self.config_maps:
            raise client.ApiException(status=409, reason="AlreadyExists")
        cm = copy.deepcopy(body)
        cm["metadata"]["uid"] = f"uid-{next(self._ids)}"
        self.config_maps[name] = cm
        return copy.deepcopy(cm)

    async def read_config_map(self, name: str) -> dict:
        await asyncio.sleep(API_S)
        if name not in self.config_maps:
            raise client.ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.config_maps[name])

    async def delete_config_map(self, name: str) -> dict:
        await asyncio.sleep(API_S)
        if self.config_maps.pop(name, None) is None:
            raise client.ApiException(status=404, reason="NotFound")
        return {"kind": "Status", "status": "Success"}

    async def patch_config_map(self, name: str, patch: dict) -> dict:
        await asyncio.sleep(API_S)
        if name not in self.config_maps:
            raise client.ApiException(status=404, reason="NotFound")
        cm = self.config_maps[name]
        cm.setdefault("data", {}).update((patch or {}).get("data") or {})
        return copy.deepcopy(cm)

    def informer(self, loop, on_event) -> _Informer:
        return _Informer(self, loop, on_event)

    def event_watches(self, loop, on_event) -> list:
        return []  # no events in a replay
