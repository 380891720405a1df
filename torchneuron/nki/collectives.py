"""`nki.collectives`: collective communication between the ranks of a kernel launch.

Follows AWS's `nki.collectives` API of Neuron 2.30-2.33 (NKI 0.3+, "relevant for Trn2,
Trn3"; docs page nki/api/nki.collectives.rst and its generated pages): `ReplicaGroup` (with
`from_partition_op` / `rg_partition_op`), `all_reduce`, `all_gather`, `reduce_scatter`,
`all_to_all`, `collective_permute`, `collective_permute_implicit`,
`collective_permute_implicit_reduce`, `collective_permute_implicit_current_processing_rank_id`,
`rank_id` and `self_index_in_replica_group`, with AWS's argument names and rules: `srcs` /
`dsts` are lists (coalesced only on HBM), tensors all on HBM or all on SBUF (all-to-all and the
explicit permute HBM only; AWS's nki-library runs the implicit ring permute on SBUF too),
reductions `nl.add` / `nl.minimum` / `nl.maximum`, `collective_dim` 0 (and
1 for a 2-D SBUF all-gather). Not provided: `all_to_all_v` (runtime-sized exchange). The same
rendezvous serves `nisa.core_barrier` across the cores of an `nl.nc(n)` grid
(`barrier_across_cores`).

Ranks. On a Trainium a rank is a (logical) NeuronCore running its own copy of the kernel
with its own inputs. Here ranks are either the programs of a launch grid (`kernel[4](...)`:
ranks 0-3, `kernel[2, 2]`: row-major; they share the arguments and `nl.shared_hbm`, select a
rank's slice with `nl.program_id` / `rank_id()`), or, as on the device, one kernel call per
rank with its own inputs and its own shared HBM: `nki.simulate_ranks(kernel, [inputs of rank
0, ...])`. Each rank runs on its own NeuronCore timeline with its own SBUF and PSUM. Not
modeled: a grid inside each rank (AWS's LNC=2 programs of one logical core). How ranks wait
for each other is programs.py's.

Numerics: a reduction runs in fp32 (int32 data in int64) over the ranks in rank-list order and
rounds once to the destination dtype. Assumption: AWS does not document the collective
engine's accumulation precision; fp32 with one rounding is the numpy reference the tests use.
Reductions take fp32, bf16, fp16 and int32 data (the types AWS's examples use); data movement
(gather, all-to-all, permute) takes any dtype. Source and destination dtypes must match (a
collective moves bytes; it does not cast).

Cost: each collective is one instruction per rank on the DMA resource, priced by the device
model's ring collective (`hardware.model.collective_cost`: steps x `link_step_latency_s`, 1.5
us, plus the bytes each rank sends over the per-rank ring bandwidth: through HBM by DMA within
a chip, min(16 DMA queues' rate, half the core's HBM bandwidth), NeuronLink across chips; the
constants and their sources are in hardware/targets.py). SBUF-to-SBUF within a chip moves at
the DMA queues' rate (no HBM round trip). The instruction starts when the last rank of the
group has its sources ready (a collective is a synchronisation point) and keeps the DMA queues
busy for the transfer part; the reduction arithmetic rides on the transfer at line rate, as the
model states. `priority` is checked (0-3) but the model has no DMA QoS arbitration, so it does
not change timing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..hardware.model import collective_cost, collective_link_bytes_per_s
from . import language as _nl
from .engines import write
from .errors import CollectiveError, DTypeError, ShapeError, user_location
from .programs import Arrival
from .registers import VirtualRegister
from .simulator import Run, _region, current
from .tile import HBM_KINDS, Tile

__all__ = ["ReplicaGroup", "rg_partition_op", "all_reduce", "all_gather", "reduce_scatter",
           "all_to_all", "collective_permute", "collective_permute_implicit",
           "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id",
           "self_index_in_replica_group"]

_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
_MAX_CHANNELS = 4  # AWS: at most 4 channels (a replica group of all devices in a node)


# --------------------------------------------------------------------------- replica groups
class rg_partition_op(enum.Enum):  # noqa: N801 - AWS's name
    """How `ReplicaGroup.from_partition_op` maps a rank to its rank-list id."""

    bitwise_and = "bitwise_and"
    div = "div"
    mod = "mod"


@dataclass
class ReplicaGroup:
    """The ranks a collective runs on, as disjoint rank-lists: `ReplicaGroup([[0, 1], [2, 3]])`
    runs the collective within ranks 0-1 and within ranks 2-3, in parallel."""

    rank_lists: list

    def __post_init__(self):
        lists = [list(r) for r in self.rank_lists] if self.rank_lists else []
        if lists and all(isinstance(r, (int, np.integer)) for r in self.rank_lists):
            lists = [[int(r) for r in self.rank_lists]]  # a flat list is one rank-list
        if not lists or any(not r for r in lists):
            raise CollectiveError(f"ReplicaGroup({self.rank_lists!r}): give a non-empty list of "
                                  "non-empty rank-lists, e.g. ReplicaGroup([[0, 1, 2, 3]])")
        seen: set = set()
        for r in (int(x) for rl in lists for x in rl):
            if r < 0 or r in seen:
                raise CollectiveError(f"ReplicaGroup({lists}): rank {r} is "
                                      f"{'negative' if r < 0 else 'in two rank-lists'}; each rank "
                                      "belongs to at most one rank-list")
            seen.add(r)
        self.rank_lists = [[int(x) for x in rl] for rl in lists]

    @staticmethod
    def from_partition_op(world_size: int, op: rg_partition_op, operand: int) -> "ReplicaGroup":
        """Ranks [0, world_size) sharing `op(rank, operand)` form one rank-list."""
        key: Callable[[int], int] = {rg_partition_op.bitwise_and: lambda r: r & operand,
                                     rg_partition_op.div: lambda r: r // operand,
                                     rg_partition_op.mod: lambda r: r % operand}[rg_partition_op(op)]
        lists: dict = {}
        for r in range(int(world_size)):
            lists.setdefault(key(r), []).append(r)
        return ReplicaGroup([lists[k] for k in sorted(lists)])

    def members_of(self, rank: int, world: int, what: str) -> tuple:
        """The rank-list `rank` belongs to, after checking the group fits the launch."""
        for rl in self.rank_lists:
            for r in rl:
                if r >= world:
                    raise CollectiveError(
                        f"{what}: the replica group {self.rank_lists} names rank {r}, but the launch "
                        f"has {world} program(s) (ranks 0-{world - 1}); launch the kernel over a grid "
                        f"with one program per rank, e.g. kernel[{max(max(x) for x in self.rank_lists) + 1}](...)")
        for rl in self.rank_lists:
            if rank in rl:
                return tuple(rl)
        raise CollectiveError(f"{what}: rank {rank} is in no rank-list of the replica group "
                              f"{self.rank_lists}; add it to one, or do not call the collective on it")


def _group(replica_group: Any) -> ReplicaGroup:
    if isinstance(replica_group, ReplicaGroup):
        return replica_group
    if isinstance(replica_group, (list, tuple)):
        return ReplicaGroup(list(replica_group))
    raise CollectiveError(f"replica_group must be a ReplicaGroup (or a list of rank-lists), got "
                          f"{type(replica_group).__name__}")


# --------------------------------------------------------------------------- rank queries
def rank_id(name: str | None = None) -> VirtualRegister:
    """The rank of the calling program (its flat index in the launch grid), in a register."""
    return VirtualRegister(current().rank)


def self_index_in_replica_group(replica_group: ReplicaGroup, name: str | None = None) -> VirtualRegister:
    """The caller's position within its own rank-list of `replica_group`."""
    run = current()
    members = _group(replica_group).members_of(run.rank, run.programs.world, "self_index_in_replica_group")
    return VirtualRegister(members.index(run.rank))


