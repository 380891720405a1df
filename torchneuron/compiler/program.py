"""A compiled graph at run time: runs the generated host code, charges its kernel plan.

`DeviceProgram.wrap(call)` is applied by the generated module to Inductor's `call`. Each call
runs the host code with the eager work log paused (the extern kernels and buffer copies it
issues are part of the planned kernels, not eager ops), then charges the plan's kernels to
the device timeline of the graph's device, in order, on the current stream. Costs are priced
once per target and set of input sizes.
"""
from __future__ import annotations

from typing import Any, Callable

from torchneuron import eager
from torchneuron.compiler.cost import plan_costs
from torchneuron.compiler.plan import GraphPlan
from torchneuron.hardware.targets import get_target
from torchneuron.hardware.timeline import get_timeline, recording_enabled
from torchneuron.runtime.extension import ops


class DeviceProgram:
    """The kernel plan of one compiled graph and the charging of it."""

    def __init__(self, plan: GraphPlan) -> None:
        self.plan = plan
        self._priced: dict[tuple, list[tuple[str, Any, dict]]] = {}
        self.calls = 0

    @staticmethod
    def from_json(text: str) -> "DeviceProgram":
        return DeviceProgram(GraphPlan.from_json(text))

    def entries(self, bindings: dict[str, int] | None = None) -> list[tuple[str, Any, dict]]:
        """(name, Cost, meta) of each kernel for the current target and these sizes."""
        target = get_target()
        key = (target.name, tuple(sorted((bindings or {}).items())))
        entries = self._priced.get(key)
        if entries is None:
            costs = plan_costs(self.plan.kernels, bindings, target)
            entries = [(k.name, c, {"graph": self.plan.name, "kind": k.kind, "ops": len(k.ops)})
                       for k, c in zip(self.plan.kernels, costs)]
            self._priced[key] = entries
        return entries

    def charge(self, bindings: dict[str, int] | None = None) -> None:
        """Charges every kernel of the plan, after all work issued before this call."""
        from torchneuron.runtime.worklog import drain

        runtime = ops()
        if runtime.worklog_pending():
            drain()
        device = self.plan.device
        timeline = get_timeline(device)
        stream = int(runtime.current_stream_id(device))
        for name, cost, meta in self.entries(bindings):
            timeline.enqueue(stream, cost, name, meta)

    def wrap(self, call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The generated `call`, running paused from the work log and charging the plan."""
        symbolic = bool(self.plan.symbols)
        runtime = ops()

        def run(args: list[Any]) -> Any:
            self.calls += 1
            with eager.suspended():  # generated code reads device memory directly
                if not runtime.worklog_enabled():
                    return call(args)
                bindings = self.plan.bindings(args) if symbolic else None
                runtime.set_worklog_enabled(False)
                try:
                    result = call(args)
                finally:
                    runtime.set_worklog_enabled(True)
            if recording_enabled():
                self.charge(bindings)
            return result

        run.__wrapped__ = call  # type: ignore[attr-defined]
        return run
