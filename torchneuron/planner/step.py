"""One rank's training step, run for real on fake tensors in a simulated world, and traced.

`trace_step(setup)` builds the model (build.py), parallelises it over the world's mesh, runs
one untraced warm-up step (FSDP's lazy initialisation, the optimizer's states, DTensor's
sharding caches), then traces one micro-batch (forward and backward; FSDP reduce-scatters its
gradients every micro-batch, as torchtitan does) and the optimizer step (with ZeRO-1's
collectives when data parallelism shards it). Every micro-batch of a step does the same work,
so the planner replays the traced one `micro_batches` times. With pipeline parallelism the
traced "micro-batch" is instead one step of the rank's pipeline schedule (pipeline.StageRun: the
rank's stages, a few micro-batches, every action marked), which the planner replays per rank.

A transformers decoder runs through its own modules (embeddings, rotary tables, decoder layers,
norm, output layer) with a causal mask and the full sequence's positions, so that sequence
parallelism sees whole-sequence rotary tables; the loss is cross-entropy, vocabulary-parallel
under tensor parallelism (`loss_parallel`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchneuron.planner.build import (
    ModelSource, ParallelSpec, Zero1, build_model, decoder_layers, loss_context, parallelize,
)
from torchneuron.planner.pipeline import PipelineTrace, StageRun, traced_micro_batches
from torchneuron.planner.trace import Tracer
from torchneuron.planner.world import mesh as make_mesh


@dataclass
class StepSetup:
    source: ModelSource
    spec: ParallelSpec
    dtype: torch.dtype
    micro_batch: int
    seq: int
    depth: int | None = None
    parallelize_fn: Callable | None = None
    batch_fn: Callable | None = None      # (micro_batch, seq, device) -> model inputs (for a model_fn)
    micro_batches: int = 1                # of the step (pp > 1: the schedule's)


@dataclass
class StepTrace:
    micro: Tracer           # one micro-batch: forward + backward
    optimizer: Tracer       # the optimizer step
    param_bytes: int        # this rank's parameters as stored
    param_numel: int
    grad_bytes: int
    optimizer_bytes: int    # optimizer states (+ FP32 master weights for ZeRO-1)
    layers: int
    vocab: int
    pipeline: PipelineTrace | None = None       # pp > 1: the schedule run's actions (micro covers the whole run)
    order: Callable[[int], dict] | None = None  # pp > 1: every pipeline rank's actions for m micro-batches


def _is_decoder(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "embed_tokens") and hasattr(model, "lm_head")


class DecoderLoss(nn.Module):
    """One micro-batch's loss of a transformers decoder `lm`, through its own modules."""

    def __init__(self, lm: nn.Module, vocab_parallel: bool):
        super().__init__()
        self.lm = lm
        self.vocab_parallel = vocab_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inner = self.lm.model
        hidden = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        rotary = inner.rotary_emb(hidden, positions) if hasattr(inner, "rotary_emb") else None
        for layer in inner.layers:
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        logits = self.lm.lm_head(inner.norm(hidden))
        with loss_context(self.vocab_parallel):
            return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(0, 1))


def run_micro_batch(root: nn.Module, inputs: Any) -> None:
    """Forward and backward of one micro-batch (the loss of a model_fn's output: its mean)."""
    if isinstance(root, DecoderLoss):
        loss = root(inputs)
    else:
        out = root(*inputs) if isinstance(inputs, tuple) else root(inputs)
        loss = (out[0] if isinstance(out, tuple) else out).float().mean()
    with loss_context(isinstance(root, DecoderLoss) and root.vocab_parallel):
        loss.backward()


def _inputs(model: nn.Module, setup: StepSetup, device: torch.device) -> Any:
    if setup.batch_fn is not None:
        return setup.batch_fn(setup.micro_batch, setup.seq, device)
    if _is_decoder(model):
        return torch.zeros(setup.micro_batch, setup.seq, dtype=torch.long, device=device)
    raise ValueError("a model_fn that is not a transformers decoder needs batch_fn=(micro_batch, seq, device) -> "
                     "inputs, so the planner knows what one micro-batch is")


