"""Which SGLang instance this process belongs to; imports nothing of SGLang, so the benchmark
and test harnesses (run from pdflow's own environment) can read the names too.

One SGLang instance (its launcher and every scheduler process it spawns) is one pdflow
incarnation: the plugin sets these in the launcher, the children inherit them, so all ranks
and the bootstrap server report the same life and a restart is a new one.
"""

from __future__ import annotations

import os
import secrets
import time

INCARNATION_ENV = "PDFLOW_SGLANG_INCARNATION"
STARTED_AT_ENV = "PDFLOW_SGLANG_STARTED_AT"


def instance_identity() -> tuple[str, float]:
    """This SGLang instance's incarnation and start time (set once, inherited by children)."""
    if not os.environ.get(INCARNATION_ENV):
        os.environ[INCARNATION_ENV] = secrets.token_hex(8)
        os.environ[STARTED_AT_ENV] = repr(time.time())
    return os.environ[INCARNATION_ENV], float(os.environ.get(STARTED_AT_ENV) or time.time())
