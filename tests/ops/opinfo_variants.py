"""PyTorch's OpInfo variants on neuron, each compared with the same call on the CPU.

opinfo_sweep.py checks every op on its samples as given. This module runs the variants PyTorch's
own device tests run (test_ops.py: test_noncontiguous_samples, test_out, test_out_warning,
test_variant_consistency_eager, the channels-last tests of conv and norm modules), and judges each
by what the CPU does for the same call, not by a rule of our own:

- noncontiguous: `sample.noncontiguous()`, forward and backward (opinfo_sweep.check_sample);
- out: `out=` tensors of the right size, contiguous and strided: the result *is* `out`, its
  storage (data_ptr) and strides are kept as the CPU keeps them; an `out=` of a dtype the result
  cannot be cast to raises as it does on the CPU;
- out_resize: `out=` tensors that need resizing (empty, or of a wrong size): resized to the CPU's
  sizes and strides, with PyTorch's "An output with one or more elements was resized" warning
  exactly when the CPU gives it;
- inplace: `op.inplace_variant` on a copy of the input: the result *is* the input, its values and
  strides are the CPU's, errors (a dtype promotion in-place ops reject, a broadcast of the input)
  are the CPU's; backward through the in-place op gives the CPU's gradients;
- channels_last: conv, norm, pooling and resampling ops with their 4-d (5-d) tensors in
  channels_last (channels_last_3d): values, the results' strides, gradients and their strides.

A case is one (op, dtype, variant); it passes when all its samples do. Which samples a variant
uses is `VARIANT_SAMPLES` (the first per op: the variants test how the device treats geometry and
out= tensors, which the first sample exercises as well as later ones; the contiguous sweep covers
the ops' value ranges with up to opinfo_sweep.MAX_SAMPLES).
Run as a script for a report:
    python -m tests.ops.opinfo_variants [--dtype float16] [--variant out] [--ops name,...]
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
from torch.testing._internal.common_utils import noncontiguous_like
from torch.utils._pytree import tree_leaves, tree_map

from tests.ops import opinfo_sweep
from tests.ops.opinfo_sweep import ReferenceUnavailable, op_key

VARIANTS = ("noncontiguous", "out", "out_resize", "inplace", "channels_last")
VARIANT_SAMPLES = {"noncontiguous": 1, "out": 1, "out_resize": 1, "inplace": 1, "channels_last": 2}
# Ops whose results depend on their memory format on the CPU (kernels of their own for
# channels_last): convolutions, norms, pooling, resampling, pixel shuffles.
CHANNELS_LAST_OPS = ("nn.functional.conv", "conv", "nn.functional.batch_norm", "native_batch_norm",
                     "_native_batch_norm_legit", "_batch_norm_with_update", "nn.functional.instance_norm",
                     "nn.functional.group_norm", "native_group_norm", "nn.functional.layer_norm",
                     "nn.functional.rms_norm", "nn.functional.local_response_norm", "nn.functional.max_pool",
                     "nn.functional.avg_pool", "nn.functional.adaptive_max_pool", "nn.functional.adaptive_avg_pool",
                     "nn.functional.interpolate", "nn.functional.upsample", "nn.functional.pixel_",
                     "nn.functional.grid_sample", "grid_sampler", "nn.functional.unfold", "nn.functional.fold",
                     "nn.functional.lp_pool", "nn.functional.max_unpool", "nn.functional.channel_shuffle",
                     "nn.functional.pad", "nn.functional.prelu", "nn.functional.dropout2d")
RESIZE_WARNING = "An output with one or more elements was resized"


@dataclass
class VariantResult:
    """Cases passed and failed per (variant, dtype), and the first error of each failed case."""

    passed: collections.Counter = field(default_factory=collections.Counter)
    failed: collections.Counter = field(default_factory=collections.Counter)
    failures: dict[str, str] = field(default_factory=dict)  # "op.variant/dtype/variant" -> first error
    keys: list[str] = field(default_factory=list)

    def rate(self, variant: str | None = None, dtype: str | None = None) -> float:
        match = lambda k: (variant is None or k[0] == variant) and (dtype is None or k[1] == dtype)  # noqa: E731
        passed = sum(n for k, n in self.passed.items() if match(k))
        total = passed + sum(n for k, n in self.failed.items() if match(k))
        return passed / total if total else 1.0

    def cases(self, variant: str | None = None) -> int:
        return sum(n for k, n in (self.passed + self.failed).items() if variant is None or k[0] == variant)

    def summary(self) -> str:
        """One line per variant: its pass rate per dtype and over all dtypes."""
        dtypes = sorted({k[1] for k in self.passed + self.failed})
        lines = []
        for variant in dict.fromkeys(k[0] for k in self.passed + self.failed):
            per = ", ".join(f"{d} {self.rate(variant, d):.2%}" for d in dtypes)
            lines.append(f"{variant:>14}: {self.rate(variant):.2%} of {self.cases(variant)} cases ({per})")
        lines.append(f"{'all variants':>14}: {self.rate():.2%} of {self.cases()} op-dtype-variant cases")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running one call on the CPU and on neuron
# ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    result: object = None
    error: BaseException | None = None
    resize_warned: bool = False


def _run(fn) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        try:
            result = fn()
        except opinfo_sweep._Timeout:
            raise
        except Exception as e:  # noqa: BLE001 - compared with the CPU's outcome
            return Outcome(error=e)
    return Outcome(result=result, resize_warned=any(RESIZE_WARNING in str(w.message) for w in caught))


def _same_outcome(cpu: Outcome, dev: Outcome) -> bool:
    """False when only one side raised; raises when both did with different exception types.
    True when both returned."""
    if cpu.error is not None or dev.error is not None:
        if cpu.error is None:
            raise AssertionError(f"neuron raised where the CPU did not: {type(dev.error).__name__}: {dev.error}")
        if dev.error is None:
            raise AssertionError(f"the CPU raised {type(cpu.error).__name__} ({str(cpu.error)[:120]}), neuron did not")
        if not isinstance(dev.error, type(cpu.error)):
            raise AssertionError(f"neuron raised {type(dev.error).__name__}: {str(dev.error)[:120]}, "
                                 f"the CPU {type(cpu.error).__name__}: {str(cpu.error)[:120]}")
        return False
    return True


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _assert_same_values(op, actual, expected, dtype, exact=None) -> None:
    actual = tree_map(opinfo_sweep._cpu, actual)
    if op.name.startswith(opinfo_sweep.NONDETERMINISTIC):
        for a, e in zip(_tensors(actual), _tensors(expected)):
            assert a.shape == e.shape and a.dtype == e.dtype
        return
    opinfo_sweep.assert_matches_cpu(op, actual, expected, dtype, exact)


def _assert_same_geometry(actual, expected, what: str) -> None:
    for a, e in zip(_tensors(actual), _tensors(expected)):
        if a.numel() > 1 and a.stride() != e.stride():
            raise AssertionError(f"{what}: strides {a.stride()} on neuron, {e.stride()} on the CPU "
                                 f"(sizes {tuple(e.shape)})")


def _grads(outputs, inputs) -> list:
    outs = opinfo_sweep._differentiable_outputs(outputs)
    if not (outs and inputs):
        return []
    return list(torch.autograd.grad(sum(o.sum() for o in outs), inputs, allow_unused=True))


def _assert_same_grads(op, sample, cpu_outputs, dev_outputs, dev_inputs, dtype, geometry: bool = False) -> None:
    try:
        gc = _grads(cpu_outputs, _grad_leaves(sample))
    except (NotImplementedError, RuntimeError) as e:
        raise ReferenceUnavailable(str(e)) from e
    if not gc:
        return
    gd = [opinfo_sweep._cpu(g) for g in _grads(dev_outputs, dev_inputs)]
    opinfo_sweep.assert_matches_cpu(op, gd, gc, dtype, lambda: opinfo_sweep._float64_grads(op, sample),
                                    **opinfo_sweep.GRAD_TOLERANCE[dtype])
    if geometry:
        _assert_same_geometry([g for g in gd if g is not None], [g for g in gc if g is not None], "gradient")


# ---------------------------------------------------------------------------------------------
# The variants
# ---------------------------------------------------------------------------------------------

def check_noncontiguous(op, sample, dtype, grad) -> None:
    sample = sample.noncontiguous()
    cpu = _run(lambda: _call(op, sample.transform(_detached)))
    if cpu.error is not None:  # the CPU rejects non-contiguous operands (view_as_complex): so must neuron
        dev_sample = opinfo_sweep.device_sample(sample.transform(_detached), op)
        _same_outcome(cpu, _run(lambda: _call(op, dev_sample)))
        return
    opinfo_sweep.check_sample(op, sample, dtype, grad)


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _call(op, sample, **extra):
    return op(sample.input, *sample.args, **sample.kwargs, **extra)


def _out_like(result, make):
    """out= tensors for `result` (a tensor, or tuples and lists of them), each made by make(tensor)."""
    return tree_map(lambda t: make(t) if isinstance(t, torch.Tensor) else t, result)


def _filled(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.is_floating_point() else 7)


def _strided_empty(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of t's sizes whose last dimension has stride 2 (not contiguous)."""
    if t.dim() == 0:
        return torch.empty_like(t)
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return wide[..., ::2]


