"""The kernel plan of a compiled graph: what the NeuronCore runs, kernel by kernel.

Plain, JSON-serialisable records shared by the compiler stages and the runtime:

- `TensorSpec`: dtype and shape of a tensor (a symbolic dimension is kept as the text of its
  sympy expression, evaluated at run time from the graph's inputs);
- `OpSpec`: one aten op inside a kernel, with its tensor inputs and outputs;
- `KernelSpec`: one dispatched kernel: its ops, the tensors it reads from and writes to HBM,
  and where it runs ("device", or "host" for a CPU fallback);
- `GraphPlan`: the kernels of one graph in execution order, the device, and where each
  size symbol comes from in the graph's inputs.

The plan is embedded in Inductor's generated module (codegen.py) and priced by cost.py.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

PLAN_META_KEY = "torchneuron_plan"  # where the graph pass leaves a graph's GraphPlan (GraphModule.meta)

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[Dim, ...]

    @staticmethod
    def of(value: Any) -> "TensorSpec | None":
        """The spec of a (fake) tensor, or None for anything else."""
        if not isinstance(value, torch.Tensor):
            return None
        return TensorSpec(str(value.dtype).removeprefix("torch."), tuple(_dim(s) for s in value.shape))

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def nbytes(self, bindings: dict[str, int] | None = None) -> int:
        numel = 1
        for d in self.resolve(bindings):
            numel *= d
        return numel * self.torch_dtype().itemsize

    def resolve(self, bindings: dict[str, int] | None = None) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else evaluate(d, bindings or {}) for d in self.shape)


def _dim(size: Any) -> Dim:
    if isinstance(size, int):
        return size
    node_expr = getattr(getattr(size, "node", None), "expr", None)
    if node_expr is not None and getattr(node_expr, "is_number", False):
        return int(node_expr)
    return str(node_expr if node_expr is not None else size)


_compiled_exprs: dict[str, Any] = {}


def evaluate(expr: str, bindings: dict[str, int]) -> int:
    """Value of a sympy expression text such as "s0*s1" under `bindings` (symbol name -> int)."""
    fn = _compiled_exprs.get(expr)
    if fn is None:
        import sympy

        parsed = sympy.sympify(expr)
        names = sorted(str(s) for s in parsed.free_symbols)
        fn = (names, sympy.lambdify([sympy.Symbol(n) for n in names], parsed, modules="math"))
        _compiled_exprs[expr] = fn
    names, body = fn
    try:
        return int(body(*(bindings[n] for n in names)))
    except KeyError as missing:
        raise KeyError(f"size symbol {missing} of {expr!r} has no value at run time") from None


@dataclass(frozen=True)
class OpSpec:
    op: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass
class KernelSpec:
    name: str
    kind: str                      # "fused", "matmul", "reduction", "pointwise", "nki", "op", "host"
    ops: list[OpSpec]
    reads: list[TensorSpec]
    writes: list[TensorSpec]
    placement: str = "device"      # "device" or "host" (a CPU fallback)
    nodes: list[str] = field(default_factory=list)  # FX node names, for reports


@dataclass
class GraphPlan:
    name: str
    device: int
    kernels: list[KernelSpec]
    symbols: dict[str, tuple[int, int]] = field(default_factory=dict)  # symbol -> (input index, dim or -1)
    # Data-dependent sizes (unbacked symbols: nonzero's count, x[mask]'s rows) that size tensors of
    # the plan: where a graph output shows each one (output index, dim), and the value to price it
    # at when no output does (its upper bound when finite, else its lower bound).
    unbacked: dict[str, tuple[int, int]] = field(default_factory=dict)
    unbacked_defaults: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "GraphPlan":
        raw = json.loads(text)

        def tensor(t: dict) -> TensorSpec:
            return TensorSpec(t["dtype"], tuple(t["shape"]))

        def op(o: dict) -> OpSpec:
            return OpSpec(o["op"], tuple(map(tensor, o["inputs"])), tuple(map(tensor, o["outputs"])))

        kernels = [KernelSpec(k["name"], k["kind"], [op(o) for o in k["ops"]], [tensor(t) for t in k["reads"]],
                              [tensor(t) for t in k["writes"]], k["placement"], list(k["nodes"]))
                   for k in raw["kernels"]]
        symbols = {name: (int(src[0]), int(src[1])) for name, src in raw["symbols"].items()}
        unbacked = {name: (int(src[0]), int(src[1])) for name, src in raw.get("unbacked", {}).items()}
        defaults = {name: int(value) for name, value in raw.get("unbacked_defaults", {}).items()}
        return GraphPlan(raw["name"], int(raw["device"]), kernels, symbols, unbacked, defaults)

    @property
    def symbolic(self) -> bool:
        """Whether pricing the plan needs size bindings (symbolic inputs or data-dependent sizes)."""
        return bool(self.symbols or self.unbacked_defaults)

    def bindings(self, args: list[Any]) -> dict[str, int]:
        """Values of the size symbols for one call's inputs (data-dependent sizes at their defaults
        until `bind_outputs` reads them from the call's results)."""
        values = dict(self.unbacked_defaults)
        for name, (index, dim) in self.symbols.items():
            arg = args[index]
            values[name] = int(arg) if dim < 0 else int(arg.shape[dim])
        return values

    def bind_outputs(self, bindings: dict[str, int], outputs: Any) -> dict[str, int]:
        """`bindings` with each data-dependent size a graph output shows set to its value in this
        call's `outputs` (the generated code's results, in graph output order)."""
        if not self.unbacked or not isinstance(outputs, (list, tuple)):
            return bindings
        for name, (index, dim) in self.unbacked.items():
            value = outputs[index] if index < len(outputs) else None
            if isinstance(value, torch.Tensor) and dim < value.dim():
                bindings[name] = int(value.shape[dim])
            elif dim < 0 and isinstance(value, int):
                bindings[name] = value
        return bindings

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kernel in self.kernels:
            key = kernel.kind if kernel.placement == "device" else "host"
            counts[key] = counts.get(key, 0) + 1
        counts["ops"] = sum(len(k.ops) for k in self.kernels)
        return counts
