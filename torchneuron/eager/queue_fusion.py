"""Fusion of queued ops and the fused-kernel cache of adaptive eager mode.

At a flush the C++ queue has no plan for, `Executor.run(entries)` walks the queue in order and
returns the plan it followed (which stretches ran fused, through which kernel's entry point, and
which eagerly); the queue replays a final plan itself when the same queue comes back. Heuristics:

- a *run* is a maximal sequence of fusible ops (pointwise, reductions, norms, matmuls,
  gathers, optimizer updates; op_kinds.FUSIBLE_CATEGORIES) with the views recorded between them;
  any other queued op runs alone, eagerly;
- a run's *key* is its structure: each op with its arguments' signature and where each tensor
  comes from (an external input, or an op of the run), plus which inputs share memory when
  the run mutates an input. Float arguments (learning rates, scales) are kept apart;
- a run is compiled into one fused program the second time its key and floats are seen (a
  sequence seen once costs no compilation) and served from the cache afterwards;
- when a key comes back with different floats (a learning-rate schedule, bias corrections),
  the floats that changed become the program's arguments (compiled at once: the run was seen
  before), so a training loop pays each compilation once; where a program cannot take a float
  as an argument (it would branch on its value), the ops holding changing floats leave the run
  and run eagerly instead, and the rest still fuses;
- a run shorter than `MIN_OPS` ops, or one whose compilation failed, runs eagerly.

A fused program receives the run's external inputs and the output buffers that are still
alive (referenced by the program, autograd, a view or a later op) and writes those; the others
are intermediates nobody can observe any more. Inputs sharing memory with an input the run
mutates are passed as views of one tensor spanning their storage, so the program sees the
aliasing. Programs come from the kernel compiler the compiler package registers
(`torchneuron.eager.set_kernel_compiler`).
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchneuron.eager.op_kinds import flat_tensors, traceable_overload
from torchneuron.eager.queue import Entry

log = logging.getLogger(__name__)

MIN_OPS = 2
COMPILE_AFTER = 2   # sightings of a run before it is compiled

# compiler(replay, example_tensors, n_inputs, float_hints) -> runner: the first n_inputs tensors are
# the run's inputs, the rest the output buffers the replay writes; the replay and the runner take
# the run's changing floats after the tensors (float_hints: their current values).
KernelCompiler = Callable[[Callable[..., None], list[torch.Tensor], int, tuple], Callable[[list], Any]]
Runner = Callable[[list[torch.Tensor]], Any]


@dataclass
class _Kernel:
    sightings: int = 0
    program: Any = None                                          # _Steps, once compiled
    runners: dict[tuple, Runner] = field(default_factory=dict)   # live-output mask -> program
    failed: bool = False
    runtime_floats: tuple[int, ...] = ()  # the run's floats (positions) the program takes as arguments
    # entry_point(mask, tensors, float_values): runs the program (what C++ plans call)
    entry_point: Any = None


@dataclass
class _Sequence:
    """What is known of one run key: the floats of its last sighting, the positions of the floats
    seen changing, and a kernel per floats (changing ones as None)."""

    last_floats: tuple | None = None
    sightings: int = 0
    changing: frozenset[int] = frozenset()
    kernels: dict[tuple, _Kernel] = field(default_factory=dict)


@dataclass
class _Run:
    entries: list[Entry]
    key: "_Key"
    floats: tuple
    float_positions: tuple          # entry index of each float
    inputs: list[torch.Tensor]      # external inputs in first-use order
    outputs: list[torch.Tensor]     # the output buffers, in order
    aliases: dict[int, int]         # input index -> slot of the base spanning its storage
    runtime_inputs: list[torch.Tensor]


def _storage_classes(inputs: list[torch.Tensor], mutated: set[int]) -> tuple[tuple, dict[int, int], list]:
    """Groups of inputs sharing storage with a mutated input: (key part, input -> base slot,
    bases). A base is a 1-D view over the whole storage."""
    pointers = [t.untyped_storage().data_ptr() for t in inputs]
    counts: dict[int, int] = {}
    for pointer in pointers:
        counts[pointer] = counts.get(pointer, 0) + 1
    shared = {pointers[i] for i in mutated if counts[pointers[i]] > 1}
    if not shared:
        return (), {}, []
    slots: dict[int, int] = {}
    bases: list[torch.Tensor] = []
    aliases: dict[int, int] = {}
    key = []
    for i, pointer in enumerate(pointers):
        if pointer in shared:
            if pointer not in slots:
                storage = inputs[i].untyped_storage()
                slots[pointer] = len(bases)
                bases.append(inputs[i].as_strided((storage.nbytes() // inputs[i].element_size(),), (1,), 0))
            aliases[i] = slots[pointer]
            key.append((i, slots[pointer], inputs[i].storage_offset(), inputs[i].dtype))
    if any(inputs[i].dtype != bases[slot].dtype for i, slot in aliases.items()):
        raise _Untraceable(0)
    return tuple(key), aliases, bases


class _Untraceable(Exception):
    """A run contains an op a fused program cannot express (at entry `position`)."""

    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.position = position


def describe(entries: list[Entry]) -> _Run:
    """The key, floats, inputs and outputs of a run (from signatures taken at enqueue). Raises
    _Untraceable at the first op a graph cannot express."""
    local: dict[int, tuple] = {}
    external: dict[int, int] = {}
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    parts, floats, positions = [], [], []
    mutated: set[int] = set()
    for position, entry in enumerate(entries):
        if traceable_overload(entry.func, entry.args) is None:
            raise _Untraceable(position)
        refs = []
        for tensor in entry.tensors:
            ref = local.get(id(tensor))
            if ref is None:
                ref = external.get(id(tensor))
                if ref is None:
                    ref = external[id(tensor)] = len(inputs)
                    inputs.append(tensor)
            refs.append(ref)
        if entry.info is not None and entry.info.inplace:
            written = len(flat_tensors(entry.args[0]))
            mutated.update(r for r in refs[:written] if type(r) is int)
        elif entry.info is not None and entry.info.writes_out:  # out= arguments are keywords: the last tensors
            written = len(flat_tensors([entry.kwargs[name] for name in entry.info.out_names]))
            mutated.update(r for r in refs[len(refs) - written:] if type(r) is int)
        parts.append((id(entry.func), entry.signature, tuple(refs)))  # ops are process-lived singletons
        floats.extend(entry.floats)
        positions.extend([position] * len(entry.floats))
        for j, tensor in enumerate(entry.produced):
            local[id(tensor)] = (position, j)
            if not entry.is_view:
                outputs.append(tensor)
    alias_key, aliases, bases = _storage_classes(inputs, mutated) if mutated else ((), {}, [])
    runtime_inputs = [t for i, t in enumerate(inputs) if i not in aliases] + bases
    return _Run(entries, _Key((tuple(parts), alias_key)), tuple(floats), tuple(positions), inputs, outputs,
                aliases, runtime_inputs)


class _Key:
    """A run's key with its hash computed once (keys are large nested tuples, looked up often)."""

    __slots__ = ("value", "hash")

    def __init__(self, value: tuple) -> None:
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.value == other.value


