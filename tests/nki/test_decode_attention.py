"""The NKI decode (paged) attention kernel in vLLM's KV-cache layout against a gathered fp32
reference: random block tables with prefix blocks shared between sequences, GQA / MQA, head dims
32 / 64 / 128, one or two new tokens; the registered op (host path and kernel, fake
implementation, the generic fallback for operands the kernel refuses) and its price."""
import math
import warnings

import pytest
import torch

import torchneuron.nki.typing as nt
from torchneuron.hardware import get_target
from torchneuron.kernels import decode_attention as da
from torchneuron.kernels import pricing
from torchneuron.kernels import torch_ops as ops
from torchneuron.ops import policy

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(params=["kernel", "host"])
def path(request, monkeypatch):
    """The op computes with the NKI kernel (NKI_SIMULATOR=1) or with its host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def paged(b, t, hq, hk, d, bs, lens, dtype, shared_blocks=0, seed=3):
    """q, a vLLM-layout cache [blocks, hk, 2 * bs, d] and block tables naming shuffled blocks; the
    first `shared_blocks` entries of every table name the same blocks (a cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    maxb = max(math.ceil(n / bs) for n in lens)
    nblk = b * maxb + 3
    cache = torch.randn(nblk, hk, 2 * bs, d, generator=g).to(dtype)
    table = torch.randperm(nblk, generator=g)[:b * maxb].reshape(b, maxb).int()
    table[:, :shared_blocks] = table[0, :shared_blocks]
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("b,t,hq,hk,d,bs,lens,dtype,shared", [
    (3, 1, 8, 2, 64, 32, [100, 40, 70], torch.bfloat16, 1),   # GQA, a one-block shared prefix
    (2, 2, 8, 2, 128, 128, [300, 260], torch.bfloat16, 2),    # two new tokens, two shared blocks
    (2, 1, 4, 1, 128, 16, [37, 50], torch.float16, 2),        # MQA, small blocks
    (2, 1, 4, 4, 32, 32, [33, 64], torch.float32, 0),         # the serving tests' head size
    (2, 1, 4, 2, 64, 256, [300, 700], torch.bfloat16, 1),     # blocks of 256 keys
])
def test_paged_decode_attention_matches_gathered_reference(b, t, hq, hk, d, bs, lens, dtype, shared, path):
    q, cache, table, ctx = paged(b, t, hq, hk, d, bs, lens, dtype, shared)
    out = ops.paged_decode_attention(q, cache, table, ctx)
    ref = da.reference(q, cache, table, ctx, d ** -0.5)
    assert out.shape == (b, t, hq, d) and out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]


def test_kernel_and_host_path_agree_to_bf16_rounding():
    q, cache, table, ctx = paged(2, 1, 8, 2, 128, 32, [200, 90], torch.bfloat16, 3)
    kernel = da.decode_attention[2](q, cache, table, ctx.view(-1, 1), 128 ** -0.5)
    host = da.host(q, cache, table, ctx.view(-1, 1), 128 ** -0.5)
    assert (kernel.float() - host.float()).abs().max().item() <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,t,hq,hk,d,bs,lens,shared", [
    (3, 1, 8, 2, 64, 32, [100, 40, 70], 1),
    (2, 2, 8, 2, 128, 128, [300, 260], 2),
    (2, 1, 4, 1, 32, 16, [1, 50], 0),          # a one-key context
    (4, 1, 2, 1, 32, 256, [300, 700, 5, 256], 1),
])
def test_host_kernel_equals_the_torch_ops_with_the_kernels_numerics(b, t, hq, hk, d, bs, lens, shared, dtype):
    """host() computes with one C++ kernel (ops/csrc/decode_attention.cpp); _attend(round_p=True)
    is the same numerics as torch ops. They may part only by fp32 summation order: an ulp of the
    output dtype at most, on few elements."""
    q, cache, table, ctx = paged(b, t, hq, hk, d, bs, lens, dtype, shared)
    scale = d ** -0.5
    fast = da.host(q, cache, table, ctx.view(-1, 1), scale)
    ops_path = da._attend(q, cache, table, ctx.view(-1, 1), scale, round_p=True)
    assert fast.shape == (b, t, hq, d) and fast.dtype == dtype
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    gap = (fast.float() - ops_path.float()).abs() / ops_path.float().abs().clamp_min(1.0)
    assert gap.max().item() <= ulp
    assert (fast != ops_path).float().mean().item() <= (1.0 if dtype == torch.float32 else 0.05)
    assert (fast.float() - da.reference(q, cache, table, ctx, scale)).abs().max().item() <= TOL[dtype]


