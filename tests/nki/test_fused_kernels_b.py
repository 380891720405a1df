"""NKI-lib RoPE and cross-entropy kernels (kernels/rope.py, kernels/cross_entropy.py) against torch:
the kernels simulated on data, their ops forward and backward (host path and kernel), their
prices, fake tensors, bad input, and the compiler's substitution on a tiny Llama."""

import pytest
import torch
import torch.nn.functional as F

import torchneuron.nki.typing as nt
from torchneuron.hardware import model
from torchneuron.hardware.targets import TARGETS
from torchneuron.kernels import cross_entropy as ce
from torchneuron.kernels import rope as rp
from torchneuron.kernels import rope_ce_ops as ops
from torchneuron.kernels import torch_ops
from torchneuron.ops import policy

# bf16 keeps 8 bits of mantissa: one rounding of an O(1) result is within 2^-8 relative
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _tables(c: int, s: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin tables (halves repeat, as transformers builds them), per sequence."""
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    pos = torch.arange(s).float().view(1, -1, 1) + torch.arange(c).float().view(-1, 1, 1) * 3
    emb = torch.cat((pos * inv, pos * inv), dim=-1)
    return emb.cos(), emb.sin()


def _rope_reference(x, cos, sin):
    return x * cos.unsqueeze(1) + ops.rotate_half(x) * sin.unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,s,d,per_sequence", [(2, 3, 200, 64, True), (1, 4, 128, 128, False)])
def test_rope_kernel_forward_and_backward_match_torch(dtype, b, h, s, d, per_sequence):
    x = torch.randn(b, h, s, d)
    cos, sin = _tables(b if per_sequence else 1, s, d)
    out = rp.rope(x.to(dtype).flatten(0, 1), cos.to(dtype), sin.to(dtype)).view(b, h, s, d)
    ref = _rope_reference(x.to(dtype).float(), cos.to(dtype).float(), sin.to(dtype).float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    grad = torch.randn(b, h, s, d).to(dtype)
    xr = x.to(dtype).float().requires_grad_()
    _rope_reference(xr, cos.to(dtype).float(), sin.to(dtype).float()).backward(grad.float())
    back = rp.rope(grad.flatten(0, 1), cos.to(dtype), sin.to(dtype), backward=True).view(b, h, s, d)
    torch.testing.assert_close(back.float(), xr.grad, **TOL[dtype])


def test_rope_backward_is_the_adjoint_for_any_table():
    x, cos, sin = torch.randn(4, 130, 32), torch.randn(1, 130, 32), torch.randn(1, 130, 32)
    xr = x.clone().requires_grad_()
    grad = torch.randn_like(x)
    (xr * cos + ops.rotate_half(xr) * sin).backward(grad)
    torch.testing.assert_close(rp.rope(grad, cos, sin, backward=True), xr.grad, **TOL[torch.float32])


def _ce_problem(t, d, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.05).to(dtype)
    labels = torch.randint(0, v, (t, 1), generator=g, dtype=torch.int32)
    labels[::37] = -100  # ignored tokens
    return h, w, labels


def _ce_reference(h, w, labels, grad):
    """Per-token loss, lse and the gradients of sum(grad * loss), in fp32 with torch."""
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    logits = hr @ wr.T
    loss = F.cross_entropy(logits, labels.view(-1).long(), ignore_index=-100, reduction="none")
    (loss * grad.view(-1)).sum().backward()
    return loss.detach(), logits.detach().logsumexp(-1), hr.grad, wr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [ce.SBUF_BUDGET, 14 * 1024])  # one token block; several (dW summed in HBM)
def test_linear_cross_entropy_kernels_match_torch(dtype, budget, monkeypatch):
    monkeypatch.setattr(ce, "SBUF_BUDGET", budget)
    h, w, labels = _ce_problem(512, 256, 700, dtype)
    grad = torch.rand(512, 1)
    loss, lse = ce.linear_ce_fwd(h, w, labels)
    ref_loss, ref_lse, ref_dh, ref_dw = _ce_reference(h, w, labels, grad)
    tol = dict(atol=1e-4, rtol=1e-4)  # fp32 logits and log-sum-exp in both dtypes
    torch.testing.assert_close(loss.view(-1), ref_loss, **tol)
    torch.testing.assert_close(lse.view(-1), ref_lse, **tol)
    dh, dw = ce.linear_ce_bwd(h, w, labels, lse, grad)
    # dlogits are rounded to the input dtype before both matmuls: bf16's error, relative to the largest
    scale = 1e-5 if dtype == torch.float32 else 1e-2
    assert (dh.float() - ref_dh).abs().max() <= scale * ref_dh.abs().max()
    assert (dw - ref_dw).abs().max() <= scale * ref_dw.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_over_logits_kernels_match_torch(dtype):
    logits = (torch.randn(256, 2500) * 3).to(dtype)
    labels = torch.randint(0, 2500, (256, 1), dtype=torch.int32)
    labels[5] = -100
    grad = torch.rand(256, 1)
    loss, lse = ce.ce_fwd(logits, labels)
    xr = logits.float().requires_grad_()
    ref = F.cross_entropy(xr, labels.view(-1).long(), reduction="none")
    (ref * grad.view(-1)).sum().backward()
    torch.testing.assert_close(loss.view(-1), ref.detach(), atol=1e-4, rtol=1e-4)
    dlogits = ce.ce_bwd(logits, labels, lse, grad)
    torch.testing.assert_close(dlogits.float(), xr.grad, **TOL[dtype])


@pytest.fixture(params=["kernel", "host"])
def path(request, monkeypatch):
    """The ops compute with the NKI kernel (NKI_SIMULATOR=1) or with their host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def test_ops_forward_and_backward_match_autograd_of_torch(path):
    x = torch.randn(2, 2, 130, 32, requires_grad=True)
    cos, sin = _tables(2, 130, 32)
    grad = torch.randn(2, 2, 130, 32)
    out = ops.apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1))
    (dx,) = torch.autograd.grad(out, x, grad)
    ref = _rope_reference(x, cos, sin)
    (ref_dx,) = torch.autograd.grad(ref, x, grad)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(dx, ref_dx, **TOL[torch.float32])

    h, w, labels = _ce_problem(256, 128, 300, torch.float32)
    h, w, labels = h.view(2, 128, 128).requires_grad_(), w.requires_grad_(), labels.view(2, 128).long()
    for reduction in ("mean", "sum"):
        loss = ops.linear_cross_entropy(h, w, labels, reduction=reduction)
        ref = F.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten(), reduction=reduction)
        grads, ref_grads = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))
        torch.testing.assert_close(loss, ref, **TOL[torch.float32])
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    logits = torch.randn(128, 300, requires_grad=True)
    loss = ops.cross_entropy(logits, labels[0])
    ref = F.cross_entropy(logits, labels[0])
    torch.testing.assert_close(loss, ref, **TOL[torch.float32])
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0],
                               atol=1e-7, rtol=1e-4)