def live_mask(outputs: list[torch.Tensor]) -> tuple[bool, ...]:
    """Which output buffers may still be read: referenced from Python beyond `outputs` itself,
    held by C++ (autograd, a view's base) or sharing their storage (views, saved tensors)."""
    mask = []
    for i in range(len(outputs)):
        dead = (sys.getrefcount(outputs[i]) == 2 and outputs[i]._use_count() == 1
                and torch._C._storage_Use_Count(outputs[i].untyped_storage()._cdata) == 2)
        mask.append(not dead)
    return tuple(mask)


# ---------------------------------------------------------------------------------------------
# The fused program: a replay of the run over placeholders
# ---------------------------------------------------------------------------------------------

def _template(value: Any, refs: list[Any], floats: list[int]) -> Any:
    """An argument with its tensors replaced by `refs` (in order) and its floats by indices."""
    if isinstance(value, torch.Tensor):
        return ("ref", refs.pop(0))
    if isinstance(value, (list, tuple)):
        return tuple(_template(v, refs, floats) for v in value)
    if type(value) is float:
        return ("float", floats.pop(0))
    return ("const", value)


@dataclass
class _Steps:
    """A run's ops with their arguments as templates: what a fused program replays."""

    steps: list[tuple]                      # (traceable func, args, kwargs, is_view, first output, outputs)
    slot: dict[int, int]                    # input index -> runtime input position
    alias_views: dict[int, tuple]           # input index -> (base position, shape, stride, offset)
    n_inputs: int
    n_outputs: int

    @functools.cached_property
    def computing(self) -> int:
        """Steps that compute (not views): the ops a run of the program counts."""
        return sum(not step[3] for step in self.steps)