def collective_permute_implicit_current_processing_rank_id(iteration_id: Any, replica_group: ReplicaGroup,
                                                           channel_id: int = 0) -> VirtualRegister:
    """The rank whose data a ring permute holds at `iteration_id`: the caller's own at 0, then
    its predecessors' in the ring, one step further back each iteration."""
    run = current()
    members = _group(replica_group).members_of(run.rank, run.programs.world,
                                               "collective_permute_implicit_current_processing_rank_id")
    step = int(getattr(iteration_id, "value", iteration_id))
    return VirtualRegister(members[(members.index(run.rank) - step) % len(members)])


# --------------------------------------------------------------------------- checks
_OPS = {"add": lambda v: v.sum(0), "minimum": lambda v: v.amin(0), "maximum": lambda v: v.amax(0)}


def _op_name(op: Any, what: str) -> str:
    name = getattr(op, "__name__", None) if op in (_nl.add, _nl.minimum, _nl.maximum, np.add,
                                                   np.minimum, np.maximum) else None
    if name not in _OPS:
        raise CollectiveError(f"{what}: op {getattr(op, '__name__', op)!r} is not a collective "
                              "reduction; use nl.add, nl.minimum or nl.maximum")
    return name


def _tiles(xs: Any, arg: str, what: str) -> list[Tile]:
    if isinstance(xs, Tile) or not isinstance(xs, (list, tuple)) or not xs:
        raise CollectiveError(f"{what}: {arg} takes a non-empty list of tensors (e.g. {arg}=[t]), "
                              f"got {type(xs).__name__}")
    for t in xs:
        if not isinstance(t, Tile):
            raise CollectiveError(f"{what}: {arg} holds a {type(t).__name__}; it takes NKI tensors")
    return list(xs)


