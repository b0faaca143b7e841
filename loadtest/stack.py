"""Moved: the stack is testbed/stack.py, the webhook starter and `probe_pod` testbed/webhook.py.

This name is kept only because loadtest/admission_storm.py imports `probe_pod` from here;
import it from testbed.webhook and delete this file.
"""

from testbed.webhook import probe_pod

__all__ = ["probe_pod"]
