"""The OpInfo sweep under torch.compile: tests/ops/opinfo_sweep.py's checks, with the neuron side
of every sample run as `torch.compile(op, backend="neuron", fullgraph=False, dynamic=False)`
and compared with the op run eagerly on the CPU (the sweep's tolerances).

`CompiledOp` stands in for an OpInfo in opinfo_sweep.check_sample: its reference call (CPU
tensors) runs the op eagerly, its device call (neuron tensors) runs the op compiled. Dynamo
graph-breaks where it must and runs those parts eagerly, so every op gives a result; the ops for
which it compiles nothing at all are listed (RUN_EAGERLY), so the sweep cannot silently test eager
mode. Each op gets a code object of its own (Dynamo's caches and recompile limits are per op), and
Dynamo is reset only around the whole sweep.

The whole op_db takes about 5 min on two cores (float32, one sample per op, forward; 7 min with
two samples, 9 min with backward), so the gate covers a subset that takes about 3 min: every
pointwise (unary and binary ufunc) and reduction OpInfo but torch.special's and a few other
spellings (UFUNCS_LEFT_OUT), plus the matmul, normalisation, indexing, layout and nn ops named
below; one sample each (two for the ops whose second sample found a bug), float32, forward; and a
few ops in bfloat16 (BF16) and with their backward (GRAD). Its failures must be exactly
COMPILED_KNOWN_FAILURES: bugs of the neuron compiler, limitations Inductor has on the CPU too
(upstream), and what fails eagerly already; a new failure or a fixed one fails the test.

Run as a script for the whole op_db (or some ops), with a report:
    python -m tests.compiler.test_opinfo_compiled [--dtype bfloat16] [--samples 2] [--grad] [--ops a,b]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

import pytest
import torch
from torch.utils._pytree import tree_leaves

from tests.ops import opinfo_sweep
from tests.ops.test_opinfo import KNOWN_FAILURES as EAGER_KNOWN_FAILURES

pytestmark = pytest.mark.slow  # ~3 min on two cores (conftest.py: a cold Inductor cache per session)

# ---------------------------------------------------------------------------------------------
# The compiled sweep
# ---------------------------------------------------------------------------------------------

_backends: dict[str, object] = {}
_running: list = [None]  # the CompiledOp whose compiled call is running


def _counting_backend(name: str):
    """The backend `name`, counting the graphs (with at least one op) it compiles for the running
    CompiledOp. One callable per backend for all ops: Dynamo guards on the backend's identity, so a
    callable per op would recompile every frame ops share (torch.neuron's own Python, ...)."""
    backend = _backends.get(name)
    if backend is None:
        from torch._dynamo import lookup_backend

        compiler = lookup_backend(name)

        def backend(gm, example_inputs):
            if _running[0] is not None and any(n.op in ("call_function", "call_method") for n in gm.graph.nodes):
                _running[0].graphs += 1
            return compiler(gm, example_inputs)

        backend.__name__ = f"counting_{name}"
        _backends[name] = backend
    return backend


class CompiledOp:
    """An OpInfo for opinfo_sweep.check_sample whose device call runs compiled."""

    def __init__(self, op, backend: str = "neuron"):
        self.op, self.name = op, op.name
        self.key = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        self.graphs = 0  # graphs with ops Dynamo handed to the backend (0: the op ran eagerly)
        namespace = {"op": op.op}  # a code object of its own: Dynamo caches frames per code object
        exec(compile("def run(*args, **kwargs):\n    return op(*args, **kwargs)\n", f"<compiled {self.key}>", "exec"),
             namespace)
        self.compiled = torch.compile(namespace["run"], backend=_counting_backend(backend), fullgraph=False,
                                      dynamic=False)

    @staticmethod
    def is_device_call(leaves) -> bool:
        """check_sample's reference call has CPU tensors only; its device call, neuron tensors."""
        return any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in leaves)

    def __call__(self, *args, **kwargs):
        if not self.is_device_call(tree_leaves((args, kwargs))):
            return self.op(*args, **kwargs)
        _running[0] = self
        try:
            return self.compiled(*args, **kwargs)
        finally:
            _running[0] = None


