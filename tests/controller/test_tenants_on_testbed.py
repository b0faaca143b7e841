"""Tenants and roles in the pacer, through the controller's API on the test bed: two tenants
(real ServiceAccounts, tokens and RBAC, `--auth kubernetes` over https, as in test_auth.py)
pacing at 20 creates/s with no burst. A tenant that spreads its acquires over many job names
gets no more of the rate than one that uses one; a grading acquire does not wait behind queued
rollouts. Waits are the controller's own `timings.queued_ms` (the pacing queue alone)."""

from __future__ import annotations

import asyncio
import ssl
import statistics

import httpx
import pytest

from sandman import api
from testbed.controller import local_tls_dir
from tests.controller.test_auth import IMAGE, bearer

pytestmark = pytest.mark.timing

RATE = 20


async def _fire(url: str, token: str, bodies: list[dict], delay_s: float = 0.0) -> list[dict]:
    """POST each acquire at once (after `delay_s`); the answers, each a 201's body."""
    await asyncio.sleep(delay_s)
    ctx = ssl.create_default_context(cafile=str(local_tls_dir() / "ca.crt"))
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits, verify=ctx,
                                 headers=bearer(token)) as cl:
        async def one(body):
            r = await cl.post(url + api.ACQUIRE.path, json={
                "image": IMAGE, "cpu": "100m", "memory": "128Mi", "timeout_s": 240, **body})
            assert r.status_code == 201, r.text
            return r.json()

        return await asyncio.gather(*(one(b) for b in bodies))


def _queued_s(answers: list[dict]) -> list[float]:
    return [a["timings"]["queued_ms"] / 1000 for a in answers]


async def _release(url: str, token: str, answers: list[dict]) -> None:
    ctx = ssl.create_default_context(cafile=str(local_tls_dir() / "ca.crt"))
    async with httpx.AsyncClient(timeout=60, verify=ctx, headers=bearer(token)) as cl:
        await asyncio.gather(*(cl.delete(url + api.RELEASE.url(id=a["id"]))
                               for a in answers))


def _two_tenants(tenants):
    out = []
    for prefix in ("ta", "tb"):
        ns = tenants.namespace(prefix)
        tenants.account(ns, "trainer")
        tenants.bind(ns, ns, "trainer")
        out.append((ns, tenants.token(ns, "trainer")))
    return out


def test_a_tenant_spreading_its_acquires_over_50_jobs_does_not_crowd_out_another(
        tenants, authctl, figures):
    (_, tok_a), (_, tok_b) = _two_tenants(tenants)
    ctl = authctl("--rate", str(RATE), "--burst", "1", "--max-creating", "1000")
    b_bodies = [{"job": "eval"}] * 20

    alone = asyncio.run(_fire(ctl.url, tok_b, b_bodies))
    asyncio.run(_release(ctl.url, tok_b, alone))

    async def crowded():
        return await asyncio.gather(
            _fire(ctl.url, tok_a, [{"job": f"roll-{i % 50}"} for i in range(500)]),
            _fire(ctl.url, tok_b, b_bodies, delay_s=1.0))

    a_answers, b_answers = asyncio.run(crowded())
    p50_alone = statistics.median(_queued_s(alone))
    p50_crowded = statistics.median(_queued_s(b_answers))
    figures.add(f"tenants: B's 20 acquires queued p50 {p50_alone:.2f} s alone, "
                f"{p50_crowded:.2f} s beside A's 500 over 50 jobs ({RATE}/s, burst 1)")
    # A fair two-way split is about 2x B alone; a round robin by job gave B 1 slot in 51.
    assert p50_crowded <= 3 * max(p50_alone, 1 / RATE), (p50_alone, p50_crowded)
    asyncio.run(_release(ctl.url, tok_a, a_answers))
    asyncio.run(_release(ctl.url, tok_b, b_answers))


def test_a_grading_acquire_is_served_within_2_s_of_capacity_behind_200_rollouts(
        tenants, authctl, figures):
    (_, tok_a), (_, tok_b) = _two_tenants(tenants)
    ctl = authctl("--rate", str(RATE), "--burst", "1", "--max-creating", "1000")

    async def main():
        return await asyncio.gather(
            _fire(ctl.url, tok_a, [{"job": f"roll-{i % 8}"} for i in range(200)]),
            _fire(ctl.url, tok_b, [{"job": "grade", "role": "grading"}], delay_s=1.0))

    rollouts, (grading,) = asyncio.run(main())
    waited = grading["timings"]["queued_ms"] / 1000
    behind = sum(1 for a in rollouts if a["timings"]["queued_ms"] / 1000 > 1.0 + waited)
    figures.add(f"roles: a grading acquire queued {waited:.2f} s behind {behind} rollouts "
                f"still waiting ({RATE}/s)")
    assert behind >= 100, behind  # the rollouts really were queued ahead of it
    assert waited <= 2.0, waited
    asyncio.run(_release(ctl.url, tok_a, rollouts))
    asyncio.run(_release(ctl.url, tok_b, [grading]))
