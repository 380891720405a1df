"""The programs of one kernel launch, and the rendezvous where collectives meet.

Owns how the SPMD programs of a launch run. Each program is a rank (its flat index in the
launch grid, row-major). Without collectives, programs run one after another in the calling
thread (`SequentialPrograms`, the fast path every kernel takes first). A collective is a
synchronisation point: every rank of its replica group must contribute before any of them
continues. When a sequential launch reaches a collective spanning several programs it cannot
suspend the caller, so it raises `NeedsCooperative` and the launch is restarted with
`CooperativePrograms`: each program runs in its own thread, exactly one thread at a time holds
the baton (deterministic, no races on the simulator's state), and a program that reaches a
collective parks there and hands the baton to the next runnable program. The last rank of a
group to arrive performs the collective for all of them, which makes the others runnable.

When every unfinished program is parked and no group is complete, the launch has deadlocked
(some ranks skipped a collective, or called different ones): that raises an error naming who
waits where; it never hangs.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import CollectiveError
from .scheduler import Scheduler
from .simulator import Run, set_current

# Per-program fields of `Run`, saved when a program parks and restored when it resumes.
_PROGRAM_STATE = ("program_id", "rank", "sched", "shared_count", "seq_depth", "offsets",
                  "pending_ranges")


class NeedsCooperative(BaseException):
    """A sequential launch reached a collective over several programs (restart it cooperatively).
    A BaseException so kernel code's `except Exception` cannot swallow it."""


class _Aborted(BaseException):
    """The launch failed in another program: unwind this one."""


@dataclass
class Arrival:
    """One rank's call of a collective: what it passed and where it was called from."""

    rank: int
    kind: str
    members: tuple          # the ranks of its group, in group order
    signature: tuple        # what must agree across the group (kind, op, dims, ...)
    payload: Any            # the collective's own data (tiles)
    location: str
    sched: Scheduler
    seq: int = 0            # how many collectives over these members the rank made before


@dataclass
class Program:
    """One program (rank) of a launch: its kernel arguments, its NeuronCore's timeline and,
    when ranks run side by side, its own SBUF/PSUM (and, one kernel per rank, its own shared
    HBM)."""

    rank: int
    pid: tuple
    sched: Scheduler
    call: tuple                     # (args, kwargs) of its kernel call
    pools: tuple | None = None      # (sbuf, psum) Pools, None: the Run's
    shared: dict | None = None      # nl.shared_hbm allocations, None: the Run's
    state: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)  # rank-list -> collectives called over it so far
    waiting: Arrival | None = None  # parked at this collective
    done: bool = False
    result: Any = None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _describe(a: Arrival) -> str:
    return f"{a.kind} over ranks {list(a.members)}" + (f" at {a.location}" if a.location else "")


class _Programs:
    """What both runners share: the programs, their state on the `Run`, collective matching."""

    def __init__(self, run: Run, programs: list[Program]):
        self.run, self.programs = run, programs
        self.pending: dict[tuple, list[Arrival]] = {}

    @property
    def world(self) -> int:
        return len(self.programs)

    def _enter(self, p: Program) -> None:
        run = self.run
        run.program_id, run.rank, run.sched = p.pid, p.rank, p.sched
        if p.pools is not None:
            run.sbuf, run.psum = p.pools
        if p.shared is not None:
            run.shared = p.shared
        run.shared_count, run.seq_depth, run.offsets, run.pending_ranges = 0, 0, (), []
        for name, value in p.state.items():
            setattr(run, name, value)

    def _save(self, p: Program) -> None:
        self.run.flush()
        p.state = {name: getattr(self.run, name) for name in _PROGRAM_STATE}

    def _arrive(self, p: Program, arrival: Arrival) -> list[Arrival] | None:
        """Record `arrival`; the group's arrivals in group order once all ranks are in."""
        arrival.seq = p.calls.get(arrival.members, 0)
        p.calls[arrival.members] = arrival.seq + 1
        key = (arrival.members, arrival.seq)
        got = self.pending.setdefault(key, [])
        if got and got[0].signature != arrival.signature:
            first = got[0]
            raise CollectiveError(
                f"the {_ordinal(arrival.seq + 1)} collective of ranks {list(arrival.members)} differs: rank "
                f"{first.rank} calls {first.kind} {first.signature[1:]} ({first.location}), rank "
                f"{arrival.rank} calls {arrival.kind} {arrival.signature[1:]}; every rank of a replica "
                "group must make the same collective calls, with the same arguments, in the same order")
        got.append(arrival)
        if len(got) < len(arrival.members):
            return None
        del self.pending[key]
        by_rank = {a.rank: a for a in got}
        return [by_rank[r] for r in arrival.members]


