"""The controller's only door to the API server.

`Kube` is the narrow interface the books and the owner pipeline use: exactly the API calls they
make, so they can be tested against a deliberately lagging or failing fake
(tests/controller/fakekube.py) as well as the real API server. `KubeClient` is the real one:
blocking `kubernetes` client calls run in a bounded thread pool, plus a pod informer that
delivers slim pods (`pods.slim_pod`) to the event loop. `ListWatch` is the one list + watch loop:
the pod informer and the capacity signals' event watches (controller/events.py) are two of it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import urllib3
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from controller.pods import slim_pod
from sandman import contract

# Pods per page of the sweep's list (list_pods_slim).
LIST_PAGE = 500
log = logging.getLogger("controller.kube")

# Answers after which the API server may or may not have stored the object.
AMBIGUOUS_STATUSES = {500, 502, 503, 504}


def load_api_client(kubeconfig: str | None, pool: int) -> client.ApiClient:
    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    cfg.retries = False  # the controller owns every retry; hidden ones would double creates
    return client.ApiClient(cfg)


def is_transport_error(e: BaseException) -> bool:
    return isinstance(e, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError))


class Informer(Protocol):
    """List + watch of the controller's pods: `on_event("SYNC", [pod, ...])` after each (re)list,
    then `on_event("ADDED"|"MODIFIED"|"DELETED", pod)`, always on the event loop."""

    synced: asyncio.Event  # set after the first list was delivered

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Kube(Protocol):
    """Every API call the books and the owner pipeline make, and nothing else.

    Pods and ConfigMaps travel as plain JSON dicts. An answer from the API server is raised as
    `kubernetes.client.ApiException` (read `.status`); a call whose answer was lost (timeout,
    reset) raises a transport error (`is_transport_error`): it may or may not have been applied.
    """

    async def create_pod(self, body: dict) -> dict: ...

    async def read_pod(self, name: str) -> dict: ...

    async def patch_pod(self, name: str, patch: dict) -> dict: ...

    async def delete_pod(self, name: str, uid: str | None) -> dict: ...

    async def list_pods(self, selector: str) -> list[dict]: ...

    async def list_pods_slim(self, selector: str) -> list[dict]:
        """Every pod matching `selector` as `pods.slim_pod` copies (the sweep's read)."""
        ...

    async def list_nodes(self, selector: str) -> list[dict]:
        """Nodes matching a label selector (the image pre-pull's node pool)."""
        ...

    async def read_node(self, name: str) -> dict | None:
        """The Node named `name`, None when there is none (a lost node's leases,
        controller/lost.py)."""
        ...

    async def pod_events(self, name: str, limit: int = 10) -> list[str]:
        """The pod's last events as one line each; [] when they cannot be read."""
        ...

    async def create_config_map(self, body: dict) -> dict: ...

    async def pod_event(self, pod: dict, reason: str, message: str) -> None:
        """A Kubernetes Event about `pod` (slim copy is enough); best effort, never raises."""

    async def read_config_map(self, name: str) -> dict: ...

    async def read_secret(self, name: str) -> dict:
        """A pull Secret the pod template names (image pinning's registry credentials)."""

    async def delete_config_map(self, name: str) -> dict: ...

    async def patch_config_map(self, name: str, patch: dict) -> dict: ...

    def informer(self, loop: asyncio.AbstractEventLoop,
                 on_event: Callable[[str, Any], None]) -> Informer: ...

    def event_watches(self, loop: asyncio.AbstractEventLoop,
                      on_event: Callable[..., None]) -> list[Any]:
        """The capacity signals' event watches (controller/events.py); each has start/stop."""
        ...


class KubeClient:
    """`Kube` on the real API server (plus `call`, `api` and `ns` for the leader's Lease)."""

    def __init__(self, api: client.ApiClient, namespace: str, threads: int = 32,
                 request_timeout: float = 15.0):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.ns = namespace
        self.timeout = request_timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kube")

    async def call(self, fn: Callable, *args, **kwargs) -> Any:
        kwargs.setdefault("_request_timeout", self.timeout)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # Pods travel as plain JSON dicts: the client's model (de)serialisation cost ~5 ms of CPU
    # per pod and capped a 2-core controller near 30 creates/s.
    async def _raw(self, fn: Callable, *args, **kwargs) -> dict:
        kwargs.setdefault("_request_timeout", self.timeout)

        def run() -> dict:
            # The body is read here, in the pool thread: reading it on the event loop would
            # block every other request for the length of a TLS read.
            return json.loads(fn(*args, _preload_content=False, **kwargs).data)

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    async def create_pod(self, body: dict) -> dict:
        return await self._raw(self.core.create_namespaced_pod, self.ns, body)

    async def read_pod(self, name: str) -> dict:
        return await self._raw(self.core.read_namespaced_pod, name, self.ns)

    async def delete_pod(self, name: str, uid: str | None) -> dict:
        opts: dict[str, Any] = {"gracePeriodSeconds": 0}
        if uid:
            opts["preconditions"] = {"uid": uid}
        return await self._raw(self.core.delete_namespaced_pod, name, self.ns, body=opts)

    async def patch_pod(self, name: str, patch: dict) -> dict:
        return await self._raw(self.core.patch_namespaced_pod, name, self.ns, patch)

    async def list_pods(self, selector: str) -> list[dict]:
        return (await self._raw(self.core.list_namespaced_pod, self.ns,
                                label_selector=selector))["items"]

    async def list_pods_slim(self, selector: str) -> list[dict]:
        """Read LIST_PAGE pods at a time, each page decoded and slimmed in a pool thread: one
        list of thousands of whole pods held the GIL while json.loads ran, and every hand-out
        waited behind it once per sweep (make bench-warmburst's p99); between pages the loop
        runs."""
        out: list[dict] = []
        token: str | None = None
        loop = asyncio.get_running_loop()
        while True:
            def page(token: str | None = token) -> tuple[list[dict], str | None]:
                kw: dict[str, Any] = {"label_selector": selector, "limit": LIST_PAGE,
                                      "_preload_content": False,
                                      "_request_timeout": self.timeout}
                if token:
                    kw["_continue"] = token
                body = json.loads(self.core.list_namespaced_pod(self.ns, **kw).data)  # type: ignore[attr-defined]
                return ([slim_pod(p) for p in body.get("items") or ()],
                        (body.get("metadata") or {}).get("continue") or None)

            items, token = await loop.run_in_executor(self._pool, page)
            out += items
            if not token:
                return out

    async def list_nodes(self, selector: str) -> list[dict]:
        return (await self._raw(self.core.list_node, label_selector=selector))["items"]

    async def read_node(self, name: str) -> dict | None:
        # A list by name: the chart grants list on nodes, not get.
        items = (await self._raw(self.core.list_node,
                                 field_selector=f"metadata.name={name}"))["items"]
        return items[0] if items else None

    async def create_config_map(self, body: dict) -> dict:
        return await self._raw(self.core.create_namespaced_config_map, self.ns, body)

    async def read_config_map(self, name: str) -> dict:
        return await self._raw(self.core.read_namespaced_config_map, name, self.ns)

    async def delete_config_map(self, name: str) -> dict:
        return await self._raw(self.core.delete_namespaced_config_map, name, self.ns)

    async def patch_config_map(self, name: str, patch: dict) -> dict:
        return await self._raw(self.core.patch_namespaced_config_map, name, self.ns, patch)

    async def read_secret(self, name: str) -> dict:
        return await self._raw(self.core.read_namespaced_secret, name, self.ns)

    def informer(self, loop: asyncio.AbstractEventLoop,
                 on_event: Callable[[str, Any], None]) -> ListWatch:
        """The controller's pods (its managed-by label), slim (`pods.slim_pod`)."""
        selector = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_CONTROLLER}"

        def list_pods(**kw: Any) -> Any:
            return self.core.list_namespaced_pod(self.ns, label_selector=selector,
                                                 _preload_content=False, **kw)

        return ListWatch("pod-informer", list_pods, slim_pod, loop, on_event)

    def event_watches(self, loop: asyncio.AbstractEventLoop,
                      on_event: Callable[..., None]) -> list[Any]:
        from controller import events

        return list(events.watches(self.core, self.ns, loop, on_event))

    async def pod_events(self, name: str, limit: int = 10) -> list[str]:
        try:
            ev = await self.call(self.core.list_namespaced_event, self.ns,
                                 field_selector=f"involvedObject.name={name}")
        except Exception:  # noqa: BLE001 - events are a courtesy in an error message
            return []
        items = sorted(ev.items, key=lambda e: (e.last_timestamp or e.event_time or 0).__str__())
        return [f"{e.type} {e.reason}: {e.message}" for e in items[-limit:]]

    async def pod_event(self, pod: dict, reason: str, message: str) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = pod.get("metadata") or {}
        body = {"metadata": {"generateName": f"{meta.get('name', 'pod')}.",
                             "namespace": self.ns},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": self.ns,
                                   "name": meta.get("name"), "uid": meta.get("uid")},
                "reason": reason, "message": message, "type": "Normal", "count": 1,
                "firstTimestamp": now, "lastTimestamp": now,
                "source": {"component": "sandman-controller"}}
        try:
            await self._raw(self.core.create_namespaced_event, self.ns, body)
        except Exception as ex:  # noqa: BLE001 - an event is a courtesy, the delete stands
            log.warning("event %s for pod %s not recorded: %s", reason, meta.get("name"), ex)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ListWatch:
    """List + watch of one kind of object in a thread, delivered on the loop: `on_event("SYNC",
    [obj, ...])` after each (re)list (with `prime`, a third argument: True for the first list
    only), then `on_event("ADDED"|"MODIFIED"|"DELETED", obj)`, each object through `slim`.

    `list_call(**kw)` is the kubernetes client's list call with the selector bound, answering
    raw (`_preload_content=False`). A watch that ends or fails is resumed from the last
    resourceVersion, and relisted on 410; any other failure is logged and retried after
    `retry_s` (`forbidden_retry_s` on a 403: the RBAC was not granted, which a retry a second
    later will not change). `synced` is set once the first list was delivered, `tried` once it
    was delivered or failed (for a watch whose absence must not hold the start up).
    """

    def __init__(self, name: str, list_call: Callable[..., Any], slim: Callable[[dict], Any],
                 loop: asyncio.AbstractEventLoop, on_event: Callable[..., None], *,
                 prime: bool = False, retry_s: float = 1.0, forbidden_retry_s: float = 1.0):
        self.name = name
        self.list_call = list_call
        self.slim = slim
        self.loop = loop
        self.on_event = on_event
        self.prime = prime
        self.retry_s = retry_s
        self.forbidden_retry_s = forbidden_retry_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.synced = asyncio.Event()
        self.tried = asyncio.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, *args: Any) -> None:
        self.loop.call_soon_threadsafe(self.on_event, *args)

    def _run(self) -> None:
        rv = None
        first = True
        while not self._stop.is_set():
            resp = None
            try:
                if rv is None:
                    lst = json.loads(self.list_call(_request_timeout=60).data)
                    rv = lst["metadata"]["resourceVersion"]
                    items = [self.slim(o) for o in lst.get("items") or []]
                    self._emit("SYNC", items, *((first,) if self.prime else ()))
                    if first:
                        first = False
                        self.loop.call_soon_threadsafe(self.synced.set)
                        self.loop.call_soon_threadsafe(self.tried.set)
                resp = self.list_call(resource_version=rv, watch=True, timeout_seconds=60,
                                      allow_watch_bookmarks=True, _request_timeout=90)
                for line in iter_resp_lines(resp):
                    if self._stop.is_set():
                        return
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        if obj.get("code") == 410:  # resourceVersion too old: relist
                            rv = None
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._emit(ev["type"], self.slim(obj))
            except client.ApiException as e:
                if first:
                    self.loop.call_soon_threadsafe(self.tried.set)
                if e.status == 410:
                    rv = None
                else:
                    wait = self.forbidden_retry_s if e.status == 403 else self.retry_s
                    log.warning("%s failed: %s %s; retrying in %gs", self.name, e.status,
                                e.reason, wait)
                    self._stop.wait(wait)
            except Exception as e:  # noqa: BLE001 - keep watching whatever happened
                if first:
                    self.loop.call_soon_threadsafe(self.tried.set)
                log.warning("%s failed: %s; retrying in %gs", self.name, e, self.retry_s)
                self._stop.wait(self.retry_s)
            finally:
                if resp is not None:
                    resp.release_conn()