def _detached(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def _caused_by_timeout(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, opinfo_sweep._Timeout):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__ or getattr(error, "inner_exception", None)
    return False


@contextlib.contextmanager
def compiled_checks(samples, grad_ops, backend: str, wrapper: type):
    """opinfo_sweep.sweep() with every sample checked through `wrapper` (forward only, but for
    ops named in grad_ops) and at most samples(op) samples per op. Yields the wrappers made and
    the number of samples skipped (the sweep counts them as passed)."""
    original_check, original_max = opinfo_sweep.check_sample, opinfo_sweep.MAX_SAMPLES
    wrappers: dict[int, CompiledOp] = {}
    seen: collections.Counter = collections.Counter()
    skipped = [0]

    def check(op, sample, dtype, grad):
        seen[id(op), dtype] += 1
        if seen[id(op), dtype] > samples(op):
            skipped[0] += 1
            return
        wrapped = wrappers.get(id(op))
        if wrapped is None:
            wrapped = wrappers[id(op)] = wrapper(op, backend)
        grad = grad and op.name in grad_ops
        if not grad:
            sample = sample.transform(_detached)  # no autograd graph: no backward compiled
        try:
            original_check(wrapped, sample, dtype, grad)
        except opinfo_sweep._Timeout:
            raise
        except Exception as error:
            if _caused_by_timeout(error):  # the alarm fired inside Dynamo or Inductor
                raise opinfo_sweep._Timeout() from None
            raise

    opinfo_sweep.check_sample = check
    opinfo_sweep.MAX_SAMPLES = max(samples(op) for op in opinfo_sweep.op_db)
    try:
        yield wrappers, skipped
    finally:
        opinfo_sweep.check_sample, opinfo_sweep.MAX_SAMPLES = original_check, original_max


def compiled_sweep(dtypes=(torch.float32,), names=None, samples=1, grad_ops=frozenset(), per_op_seconds=60,
                   backend="neuron", wrapper=CompiledOp, progress=None) -> opinfo_sweep.SweepResult:
    """opinfo_sweep.sweep() through torch.compile. `samples`: per op, an int or a function of the
    OpInfo. The result also has `graphs` ("op.variant" -> graphs compiled) and `seconds`."""
    limit = samples if callable(samples) else (lambda op: samples)

    def next_op(key):
        torch.manual_seed(0)  # each op's samples are the same whichever ops ran before it
        if progress:
            progress(key)

    start = time.time()
    torch.manual_seed(0)
    with compiled_checks(limit, grad_ops, backend, wrapper) as (wrappers, skipped):
        result = opinfo_sweep.sweep(dtypes, names, per_op_seconds=per_op_seconds, progress=next_op)
    result.samples_passed -= skipped[0]
    result.graphs = {w.key: w.graphs for w in wrappers.values()}
    result.seconds = time.time() - start
    return result


# ---------------------------------------------------------------------------------------------
# The gate's subset
# ---------------------------------------------------------------------------------------------

MATMUL = """__rmatmul__ addbmm addmm addmv addr baddbmm bmm dot einsum inner kron linalg.multi_dot linalg.vecdot
    matmul mm mv nn.functional.bilinear nn.functional.linear outer tensordot vdot"""
NORM = """_batch_norm_with_update _native_batch_norm_legit linalg.norm log_softmax logsumexp
    native_batch_norm native_group_norm native_layer_norm nn.functional.batch_norm nn.functional.group_norm
    nn.functional.instance_norm nn.functional.layer_norm nn.functional.local_response_norm nn.functional.normalize
    nn.functional.rms_norm nn.functional.softmin renorm softmax"""
INDEXING = """__getitem__ _unsafe_masked_index _unsafe_masked_index_put_accumulate as_strided as_strided_scatter
    bucketize diagonal diagonal_scatter gather index_add index_copy index_fill index_put index_reduce index_select
    masked_fill masked_scatter masked_select narrow nn.functional.embedding nonzero nonzero_static put scatter
    scatter_add scatter_reduce searchsorted select select_scatter slice slice_scatter take take_along_dim
    tensor_split where"""
LAYOUT = "cat constant_pad_nd flip repeat roll tril"  # (views alone compile to no kernel)
NN = """addcdiv addcmul argsort clamp cumprod cumsum lerp nn.functional.adaptive_avg_pool2d nn.functional.avg_pool2d
    nn.functional.binary_cross_entropy nn.functional.conv1d nn.functional.conv2d nn.functional.conv3d
    nn.functional.conv_transpose1d nn.functional.conv_transpose2d nn.functional.conv_transpose3d
    nn.functional.cross_entropy nn.functional.gelu nn.functional.glu nn.functional.hardswish nn.functional.leaky_relu
    nn.functional.max_pool2d nn.functional.mse_loss nn.functional.nll_loss sort topk"""
RANDOM = "bernoulli nn.functional.dropout normal uniform"  # run under freeze_rng_state (torch.neuron's RNG)
# Two samples: the second is the one that found a bug (batch norm in eval mode; Dynamo tracing
# torch.neuron.set_rng_state under no_dispatch(), fixed by 30509b4). The convolutions of NN
# found the channels_last stride mismatch fixed by e934a9c.
TWO_SAMPLES = {"native_batch_norm", "_native_batch_norm_legit", *RANDOM.split()}
# bfloat16 and backward, for a few ops of each kind (~20 s more).
BF16 = """add mm softmax nn.functional.layer_norm native_layer_norm native_batch_norm _native_batch_norm_legit
    _batch_norm_with_update grid_sampler_2d nn.functional.grid_sample"""
GRAD = """add mul exp sum mm addmm softmax nn.functional.layer_norm nn.functional.gelu nn.functional.conv2d
    nn.functional.cross_entropy index_select gather"""
# Ufuncs left out (for time): other spellings of covered ops, special functions, and conversions to
# dtypes the NeuronCore lacks (host ops).
UFUNCS_LEFT_OUT = """__radd__ __rand__ __rdiv__ __rmod__ __rmul__ __ror__ __rpow__ __rsub__ __rxor__ rsub true_divide
    positive conj_physical polygamma mvlgamma i0 igamma igammac cdouble cfloat chalf double"""


def subset() -> set[str]:
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, UnaryUfuncInfo

    left_out = set(UFUNCS_LEFT_OUT.split())
    ufuncs = {op.name for op in opinfo_sweep.op_db
              if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo, ReductionOpInfo)) and op.name not in left_out
              and not op.name.startswith(("special.", "masked.", "jiterator_"))}
    return ufuncs | set(" ".join((MATMUL, NORM, INDEXING, LAYOUT, NN, RANDOM)).split())


