"""The capacity signals' pure logic (controller/events.py): the kubelet's pull message parsed or
ignored, events counted once per occurrence, sandman's pods told from lookalikes by uid, and
memory bounded under a flood. On the real API server: test_capacity_signals.py."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from controller import events as E
from controller import metrics

NS = "sandman-sandboxes"
OWN_UID = "11111111-1111-1111-1111-111111111111"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def failures(scope: str) -> float:
    return sample("sandman_controller_pod_address_failures_total", scope=scope)


def pulls() -> tuple[float, float]:
    return (sample("sandman_controller_image_pull_seconds_count"),
            sample("sandman_controller_image_pull_seconds_sum"))


def ev(uid: str, reason: str = E.REASON_SANDBOX_FAILED, count: int = 1, ns: str = NS,
       pod_uid: str = OWN_UID, message: str | None = None, kind: str = "Pod") -> dict:
    return E.slim_event({"metadata": {"uid": uid}, "reason": reason, "count": count,
                         "message": message,
                         "involvedObject": {"kind": kind, "namespace": ns, "name": "sb-x",
                                            "uid": pod_uid}})


@pytest.mark.parametrize(("message", "seconds"), [
    ('Successfully pulled image "registry.invalid/swe/task:1" in 3.2s (3.2s including waiting)',
     3.2),
    ('Successfully pulled image "r/x@sha256:ab" in 1m2.5s (1m40s including waiting). '
     'Image size: 1234 bytes.', 62.5),
    ('Successfully pulled image "x" in 450ms (450ms including waiting)', 0.45),
    ('Successfully pulled image "x" in 3.204843s', 3.204843),
    ('Successfully pulled image "x" in 1h0m0s.', 3600.0),
    ('Successfully pulled image "x" in 12µs (12µs including waiting)', 12e-6),
])
def test_the_kubelets_pull_messages_are_read(message, seconds):
    assert E.pull_seconds(message) == pytest.approx(seconds)


@pytest.mark.parametrize("message", [
    'Container image "x" already present on machine',
    'Successfully pulled image "x" in 3.2sXYZ (forged)',
    'Successfully pulled image "x" in -3s',
    'Successfully pulled image "x" in 3.2',
    'Successfully pulled image "x" in s',
    'Successfully pulled image "x" in 1000000h (too long to be a pull)',
    'Successfully pulled image "x" in 99999999999999999999s',
    'Successfully pulled image "a" in 1s" in 5s',
    'x Successfully pulled image "x" in 3s',
    'Successfully pulled image "x" in 1h1h1h1h1h',
    'Successfully pulled image "' + "a" * 5000 + '" in 1s',
    "", None, 3.2, {"in": "3s"}, ["Successfully pulled image"],
])
def test_odd_or_hostile_pull_messages_are_ignored(message):
    assert E.pull_seconds(message) is None


@pytest.mark.parametrize(("raw", "n"), [
    ({"count": 4}, 4), ({"series": {"count": 7}}, 7), ({}, 1), ({"count": 0}, 1),
    ({"count": -5}, 1), ({"count": "9"}, 1), ({"count": True}, 1), ({"count": 10**12}, 1),
    ({"series": {}}, 1),
])
def test_occurrences_are_sane_integers(raw, n):
    assert E.occurrences(raw) == n


def test_an_event_counts_once_per_occurrence_and_a_relist_adds_nothing():
    s = E.CapacitySignals(NS)
    before = failures("other")
    s.on_event("ADDED", ev("e1", count=1, ns="team-b", pod_uid="p-b"))
    s.on_event("MODIFIED", ev("e1", count=3, ns="team-b", pod_uid="p-b"))  # aggregated twice
    s.on_event("MODIFIED", ev("e1", count=3, ns="team-b", pod_uid="p-b"))  # a resync
    s.on_event("SYNC", [ev("e1", count=3, ns="team-b", pod_uid="p-b")])  # a relist after 410
    s.on_event("MODIFIED", ev("e1", count=2, ns="team-b", pod_uid="p-b"))  # never backwards
    assert failures("other") - before == 3


def test_the_first_list_primes_and_counts_nothing():
    s = E.CapacitySignals(NS)
    before = failures("other")
    s.on_event("SYNC", [ev("old", count=40, ns="team-b", pod_uid="p-b")], True)
    assert failures("other") == before
    s.on_event("MODIFIED", ev("old", count=41, ns="team-b", pod_uid="p-b"))
    assert failures("other") - before == 1


def test_sandmans_pods_are_known_by_uid_never_by_name_or_namespace():
    s = E.CapacitySignals(NS)
    s.remember(OWN_UID, "agent")
    own, other = failures("sandman"), failures("other")
    s.on_event("ADDED", ev("a", pod_uid=OWN_UID))  # ours
    # Lookalikes: our uid in another namespace (an event cannot name another namespace's
    # object, the API server refuses it; a forged one still does not count), our namespace
    # with a pod we did not create, and a non-pod object carrying our uid.
    s.on_event("ADDED", ev("b", ns="team-b", pod_uid=OWN_UID))
    s.on_event("ADDED", ev("c", pod_uid="not-ours"))
    s.on_event("ADDED", ev("d", kind="Node", pod_uid=OWN_UID))
    s.on_event("ADDED", ev("e", pod_uid=None))  # type: ignore[arg-type]
    assert failures("sandman") - own == 1
    assert failures("other") - other == 3  # b, c, e; the Node event is not a pod's


def test_pulls_are_observed_for_sandmans_pods_only():
    s = E.CapacitySignals(NS)
    s.remember(OWN_UID, "grading")
    n0, sum0 = pulls()
    msg = 'Successfully pulled image "x" in 17.4s (20s including waiting)'
    s.on_event("ADDED", ev("p1", reason=E.REASON_PULLED, message=msg))
    s.on_event("ADDED", ev("p2", reason=E.REASON_PULLED, message=msg, ns="team-b",
                           pod_uid="p-b"))
    s.on_event("ADDED", ev("p3", reason=E.REASON_PULLED, message="Successfully pulled image "
                           '"x" in 9999999h'))
    s.on_event("ADDED", ev("p4", reason=E.REASON_PULLED, message='Container image "x" already '
                           "present on machine"))
    s.on_event("MODIFIED", ev("p1", reason=E.REASON_PULLED, message=msg))  # a resync
    n1, sum1 = pulls()
    assert (n1 - n0, sum1 - sum0) == (1, pytest.approx(17.4))


def test_other_reasons_and_malformed_objects_count_nothing():
    s = E.CapacitySignals(NS)
    before = failures("other") + failures("sandman")
    for obj in ({}, {"uid": "x"}, {"uid": "y", "kind": "Pod", "reason": "Scheduled"},
                E.slim_event({}), E.slim_event({"metadata": {}, "involvedObject": {}})):
        s.on_event("ADDED", obj)
    s.on_event("BOOKMARK", {"uid": "z"})
    s.on_event("DELETED", {})
    assert failures("other") + failures("sandman") == before


def test_a_flood_of_events_keeps_memory_bounded():
    s = E.CapacitySignals(NS, seen_cap=1000, own_cap=100)
    before = failures("other")
    for i in range(20000):
        s.on_event("ADDED", ev(f"flood-{i}", ns="team-b", pod_uid=f"p-{i}"))
        s.remember(f"own-{i}", "agent")
    assert len(s.seen_other) == 1000 and len(s._own) == 100
    assert failures("other") - before == 20000
    # The most recent stay deduped; a deleted (expired) event frees its slot.
    s.on_event("MODIFIED", ev("flood-19999", ns="team-b", pod_uid="p"))
    assert failures("other") - before == 20000
    s.on_event("DELETED", ev("flood-19999"))
    assert len(s.seen_other) == 999


def test_an_event_seen_before_its_pod_was_remembered_is_not_recounted():
    s = E.CapacitySignals(NS)
    late = "22222222-2222-2222-2222-222222222222"
    before_other, before_own = failures("other"), failures("sandman")
    s.on_event("ADDED", ev("early", count=3, pod_uid=late))  # its pod not in the books yet
    s.remember(late, "agent")
    s.on_event("MODIFIED", ev("early", count=4, pod_uid=late))
    assert (failures("other") - before_other, failures("sandman") - before_own) == (3, 1)
    s.on_event("DELETED", ev("early", pod_uid=late))
    assert len(s.seen_own) == 0 and len(s.seen_other) == 0


def test_metric_labels_stay_in_their_allow_lists():
    metrics.pod_address_failures("sandman; DROP", 1)
    metrics.create_to_ready("ns-of-an-attacker", 1.0)
    scopes = {s.labels["scope"] for m in REGISTRY.collect()
              if m.name == "sandman_controller_pod_address_failures" for s in m.samples}
    roles = {s.labels["role"] for m in REGISTRY.collect()
             if m.name == "sandman_controller_create_to_ready_seconds" for s in m.samples}
    assert scopes <= set(metrics.FAILURE_SCOPES)
    assert roles <= set(metrics.contract.ROLES)
