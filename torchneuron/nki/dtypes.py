"""NKI data types and their mapping to torch storage dtypes.

NKI kernels name dtypes the numpy way (`nl.float32 is np.float32`), plus `nl.bfloat16`,
`nl.float8_e4m3`, `nl.float8_e5m2`, `nl.tfloat32` that numpy lacks. Kernels also receive
dtypes from their inputs (torch dtypes, numpy dtypes). `to_torch` maps any of those to the
torch dtype a tile is stored in; `to_nki` maps back to the object kernels compare against.
"""
from __future__ import annotations

import numpy as np
import torch

try:  # numpy bf16/fp8 dtypes, when available, so host arrays can hold them
    import ml_dtypes as _ml  # type: ignore
except ImportError:  # pragma: no cover - optional
    _ml = None


class NkiDType:
    """A hardware dtype numpy does not have. Compares equal to its torch dtype and its name."""

    __slots__ = ("name", "torch_dtype")

    def __init__(self, name: str, torch_dtype: torch.dtype):
        self.name = name
        self.torch_dtype = torch_dtype

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NkiDType):
            return other.name == self.name
        if isinstance(other, torch.dtype):
            return other == self.torch_dtype
        if isinstance(other, str):
            return other == self.name
        try:
            return np.dtype(other).name == self.name  # ml_dtypes dtypes
        except TypeError:
            return False

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def dtype(self) -> np.dtype:
        """What `np.dtype(nl.bfloat16)` sees: the ml_dtypes type when installed, else an
        opaque numpy type of the right size (enough for itemsize arithmetic)."""
        if _ml is not None:
            return np.dtype(getattr(_ml, {"float8_e4m3": "float8_e4m3fn"}.get(self.name, self.name), "float32"))
        return np.dtype((np.void, self.itemsize), metadata={"nki_dtype": self.name})

    def __repr__(self) -> str:
        return f"nl.{self.name}"


bfloat16 = NkiDType("bfloat16", torch.bfloat16)
# NKI's float8_e4m3 is stored as torch's e4m3fn (max 448; the IEEE-style e4m3 saturates at 240).
float8_e4m3 = NkiDType("float8_e4m3", torch.float8_e4m3fn)
float8_e4m3fn = NkiDType("float8_e4m3fn", torch.float8_e4m3fn)
float8_e5m2 = NkiDType("float8_e5m2", torch.float8_e5m2)
# MX packed types: four fp8 values in one 32-bit element, four fp4 values in one 16-bit element
# (stored as the raw bits; the Tensor engine's MX matmul unpacks them with their scales).
float8_e4m3fn_x4 = NkiDType("float8_e4m3fn_x4", torch.uint32)
float8_e5m2_x4 = NkiDType("float8_e5m2_x4", torch.uint32)
float4_e2m1fn_x4 = NkiDType("float4_e2m1fn_x4", torch.uint16)
# tf32 tiles are stored as fp32; the Tensor engine rounds them to 10 mantissa bits.
tfloat32 = NkiDType("tfloat32", torch.float32)

_NP_TO_TORCH = {
    np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
    np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16, np.dtype(np.uint16): torch.uint16,
    np.dtype(np.int32): torch.int32, np.dtype(np.uint32): torch.uint32,
    np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
    np.dtype(np.float64): torch.float64,
}
_TORCH_TO_NKI: dict[torch.dtype, object] = {
    torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: bfloat16,
    torch.float8_e4m3fn: float8_e4m3, torch.float8_e5m2: float8_e5m2,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.uint16: np.uint16,
    torch.int32: np.int32, torch.uint32: np.uint32, torch.int64: np.int64, torch.bool: np.bool_,
    torch.float64: np.float64,
}
_NAMES = {"float8_e4m3fn_x4": torch.uint32, "float8_e5m2_x4": torch.uint32,
          "float4_e2m1fn_x4": torch.uint16, "bfloat16": torch.bfloat16, "float8_e4m3": torch.float8_e4m3fn,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
          "tfloat32": torch.float32}
_cache: dict[object, torch.dtype] = {}

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16,
                          torch.float8_e4m3fn, torch.float8_e5m2})
# What the Tensor engine multiplies (docs: fp8 e4m3/e5m2, bf16, fp16, tf32, fp32).
MATMUL_DTYPES = FLOAT_DTYPES


def to_torch(dtype: object) -> torch.dtype:
    """Storage dtype for any dtype spelling a kernel may use."""
    try:
        return _cache[dtype]
    except (KeyError, TypeError):
        pass
    if isinstance(dtype, torch.dtype):
        out = dtype
    elif isinstance(dtype, NkiDType):
        out = dtype.torch_dtype
    elif isinstance(dtype, str) and dtype in _NAMES:
        out = _NAMES[dtype]
    else:
        nd = np.dtype(dtype)
        out = _NP_TO_TORCH.get(nd) or _NAMES.get(nd.name)
        if out is None:
            raise TypeError(f"dtype {dtype!r} is not an NKI data type")
    try:
        _cache[dtype] = out
    except TypeError:
        pass
    return out


def to_nki(tdtype: torch.dtype) -> object:
    """The dtype object kernels see on a tile (`nl.float32 is np.float32`, `nl.bfloat16`, ...)."""
    return _TORCH_TO_NKI.get(tdtype, tdtype)


def numpy_dtype(tdtype: torch.dtype):
    """numpy dtype for returning host arrays, or None when numpy cannot hold it."""
    nd = _TORCH_TO_NKI.get(tdtype)
    if isinstance(nd, NkiDType):
        if _ml is not None:
            return np.dtype(getattr(_ml, {"float8_e4m3": "float8_e4m3fn"}.get(nd.name, nd.name)))
        return None
    return np.dtype(nd) if nd is not None else None
