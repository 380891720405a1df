"""NKI-lib RMSNorm + projection and SwiGLU MLP kernels (kernels/norm_mlp.py) against torch: the
kernels simulated on data against a float64 reference, their host paths against the simulated
kernels, the ops (kernels/norm_mlp_ops.py) forward and backward against unfused torch, bad input
and the fallback, fake tensors, and the ops' price on the device timeline."""
import pytest
import torch
import torch.nn.functional as F

import torchneuron.nki.typing as nt
from torchneuron.hardware import model
from torchneuron.hardware.estimate import estimate
from torchneuron.hardware.targets import TARGETS
from torchneuron.kernels import norm_mlp as nm
from torchneuron.kernels import norm_mlp_ops as ops
from torchneuron.kernels import torch_ops
from torchneuron.ops import policy

EPS = 1e-6
# error allowed relative to the largest magnitude of a result: fp32 arithmetic, or activations
# rounded to bf16 (8 bits of mantissa) before the next matmul
REL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# host path against kernel: the same roundings, apart by fp32 summation order and the bf16
# roundings that order flips (an element of h, dg or du one bf16 ulp off)
HOST_REL = {torch.float32: 2e-5, torch.bfloat16: 4e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, rel: dict = REL) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel[dtype] * scale, f"{what}: max error {err:.3g} against max |ref| {scale:.3g}"


def _rmsnorm_problem(t, d, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    w_norm = (1 + 0.2 * torch.randn(1, d, generator=g)).to(dtype)
    w = (torch.randn(n, d, generator=g) / d ** 0.5).to(dtype)
    dy = torch.randn(t, n, generator=g).to(dtype)
    return x, w_norm, w, dy


def _rmsnorm_reference(x, w_norm, w, dy):
    """y, rstd and the gradients of sum(dy * y) in float64."""
    xr, wnr, wr = (v.double().requires_grad_() for v in (x, w_norm, w))
    rstd = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS)
    y = (xr * rstd * wnr) @ wr.T
    grads = torch.autograd.grad(y, (xr, wnr, wr), dy.double())
    return y.detach(), rstd.detach(), grads


