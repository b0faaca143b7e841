"""The paper's 25 ownership windows (appendix F, table A21), reproduced on the real test bed.

Each test drives the real controller (a subprocess) through the fault proxy
(tests/controller/faultproxy.py) into one window: a call held at a chosen point, a caller that
hangs up or times out there, an answer changed to 403/409/500/504 or a reset. Triggers are
events, never timers: the test waits until the proxy holds the call (or the watch is paused, or
the stand-in execd holds the probe), then acts, then releases. After every trial an independent
auditor lists the namespace's pods through the real API server (not the proxy): each must be
held by a caller, warm in the controller's books, or being deleted; once the callers released
what they hold, no sandman pod may remain; a sentinel pod of another tenant is in every trial
and must survive untouched.

Mapping of the paper's terms: a "grading" acquire has no per-caller state (warm-eligible: parked
warm when its caller leaves after the create); a "rollout" acquire carries labels (deleted).
A "cancel" is the HTTP client hanging up mid-request; an "acquire timeout" is `timeout_s`.
The sweep is switched off (interval 1 h) so that every window tests the owner tasks alone;
test_sweep_backstop covers the sweep.

SANDMAN_WINDOW_REPEATS (default 5) sets the trials per window; `make test-windows-full` uses 20.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kubernetes import client, config

from tests.controller.faultproxy import Fault, FaultProxy
from tests.controller.windows_helpers import (
    CANCEL_SETTLE_S,
    CONTROLLER_ROOT,
    JOB,
    POOL_JOB,
    ROLLOUT,
    Caller,
    ControllerProc,
    GatedExecd,
    NodeLeaseKeeper,
    Window,
    acquire_body,
    created_pod,
    deletes,
    patched_state,
    wait_for,
)

REPEATS = int(os.environ.get("SANDMAN_WINDOW_REPEATS", "5"))
PODS = r"/namespaces/[^/]+/pods$"
POD_DELETE = r"/namespaces/[^/]+/pods/[^/]+$"
CONFIGMAP_DELETE = r"/namespaces/[^/]+/configmaps/[^/]+$"
UNSCHEDULABLE = ["--node-pool-label", "sandman.dev/node-pool=no-such-pool"]


def _ready_budget_flag(seconds: str) -> list[str]:
    """`--ready-budget` when this controller has it (an owner's readiness budget separate from
    the caller's timeout_s; see test_w13_late_grading_pod_is_parked_and_reused)."""
    out = subprocess.run([sys.executable, "-m", "controller", "serve", "--help"],
                         cwd=CONTROLLER_ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    return ["--ready-budget", seconds] if "--ready-budget" in out else []

@pytest.fixture(scope="module", autouse=True)
def _node_heartbeats(cluster):
    """Keeps the kwok nodes Ready for the whole module (see NodeLeaseKeeper)."""
    keeper = NodeLeaseKeeper(cluster.api_client).start()
    yield
    keeper.stop()


@pytest.fixture
def window(cluster, namespace, tmp_path, figures, request):
    """`window(*controller_flags)` -> a Window: proxy + controller + auditor for this test."""
    made: list[tuple[FaultProxy, ControllerProc]] = []
    t0 = time.monotonic()

    def make(*flags: str) -> Window:
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
        proxy = FaultProxy(cfg.host, cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file,
                           tmp_path / "proxy").start()
        ctl = ControllerProc(namespace, proxy.kubeconfig(tmp_path / "proxy.kubeconfig"),
                             tmp_path, list(flags))
        made.append((proxy, ctl))
        ctl.start()
        w = Window(cluster.core, namespace, proxy, ctl)
        made_windows.append(w)
        return w

    made_windows: list[Window] = []
    try:
        yield make
    finally:
        for proxy, ctl in made:
            ctl.close()
            proxy.stop()
    hits = sum(w.hits for w in made_windows)
    figures.add(f"{request.node.name}: {hits} trial(s) hit the window and left every pod owned, "
                f"{time.monotonic() - t0:.1f}s")


def repeat(w: Window, trial) -> None:
    """REPEATS trials of one window on one controller, each audited (Window.trial)."""
    for i in range(REPEATS):
        with w.trial(i) as mark:
            try:
                trial(i, mark)
            except AssertionError as e:
                raise AssertionError(f"trial {i + 1}/{REPEATS}: {e}\n--- pods ---\n"
                                     f"{w.describe_pods()}\n--- controller log tail ---\n"
                                     f"{w.ctl.tail()}") from None


def job(i: int) -> str:
    # One job per trial: a drain or a job's owner ConfigMap never reaches the next trial.
    return f"{JOB}-{i}"


def never_leased(w: Window, mark: int, name: str) -> None:
    states = patched_state(w.proxy, mark, name)
    assert "leased" not in states, f"{name} was handed out to a caller that had left: {states}"


# ---- cancel before the API stores the pod ----------------------------------------------------
def test_w01_cancel_while_the_create_waits_in_the_queue(window):
    """A hang-up while the create waits for a token of the create bucket: withdrawn, never
    sent (paper: 'no pod (withdrawn)')."""
    # One token per 5 s: the first acquire's token cannot come back while it waits for its
    # pod to be ready, so the second always queues (at --rate 1 a loaded bed let it through).
    w = window("--rate", "0.2", "--burst", "1")

    def trial(i: int, mark: int) -> None:
        first = w.ctl.acquire(job=job(i))  # takes the bucket's only token
        assert first.status_code == 201, first.text
        w.hand(first.json())
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        wait_for(lambda: w.ctl.http.get("/v1/stats").json()["queue_depth"].get(job(i)),
                   5, "the second acquire to wait in the queue")
        c.hang_up()
        wait_for(lambda: not w.ctl.http.get("/v1/stats").json()["queue_depth"].get(job(i)),
                   5, "the hung-up acquire to leave the queue")
        time.sleep(5.3)  # the next token: a create still queued would be sent now
        creates = w.proxy.since(mark, "POST", PODS)
        assert len(creates) == 1, f"a withdrawn create was sent: {creates}"

    repeat(w, trial)


def test_w02_cancel_during_admission_then_stored(window):
    """Paper: 'request sent anyway, then deleted'."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("POST", PODS, hold="before"))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        rec = rule.wait_reached()
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        rule.release()
        wait_for(lambda: rec.upstream, 10, "the held create to be stored")
        assert rec.upstream == 201
        w.wait_gone(rec.name, 15, "after its caller left")
        assert deletes(w.proxy, mark, rec.name), "gone without a delete from the controller"
        never_leased(w, mark, rec.name)

    repeat(w, trial)


def test_w03_cancel_during_admission_then_rejected_403(window):
    """Paper: 'no pod'. No read-back and no delete after a 4xx."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("POST", PODS, hold="before", forward=False, answer=403))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        rec = rule.wait_reached()
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        rule.release()
        wait_for(lambda: rec.status, 10, "the 403 answer")
        time.sleep(0.6)  # a retried or duplicated create (back-off 0.2 s) shows up here
        assert rec.status == 403 and rec.upstream is None
        assert len(w.proxy.since(mark, "POST", PODS)) == 1, "a refused create was retried"
        assert w.pod(rec.name) is None
        assert not deletes(w.proxy, mark, rec.name), "a delete for a pod never stored"

    repeat(w, trial)


def test_w04_acquire_times_out_while_waiting_for_a_create_slot(window):
    """Paper (with the fix): 'sent when the slot frees, then deleted'; here it is withdrawn
    from the queue: no create is ever sent."""
    w = window("--max-creating", "1")

    def trial(i: int, mark: int) -> None:
        hold = w.proxy.add(Fault("POST", PODS, hold="before"))
        first = Caller(w.ctl.port, acquire_body(job=job(i)))
        hold.wait_reached()  # the only create slot is taken by a create in admission
        late = Caller(w.ctl.port, acquire_body(job=job(i), timeout_s=0.5))
        status, err = late.wait(10)
        assert status == 504 and err["error"]["type"] == "AcquireTimeout", err
        assert "queued" in err["error"]["message"], err
        hold.release()
        status, res = first.wait(15)
        assert status == 201, res
        w.hand(res)
        time.sleep(0.5)  # the slot is free again: a create not withdrawn would be sent now
        creates = w.proxy.since(mark, "POST", PODS)
        assert len(creates) == 1, f"the timed-out acquire still created: {creates}"

    repeat(w, trial)


# ---- cancel after the API stores the pod, before the caller has it -------------------------
def test_w05_cancel_while_the_create_response_is_in_flight(window):
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("POST", PODS, hold="after"))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        rec = rule.wait_reached()
        wait_for(lambda: rec.upstream, 10, "the create to be stored")
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        rule.release()
        w.wait_gone(rec.name, 15, "after its caller left")
        never_leased(w, mark, rec.name)

    repeat(w, trial)


def test_w06_cancel_during_the_ready_wait(window):
    """The watch is paused: the controller cannot learn that the pod is Ready."""
    w = window()

    def trial(i: int, mark: int) -> None:
        w.proxy.watch_open.clear()
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        w.wait_ready(name)  # Ready in the API; the controller does not know yet
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        w.proxy.watch_open.set()
        w.wait_gone(name, 15, "after its caller left")
        never_leased(w, mark, name)

    repeat(w, trial)


def test_w07_cancel_during_the_execd_health_probe(window):
    """--ready-check execd: a stand-in execd on the pod's loopback address holds /ready."""
    w = window("--ready-check", "execd")

    def trial(i: int, mark: int) -> None:
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        gate = GatedExecd(w.wait_ready(name))
        try:
            assert gate.reached.wait(10), "the controller never probed execd /ready"
            c.hang_up()
            time.sleep(CANCEL_SETTLE_S)
            gate.release.set()
            w.wait_gone(name, 15, "after its caller left")
            never_leased(w, mark, name)
        finally:
            gate.close()

    repeat(w, trial)


# ---- second (and third) cancel during cleanup ------------------------------------------------
def test_w08_second_cancel_while_cleanup_waits_for_the_create(window):
    """First cancel: the caller hangs up while the create is in admission. Second: the job is
    drained while the owner still waits for that create."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("POST", PODS, hold="before"))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        rec = rule.wait_reached()
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        assert w.ctl.drain(job(i))["deleting"] >= 1
        rule.release()
        wait_for(lambda: rec.upstream, 10, "the held create to be stored")
        w.wait_gone(rec.name, 15, "after the caller left and the job was drained")
        never_leased(w, mark, rec.name)

    repeat(w, trial)


def test_w09_second_and_third_cancel_while_the_cleanup_delete_is_held(window):
    """The cleanup delete is held; second cancel: the job is drained; third: the controller
    is killed (SIGKILL) and restarted. The restarted controller rebuilds its books from labels
    and redoes the delete; the dead controller's held delete is never applied."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("DELETE", POD_DELETE, hold="before"))
        # The drain also deletes the job's owner ConfigMap, whose pods the garbage collector
        # then deletes: held too, so that delete dies with the controller like the pod's,
        # instead of racing the kill on a busy machine and taking the pod before the restart.
        owner = w.proxy.add(Fault("DELETE", CONFIGMAP_DELETE, hold="before"))
        w.proxy.watch_open.clear()
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        w.wait_ready(name)
        c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        w.proxy.watch_open.set()
        held = rule.wait_reached(15)
        assert held.name == name
        w.ctl.drain(job(i))
        w.ctl.kill()
        rule.release()
        owner.release()
        wait_for(lambda: held.outcome, 5, "the dead controller's delete to be dropped")
        assert held.outcome == "client-gone" and held.upstream is None
        assert w.pod(name) is not None, "the pod went before the restart: window missed"
        w.ctl.start()
        w.wait_gone(name, 10, "by the restarted controller")
        assert [d for d in deletes(w.proxy, mark, name) if d.upstream == 200]

    repeat(w, trial)


# ---- acquire timeout with the create in flight ----------------------------------------------
def _timeout_during_create_response(w: Window, i: int, labels, answer=None):
    rule = w.proxy.add(Fault("POST", PODS, hold="after", answer=answer))
    c = Caller(w.ctl.port, acquire_body(labels, job=job(i), timeout_s=1.0))
    rec = rule.wait_reached()
    status, err = c.wait(10)
    assert rec.upstream == 201, "the create was not stored before the acquire timed out"
    assert status == 504 and err["error"]["type"] == "AcquireTimeout", err
    time.sleep(0.05)
    rule.release()
    return rec


def test_w10_grading_acquire_times_out_during_the_create_response(window):
    """Paper: 'kept warm; next acquire reused it'. The late pod is parked warm."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rec = _timeout_during_create_response(w, i, None)
        wait_for(lambda: "warm" in patched_state(w.proxy, mark, rec.name), 10,
                   "the late grading pod to be parked warm")
        never_leased(w, mark, rec.name)

    repeat(w, trial)


def test_w11_rollout_acquire_times_out_during_the_create_response(window):
    """Paper: 'deleted'."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rec = _timeout_during_create_response(w, i, ROLLOUT)
        w.wait_gone(rec.name, 15, "after its acquire timed out")
        assert "warm" not in patched_state(w.proxy, mark, rec.name), "per-caller pod parked"
        never_leased(w, mark, rec.name)

    repeat(w, trial)


def _timeout_during_ready_wait(w: Window, i: int, labels, resume_after: float = 0.05):
    mark = w.proxy.mark()
    w.proxy.watch_open.clear()
    c = Caller(w.ctl.port, acquire_body(labels, job=job(i), timeout_s=1.5))
    name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
    status, err = c.wait(10)
    assert status == 504 and err["error"]["type"] == "AcquireTimeout", err
    assert "starting" in err["error"]["message"], err
    time.sleep(resume_after)
    w.proxy.watch_open.set()
    return name


def test_w12_rollout_acquire_times_out_while_its_pod_waits_for_ready(window):
    """Paper: 'deleted once Ready'."""
    w = window()

    def trial(i: int, mark: int) -> None:
        name = _timeout_during_ready_wait(w, i, ROLLOUT)
        w.wait_gone(name, 15, "once Ready")
        never_leased(w, mark, name)

    repeat(w, trial)


def test_w13_grading_acquire_times_out_while_its_pod_waits_for_ready(window):
    """Paper: 'kept warm and reused'. Here the late grading pod is parked or deleted (never
    left without an owner) and a second acquire of the key gets a sandbox; whether it is the
    late pod is test_w13_late_grading_pod_is_parked_and_reused."""
    w = window()

    def trial(i: int, mark: int) -> None:
        name = _timeout_during_ready_wait(w, i, None)
        wait_for(lambda: "warm" in patched_state(w.proxy, mark, name)
                   or deletes(w.proxy, mark, name), 10, "the late grading pod parked or deleted")
        second = w.ctl.acquire(job=job(i))
        assert second.status_code == 201, second.text
        w.hand(second.json())
        if second.json()["pod"] != name:  # else: reused, the paper's outcome
            never_leased(w, mark, name)

    repeat(w, trial)


def test_w10_parked_pod_outlives_a_maintenance_tick(window):
    """Window 10's paper outcome: the late grading pod is kept warm and the NEXT acquire of the
    key reuses it. The next acquire comes 1.5 s after the park: longer than one maintenance
    tick (1 s), far shorter than --idle-timeout."""
    w = window("--idle-timeout", "60")

    def trial(i: int, mark: int) -> None:
        rec = _timeout_during_create_response(w, i, None)
        wait_for(lambda: "warm" in patched_state(w.proxy, mark, rec.name), 10,
                   "the late grading pod to be parked warm")
        time.sleep(1.5)
        _next_acquire_reuses(w, i, mark, rec.name)

    repeat(w, trial)


def test_w13_late_grading_pod_is_parked_and_reused(window):
    """Window 13's paper outcome: the pod of a grading acquire that timed out while the pod
    waited for Ready is parked once Ready (0.5 s after the timeout here) and reused by the
    next acquire of the key (1.5 s after the park)."""
    w = window("--idle-timeout", "60")

    def trial(i: int, mark: int) -> None:
        name = _timeout_during_ready_wait(w, i, None, resume_after=0.5)
        wait_for(lambda: "warm" in patched_state(w.proxy, mark, name)
                   or deletes(w.proxy, mark, name), 10, "the late grading pod parked or deleted")
        assert "warm" in patched_state(w.proxy, mark, name), (
            f"the late grading pod {name} was deleted, not parked")
        time.sleep(1.5)
        _next_acquire_reuses(w, i, mark, name)

    repeat(w, trial)


def _next_acquire_reuses(w: Window, i: int, mark: int, name: str) -> None:
    nxt = w.ctl.acquire(job=job(i))
    assert nxt.status_code == 201, nxt.text
    w.hand(nxt.json())
    assert nxt.json()["warm"] and nxt.json()["pod"] == name, (
        f"the parked pod {name} was not reused: got {nxt.json()['pod']}; "
        f"deletes of the parked pod: {deletes(w.proxy, mark, name)}")


def test_w14_acquire_times_out_and_the_pod_never_becomes_ready(window):
    """No node matches the pool: the pod stays Pending. Paper: 'deleted when the budget
    expires'. The caller's error carries the pod's last events."""
    w = window(*UNSCHEDULABLE, *_ready_budget_flag("3"))

    def trial(i: int, mark: int) -> None:
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i), timeout_s=2.0))
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        status, err = c.wait(15)
        assert status == 504 and err["error"]["type"] == "AcquireTimeout", err
        assert any("FailedScheduling" in ev for ev in err["error"]["events"]), err
        w.wait_gone(name, 15, "when the readiness budget ran out")
        never_leased(w, mark, name)

    repeat(w, trial)


