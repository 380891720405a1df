"""Neuron kernels behind vLLM's layers: paged attention, the KV-cache write, RMSNorm (plain and
with the residual add), rotary embedding, SiLU-and-mul.

Each is a torch op in the `neuron_serving` namespace with a PrivateUse1 kernel, so every call is
one device kernel: it computes on zero-copy host views of the device tensors (the software
NeuronCore's kernels run on the host), then charges one kernel to the device timeline priced by the
performance model. The per-layer ones (the norms, SiLU-and-mul, rotary embedding, the KV-cache
write, a decode step's attention) are C++ (csrc/fused_layers.cpp): they append a work-log record,
priced by name like any op; paged attention with prefill chunks and the MoE router are below. The
arithmetic is what vLLM's CPU platform runs, so results match it bit for bit in every dtype: its C++ kernels for attention, the KV-cache write and rotary embedding; for RMSNorm
and SiLU-and-mul, which the CPU platform runs as PyTorch-native code, the native rounding points
(RMSNorm: normalise in float32, round to the input dtype, then multiply by the weight in its dtype;
SiLU-and-mul: SiLU rounded to the input dtype, then the product). vLLM's C++ `rms_norm` and
`silu_and_mul` round once, at the end: in bfloat16 about half their outputs differ by an ulp from
the CPU platform's (and transformers'), enough to change greedy tokens. A fused kernel on the
NeuronCore may round its float32 intermediates wherever it chooses, so these rounding points cost
nothing on the hardware. Paged attention is priced from the step's per-sequence query and context
lengths (hardware.model.paged_attention_cost), i.e. by the cached context actually attended.

`paged_attention` (the attention backend's entry) sends a decode step instead to the NKI
decode-attention kernel (kernels/decode_attention.py, op `nki_kernels::decode_attention`):
`neuron_serving::decode_attention` (C++, csrc/fused_layers.cpp) reads vLLM's cache through the
block table's first ceil(longest context / block size) columns, computes on the host with the
kernel's numerics and appends a record of `nki_kernels::decode_attention`, priced by the kernel's
simulated latency (kernels/pricing.py).

The host time of a decode step is vLLM's own plus the kernels' host work: each Python kernel's
cost is looked up per (kernel, signature, target), priced only the first time, and charged
straight to its stream's clock unless a listener watches the timeline entry by entry (_enqueue).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from torchneuron import eager
from torchneuron.hardware import model as perf_model
from torchneuron.hardware.targets import get_target
from torchneuron.hardware.timeline import get_timeline, has_listeners
from torchneuron.hardware.worklog import charge, drain
from torchneuron.kernels import decode_attention as nki_decode
from torchneuron.kernels import torch_ops as nki_ops
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-call Python code
from torchneuron.runtime import host_view

_LIB = torch.library.Library("neuron_serving", "DEF")
_LIB.define("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()")
_LIB.define("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()")
_LIB.define("silu_and_mul(Tensor(a!) out, Tensor x) -> ()")
_LIB.define("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
            "Tensor cos_sin_cache, bool is_neox) -> ()")
_LIB.define("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
            "Tensor slot_mapping, str isa) -> ()")
_LIB.define("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
            "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, "
            "int sliding_window, Tensor block_table, float softcap, Tensor scheduler_metadata, "
            "Tensor? sinks) -> ()")
_LIB.define("decode_attention(Tensor query, Tensor kv_cache, Tensor(a!) output, Tensor seq_lens, Tensor block_table, "
            "int tokens, float scale) -> ()")


_host_view_op = torch.ops.torchneuron.host_view


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """The CPU view of a neuron tensor (CPU tensors pass through)."""
    if t is None or t.device.type == "cpu":
        return t
    # vLLM runs its steps without autograd: the view needs no no_grad block of its own then
    return host_view(t) if torch.is_grad_enabled() else _host_view_op(t)


def _sig(t: torch.Tensor) -> perf_model.TensorSig:
    return t.dtype, tuple(t.shape)


# Each kernel's cost (launch included) per target and signature: the steady state of a decode
# loop prices nothing, it looks its kernels' costs up.
_prices: dict[tuple, perf_model.Cost] = {}
_PRICES_LIMIT = 1 << 14


def _priced(key: tuple, price: Callable[[], perf_model.Cost]) -> perf_model.Cost:
    """The cost of the kernel `key` names (the first element its name, the rest what its price
    depends on) on the current target, launch included; `price()` gives it without the launch
    the first time."""
    target = get_target()
    full = (target.name, *key)
    cost = _prices.get(full)
    if cost is None:
        base = price()
        if len(_prices) >= _PRICES_LIMIT:
            _prices.clear()
        cost = _prices[full] = dataclasses.replace(base, duration_s=base.duration_s + perf_model.launch_cost(target))
    return cost


def _enqueue(name: str, cost: perf_model.Cost, device: int, meta: dict | None = None) -> None:
    """Charges a kernel on `device`'s current stream after the work issued before it. With nobody
    watching the timeline entry by entry (profiler, estimate()), op records still in the work log
    may be applied after it: a stream's clock and busy times add up the same (as a compiled
    graph's plan is charged, compiler/program.py). Pending control records (an event, a wait, a
    sync) see the pending ops first."""
    if has_listeners():
        charge(name, cost, device=device, meta=meta)
        return
    if fast.worklog_pending_control():
        drain()
    get_timeline(device).advance(fast.current_stream_id(device), cost.duration_s, {cost.engine: cost.duration_s}, 1)


def _charge(name: str, key: tuple, price: Callable[[], perf_model.Cost], like: torch.Tensor) -> None:
    """Charges serving kernel `name` (priced by `price()` once per `key` and target)."""
    _enqueue(f"neuron_serving::{name}", _priced((name, *key), price), like.device.index)


def _ready() -> None:
    """Device memory is read directly below: run anything adaptive eager mode still queues."""
    if eager.pending():
        eager.flush()


# the price of the last step's attention: every layer of a step attends over the same lengths
_last_attention_cost: dict[tuple, perf_model.Cost] = {}


def _paged_attention(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
                     alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, sinks):
    _ready()
    starts, lens = _host(query_start_loc), _host(seq_lens)
    torch.ops._C.cpu_attention_with_kv_cache(
        _host(query), _host(key_cache), _host(value_cache), _host(output), starts, lens, scale, causal,
        _host(alibi_slopes), sliding_window, _host(block_table), softcap, _host(scheduler_metadata), _host(sinks),
        None, 1.0, 1.0, "auto")
    starts_list = starts.tolist()
    q_lens = [b - a for a, b in zip(starts_list, starts_list[1:])]
    kv_lens = lens.tolist()[:len(q_lens)]
    if sliding_window > 0:
        kv_lens = [min(s, sliding_window + q - 1) for q, s in zip(q_lens, kv_lens)]
    key = (tuple(q_lens), tuple(kv_lens), query.shape[1], key_cache.shape[1], query.shape[2], key_cache.dtype,
           key_cache.shape[2], causal, get_target().name)
    cost = _last_attention_cost.get(key)
    if cost is None:  # every layer of a step attends over the same lengths: priced once per step
        cost = perf_model.paged_attention_cost(
            q_lens, kv_lens, heads=query.shape[1], kv_heads=key_cache.shape[1], head_size=query.shape[2],
            dtype=key_cache.dtype, block_size=key_cache.shape[2], causal=causal)
        cost = dataclasses.replace(cost, duration_s=cost.duration_s + perf_model.launch_cost())
        _last_attention_cost.clear()
        _last_attention_cost[key] = cost
    _enqueue("neuron_serving::paged_attention", cost, query.device.index)


def _decode_tokens(query_start_loc: torch.Tensor, heads: int) -> int:
    """T if every sequence of the step has the same T new tokens and T * heads score rows fit one
    tile of the NKI decode kernel (a decode step), else 0 (a step with prefill chunks)."""
    starts = _host(query_start_loc).tolist()
    q_lens = {b - a for a, b in zip(starts, starts[1:])}
    t = q_lens.pop() if len(q_lens) == 1 else 0
    return t if 0 < t and t * heads <= nki_decode.P else 0


DECODE_ISA = "vec"  # the vLLM CPU kernels whose KV-cache layout the NKI decode kernel reads


def _decode_refusal(kv_cache: torch.Tensor, query: torch.Tensor, t: int, block_table: torch.Tensor, isa: str,
                    causal: bool, alibi_slopes, sliding_window: int, softcap: float, sinks) -> str | None:
    """Why the NKI decode kernel cannot run this layer's decode step, or None."""
    if isa != DECODE_ISA:
        return (f"the NKI decode-attention kernel reads the KV-cache layout of vLLM's {DECODE_ISA!r} CPU kernels; "
                f"this cache is laid out for {isa!r} (head size {query.shape[-1]}, "
                f"block size {kv_cache.shape[2] // 2})")
    features = [("ALiBi slopes", alibi_slopes is not None), ("a sliding window", sliding_window > 0),
                ("logits soft-capping", softcap > 0), ("attention sinks", sinks is not None),
                ("non-causal attention", not causal)]
    missing = [name for name, used in features if used]
    if missing:
        return f"the NKI decode-attention kernel has no {', '.join(missing)}"
    if not kv_cache.is_contiguous():
        return "the NKI decode-attention kernel addresses a contiguous KV cache; this one is strided"
    try:
        nki_decode.check_shapes(query[:t].unsqueeze(0), kv_cache, block_table[:1])
    except ValueError as error:
        return str(error)
    return None


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, isa: str, scale: float, causal: bool, alibi_slopes: torch.Tensor | None,
                    sliding_window: int, block_table: torch.Tensor, softcap: float,
                    scheduler_metadata: torch.Tensor, sinks: torch.Tensor | None, step_memo: dict | None = None) -> None:
    """One layer's attention over a step's sequences into `output`. kv_cache is vLLM's cache viewed
    [blocks, kv_heads, 2 * block_size, head_size] (each block's keys, then its values, as vLLM's
    CPU kernels for `isa` lay them out).

    A decode step (every sequence T new tokens, T * heads <= 128) runs the NKI decode-attention
    kernel (`nki_kernels::decode_attention`, charged its simulated latency) over the block table's
    first ceil(max context / block size) columns; a step with prefill chunks runs
    `neuron_serving::paged_attention`. A decode step the kernel cannot take (a feature it lacks,
    a head size, block size or cache layout outside its constraints) warns once and runs the
    latter too; strict mode (TORCHNEURON_STRICT=1) raises instead.

    `step_memo`: a dict that lives for one step (the attention backend keeps it on the step's
    metadata); the choice of kernel is made once per step for the layers that share its inputs."""
    memo_key = (query.shape[1:], query.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, isa, causal,
                alibi_slopes is None, sliding_window, softcap, sinks is None)
    decided = None if step_memo is None else step_memo.get(memo_key)
    if decided is None:
        t = _decode_tokens(query_start_loc, query.shape[1])
        decided = (t, _decode_refusal(kv_cache, query, t, block_table, isa, causal, alibi_slopes, sliding_window,
                                      softcap, sinks) if t else None)
        if step_memo is not None:
            step_memo[memo_key] = decided
    t, reason = decided
    if t:
        if reason is None:
            ops.decode_attention(query, kv_cache, output, seq_lens, block_table, t, scale)
            return
        nki_ops.fallback_once(nki_decode.UnsupportedInput(reason))
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    ops.paged_attention(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
                        alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, sinks)


# rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, reshape_and_cache and
# decode_attention have C++ kernels (csrc/fused_layers.cpp, registered for these schemas when the
# runtime loads)
_LIB.impl("paged_attention", _paged_attention, "PrivateUse1")

ops = torch.ops.neuron_serving


def _topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize, bias, is_padding):
    """The MoE router's top-k of softmax(logits) (renormalised over the chosen k if asked)."""
    _ready()
    logits = _host(gating_output).float()
    scores = logits.softmax(dim=-1)
    chosen = (scores + _host(bias).float() if bias is not None else scores).topk(topk_ids.shape[1], dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if is_padding is not None:  # padded rows route nowhere
        weights = weights.masked_fill(_host(is_padding).bool().reshape(-1, 1), 0.0)
    _host(topk_weights).copy_(weights)
    _host(topk_ids).copy_(chosen)
    tokens, k = chosen.shape
    _host(token_expert_indices).copy_(torch.arange(k).mul(tokens).reshape(1, k) + torch.arange(tokens).reshape(tokens, 1))
    _charge("topk_softmax", (gating_output.dtype, gating_output.shape, topk_weights.dtype, topk_ids.shape),
            lambda: perf_model.op_cost("aten::topk", [_sig(gating_output)], [_sig(topk_weights), _sig(topk_ids)]),
            gating_output)


# vLLM's MoE router calls the fused top-k-softmax of its CUDA build (`_moe_C`), which its CPU build
# lacks: give that op its neuron kernel (only if no build of vLLM defined it).
if not hasattr(torch.ops._moe_C, "topk_softmax"):
    _MOE_LIB = torch.library.Library("_moe_C", "FRAGMENT")
    _MOE_LIB.define("topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor(c!) token_expert_indices, "
                    "Tensor gating_output, bool renormalize, Tensor? bias, Tensor? is_padding) -> ()")
    _MOE_LIB.impl("topk_softmax", _topk_softmax, "PrivateUse1")
