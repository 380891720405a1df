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


def _decode_batch(ctx_lens, shared_prefix_blocks=1):
    """A decode step's operands on neuron: one new token per sequence, contexts written through
    reshape_and_cache into shuffled blocks; the first `shared_prefix_blocks` blocks are one cached
    prefix every sequence's table names. Returns (q, cache rows, tables, seq_lens, the contexts, the
    ISA whose layout the cache was written in)."""
    torch.manual_seed(1)
    num_blocks = 16
    dev = torch.device("neuron")
    cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * D, device=dev)
    rows = cache.view(num_blocks, KV_HEADS, 2 * BLOCK, D)
    k_cache, v_cache = rows.chunk(2, dim=2)
    order = torch.randperm(num_blocks).tolist()
    prefix = [order.pop() for _ in range(shared_prefix_blocks)]
    shared = [torch.randn(shared_prefix_blocks * BLOCK, KV_HEADS, D) for _ in "kv"]
    isa, _ = _schedule(torch.tensor(ctx_lens, dtype=torch.int32), torch.arange(len(ctx_lens) + 1, dtype=torch.int32))
    tables, contexts = [], []
    for s in ctx_lens:
        blocks = prefix + [order.pop() for _ in range(math.ceil(s / BLOCK) - shared_prefix_blocks)]
        tables.append(blocks + [0] * (4 - len(blocks)))
        own = s - len(shared[0])
        k, v = (torch.cat([p, torch.randn(own, KV_HEADS, D)]) for p in shared)
        contexts.append((k, v))
        slot = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(shared[0]), s)])
        ops.reshape_and_cache(k[len(shared[0]):].to(dev), v[len(shared[0]):].to(dev), k_cache, v_cache,
                              slot.to(dev), isa)
    for (k, v) in contexts[:1]:  # the shared prefix is written once, as prefix caching leaves it
        slot = torch.tensor([prefix[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(shared[0]))])
        ops.reshape_and_cache(k[:len(shared[0])].to(dev), v[:len(shared[0])].to(dev), k_cache, v_cache,
                              slot.to(dev), isa)
    q = torch.randn(len(ctx_lens), HEADS, D)
    return q, rows, torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32), contexts, isa


def test_decode_step_runs_the_nki_kernel_charged_its_simulated_latency(charged):
    import torchneuron.nki.typing as nt
    from torchneuron.hardware.model import launch_cost
    from torchneuron.kernels import decode_attention as nki_decode
    from torchneuron.serving.llm import kernels

    ctx_lens = [70, 33, 40]
    q, rows, tables, seq_lens, contexts, isa = _decode_batch(ctx_lens)
    dev = torch.device("neuron")
    starts = torch.arange(len(ctx_lens) + 1, dtype=torch.int32)
    _, meta = _schedule(seq_lens, starts)
    out = torch.zeros_like(q, device=dev)
    _names(charged)
    charged.clear()
    kernels.paged_attention(q.to(dev), rows, out, starts.to(dev), seq_lens.to(dev), isa, 1 / math.sqrt(D), True,
                            None, -1, tables.to(dev), 0.0, meta, None)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i:i + 1].cpu(), _reference_attention(q[i:i + 1], k, v, 1), rtol=1e-4, atol=1e-4)
    device_timeline.flush_pending()
    kernel = [e for e in charged if e.name == "nki_kernels::decode_attention"]
    assert len(kernel) == 1 and "neuron_serving::paged_attention" not in _names(charged)
    b, blocks = len(ctx_lens), math.ceil(max(ctx_lens) / BLOCK)  # the table's columns the kernel walks
    holders = (nt.tensor[(b, 1, HEADS, D), torch.float32], nt.tensor[tuple(rows.shape), torch.float32],
               nt.tensor[(b, blocks), torch.int32], nt.tensor[(b, 1), torch.int32])
    _, stats = nki_decode.decode_attention[b].run(holders, {"scale": 1 / math.sqrt(D)})  # timing-only simulation
    assert kernel[0].cost.duration_s == pytest.approx(stats.latency_s + launch_cost())


def test_decode_step_the_kernel_cannot_take_warns_once_and_runs_vllms_kernel(charged, monkeypatch):
    from torchneuron.kernels import torch_ops
    from torchneuron.ops import policy
    from torchneuron.serving.llm import kernels

    ctx_lens = [50, 40]
    q, rows, tables, seq_lens, contexts, isa = _decode_batch(ctx_lens)
    dev = torch.device("neuron")
    starts = torch.arange(len(ctx_lens) + 1, dtype=torch.int32)
    _, meta = _schedule(seq_lens, starts)
    monkeypatch.setattr(torch_ops, "_warned", set())
    args = (q.to(dev), rows, torch.zeros(q.shape, device=dev), starts.to(dev), seq_lens.to(dev), isa,
            1 / math.sqrt(D), True, None, -1, tables.to(dev), 30.0, meta, None)  # soft-capping: not in the NKI kernel
    with pytest.warns(UserWarning, match="no logits soft-capping"):
        kernels.paged_attention(*args)
    assert "neuron_serving::paged_attention" in _names(charged)
    assert "nki_kernels::decode_attention" not in _names(charged)
    policy.set_strict(True)
    try:
        with pytest.raises(ValueError, match="strict mode forbids"):
            kernels.paged_attention(*args)
    finally:
        policy.set_strict(False)


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