# ---- job-end drain while a warm pod starts ---------------------------------------------------
def test_w15_drain_while_a_warm_build_waits_for_ready(window):
    w = window()

    def trial(i: int, mark: int) -> None:
        w.proxy.watch_open.clear()
        w.ctl.prewarm(1)
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        w.wait_ready(name)
        assert w.ctl.drain(POOL_JOB)["deleting"] >= 1
        w.ctl.prewarm(0)  # the job ended: no warm pods wanted any more
        time.sleep(0.05)
        w.proxy.watch_open.set()
        w.wait_gone(name, 15, "after the drain")
        assert len(w.proxy.since(mark, "POST", PODS)) == 1

    repeat(w, trial)


# ---- create stored, but answered with an error (no cancel) ----------------------------------
def _stored_then_error(w: Window, i: int, mark: int, answer) -> None:
    rule = w.proxy.add(Fault("POST", PODS, answer=answer))
    r = w.ctl.acquire(labels=ROLLOUT, job=job(i))
    rec = rule.wait_reached()
    assert rec.upstream == 201, "the create was not stored"
    assert r.status_code == 201, r.text
    got = w.hand(r.json())
    # Read back by name and nonce: the stored pod is adopted, never duplicated.
    assert got["pod"] == rec.name, f"a second pod was created: {got['pod']} besides {rec.name}"
    assert len(w.proxy.since(mark, "POST", PODS)) == 1
    assert w.proxy.since(mark, "GET", name=rec.name), "no read-back after the ambiguous answer"