def _check_memory(what: str, srcs: list[Tile], dsts: list[Tile], sbuf_ok: bool,
                  channels: bool = False) -> None:
    """`channels`: the lists hold one tensor per ring channel (not a coalesced transfer)."""
    spaces = {"hbm" if t.buf.kind in HBM_KINDS else t.buf.kind for t in srcs + dsts}
    if "psum" in spaces:
        raise CollectiveError(f"{what}: a tensor is in PSUM; collectives read and write HBM or SBUF: "
                              "copy PSUM results to SBUF first (nisa.tensor_copy)")
    if len(spaces) > 1:
        raise CollectiveError(f"{what}: tensors mix HBM and SBUF; put all srcs and dsts on HBM or "
                              "all on SBUF")
    if "sbuf" in spaces and not sbuf_ok:
        raise CollectiveError(f"{what}: tensors must be on HBM (SBUF is not supported for it); "
                              "dma_copy them to an nl.shared_hbm / nl.private_hbm tensor")
    if "sbuf" in spaces and len(srcs) > 1 and not channels:
        raise CollectiveError(f"{what}: several tensors in one call (coalesced) need HBM; on SBUF "
                              "pass one tensor per call")
    if len(srcs) != len(dsts):
        raise CollectiveError(f"{what}: {len(srcs)} srcs but {len(dsts)} dsts; give one dst per src")
    for s, d in zip(srcs, dsts):
        if s.buf.tdtype != d.buf.tdtype:
            raise DTypeError(f"{what}: src is {s.buf.tdtype} but dst is {d.buf.tdtype}; a collective "
                             "moves data without casting: allocate dst with the src dtype")


def _check_reducible(what: str, srcs: list[Tile]) -> None:
    for s in srcs:
        if s.buf.tdtype not in _REDUCE_DTYPES:
            raise DTypeError(f"{what}: cannot reduce {s.buf.tdtype} data; collective reductions "
                             "take float32, bfloat16, float16 or int32: cast first (nisa.tensor_copy)")


def _check_dim(what: str, dim: int, srcs: list[Tile], allowed_hbm: tuple, allowed_sbuf: tuple) -> int:
    on_sbuf = srcs[0].buf.kind == "sbuf"
    allowed = allowed_sbuf if on_sbuf else allowed_hbm
    dim = int(dim)
    if dim not in allowed:
        raise CollectiveError(f"{what}: collective_dim={dim} is not supported on "
                              f"{'SBUF' if on_sbuf else 'HBM'}; use {' or '.join(map(str, allowed))}")
    if on_sbuf and any(len(s.shape) != 2 for s in srcs):
        raise ShapeError(f"{what}: SBUF collectives take 2-D tensors [partitions, free]")
    return dim


def _expect_shape(what: str, dst: Tile, shape: tuple, why: str) -> None:
    if tuple(dst.shape) != tuple(shape):
        raise ShapeError(f"{what}: dst has shape {tuple(dst.shape)} but {why} gives {tuple(shape)}; "
                         "allocate dst with that shape")


def _split_rows(what: str, src: Tile, n: int) -> int:
    if not src.shape or src.shape[0] % n:
        raise ShapeError(f"{what}: dim 0 of src {tuple(src.shape)} does not split into {n} equal "
                         f"chunks (one per rank); make it a multiple of {n}")
    return src.shape[0] // n


