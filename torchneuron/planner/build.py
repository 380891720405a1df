"""Full-size models without their memory, parallelised by PyTorch's own code.

- `build_model(config | model_fn, dtype, fake_mode, depth)`: the model is built on the meta
  device (a transformers config through `AutoModelForCausalLM.from_config`, or any `model_fn`),
  then every parameter and buffer becomes a FakeTensor on neuron:0: shapes, dtypes and devices
  of the real thing, no memory.
- `parallelize(model, mesh, spec)`: tensor parallelism with sequence parallelism through
  `parallelize_module` (Megatron-style column/row splits of attention and MLP, sequence-parallel
  norms, a vocabulary-parallel output layer and loss), activation recomputation with
  `checkpoint_wrapper`, FSDP2 `fully_shard` per decoder layer (HSDP over a 2-D mesh when data
  parallelism replicates it), in the order torchtitan applies them.
- `Zero1`: data parallelism with ZeRO-1 optimizer sharding as NeuronX Distributed does it:
  parameters and gradients replicated in the compute dtype, FP32 master weights and AdamW
  states sharded over the data-parallel ranks; a step reduce-scatters each gradient, updates
  the rank's shard, and all-gathers the new weights.
"""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

ModelSource = str | dict | Callable[[], nn.Module]


@dataclass(frozen=True)
class ParallelSpec:
    tp: int = 1
    fsdp: int = 1
    dp: int = 1
    pp: int = 1
    checkpointing: bool = False
    sequence_parallel: bool = True
    schedule: str = "1f1b"          # the pipeline schedule (pipeline.SCHEDULES) when pp > 1
    virtual_stages: int = 1         # stages per pipeline rank (interleaved schedules)


def load_config(source: str | dict) -> Any:
    """A transformers config from a JSON file path or a dict (its `model_type` picks the class)."""
    from transformers import AutoConfig

    if isinstance(source, str):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"model config {source!r} does not exist: pass a transformers config.json "
                                    f"(the planner never downloads from the hub)")
        with open(source) as handle:
            source = json.load(handle)
    values = dict(source)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("the model config has no 'model_type' (e.g. \"llama\"); transformers needs it to pick "
                         "the model class")
    return AutoConfig.for_model(model_type, **values)


def _fakeify(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device) -> nn.Module:
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(FakeTensor(fake_mode, param, device), param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = FakeTensor(fake_mode, buffer, device)
    return model


def build_model(source: ModelSource, dtype: torch.dtype, fake_mode: FakeTensorMode,
                depth: int | None = None) -> nn.Module:
    """The model on fake neuron tensors (see the module docstring); `depth` overrides a config's
    number of decoder layers."""
    with torch.device("meta"):
        if callable(source):
            model = source()
        else:
            from transformers import AutoModelForCausalLM

            config = load_config(source)
            if depth is not None:
                config.num_hidden_layers = depth
            config._attn_implementation = "sdpa"
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(dtype)
    return _fakeify(model, fake_mode, torch.device("neuron", 0))


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The repeated blocks: a transformers decoder's `model.layers`, else the first ModuleList."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)


_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "fc1", "w1", "w3")
_ROWWISE = ("o_proj", "down_proj", "dense", "fc2", "w2", "out_proj")


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style tensor parallelism of a transformers decoder over `tp_mesh` (see the module
    docstring), with sequence parallelism when asked."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    layers = decoder_layers(model)
    inner = getattr(model, "model", None)
    if layers is None or inner is None or not hasattr(model, "lm_head"):
        raise ValueError("tensor parallelism needs a transformers decoder (model.model.layers, model.lm_head); "
                         "for another model pass parallelize=fn(model, mesh) to plan()")
    seq = Shard(1) if sequence_parallel else Replicate()
    inner_plan: dict[str, Any] = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
    if sequence_parallel:
        inner_plan["norm"] = SequenceParallel()
    parallelize_module(inner, tp_mesh, inner_plan)
    parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                                                   use_local_output=False)})
    for layer in layers:
        plan: dict[str, Any] = {}
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and leaf in _COLWISE:
                plan[name] = ColwiseParallel()
            elif isinstance(module, nn.Linear) and leaf in _ROWWISE:
                plan[name] = RowwiseParallel(output_layouts=seq)
            elif sequence_parallel and leaf.endswith("layernorm"):
                plan[name] = SequenceParallel()
        if sequence_parallel:
            plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})
            plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        parallelize_module(layer, tp_mesh, plan)


def parallelize(model: nn.Module, device_mesh: DeviceMesh, spec: ParallelSpec, dtype: torch.dtype,
                parallelize_fn: Callable[[nn.Module, DeviceMesh], Any] | None = None,
                root: nn.Module | list[nn.Module] | None = None) -> nn.Module | list[nn.Module]:
    """Applies TP (+SP), activation checkpointing and FSDP2 to `model` in place; FSDP's root is
    `root` (a module whose forward runs `model`, or a list of them: a rank's pipeline stages),
    else `model`. Under pipeline parallelism FSDP keeps a layer's parameters gathered from its
    forward to its backward (as torchtitan does: the schedule interleaves micro-batches). Returns
    the root."""
    root = root if root is not None else model
    if parallelize_fn is not None:
        parallelize_fn(model, device_mesh)
    elif spec.tp > 1:
        tensor_parallel(model, device_mesh["tp"], spec.sequence_parallel)
    layers = decoder_layers(model)
    if spec.checkpointing and layers is not None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(list(layers)):
            # (the RNG state of a fake device cannot be saved; recomputation draws no numbers here)
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if spec.fsdp > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard_mesh = device_mesh["dp", "fsdp"] if spec.dp > 1 else device_mesh["fsdp"]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        reshard = spec.pp == 1
        for layer in (layers or []):
            fully_shard(layer, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=reshard)
        for module in (root if isinstance(root, list) else [root]):
            fully_shard(module, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return root


def loss_context(vocab_parallel: bool):
    """Where a vocabulary-parallel loss (and its backward) runs: `loss_parallel` under tensor
    parallelism, nothing otherwise."""
    if not vocab_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Zero1:
    """AdamW with ZeRO-1 sharding of FP32 master weights and states over `group` (see the
    module docstring). With a group of one it is plain mixed-precision AdamW."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, lr: float = 1e-4):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.masters = []
        for p in self.params:
            local = _local(p.detach())
            shard = -(-local.numel() // self.size)
            self.masters.append(nn.Parameter(local.new_empty(shard, dtype=torch.float32)))
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, foreach=True)

    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            grad = _local(p.grad).reshape(-1).float()
            padded = master.numel() * self.size
            if padded != grad.numel():
                grad = torch.nn.functional.pad(grad, (0, padded - grad.numel()))
            if self.size > 1:
                shard = grad.new_empty(master.numel())
                dist.reduce_scatter_tensor(shard, grad, group=self.group)
                master.grad = shard
            else:
                master.grad = grad
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            local = _local(p.data)
            new = master.detach().to(local.dtype)
            if self.size > 1:
                full = new.new_empty(master.numel() * self.size)
                dist.all_gather_into_tensor(full, new, group=self.group)
                new = full
            local.view(-1).copy_(new[:local.numel()])
            master.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