class SequentialPrograms(_Programs):
    """Programs run to completion one after another; a collective must stay within one rank."""

    def run_all(self, body: Callable[[Program], Any]) -> list:
        """Run every program; their results in rank order."""
        for p in self.programs:
            self.run.flush()
            self._enter(p)
            self.current = p
            p.result = body(p)
        self.run.flush()
        return [p.result for p in self.programs]

    def exchange(self, arrival: Arrival, perform: Callable[[list[Arrival]], None]) -> None:
        if len(arrival.members) > 1:
            raise NeedsCooperative()
        perform(self._arrive(self.current, arrival))


class CooperativePrograms(_Programs):
    """Programs run as threads passing one baton; collectives park the caller until its group
    is complete."""

    def __init__(self, run: Run, programs: list[Program]):
        super().__init__(run, programs)
        self.cond = threading.Condition()
        self.turn = 0
        self.error: BaseException | None = None
        self.finished = False
        self._local = threading.local()
        self.torch_threads = torch.get_num_threads()  # the launch's setting, for the workers too

    def run_all(self, body: Callable[[Program], Any]) -> list:
        """Run every program; their results in rank order."""
        threads = [threading.Thread(target=self._program_main, args=(p, body), daemon=True,
                                    name=f"nki-program-{p.rank}") for p in self.programs]
        for t in threads:
            t.start()
        with self.cond:
            while not self.finished and self.error is None:
                self.cond.wait()
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error
        return [p.result for p in self.programs]

    # -- one program's thread ------------------------------------------------------------
    def _program_main(self, p: Program, body: Callable[[Program], Any]) -> None:
        set_current(self.run)
        torch.set_num_threads(self.torch_threads)  # (OpenMP's thread count is per thread)
        self._local.program = p
        try:
            with self.cond:
                self._wait_for_baton(p)
            self._enter(p)
            p.result = body(p)
            with self.cond:
                self.run.flush()
                p.done = True
                self._pass_baton(p)
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the launching thread
            with self.cond:
                self._fail(e)
        finally:
            set_current(None)

    def _wait_for_baton(self, p: Program) -> None:
        while self.turn != p.rank or p.waiting is not None:
            if self.error is not None:
                raise _Aborted()
            self.cond.wait()
        if self.error is not None:
            raise _Aborted()

    def _pass_baton(self, p: Program) -> None:
        n = self.world
        for step in range(1, n + 1):
            q = self.programs[(p.rank + step) % n]
            if not q.done and q.waiting is None:
                self.turn = q.rank
                self.cond.notify_all()
                return
        if all(q.done for q in self.programs):
            self.finished = True
            self.cond.notify_all()
            return
        self._fail(self._deadlock())

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.cond.notify_all()

    def _deadlock(self) -> CollectiveError:
        parked = [q for q in self.programs if q.waiting is not None]
        done = [q.rank for q in self.programs if q.done]
        lines = [f"rank {q.rank} waits in its {_ordinal(q.waiting.seq + 1)} collective over these ranks, "
                 f"{_describe(q.waiting)}" for q in parked]
        if done:
            lines.append(f"rank(s) {done} finished without joining")
        return CollectiveError(
            "the kernel's collectives deadlock: " + "; ".join(lines) + ". Every rank of a replica "
            "group must call the same collectives in the same order (a collective under a "
            "rank-dependent `if` or loop count never completes)", location="")

    # -- collectives ---------------------------------------------------------------------
    def exchange(self, arrival: Arrival, perform: Callable[[list[Arrival]], None]) -> None:
        p: Program = self._local.program
        group = self._arrive(p, arrival)
        if group is not None:
            perform(group)
            with self.cond:
                for a in group:
                    self.programs[a.rank].waiting = None
            return
        with self.cond:
            self._save(p)
            p.waiting = arrival
            self._pass_baton(p)
            self._wait_for_baton(p)
        self._enter(p)


def make_programs(run: Run, grid: tuple, scheds: list[Scheduler], cooperative: bool,
                  calls: list[tuple]) -> _Programs:
    """The programs of a launch. One call in `calls`: the programs of `grid` (row-major ranks)
    share its arguments and the launch's shared HBM. Several calls: a multi-rank launch, one
    single-program kernel per rank with its own arguments and shared HBM. Programs spread over
    `scheds` (one per NeuronCore); when they run side by side each gets its own SBUF/PSUM."""
    per_rank = len(calls) > 1
    if per_rank:
        pids = [(0,)] * len(calls)
    else:
        pids = list(itertools.product(*[range(g) for g in grid])) if grid else [(0,)]
    side_by_side = cooperative and len(pids) > 1
    programs = [Program(i, pid, scheds[i % len(scheds)], calls[i if per_rank else 0],
                        run.new_pools() if side_by_side else None, {} if per_rank else None)
                for i, pid in enumerate(pids)]
    return (CooperativePrograms if side_by_side else SequentialPrograms)(run, programs)