# --------------------------------------------------------------------------- the exchange
@dataclass
class _Payload:
    srcs: list
    dsts: list


def _signature(kind: str, srcs: list[Tile], dsts: list[Tile], *extra: Any) -> tuple:
    tensors = tuple((tuple(s.shape), str(s.buf.tdtype).replace("torch.", "")) for s in srcs)
    return (kind, *extra, ("srcs", tensors), ("dsts", tuple(tuple(d.shape) for d in dsts)))


def _check_distinct_dsts(kind: str, group: list[Arrival]) -> None:
    """Ranks receiving different data must not write the same memory (in a grid launch the
    programs share their nl.shared_hbm tensors)."""
    seen: dict = {}
    for a in group:
        for d in a.payload.dsts:
            for rank, other in seen.get(id(d.buf), []):
                if all(lo <= ohi and olo <= hi for (lo, hi), (olo, ohi) in zip(d.region(), other.region())):
                    raise CollectiveError(
                        f"{kind}: ranks {rank} and {a.rank} receive different data into the same "
                        f"{d.buf.kind} tensor; the programs of a grid share nl.shared_hbm: give each "
                        "rank its own dst (nl.private_hbm, SBUF, or a slice per rank), or launch one "
                        "kernel per rank with nki.simulate_ranks")
            seen.setdefault(id(d.buf), []).append((a.rank, d))


def _exchange(kind: str, members: tuple, signature: tuple, srcs: list[Tile], dsts: list[Tile],
              compute: Callable[[list[Arrival]], dict], model_kind: str, nbytes: int,
              same_result: bool = False) -> None:
    """Meet the other ranks of `members`; the last to arrive computes every rank's results
    (`compute` returns {(rank, dst index): values}, none a view of a src: every result is read
    before any dst is written, so in-place collectives work) and charges the instruction on each.
    `same_result`: every rank receives the same data (all-reduce, all-gather), so ranks may
    share a dst."""
    run = current()
    run.flush()
    arrival = Arrival(run.rank, kind, members, signature, _Payload(srcs, dsts), user_location(), run.sched)

    def perform(group: list[Arrival]) -> None:
        if not same_result:
            _check_distinct_dsts(kind, group)
        if run.compute:
            results = compute(group)
            for (rank, i), values in results.items():
                dst = next(a for a in group if a.rank == rank).payload.dsts[i]
                write(run, dst, values)
        _charge(run, kind, group, model_kind, nbytes)

    run.programs.exchange(arrival, perform)


def _charge(run: Run, kind: str, group: list[Arrival], model_kind: str, nbytes: int) -> None:
    """One instruction per rank on its DMA queues: the ring's cost, from when the slowest rank's
    sources are ready."""
    ranks = len(group)
    target = run.target
    cost = collective_cost(model_kind, nbytes, ranks, target)
    link = collective_link_bytes_per_s(target, ranks)
    on_sbuf = group[0].payload.srcs[0].buf.kind == "sbuf"
    # SBUF to SBUF within a chip, the DMA engines move the bytes without the HBM round trip the
    # ring model charges (read and write in HBM: half its bandwidth): the DMA rate bounds it.
    rate = target.dma_bytes_per_s if on_sbuf and ranks <= target.cores_per_chip else link
    busy = cost.bytes / rate if ranks > 1 else 0.0
    latency = cost.duration_s - cost.bytes / link + busy  # the ring's step latencies + the transfer
    accesses = [([_region(t) for t in a.payload.srcs], [_region(t) for t in a.payload.dsts]) for a in group]
    start = max(a.sched.ready(r, w) for a, (r, w) in zip(group, accesses))
    for a, (r, w) in zip(group, accesses):
        a.sched.issue(kind, "dma", busy, latency, r, w, a.location if run.trace else "", not_before=start)
    run.instructions += ranks
    if not on_sbuf:
        run.hbm_bytes += 2.0 * cost.bytes * ranks  # each byte sent is read and written in HBM


def _values(t: Tile) -> torch.Tensor:
    return t.float32() if t.buf.tdtype.is_floating_point else t.torch().to(torch.int64)


def _reduced(group: list[Arrival], i: int, op: str) -> torch.Tensor:
    return _OPS[op](torch.stack([_values(a.payload.srcs[i]) for a in group]))


