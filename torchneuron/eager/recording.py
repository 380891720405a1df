"""Pausing the runtime's work log, for eager ops that belong to work charged another way (a
fused kernel's host code, moving a result into a buffer handed out earlier, compilation)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from torchneuron.runtime.extension import ops


@contextlib.contextmanager
def worklog_paused() -> Iterator[None]:
    """Eager ops issued inside are not recorded as device work."""
    runtime = ops()
    was_enabled = bool(runtime.worklog_enabled())
    if was_enabled:
        runtime.set_worklog_enabled(False)
    try:
        yield
    finally:
        if was_enabled:
            runtime.set_worklog_enabled(True)
