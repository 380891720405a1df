"""torchneuron.hardware: targets (specs), the performance model, the device timeline.

The lowest layer beside runtime: pure Python (torch for dtypes, numpy), importing nothing
from other torchneuron folders. See targets.py (the machines), instructions.py (one NKI
instruction), model.py (one aten op, copy or collective), timeline.py (per-device stream
clocks) and estimate.py (the `estimate()` context manager).
"""

from .targets import TARGETS, Target, UnsupportedDtypeError, get_target, on_target_change, set_target

__all__ = ["TARGETS", "Target", "UnsupportedDtypeError", "get_target", "on_target_change", "set_target"]
