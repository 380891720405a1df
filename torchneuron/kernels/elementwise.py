"""Element-wise NKI kernels: tensor addition, looped on one program or split over an SPMD grid."""
from __future__ import annotations

from .. import nki
from ..nki import language as nl

P = nl.tile_size.pmax
F = 512


@nki.jit
def tensor_add(a, b):
    """a + b for [R, C] tensors; rows in 128-partition tiles (masked tail), columns in 512s."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    rows, cols = a.shape
    for r in nl.affine_range((rows + P - 1) // P):
        for c in nl.affine_range((cols + F - 1) // F):
            ip = r * P + nl.arange(P)[:, None]
            jf = c * F + nl.arange(F)[None, :]
            inside = (ip < rows) & (jf < cols)
            x = nl.load(a[ip, jf], mask=inside)
            y = nl.load(b[ip, jf], mask=inside)
            nl.store(out[ip, jf], value=nl.add(x, y, mask=inside), mask=inside)
    return out


@nki.jit
def tensor_add_spmd(a, b):
    """One [128, 512] tile per program: launch as tensor_add_spmd[R // 128, C // 512](a, b)."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    ip = nl.program_id(0) * P + nl.arange(P)[:, None]
    jf = nl.program_id(1) * F + nl.arange(F)[None, :]
    nl.store(out[ip, jf], value=nl.load(a[ip, jf]) + nl.load(b[ip, jf]))
    return out


def tensor_add_grid(a, b):
    """Launch tensor_add_spmd over the grid that covers a (sizes multiple of 128 x 512)."""
    return tensor_add_spmd[a.shape[0] // P, a.shape[1] // F](a, b)
