"""Cross-rank consistency checks and clear errors for the neuron backend.

Gloo aborts the whole process when a peer sends more bytes than a collective expects, so a shape
mismatch between ranks must be caught before any payload moves. Before each collective every rank
contributes a small fixed-size row (which collective, dtype, element counts, root, reduce op, per-peer
split sizes) to one all-gather; every rank then sees every rank's call and all raise the same
`CollectiveMismatchError` when they disagree. TORCHNEURON_DIST_CHECKS=0 skips the check (one small
all-gather per collective) for speed. `translate()` turns transport failures (a peer that died, a
timeout) into errors that name the cause and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from torchneuron import settings

KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "gather", "scatter",
         "reduce_scatter", "reduce_scatter_single", "all_to_all", "barrier")
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64, torch.bool, torch.complex64,
           torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
_MAGIC = 0x4E455552  # "NEUR"
_HEADER = ("magic", "seq", "kind", "dtype", "numel_in", "numel_out", "root", "reduce", "count")


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with arguments that do not match (or called different collectives)."""


def checks_enabled() -> bool:
    return settings.current().dist_checks


@dataclass
class Signature:
    """What one rank passes to a collective, in elements. `in_splits[j]`: elements sent to peer j;
    `out_splits[j]`: elements expected from peer j (only where a collective has per-peer sizes)."""

    kind: str
    dtype: torch.dtype | None = None
    numel_in: int = 0
    numel_out: int = 0
    root: int = -1
    reduce: int = -1
    count: int = 1
    in_splits: Sequence[int] = field(default_factory=tuple)
    out_splits: Sequence[int] = field(default_factory=tuple)

    def row(self, seq: int, world: int) -> torch.Tensor:
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else -1
        head = [_MAGIC, seq, KINDS.index(self.kind), dtype, self.numel_in, self.numel_out, self.root, self.reduce,
                self.count]
        splits = [list(self.in_splits) + [0] * (world - len(self.in_splits)),
                  list(self.out_splits) + [0] * (world - len(self.out_splits))]
        return torch.tensor(head + splits[0] + splits[1], dtype=torch.int64)


def exchange(signature: Signature, gloo: dist.ProcessGroup, seq: int, world: int) -> torch.Tensor:
    """All-gathers every rank's signature row: a [world, len(row)] int64 tensor."""
    row = signature.row(seq, world)
    rows = torch.empty(world * row.numel(), dtype=torch.int64)
    gloo._allgather_base(rows, row).wait()
    return rows.view(world, -1)


def _describe(r: torch.Tensor, world: int) -> str:
    kind = KINDS[int(r[2])] if 0 <= int(r[2]) < len(KINDS) else f"unknown({int(r[2])})"
    dtype = _DTYPES[int(r[3])] if 0 <= int(r[3]) < len(_DTYPES) else None
    text = f"{kind}(#{int(r[1])}"
    if kind != "barrier":
        text += f", {str(dtype).replace('torch.', '')}, {int(r[4])} elements in, {int(r[5])} out"
    if int(r[6]) >= 0:
        text += f", root {int(r[6])}"
    if kind == "all_to_all":
        splits = r[len(_HEADER):].view(2, world).tolist()
        text += f", sends {splits[0]}, expects {splits[1]}"
    return text + ")"


def verify(rows: torch.Tensor, group: str) -> None:
    """Raises CollectiveMismatchError (on every rank alike) unless all ranks' calls agree."""
    world = rows.shape[0]
    head = rows[:, :len(_HEADER)]
    ins, outs = rows[:, len(_HEADER):len(_HEADER) + world], rows[:, len(_HEADER) + world:]
    calls = "; ".join(f"rank {i}: {_describe(rows[i], world)}" for i in range(world))

    def fail(problem: str) -> None:
        raise CollectiveMismatchError(
            f"neuron backend, group {group!r}: {problem}. Every rank must call the same collectives in the same "
            f"order with matching tensors. Calls seen: {calls}")

    if not bool((head[:, 0] == _MAGIC).all()):
        fail("a rank sent a corrupt collective header (mixed torchneuron versions?)")
    for column, what in ((2, "different collectives"), (1, "collectives out of order"), (3, "different dtypes"),
                         (6, "different roots"), (7, "different reduce ops"), (8, "different numbers of tensors")):
        if not bool((head[:, column] == head[0, column]).all()):
            fail(f"ranks called {what}")
    kind = KINDS[int(head[0, 2])]
    numel_in, numel_out = head[:, 4], head[:, 5]
    same_in = bool((numel_in == numel_in[0]).all())
    if kind in ("all_reduce", "broadcast", "reduce", "all_gather_single", "reduce_scatter_single") and not same_in:
        fail("input sizes differ across ranks")
    if kind == "all_gather_single" and not bool((numel_out == world * numel_in).all()):
        fail("an output is not world_size times the input")
    if kind == "reduce_scatter_single" and not bool((numel_in == world * numel_out).all()):
        fail("an input is not world_size times the output")
    if kind == "all_gather" and not bool((outs == numel_in.unsqueeze(0)).all()):
        fail("an output list entry does not match the size of the peer's input")
    if kind == "reduce_scatter" and not (bool((ins == ins[0]).all()) and bool((ins[0] == numel_out).all())):
        fail("input list entries do not match the peers' output sizes")
    if kind == "all_to_all" and not bool((ins == outs.t()).all()):
        fail("split sizes do not match: what rank i sends to rank j must equal what rank j expects from rank i")
    root = int(head[0, 6])
    if kind == "gather" and (not same_in or not bool((outs[root] == numel_in).all())):
        fail("gather inputs differ in size or do not match the root's output list")
    if kind == "scatter" and not bool((ins[root] == numel_out).all()):
        fail("the root's scatter list does not match the outputs")


def check(signature: Signature, gloo: dist.ProcessGroup, seq: int, world: int, group: str) -> None:
    """Exchanges signatures and verifies them (a no-op when TORCHNEURON_DIST_CHECKS=0)."""
    if world > 1 and checks_enabled():
        verify(exchange(signature, gloo, seq, world), group)


_PEER_GONE = ("Connection reset", "Connection closed", "Broken pipe", "Connection refused", "closed by peer",
              "EOF", "Socket closed")


def translate(error: BaseException, kind: str, group: str, rank: int, world: int, timeout_s: float) -> BaseException:
    """A DistBackendError naming the cause of a transport failure (or the error itself if not one)."""
    if isinstance(error, (CollectiveMismatchError, TypeError, ValueError)):
        return error
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = f"neuron backend: {kind} on group {group!r} (rank {rank} of {world})"
    if any(marker in text for marker in _PEER_GONE):
        return dist.DistBackendError(
            f"{where} failed because a peer rank closed its connection: that rank most likely exited or crashed "
            f"(check its log); the job cannot continue. [{text}]")
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return dist.DistBackendError(
            f"{where} timed out after {timeout_s:.0f} s waiting for peer ranks: a rank is hung, slower than the "
            f"timeout, or called a different collective. Raise it with init_process_group(timeout=...). [{text}]")
    return dist.DistBackendError(f"{where} failed: {text}")
