"""Errors the neuron compiler raises."""
from __future__ import annotations


class NeuronCompileError(RuntimeError):
    """A graph could not be compiled for the NeuronCore; names the op and the reason.

    Set TORCHNEURON_COMPILE_FALLBACK=eager to run such graphs eagerly instead.
    """

    def __init__(self, reason: str, op: str | None = None, graph: str | None = None) -> None:
        self.op = op
        self.reason = reason
        self.graph = graph
        where = f" in graph {graph}" if graph else ""
        what = f"{op}: " if op else ""
        super().__init__(f"neuron compiler: cannot compile{where}: {what}{reason}. Set "
                         "TORCHNEURON_COMPILE_FALLBACK=eager to run graphs that fail to compile eagerly.")
