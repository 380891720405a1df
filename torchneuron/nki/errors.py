"""Errors raised by the NKI simulator.

Owns the exception hierarchy and the lookup of the kernel source line an error belongs
to. Every error a kernel author can cause names the hardware rule it broke and the
kernel's file and line, the way the Neuron compiler reports them.
"""
from __future__ import annotations

import os
import sys
import types

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_KERNELS_OK = os.path.join(os.path.dirname(_PKG_DIR), "kernels")


class NKIError(Exception):
    """Base class: a kernel broke an NKI rule. `rule` names the rule, `location` the source line."""

    rule = "nki"

    def __init__(self, message: str, *, rule: str | None = None, location: str | None = None):
        if rule is not None:
            self.rule = rule
        self.location = location if location is not None else user_location()
        self.detail = message
        where = f" (at {self.location})" if self.location else ""
        super().__init__(f"[{self.rule}] {message}{where}")


class PartitionDimError(NKIError):
    rule = "partition-dim"


class CapacityError(NKIError):
    rule = "sbuf-capacity"


class OutOfBoundsError(NKIError):
    rule = "out-of-bounds"


class ShapeError(NKIError):
    rule = "tile-shape"


class EngineRuleError(NKIError):
    rule = "engine-buffer"


class DTypeError(NKIError):
    rule = "dtype"


class CollectiveError(NKIError):
    """Ranks disagree on a collective (deadlock, different calls) or its arguments are wrong."""

    rule = "collective"


class KernelError(NKIError):
    """The kernel's own Python code raised; the original exception is the __cause__."""

    rule = "kernel-raised"


def _is_internal(filename: str) -> bool:
    return filename.startswith(_PKG_DIR) or "/torch/" in filename or "/numpy/" in filename


def user_location(frame: types.FrameType | None = None) -> str:
    """`file:line in function` of the innermost frame outside this package (the kernel's line)."""
    f = frame or sys._getframe(1)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return ""
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def traceback_location(tb: types.TracebackType | None) -> str:
    """The innermost traceback entry outside this package, as `file:line in function`."""
    last = ""
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not _is_internal(fn):
            last = f"{fn}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return last