def test_w16_pod_stored_then_a_504_answer(window):
    """Paper (fix): 'read back and deleted'; here read back and adopted (handed out)."""
    w = window()

    def trial(i: int, mark: int) -> None:
        _stored_then_error(w, i, mark, 504)

    repeat(w, trial)


def test_w17_pod_stored_then_the_connection_resets(window):
    w = window()

    def trial(i: int, mark: int) -> None:
        _stored_then_error(w, i, mark, "reset")

    repeat(w, trial)


def test_w18_grading_timeout_then_a_late_504_after_the_pod_was_stored(window):
    """As 10, but the late answer is a 504: read back by nonce, then parked (grading)."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rec = _timeout_during_create_response(w, i, None, answer=504)
        wait_for(lambda: rec.status == 504, 5, "the late 504")
        wait_for(lambda: w.proxy.since(mark, "GET", name=rec.name), 10,
                   "the read-back by name after the 504")
        wait_for(lambda: "warm" in patched_state(w.proxy, mark, rec.name)
                   or deletes(w.proxy, mark, rec.name), 10,
                   "the late pod to be parked or deleted")
        never_leased(w, mark, rec.name)

    repeat(w, trial)


# ---- delete fails or its reply is lost -------------------------------------------------------
def _cancel_during_ready_with_delete_fault(w: Window, i: int, mark: int, **fault):
    rule = w.proxy.add(Fault("DELETE", POD_DELETE, **fault))
    w.proxy.watch_open.clear()
    c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
    name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
    w.wait_ready(name)
    c.hang_up()
    time.sleep(CANCEL_SETTLE_S)
    w.proxy.watch_open.set()
    first = rule.wait_reached(15)
    assert first.name == name
    return name, first


def test_w19_cleanup_delete_answers_500_not_applied(window):
    """Paper (fix): 'deleted by the retry (1.0 s)'."""
    w = window()

    def trial(i: int, mark: int) -> None:
        name, first = _cancel_during_ready_with_delete_fault(w, i, mark, forward=False,
                                                             answer=500)
        wait_for(lambda: first.status == 500, 5, "the 500 answer")
        assert w.pod(name) is not None, "the failed delete was applied"
        w.wait_gone(name, 5, "by the retried delete")
        assert len(deletes(w.proxy, mark, name)) >= 2
        never_leased(w, mark, name)

    repeat(w, trial)


def test_w20_cleanup_delete_applied_but_its_reply_lost(window):
    w = window()

    def trial(i: int, mark: int) -> None:
        name, first = _cancel_during_ready_with_delete_fault(w, i, mark, answer="reset")
        wait_for(lambda: first.outcome == "reset", 5, "the reset")
        assert first.upstream == 200
        w.wait_gone(name, 5)
        # The controller's books let go of it too (no delete retried forever).
        wait_for(lambda: name not in {s["pod"] for s in w.ctl.sandboxes()}, 5,
                   "the controller to forget the deleted pod")
        never_leased(w, mark, name)

    repeat(w, trial)


def test_w21_cleanup_delete_not_applied_and_its_reply_times_out(window):
    """The delete gets no answer until the controller's client gives up (its request timeout
    is 15 s), so the trials of this window run side by side: one round of REPEATS callers."""
    w = window()
    with w.trial(0) as mark:
        rule = w.proxy.add(Fault("DELETE", POD_DELETE, forward=False, answer="drop",
                                count=REPEATS))
        w.proxy.watch_open.clear()
        callers = [Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i))) for i in range(REPEATS)]
        def stored():
            got = {r.name for r in w.proxy.since(mark, "POST", PODS) if r.status == 201}
            return got if len(got) == REPEATS else None

        names = wait_for(stored, 20, "every create stored")
        for c in callers:
            c.hang_up()
        time.sleep(CANCEL_SETTLE_S)
        w.proxy.watch_open.set()
        wait_for(lambda: rule.fired == REPEATS, 20, "every cleanup delete to be swallowed")
        assert {h.name for h in rule.hits} == names
        assert all(w.pod(n) is not None for n in names), "a swallowed delete was applied"
        wait_for(lambda: all(h.outcome == "dropped" for h in rule.hits), 30,
                   "the controller to give up on the unanswered deletes")
        for n in names:
            w.wait_gone(n, 6, "by the retried delete")
            never_leased(w, mark, n)
    w.hits = REPEATS


def test_w22_pod_fails_while_starting_and_the_cleanup_delete_answers_500(window):
    """No cancel. The pod (unschedulable, so nothing else changes it) is marked Failed; the
    caller gets a clear error with the pod's events; the first delete answers 500."""
    w = window(*UNSCHEDULABLE)

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("DELETE", POD_DELETE, forward=False, answer=500))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i), timeout_s=30))
        name = created_pod(w.proxy, mark, pred=lambda r: r.status == 201)
        w.core.patch_namespaced_pod_status(name, w.ns, {"status": {
            "phase": "Failed", "reason": "Evicted", "message": "failed by the window test"}})
        status, err = c.wait(15)
        assert status == 502 and err["error"]["type"] == "PodFailed", err
        assert name in err["error"]["message"] and "Failed" in err["error"]["message"], err
        assert err["error"]["events"], f"the error carries none of the pod's events: {err}"
        first = rule.wait_reached(10)
        assert first.name == name
        w.wait_gone(name, 5, "by the retried delete")
        assert len(deletes(w.proxy, mark, name)) >= 2

    repeat(w, trial)


