"""Compiled graphs facing unsupported ops, mutation, aliasing and random numbers behave as
eager does."""
import pytest
import torch
import torch.nn.functional as F

from torchneuron.compiler import NeuronCompileError
from torchneuron.ops import policy


def test_host_only_op_falls_back_visibly_or_raises_in_strict_mode(fresh_dynamo):
    def fn(x):
        return torch.linalg.svdvals(x @ x.t()).sum() + x.relu().sum()

    x = torch.randn(4, 4, device="neuron")
    policy.reset_fallback_counts()
    with pytest.warns(policy.CPUFallbackWarning, match="linalg_svd"):
        out = torch.compile(fn, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), fn(x.cpu()), atol=1e-4, rtol=1e-4)
    assert any("linalg_svd" in name for name in policy.fallback_counts())

    torch._dynamo.reset()
    policy.set_strict(True)
    try:
        with pytest.raises(Exception, match="linalg_svd.*strict") as raised:
            torch.compile(fn, backend="neuron")(x)
    finally:
        policy.set_strict(False)
    cause = raised.value
    while cause is not None and not isinstance(cause, NeuronCompileError):
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    assert cause is not None and cause.op == "aten::_linalg_svd"


def test_input_mutation_and_aliasing_outputs_behave_as_eager(fresh_dynamo):
    def fn(x, buf):
        buf.add_(x)                 # mutates an input
        flat = x.view(-1)           # aliases an input
        return buf * 2, flat, flat[:3]

    compiled = torch.compile(fn, backend="neuron")
    x = torch.randn(2, 3, device="neuron")
    buf, expected_buf = torch.zeros(2, 3, device="neuron"), torch.zeros(2, 3, device="neuron")
    doubled, flat, head = compiled(x, buf)
    want = fn(x, expected_buf)
    torch.testing.assert_close(buf, expected_buf)
    torch.testing.assert_close(doubled, want[0])
    assert flat.data_ptr() == x.data_ptr() and head.data_ptr() == x.data_ptr()
    flat.mul_(0)                    # writes through the alias, as in eager
    assert torch.count_nonzero(x.cpu()) == 0 and torch.count_nonzero(head.cpu()) == 0


def test_random_ops_draw_the_same_numbers_as_eager(fresh_dynamo):
    def fn(x):
        return F.dropout(x, 0.5, training=True) + torch.rand_like(x) * torch.randn(3, device=x.device)

    x = torch.ones(4, 3, device="neuron")
    compiled = torch.compile(fn, backend="neuron")
    compiled(x)  # compile outside the seeded region
    torch.manual_seed(123)
    want = fn(x)
    torch.manual_seed(123)
    got = compiled(x)
    torch.testing.assert_close(got, want)
    torch.manual_seed(124)
    assert not torch.equal(compiled(x).cpu(), want.cpu())


def test_rng_state_functions_inside_a_compiled_region_run_eagerly(fresh_dynamo):
    """torch.neuron's RNG state functions graph-break like torch.cuda's, so code saving and
    restoring the generator around random ops (torch.testing's freeze_rng_state) compiles."""
    from torch.testing._utils import freeze_rng_state

    def fill(x):
        with freeze_rng_state():
            torch.manual_seed(42)
            return x.uniform_(0.0, 1.0)

    torch.manual_seed(7)
    state = torch.neuron.get_rng_state()
    got = torch.compile(fill, backend="neuron", dynamic=False)(torch.zeros(3, 4, device="neuron"))
    assert torch.equal(torch.neuron.get_rng_state(), state)   # restored on the way out
    want = fill(torch.zeros(3, 4, device="neuron"))
    assert torch.equal(got.cpu(), want.cpu())
