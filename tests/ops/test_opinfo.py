"""The OpInfo gate: every op in PyTorch's op_db, forward and backward, float32, bfloat16 and
float16, neuron vs CPU, on the samples as given (test_opinfo_variants.py: non-contiguous, out=,
in-place and channels-last variants).

At least 99.5% of (op, dtype) cases and 97% of samples must match, and every failing op must be a
known issue listed below with its cause; a new failure or a fixed known issue both fail this test,
so the list stays true.
"""
import pytest
import torch

from tests.ops.opinfo_sweep import expected_runs, shard_names, sweep

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALL = ("float32", "bfloat16", "float16")

KNOWN_FAILURES = {
    # Sparse layouts are not supported on neuron (strided tensors only).
    **{f"{name}/{dt}": "sparse layouts unsupported" for dt in _ALL for name in (
        "sparse.mm.reduce", "to_sparse")},
    "sparse.sampled_addmm/float32": "sparse layouts unsupported",
}
# (as_strided.partial_views was listed until the sweep moved samples with their whole storage
# (opinfo_sweep._to_neuron); tensor_split until it kept the index tensor PyTorch requires on the CPU
# there (opinfo_sweep.CPU_ARGUMENTS); the jiterator ops until samples the CPU cannot compute were
# counted apart (CUDA_ONLY).)
# Ops whose samples the CPU itself cannot run: none of their entries is a case.
CUDA_ONLY = {f"{name}/{dt}" for dt in _ALL for name in (
    "jiterator_2inputs_2outputs", "jiterator_4inputs_with_extra_args", "jiterator_binary",
    "jiterator_binary_return_by_ref", "jiterator_unary")}


def case_pass_rate(result) -> float:
    """The share of (op, dtype) cases with no failing sample (entries without a CPU reference are no
    cases)."""
    cases = len(result.keys) - len(result.unreferenced)
    return 1 - len(result.failures) / cases if cases else 1.0


def summary(result) -> str:
    """The gate's summary line: the case pass rate per dtype."""
    cases = [k for k in result.keys if k not in result.unreferenced]
    per = ", ".join(f"{d} {1 - sum(k.endswith('/' + d) for k in result.failures) / n:.2%}"
                    for d in _ALL if (n := sum(k.endswith("/" + d) for k in cases)))
    return (f"OpInfo contiguous: {case_pass_rate(result):.2%} of {len(cases)} op-dtype cases ({per}); "
            f"samples {result.pass_rate:.2%}; {len(result.unreferenced)} entries without a CPU reference")


@pytest.fixture(scope="module")
def result():
    return sweep(DTYPES)


def test_every_op_is_covered(result):
    assert result.ops_run == expected_runs(DTYPES)


def test_pass_rate_at_least_97_percent(result):
    assert result.pass_rate >= 0.97, f"pass rate {result.pass_rate:.2%}"


def test_case_pass_rate_at_least_99_5_percent(result, record_property):
    record_property("opinfo_summary", summary(result))
    assert case_pass_rate(result) >= 0.995, summary(result)


def test_ops_the_cpu_cannot_run_are_counted_apart(result):
    assert CUDA_ONLY <= result.unreferenced, sorted(CUDA_ONLY - result.unreferenced)


def test_failures_are_exactly_the_known_issues(result):
    new = {k: v for k, v in result.failures.items() if k not in KNOWN_FAILURES}
    fixed = sorted(k for k in KNOWN_FAILURES if k not in result.failures)
    assert not new, f"new OpInfo failures: {new}"
    assert not fixed, f"known failures now pass, remove them from KNOWN_FAILURES: {fixed}"


def test_shards_cover_the_op_database_once():
    from torch.testing._internal.common_methods_invocations import op_db

    shards = [shard_names(i, 2) for i in range(2)]
    assert shards[0] | shards[1] == {op.name for op in op_db} and not shards[0] & shards[1]
