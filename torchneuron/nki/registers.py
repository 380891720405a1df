"""Engine registers (`nisa.VirtualRegister`) and the ISA calls that move values through them.

Owns `VirtualRegister` and `register_alloc` / `register_load` / `register_store` /
`register_move`. A register holds one integer read from SBUF at run time; kernels use it as a
dynamic loop bound (`nl.fori_loop`, `nl.while_loop`, `nl.dynamic_range`) or a dynamic offset
(`tensor.ap(scalar_offset=reg, ...)`). The software NeuronCore knows the value when it runs
with data; a timing-only run (typed placeholders) does not, so a loop bounded by a register
needs data there and says so.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import NKIError
from .simulator import current
from .tile import Tile


class VirtualRegister:
    """One engine register: an int32 value known when the kernel runs with data."""

    __slots__ = ("value",)

    def __init__(self, value: int | None = None):
        self.value = value

    def get(self, what: str = "register") -> int:
        if self.value is None:
            raise NKIError(f"{what}: the value is read from device memory at run time; this run has "
                           "no data (typed placeholders), so it is unknown. Call the kernel with arrays",
                           rule="register")
        return self.value

    def __int__(self) -> int:
        return self.get()

    __index__ = __int__

    def __bool__(self) -> bool:  # `while reg:` (NKI's parser frontend)
        return self.get("while reg") != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


def register_value(x: Any, what: str) -> int:
    """An int bound or offset: an int, a register, or a [1, 1] tile."""
    if isinstance(x, VirtualRegister):
        return x.get(what)
    if isinstance(x, Tile):
        if current().compute is False:
            return VirtualRegister(None).get(what)
        return int(x.torch().reshape(-1)[0].item())
    return int(x)


def _charge(reads: list, writes: list) -> None:
    """A register move costs one instruction's fixed issue time (priced like a semaphore op)."""
    current().issue("sync", reads, writes, partitions=1, free_elems=1, dtype=torch.int32)


def register_alloc(init: Any = None) -> VirtualRegister:
    """A new register, optionally holding `init` (an int)."""
    return VirtualRegister(None if init is None else int(init))


def register_load(dst: VirtualRegister, src: Tile) -> VirtualRegister:
    """dst = src[0, 0] (a [1, 1] integer tile in SBUF)."""
    if not isinstance(dst, VirtualRegister) or not isinstance(src, Tile):
        raise NKIError("register_load(dst_register, src_tile): a register and a [1, 1] SBUF tile", rule="register")
    if src.numel() != 1:
        raise NKIError(f"register_load reads one value; the tile has shape {tuple(src.shape)}", rule="register")
    run = current()
    dst.value = int(src.torch().reshape(-1)[0].item()) if run.compute else None
    _charge([src], [])
    return dst


def register_store(dst: Tile, src: VirtualRegister) -> Tile:
    """dst[0, 0] = src (a [1, 1] tile in SBUF)."""
    if dst.numel() != 1:
        raise NKIError(f"register_store writes one value; the tile has shape {tuple(dst.shape)}", rule="register")
    run = current()
    if run.compute:
        dst.buf.prepare_write()
        dst.torch().fill_(src.get("register_store"))
    _charge([], [dst])
    return dst


def register_move(dst: VirtualRegister, src: Any) -> VirtualRegister:
    """dst = src (a register or an int)."""
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)
    return dst


__all__ = ["VirtualRegister", "register_alloc", "register_load", "register_store", "register_move",
           "register_value", "np"]
