"""Mixture-of-experts kernels in NKI: the router's top-K and the blockwise grouped matmul.

- `router_topk(x [T, H], w [H, E], k)`: logits x w on the Tensor engine, softmax over the E
  experts, the k largest (`max8`, `nc_find_index8`; k <= 8, 8 <= E <= 512), renormalised to
  sum 1. Returns (weights [T, k] fp32, experts [T, k] int32). T a multiple of 128, H of 128.
- `grouped_matmul(x [NB * BT, K], w [E, K, N], block_expert [NB, 1])`: tokens come grouped in
  NB blocks of BT = 512 rows, block b multiplied by expert block_expert[b]'s weights (read at
  run time: a dynamic DMA offset). Per block, each [128, 512] weight tile is loaded once and
  used by the block's four 128-token tiles, so the Tensor engine, not HBM, bounds the kernel;
  PSUM results are copied out by the Vector and Scalar engines in turn. K, N multiples of
  128 and 512.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = 128
BT = 512       # tokens per block
NT = 512       # output columns per PSUM tile


def _router_shapes(x, w, k: int) -> tuple[int, int, int]:
    """(T, H, E) of router_topk's operands, or the ValueError naming what the kernel takes."""
    t, h = x.shape
    e = w.shape[1]
    if t % P or h % P or not 8 <= e <= 512 or not 1 <= k <= 8:
        raise ValueError(f"router_topk: need T, H multiples of {P}, 8 <= E <= 512, 1 <= k <= 8; "
                         f"got T={t}, H={h}, E={e}, k={k}")
    return t, h, e


def _grouped_shapes(x, w, block_expert) -> tuple[int, int, int, int]:
    """(rows, K, N, NB) of grouped_matmul's operands, or the ValueError naming what the kernel takes."""
    rows, kdim = x.shape
    _, kw, n = w.shape
    nb = block_expert.shape[0]
    if kw != kdim or rows != nb * BT or kdim % P or n % NT:
        raise ValueError(f"grouped_matmul: need x [NB * {BT}, K], w [E, K, N] (K % {P} == 0, N % {NT} == 0) "
                         f"and block_expert [NB, 1]; got x {tuple(x.shape)}, w {tuple(w.shape)}, NB={nb}")
    return rows, kdim, n, nb


@nki.jit
def router_topk(x, w, k: int = 2):
    t, h, e = _router_shapes(x, w, k)
    weights = nl.ndarray((t, k), dtype=nl.float32, buffer=nl.shared_hbm)
    experts = nl.ndarray((t, k), dtype=nl.int32, buffer=nl.shared_hbm)
    w_sb = nl.ndarray((P, h // P, e), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w.ap([[e, P], [P * e, h // P], [1, e]]))
    for ti in range(t // P):
        x_t = nl.ndarray((P, h // P, P), dtype=x.dtype, buffer=nl.sbuf)
        for c in range(h // P):
            nisa.dma_transpose(dst=x_t[:, c, :], src=x[ti * P:(ti + 1) * P, c * P:(c + 1) * P])
        logits = nl.ndarray((P, e), dtype=nl.float32, buffer=nl.psum)
        for c in range(h // P):
            nisa.nc_matmul(dst=logits, stationary=x_t[:, c, :], moving=w_sb[:, c, :])
        top = nl.ndarray((P, 8), dtype=nl.float32, buffer=nl.sbuf)
        scores = nl.ndarray((P, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=scores, src=logits)
        nisa.max8(dst=top, src=scores)
        idx = nl.ndarray((P, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=scores, vals=top)
        # softmax over all experts, then the chosen ones renormalised: exp(l - max) / sum_k
        neg = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg, data=top[:, 0:1], op0=nl.multiply, operand0=-1.0)
        probs = nl.ndarray((P, k), dtype=nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=probs, op=nl.exp, data=top[:, 0:k], bias=neg, reduce_res=total, reduce_op=nl.add)
        inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=total)
        nisa.tensor_scalar(dst=probs, data=probs, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=weights[ti * P:(ti + 1) * P, :], src=probs)
        ids = nl.ndarray((P, k), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ids, src=idx[:, 0:k])
        nisa.dma_copy(dst=experts[ti * P:(ti + 1) * P, :], src=ids)
    return weights, experts


@nki.jit
def grouped_matmul(x, w, block_expert):
    rows, kdim, n, nb = _grouped_shapes(x, w, block_expert)
    out = nl.ndarray((rows, n), dtype=x.dtype, buffer=nl.shared_hbm)
    ids = nl.ndarray((1, nb), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=block_expert.ap([[0, 1], [1, nb]]))
    sub = BT // P
    flip = 0
    for b in range(nb):
        # the block's tokens transposed: [128 of K, K/128, 512 tokens]
        x_t = nl.ndarray((P, kdim // P, BT), dtype=x.dtype, buffer=nl.sbuf)
        for c in range(kdim // P):
            nisa.dma_transpose(dst=x_t[:, c, :], src=x[b * BT:(b + 1) * BT, c * P:(c + 1) * P])
        expert = ids[0:1, b:b + 1]
        for j in range(n // NT):
            acc = [nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.psum) for _ in range(sub)]
            for c in range(kdim // P):
                w_t = nl.ndarray((P, NT), dtype=w.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=w_t, src=w.ap([[n, P], [1, NT]], offset=c * P * n + j * NT,
                                                scalar_offset=expert, indirect_dim=0))
                for s in range(sub):
                    nisa.nc_matmul(dst=acc[s], stationary=x_t[:, c, s * P:(s + 1) * P], moving=w_t)
            for s in range(sub):
                o_sb = nl.ndarray((P, NT), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=o_sb, src=acc[s], engine=nisa.scalar_engine if flip % 2 else nisa.vector_engine)
                flip += 1
                nisa.dma_copy(dst=out[b * BT + s * P:b * BT + (s + 1) * P, j * NT:(j + 1) * NT], src=o_sb)
    return out


def grouped_flops(nb: int, kdim: int, n: int) -> float:
    return 2.0 * nb * BT * kdim * n


def host_router_topk(x, w, k: int = 2):
    """router_topk's result computed with torch on the host (fp32 logits and softmax)."""
    import torch
    t, h, e = _router_shapes(x, w, k)
    top, idx = torch.topk(x.float() @ w.float(), k, dim=-1)
    probs = torch.exp(top - top[:, :1])
    return probs / probs.sum(-1, keepdim=True), idx.to(torch.int32)


def host_grouped_matmul(x, w, block_expert):
    """grouped_matmul's result computed with torch on the host (fp32 accumulation)."""
    import torch
    rows, kdim, n, nb = _grouped_shapes(x, w, block_expert)
    blocks = x.float().view(nb, BT, kdim)
    return torch.bmm(blocks, w.float()[block_expert.view(-1).long()]).view(rows, n).to(x.dtype)