def _nbytes(tiles: Sequence[Tile]) -> int:
    return sum(int(np.prod(t.shape)) * t.buf.tdtype.itemsize for t in tiles)


def _check_priority(what: str, priority: int | None) -> None:
    if priority is not None and int(priority) not in (0, 1, 2, 3):
        raise CollectiveError(f"{what}: priority={priority}; DMA priority levels are 0-3 (0 highest)")


def _operands(what: str, srcs: Any, dsts: Any, priority: int | None, *, sbuf_ok: bool,
              reduces: bool = False) -> tuple[list[Tile], list[Tile]]:
    """The checked `srcs` / `dsts` lists of one call (memory spaces, dtypes, priority)."""
    srcs, dsts = _tiles(srcs, "srcs", what), _tiles(dsts, "dsts", what)
    _check_memory(what, srcs, dsts, sbuf_ok=sbuf_ok)
    if reduces:
        _check_reducible(what, srcs)
    _check_priority(what, priority)
    return srcs, dsts


def _members(replica_group: Any, what: str) -> tuple:
    run = current()
    return _group(replica_group).members_of(run.rank, run.programs.world, what)


# --------------------------------------------------------------------------- collectives
def all_reduce(srcs: list, dsts: list, replica_group: ReplicaGroup, op: Any,
               priority: int | None = None, name: str | None = None) -> None:
    """Every rank of a rank-list gets the elementwise `op` of all its ranks' `srcs`."""
    what = "all_reduce"
    srcs, dsts = _operands(what, srcs, dsts, priority, sbuf_ok=True, reduces=True)
    op_name = _op_name(op, what)
    for s, d in zip(srcs, dsts):
        _expect_shape(what, d, s.shape, "the src")
    members = _members(replica_group, what)

    def compute(group):
        return {(a.rank, i): _reduced(group, i, op_name) for i in range(len(srcs)) for a in group}

    _exchange(what, members, _signature(what, srcs, dsts, op_name), srcs, dsts, compute,
              "all_reduce", _nbytes(srcs), same_result=True)


def all_gather(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int,
               priority: int | None = None, name: str | None = None) -> None:
    """Every rank gets all ranks' `srcs` concatenated along `collective_dim`, in rank-list order."""
    what = "all_gather"
    srcs, dsts = _operands(what, srcs, dsts, priority, sbuf_ok=True)
    dim = _check_dim(what, collective_dim, srcs, (0,), (0, 1))
    members = _members(replica_group, what)
    n = len(members)
    for s, d in zip(srcs, dsts):
        shape = list(s.shape)
        shape[dim] *= n
        _expect_shape(what, d, shape, f"gathering {n} ranks' src along dim {dim}")

    def compute(group):
        return {(a.rank, i): torch.cat([b.payload.srcs[i].torch() for b in group], dim)
                for i in range(len(srcs)) for a in group}

    _exchange(what, members, _signature(what, srcs, dsts, dim), srcs, dsts, compute,
              "all_gather", _nbytes(dsts), same_result=True)


def reduce_scatter(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int, op: Any,
                   priority: int | None = None, name: str | None = None) -> None:
    """The `op` of all ranks' `srcs`, split along `collective_dim` into one chunk per rank: the
    k-th rank of a rank-list gets chunk k."""
    what = "reduce_scatter"
    srcs, dsts = _operands(what, srcs, dsts, priority, sbuf_ok=True, reduces=True)
    op_name = _op_name(op, what)
    _check_dim(what, collective_dim, srcs, (0,), (0,))
    members = _members(replica_group, what)
    n = len(members)
    for s, d in zip(srcs, dsts):
        _expect_shape(what, d, (_split_rows(what, s, n),) + tuple(s.shape[1:]),
                      f"splitting src into {n} chunks along dim 0")

    def compute(group):
        out = {}
        for i in range(len(srcs)):
            chunks = _reduced(group, i, op_name).chunk(n, 0)
            out.update({(a.rank, i): chunks[k] for k, a in enumerate(group)})
        return out

    _exchange(what, members, _signature(what, srcs, dsts, op_name, 0), srcs, dsts, compute,
              "reduce_scatter", _nbytes(srcs))