def _on_device(tensors, device: str):
    return tree_map(lambda t: opinfo_sweep._to_neuron(t) if device == "neuron" else t.clone(), tensors)


def _is_out(result, out) -> list[bool]:
    """For each out= tensor, whether the call returned that very tensor."""
    return [r is o for r, o in zip(_tensors(result), _tensors(out))]


def _pointers(x) -> list[int]:
    return [t.data_ptr() for t in _tensors(x)]


def _compare_out_call(op, cpu_sample, dev_sample, cpu_out, dtype, what: str, sized: bool) -> None:
    """Runs op with out=cpu_out on the CPU and a neuron copy of it on neuron; compares outcomes."""
    dev_out = _on_device(cpu_out, "neuron")
    cpu_ptrs, dev_ptrs = _pointers(cpu_out), _pointers(dev_out)
    cpu = _run(lambda: _call(op, cpu_sample, out=cpu_out))
    dev = _run(lambda: _call(op, dev_sample, out=dev_out))
    if not _same_outcome(cpu, dev):
        return
    if _is_out(cpu.result, cpu_out) != _is_out(dev.result, dev_out):
        raise AssertionError(f"{what}: the result is the out= tensor {_is_out(dev.result, dev_out)} on neuron, "
                             f"{_is_out(cpu.result, cpu_out)} on the CPU")
    kept_cpu = [a == b for a, b in zip(cpu_ptrs, _pointers(cpu_out))]
    kept_dev = [a == b for a, b in zip(dev_ptrs, _pointers(dev_out))]
    if sized and kept_cpu != kept_dev:
        raise AssertionError(f"{what}: out= storage kept {kept_dev} on neuron, {kept_cpu} on the CPU")
    if cpu.resize_warned != dev.resize_warned:
        raise AssertionError(f"{what}: resize warning {'given' if dev.resize_warned else 'missing'} on neuron "
                             f"({'given' if cpu.resize_warned else 'not given'} on the CPU)")
    for a, e in zip(_tensors(dev_out), _tensors(cpu_out)):
        if a.shape != e.shape:
            raise AssertionError(f"{what}: out= resized to {tuple(a.shape)} on neuron, {tuple(e.shape)} on the CPU")
    _assert_same_geometry(dev_out, cpu_out, f"{what}: out=")
    _assert_same_values(op, dev_out, cpu_out, dtype)


