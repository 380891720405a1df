"""Execution state of one kernel run: allocation, capacity rules, instruction issue.

Owns the `Run` context that `nl`/`nisa` calls act on while a kernel executes: the target,
whether values are computed (or only shapes, for typed-placeholder benchmarks), SBUF and
PSUM capacity accounting per partition, the SPMD program ids, the loop nesting
(`affine_range` / `sequential_range`), and `issue()`, which prices one instruction with the
hardware model (`torchneuron.hardware.instructions`) and hands it to the list scheduler.

Capacity is charged per partition while a tensor is alive in Python, which approximates the
compiler's liveness: an allocation that replaces one bound to the same name fits (the check
runs at the next instruction), a PSUM result the compiler placed is dead after its first
use, a multi-block PSUM tensor rotates through one bank, and direct allocations
(`nki.compiler.*.mod_alloc`) are checked by address range instead.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

from ..hardware.instructions import instruction_timing
from ..hardware.targets import Target, get_target
from .errors import CapacityError, NKIError, user_location
from .scheduler import Scheduler
from .tile import Buffer, Tile

_local = threading.local()


def current() -> "Run":
    run = getattr(_local, "run", None)
    if run is None:
        raise NKIError("nki.language / nki.isa calls must run inside a kernel: decorate the "
                       "function with @nki.jit (or call nki.simulate_kernel)", rule="no-kernel")
    return run


def active() -> "Run | None":
    return getattr(_local, "run", None)


class Pool:
    """Bytes per partition in use in one on-chip memory, with its capacity rule."""

    __slots__ = ("name", "capacity", "used", "peak", "rule", "hint", "spill_to", "spilled",
                 "spill_total", "on_spill")

    def __init__(self, name: str, capacity: int, rule: str, hint: str, spill_to: "Pool | None" = None,
                 on_spill: Any = None):
        self.name, self.capacity, self.rule, self.hint = name, capacity, rule, hint
        self.used = 0
        self.peak = 0
        # PSUM: live tiles past its banks are spilled to SBUF (as the compiler's allocator
        # does), each spilled byte charged to `spill_to` and a copy out and back to the kernel.
        self.spill_to, self.on_spill = spill_to, on_spill
        self.spilled = 0
        self.spill_total = 0

    def charge(self, nbytes: int, what: str) -> None:
        """Reserve; a single tile larger than the memory fails here, an over-full memory when
        the next instruction runs (so a tile replacing one bound to the same name fits)."""
        if nbytes > self.capacity:
            raise CapacityError(f"{what} needs {nbytes} B per partition; {self.name} has "
                                f"{self.capacity} B per partition; {self.hint}", rule=self.rule)
        self.used += nbytes
        if self.used > self.peak and self.used <= self.capacity:
            self.peak = self.used

    def check(self) -> None:
        if self.spill_to is not None and self.used - self.spilled > self.capacity:
            grow = self.used - self.spilled - self.capacity
            self.spilled += grow
            self.spill_total += grow
            self.spill_to.used += grow
            self.on_spill(grow)
            self.spill_to.check()
            return
        if self.used - self.spilled > self.capacity:
            raise CapacityError(
                f"live {self.name} tiles need {self.used} B per partition, more than the "
                f"{self.capacity} B available; {self.hint}", rule=self.rule)
        if self.used > self.peak:
            self.peak = self.used

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        if self.spilled:
            back = self.spilled - max(0, self.used - self.capacity)
            if back > 0:
                self.spilled -= back
                self.spill_to.used -= back


class Run:
    """State of one kernel execution (one SPMD instance shares it with its siblings)."""

    def __init__(self, target: Target | None = None, *, compute: bool = True, trace: bool = False):
        self.target = target or get_target()
        self.compute = compute
        self.sched = Scheduler(keep_trace=trace)
        self.trace = trace
        self.sbuf, self.psum = self.new_pools()
        self.ncores = 1             # NeuronCores of the launch grid (nl.nc(n))
        self.program_id: tuple = ()
        self.rank = 0               # flat index of the running program (its collective rank)
        self.programs = None        # the launch's programs (programs.py): collectives meet there
        self.grid: tuple = ()
        self.shared: dict = {}      # n-th shared_hbm allocation -> Buffer (shared by SPMD instances)
        self.shared_count = 0
        self.seq_depth = 0          # > 0 inside sequential_range
        self.pending = None         # last value-returning instruction, not yet scheduled
        self.pending_ranges: list = []  # mask narrowing of the pending instruction
        self.offsets: tuple = ()        # start of the current instruction's narrowed space
        self.cost_cache: dict = {}
        self.instructions = 0
        self.inputs: list[Buffer] = []
        self.threads = _matmul_threads()
        self.flops = 0.0       # Tensor-engine work (2*K*M*N per matmul)
        self.hbm_bytes = 0.0   # bytes DMA moved to or from HBM

    def new_pools(self) -> tuple[Pool, Pool]:
        """Empty SBUF and PSUM of one NeuronCore of the target."""
        t = self.target
        sbuf = Pool("SBUF", t.sbuf_usable_bytes_per_partition, "sbuf-capacity",
                    "free tiles (let them go out of scope) or use smaller tiles")
        psum = Pool("PSUM", t.psum_banks * t.psum_bank_bytes, "psum-capacity",
                    f"PSUM has {t.psum_banks} banks of {t.psum_bank_bytes} B a partition; "
                    "copy results to SBUF and reuse PSUM tiles", spill_to=sbuf,
                    on_spill=self._charge_spill)
        return sbuf, psum

    def _charge_spill(self, nbytes: int) -> None:
        """PSUM tiles of `nbytes` a partition moved to SBUF and back: two Vector-engine copies
        of that many fp32 elements a partition, in program order with everything else."""
        eng, busy, lat = self.timing("tensor_copy", "", partitions=self.target.partitions,
                                     free_elems=max(1, nbytes // 4), dtype=torch.float32)
        self.instructions += 2
        for _ in range(2):
            self.sched.issue("psum_spill", eng, busy, lat, [], [], "")

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, kind: str, shape: tuple, tdtype: torch.dtype, pdim: int = 0,
                 fill: float | None = None, name: str = "", blocks: tuple | None = None,
                 base: int | None = None) -> Buffer:
        if kind in ("sbuf", "psum"):
            p = shape[pdim] if shape else 1
            if p > self.target.partitions:
                from .errors import PartitionDimError
                raise PartitionDimError(f"{kind} tensor of shape {shape} has partition dimension {p}; "
                                        f"the hardware has {self.target.partitions} partitions (pmax)")
            free = tdtype.itemsize
            for i, s in enumerate(shape):
                if i != pdim:
                    free *= s
            if blocks:  # direct allocation: leading block dims rotate over `blocks` buffers
                lead = 1
                for s in [s for i, s in enumerate(shape) if i != pdim][:len(blocks)]:
                    lead *= s
                phys = 1
                for b in blocks:
                    phys *= b
                free = free // max(lead, 1) * phys
            pool = self.sbuf if kind == "sbuf" else self.psum
            if kind == "psum":
                bank = self.target.psum_bank_bytes
                nblk = 1
                for i in range(pdim):
                    nblk *= shape[i]
                if blocks:
                    nblk = 1
                    for b in blocks:
                        nblk *= b
                per_block = free // max(nblk, 1)
                if per_block > bank:
                    raise CapacityError(
                        f"PSUM tile of shape {shape} ({tdtype}) needs {per_block} B a partition; a PSUM "
                        f"tile must fit one {bank} B bank ({bank // 4} fp32, nl.tile_size.psum_fmax)",
                        rule="psum-capacity")
                # An auto-allocated multi-block PSUM tensor is rotated through banks as its
                # blocks' lifetimes allow (the compiler's allocator); charge one bank for it.
                free = (nblk if blocks else 1) * bank
            if base is not None:  # placed by the kernel (direct allocation): check the address range
                limit = self.target.sbuf_bytes_per_partition if kind == "sbuf" else pool.capacity
                if base + free > limit:
                    raise CapacityError(f"{kind} allocation at byte {base} of {free} B a partition ends "
                                        f"past the {limit} B of a partition", rule=pool.rule)
                free = 0
            pool.charge(free, f"{kind} tensor of shape {shape} ({tdtype})")
        data = None
        if self.compute:
            if fill is None and kind != "psum":
                data = torch.empty(shape, dtype=tdtype)
            else:
                data = torch.full(shape, fill or 0, dtype=tdtype)
        buf = Buffer(kind, shape, tdtype, data, pdim, name)
        if kind in ("sbuf", "psum"):
            buf.charge = free
            buf.pool = pool
        return buf

    def new_iteration(self) -> None:
        """A sequential_range iteration starts: it keeps program order on every engine (no
        instruction of it is placed before the previous iteration's on the same engine)."""
        self.flush()
        self.sched.order_point()

    # -- instructions -----------------------------------------------------------------------
    def timing(self, kind: str, engine: str = "", **kw) -> tuple:
        key = (kind, engine) + tuple(kw.items())  # call sites pass keywords in a fixed order
        t = self.cost_cache.get(key)
        if t is None:
            dtype = kw.pop("dtype")
            try:
                tm = instruction_timing(kind, dtype=dtype, target=self.target, engine=engine, **kw)
            except TypeError as e:  # UnsupportedDtypeError is a TypeError
                from .errors import DTypeError
                raise DTypeError(str(e)) from None
            except ValueError as e:
                from .errors import ShapeError
                raise ShapeError(str(e)) from None
            t = self.cost_cache[key] = (tm.engine, tm.busy_s, tm.latency_s)
        return t

    def issue(self, kind: str, reads: list[Tile], writes: list[Tile], engine: str = "",
              **cost: Any) -> None:
        """Charge one instruction to its engine and schedule it after its dependencies."""
        if self.pending is not None:
            self.flush()
        if self.sbuf.used > self.sbuf.capacity or self.psum.used - self.psum.spilled > self.psum.capacity:
            self.sbuf.check()
            self.psum.check()
        eng, busy, lat = self.timing(kind, engine, **cost)
        self.instructions += 1
        for t in reads:
            b = t.buf
            if b.kind == "psum" and b.name == "~result" and b.charge is not None and b not in writes_bufs(writes):
                # A PSUM result placed by the compiler is dead after its first use (copied out
                # or accumulated); Python may keep the name alive, the bank is free again.
                b.pool.release(b.charge)
                b.charge = None
        self.sched.issue(kind, eng, busy, lat,
                         [_region(t) for t in reads], [_region(t) for t in writes],
                         user_location() if self.trace else "")

    def issue_value(self, kind: str, reads: list[Tile], out: Tile, engine: str = "", **cost: Any) -> None:
        """Like issue(), for an instruction whose result is a fresh tile: scheduling waits one
        step so that `dst[...] = value` can retarget the write instead of adding a copy."""
        if self.pending is not None:
            self.flush()
        self.pending = (kind, reads, out, engine, cost)

    def retarget(self, value: Tile, dst: Tile, accumulate: bool = False) -> bool:
        """If `value` is the pending instruction's result, make that instruction write `dst`."""
        p = self.pending
        if p is None or p[2].buf is not value.buf:
            return False
        kind, reads, _, engine, cost = p
        if accumulate:
            reads = list(reads) + [dst]
        self.pending = (kind, reads, dst, engine, cost)
        return True

    def flush(self) -> None:
        p = self.pending
        if p is None:
            return
        self.pending = None
        kind, reads, out, engine, cost = p
        self.issue(kind, reads, [out], engine, **cost)


def _region(t: Tile) -> tuple:
    buf = t.buf
    if buf.coarse or t.is_whole:
        return (buf.id, None)
    return (buf.id, t.region())


def _matmul_threads() -> int:
    """Host threads for the matmul tiles: torch's setting, or 1 when the host is already busy
    (a tile-sized GEMM split over cores that other processes occupy waits on them)."""
    n = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except OSError:
        return n
    return n if load < (os.cpu_count() or 1) else 1  # (the load includes this process)


def writes_bufs(writes: list) -> tuple:
    return tuple(t.buf for t in writes)


def set_current(run: "Run | None") -> None:
    _local.run = run
