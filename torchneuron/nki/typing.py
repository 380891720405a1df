"""`nki.typing` (nt): typed placeholders for timing-only runs.

`nt.tensor[[8192, 4096], nl.bfloat16]` names an HBM tensor by shape and dtype without data.
A kernel called with placeholders runs through the simulator with shapes only: every
instruction is checked, priced and scheduled, no values are computed. Used as annotations
(`x: nt.tensor[128, 512] = ...`) it is inert.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class TensorType:
    """A placeholder HBM tensor: shape and dtype, no data."""

    __slots__ = ("shape", "dtype", "buffer")

    def __init__(self, shape: tuple, dtype: Any = np.float32, buffer: str = "shared_hbm"):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.buffer = buffer

    def __repr__(self) -> str:
        return f"nt.tensor[{list(self.shape)}, {self.dtype!r}]"


class _TensorFactory:
    def __getitem__(self, key: Any) -> TensorType:
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], (list, tuple)):
            return TensorType(tuple(key[0]), key[1])
        if isinstance(key, (list, tuple)):
            shape = tuple(k for k in key if isinstance(k, int))
            dtypes = [k for k in key if not isinstance(k, int)]
            return TensorType(shape, dtypes[0] if dtypes else np.float32)
        return TensorType((int(key),))

    def __call__(self, shape: Any, dtype: Any = np.float32) -> TensorType:
        return TensorType(tuple(shape), dtype)


tensor = _TensorFactory()
scalar = float
# `nt.mutable_tensor`: an HBM argument the kernel writes in place (annotation; the simulator
# stages writes to any argument and commits them when the kernel succeeds)
mutable_tensor = tensor