# ---------------------------------------------------------------------------------------------
# Known failures: "op.variant/dtype" -> cause
# ---------------------------------------------------------------------------------------------

# Bugs of the neuron device under torch.compile (each passes eagerly, and with Inductor on CPU
# tensors in a process without torchneuron).
NEURON_BUGS = {
    # The runtime runs the CPU kernel, which returns empty saved statistics in eval mode; the fake
    # (meta) kernel and Inductor's decomposition give any device but "cpu" CUDA's [C] ones.
    "native_batch_norm/float32": "eval-mode save_mean/save_invstd: [C] compiled, [0] eagerly (CPU kernel)",
    "_native_batch_norm_legit/float32": "eval-mode save_mean/save_invstd: [C] compiled, [0] eagerly (CPU kernel)",
    # The CPU kernels return bf16 statistics for bf16 inputs; the fake kernels and the decompositions
    # (torch._refs.native_layer_norm: only "cpu"/"mtia") return float32 ones on other devices.
    "native_batch_norm/bfloat16": "saved mean/invstd float32 compiled, bfloat16 eagerly (CPU kernel)",
    "_native_batch_norm_legit/bfloat16": "saved mean/invstd float32 compiled, bfloat16 eagerly (CPU kernel)",
    "_batch_norm_with_update/bfloat16": "saved mean/invstd float32 compiled, bfloat16 eagerly (CPU kernel)",
    "native_layer_norm/bfloat16": "mean/rstd float32 compiled, bfloat16 eagerly (CPU kernel)",
}
# Failures Inductor has on the CPU too, with bit-identical results (not neuron's).
UPSTREAM_LIMITATIONS = {
    # Inductor's decompositions round bf16 intermediates that the eager kernels keep in float32.
    "grid_sampler_2d/bfloat16": "Inductor's bf16 decomposition rounds intermediates (same on CPU)",
    "nn.functional.grid_sample/bfloat16": "Inductor's bf16 decomposition rounds intermediates (same on CPU)",
}
# Failures of the eager sweep too (tests/ops/test_opinfo.py's KNOWN_FAILURES), for the same reason.
ALSO_EAGER = {key: EAGER_KNOWN_FAILURES[key] for key in ("tensor_split/float32",)}
COMPILED_KNOWN_FAILURES = {**NEURON_BUGS, **UPSTREAM_LIMITATIONS, **ALSO_EAGER}