def _swiglu_problem(t, d, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    wg, wu = ((torch.randn(f, d, generator=g) / d ** 0.5).to(dtype) for _ in range(2))
    wd = (torch.randn(d, f, generator=g) / f ** 0.5).to(dtype)
    dy = torch.randn(t, d, generator=g).to(dtype)
    return x, wg, wu, wd, dy


def _swiglu_reference(x, wg, wu, wd, dy):
    xr, wgr, wur, wdr = (v.double().requires_grad_() for v in (x, wg, wu, wd))
    y = ops.swiglu_reference(xr, wgr, wur, wdr)
    return y.detach(), torch.autograd.grad(y, (xr, wgr, wur, wdr), dy.double())


# (T, D, N): several token blocks of the backward (4 tiles a block), D and N past one 512 chunk,
# N not a multiple of 128 (partial row tiles)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d,n", [(640, 640, 320), (128, 256, 96)])
def test_rmsnorm_linear_kernels_match_float64_and_their_host_path(dtype, t, d, n):
    x, w_norm, w, dy = _rmsnorm_problem(t, d, n, dtype)
    y_ref, rstd_ref, (dx_ref, dwn_ref, dw_ref) = _rmsnorm_reference(x, w_norm, w, dy)
    y, rstd = nm.rmsnorm_linear_fwd(x, w_norm, w, EPS)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and y.shape == (t, n)
    _close(y, y_ref, dtype, "y")
    _close(rstd, rstd_ref, torch.float32, "rstd")
    dx, dwn, dw = nm.rmsnorm_linear_bwd(x, w_norm, w, rstd, dy, EPS)
    assert dx.dtype == dtype and dwn.dtype == dw.dtype == torch.float32
    _close(dx, dx_ref, dtype, "dx")
    _close(dwn, dwn_ref, dtype, "dw_norm")
    _close(dw, dw_ref, dtype, "dw")
    host_fwd = nm.host_rmsnorm_linear_fwd(x, w_norm, w, EPS)
    host_bwd = nm.host_rmsnorm_linear_bwd(x, w_norm, w, rstd, dy, EPS)
    for name, got, want in zip(("y", "rstd", "dx", "dw_norm", "dw"), (y, rstd, dx, dwn, dw), (*host_fwd, *host_bwd)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        _close(got, want, dtype, f"host {name}", HOST_REL)


# (T, D, F): a 512-token block and a partial one, F past one group of chunks in both passes, D past 512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d,f", [(640, 640, 640), (128, 128, 256)])
def test_swiglu_kernels_match_float64_and_their_host_path(dtype, t, d, f):
    x, wg, wu, wd, dy = _swiglu_problem(t, d, f, dtype)
    y_ref, grads_ref = _swiglu_reference(x, wg, wu, wd, dy)
    y = nm.swiglu_fwd(x, wg, wu, wd)
    assert y.dtype == dtype and y.shape == (t, d)
    _close(y, y_ref, dtype, "y")
    grads = nm.swiglu_bwd(x, wg, wu, wd, dy)
    names = ("dx", "dwg", "dwu", "dwd")
    for name, got, want in zip(names, grads, grads_ref):
        assert got.shape == want.shape, name
        _close(got, want, dtype, name)
    _close(y, nm.host_swiglu_fwd(x, wg, wu, wd), dtype, "host y", HOST_REL)
    for name, got, want in zip(names, grads, nm.host_swiglu_bwd(x, wg, wu, wd, dy)):
        assert got.dtype == want.dtype, name
        _close(got, want, dtype, f"host {name}", HOST_REL)


@pytest.fixture(params=["kernel", "host"])
def path(request, monkeypatch):
    """The ops compute with the NKI kernel (NKI_SIMULATOR=1) or with their host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def test_ops_forward_and_backward_match_unfused_torch(path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 128, 256, generator=g, requires_grad=True)
    w_norm = (1 + 0.2 * torch.randn(256, generator=g)).requires_grad_()
    wq, wk, wv = (torch.randn(n, 256, generator=g).div(16).requires_grad_() for n in (256, 64, 64))
    q, k, v = ops.rmsnorm_linear(x, w_norm, [wq, wk, wv], EPS)
    normed = ops.rmsnorm_reference(x, w_norm, EPS)
    refs = [F.linear(normed, w) for w in (wq, wk, wv)]
    leaves = (x, w_norm, wq, wk, wv)
    cot = [torch.randn(r.shape, generator=g) for r in refs]
    for got, want in zip((q, k, v), refs):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = _grads((q, k, v), leaves, cot)
    want = _grads(refs, leaves, cot)
    for name, a, b in zip(("x", "w_norm", "wq", "wk", "wv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)

    wg, wu = (torch.randn(384, 256, generator=g).div(16).requires_grad_() for _ in range(2))
    wd = torch.randn(256, 384, generator=g).div(20).requires_grad_()
    y = ops.swiglu_mlp(x, wg, wu, wd)
    ref = ops.swiglu_reference(x, wg, wu, wd)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn(ref.shape, generator=g)
    for name, a, b in zip(("x", "wg", "wu", "wd"), _grads(y, (x, wg, wu, wd), cot),
                          _grads(ref, (x, wg, wu, wd), cot)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_ops_in_bf16_match_unfused_torch_within_its_rounding():
    x = torch.randn(256, 128).bfloat16().requires_grad_()
    wg, wu = (torch.randn(256, 128).div(11).bfloat16().requires_grad_() for _ in range(2))
    wd = torch.randn(128, 256).div(16).bfloat16().requires_grad_()
    y = ops.swiglu_mlp(x, wg, wu, wd)
    ref = ops.swiglu_reference(*(v.float() for v in (x, wg, wu, wd)))
    assert y.dtype == torch.bfloat16
    _close(y, ref, torch.bfloat16, "y")
    dy = torch.randn(256, 128).bfloat16()
    got = _grads(y, (x, wg, wu, wd), dy)
    assert all(g_.dtype == torch.bfloat16 for g_ in got)
    leaves = [v.detach().float().requires_grad_() for v in (x, wg, wu, wd)]
    want = _grads(ops.swiglu_reference(*leaves), leaves, dy.float())
    for name, a, b in zip(("x", "wg", "wu", "wd"), got, want):
        _close(a, b, torch.bfloat16, name)


def test_ops_on_neuron_match_cpu_and_are_charged_their_kernels_simulated_latency():
    trn2 = TARGETS["trn2"]
    x, w_norm, w, _ = _rmsnorm_problem(256, 256, 384, torch.bfloat16)
    xs, wgs, wus, wds, _ = _swiglu_problem(256, 256, 512, torch.bfloat16)
    with estimate("trn2") as est:
        (y,) = ops.rmsnorm_linear(x.to("neuron"), w_norm.view(-1).to("neuron"), [w.to("neuron")], EPS)
        m = ops.swiglu_mlp(*(v.to("neuron") for v in (xs, wgs, wus, wds)))
        y_cpu, m_cpu = y.cpu(), m.cpu()
    torch.testing.assert_close(y_cpu, ops.rmsnorm_linear(x, w_norm.view(-1), [w], EPS)[0])
    torch.testing.assert_close(m_cpu, ops.swiglu_mlp(xs, wgs, wus, wds))
    rows = {row.name: row for row in est.per_op}
    launch = model.launch_cost(trn2)  # an eager op's dispatch, on top of the kernel's latency
    _, stats = nm.rmsnorm_linear_fwd.run((x, w_norm, w, EPS), {}, target=trn2)
    assert rows["nki::rmsnorm_linear_fwd"].time_s == pytest.approx(stats.latency_s + launch)
    _, stats = nm.swiglu_fwd.run((xs, wgs, wus, wds), {}, target=trn2)
    assert rows["nki::swiglu_fwd"].time_s == pytest.approx(stats.latency_s + launch)
    # the backward ops are priced by their kernels too
    for name, kernel, args in (
            ("rmsnorm_linear_bwd", nm.rmsnorm_linear_bwd,
             (nt.tensor[(256, 256), torch.bfloat16], nt.tensor[(1, 256), torch.bfloat16],
              nt.tensor[(384, 256), torch.bfloat16], nt.tensor[(256, 1), torch.float32],
              nt.tensor[(256, 384), torch.bfloat16])),
            ("swiglu_bwd", nm.swiglu_bwd,
             (nt.tensor[(256, 256), torch.bfloat16], nt.tensor[(512, 256), torch.bfloat16],
              nt.tensor[(512, 256), torch.bfloat16], nt.tensor[(256, 512), torch.bfloat16],
              nt.tensor[(256, 256), torch.bfloat16]))):
        _, stats = kernel.run(args, {}, target=trn2)
        sigs = [(a.dtype, a.shape) for a in args]
        assert model.op_cost(f"nki_kernels::{name}", sigs, [], trn2).duration_s == pytest.approx(stats.latency_s)


def test_fake_tensors_give_the_ops_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y, rstd = ops.rmsnorm_linear_fwd_op(torch.empty(256, 128), torch.empty(1, 128), torch.empty(200, 128), EPS)
        dx, dwn, dw = ops.rmsnorm_linear_bwd_op(torch.empty(256, 128), torch.empty(1, 128), torch.empty(200, 128),
                                                rstd, y, EPS)
        m = ops.swiglu_fwd_op(*(torch.empty(s, dtype=torch.bfloat16) for s in ((128, 256), (384, 256),
                                                                                   (384, 256), (256, 384))))
    assert y.shape == (256, 200) and rstd.shape == (256, 1) and rstd.dtype == torch.float32
    assert dx.shape == (256, 128) and dwn.shape == (1, 128) and dw.shape == (200, 128) and dw.dtype == torch.float32
    assert m.shape == (128, 256) and m.dtype == torch.bfloat16


def test_kernels_name_the_constraint_and_ops_fall_back_once_or_raise_in_strict_mode():
    with pytest.raises(Exception, match="rmsnorm_linear_fwd: tokens T=100 and hidden size D=128 must be "
                                                  "multiples of 128"):
        nm.rmsnorm_linear_fwd(torch.randn(100, 128), torch.ones(1, 128), torch.randn(64, 128))
    with pytest.raises(Exception, match="swiglu_fwd: .*intermediate size F=200 must be multiples of 128"):
        nm.swiglu_fwd(torch.randn(128, 128), torch.randn(200, 128), torch.randn(200, 128), torch.randn(128, 200))
    with pytest.raises(nm.UnsupportedInput, match="swiglu_bwd: hidden size D=8192 does not fit"):
        nm.check_swiglu(*(nt.tensor[s, torch.float32] for s in ((128, 8192), (128, 8192), (128, 8192),
                                                                (8192, 128))), what="swiglu_bwd")
    torch_ops._warned.clear()
    x, w_norm, w = torch.randn(3, 40, 128), torch.rand(128) + 0.5, torch.randn(64, 128)
    with pytest.warns(UserWarning, match="rmsnorm_linear kernel: tokens T=120") as caught:
        (y,) = ops.rmsnorm_linear(x, w_norm, [w])
        ops.rmsnorm_linear(x, w_norm, [w])
    assert len([c for c in caught if "rmsnorm_linear kernel" in str(c.message)]) == 1  # once
    torch.testing.assert_close(y, F.linear(ops.rmsnorm_reference(x, w_norm, 1e-6), w))
    xs = torch.randn(128, 128, dtype=torch.float64)
    ws = [torch.randn(256, 128, dtype=torch.float64), torch.randn(256, 128, dtype=torch.float64),
          torch.randn(128, 256, dtype=torch.float64)]
    with pytest.warns(UserWarning, match="swiglu kernel: operands must share one of float32/bfloat16/float16"):
        out = ops.swiglu_mlp(xs, *ws)
    torch.testing.assert_close(out, ops.swiglu_reference(xs, *ws))
    policy.set_strict(True)
    try:
        with pytest.raises(nm.UnsupportedInput, match="strict mode"):
            ops.rmsnorm_linear(x, w_norm, [w])
        with pytest.raises(nm.UnsupportedInput, match="strict mode"):
            ops.swiglu_mlp(xs, *ws)
    finally:
        policy.set_strict(False)


def test_prices_of_large_problems_extend_short_simulations_close_to_a_whole_one(monkeypatch):
    from torchneuron.kernels import pricing_norm_mlp as pricing

    trn2 = TARGETS["trn2"]
    # past two token blocks (the backward's 512 tokens; SwiGLU's 512) and past the fits' widths
    problems = [("rmsnorm_linear_bwd", 2048, 256, 6144), ("swiglu_fwd", 2048, 256, 2048)]
    whole = [pricing.kernel_seconds(trn2, *p, torch.bfloat16) for p in problems]
    simulated = []
    run = pricing._run

    def recording(*args):
        simulated.append(args[1:5])
        return run(*args)

    monkeypatch.setattr(pricing, "_run", recording)
    monkeypatch.setattr(pricing, "SIM_MATMUL_TILES", 1)  # extend from shorter runs
    for problem, seconds in zip(problems, whole):
        assert pricing.kernel_seconds(trn2, *problem, torch.bfloat16) == pytest.approx(seconds, rel=0.1)
        assert problem not in simulated and any(s[0] == problem[0] for s in simulated)


def _mlp(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd).sum()


@pytest.mark.parametrize("enabled", [True, False])
def test_substitution_fires_on_the_swiglu_mlp_unless_switched_off_or_unsupported(enabled, substituting):
    backend, counts = substituting(enabled)

    _, wg, wu, wd, _ = _swiglu_problem(128, 128, 256, torch.float32)
    for tokens, fires in ((128, enabled), (100, False)):  # 100 tokens: no kernel tile
        x = torch.randn(tokens, 128)
        torch._dynamo.reset()
        out = torch.compile(_mlp, backend=backend)(*(v.to("neuron") for v in (x, wg, wu, wd)))
        assert counts[-1]["swiglu"] == int(fires)
        torch.testing.assert_close(out.cpu(), _mlp(x, wg, wu, wd), atol=1e-4, rtol=1e-5)


@pytest.mark.slow
def test_tiny_llama_compiled_substitutes_its_mlps_and_matches_eager(monkeypatch):
    from tests.models import compiled_llama_against_eager, tiny_llama

    monkeypatch.setenv("TORCHNEURON_COMPILE_ROPE_CE_KERNELS", "1")
    torch.manual_seed(0)
    base = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
    ids = torch.randint(0, 128, (2, 64))  # 128 tokens: the kernels' tile
    counts = compiled_llama_against_eager(base, ids, monkeypatch)
    assert counts[0]["swiglu"] == 2  # one MLP a layer
