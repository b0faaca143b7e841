"""Declared run conditions (docs/controller.md, "Declared conditions"): before a sandbox is
handed out, execd's `/conditions` is read inside the pod (with the sandbox token the
controller holds) and compared with what the acquire declared. A pod that contradicts any
readable field is refused: deleted, counted, an event recorded, and the acquire tries another
pod. A field the pod cannot read never refuses; it is returned as `unverified`.

`compare` is pure (unit-tested); `Checker.check` does the probe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from controller.execd_client import ExecdClient
from sandman import api, contract, egress
from sandman.execd_api import EnvRequest
from sandman.quantity import parse_quantity

log = logging.getLogger("controller")

UNLIMITED = "unlimited"
# Kubernetes writes the limit in bytes; the kernel rounds memory.max down to a page.
MEMORY_SLACK = 64 * 1024
_UTC = {"UTC", "Etc/UTC", "UCT", "Etc/UCT", "Universal", "Etc/Universal", "Zulu", "Etc/Zulu",
        "GMT", "Etc/GMT", "GMT0", "Etc/GMT0", "GMT+0", "Etc/GMT+0", "GMT-0", "Etc/GMT-0",
        "Greenwich", "Etc/Greenwich", "UTC0"}


@dataclass
class Comparison:
    """The declared conditions against what the pod read (`compare`); its `answer()` is the
    acquire's api.ConditionsCheck."""

    verified: dict[str, Any] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)
    contradicted: list[tuple[str, Any, Any]] = field(default_factory=list)  # field, want, read

    @property
    def ok(self) -> bool:
        return not self.contradicted

    def message(self) -> str:
        return "; ".join(f"{f}: declared {want!r}, the pod reads {got!r}"
                         for f, want, got in self.contradicted)

    def answer(self) -> dict:
        """The Lease's `conditions`."""
        return {"verified": dict(self.verified), "unverified": list(self.unverified)}


def _num(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float)


def readings(c: dict) -> dict[str, Any]:
    """execd's /conditions answer -> one reading per declarable field; None: unreadable."""
    r: dict[str, Any] = dict.fromkeys(api.CONDITION_FIELDS)
    if _num(c.get("cpu_cores")):
        r["cpu_quota"] = float(c["cpu_cores"])
    elif _num(c.get("cpu_quota_us")) and _num(c.get("cpu_period_us")) and c["cpu_period_us"]:
        r["cpu_quota"] = c["cpu_quota_us"] / c["cpu_period_us"]
    elif c.get("cpu_unlimited") is True:
        r["cpu_quota"] = UNLIMITED
    if _num(c.get("visible_cpu_count")):
        r["visible_cpus"] = int(c["visible_cpu_count"])
    if _num(c.get("memory_limit_bytes")):
        r["memory_limit"] = int(c["memory_limit_bytes"])
    elif c.get("memory_unlimited") is True:
        r["memory_limit"] = UNLIMITED
    if _num(c.get("uid")):
        r["user"] = {"uid": int(c["uid"]), "name": c.get("user")
                     if isinstance(c.get("user"), str) else None}
    if isinstance(c.get("tz"), str):
        r["tz"] = c["tz"]
    if "pythonhashseed" in c:  # absent from the shell's environment: Python picks randomly
        seed = c["pythonhashseed"]
        r["hash_seed"] = "random" if seed in (None, "", "random") else str(seed)
    probe = c.get("egress")
    probe = probe if isinstance(probe, dict) else {}
    opened = probe.get("open") is True
    if opened:
        r["egress"] = "allow"  # an outbound connection was made: whatever the guard says
    elif c.get("netguard_mode") in api.EGRESS_VALUES:
        r["egress"] = c["netguard_mode"]
    applied = c.get("netguard_allow_egress")
    if c.get("netguard_mode") == contract.EGRESS_ALLOW:  # no allowlist: everything goes out
        applied = f"egress {contract.EGRESS_ALLOW}"
    elif c.get("netguard_mode") == contract.EGRESS_DENY and isinstance(applied, list):
        applied = _canonical(applied)
    else:
        applied = None
    if applied is not None:
        r["egress_allow"] = {"applied": applied,
                             "probe": probe.get("target") if opened else None}
    return r


