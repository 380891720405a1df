"""NKI flash-attention kernels (torchneuron.kernels.flash_attention) against torch: forward and
backward, causal or not, GQA / MQA, head dims 64 and 128, sliding window, bf16 / fp16; the
registered torch ops (fake implementation under torch.compile, autograd) and their errors on
unsupported input. Decode (paged) attention: test_decode_attention.py."""

import pytest
import torch
import torch.nn.functional as F

from torchneuron.kernels import flash_attention as fa
from torchneuron.kernels import torch_ops as ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(params=["kernel", "host"])
def path(request, monkeypatch):
    """The ops compute with the NKI kernel (NKI_SIMULATOR=1) or with their host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def _qkv(b, hq, hk, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, s, d, generator=g).to(dtype) for n in (b * hq, b * hk, b * hk)]


@pytest.mark.parametrize("hq,hk,s,d,causal,window,dtype", [
    (2, 2, 256, 64, False, 0, torch.float32),
    (4, 1, 256, 128, True, 0, torch.bfloat16),     # MQA
    (4, 2, 384, 64, True, 130, torch.float16),     # GQA, sliding window
])
def test_attention_forward_matches_torch(hq, hk, s, d, causal, window, dtype):
    q, k, v = _qkv(1, hq, hk, s, d, dtype)
    out, lse = fa.attention_fwd[hq](q, k, v, d ** -0.5, causal, window)
    ref, ref_lse = fa.reference(q, k, v, d ** -0.5, causal, window)
    assert out.dtype == dtype and lse.shape == (hq, s, 1)
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * max(1.0, scale)
    assert (lse - ref_lse).abs().max().item() <= TOL[dtype] * 10


@pytest.mark.parametrize("hq,hk,d,causal,window,dtype", [
    (2, 1, 64, True, 0, torch.bfloat16),
    (2, 2, 128, False, 0, torch.float32),
    (1, 1, 64, True, 100, torch.float16),
])
def test_attention_op_backward_matches_torch_sdpa(hq, hk, d, causal, window, dtype, path):
    s = 256
    q, k, v = [t.reshape(1, -1, s, d).requires_grad_() for t in _qkv(1, hq, hk, s, d, dtype, seed=1)]
    out = ops.attention(q, k, v, causal=causal, window=window)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out.backward(grad)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    mask = None
    if window:
        i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
        mask = (j <= i) & (j > i - window)
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=True)
    ref.backward(grad.float())
    for got, want in [(out, ref)] + [(a.grad, b.grad) for a, b in zip((q, k, v), ref_in)]:
        err = (got.float() - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err <= TOL[dtype] * 2, err




@pytest.mark.parametrize("s,d,causal,window", [(1152, 96, True, 300), (640, 80, False, 200)])
def test_attention_forward_over_several_query_groups_matches_torch_and_its_host_path(s, d, causal, window):
    """Full groups of QGROUP query tiles and a partial one, K and V loaded in one or two
    KBLOCKs; d = 96 carries the row-max shift in the contraction, d = 80 (no free partition
    quadrant) by a rank-1 matmul."""
    q, k, v = _qkv(1, 2, 1, s, d, torch.bfloat16, seed=5)
    out, lse = fa.attention_fwd[2](q, k, v, d ** -0.5, causal, window)
    ref, ref_lse = fa.reference(q, k, v, d ** -0.5, causal, window)
    assert (out.float() - ref).abs().max().item() <= TOL[torch.bfloat16] * max(1.0, ref.abs().max().item())
    assert (lse - ref_lse).abs().max().item() <= TOL[torch.bfloat16]
    host_out, host_lse = fa.host_fwd(q, k, v, d ** -0.5, causal, window)
    # same numerics: at most one bf16 rounding step apart (fp32 sums in another order)
    assert (out.float() - host_out.float()).abs().max().item() <= 2 ** -7 * max(1.0, ref.abs().max().item())
    assert (lse - host_lse).abs().max().item() <= 1e-5


def test_attention_forward_rows_that_see_no_key_are_nan_as_softmax_makes_them():
    """A window with fewer keys than queries leaves the last queries no key (whole query
    tiles among them): those rows are NaN, lse -inf, as torch's softmax gives; the rest match."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, n, 64, generator=g).to(torch.bfloat16) for n in (512, 128, 128))
    out, lse = fa.attention_fwd[1](q, k, v, 0.125, True, 64)
    ref, ref_lse = fa.reference(q, k, v, 0.125, True, 64)
    empty = ref.isnan().any(-1)
    assert empty.any() and torch.equal(out.float().isnan().any(-1), empty)
    assert torch.equal(lse[empty], ref_lse[empty])
    assert (out.float() - ref)[~empty].abs().max().item() <= TOL[torch.bfloat16] * 2