def test_ops_on_neuron_match_cpu_and_keep_autograd_through_views():
    x = torch.randn(1, 2, 128, 64)
    cos, sin = _tables(1, 128, 64)
    xn = x.to("neuron").requires_grad_()
    out = ops.apply_rope(xn, cos.to("neuron"), sin.to("neuron"))
    assert out.grad_fn is not None  # (the op's output is reshaped: views of it must stay tracked)
    out.sum().backward()
    xc = x.clone().requires_grad_()
    _rope_reference(xc, cos, sin).sum().backward()
    torch.testing.assert_close(out.cpu(), _rope_reference(x, cos, sin), **TOL[torch.float32])
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, **TOL[torch.float32])


def test_ops_are_charged_their_kernels_simulated_latency():
    trn2 = TARGETS["trn2"]
    args = (nt.tensor[(8, 256, 64), torch.bfloat16], nt.tensor[(1, 256, 64), torch.bfloat16],
            nt.tensor[(1, 256, 64), torch.bfloat16])
    _, stats = rp.rope.run(args, {}, target=trn2)
    sigs = [(a.dtype, a.shape) for a in args]
    assert model.op_cost("nki_kernels::rope", sigs, sigs[:1], trn2).duration_s == pytest.approx(stats.latency_s)
    ce_args = (nt.tensor[(256, 128), torch.bfloat16], nt.tensor[(600, 128), torch.bfloat16],
               nt.tensor[(256, 1), torch.int32])
    _, stats = ce.linear_ce_fwd.run(ce_args, {}, target=trn2)
    sigs = [(a.dtype, a.shape) for a in ce_args]
    cost = model.op_cost("nki_kernels::linear_ce_fwd", sigs, [], trn2)
    assert cost.duration_s == pytest.approx(stats.latency_s)


def test_fake_tensors_give_the_ops_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = ops.rope_op(torch.empty(6, 128, 64), torch.empty(2, 128, 64), torch.empty(2, 128, 64))
        loss, lse = ops.linear_ce_fwd_op(torch.empty(128, 128), torch.empty(500, 128),
                                         torch.empty(128, 1, dtype=torch.int32))
        dh, dw = ops.linear_ce_bwd_op(torch.empty(128, 128), torch.empty(500, 128),
                                      torch.empty(128, 1, dtype=torch.int32), lse, loss)
    assert out.shape == (6, 128, 64) and loss.shape == lse.shape == (128, 1)
    assert dh.shape == (128, 128) and dw.shape == (500, 128) and dw.dtype == torch.float32


