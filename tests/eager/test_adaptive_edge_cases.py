"""Adaptive eager on the edge cases that once broke it: ops whose meta kernel or out= variant
disagrees with the device kernel, undefined outputs, runs that clone an input and then mutate
it, bfloat16 rounding inside fused runs, and host-only ZeroTensors under the global mode."""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchneuron.eager as eager


def repeat(fn, times=4):
    """fn's results over several calls: learnt, queued once, compiled, served fused."""
    return [fn() for _ in range(times)]


def assert_same_as_eager(fn, times=4, **tolerance):
    eager.set_eager_mode("eager")
    want = repeat(fn, times)
    eager.set_eager_mode("adaptive")
    got = repeat(fn, times)
    eager.set_eager_mode("eager")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **(tolerance or dict(atol=0, rtol=0)))


def test_outputs_the_meta_kernel_mispredicts_are_not_queued(adaptive):
    """An op whose meta kernel disagrees with the device's outputs (a float64 hypot where the device
    makes float32) runs unqueued, and the results are eager's. No aten op disagrees on OpInfo's
    samples today (batch norm in eval mode and half-precision norms did, before the device took
    CUDA's statistics); the test gives hypot a wrong meta kernel for its duration."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, 5, generator=g).to("neuron") for _ in range(2))
    wrong = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        wrong.impl("hypot", lambda a, b: torch.empty(a.shape, dtype=torch.float64, device="meta"), "Meta")
    try:
        before = eager.stats()
        assert_same_as_eager(lambda: [torch.hypot(x * 1, y).cpu(), (x + y).cpu()])
        eager.set_eager_mode("adaptive")
        after_first = eager.stats()
        torch.hypot(x * 1, y).cpu()
        after = eager.stats()
    finally:
        wrong._destroy()
    assert after["unqueued"] - after_first["unqueued"] >= 1 and after_first["queued"] > before["queued"]
    assert torch.hypot(x.to("meta"), y.to("meta")).dtype == torch.float32   # the real meta kernel is back


def test_half_precision_layer_norm_is_queued_and_fused(adaptive):
    """bfloat16 layer norm keeps float32 statistics, as its meta kernel says: it fuses with its
    neighbours, forward and backward, with eager's bits. (Batch norm keeps them too.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 24, generator=g).bfloat16().to("neuron")
    w = torch.randn(24, generator=g).bfloat16().to("neuron").requires_grad_()

    def fn():
        h = torch.nn.functional.layer_norm(x * 2, (24,), w, w * 0.5)
        (h.relu() * 3).float().sum().backward()
        grad, w.grad = w.grad, None
        return [h.detach().cpu(), grad.cpu()]

    assert_same_as_eager(fn)
    eager.set_eager_mode("adaptive")   # (the fixture turns it off again)
    before = eager.stats()
    fn()
    after = eager.stats()
    assert after["fused_ops"] - before["fused_ops"] >= 6 and after["compile_failures"] == before["compile_failures"]


def test_an_out_variant_that_differs_is_not_used(adaptive):
    """binary_cross_entropy.out resizes a 0-d `out`: the queued op runs functionally instead."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.rand(5, generator=g).to("neuron"), torch.rand(5, generator=g).to("neuron")
    assert_same_as_eager(lambda: F.binary_cross_entropy(x * 1, t).cpu())


def test_undefined_outputs_of_a_masked_backward(adaptive):
    """convolution_backward with an output mask returns no input gradient."""
    def fn():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3).to("neuron")
        conv(torch.ones(2, 3, 8, 8, device="neuron")).square().sum().backward()
        return [conv.weight.grad.cpu(), conv.bias.grad.cpu()]

    assert_same_as_eager(fn)


def test_a_fused_run_that_clones_an_input_then_mutates_it(adaptive):
    """What autograd issues for an in-place op whose backward needs the original: the clone
    keeps the old values once the run is fused."""
    base = torch.tensor([-2.0, 3.0, -1.0, 4.0]).to("neuron")
    for _ in range(4):
        t = base.clone()
        eager.flush()                  # t is an input of the next run
        original = t.clone()
        t.clamp_min_(0)
        assert original.cpu().tolist() == [-2.0, 3.0, -1.0, 4.0]
        assert t.cpu().tolist() == [0.0, 3.0, 0.0, 4.0]
    assert eager.stats()["fused_runs"] >= 1


def test_a_swap_through_clones_runs_correctly(adaptive):
    """Two inputs exchanging values through a clone have no safe fused write-back order: the
    run is not fused, and the values are still swapped."""
    for _ in range(4):
        a, b = torch.zeros(3, device="neuron"), torch.ones(3, device="neuron")
        eager.flush()
        saved = a.clone()
        a.copy_(b)
        b.copy_(saved)
        del saved
        assert a.cpu().tolist() == [1.0] * 3 and b.cpu().tolist() == [0.0] * 3


def test_fused_bfloat16_chains_round_like_eager(adaptive):
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(16, 48).to("neuron"), torch.nn.Linear(16, 48).to("neuron")
    x = torch.randn(8, 16).to("neuron")

    def fn():
        with torch.autocast("neuron", dtype=torch.bfloat16):
            return (F.silu(gate(x)) * up(x) * 0.5).cpu()

    assert_same_as_eager(fn)
    assert eager.stats()["fused_runs"] >= 1


@pytest.mark.parametrize("op", ["isclose", "add", "mul"])
def test_host_zero_tensors_under_the_mode(adaptive, op):
    """CPU gradients can be efficient zero tensors; CPU code keeps working on them while the
    (process-wide) mode is on."""
    x = torch.randn(4, requires_grad=True)
    (z,) = torch.autograd.grad(torch.sgn(x).sum(), x)
    assert z._is_zerotensor()
    result = {"isclose": lambda: torch.isclose(torch.zeros(4), z), "add": lambda: z + 1,
              "mul": lambda: z * torch.ones(4)}[op]()
    eager.set_eager_mode("eager")
    want = {"isclose": torch.ones(4, dtype=torch.bool), "add": torch.ones(4), "mul": torch.zeros(4)}[op]
    assert torch.equal(result, want)


def test_running_statistics_an_op_updates_without_declaring_it(adaptive):
    """native_batch_norm writes its running statistics though its schema does not say so:
    learning how to queue it must not update them a second time."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(6).to("neuron")

    def fn():
        bn(torch.arange(24.0, device="neuron").view(4, 6).sin() * 3)
        return [bn.running_mean.cpu(), bn.running_var.cpu()]

    eager.set_eager_mode("eager")
    want = repeat(fn)
    bn.reset_running_stats()
    eager.set_eager_mode("adaptive")
    got = repeat(fn)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---- found when the queue moved into the device's fallback (C++) ----

