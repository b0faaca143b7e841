"""A pytest plugin the grader ships into a grading pod (as this file's bytes) to record the
official test ids on the base: the node ids of the items pytest collected, as JSON, to the
file named by $SANDMAN_GRADING_IDS. It runs on the base only, before any patch is applied."""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_collection_finish(session: Any) -> None:
    with open(os.environ["SANDMAN_GRADING_IDS"], "w", encoding="utf-8") as f:
        json.dump([item.nodeid for item in session.items], f)