def _group_names(device_mesh) -> dict[tuple[int, ...], str]:
    """Each mesh dimension's group (this rank's) by its ranks, named after the dimension."""
    names = {}
    for name in device_mesh.mesh_dim_names:
        if device_mesh[name].size() > 1:
            group = device_mesh[name].get_group()
            names[tuple(dist.get_process_group_ranks(group))] = name
    return names


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def trace_step(setup: StepSetup) -> StepTrace:
    """Runs and traces one rank's step in the current simulated world (see the module doc)."""
    spec = setup.spec
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fsdp = spec.fsdp > 1
    param_dtype = torch.float32 if fsdp else setup.dtype
    model = build_model(setup.source, param_dtype, fake_mode, setup.depth)
    device_mesh = make_mesh({"pp": spec.pp, "dp": spec.dp, "fsdp": spec.fsdp, "tp": spec.tp})
    device = torch.device("neuron", 0)
    stages = None
    if spec.pp > 1:
        if not _is_decoder(model) or setup.parallelize_fn is not None:
            raise ValueError("pipeline parallelism splits a transformers decoder's layers into stages; for a model_fn "
                             "(or a custom parallelize) plan with pp=1")
        # TP (+SP) and recomputation first, then the stages hold the wrapped layers and are FSDP's roots
        parallelize(model, device_mesh, dataclasses.replace(spec, fsdp=1), setup.dtype)
        stages = StageRun(model, device_mesh, spec, setup.seq, setup.micro_batch, setup.dtype, device, fake_mode,
                          traced_micro_batches(spec.schedule, spec.pp, setup.micro_batches))
        parallelize(model, device_mesh, dataclasses.replace(spec, tp=1, checkpointing=False), setup.dtype,
                    root=stages.modules)
        stages.build(setup.dtype)
        owners: list[nn.Module] = stages.modules
    else:
        root = DecoderLoss(model, spec.tp > 1 and setup.parallelize_fn is None) if _is_decoder(model) else None
        root = parallelize(model, device_mesh, spec, setup.dtype, setup.parallelize_fn, root)
        owners = [model]
    with fake_mode:
        params = [p for owner in owners for p in owner.parameters()]
        if fsdp:
            optimizer: Any = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        else:
            group = device_mesh["dp"].get_group() if spec.dp > 1 else None
            optimizer = Zero1(params, group)
        if stages is None:
            inputs = _inputs(model, setup, device)
            run = lambda tracer: run_micro_batch(root, inputs)  # noqa: E731
        else:
            run = stages.step
        run(None)      # warm-up: lazy init, optimizer states, caches
        optimizer.step()
        optimizer.zero_grad()
        names = _group_names(device_mesh)
        micro, opt = Tracer(names), Tracer(names)
        with micro:
            micro.phase = "forward/backward"
            pipeline = run(micro)
        micro.finish()
        with opt:
            opt.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        param_bytes = _nbytes(local)
        numel = sum(t.numel() for t in local)
        if fsdp:
            states = [s for state in optimizer.state.values() for s in state.values()
                      if isinstance(s, torch.Tensor) and s.dim() > 0]
            optimizer_bytes = _nbytes(s.to_local() if hasattr(s, "to_local") else s for s in states)
        else:
            states = [s for state in optimizer.optimizer.state.values() for s in state.values()
                      if isinstance(s, torch.Tensor) and s.dim() > 0]
            optimizer_bytes = _nbytes(states) + _nbytes(optimizer.masters)
        grad_bytes = param_bytes
    layers = decoder_layers(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    return StepTrace(micro, opt, param_bytes, numel, grad_bytes, optimizer_bytes,
                     len(layers) if layers is not None else 0, vocab, pipeline,
                     stages.order if stages is not None else None)