def test_attention_backward_kernel_over_several_key_groups_matches_its_host_path():
    """1152 keys: two full groups of KGROUP key tiles and a partial one, residents loaded in
    two KBLOCKs, causal with a window (some pairs masked, some skipped), GQA: the kernel
    equals host_bwd."""
    s, d, dtype = 1152, 64, torch.bfloat16
    q, k, v = _qkv(1, 2, 1, s, d, dtype, seed=3)
    o, lse = fa.host_fwd(q, k, v, d ** -0.5, True, 300)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = fa.attention_bwd[2](q, k, v, o, do, lse, d ** -0.5, True, 300)
    want = fa.host_bwd(q, k, v, o, do, lse, d ** -0.5, True, 300)
    for g, w in zip(got, want):
        err = (g.float() - w.float()).abs().max().item() / max(1.0, w.float().abs().max().item())
        assert err <= TOL[dtype], err

def test_attention_op_traces_under_compile_with_its_fake_implementation():
    q = torch.randn(1, 2, 128, 64)
    f = torch.compile(lambda a: ops.attention(a, a, a, causal=True), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(q), F.scaled_dot_product_attention(q, q, q, is_causal=True),
                               atol=1e-5, rtol=1e-5)


def test_attention_op_on_neuron_computes_on_the_host_path_and_charges_the_kernel(monkeypatch):
    """Without NKI_SIMULATOR the op computes with its host path and the device is charged the
    kernel's timing-only latency; with it, the kernel runs on the data: same results."""
    from torchneuron.hardware import timeline as device_timeline
    from torchneuron.hardware.model import launch_cost
    import torchneuron.nki.typing as nt
    q = torch.randn(1, 2, 256, 64)
    outs, entries = {}, []
    device_timeline.add_listener(entries.append)
    try:
        for mode in ("0", "1"):
            monkeypatch.setenv("NKI_SIMULATOR", mode)
            qn = q.to("neuron")
            outs[mode] = ops.attention(qn, qn, qn, causal=True).cpu()
            torch.neuron.synchronize()
            device_timeline.flush_pending()
    finally:
        device_timeline.remove_listener(entries.append)
    torch.testing.assert_close(outs["0"], outs["1"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["0"], F.scaled_dot_product_attention(q, q, q, is_causal=True),
                               atol=1e-5, rtol=1e-5)
    holder = nt.tensor[(2, 256, 64), torch.float32]
    _, stats = fa.attention_fwd[2].run((holder,) * 3, {"scale": 0.125, "causal": True})
    charged = [e.cost.duration_s for e in entries if e.name == "nki::attention_fwd"]
    assert len(charged) == 2 and charged[0] == pytest.approx(stats.latency_s + launch_cost())
    assert charged[1] == pytest.approx(charged[0])


def test_attention_kernel_names_unsupported_input():
    q = torch.randn(1, 100, 64)
    with pytest.raises(Exception, match="multiples of 128"):
        fa.attention_fwd[1](q, q, q, 0.125, False, 0)
    q = torch.randn(3, 128, 64)
    with pytest.raises(Exception, match="not a multiple of 2 key/value heads"):
        fa.attention_fwd[3](q, torch.randn(2, 128, 64), torch.randn(2, 128, 64), 0.125, False, 0)


