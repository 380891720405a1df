"""The OpInfo gate in adaptive eager mode: test_opinfo.py's sweep with
`torchneuron.eager.set_eager_mode("adaptive")` on.

Adaptive mode promises plain eager's results for every op, so the failures must be exactly
eager's known failures (test_opinfo.KNOWN_FAILURES) plus the adaptive-only bugs listed in
ADAPTIVE_KNOWN_FAILURES, with their cause; a new failure or a fixed bug both fail this test,
so the list stays true.

The sweep mostly exercises queueing, output allocation, `.out` variants and flush triggers
(a run of ops is compiled only the second time it is seen). Which runs get compiled depends on
what the fused-kernel cache has seen, so the sweep starts from an empty cache: the result must
not depend on which tests ran before in the process.
"""
import pytest
import torch

import torchneuron.eager as eager
from tests.ops.opinfo_sweep import sweep
from tests.ops.test_opinfo import KNOWN_FAILURES
# test_opinfo's coverage and pass-rate checks, collected again here on this module's (adaptive) `result`.
from tests.ops.test_opinfo import test_every_op_is_covered, test_pass_rate_at_least_97_percent  # noqa: F401
from torchneuron.eager.fusion import Executor

# ~6 min alone on a fresh machine (plain eager's sweep: ~35 s), mostly compiling fused runs
pytestmark = pytest.mark.slow

DTYPES = (torch.float32, torch.bfloat16)  # test_opinfo's

# "op.variant/dtype" -> cause, for ops that fail in adaptive mode only. The sweep found 13 in 8
# ops with the Python queue and 16 in 11 ops with the C++ one; all are fixed, each with a
# regression test in tests/eager/test_adaptive_edge_cases.py.
ADAPTIVE_KNOWN_FAILURES: dict[str, str] = {}


@pytest.fixture(scope="module")
def result():
    previous = eager.get_eager_mode()
    eager.set_eager_mode("eager")
    try:
        with pytest.MonkeyPatch.context() as patch:
            executor = Executor()  # an empty fused-kernel cache, picked up by set_eager_mode
            executor.compiler = eager._executor.compiler
            patch.setattr(eager, "_executor", executor)
            torch.manual_seed(0)
            eager.set_eager_mode("adaptive")
            try:
                return sweep(DTYPES)
            finally:
                eager.set_eager_mode("eager")
    finally:
        eager.set_eager_mode(previous)


def test_failures_are_eager_known_issues_plus_adaptive_ones(result):
    known = {**KNOWN_FAILURES, **ADAPTIVE_KNOWN_FAILURES}
    new = {k: v for k, v in result.failures.items() if k not in known}
    fixed = sorted(k for k in ADAPTIVE_KNOWN_FAILURES if k not in result.failures)
    passing = sorted(k for k in KNOWN_FAILURES if k not in result.failures)
    assert not new, f"new failures in adaptive eager mode: {new}"
    assert not fixed, f"adaptive-only failures now pass, remove them from ADAPTIVE_KNOWN_FAILURES: {fixed}"
    assert not passing, f"known eager failures pass in adaptive mode (it must give eager's results): {passing}"
