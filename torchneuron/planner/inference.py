"""`plan_inference()`: serving a decoder with tensor parallelism, TTFT, TPOT and KV-cache capacity.

The transformers model runs on fake tensors over `tp` logical cores of one node with tensor
parallelism (column/row splits, no sequence parallelism), as one rank: a prefill of `batch`
sequences of `context` tokens (time to first token), then one decode step of `batch` tokens
against the KV cache the prefill left (time per output token). Both are traced, priced in the
chosen mode and replayed like a training step (simulate.py); a decoder deeper than the traced
depths is extrapolated linearly in its layers, as in training.py.

KV-cache capacity: what is left of the core's HBM share (less the reserve) after the weights and
the decode step's transient memory, divided by the cache bytes one token takes on one core:
2 (K and V) x layers x max(1, kv_heads / tp) x head_dim x itemsize.
"""
from __future__ import annotations

import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchneuron.planner.build import ModelSource, tensor_parallel, build_model, load_config
from torchneuron.planner.cluster import DEFAULT_LNC, Assumptions, instance, logical_target
from torchneuron.planner.report import InferencePlan
from torchneuron.planner.simulate import Replay, Totals, price
from torchneuron.planner.topology import Topology
from torchneuron.planner.trace import Tracer
from torchneuron.planner.training import TRACE_DEPTHS, parse_dtype
from torchneuron.planner.world import mesh as make_mesh
from torchneuron.planner.world import simulated_world


def _forward(lm: torch.nn.Module, ids: torch.Tensor, cache: object, start: int) -> torch.Tensor:
    """The decoder's own modules over `ids` at positions start..., appending to `cache`; the
    last position's logits."""
    inner = lm.model
    hidden = inner.embed_tokens(ids)
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    rotary = inner.rotary_emb(hidden, positions) if hasattr(inner, "rotary_emb") else None
    for layer in inner.layers:
        out = layer(hidden, attention_mask=None, position_ids=positions, past_key_values=cache, use_cache=True,
                    cache_position=positions[0], position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    return lm.lm_head(inner.norm(hidden[:, -1:]))


def _run(source: ModelSource, depth: int | None, tp: int, batch: int, context: int, dtype: torch.dtype,
         mode: str, topology: Topology) -> tuple[Totals, Totals, int, int]:
    """(prefill totals, decode totals, weight bytes, decode transient peak bytes) at `depth`."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_model(source, dtype, fake_mode, depth)
    if tp > 1:
        tensor_parallel(model, make_mesh({"tp": tp})["tp"], sequence_parallel=False)
    device = torch.device("neuron", 0)
    with fake_mode, torch.no_grad():
        ids = torch.zeros(batch, context, dtype=torch.long, device=device)
        prefill, decode = Tracer(), Tracer()
        from transformers import DynamicCache

        cache = DynamicCache()
        with prefill:
            _forward(model, ids, cache, 0)
        with decode:
            _forward(model, ids[:, :1], cache, context)
        decode.finish()
        weights = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                      for p in model.parameters())
    results = []
    for tracer in (prefill, decode):
        replay = Replay()
        replay.run(price(tracer.events, mode, topology.target, topology))
        results.append(replay.finish())
    return results[0], results[1], weights, decode.memory.peak_total


def plan_inference(model: ModelSource, *, tp: int = 1, target: str = "trn2", batch: int = 1, context: int = 2048,
                   dtype: str | torch.dtype = "bf16", mode: str = "eager", lnc: int | None = None,
                   assumptions: Assumptions | None = None) -> InferencePlan:
    """Plans serving `model` (a transformers decoder config) on `tp` logical cores of one node."""
    started = time.perf_counter()
    assumptions = assumptions or Assumptions()
    node = instance(target)
    lnc = lnc if lnc is not None else DEFAULT_LNC[node.target]
    core = logical_target(node.target, lnc)
    topology = Topology(node, core, 1, assumptions, ranks=tp)
    config = load_config(model)
    layers = config.num_hidden_layers
    compute_dtype = parse_dtype(dtype)
    depths = TRACE_DEPTHS if layers > max(TRACE_DEPTHS) else (None,)
    runs = []
    with simulated_world(tp):
        for depth in depths:
            runs.append(_run(model, depth, tp, batch, context, compute_dtype, mode, topology))
    if len(runs) == 1:
        prefill, decode, weights, transient = runs[0]
    else:
        factor = (layers - depths[0]) / (depths[1] - depths[0])
        (p1, d1, w1, m1), (p2, d2, w2, m2) = runs
        prefill, decode = p1.scaled(p2, factor), d1.scaled(d2, factor)
        weights, transient = w1 + factor * (w2 - w1), m1 + factor * (m2 - m1)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * layers * max(1.0, kv_heads / tp) * head_dim * compute_dtype.itemsize
    free = core.hbm_bytes * (1 - assumptions.hbm_reserved_fraction) - weights - transient
    capacity = max(0, int(free // per_token))
    return InferencePlan(str(model) if isinstance(model, str) else config.model_type, node, core, lnc, tp, batch,
                         context, mode, prefill.step_s, decode.step_s, float(weights), per_token, capacity,
                         float(core.hbm_bytes), assumptions, time.perf_counter() - started)
