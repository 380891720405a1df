"""The torchtitan config this package trains on neuron: torchtitan's own Llama-3 debug model
(`llama3_debugmodel`), small enough for a host, with every loss written to a file.

torchtitan loads it by module name (`--module torchtitan_config --config llama3_debugmodel_neuron`:
torchtitan_llama.py runs its ranks as a script from this folder, so a CPU reference rank never
imports torchneuron), after the rank has chosen its device: this module imports torchtitan,
whose `torchtitan.tools.utils` fixes the device type when it is first imported
(torchtitan_llama.py's rank entry point sees to the order). Everything else is torchtitan's:
the model, its parallelisms, selective activation checkpointing, AdamW, the warmup schedule and
DCP checkpoints; the command line overrides any field (`--parallelism.tensor_parallel_degree 2`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import TrainingConfig
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

LOSSES_FILE = "losses_rank{rank}.jsonl"


class LossRecorder(MetricsProcessor):
    """torchtitan's metrics processor that also appends each logged step's loss and gradient norm,
    unrounded, to `<dump_folder>/losses_rank<R>.jsonl` (the log prints them to 5 digits)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs: Any) -> None:
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        os.makedirs(dump_folder, exist_ok=True)
        self._losses_path = os.path.join(dump_folder, LOSSES_FILE.format(rank=rank))

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        with open(self._losses_path, "a") as f:
            f.write(json.dumps({"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                                "grad_norm": float(grad_norm)}) + "\n")
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def llama3_debugmodel_neuron() -> Trainer.Config:
    """torchtitan's `llama3_debugmodel` (6 layers, dim 256, vocab 2048, FlexAttention, selective
    activation checkpointing) with 64-token sequences and 2 steps of batch 2."""
    config = llama3_debugmodel()
    config.training = TrainingConfig(local_batch_size=2, seq_len=64, steps=2, disable_cuda_graphs=True)
    config.metrics = LossRecorder.Config(log_freq=1, disable_color_printing=True)
    config.validator.enable = False
    config.lr_scheduler.warmup_steps = 1
    config.checkpoint.interval = 2
    config.debug.seed = 0
    # torchtitan's default SPMD backend, "spmd_types", fails on torch 2.13 before the first step on
    # any device (FSDP2 gets plain parameters where it asks for DTensors on the full mesh): the
    # classic path, DTensors on the parallelised mesh dimensions only, runs.
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
