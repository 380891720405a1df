"""The neuron kernels behind vLLM's layers, without an engine: each matches a plain PyTorch
reference computed on the CPU, and each call is one kernel on the device timeline, priced by
what it reads (paged attention by the cached context)."""
from __future__ import annotations

import math

import pytest
import torch

from torchneuron.hardware import timeline as device_timeline
from torchneuron.serving.llm.kernels import ops

HEADS, KV_HEADS, D, BLOCK = 4, 2, 32, 32


@pytest.fixture
def charged():
    entries = []
    listener = entries.append
    device_timeline.add_listener(listener)
    yield entries
    device_timeline.remove_listener(listener)


def _names(entries) -> list[str]:
    device_timeline.flush_pending()
    return [e.name for e in entries]


def _reference_attention(q, k_ctx, v_ctx, q_len):
    """Causal attention of the last q_len positions of a context: q [q_len, H, D], k/v [S, KVH, D]."""
    s = k_ctx.shape[0]
    group = HEADS // KV_HEADS
    k = k_ctx.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = v_ctx.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(D)  # [H, q_len, S]
    positions = torch.arange(s - q_len, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > positions, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [q_len, H, D]


def _schedule(seq_lens, query_start):
    from vllm import _custom_ops as vllm_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, BLOCK, D)
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    return isa, meta


def test_paged_attention_prefill_and_decode_match_reference(charged):
    torch.manual_seed(0)
    ctx_lens, q_lens = [70, 33, 5], [70, 1, 2]   # a prefill, a decode, a 2-token chunk
    num_blocks = 16
    cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * D)
    # scatter each sequence's context through a shuffled block table
    order = torch.randperm(num_blocks).tolist()
    tables, contexts, slots = [], [], []
    for s in ctx_lens:
        blocks = [order.pop() for _ in range(math.ceil(s / BLOCK))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        contexts.append((torch.randn(s, KV_HEADS, D), torch.randn(s, KV_HEADS, D)))
        slots.append(torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(s)]))
    q = torch.randn(sum(q_lens), HEADS, D)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    isa, meta = _schedule(seq_lens, starts)

    dev = torch.device("neuron")
    cache_n = cache.to(dev)
    k_cache, v_cache = cache_n.view(num_blocks, KV_HEADS, 2 * BLOCK, D).chunk(2, dim=2)
    for (k, v), slot in zip(contexts, slots):
        ops.reshape_and_cache(k.to(dev), v.to(dev), k_cache, v_cache, slot.to(dev), isa)
    out = torch.zeros_like(q, device=dev)
    ops.paged_attention(q.to(dev), k_cache, v_cache, out, starts.to(dev), seq_lens.to(dev), 1 / math.sqrt(D), True,
                        None, -1, torch.tensor(tables, dtype=torch.int32).to(dev), 0.0, meta, None)
    begin = 0
    for (k, v), q_len in zip(contexts, q_lens):
        ref = _reference_attention(q[begin:begin + q_len], k, v, q_len)
        torch.testing.assert_close(out[begin:begin + q_len].cpu(), ref, rtol=1e-4, atol=1e-4)
        begin += q_len
    names = _names(charged)
    assert names.count("neuron_serving::reshape_and_cache") == 3
    assert names.count("neuron_serving::paged_attention") == 1


def test_paged_attention_cost_grows_with_cached_context():
    from torchneuron.hardware import model

    def cost(ctx):
        return model.paged_attention_cost([1] * 8, [ctx] * 8, heads=32, kv_heads=8, head_size=128,
                                          dtype=torch.bfloat16, block_size=128).duration_s

    short, long = cost(256), cost(4096)
    assert long > 8 * short  # decode attention reads the whole context: ~linear in it
    # one sequence's prefill chunk of 512 costs more than a 512-context decode of one token
    prefill = model.paged_attention_cost([512], [512], heads=32, kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                         block_size=128)
    decode = model.paged_attention_cost([1], [512], heads=32, kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                        block_size=128)
    assert prefill.flops > 100 * decode.flops and prefill.duration_s > decode.duration_s


def test_fused_layers_are_one_kernel_each_and_match_vllm_native(charged):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from torchneuron.serving.llm import platform

    platform.install()
    dev = torch.device("neuron")
    with set_current_vllm_config(VllmConfig()):
        norm, act = RMSNorm(64, eps=1e-5), SiluAndMul()
        rope = get_rope(D, max_position=256, is_neox_style=True, dtype=torch.float32)
    assert type(norm).__name__ == "NeuronRMSNorm" and type(act).__name__ == "NeuronSiluAndMul"
    assert type(rope).__name__ == "NeuronRotaryEmbedding"
    norm.weight.data.normal_()
    x, residual, gate = torch.randn(5, 64), torch.randn(5, 64), torch.randn(5, 128)
    positions = torch.tensor([0, 3, 7, 100, 255])
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * D)
    q, k = qkv[:, :HEADS * D], qkv[:, HEADS * D:(HEADS + KV_HEADS) * D]  # strided views, as attention passes

    expect_norm = norm.forward_native(x)
    expect_add = norm.forward_native(x.clone(), residual.clone())
    expect_act = act.forward_native(gate)
    expect_q, expect_k = rope.forward_native(positions, q.clone(), k.clone())

    norm_n = norm.to(dev)
    rope_n = rope.to(dev)
    torch.testing.assert_close(norm_n(x.to(dev)).cpu(), expect_norm)
    out, res = norm_n(x.to(dev), residual.to(dev))
    torch.testing.assert_close(out.cpu(), expect_add[0])
    torch.testing.assert_close(res.cpu(), expect_add[1])
    torch.testing.assert_close(act(gate.to(dev)).cpu(), expect_act)
    qkv_n = qkv.to(dev)
    q_n, k_n = qkv_n[:, :HEADS * D], qkv_n[:, HEADS * D:(HEADS + KV_HEADS) * D]
    rope_n(positions.to(dev), q_n, k_n)
    torch.testing.assert_close(q_n.cpu(), expect_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_n.cpu(), expect_k, rtol=1e-5, atol=1e-5)
    names = [n for n in _names(charged) if n.startswith("neuron_serving::")]
    assert names == ["neuron_serving::rms_norm", "neuron_serving::fused_add_rms_norm",
                     "neuron_serving::silu_and_mul", "neuron_serving::rotary_embedding"]


def test_bf16_norm_and_activation_equal_the_cpu_platform_bit_for_bit():
    # vLLM's CPU platform runs RMSNorm and SiLU-and-mul as their PyTorch-native code (CustomOp's
    # forward_cpu); its C++ kernels round once instead and differ by an ulp in about half the outputs
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from torchneuron.serving.llm import platform

    platform.install()
    bf16, dev = torch.bfloat16, torch.device("neuron")
    with set_current_vllm_config(VllmConfig()):
        norm, act = RMSNorm(64, eps=1e-5, dtype=bf16), SiluAndMul()
    norm.weight.data.normal_()
    x, residual, gate = (torch.randn(16, n, dtype=bf16) * 3 for n in (64, 64, 256))
    expect_norm = norm.forward_native(x)
    expect_out, expect_res = norm.forward_native(x.clone(), residual.clone())
    expect_act = act.forward_native(gate)
    norm_n = norm.to(dev)
    assert torch.equal(norm_n(x.to(dev)).cpu(), expect_norm)
    out, res = norm_n(x.to(dev), residual.to(dev))
    assert torch.equal(out.cpu(), expect_out) and torch.equal(res.cpu(), expect_res)
    assert torch.equal(act(gate.to(dev)).cpu(), expect_act)
