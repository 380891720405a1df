"""`nki.isa.constants`: the enumerations ISA calls take as modes.

Owns `reduce_cmd`, `matmul_perf_mode`, `dge_mode` (which descriptor generator a DMA uses) and
`oob_mode` (what an indirect DMA does with an out-of-range index). `nki.isa` re-exports them,
so `nisa.dge_mode.hwdge` and `from nki.isa.constants import oob_mode` name the same object.
"""
from __future__ import annotations

import enum


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = 0
    double_row = 1
    double_row_gen3 = 2


class dge_mode(enum.Enum):  # noqa: N801
    """Descriptor generation: `none` (precomputed descriptors), `swdge` (software, on the
    GpSimd engine), `hwdge` (the DMA engine's hardware generator), `unknown` (compiler's pick)."""
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    """Indirect DMA with an index past the tensor: `error` raises, `skip` leaves that row."""
    error = 0
    skip = 1