def program_steps(run: _Run) -> _Steps:
    """The replayable form of a run (needs its entries' arguments; independent of liveness)."""
    n_direct = len(run.inputs) - len(run.aliases)
    slot, alias_views = {}, {}
    for i, tensor in enumerate(run.inputs):
        if i in run.aliases:
            alias_views[i] = (n_direct + run.aliases[i], tuple(tensor.shape), tensor.stride(),
                              tensor.storage_offset())
        else:
            slot[i] = len(slot)
    steps = []
    float_index = output_index = 0
    for (_, _, refs), entry in zip(run.key.value[0], run.entries):
        func = entry.func
        floats = list(range(float_index, float_index + len(entry.floats)))
        float_index += len(entry.floats)
        ref_list = list(refs)
        args = _template(entry.args, ref_list, floats)
        kwargs = tuple((k, _template(v, ref_list, floats)) for k, v in entry.kwargs.items())
        steps.append((traceable_overload(func, entry.args), args, kwargs, entry.is_view, output_index,
                      len(entry.produced)))
        if not entry.is_view:
            output_index += len(entry.produced)
    return _Steps(steps, slot, alias_views, len(run.runtime_inputs), output_index)


def replay_program(program: _Steps, mask: tuple[bool, ...], baked_floats: tuple,
                   runtime_floats: tuple[int, ...] = ()) -> Callable[..., None]:
    """A function of (runtime inputs..., live output buffers..., floats at `runtime_floats`...)
    doing what the run does; its other floats are `baked_floats`."""
    live_slot = {}
    for j, alive in enumerate(mask):
        if alive:
            live_slot[j] = len(live_slot)
    slot, alias_views, n_inputs = program.slot, program.alias_views, program.n_inputs
    n_tensors = n_inputs + len(live_slot)

    def replay(*arguments: Any) -> None:
        tensors = arguments[:n_tensors]
        float_values = list(baked_floats)
        for position, value in zip(runtime_floats, arguments[n_tensors:]):
            float_values[position] = value
        inputs, buffers = tensors[:n_inputs], tensors[n_inputs:]
        values: dict[tuple, torch.Tensor] = {}
        views: dict[int, torch.Tensor] = {}

        def ref(r: Any) -> torch.Tensor:
            if type(r) is int:
                if r in alias_views:
                    if r not in views:
                        base, shape, stride, offset = alias_views[r]
                        views[r] = torch.as_strided(inputs[base], shape, stride, offset)
                    return views[r]
                return inputs[slot[r]]
            return values[r]

        def value(desc: Any) -> Any:
            if isinstance(desc, tuple) and desc and isinstance(desc[0], str):
                tag, item = desc
                return ref(item) if tag == "ref" else float_values[item] if tag == "float" else item
            return type(desc)(value(d) for d in desc)

        for position, (func, args, kwargs, is_view, first, produced) in enumerate(program.steps):
            result = func(*value(args), **{k: value(v) for k, v in kwargs})
            for j, tensor in enumerate(flat_tensors(result) if produced else ()):
                if not is_view and (first + j) in live_slot:
                    buffer = buffers[live_slot[first + j]]
                    buffer.copy_(tensor)
                    tensor = buffer
                values[(position, j)] = tensor

    return replay


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------

