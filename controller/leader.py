"""Leader election on a coordination.k8s.io Lease: one active replica, standbys take over
within `duration` seconds of the leader's last renewal. Losing the lease ends the process
(crash-only: the Deployment restarts it as a standby, whose books are rebuilt from labels).

The leader also writes the URL where it serves the API into the Lease (annotation
`sandman.dev/leader-url`), in the same resourceVersion-guarded update that renews it, so a
standby that reads the Lease learns who leads and where in one fenced object: it forwards API
calls there (controller/forward.py) and is Ready without being the leader.

Expiry is judged on this replica's own clock, as client-go does: a standby notes the local
monotonic time at which it last saw the Lease's record CHANGE (`Observed`), and takes over only
after the record stayed the same for a whole lease duration. The holder's `renewTime` is never
compared with this replica's wall clock, so a skewed clock on either side can neither steal a
lease that is being renewed nor keep a dead holder's lease alive forever."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
import time
from collections.abc import Callable

from kubernetes import client

from controller import metrics
from controller.kube import KubeClient
from sandman.contract import DOMAIN

log = logging.getLogger("controller.leader")

LEADER_URL_ANNOTATION = f"{DOMAIN}/leader-url"


class Observed:
    """client-go's observedRecord/observedTime: when (on `clock`, monotonic) the Lease's
    record was last seen to change. Pure logic: tests drive it with a fake clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.record: tuple | None = None
        self.at: float = 0.0

    def see(self, record: tuple) -> None:
        if record != self.record:  # a renewal (or any write): the holder is alive now
            self.record, self.at = record, self.clock()

    def expired(self, duration: float) -> bool:
        """No change seen for more than `duration` s of local time (a first sighting counts
        as a change: a replica that just started waits a whole duration)."""
        return self.record is None or self.clock() - self.at > duration


def record_of(spec: client.V1LeaseSpec) -> tuple:
    """What a renewal changes. Compared as values, never against this replica's clock."""
    return (spec.holder_identity or "", str(spec.renew_time), str(spec.acquire_time),
            spec.lease_transitions, spec.lease_duration_seconds)


class LeaderElector:
    def __init__(self, kube: KubeClient, name: str = "sandman-controller", duration: float = 10.0,
                 renew: float = 2.0, identity: str | None = None,
                 advertise_url: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < renew < duration:
            raise ValueError("renew period must be positive and shorter than the lease duration")
        self.kube = kube
        self.name = name
        self.duration = duration
        self.renew = renew
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.advertise_url = advertise_url  # where this replica serves the API, for standbys
        self.is_leader = False
        # Another replica's advertised URL while it holds an unexpired lease; None when nobody
        # leads, this replica leads, or the holder advertised nothing.
        self.leader_url: str | None = None
        self.holder: str | None = None
        self._last_renew: float = 0.0
        self._contact: float | None = None  # monotonic time of the last API round trip
        self.observed = Observed(clock)
        self.coord = client.CoordinationV1Api(kube.api)

    def connected(self) -> bool:
        """The API server answered a lease call within the last `duration` seconds: what a
        standby needs to be Ready (it can tell who leads and forward to it)."""
        return self._contact is not None and time.monotonic() - self._contact < self.duration

    def _annotate(self, meta: client.V1ObjectMeta) -> None:
        if self.advertise_url:
            meta.annotations = dict(meta.annotations or {},
                                    **{LEADER_URL_ANNOTATION: self.advertise_url})

    def _now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def _try(self) -> bool:
        ns = self.kube.ns
        now = self._now()
        try:
            lease = await self.kube.call(self.coord.read_namespaced_lease, self.name, ns)
        except client.ApiException as e:
            if e.status != 404:
                raise
            self._contact = time.monotonic()
            self.holder = self.leader_url = None
            meta = client.V1ObjectMeta(name=self.name)
            self._annotate(meta)
            body = client.V1Lease(metadata=meta, spec=client.V1LeaseSpec(
                holder_identity=self.identity, lease_duration_seconds=int(self.duration),
                acquire_time=now, renew_time=now, lease_transitions=0))
            try:
                await self.kube.call(self.coord.create_namespaced_lease, ns, body)
                return True
            except client.ApiException as e2:
                if e2.status == 409:
                    return False
                raise
        self._contact = time.monotonic()
        spec = lease.spec
        holder = spec.holder_identity or ""
        self.observed.see(record_of(spec))
        # An empty holder is a released lease (release() below): free at once.
        expired = not holder or self.observed.expired(spec.lease_duration_seconds
                                                      or self.duration)
        if holder != self.identity and not expired:
            self.holder = holder
            self.leader_url = (lease.metadata.annotations or {}).get(LEADER_URL_ANNOTATION)
            return False
        self.holder = self.leader_url = None  # nobody else leads: forward nowhere
        if holder != self.identity:
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.acquire_time = now
            spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.duration)
        self._annotate(lease.metadata)
        try:
            # replace carries resourceVersion: two candidates cannot both win, and the URL a
            # standby forwards to is only ever written by the holder of this very version.
            await self.kube.call(self.coord.replace_namespaced_lease, self.name, ns, lease)
            self.observed.see(record_of(spec))
            return True
        except client.ApiException as e:
            if e.status == 409:
                return False
            raise

    async def run(self, on_started, on_lost) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                ok = await self._try()
            except Exception as e:  # noqa: BLE001 - a failed renewal is judged by the deadline
                log.warning("lease %s: %s", self.name, e)
                ok = False
            t = loop.time()
            if ok:
                self._last_renew = t
                if not self.is_leader:
                    self.is_leader = True
                    metrics.LEADER.set(1)
                    log.info("became leader (%s)", self.identity)
                    await on_started()
            elif self.is_leader and t - self._last_renew > self.duration - self.renew:
                # Stop before another replica may take over: never two active leaders.
                self.is_leader = False
                metrics.LEADER.set(0)
                log.error("lost the lease %s", self.name)
                await on_lost()
                return
            await asyncio.sleep(self.renew)

    async def release(self) -> None:
        """On a clean shutdown hand the lease over at once instead of after `duration`."""
        if not self.is_leader:
            return
        try:
            lease = await self.kube.call(self.coord.read_namespaced_lease, self.name, self.kube.ns)
            if lease.spec.holder_identity == self.identity:
                # As client-go's ReleaseOnCancel: no holder, so a standby takes over at its
                # next try (a renewTime in the past would mean nothing to its local clock).
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1
                await self.kube.call(self.coord.replace_namespaced_lease, self.name,
                                     self.kube.ns, lease)
        except Exception as e:  # noqa: BLE001
            log.warning("lease release failed: %s", e)
