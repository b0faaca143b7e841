"""acquire_burst with a user whose task raises after each cycle: every request succeeds, so only
the task-exception threshold can fail the run (tests/loadtest/test_thresholds.py, and the
in-cluster Job in tests/e2e/test_loadtest_job.py, mounted from a ConfigMap)."""

from locust import task

from loadtest import acquire_burst
from loadtest.acquire_burst import SandmanShape  # noqa: F401 - the shape locust plays


class RaisingUser(acquire_burst.SandboxUser):
    @task
    def cycle(self) -> None:
        super().cycle()
        raise RuntimeError("task raised on purpose")
