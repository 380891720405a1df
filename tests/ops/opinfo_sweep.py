"""Runs PyTorch's OpInfo database on neuron and compares every sample with the CPU.

For each OpInfo and dtype (float32, bfloat16, float16), up to MAX_SAMPLES sample inputs run on the CPU
and on neuron, forward and (where the op supports autograd) backward; results must match within
the dtype's tolerance. Samples the CPU itself cannot compute are counted apart, not as passes. Random ops are compared in shape/dtype only (the same seed
gives the same numbers only for generator-driven ops). Run as a script for a report:
    python tests/ops/opinfo_sweep.py [--dtype float32] [--ops name,...]
"""
from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

import torchneuron  # noqa: F401  (before common_device_type)
from torch.testing import assert_close
from torch.testing._internal.common_methods_invocations import op_db

MAX_SAMPLES = 4
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=1e-3, rtol=1e-3)}
GRAD_TOLERANCE = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
                  torch.float16: dict(atol=1e-2, rtol=1e-2)}
# Ops whose results on neuron are CUDA's where the CPU's differ (the meta kernel's, which torch.compile
# traces with): half-precision layer and batch norm save float32 statistics, batch norm in eval mode
# saves the running ones. Values are compared across dtypes; shapes of the CPU's empty statistics
# are not compared; tests/runtime/test_device.py checks both.
CUDA_STATISTICS = frozenset({"native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
                             "_batch_norm_with_update"})
# Batch norm in half precision computes in float32 on neuron, as on CUDA (runtime/csrc/norms.cpp);
# the CPU's half kernels for non-contiguous or channels-last data round intermediates to the data's
# dtype. Where the two differ beyond the tolerance, neuron must be as close as the CPU to the
# float64 result (_no_less_accurate).
FLOAT32_COMPUTE = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                             "nn.functional.batch_norm", "nn.functional.instance_norm"})
NONDETERMINISTIC = ("empty", "new_empty", "rand", "normal", "bernoulli", "multinomial", "uniform",
                    "nn.functional.dropout", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
                    "cauchy", "exponential", "geometric", "log_normal", "randint", "randn", "randperm",
                    "nn.functional.rrelu", "empty_like", "empty_strided", "empty_permuted", "new_empty_strided")


@dataclass
class SweepResult:
    samples_passed: int = 0
    samples_failed: int = 0
    samples_without_reference: int = 0
    keys: list[str] = field(default_factory=list)  # the "op.variant/dtype" entries run, in order
    unreferenced: set[str] = field(default_factory=set)  # entries none of whose samples the CPU computes
    failures: dict[str, str] = field(default_factory=dict)  # "op.variant/dtype" -> first error

    @property
    def ops_run(self) -> int:
        return len(self.keys)

    @property
    def pass_rate(self) -> float:
        total = self.samples_passed + self.samples_failed
        return self.samples_passed / total if total else 1.0

    @classmethod
    def merged(cls, parts: list["SweepResult"]) -> "SweepResult":
        """One result of several sweeps (of other ops or dtypes), in order."""
        result = cls()
        for part in parts:
            result.samples_passed += part.samples_passed
            result.samples_failed += part.samples_failed
            result.samples_without_reference += part.samples_without_reference
            result.keys.extend(part.keys)
            result.unreferenced |= part.unreferenced
            result.failures.update(part.failures)
        return result


class _Timeout(Exception):
    pass


class ReferenceUnavailable(Exception):
    """The CPU itself cannot compute this sample (e.g. a backward without a bf16 kernel)."""


def _alarm(*_):
    raise _Timeout()