def all_to_all(srcs: list, dsts: list, replica_group: ReplicaGroup, collective_dim: int,
               priority: int | None = None, name: str | None = None) -> None:
    """Each rank splits its `srcs` along dim 0 into one chunk per rank and sends chunk k to the
    k-th rank of its rank-list; a rank's `dsts` are the chunks it receives, in rank-list order."""
    what = "all_to_all"
    srcs, dsts = _operands(what, srcs, dsts, priority, sbuf_ok=False)
    _check_dim(what, collective_dim, srcs, (0,), ())
    members = _members(replica_group, what)
    n = len(members)
    for s, d in zip(srcs, dsts):
        _split_rows(what, s, n)
        _expect_shape(what, d, s.shape, "the src")

    def compute(group):
        return {(a.rank, i): torch.cat([b.payload.srcs[i].torch().chunk(n, 0)[k] for b in group], 0)
                for i in range(len(srcs)) for k, a in enumerate(group)}

    _exchange(what, members, _signature(what, srcs, dsts, 0), srcs, dsts, compute,
              "all_to_all", _nbytes(srcs))


def _permute(what: str, srcs: list[Tile], dsts: list[Tile], pairs: list[tuple[int, int]],
             members: tuple, values: Callable[[Arrival], torch.Tensor], extra: tuple) -> None:
    """Rank t's dst receives values(rank s) for each (s, t) in `pairs`."""
    source_of = {}
    for s, t in pairs:
        if t in source_of:
            raise CollectiveError(f"{what}: rank {t} is the target of ranks {source_of[t]} and {s}; "
                                  "each rank receives from at most one source")
        source_of[t] = s
    run = current()
    if run.rank not in members:
        raise CollectiveError(f"{what}: rank {run.rank} is in no (source, target) pair {pairs}; "
                              "do not call it on that rank, or add a pair for it")

    def compute(group):
        by_rank = {a.rank: a for a in group}
        return {(t, 0): values(by_rank[s]) for s, t in source_of.items()}

    _exchange(what, members, _signature(what, srcs, dsts, *extra), srcs, dsts, compute, "send",
              _nbytes(srcs))


def collective_permute(srcs: list, dsts: list, source_target_pairs: list,
                       priority: int | None = None, name: str | None = None) -> None:
    """Send each source rank's `srcs` to its target rank's `dsts`, as `source_target_pairs` says."""
    what = "collective_permute"
    srcs, dsts = _operands(what, srcs, dsts, priority, sbuf_ok=False)
    if len(srcs) != 1:
        raise CollectiveError(f"{what}: takes exactly one tensor in srcs and dsts (coalesced "
                              "permutes are not supported by NKI); call it once per tensor")
    _expect_shape(what, dsts[0], srcs[0].shape, "the src")
    pairs = [(int(s), int(t)) for s, t in source_target_pairs]
    world = current().programs.world
    bad = [r for p in pairs for r in p if not 0 <= r < world]
    if bad:
        raise CollectiveError(f"{what}: pair rank {bad[0]} is outside the launch's ranks "
                              f"0-{world - 1}; launch one program per rank")
    members = tuple(sorted({r for p in pairs for r in p}))
    _permute(what, srcs, dsts, pairs, members, lambda a: a.payload.srcs[0].torch().clone(), (tuple(pairs),))


def _channels(what: str, channel_ids: Sequence[int], *lists: Any) -> list[list[Tile]]:
    ids = [int(c) for c in channel_ids]
    if ids != list(range(len(ids))) or not 1 <= len(ids) <= _MAX_CHANNELS:
        raise CollectiveError(f"{what}: channel_ids={ids}; give consecutive ids from 0, at most "
                              f"{_MAX_CHANNELS} channels")
    out = []
    for arg, per_channel in lists:
        if len(per_channel) != len(ids):
            raise CollectiveError(f"{what}: {arg} has {len(per_channel)} channel(s) but channel_ids "
                                  f"has {len(ids)}; give one inner list per channel")
        tiles = [_tiles(c, f"{arg}[{k}]", what) for k, c in enumerate(per_channel)]
        if any(len(c) != 1 for c in tiles):
            raise CollectiveError(f"{what}: each channel of {arg} takes exactly one tensor")
        out.append([c[0] for c in tiles])
    return out