# Ops of the subset for which Dynamo hands no graph to the backend (they run eagerly): the rest
# must compile, or the sweep would silently test eager mode.
RUN_EAGERLY = {
    "masked_select": "data-dependent output shape: graph break",
    "nonzero": "data-dependent output shape: graph break",
    "tensor_split": "fails while tracing (index tensor on neuron, as eagerly)",
    # OpInfo runs random ops under freeze_rng_state(), which Dynamo does not trace (no_dispatch(),
    # torch.neuron's RNG state functions): the wrapped op runs eagerly.
    **{name: "random op under freeze_rng_state: graph breaks" for name in (
        "bernoulli", "nn.functional.dropout", "nn.functional.rrelu", "normal", "normal.in_place",
        "normal.number_mean", "uniform")},
}


def run_gate_sweep() -> opinfo_sweep.SweepResult:
    """The gate's sweeps (float32 subset; bfloat16; backward), merged into one result."""
    samples = lambda op: 2 if op.name in TWO_SAMPLES else 1  # noqa: E731
    parts = [compiled_sweep((torch.float32,), subset(), samples, grad_ops=set(GRAD.split())),
             compiled_sweep((torch.bfloat16,), set(BF16.split()), samples)]
    result = opinfo_sweep.SweepResult()
    result.graphs, result.seconds = {}, 0.0
    for part in parts:
        result.samples_passed += part.samples_passed
        result.samples_failed += part.samples_failed
        result.samples_without_reference += part.samples_without_reference
        result.ops_run += part.ops_run
        result.failures.update(part.failures)
        for key, graphs in part.graphs.items():
            result.graphs[key] = result.graphs.get(key, 0) + graphs
        result.seconds += part.seconds
    return result


@pytest.fixture(scope="module")
def result():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCHNEURON_COMPILE_FALLBACK", raising=False)  # a failure must fail, not run eagerly
        torch._dynamo.reset()
        torch.manual_seed(0)
        try:
            yield run_gate_sweep()
        finally:
            torch._dynamo.reset()


def test_failures_are_exactly_the_known_issues(result):
    new = {k: v for k, v in result.failures.items() if k not in COMPILED_KNOWN_FAILURES}
    fixed = sorted(k for k in COMPILED_KNOWN_FAILURES if k not in result.failures)
    assert not new, f"new failures under torch.compile(backend='neuron'): {new}"
    assert not fixed, f"known failures now pass, remove them from COMPILED_KNOWN_FAILURES: {fixed}"


def test_the_subset_is_compiled(result):
    eager = sorted(k for k, graphs in result.graphs.items() if graphs == 0)
    assert eager == sorted(RUN_EAGERLY), f"ops that compiled no graph: {eager}"


def test_every_op_of_the_subset_ran(result):
    swept = ((torch.float32, subset()), (torch.bfloat16, set(BF16.split())))
    expected = sum(1 for op in opinfo_sweep.op_db for dtype, names in swept
                   if op.name in names and dtype in op.supported_dtypes("cpu"))
    assert result.ops_run == expected


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all of op_db)")
    parser.add_argument("--subset", action="store_true", help="the gate's float32 subset instead of all ops")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--grad", action="store_true", help="also check the backward of every op")
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in (args.dtype or ["float32"]))
    names = set(filter(None, args.ops.split(","))) or (subset() if args.subset else None)
    grad_ops = {op.name for op in opinfo_sweep.op_db} if args.grad else frozenset()
    os.environ.pop("TORCHNEURON_COMPILE_FALLBACK", None)
    start = time.time()
    res = compiled_sweep(dtypes, names, args.samples, grad_ops,
                         progress=lambda key: print(f"{time.time() - start:7.1f}s {key}", file=sys.stderr))
    print(f"ops x dtypes: {res.ops_run}, samples passed {res.samples_passed}, failed {res.samples_failed}, "
          f"pass rate {res.pass_rate:.2%}, {res.seconds:.0f}s")
    for key, err in sorted(res.failures.items()):
        tag = "known" if key in COMPILED_KNOWN_FAILURES else "NEW"
        print(f"{tag}\t{key}\t{err}")
    print("ran eagerly (no graph):", sorted(k for k, g in res.graphs.items() if g == 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