def _to_neuron(x):
    """`x` on neuron with its exact geometry: its whole storage is copied and viewed with x's sizes,
    strides and offset, so the device gets what the CPU gets (a transposed, sliced, expanded or
    channels-last tensor stays one; `.to()` would make non-dense tensors contiguous)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.layout != torch.strided or x.is_conj() or x.is_neg() or x.untyped_storage().nbytes() == 0:
        return x.detach().to("neuron").requires_grad_(x.requires_grad)
    storage = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (x.untyped_storage().nbytes() // x.itemsize,))
    dev = storage.to("neuron").as_strided(x.size(), x.stride(), x.storage_offset())
    return dev.detach().requires_grad_(x.requires_grad)


# Tensor arguments PyTorch requires on the CPU on every device (CUDA raises for them too): op name ->
# position in the sample's args, kept on the CPU by device_sample.
CPU_ARGUMENTS = {"tensor_split": 0}  # tensor_indices_or_sections


def device_sample(sample, op=None):
    """The sample with its tensors on neuron (_to_neuron) but the CPU_ARGUMENTS of `op`, and a
    `device="cpu"` argument of a factory (arange, full, randn, ...) made `device="neuron"`: the
    device call must make neuron tensors."""
    dev = sample.transform(_to_neuron)
    keep = CPU_ARGUMENTS.get(getattr(op, "name", None))
    if keep is not None and keep < len(sample.args):
        dev.args = (*dev.args[:keep], sample.args[keep], *dev.args[keep + 1:])
    device = dev.kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        dev.kwargs = {**dev.kwargs, "device": torch.device("neuron")}
    return dev


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _grad_inputs(sample) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _differentiable_outputs(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def _without_empty_statistics(actual, expected) -> tuple[list, list]:
    """The outputs of a CUDA_STATISTICS op but the statistics the CPU saves empty (eval mode)."""
    pairs = zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected))
    kept = [(a, e) for a, e in pairs if not (isinstance(e, torch.Tensor) and e.numel() == 0 != a.numel())]
    return [a for a, _ in kept], [e for _, e in kept]


def _float64(x):
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _no_less_accurate(actual, expected, exact) -> bool:
    """Whether every tensor of `actual` is at least as close to `exact` (float64) as `expected`."""
    for a, e, x in zip(*(torch.utils._pytree.tree_leaves(v) for v in (actual, expected, exact))):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            if (a.double() - x).abs().nan_to_num().max() > (e.double() - x).abs().nan_to_num().max() * 1.01:
                return False
    return True


def assert_matches_cpu(op, actual, expected, dtype: torch.dtype, exact=None, **tolerance) -> None:
    """assert_close with the sweep's tolerances; for FLOAT32_COMPUTE ops in half precision, `exact()`
    (the float64 result) decides where neuron and the CPU differ."""
    try:
        assert_close(actual, expected, equal_nan=True, check_device=False,
                     check_dtype=op.name not in CUDA_STATISTICS, **(tolerance or TOLERANCE[dtype]))
    except AssertionError:
        if not (exact and op.name in FLOAT32_COMPUTE and dtype in (torch.float16, torch.bfloat16)):
            raise
        if not _no_less_accurate(actual, expected, exact()):
            raise


def check_sample(op, sample, dtype: torch.dtype, grad: bool) -> None:
    dev = device_sample(sample, op)
    torch.manual_seed(0)
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
    except _Timeout:
        raise
    except Exception as e:  # noqa: BLE001 - the CPU cannot compute it (jiterator ops are CUDA-only)
        raise ReferenceUnavailable(f"the CPU raises {type(e).__name__}: {e}") from e
    torch.manual_seed(0)
    actual = op(dev.input, *dev.args, **dev.kwargs)
    expected_out = sample.output_process_fn_grad(expected)
    actual_out = torch.utils._pytree.tree_map(_cpu, dev.output_process_fn_grad(actual))
    if op.name.startswith(NONDETERMINISTIC):
        for a, e in zip(torch.utils._pytree.tree_leaves(actual_out), torch.utils._pytree.tree_leaves(expected_out)):
            if isinstance(e, torch.Tensor):
                assert a.shape == e.shape and a.dtype == e.dtype
        return
    if op.name in CUDA_STATISTICS:
        actual_out, expected_out = _without_empty_statistics(actual_out, expected_out)
    assert_matches_cpu(op, actual_out, expected_out, dtype, lambda: _float64_result(op, sample))
    if not grad:
        return
    outs_c, outs_d = _differentiable_outputs(expected), _differentiable_outputs(actual)
    ins_c, ins_d = _grad_inputs(sample), _grad_inputs(dev)
    if not (outs_c and ins_c):
        return
    try:
        gc = torch.autograd.grad(sum(o.sum() for o in outs_c), ins_c, allow_unused=True)
    except (NotImplementedError, RuntimeError) as e:
        raise ReferenceUnavailable(str(e)) from e
    gd = torch.autograd.grad(sum(o.sum() for o in outs_d), ins_d, allow_unused=True)
    assert_matches_cpu(op, [_cpu(g) for g in gd], list(gc), dtype, lambda: _float64_grads(op, sample),
                       **GRAD_TOLERANCE[dtype])


def samples_of(op, dtype: torch.dtype, requires_grad: bool):
    """The OpInfo's CPU samples, as op.sample_inputs gives them but without its test-tracking
    wrapper, which crawls the Python stack for a unittest test case on every call (~0.1 s each in
    a process with torch's modules loaded: most of a sweep's time)."""
    torch.manual_seed(0)
    return iter(op.sample_inputs_func(op, "cpu", dtype, requires_grad))


def _float64_result(op, sample):
    """The sample's result computed in float64 (the exact reference of assert_matches_cpu)."""
    exact = sample.transform(_float64)
    return exact.output_process_fn_grad(op(exact.input, *exact.args, **exact.kwargs))


