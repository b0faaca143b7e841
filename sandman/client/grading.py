"""Grading in the SDK (docs/grading.md): capture an agent's patch, grade it on a never-used
grading pod, preflight a task set.

    from sandman.client import Client
    from sandman.client.grading import Task, capture_patch, grade, preflight

    patch, excluded = capture_patch(agent_sandbox, task.base_commit, repo=task.repo)
    pre = preflight(client, tasks)          # reference passes, empty fails, twice
    pre.record.save("preflight.json")       # pin pre.record.sha256 in the job's config
    record = PreflightRecord.load("preflight.json", PINNED_SHA256)
    result = grade(client, task, patch, record=record)  # passed | failed | no_verdict

`acapture_patch`, `agrade` and `apreflight` are the asyncio twins (with an AsyncClient /
AsyncSandbox). `passed`/`failed` are verdicts on the patch; `no_verdict` means resample:
an infrastructure failure is retried and never scored 0.
"""

from sandman.client._async.grading import capture_patch as acapture_patch
from sandman.client._async.grading import grade as agrade
from sandman.client._async.grading import preflight as apreflight
from sandman.client._grading import (
    DEFAULT_EXCLUDE,
    NO_EXCLUDE,
    CapturedPatch,
    Excluded,
    Exclusions,
    GradeResult,
    PreflightRecord,
    PreflightResult,
    Task,
    TaskRecord,
    TaskRefused,
    Verdict,
    judge,
    scan_patch,
)
from sandman.client._sync.grading import (
    GRADING_ROLE,
    SHADOW_SHARE,
    capture_patch,
    grade,
    preflight,
)

__all__ = [
    "DEFAULT_EXCLUDE", "GRADING_ROLE", "NO_EXCLUDE", "CapturedPatch", "Excluded", "Exclusions",
    "GradeResult", "PreflightRecord", "PreflightResult", "SHADOW_SHARE", "Task", "TaskRecord",
    "TaskRefused", "Verdict", "acapture_patch", "agrade",
    "apreflight", "capture_patch", "grade", "judge", "preflight", "scan_patch",
]
