"""A compiled graph at run time: runs the generated host code, charges its kernel plan.

`DeviceProgram.wrap(call)` is applied by the generated module to Inductor's `call` (in tiered
mode with the module's background build, whose ATen tier runs until the build is done). Each call
runs the host code with the eager work log paused (the extern kernels and buffer copies it
issues are part of the planned kernels, not eager ops), then charges the plan's kernels to
the device timeline of the graph's device, in order, on the current stream. Costs are priced
once per target and set of input sizes. `recorded_plans()` collects the plans a region charges
with their size bindings, so graphs traced with symbolic shapes can be priced at other sizes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torchneuron import eager
from torchneuron.compiler.cost import plan_costs
from torchneuron.compiler.plan import GraphPlan
from torchneuron.hardware.targets import get_target
from torchneuron.hardware.timeline import get_timeline, has_listeners
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-call Python code


_recorders: list[list[tuple[GraphPlan, dict[str, int]]]] = []


@contextmanager
def recorded_plans() -> Iterator[list[tuple[GraphPlan, dict[str, int]]]]:
    """Collects (plan, size bindings) of every compiled graph charged inside the region. Price
    them at other sizes with `compiler.cost.plan_costs(plan.kernels, bindings, target)`: a graph
    compiled with symbolic shapes (`dynamic=True`, weights passed as inputs) gives the device
    cost of any size without computing it on the host."""
    record: list[tuple[GraphPlan, dict[str, int]]] = []
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


_PRICED_LIMIT = 1024  # priced size bindings kept per program


def _price_key(target: str, bindings: dict[str, int] | None) -> tuple:
    """What a plan's prices depend on: the target and the sizes bound to its symbols."""
    return target, tuple(sorted((bindings or {}).items()))


class DeviceProgram:
    """The kernel plan of one compiled graph and the charging of it."""

    def __init__(self, plan: GraphPlan) -> None:
        self.plan = plan
        self._priced: dict[tuple, list[tuple[str, Any, dict]]] = {}
        self._totals: dict[tuple, tuple[float, dict[str, float], int]] = {}
        self.calls = 0

    @staticmethod
    def from_json(text: str) -> "DeviceProgram":
        return DeviceProgram(GraphPlan.from_json(text))

    def entries(self, bindings: dict[str, int] | None = None) -> list[tuple[str, Any, dict]]:
        """(name, Cost, meta) of each kernel for the current target and these sizes."""
        target = get_target()
        key = _price_key(target.name, bindings)
        entries = self._priced.get(key)
        if entries is None:
            if len(self._priced) >= _PRICED_LIMIT:  # data-dependent sizes: a new key per count
                self._priced.clear()
                self._totals.clear()
            costs = plan_costs(self.plan.kernels, bindings, target)
            entries = [(k.name, c, {"graph": self.plan.name, "kind": k.kind, "ops": len(k.ops)})
                       for k, c in zip(self.plan.kernels, costs)]
            self._priced[key] = entries
        return entries

    def totals(self, bindings: dict[str, int] | None = None) -> tuple[float, dict[str, float], int]:
        """(device seconds, busy seconds per engine, kernel count) of the whole plan."""
        key = _price_key(get_target().name, bindings)
        totals = self._totals.get(key)
        if totals is None:
            busy: dict[str, float] = {}
            entries = self.entries(bindings)
            for _, cost, _ in entries:
                busy[cost.engine] = busy.get(cost.engine, 0.0) + cost.duration_s
            totals = self._totals[key] = (sum(busy.values()), busy, len(entries))
        return totals

    def charge(self, bindings: dict[str, int] | None = None) -> None:
        """Charges every kernel of the plan after all work issued before this call: one by one
        when a listener (the profiler, estimate()) watches the timeline, as one back-to-back block
        otherwise."""
        from torchneuron.hardware.worklog import drain

        for record in _recorders:
            record.append((self.plan, dict(bindings or {})))
        device = self.plan.device
        timeline = get_timeline(device)
        stream = fast.current_stream_id(device)
        if not has_listeners():
            # Pending op records may be applied after the plan: their streams' clocks add up the
            # same. Pending control records (an event, a wait, a sync) must see them first.
            if fast.worklog_pending_control():
                drain()
            timeline.advance(stream, *self.totals(bindings))
            return
        if fast.worklog_pending():
            drain()
        for name, cost, meta in self.entries(bindings):
            timeline.enqueue(stream, cost, name, meta)

    def wrap(self, generated: Callable[[list[Any]], Any], build: Any = None) -> Callable[[list[Any]], Any]:
        """The generated `call`, running paused from the work log and charging the plan. With a
        `build` (tiered.Build, tiered mode), its ATen tier runs instead until the build is done."""
        symbolic = self.plan.symbolic

        def run_logged(args: list[Any]) -> Any:
            nonlocal build
            call = generated
            if build is not None:
                call = build.runner(generated)
                if call is generated:
                    build = None
            # The work log's switch (TORCHNEURON_TIMELINE, worklog.set_enabled) decides for compiled
            # graphs as for eager ops: when recording is off, leave it off and charge nothing.
            if not fast.worklog_exchange_enabled(False):
                return call(args)
            try:
                bindings = self.plan.bindings(args) if symbolic else None  # before `call` clears args
                result = call(args)
            finally:
                fast.worklog_exchange_enabled(True)
            if bindings is not None:
                bindings = self.plan.bind_outputs(bindings, result)
            self.charge(bindings)
            return result

        def run(args: list[Any]) -> Any:
            self.calls += 1
            if eager.get_eager_mode() == "eager":
                return run_logged(args)
            with eager.suspended():  # generated code reads device memory directly
                return run_logged(args)

        run.__wrapped__ = generated  # type: ignore[attr-defined]
        return run