def _timed_kernels() -> tuple[float, float, int]:
    """(ms from `start` to `middle`, ms from `middle` to `end`, records still pending in the work
    log after the first kernel) of a Python-charged kernel (the MoE router's top-k) and two C++
    ones (the norm, SiLU-and-mul, work-log records) around an aten op and an event."""
    from torchneuron.runtime import _C as fast

    dev = torch.device("neuron")
    x, w = torch.randn(8, 64, device=dev), torch.ones(64, device=dev)
    out = torch.empty_like(x)
    weights = torch.empty(8, 2, device=dev)
    ids, slots = (torch.empty(8, 2, dtype=torch.int32, device=dev) for _ in range(2))
    start, middle, end = (torch.neuron.Event(enable_timing=True) for _ in range(3))
    start.record()
    device_timeline.flush_pending()
    y = x + 1  # an op record pending in the work log when the next kernel is charged
    torch.ops._moe_C.topk_softmax(weights, ids, slots, y, True, None, None)
    pending = fast.worklog_pending()
    middle.record()  # a control record pending when the next kernel is charged
    ops.silu_and_mul(torch.empty(8, 32, device=dev), y)
    ops.rms_norm(out, x, w, 1e-5)
    end.record()
    return start.elapsed_time(middle), middle.elapsed_time(end), pending


def test_kernels_charge_without_draining_the_work_log_and_the_same_time_as_when_watched(charged):
    # without a listener a Python kernel leaves earlier op records pending (no per-kernel pricing
    # in Python); the clocks, the events between kernels included, come out as when a listener
    # watches, for the C++ kernels' work-log records as for the Python kernel's direct charge
    device_timeline.remove_listener(charged.append)
    unwatched = _timed_kernels()
    device_timeline.add_listener(charged.append)
    watched = _timed_kernels()
    assert unwatched[2] > 0 and watched[2] == 0
    assert unwatched[0] == pytest.approx(watched[0], rel=1e-9) and unwatched[1] == pytest.approx(watched[1], rel=1e-9)
    assert watched[0] > 0 and watched[1] > 0


def test_fused_layer_records_are_priced_as_the_work_they_do(charged):
    # the C++ kernels' records hold at most four signatures: two writes of one dtype go as one of
    # their bytes; each is priced as the Python kernels were (the op it does, plus the launch)
    from torchneuron.hardware import model as perf_model

    dev, bf16 = torch.device("neuron"), torch.bfloat16
    x, residual = (torch.randn(6, 64, dtype=bf16, device=dev) for _ in range(2))
    w = torch.ones(64, dtype=bf16, device=dev)
    gate, act = torch.randn(6, 128, dtype=bf16, device=dev), torch.empty(6, 64, dtype=bf16, device=dev)
    key, value = torch.randn(6, KV_HEADS, D, dtype=bf16, device=dev), torch.randn(6, KV_HEADS, D, dtype=bf16, device=dev)
    kv_cache = torch.zeros(4, KV_HEADS, 2 * BLOCK, D, dtype=bf16, device=dev)
    k_cache, v_cache = kv_cache.chunk(2, dim=2)
    slots = torch.arange(6, device=dev)
    ops.fused_add_rms_norm(x, residual, w, 1e-5)
    ops.silu_and_mul(act, gate)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots, "vec")
    _names(charged)
    got = {e.name: e.cost.duration_s for e in charged if e.name.startswith("neuron_serving::")}
    sig = lambda t: (t.dtype, tuple(t.shape))  # noqa: E731
    launch = perf_model.launch_cost()
    norm = perf_model.op_cost("aten::rms_norm", [sig(x), sig(residual), sig(w)], [sig(x), sig(residual)])
    silu = perf_model.op_cost("aten::silu", [sig(gate)], [sig(act)])
    write = perf_model.kv_cache_write_cost(6, kv_heads=KV_HEADS, head_size=D, dtype=bf16)
    assert got["neuron_serving::fused_add_rms_norm"] == pytest.approx(norm.duration_s + launch, rel=1e-9)
    assert got["neuron_serving::silu_and_mul"] == pytest.approx(silu.duration_s + launch, rel=1e-9)
    assert got["neuron_serving::reshape_and_cache"] == pytest.approx(write.duration_s + launch, rel=1e-9)
    assert write.duration_s > 0