def _ring(what: str, replica_group: Any, srcs: list[Tile], dsts: list[Tile], channels: int,
          values: Callable[[Arrival, int], torch.Tensor], extra: tuple, nbytes: int) -> None:
    """Rank k of each rank-list sends `values(itself, channel)` to rank k+1 (mod n), per channel."""
    members = _members(replica_group, what)
    pairs = [(members[k], members[(k + 1) % len(members)]) for k in range(len(members))]

    def compute(group):
        by_rank = {a.rank: a for a in group}
        return {(t, c): values(by_rank[s], c) for s, t in pairs for c in range(channels)}

    _exchange(what, members, _signature(what, srcs, dsts, *extra), srcs, dsts, compute, "send", nbytes)


def collective_permute_implicit(srcs_by_channel: list, dsts_by_channel: list, replica_group: ReplicaGroup,
                                channel_ids: Sequence[int] = (0,), priority: int | None = None,
                                name: str | None = None) -> None:
    """Ring step: each rank sends each channel's src to its successor in its rank-list and
    receives its predecessor's into that channel's dst."""
    what = "collective_permute_implicit"
    srcs, dsts = _channels(what, channel_ids, ("srcs_by_channel", srcs_by_channel),
                           ("dsts_by_channel", dsts_by_channel))
    _check_memory(what, srcs, dsts, sbuf_ok=True, channels=True)
    _check_priority(what, priority)
    for s, d in zip(srcs, dsts):
        _expect_shape(what, d, s.shape, "the src")
    _ring(what, replica_group, srcs, dsts, len(srcs), lambda a, c: a.payload.srcs[c].torch().clone(), (),
          _nbytes(srcs))


def collective_permute_implicit_reduce(srcs0_by_channel: list, srcs1_by_channel: list, dsts_by_channel: list,
                                       replica_group: ReplicaGroup, op: Any, channel_ids: Sequence[int] = (0,),
                                       priority: int | None = None, name: str | None = None) -> None:
    """Ring step with a reduction: each rank sends `op(srcs0, srcs1)` of each channel to its
    successor and receives its predecessor's into that channel's dst."""
    what = "collective_permute_implicit_reduce"
    srcs0, srcs1, dsts = _channels(what, channel_ids, ("srcs0_by_channel", srcs0_by_channel),
                                   ("srcs1_by_channel", srcs1_by_channel), ("dsts_by_channel", dsts_by_channel))
    _check_priority(what, priority)
    op_name = _op_name(op, what)
    for a, b in zip(srcs0, srcs1):
        _expect_shape(what, b, a.shape, "srcs0")
    _check_reducible(what, srcs0 + srcs1)
    n = len(srcs0)
    _check_memory(what, srcs0 + srcs1, dsts + dsts, sbuf_ok=True, channels=True)
    for a, d in zip(srcs0, dsts):
        _expect_shape(what, d, a.shape, "the src")

    def values(a: Arrival, c: int) -> torch.Tensor:  # the payload's srcs: srcs0, then srcs1
        pair = a.payload.srcs
        return _OPS[op_name](torch.stack([_values(pair[c]), _values(pair[n + c])]))

    _ring(what, replica_group, srcs0 + srcs1, dsts, n, values, (op_name,), _nbytes(srcs0))


def barrier_across_cores(data: Tile, cores: Sequence[int]) -> None:
    """`nisa.core_barrier` across the NeuronCores of an `nl.nc(n)` grid: the k-th program on each
    core in `cores` waits for the others; `data` is what they must have written. One sync
    instruction per core, starting when the last of them is ready."""
    run = current()
    n = run.ncores
    cores = tuple(sorted({int(c) for c in cores}))
    core, slot = run.rank % n, run.rank // n
    if not cores or cores[0] < 0 or cores[-1] >= n or core not in cores:
        raise CollectiveError(f"core_barrier: cores {list(cores)} on core {core} of an nl.nc({n}) grid; "
                              f"name cores 0-{n - 1}, including the calling one")
    members = tuple(slot * n + c for c in cores)
    eng, busy, lat = run.timing("sync", "", partitions=1, free_elems=1, dtype=data.buf.tdtype)
    run.flush()
    box = [_region(data)]

    def perform(group: list[Arrival]) -> None:
        start = max(a.sched.ready(box, box) for a in group)
        for a in group:
            a.sched.issue("sync", eng, busy, lat, box, box, a.location if run.trace else "", not_before=start)
        run.instructions += len(group)

    run.programs.exchange(Arrival(run.rank, "core_barrier", members, ("core_barrier", cores), None,
                                  user_location(), run.sched), perform)
