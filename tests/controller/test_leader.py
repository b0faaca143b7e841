"""Leader election judges the holder's renewals on the local clock (client-go's observedTime),
never the holder's renewTime against this replica's wall clock: the pure logic with a fake
clock, then a real controller against a Lease whose holder's clock is skewed."""

from __future__ import annotations

import datetime as dt
import threading
import time

import httpx
import pytest
from kubernetes import client

from controller.leader import Observed
from sandman import api
from testbed.controller import ControllerProc


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_changing_record_is_never_expired_whatever_its_timestamps():
    clock = FakeClock()
    o = Observed(clock)
    assert o.expired(10)  # nothing seen yet
    for i in range(20):  # a renewal every 5 s of local time, timestamps years off
        o.see(("ghost", f"2000-01-01 00:00:{i:02d}", "a", 0, 10))
        assert not o.expired(10)
        clock.t += 5
        assert not o.expired(10)


def test_an_unchanged_record_expires_after_the_duration_of_local_time():
    clock = FakeClock()
    o = Observed(clock)
    rec = ("ghost", "2999-01-01 00:00:00", "a", 0, 10)  # renewTime far in the future
    o.see(rec)
    clock.t += 9.9
    o.see(rec)  # read again, unchanged: the clock does not restart
    assert not o.expired(10)
    clock.t += 0.2
    assert o.expired(10)
    o.see(rec[:1] + ("2999-01-01 00:00:01",) + rec[2:])  # it renewed after all
    assert not o.expired(10)


# ---- on the test bed -------------------------------------------------------------------------
LEASE_S = 3


def _lease(coord, ns: str, name: str):
    return coord.read_namespaced_lease(name, ns)


class SkewedHolder:
    """Holds the Lease from a clock that is `skew` off: its renewTime is years away from the
    bed's time, but it keeps changing (a renewal every second) until stopped."""

    def __init__(self, coord, ns: str, name: str, skew: dt.timedelta):
        self.coord, self.ns, self.name, self.skew = coord, ns, name, skew
        self.stop = threading.Event()
        self.last_write = time.monotonic()
        now = dt.datetime.now(dt.UTC) + skew
        coord.create_namespaced_lease(ns, client.V1Lease(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1LeaseSpec(holder_identity="skewed-holder",
                                    lease_duration_seconds=LEASE_S, acquire_time=now,
                                    renew_time=now, lease_transitions=0)))
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        for _ in range(120):  # bounded: 2 minutes at most
            if self.stop.wait(1.0):
                return
            lease = _lease(self.coord, self.ns, self.name)
            lease.spec.renew_time = dt.datetime.now(dt.UTC) + self.skew
            self.coord.replace_namespaced_lease(self.name, self.ns, lease)
            self.last_write = time.monotonic()

    def halt(self) -> None:
        self.stop.set()
        self.t.join(10)


@pytest.mark.parametrize("skew_days", [-3650, 3650])
def test_skewed_holder_is_not_robbed_while_it_renews_and_is_replaced_when_it_stops(
        cluster, namespace, tmp_path, skew_days):
    """-3650: renewTime ten years in the past, which the old wall-clock comparison read as
    expired (a steal while the holder renews); +3650: ten years ahead, which it read as never
    expiring (a dead holder kept its lease forever)."""
    coord = cluster.coordination
    name = f"skew-{namespace}"[:60]
    holder = SkewedHolder(coord, namespace, name, dt.timedelta(days=skew_days))
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", name, "--lease-duration", str(LEASE_S),
                          "--lease-renew", "0.5"])
    try:
        ctl.start(role="standby")
        time.sleep(3 * LEASE_S)  # three lease durations of renewals
        assert _lease(coord, namespace, name).spec.holder_identity == "skewed-holder"
        r = httpx.get(ctl.url + api.READYZ.path, timeout=5)
        assert r.status_code == 200 and r.json()["role"] == "standby", r.text
        holder.halt()
        stopped = holder.last_write
        ctl.wait_ready(timeout=4 * LEASE_S, role="leader")
        took = time.monotonic() - stopped
        assert took >= LEASE_S - 0.5, f"taken over {took:.1f}s after the last renewal"
        assert _lease(coord, namespace, name).spec.holder_identity != "skewed-holder"
    finally:
        holder.halt()
        ctl.kill()
