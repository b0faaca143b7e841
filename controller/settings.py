"""The controller's settings (`python3 -m controller serve` flags; docs/controller.md, Knobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.pacer import Limits
from sandman import contract
from sandman.sandbox import SandboxPolicy


@dataclass
class Settings:
    namespace: str
    limits: Limits = field(default_factory=Limits)
    ready_check: str = "execd"  # execd: Ready AND execd /health answers; pod: Ready alone (kwok)
    node_pool_label: str = f"{contract.LABEL_NODE_POOL_DEFAULT}=sandbox"
    sweep_interval: float = 30.0
    sweep_grace: float = 120.0  # an unowned pod younger than this may still be a create in flight
    default_idle_timeout: float = 300.0  # the paper's measured sweet spot for warm pods
    policy: SandboxPolicy = field(default_factory=SandboxPolicy)
    execd_port: int = contract.EXECD_PORT
    health_timeout: float = 2.0
    # An owner waits this long for Ready (+ execd /health) after its create, whatever the
    # caller's timeout_s: a pod that turns Ready just after its caller gave up is parked for the
    # next acquire of its key instead of deleted (the paper's late grading pods).
    ready_budget: float = 120.0
    api_timeout: float = 15.0  # one API call; the controller retries, never the client library
    tenants: bool = False  # --auth kubernetes: job keys are `<tenant>.<job>`, pods labelled

    def __post_init__(self) -> None:
        if self.ready_check not in ("execd", "pod"):
            raise ValueError("ready_check must be execd or pod")
        if self.node_pool_label and "=" not in self.node_pool_label:
            raise ValueError("node_pool_label must be key=value")