def test_w23_destroy_of_a_handed_out_sandbox_answers_500(window):
    w = window()

    def trial(i: int, mark: int) -> None:
        r = w.ctl.acquire(labels=ROLLOUT, job=job(i))
        assert r.status_code == 201, r.text
        name = r.json()["pod"]
        w.proxy.add(Fault("DELETE", POD_DELETE + "", forward=False, answer=500))
        assert w.ctl.release(r.json()["id"])["released"] is True
        wait_for(lambda: any(d.status == 500 for d in deletes(w.proxy, mark, name)), 5,
                   "the failed delete")
        w.wait_gone(name, 5, "by the retried delete")

    repeat(w, trial)


def test_w24_pool_release_of_a_handed_out_pod_answers_500(window):
    """A sandbox handed out from the warm pool; its release's delete answers 500."""
    w = window()

    def trial(i: int, mark: int) -> None:
        w.ctl.prewarm(1)
        wait_for(lambda: any(s["state"] == "warm" for s in w.ctl.sandboxes()), 15,
                   "a warm pod")
        r = w.ctl.acquire(job=job(i))
        assert r.status_code == 201 and r.json()["warm"] is True, r.text
        name = r.json()["pod"]
        w.ctl.prewarm(0)
        w.proxy.add(Fault("DELETE", rf"/pods/{name}$", forward=False, answer=500))
        assert w.ctl.release(r.json()["id"])["released"] is True
        wait_for(lambda: any(d.status == 500 for d in deletes(w.proxy, mark, name)), 5,
                   "the failed delete")
        w.wait_gone(name, 5, "by the retried delete")

    repeat(w, trial)


