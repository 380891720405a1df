"""The OpInfo sweep under torch.compile: tests/ops/opinfo_sweep.py's checks, with the neuron side
of every sample run as `torch.compile(op, backend="neuron", fullgraph=False, dynamic=False)`
and compared with the op run eagerly on the CPU (the sweep's tolerances).

`CompiledOp` stands in for an OpInfo in opinfo_sweep.check_sample: its reference call (CPU
tensors) runs the op eagerly, its device call (neuron tensors) runs the op compiled. Dynamo
graph-breaks where it must and runs those parts eagerly, so every op gives a result; the ops for
which it compiles nothing at all are listed (RUN_EAGERLY), so the sweep cannot silently test eager
mode. Each op gets a code object of its own (Dynamo's caches and recompile limits are per op), and
Dynamo is reset only around the whole sweep.

The gate is the whole op_db: one sample per op (two for the ops whose second sample found a bug),
float32, forward; and a few ops in bfloat16 (BF16) and with their backward (GRAD). It takes about
6 min of one core on a cold Inductor cache, in two shards of op names (test classes that
`make test` runs on different workers). Its failures must be exactly COMPILED_KNOWN_FAILURES: bugs of
the neuron compiler, limitations Inductor has on the CPU too (upstream), and what fails eagerly
already; a new failure or a fixed one fails the test.

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

pytestmark = pytest.mark.slow  # ~3 min per shard (conftest.py: a cold Inductor cache per session)
SHARDS = 2

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
        self.key = opinfo_sweep.op_key(op)
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
# The gate's extra samples, dtypes and backward
# ---------------------------------------------------------------------------------------------

RANDOM = "bernoulli nn.functional.dropout normal uniform"  # run under freeze_rng_state (torch.neuron's RNG)
# Two samples: the second is the one that found a bug (batch norm in eval mode; Dynamo tracing
# torch.neuron.set_rng_state under no_dispatch(), fixed by 30509b4).
TWO_SAMPLES = {"native_batch_norm", "_native_batch_norm_legit", *RANDOM.split()}
# bfloat16 and backward, for a few ops of each kind (~20 s more).
BF16 = """add mm softmax nn.functional.layer_norm native_layer_norm native_batch_norm _native_batch_norm_legit
    _batch_norm_with_update grid_sampler_2d nn.functional.grid_sample"""
GRAD = """add mul exp sum mm addmm softmax nn.functional.layer_norm nn.functional.gelu nn.functional.conv2d
    nn.functional.cross_entropy index_select gather"""


# ---------------------------------------------------------------------------------------------
# Known failures: "op.variant/dtype" -> cause
# ---------------------------------------------------------------------------------------------

# Bugs of the neuron device under torch.compile (each passes eagerly, and with Inductor on CPU
# tensors in a process without torchneuron).
NEURON_BUGS: dict[str, str] = {}
# (Batch norm in eval mode and half-precision layer and batch norm were here until the device saved
# CUDA's statistics, which the meta kernels and Inductor's decompositions describe: ops/csrc/norms.cpp.)
# Failures Inductor has on the CPU too, with bit-identical results (not neuron's).
UPSTREAM_LIMITATIONS = {
    # Inductor's decompositions round bf16 intermediates that the eager kernels keep in float32.
    "grid_sampler_2d/bfloat16": "Inductor's bf16 decomposition rounds intermediates (same on CPU)",
}
# Failures of the eager sweep too (tests/ops/test_opinfo.py's KNOWN_FAILURES), for the same reason,
# in float32 (the sweep's bfloat16 ops are only BF16's).
ALSO_EAGER = {key: cause for key, cause in EAGER_KNOWN_FAILURES.items() if key.endswith("/float32")}
COMPILED_KNOWN_FAILURES = {**NEURON_BUGS, **UPSTREAM_LIMITATIONS, **ALSO_EAGER}

# Ops for which Dynamo hands no graph to the backend (they run eagerly): the rest must compile, or
# the sweep would silently test eager mode.
_NO_TENSOR_ARGUMENT = "no tensor argument: the sweep's device call is its CPU call"
_RANDOM = "wrapped in OpInfo's wrapper_set_seed (freeze_rng_state), which Dynamo does not trace"
_DATA_DEPENDENT_SHAPE = "data-dependent output shape: graph break"
_DATA_DEPENDENT_VALUE = "a Python value computed from tensor data: graph break"
RUN_EAGERLY = {
    **{name: _NO_TENSOR_ARGUMENT for name in (
        "arange", "broadcast_shapes", "empty", "empty_permuted", "empty_strided", "eye", "full", "linspace",
        "logspace", "ones", "randint", "randn", "scalar_tensor", "zeros", "signal.windows.bartlett",
        "signal.windows.blackman", "signal.windows.cosine", "signal.windows.exponential",
        "signal.windows.gaussian", "signal.windows.general_cosine", "signal.windows.general_hamming",
        "signal.windows.hamming", "signal.windows.hann", "signal.windows.kaiser", "signal.windows.nuttall")},
    **{name: _RANDOM for name in (
        "bernoulli", "cauchy", "exponential", "geometric", "item", "log_normal", "multinomial",
        "nn.functional.alpha_dropout", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
        "nn.functional.feature_alpha_dropout.with_train", "nn.functional.feature_alpha_dropout.without_train",
        "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
        "nn.functional.multi_head_attention_forward", "nn.functional.rrelu",
        "nn.functional.scaled_dot_product_attention", "normal", "normal.in_place", "normal.number_mean",
        "pca_lowrank", "rand_like", "randint_like", "randn_like", "svd_lowrank", "uniform")},
    **{name: _DATA_DEPENDENT_SHAPE for name in (
        "argwhere", "combinations", "linalg.lstsq", "linalg.lstsq.grad_oriented", "masked_select",
        "nn.functional.ctc_loss", "nonzero", "unique", "unique_consecutive")},
    **{name: _DATA_DEPENDENT_VALUE for name in (
        "allclose", "corrcoef", "cov", "equal", "nn.functional.gaussian_nll_loss",
        "tensor_split")},  # (tensor_split: its sections are a CPU tensor's values)
    "resize_": "Dynamo does not trace Tensor.resize_",
    "resize_as_": "Dynamo does not trace Tensor.resize_as_",
    **{name: "the CPU cannot run it (CUDA-only): the device call never runs" for name in (
        "jiterator_2inputs_2outputs", "jiterator_4inputs_with_extra_args", "jiterator_binary",
        "jiterator_binary_return_by_ref", "jiterator_unary")},
    **{name: "fails eagerly too (ALSO_EAGER)" for name in ("sparse.mm.reduce", "sparse.sampled_addmm", "to_sparse")},
}


def run_gate_sweep(names: set[str]) -> opinfo_sweep.SweepResult:
    """The gate's sweeps of the ops `names` (float32; bfloat16 for BF16; backward for GRAD), merged
    into one result."""
    samples = lambda op: 2 if op.name in TWO_SAMPLES else 1  # noqa: E731
    parts = [compiled_sweep((torch.float32,), names, samples, grad_ops=set(GRAD.split()) & names)]
    if set(BF16.split()) & names:
        parts.append(compiled_sweep((torch.bfloat16,), set(BF16.split()) & names, samples))
    result = opinfo_sweep.SweepResult.merged(parts)
    result.graphs = {}
    for part in parts:
        for key, graphs in part.graphs.items():
            result.graphs[key] = result.graphs.get(key, 0) + graphs
    result.seconds = sum(part.seconds for part in parts)
    return result


def expected_runs(names: set[str]) -> int:
    """(op, dtype) entries the gate's sweeps of `names` run (run_gate_sweep's two parts)."""
    bf16_names = set(BF16.split()) & names
    return (opinfo_sweep.expected_runs((torch.float32,), names)
            + (opinfo_sweep.expected_runs((torch.bfloat16,), bf16_names) if bf16_names else 0))


class _CompiledGate:
    """The gate's checks on one shard of the op database."""

    shard: int

    @pytest.fixture(scope="class")
    @classmethod
    def result(cls):
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("TORCHNEURON_COMPILE_FALLBACK", raising=False)  # a failure must fail, not run eagerly
            torch._dynamo.reset()
            torch.manual_seed(0)
            try:
                yield run_gate_sweep(opinfo_sweep.shard_names(cls.shard, SHARDS))
            finally:
                torch._dynamo.reset()

    def test_failures_are_exactly_the_known_issues(self, result):
        ran = set(result.keys)
        new = {k: v for k, v in result.failures.items() if k not in COMPILED_KNOWN_FAILURES}
        fixed = sorted(k for k in COMPILED_KNOWN_FAILURES if k in ran and k not in result.failures)
        assert not new, f"new failures under torch.compile(backend='neuron'): {new}"
        assert not fixed, f"known failures now pass, remove them from COMPILED_KNOWN_FAILURES: {fixed}"

    def test_every_op_compiles_but_the_listed_ones(self, result):
        eager = sorted(k for k, graphs in result.graphs.items() if graphs == 0)
        assert eager == sorted(k for k in RUN_EAGERLY if k in result.graphs), f"ops that compiled no graph: {eager}"

    def test_every_op_of_the_shard_ran(self, result):
        assert result.ops_run == expected_runs(opinfo_sweep.shard_names(self.shard, SHARDS))


class TestShard0(_CompiledGate):
    shard = 0


class TestShard1(_CompiledGate):
    shard = 1


def test_every_listed_op_exists():
    keys = {opinfo_sweep.op_key(op) for op in opinfo_sweep.op_db}
    assert set(RUN_EAGERLY) <= keys
    assert {k.rsplit("/", 1)[0] for k in COMPILED_KNOWN_FAILURES} <= keys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all of op_db)")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--grad", action="store_true", help="also check the backward of every op")
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in (args.dtype or ["float32"]))
    names = set(filter(None, args.ops.split(","))) or None
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