def _out_reference(op, sample):
    """The op's functional result on the CPU (what out= tensors are made like), or None."""
    outcome = _run(lambda: _call(op, sample))
    if outcome.error is not None:
        raise ReferenceUnavailable(str(outcome.error))
    result = outcome.result
    leaves = tree_leaves(result)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in leaves):
        return None  # no tensor results, or sparse ones (neuron has strided tensors only)
    return result


def _out_case(op, sample):
    """(CPU sample, neuron sample, the CPU's detached results) for out= checks, or None."""
    sample = sample.transform(_detached)
    expected = _out_reference(op, sample)
    if expected is None:
        return None
    return sample, opinfo_sweep.device_sample(sample, op), tree_map(lambda t: t.detach(), expected)


def check_out(op, sample, dtype, grad) -> None:
    case = _out_case(op, sample)
    if case is None:
        return
    sample, dev_sample, detached = case
    _compare_out_call(op, sample, dev_sample, _out_like(detached, lambda t: _filled(torch.empty_like(t))), dtype,
                      "out= of the result's size", sized=True)
    _compare_out_call(op, sample, dev_sample, _out_like(detached, lambda t: _filled(_strided_empty(t))), dtype,
                      "strided out= of the result's size", sized=True)
    if any(t.is_floating_point() for t in _tensors(detached)):
        _compare_out_call(op, sample, dev_sample,
                          _out_like(detached, lambda t: torch.empty_like(t, dtype=torch.long)), dtype,
                          "out= of dtype long", sized=True)