# ---- create answered 409 ---------------------------------------------------------------------
def test_w25_another_tenants_pod_already_holds_the_name(window):
    """The create is held; meanwhile another tenant creates a pod with that very name; the
    create then gets the API server's real 409. That pod is never read-back-deleted or
    patched; the caller gets a sandbox under a new name."""
    w = window()

    def trial(i: int, mark: int) -> None:
        rule = w.proxy.add(Fault("POST", PODS, hold="before"))
        c = Caller(w.ctl.port, acquire_body(ROLLOUT, job=job(i)))
        rec = rule.wait_reached()
        w.foreign_pod(rec.name)
        rule.release()
        status, res = c.wait(20)
        assert rec.upstream == 409
        assert status == 201, res
        w.hand(res)
        assert res["pod"] != rec.name

    repeat(w, trial)


# ---- the backstop ----------------------------------------------------------------------------
def test_sweep_backstop(window):
    """A sandman-labelled pod no entry owns (a leak from outside the owner tasks) is deleted
    by the sweep once older than the grace period; another tenant's pod is not."""
    w = window("--sweep-interval", "1", "--sweep-grace", "2")

    def trial(i: int, mark: int) -> None:
        name = f"sbx-leaked-{i}-{os.urandom(2).hex()}"
        w.core.create_namespaced_pod(w.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {
                "app.kubernetes.io/managed-by": "sandman-controller",
                "sandman.dev/sandbox": "true", "sandman.dev/job": job(i)}},
            "spec": {"containers": [{"name": "c", "image": "x"}],
                     "terminationGracePeriodSeconds": 0}})
        t0 = time.monotonic()
        w.wait_gone(name, 10, "by the sweep")
        assert time.monotonic() - t0 >= 1.0, "swept before its grace period"
        assert deletes(w.proxy, mark, name)

    repeat(w, trial)