def test_in_place_view_ops_run_after_the_queued_work_they_reshape(adaptive):
    """unsqueeze_ changes a tensor's geometry without reaching the fallback's op path: queued ops
    recorded against the old geometry must run first (quantile, group norm, bilinear did this)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, generator=g).to("neuron")

    def fn():
        r = (x * 2).sum()            # a 0-d result, queued
        r.masked_fill_(r > 100, 0)   # in place on it, queued
        r.unsqueeze_(0)              # now 1-d
        return (r + torch.ones(1, device="neuron")).cpu()

    assert_same_as_eager(fn)


def test_out_variants_whose_float_arguments_shape_their_output(adaptive):
    """arange reaches the device as arange.start_out into an empty tensor; with float bounds,
    one signature has many output lengths (mvlgamma's samples), so it is not queued by shape."""
    def fn():
        return [torch.arange(0.5, n, 0.5, device="neuron").cpu() for n in (1.0, 3.0, 2.0)]

    assert_same_as_eager(fn)


def test_wrapped_numbers_replayed_by_the_python_side(adaptive):
    """x % 3 reaches the device as remainder.Tensor with a wrapped number; a run the Python side
    runs op by op must call the Scalar overload (take_along_dim's bfloat16 samples)."""
    x = torch.arange(12, device="neuron").view(3, 4)

    def fn():
        return ((x % 3) * 2 + 1).cpu()

    assert_same_as_eager(fn, times=6)


def test_attention_fuses_with_its_neighbours_forward_and_backward(adaptive):
    """SDPA's fused kernel (and its backward) joins the fused program: no flush, no eager op."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g).to("neuron").requires_grad_() for _ in range(3))

    def fn():
        for t in (q, k, v):
            t.grad = None
        out = F.scaled_dot_product_attention(q * 2, k, v, is_causal=True).relu()
        out.sum().backward()
        return [t.cpu() for t in (out, q.grad, k.grad, v.grad)]

    assert_same_as_eager(fn)
    eager.set_eager_mode("adaptive")
    before = eager.stats()
    fn()
    after = eager.stats()
    assert after["fused_runs"] > before["fused_runs"]
    assert after["eager_ops"] == before["eager_ops"]


def test_a_resize_between_queued_ops_runs_them_first(adaptive):
    """soft_margin_loss's out= kernel writes its output at the input's shape, reduces it, then
    resizes it to a scalar: the queued writes must run against the shape they were queued with."""
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(5, generator=g).to("neuron"), torch.randn(5, generator=g).to("neuron")

    def fn():
        out = torch.empty(0, device="neuron")
        torch.ops.aten.soft_margin_loss.out(x * 1, target, 1, out=out)
        loss = F.soft_margin_loss(x.detach().requires_grad_(), target)  # its functional form, with autograd
        return [out.cpu(), loss.detach().cpu()]

    assert_same_as_eager(fn)
    torch.testing.assert_close(fn()[1], F.soft_margin_loss(x.detach().cpu(), target.cpu()))


def _loop_with_a_changing_float(fn, iterations=6, first=0, x=None):
    if x is None:
        x = torch.arange(12.0).reshape(3, 4).to("neuron") / 7
        x.cpu()  # made before the loop: every iteration queues the same ops
    return [fn(x, 0.5 + 0.25 * i).cpu() for i in range(first, first + iterations)]


def test_changing_floats_become_program_arguments(adaptive):
    """A float that changes every iteration (a scheduled learning rate, a bias correction) is an
    argument of the fused program: compiled once, every op fused, eager's results."""
    def fn(x, lr):
        return x.mul(1 - lr * 0.01).addcdiv(x + 1, (x * x + 1).sqrt().add_(1e-8), value=-lr)

    eager.set_eager_mode("eager")
    want = _loop_with_a_changing_float(fn)
    eager.set_eager_mode("adaptive")
    before = eager.stats()
    got = _loop_with_a_changing_float(fn)
    after = eager.stats()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert after["compiles"] - before["compiles"] == 1
    assert after["compile_failures"] == before["compile_failures"]
    # from the third iteration (the second sighting, floats changed) on, nothing runs eagerly
    x = torch.arange(12.0).reshape(3, 4).to("neuron") / 7
    x.cpu()
    steady = eager.stats()
    _loop_with_a_changing_float(fn, iterations=2, first=6, x=x)
    assert eager.stats()["eager_ops"] == steady["eager_ops"]
    assert eager.stats()["compiles"] == steady["compiles"]


def test_a_program_needing_the_value_of_a_changing_float_splits_around_it(adaptive):
    """Tracing logit needs the value of its eps (its kernel takes a plain float): that program
    cannot take eps as an argument, so logit runs eagerly and its neighbours still fuse."""
    def fn(x, eps):
        return torch.logit((x * 2).sigmoid(), eps=eps * 0.1).relu()

    eager.set_eager_mode("eager")
    want = _loop_with_a_changing_float(fn)
    eager.set_eager_mode("adaptive")
    got = _loop_with_a_changing_float(fn)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    x = torch.arange(12.0).reshape(3, 4).to("neuron") / 7
    x.cpu()
    before = eager.stats()
    _loop_with_a_changing_float(fn, iterations=1, first=6, x=x)
    after = eager.stats()
    assert after["fused_runs"] - before["fused_runs"] == 1   # x * 2 and sigmoid
    assert after["eager_ops"] - before["eager_ops"] == 2     # logit, and relu alone after it


_SCALAR_LIST_OPS = {
    "add": lambda ys, xs, s: torch._foreach_add(ys, s),
    "sub": lambda ys, xs, s: torch._foreach_sub(ys, s),
    "mul": lambda ys, xs, s: torch._foreach_mul(ys, s),
    "div": lambda ys, xs, s: torch._foreach_div(ys, s),
    "clamp_max": lambda ys, xs, s: torch._foreach_clamp_max(ys, s),
    "maximum": lambda ys, xs, s: torch._foreach_maximum(ys, s),
    "addcdiv": lambda ys, xs, s: torch._foreach_addcdiv(ys, xs, [x.abs() + 1 for x in xs], s),
    "addcmul": lambda ys, xs, s: torch._foreach_addcmul(ys, xs, xs, s),
    "pow": lambda ys, xs, s: torch._foreach_pow(torch._foreach_abs(ys), s),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_ops_over_changing_scalar_lists_round_like_eager(adaptive, dtype):
    """An optimizer's bias corrections: a foreach op over a list of floats that change every step.
    The programs take the floats as arguments and reproduce eager's results bit for bit; in float32
    the ops Inductor cannot lower this way (division, addcdiv, ...) are turned into ones it fuses, so
    the program calls no foreach ATen op except addcmul and pow, whose eager kernels round
    differently from anything a program computes."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 5, generator=g).to(dtype).to("neuron") for _ in range(3)]

    def loop(iterations=6):
        results = []
        for i in range(iterations):
            scalars = [1.0 + 0.1 * i + 0.01 * k for k in range(3)]
            ys = [x * 2 for x in xs]
            for op in _SCALAR_LIST_OPS.values():
                ys = op(ys, xs, scalars)
            results.append([y.cpu() for y in ys])
        return results

    eager.set_eager_mode("eager")
    want = loop()
    eager.set_eager_mode("adaptive")
    got, programs = run_and_get_code(loop)
    for g_step, w_step in zip(got, want):
        for g_tensor, w_tensor in zip(g_step, w_step):
            torch.testing.assert_close(g_tensor, w_tensor, atol=0, rtol=0)
    assert programs, "the loop compiled no fused program"
    if dtype == torch.float32:
        called = {name for code in programs for name in re.findall(r"torch\.ops\.aten\.(_foreach_\w+)\.", code)}
        assert called == {"_foreach_addcmul", "_foreach_pow"}