def _float64_grads(op, sample) -> list:
    """The sample's gradients computed in float64 (the exact reference of assert_matches_cpu)."""
    exact = sample.transform(lambda t: _float64(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                             and t.is_floating_point() else t)
    outs = _differentiable_outputs(op(exact.input, *exact.args, **exact.kwargs))
    return list(torch.autograd.grad(sum(o.sum() for o in outs), _grad_inputs(exact), allow_unused=True))


def op_key(op) -> str:
    """"op.variant" of an OpInfo (its name alone when it has no variant)."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def shard_names(shard: int, shards: int) -> set[str]:
    """Every `shards`-th OpInfo name of op_db, starting at `shard`: a sweep split into test classes
    that `make test` (pytest-xdist, --dist loadscope) runs on different workers. Names are taken in
    op_db order, so that slow and fast families spread over the shards."""
    return set(list(dict.fromkeys(op.name for op in op_db))[shard::shards])


def expected_runs(dtypes, names: set[str] | None = None) -> int:
    """How many (op, dtype) entries a sweep of `names` (all of op_db when empty or None) must run:
    each OpInfo in each of `dtypes` the CPU supports. Counted apart from the sweeps' own loops,
    which the gates check against it."""
    return sum(1 for _ in op_dtype_cases(dtypes, names))


def op_dtype_cases(dtypes, names: set[str] | None = None):
    """(OpInfo, dtype) for every OpInfo of op_db named in `names` (all when empty or None) and each of
    `dtypes` the CPU supports for it, in op_db order: the cases every sweep and its count walk."""
    for op in op_db:
        if names and op.name not in names:
            continue
        for dtype in dtypes:
            if dtype in op.supported_dtypes("cpu"):
                yield op, dtype


def start_sweep() -> None:
    """Per-op time limits (SIGALRM raises _Timeout) and no warnings, for a sweep of many ops."""
    signal.signal(signal.SIGALRM, _alarm)
    warnings.filterwarnings("ignore")


def sweep(dtypes=(torch.float32, torch.bfloat16), names: set[str] | None = None, per_op_seconds: int = 30,
          progress=None) -> SweepResult:
    result = SweepResult()
    start_sweep()
    for op, dtype in op_dtype_cases(dtypes, names):
        key = f"{op_key(op)}/{str(dtype)[6:]}"
        grad = op.supports_autograd
        result.keys.append(key)
        signal.alarm(per_op_seconds)
        try:
            checked = 0
            samples = samples_of(op, dtype, grad)
            for n, sample in enumerate(samples):
                if n >= MAX_SAMPLES:
                    break
                checked += 1
                try:
                    check_sample(op, sample, dtype, grad)
                    result.samples_passed += 1
                except _Timeout:
                    raise
                except ReferenceUnavailable:
                    result.samples_without_reference += 1
                    checked -= 1
                except Exception as e:  # noqa: BLE001 - every failure is recorded by name
                    result.samples_failed += 1
                    result.failures.setdefault(key, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        except _Timeout:
            result.samples_failed += 1
            result.failures.setdefault(key, "timeout")
        except Exception as e:  # noqa: BLE001 - sample generation itself failed on CPU
            result.failures.setdefault(key, f"samples: {type(e).__name__}")
        finally:
            signal.alarm(0)
        if not checked and key not in result.failures:
            result.unreferenced.add(key)
        if progress:
            progress(key)
    return result


def print_failures(failures: dict[str, str]) -> None:
    """The script's report: the commonest kinds of error, then every failure."""
    print(collections.Counter(v.split(":")[0] for v in failures.values()).most_common(10))
    for key, err in sorted(failures.items()):
        print(f"{key}\t{err}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--ops", default="")
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16", "float16"]))
    names = set(filter(None, args.ops.split(","))) or None
    t0 = time.time()
    res = sweep(dtypes, names)
    print(f"ops x dtypes: {res.ops_run}, samples passed {res.samples_passed}, failed {res.samples_failed}, "
          f"pass rate {res.pass_rate:.2%}, no CPU reference {res.samples_without_reference}, {time.time() - t0:.0f}s")
    print_failures(res.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
