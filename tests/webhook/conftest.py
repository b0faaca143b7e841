"""Fixtures for the webhook tests: a real `python3 -m webhook serve` process over TLS on
127.0.0.1 (testbed/webhook.py), stopped by its pid when the module is done."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.webhook import Webhook, start_webhook

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def webhook_server(tmp_path_factory) -> Webhook:
    server = start_webhook(tmp_path_factory.mktemp("webhook"))
    yield server
    server.stop()