def test_host_kernel_names_its_operand_rules():
    q, cache, table, ctx = paged(2, 1, 4, 2, 32, 32, [40, 9], torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.torchneuron.paged_decode_attention_host(q, cache.bfloat16(), table, ctx, 1.0)
    with pytest.raises(RuntimeError, match="one row per sequence"):
        torch.ops.torchneuron.paged_decode_attention_host(q, cache, table[:1], ctx, 1.0)


def test_op_traces_under_compile_with_its_fake_implementation():
    q, cache, table, ctx = paged(2, 1, 4, 2, 64, 32, [40, 9], torch.float32)
    f = torch.compile(lambda a: ops.paged_decode_attention(a, cache, table, ctx), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(q), da.reference(q, cache, table, ctx, 0.125), atol=1e-5, rtol=1e-5)


def test_unsupported_head_dim_falls_back_to_the_generic_path_once_and_strict_mode_raises(monkeypatch):
    q, cache, table, ctx = paged(2, 1, 2, 1, 256, 32, [40, 9], torch.float32)
    with pytest.raises(Exception, match="head dim 256 is over 128"):  # the kernel's error names the rule
        da.decode_attention[2](q, cache, table, ctx.view(-1, 1), 1 / 16)
    monkeypatch.setattr(ops, "_warned", set())
    with pytest.warns(UserWarning, match="head dim 256 is over 128.*generic implementation"):
        out = ops.paged_decode_attention(q, cache, table, ctx)
    torch.testing.assert_close(out, da.reference(q, cache, table, ctx, 1 / 16), atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call does not warn again
        ops.paged_decode_attention(q, cache, table, ctx)
    policy.set_strict(True)
    try:
        with pytest.raises(da.UnsupportedInput, match="strict mode forbids the generic fallback"):
            ops.paged_decode_attention(q, cache, table, ctx)
    finally:
        policy.set_strict(False)


def test_block_sizes_the_kernel_does_not_walk_are_named():
    q, cache, table, _ = paged(1, 1, 2, 2, 64, 96, [100], torch.float32)
    with pytest.raises(da.UnsupportedInput, match="block size 96 must divide 128"):
        da.check_shapes(q, cache, table)


def test_malformed_operands_raise_naming_the_layout(path):
    q, cache, table, ctx = paged(1, 1, 2, 2, 64, 16, [20], torch.float32)
    with pytest.raises(ValueError, match=r"kv_cache must be \[blocks, Hkv, 2 \* block_size, d\]"):
        ops.paged_decode_attention(q, cache[..., :32].contiguous(), table, ctx)
    with pytest.raises(Exception, match="bf16, fp16 or fp32"):
        da.check_shapes(q, cache.double(), table)


def _run(b, t, hq, hk, d, bs, blocks, dtype=torch.bfloat16):
    args = (nt.tensor[(b, t, hq, d), dtype], nt.tensor[(b * blocks, hk, 2 * bs, d), dtype],
            nt.tensor[(b, blocks), torch.int32], nt.tensor[(b, 1), torch.int32])
    return da.decode_attention[b].run(args, {"scale": d ** -0.5})[1].latency_s


def _price(b, t, hq, hk, d, bs, blocks, dtype=torch.bfloat16):
    sigs = [(dtype, (b, t, hq, d)), (dtype, (b * blocks, hk, 2 * bs, d)), (torch.int32, (b, blocks)),
            (torch.int32, (b, 1))]
    return pricing.decode_attention_seconds(get_target(), "decode_attention", sigs, sigs[:1])


def test_price_is_the_simulated_latency_and_extends_it_to_large_batches():
    assert _price(2, 1, 8, 2, 64, 32, 4) == pytest.approx(_run(2, 1, 8, 2, 64, 32, 4))  # small: simulated whole
    # 6 sequences x 2048 keys is over DECODE_SIM_KEYS: extended from 1- and 2-sequence runs
    assert 6 * 2048 > pricing.DECODE_SIM_KEYS
    assert _price(6, 1, 8, 2, 64, 128, 16) == pytest.approx(_run(6, 1, 8, 2, 64, 128, 16), rel=0.05)
    assert _price(1, 1, 8, 2, 256, 32, 2) is None  # a head dim the kernel refuses keeps the formula


def test_op_on_neuron_is_charged_the_priced_kernel_latency():
    from torchneuron.hardware import timeline as device_timeline
    from torchneuron.hardware.model import launch_cost
    q, cache, table, ctx = paged(2, 1, 8, 2, 64, 32, [100, 40], torch.bfloat16, 1)
    entries = []
    device_timeline.add_listener(entries.append)
    try:
        dev = [x.to("neuron") for x in (q, cache, table, ctx)]
        torch.neuron.synchronize()
        device_timeline.flush_pending()
        entries.clear()
        out = ops.paged_decode_attention(*dev).cpu()
        device_timeline.flush_pending()
    finally:
        device_timeline.remove_listener(entries.append)
    assert (out.float() - da.reference(q, cache, table, ctx, 0.125)).abs().max().item() <= TOL[torch.bfloat16]
    charged = [e.cost.duration_s for e in entries if e.name == "nki::decode_attention"]
    assert charged == [pytest.approx(_run(2, 1, 8, 2, 64, 32, 4) + launch_cost())]