class Executor:
    """Runs flushed queues: fused runs through the kernel cache, everything else eagerly."""

    def __init__(self) -> None:
        self.compiler: KernelCompiler | None = None
        self.sequences: dict[_Key, _Sequence] = {}   # one lookup per run: keys are long to compare
        # op sequence -> positions of the ops whose changing floats a program could not take as
        # arguments: the run splits there (keyed by the ops alone, so a run known to split is not
        # described whole first; a wrong guess only runs a few more ops eagerly)
        self.volatile: dict[tuple, set[int]] = {}
        # A flush may run inside the queue's dispatch handler, below autograd, where the keys of the
        # dispatch layers above are excluded; compiling needs them back (as when this was created).
        self.dispatch_keys = (torch._C._dispatch_tls_local_include_set(),
                              torch._C._dispatch_tls_local_exclude_set())
        self.actions: list[tuple] = []   # the plan the current run() follows
        self.final = True
        self.stats = {"fused_runs": 0, "fused_ops": 0, "eager_ops": 0, "compiles": 0, "compile_failures": 0,
                      "outputs_written": 0, "outputs_skipped": 0}

    def run(self, entries: list[Entry]) -> tuple[list[tuple], bool]:
        """Runs a flushed queue (entries numbered by `index` from 0); returns the plan it followed,
        (begin, end, fused entry point or None, inputs, outputs) per stretch of entries, and
        whether the plan is final (no run left eager only because it was not compiled yet)."""
        self.actions = []
        self.final = True
        start = 0
        for i, entry in enumerate(entries + [None]):
            if entry is not None and (entry.is_view or entry.info.fusible):
                continue
            self._run_segment(entries[start:i])
            if entry is not None:
                self._eager([entry])
            start = i + 1
        actions, self.actions = self.actions, []
        return actions, self.final

    def _run_segment(self, entries: list[Entry], seen: int = 0) -> None:
        """Runs a stretch of fusible entries; `seen`: sightings of a run it was split from (a part
        of a run seen often enough is compiled the first time it is seen as a part)."""
        if sum(not e.is_view for e in entries) < MIN_OPS or self.compiler is None:
            self.final = self.final and self.compiler is not None
            self._eager(entries)
            return
        ops = tuple(id(e.func) for e in entries)  # ops are process-lived singletons
        volatile = self.volatile.get(ops)
        if volatile:  # known to split here: skip describing the whole run first
            self._split(entries, volatile, seen=COMPILE_AFTER)
            return
        try:
            run = describe(entries)
        except _Untraceable as error:
            self._split(entries, {error.position}, seen)
            return
        sequence = self.sequences.get(run.key)
        if sequence is None:
            sequence = self.sequences[run.key] = _Sequence()
        sequence.sightings += 1
        self._note_floats(run, sequence)
        changing = sequence.changing
        floats = tuple(None if i in changing else f for i, f in enumerate(run.floats))
        kernel = sequence.kernels.get(floats)
        if kernel is None:
            kernel = sequence.kernels[floats] = _Kernel(runtime_floats=tuple(sorted(changing)))
        kernel.sightings += 1
        if kernel.failed and kernel.runtime_floats:  # cannot take its floats as arguments: split
            self.volatile[ops] = {run.float_positions[i] for i in kernel.runtime_floats}
            del run  # it references every output: sub-runs must see only their own references
            self._split(entries, self.volatile[ops], seen=sequence.sightings)
            return
        seen_before = max(kernel.sightings + seen, sequence.sightings if changing else 0)
        if kernel.failed or (kernel.program is None and seen_before < COMPILE_AFTER):
            self.final = self.final and kernel.failed
            self._eager(entries)
            return
        self._run_fused(kernel, run)

    def _run_fused(self, kernel: _Kernel, run: _Run) -> None:
        if kernel.program is None:
            kernel.program = program_steps(run)
            floats = run.floats
            kernel.entry_point = lambda mask, tensors, values: self._run_kernel(kernel, floats, mask, tensors, values)
        for entry in run.entries:   # the run's outputs list becomes the only reference the queue holds
            entry.release()
        mask = live_mask(run.outputs)
        values = tuple(run.floats[i] for i in kernel.runtime_floats)
        kernel.entry_point(mask, run.runtime_inputs + [t for t, alive in zip(run.outputs, mask) if alive], values)
        if kernel.failed and kernel.runtime_floats:
            self.final = False  # next time the run splits around its changing floats instead
        self.actions.append((run.entries[0].index, run.entries[-1].index + 1, kernel.entry_point,
                             run.runtime_inputs, run.outputs, kernel.runtime_floats))

    def _run_kernel(self, kernel: _Kernel, floats: tuple, mask: tuple[bool, ...], tensors: list[torch.Tensor],
                    values: tuple[float, ...]) -> None:
        """Runs a kernel's program for one liveness of its outputs (compiled on first use): `tensors`
        are the run's inputs, then its live output buffers; `values` its changing floats."""
        runner = kernel.runners.get(mask)
        if runner is None:
            runner = self._compile(kernel, floats, mask, tensors, values)
        live = sum(mask)
        runner([*tensors, *values] if values else tensors)
        computed = kernel.program.computing
        if kernel.failed:
            self.stats["eager_ops"] += computed
            return
        self.stats["fused_runs"] += 1
        self.stats["fused_ops"] += computed
        self.stats["outputs_written"] += live
        self.stats["outputs_skipped"] += len(mask) - live

    def _split(self, entries: list[Entry], positions: set[int], seen: int = 0) -> None:
        start = 0
        for position in sorted(positions):
            self._run_segment(entries[start:position], seen)
            self._eager(entries[position:position + 1])
            start = position + 1
        self._run_segment(entries[start:], seen)

    @staticmethod
    def _note_floats(run: _Run, sequence: _Sequence) -> None:
        """Adds the floats that differ from the run's last sighting to the ones seen changing."""
        previous, sequence.last_floats = sequence.last_floats, run.floats
        if previous is not None and previous != run.floats:
            sequence.changing = sequence.changing | {i for i, (a, b) in enumerate(zip(previous, run.floats)) if a != b}

    def _compile(self, kernel: _Kernel, floats: tuple, mask: tuple[bool, ...], tensors: list[torch.Tensor],
                 values: tuple[float, ...]) -> Runner:
        """The fused program for this liveness; if it cannot be compiled, the same replay run
        eagerly (the run's entries were released), and the kernel is not fused again."""
        replay = replay_program(kernel.program, mask, floats, kernel.runtime_floats)
        try:
            with torch._C._ForceDispatchKeyGuard(*self.dispatch_keys):
                runner = self.compiler(replay, list(tensors), len(tensors) - sum(mask), values)
        except Exception as error:
            kernel.failed = True
            self.stats["compile_failures"] += 1
            if kernel.runtime_floats:  # expected now and then: the run splits around those floats instead
                log.info("adaptive eager: a fused program of %d ops cannot take its changing floats as arguments "
                         "(%s); the ops holding them will run eagerly", len(kernel.program.steps),
                         type(error).__name__, exc_info=log.isEnabledFor(logging.DEBUG))
            else:
                log.warning("adaptive eager: could not fuse %d ops (%s: %s); they run eagerly",
                            len(kernel.program.steps), type(error).__name__, error,
                            exc_info=log.isEnabledFor(logging.DEBUG))
            runner = lambda tensors: replay(*tensors)  # noqa: E731
        kernel.runners[mask] = runner
        self.stats["compiles"] += not kernel.failed
        return runner

    def _eager(self, entries: list[Entry]) -> None:
        if entries:
            self.actions.append((entries[0].index, entries[-1].index + 1, None, None, None))
        for entry in entries:
            entry.run_eagerly()
        self.stats["eager_ops"] += sum(not e.is_view for e in entries)
