"""Device time of attention ops from the NKI flash-attention kernels' simulated latency.

`install()` registers `attention_seconds` with the performance model (hardware.model), so an
SDPA on `neuron` (eager and adaptive: the host runs its own flash kernel, whose numerics the
OpInfo gate checks against CPU) and the compiler's attention substitution are charged what
`flash_attention.attention_fwd` / `attention_bwd` take on the modeled NeuronCore, not a formula.

The kernels are run timing-only (typed placeholders, no data) and the result is cached per
shape, dtype and target. Long problems are not simulated whole; what is simulated and how it
is extended (assumptions):
- query tiles of a head are independent and alike (no causal mask: the op signature does
  not carry it, as the formula assumes): the latency is linear in the query length, fitted
  from runs at 1024 and 2048 queries;
- heads run one after another on the core, the next one's loads overlapping the current
  one's compute: heads x one head's latency, less (heads - 1) x the overlap measured by a
  two-head run;
- lengths round up to the kernels' 128-row tiles (the kernel would pad them).
Shapes the kernels do not take (head dim over 128, unequal q/k and v head dims, a query
head count not a multiple of the key/value heads', or a backward whose K, V, Q, dO do not fit
SBUF) return None and keep the formula's price.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..hardware import model as _model
from ..hardware.targets import Target
from ..nki import typing as nt
from . import flash_attention as fa

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FIT_QUERIES = (1024, 2048)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _round(n: int) -> int:
    return max(fa.P, -(-int(n) // fa.P) * fa.P)


def _run(target: Target, backward: bool, programs: int, sq: int, sk: int, d: int, dtype: torch.dtype) -> float:
    """Simulated latency of `programs` query heads (each with its own key/value head: a
    program's work does not depend on the GQA group, it loads its key/value head itself)."""
    q = nt.tensor[(programs, sq, d), dtype]
    k = nt.tensor[(programs, sk, d), dtype]
    scale = d ** -0.5
    if backward:
        args = (q, k, k, q, q, nt.tensor[(programs, sq, 1), torch.float32])
        _, stats = fa.attention_bwd[programs].run(args, {"scale": scale}, target=target)
    else:
        _, stats = fa.attention_fwd[programs].run((q, k, k), {"scale": scale}, target=target)
    return stats.latency_s


@functools.lru_cache(maxsize=256)
def kernel_seconds(target: Target, backward: bool, heads: int, sq: int, sk: int, d: int,
                   dtype: torch.dtype) -> float:
    """Modeled latency of the forward or backward kernel over `heads` query heads of `sq`
    queries and `sk` keys (multiples of 128), extended from short runs (module doc)."""
    s1 = min(sq, _FIT_QUERIES[0])
    single = _run(target, backward, 1, s1, sk, d, dtype)
    per_head = single
    if sq > s1:
        s2 = min(sq, _FIT_QUERIES[1])
        per_query = (_run(target, backward, 1, s2, sk, d, dtype) - single) / (s2 - s1)
        per_head = single + per_query * (sq - s1)
    if heads == 1:
        return per_head
    overlap = max(0.0, 2 * single - _run(target, backward, 2, s1, sk, d, dtype))
    return heads * per_head - (heads - 1) * overlap


def attention_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The performance model's pricer for the attention category (see the module doc)."""
    backward = "backward" in name
    qkv = ins[1:4] if backward else ins[:3]
    if len(qkv) < 3 or any(len(shape) < 2 for _, shape in qkv):
        return None
    (dtype, q), (kdt, k), (_, v) = qkv
    if dtype not in _DTYPES or kdt != dtype:
        return None
    d, dv = int(q[-1]), int(v[-1])
    heads, kv_heads = _numel(q[:-2]), _numel(k[:-2])
    if d != dv or d > fa.P or int(k[-1]) != d or not kv_heads or heads % kv_heads:
        return None
    sq, sk = _round(q[-2]), _round(k[-2])
    try:
        return kernel_seconds(target, backward, heads, sq, sk, d, dtype)
    except ValueError:  # a shape the kernel refuses (e.g. backward operands over SBUF)
        return None


def install() -> None:
    """Price attention ops by the NKI kernels (called once when torchneuron is imported)."""
    _model.register_kernel_pricer("attention", attention_seconds)


__all__ = ["attention_seconds", "install", "kernel_seconds"]