def _canonical(entries: list) -> list[str] | str:
    """netguard's recorded entries in canonical form; as recorded when they do not parse
    (then they can never equal a declared list)."""
    try:
        return egress.render(egress.parse_list(entries)).split(",") if entries else []
    except ValueError:
        return ",".join(str(x) for x in entries)


def _tz(z: str) -> str:
    z = z[1:] if z.startswith(":") else z
    z = z.split("/", 1)[1] if z.startswith(("posix/", "right/")) else z
    return "UTC" if z in _UTC else z


def _memory_bytes(q: str) -> int:
    return int(parse_quantity(q))


def _matches(name: str, want: Any, got: Any) -> bool | None:
    """True/False, or None when the reading cannot answer (unverified)."""
    if name == "cpu_quota":
        if got == UNLIMITED:
            return False
        return abs(got - float(want)) <= max(0.01, 0.005 * float(want))
    if name == "visible_cpus":
        return got == want
    if name == "memory_limit":
        if got == UNLIMITED:
            return False
        return abs(got - _memory_bytes(want)) < MEMORY_SLACK
    if name == "user":
        if want.isdigit():
            return got["uid"] == int(want)
        return None if got["name"] is None else got["name"] == want
    if name == "tz":
        return _tz(got) == _tz(want)
    if name in ("hash_seed", "egress"):
        return got == want
    if name == "egress_allow":
        # The list netguard applied, exactly; and the egress probe's address (never one an
        # allowlist names) must stay unreachable.
        return got["applied"] == list(want) and got["probe"] is None
    return None


def _shown(name: str, got: Any) -> Any:
    if name == "user":
        return got["name"] if got["name"] is not None else got["uid"]
    if name == "egress_allow":
        return (got["applied"] if got["probe"] is None
                else f"{got['applied']} and the egress probe {got['probe']} reachable")
    return got


def compare(declared: dict[str, Any], answer: dict) -> Comparison:
    """Each declared field against the pod's reading (execd's /conditions answer)."""
    got = readings(answer)
    v = Comparison()
    for name in api.CONDITION_FIELDS:
        if name not in declared or declared[name] is None:
            continue
        want, r = declared[name], got.get(name)
        ok = None if r is None else _matches(name, want, r)
        if ok is None:
            v.unverified.append(name)
        elif ok:
            v.verified[name] = _shown(name, r)
        else:
            v.contradicted.append((name, want, _shown(name, r)))
    return v


class Checker:
    """Reads /conditions from a pod's execd with the sandbox's token."""

    def __init__(self, port: int, timeout: float, egress_probe: str | None = None):
        self.port = port
        self.egress_probe = egress_probe  # host:port a pod with egress reaches (optional)
        # execd's own egress probe waits up to 2 s: the read waits longer.
        self._execd = ExecdClient(port, timeout + 2.0)

    async def close(self) -> None:
        await self._execd.aclose()

    async def read(self, ip: str, token: str, declared: dict[str, Any]) -> dict:
        """The pod's answer; raises on any failure (the caller refuses the pod: fail closed).
        A declared hash seed is applied first (execd /env: the shell and every later shell),
        then read back like the rest: no image sets PYTHONHASHSEED, so refusing pods for it
        would refuse them all."""
        seed = declared.get("hash_seed")
        if seed is not None:
            await self._execd.set_env(ip, token, EnvRequest(unset=["PYTHONHASHSEED"])
                                      if seed == "random"
                                      else EnvRequest(set={"PYTHONHASHSEED": str(seed)}))
        probe = self.egress_probe if ("egress" in declared or "egress_allow" in declared) else None
        return await self._execd.conditions(ip, token, probe)

    async def check(self, ip: str, token: str, declared: dict[str, Any]) -> Comparison:
        """The verdict; a pod whose probe fails gets a `probe` contradiction."""
        try:
            answer = await self.read(ip, token, declared)
        except Exception as ex:  # noqa: BLE001 - any failure refuses the pod
            return Comparison(contradicted=[("probe", "an answer", f"no answer: {ex}")])
        return compare(declared, answer)