def test_kernels_name_the_constraint_and_ops_fall_back_once_or_raise_in_strict_mode():
    with pytest.raises(Exception, match="rope kernel: head dim 33 must be even"):
        rp.rope(torch.randn(2, 8, 33), torch.randn(1, 8, 33), torch.randn(1, 8, 33))
    with pytest.raises(Exception, match="linear_ce_fwd: tokens T=100 and hidden size D=128 must be multiples of 128"):
        ce.linear_ce_fwd(torch.randn(100, 128), torch.randn(10, 128), torch.zeros(100, 1, dtype=torch.int32))
    torch_ops._warned.clear()
    x, cos, sin = torch.randn(1, 2, 8, 33), torch.randn(1, 1, 8, 33), torch.randn(1, 1, 8, 33)
    with pytest.warns(UserWarning, match="rope kernel: head dim 33"):
        out = ops.apply_rope(x, cos, sin)
    torch.testing.assert_close(out, x * cos + ops.rotate_half(x) * sin)
    h, w, labels = torch.randn(3, 40, 128), torch.randn(50, 128), torch.randint(0, 50, (3, 40))
    with pytest.warns(UserWarning, match="tokens T=120"):
        loss = ops.linear_cross_entropy(h, w, labels)
    torch.testing.assert_close(loss, F.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten()))
    policy.set_strict(True)
    try:
        with pytest.raises(rp.UnsupportedInput, match="strict mode"):
            ops.apply_rope(x, cos, sin)
    finally:
        policy.set_strict(False)
    with pytest.raises(ValueError, match="reduction"):
        ops.cross_entropy(torch.randn(128, 4), torch.zeros(128, dtype=torch.long), reduction="max")


def _rope_and_loss(x, cos, sin, w, labels):
    y = x * cos + torch.cat((-x[..., 16:], x[..., :16]), dim=-1) * sin
    logits = F.linear(y.transpose(1, 2).flatten(2), w).float()
    return F.cross_entropy(logits.view(-1, w.shape[0]), labels.view(-1), ignore_index=-100)


def _problem_on_neuron():
    x = torch.randn(2, 2, 64, 32, requires_grad=True)
    cos, sin = (t.unsqueeze(1) for t in _tables(2, 64, 32))
    w = (torch.randn(200, 64) * 0.1).requires_grad_()
    labels = torch.randint(0, 200, (2, 64))
    labels[0, :3] = -100
    args = [t.detach().to("neuron") for t in (x, cos, sin, w, labels)]
    args[0].requires_grad_()
    args[3].requires_grad_()
    return (x, cos, sin, w, labels), args


@pytest.mark.parametrize("enabled", [True, False])
def test_substitution_fires_on_rope_and_the_fused_head_unless_switched_off(enabled, substituting):
    backend, counts = substituting(enabled)

    cpu, args = _problem_on_neuron()
    torch._dynamo.reset()
    loss = torch.compile(_rope_and_loss, backend=backend)(*args)
    expected = 1 if enabled else 0
    assert counts[0]["rope"] == expected and counts[0]["cross_entropy"] == expected
    torch.testing.assert_close(loss.cpu(), _rope_and_loss(*cpu), **TOL[torch.float32])


@pytest.mark.slow
def test_compiled_rope_and_fused_head_match_eager_forward_and_backward():
    cpu, args = _problem_on_neuron()
    torch._dynamo.reset()
    loss = torch.compile(_rope_and_loss, backend="neuron")(*args)
    loss.backward()
    ref = _rope_and_loss(*cpu)
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref, **TOL[torch.float32])
    torch.testing.assert_close(args[0].grad.cpu(), cpu[0].grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(args[3].grad.cpu(), cpu[3].grad, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_tiny_llama_compiled_substitutes_rope_and_cross_entropy_and_matches_eager(monkeypatch):
    from tests.models import compiled_llama_against_eager, tiny_llama

    monkeypatch.setenv("TORCHNEURON_COMPILE_ROPE_CE_KERNELS", "1")
    torch.manual_seed(0)
    base = tiny_llama()
    ids = torch.randint(0, 128, (8, 16))  # 128 tokens: the cross-entropy kernels' tile
    counts = compiled_llama_against_eager(base, ids, monkeypatch)
    assert counts[0]["rope"] == 4 and counts[0]["cross_entropy"] == 1  # q and k of two layers; the loss


def test_prices_of_large_problems_extend_short_simulations_close_to_a_whole_one(monkeypatch):
    from torchneuron.kernels import pricing_rope_ce as pricing

    trn2 = TARGETS["trn2"]
    whole_rope = pricing.rope_kernel_seconds(trn2, 8, 4096, 128, 1, torch.bfloat16)
    whole_ce = pricing.ce_kernel_seconds(trn2, False, 256, 128, 6000, torch.bfloat16)
    monkeypatch.setattr(pricing, "ROPE_SIM_ELEMENTS", 1)  # extend from runs of 2 and 4 heads
    monkeypatch.setattr(pricing, "CE_SIM_TILES", 1)       # from vocabularies of 2048 and 4096
    assert pricing.rope_kernel_seconds(trn2, 8, 4096, 128, 1, torch.bfloat16) == pytest.approx(whole_rope, rel=0.05)
    assert pricing.ce_kernel_seconds(trn2, False, 256, 128, 6000, torch.bfloat16) == pytest.approx(whole_ce, rel=0.05)
