"""Prometheus metrics. Label values come from fixed allow-lists so cardinality stays bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandman import buildinfo
from sandman.podspec import RULES

OPERATIONS = ("mutate", "validate")
DECISIONS = ("allowed", "denied", "error")
# Reasons: the sandbox rules, plus why a request was admitted or failed.
REASONS = RULES + ("ok", "patched", "not-sandbox", "not-create", "bad-request", "overloaded",
                   "internal-error")


def bounded(value: str, allowed: tuple[str, ...], other: str = "other") -> str:
    return value if value in allowed else other


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sandman_webhook_requests", "Admission requests by operation, decision and reason.",
            ["operation", "decision", "reason"], registry=self.registry)
        # Buckets around the 5 s webhook timeout and the ~1 ms a handler takes.
        self.duration = Histogram(
            "sandman_webhook_handler_seconds", "Time in the admission handler.", ["operation"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry)
        self.patch_bytes = Histogram(
            "sandman_webhook_patch_bytes", "Size of the JSON patch returned by /mutate.",
            buckets=(0, 256, 1024, 2048, 4096, 8192, 16384, 65536), registry=self.registry)
        self.cert_expiry = Gauge(
            "sandman_webhook_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate in use (Unix time).", registry=self.registry)
        self.connections = Counter(
            "sandman_webhook_connections", "Client connections that sent a request (each one "
            "a TLS handshake): churn here costs CPU on both sides.", registry=self.registry)
        self.cert_reloads = Counter(
            "sandman_webhook_certificate_reloads", "Serving certificate (re)loads by result.",
            ["result"], registry=self.registry)
        self.build_info = buildinfo.register("webhook", self.registry)

    def count(self, operation: str, decision: str, reason: str) -> None:
        self.requests.labels(bounded(operation, OPERATIONS), bounded(decision, DECISIONS),
                             bounded(reason, REASONS)).inc()