def check_out_resize(op, sample, dtype, grad) -> None:
    case = _out_case(op, sample)
    if case is None:
        return
    sample, dev_sample, detached = case
    _compare_out_call(op, sample, dev_sample, _out_like(detached, lambda t: t.new_empty(0)), dtype,
                      "empty out=", sized=False)
    wrong = lambda t: t.new_empty(3 if t.shape == (2,) else 2).fill_(1)  # noqa: E731
    _compare_out_call(op, sample, dev_sample, _out_like(detached, wrong), dtype, "out= of a wrong size", sized=False)


def _grad_leaves(sample) -> list[torch.Tensor]:
    return opinfo_sweep._grad_inputs(sample)


def _compare_inplace(op, inplace, sample, dev_sample, cpu_x, dev_x, dtype, what: str):
    """Runs the in-place variant on cpu_x and dev_x; True when both returned (values compared)."""
    cpu = _run(lambda: inplace(cpu_x, *sample.args, **sample.kwargs))
    dev = _run(lambda: inplace(dev_x, *dev_sample.args, **dev_sample.kwargs))
    if not _same_outcome(cpu, dev):
        return False
    if (cpu.result is cpu_x) and dev.result is not dev_x:
        raise AssertionError(f"{what}: the result is not the input on neuron (it is on the CPU)")
    _assert_same_geometry(dev_x, cpu_x, what)
    _assert_same_values(op, dev_x, cpu_x, dtype)
    return True


def check_inplace(op, sample, dtype, grad) -> None:
    """The in-place variant on a copy of the input (forward and backward), on a non-contiguous copy,
    and on an int64 copy (which ops that promote integers to floats reject, on the CPU too)."""
    inplace = op.get_inplace()
    grad = grad and op.supports_inplace_autograd and sample.input.requires_grad
    if not grad:
        sample = sample.transform(_detached)
    dev_sample = opinfo_sweep.device_sample(sample, op)
    cpu_x = sample.input.clone() if grad else sample.input.clone().detach()
    dev_x = dev_sample.input.clone() if grad else dev_sample.input.clone().detach()
    if _compare_inplace(op, inplace, sample, dev_sample, cpu_x, dev_x, dtype, "in-place result") and grad and \
            not op.name.startswith(opinfo_sweep.NONDETERMINISTIC):
        _assert_same_grads(op, sample, cpu_x, dev_x, _grad_leaves(dev_sample), dtype)
    plain = sample.transform(_detached)
    dev_plain = opinfo_sweep.device_sample(plain, op)
    strided = noncontiguous_like(plain.input)
    _compare_inplace(op, inplace, plain, dev_plain, strided, opinfo_sweep._to_neuron(strided), dtype,
                     "in-place on a non-contiguous input")
    if plain.input.is_floating_point():
        as_int = plain.input.to(torch.int64)
        _compare_inplace(op, inplace, plain, dev_plain, as_int, opinfo_sweep._to_neuron(as_int), dtype,
                         "in-place on an int64 input")


def _channels_last(t):
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return t
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if fmt is None:
        return t
    converted = t.detach().to(memory_format=fmt)
    return converted.requires_grad_(t.requires_grad)


def uses_channels_last(op, sample) -> bool:
    return op.name.startswith(CHANNELS_LAST_OPS) and isinstance(sample.input, torch.Tensor) and sample.input.dim() in (4, 5)


