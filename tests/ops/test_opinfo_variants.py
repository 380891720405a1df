"""The OpInfo variants gate: opinfo_variants.py's non-contiguous, out=, out= resize, in-place and
channels-last variants of every op in op_db, float32, bfloat16 and float16, each compared with the
same call on the CPU.

At least 99.5% of (op, dtype, variant) cases must pass, and the failures must be exactly
VARIANT_KNOWN_FAILURES (with their cause): a new failure or a fixed known one fails the test, so
the list stays true. The summary line (pass rate per variant and dtype) is printed at the end of
the run (tests/ops/conftest.py).

Sampling, for time: one sample per op and variant (two for channels-last), forward and backward;
the contiguous gate (test_opinfo.py) runs up to four per op. The variants exercise how the device
treats geometry, out= tensors and in-place writes, which the first sample does as well as later
ones. Measured: 49 s of CPU time for both shards together (time.process_time; the wall time on
the shared 2-core machine was 6 min), in SHARDS test classes that `make test` runs on different
workers.
"""
import pytest
import torch

from tests.ops.opinfo_sweep import shard_names
from tests.ops.opinfo_variants import VARIANTS, expected_cases, variant_sweep
from tests.ops.test_opinfo import KNOWN_FAILURES

pytestmark = pytest.mark.slow

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHARDS = 2


def _also_contiguous(key: str) -> bool:
    """A known failure of the contiguous gate (test_opinfo.py, which keeps that list true) may fail its
    variants for the same reason; some of its variants pass (the CPU itself rejects a non-contiguous
    sparse sample, and neuron does the same)."""
    op_dtype = key.rsplit("/", 1)[0]
    return op_dtype in KNOWN_FAILURES


# "op.variant/dtype/variant" -> cause, for failures of the variants only (the contiguous gate's
# known failures fail their variants too, _also_contiguous).
VARIANT_KNOWN_FAILURES: dict[str, str] = {}


class _VariantGate:
    """The gate's checks on one shard of the op database."""

    shard: int

    @pytest.fixture(scope="class")
    @classmethod
    def result(cls):
        torch.manual_seed(0)
        return variant_sweep(DTYPES, VARIANTS, shard_names(cls.shard, SHARDS))

    def test_every_op_of_the_shard_is_covered(self, result):
        counted = sum(1 for k in result.keys if not k.endswith("/channels_last"))
        assert counted == expected_cases(DTYPES, VARIANTS, shard_names(self.shard, SHARDS))
        assert any(k.endswith("/channels_last") for k in result.keys) or self.shard, "no channels-last case ran"

    def test_pass_rate_at_least_99_5_percent(self, result, record_property):
        record_property("opinfo_summary", f"OpInfo variants, shard {self.shard}:\n{result.summary()}")
        assert result.rate() >= 0.995, result.summary()

    def test_failures_are_exactly_the_known_issues(self, result):
        ran = set(result.keys)
        new = {k: v for k, v in result.failures.items() if k not in VARIANT_KNOWN_FAILURES and not _also_contiguous(k)}
        fixed = sorted(k for k in VARIANT_KNOWN_FAILURES if k in ran and k not in result.failures)
        assert not new, f"new OpInfo variant failures: {new}"
        assert not fixed, f"known variant failures now pass, remove them from VARIANT_KNOWN_FAILURES: {fixed}"


class TestShard0(_VariantGate):
    shard = 0


class TestShard1(_VariantGate):
    shard = 1


def test_every_listed_case_exists():
    from tests.ops.opinfo_sweep import op_db, op_key

    keys = {op_key(op) for op in op_db}
    assert {k.split("/")[0] for k in VARIANT_KNOWN_FAILURES} <= keys
    assert {k.split("/")[2] for k in VARIANT_KNOWN_FAILURES} <= set(VARIANTS)