def check_channels_last(op, sample, dtype, grad) -> None:
    sample = sample.transform(_channels_last)
    dev_sample = opinfo_sweep.device_sample(sample, op)
    cpu = _run(lambda: _call(op, sample))
    dev = _run(lambda: _call(op, dev_sample))
    if not _same_outcome(cpu, dev):
        return
    expected, actual = sample.output_process_fn_grad(cpu.result), dev_sample.output_process_fn_grad(dev.result)
    if op.name in opinfo_sweep.CUDA_STATISTICS:
        actual, expected = opinfo_sweep._without_empty_statistics(actual, expected)
    _assert_same_values(op, actual, expected, dtype, lambda: opinfo_sweep._float64_result(op, sample))
    if not op.name.startswith(opinfo_sweep.NONDETERMINISTIC):
        _assert_same_geometry(actual, expected, "channels-last result")
    if grad and not op.name.startswith(opinfo_sweep.NONDETERMINISTIC):
        _assert_same_grads(op, sample, cpu.result, dev.result, _grad_leaves(dev_sample), dtype, geometry=True)


CHECKS = {"noncontiguous": check_noncontiguous, "out": check_out, "out_resize": check_out_resize,
          "inplace": check_inplace, "channels_last": check_channels_last}


def applies(variant: str, op, sample) -> bool:
    """Whether `variant` has something to test for this op and sample."""
    if variant in ("out", "out_resize"):
        return op.supports_out
    if variant == "inplace":
        return op.get_inplace() is not None
    if variant == "channels_last":
        return uses_channels_last(op, sample)
    return True


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------

def expected_cases(dtypes, variants=VARIANTS, names: set[str] | None = None) -> int:
    """(op, dtype, variant) cases a sweep must run, counted apart from the sweep's loop: the
    channels-last variant runs where a sample has a 4-d or 5-d input, which only running the
    samples tells; it is counted as the sweep ran it, the others from the OpInfos."""
    per_op = {"noncontiguous": lambda op: True, "out": lambda op: op.supports_out,
              "out_resize": lambda op: op.supports_out, "inplace": lambda op: op.get_inplace() is not None}
    return sum(1 for op, _ in opinfo_sweep.op_dtype_cases(dtypes, names)
               for v in variants if v in per_op and per_op[v](op))


def variant_sweep(dtypes=(torch.float32, torch.bfloat16, torch.float16), variants=VARIANTS,
                  names: set[str] | None = None, per_op_seconds: int = 30, progress=None) -> VariantResult:
    result = VariantResult()
    opinfo_sweep.start_sweep()
    for op, dtype in opinfo_sweep.op_dtype_cases(dtypes, names):
        dt = str(dtype)[6:]
        for variant in variants:
            key = f"{op_key(op)}/{dt}/{variant}"
            ran, error = 0, None
            signal.alarm(per_op_seconds)
            try:
                for sample in opinfo_sweep.samples_of(op, dtype, op.supports_autograd):
                    if ran >= VARIANT_SAMPLES[variant]:
                        break
                    if not applies(variant, op, sample):
                        if variant == "channels_last":
                            continue
                        break
                    ran += 1
                    try:
                        CHECKS[variant](op, sample, dtype, op.supports_autograd)
                    except (opinfo_sweep._Timeout, ReferenceUnavailable):
                        raise
                    except Exception as e:  # noqa: BLE001 - every failure is recorded by name
                        error = error or f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            except ReferenceUnavailable:
                pass  # the CPU cannot run the variant: not a case
            except opinfo_sweep._Timeout:
                error = "timeout"
            except Exception as e:  # noqa: BLE001 - sample generation itself failed on CPU
                error = f"samples: {type(e).__name__}: {str(e)[:120]}"
            finally:
                signal.alarm(0)
            if not ran and error is None:
                continue
            result.keys.append(key)
            if error is None:
                result.passed[variant, dt] += 1
            else:
                result.failed[variant, dt] += 1
                result.failures[key] = error
            if progress:
                progress(key)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--variant", action="append", choices=VARIANTS)
    parser.add_argument("--ops", default="")
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16", "float16"]))
    names = set(filter(None, args.ops.split(","))) or None
    start = time.time()
    res = variant_sweep(dtypes, tuple(args.variant or VARIANTS), names)
    print(res.summary())
    print(f"{time.time() - start:.0f}s")
    opinfo_sweep.print_failures(res.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
