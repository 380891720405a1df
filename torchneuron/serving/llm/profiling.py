"""Profiling a serving run: vLLM's worker profiler on neuron, with the Neuron Explorer export.

vLLM starts and stops its worker profiler from `LLM.start_profile()` / `stop_profile()` and the
server's `/start_profile` / `/stop_profile` (`--profiler-config '{"profiler": "torch",
"torch_profiler_dir": DIR}'`). Its `TorchProfilerWrapper` knows CPU, CUDA and XPU workers only;
`NeuronTorchProfiler` is that wrapper recording `CPU` and `PrivateUse1` (the neuron device
events of torchneuron.profiler) by default, whose trace handler writes into DIR, per
profiling cycle:

- vLLM's usual Chrome trace, `<worker>.<ns>.pt.trace.json[.gz]` (gzip as the config says), now
  with the neuron device tracks, and `<worker>.profiler_out.txt`, the ops by self device time;
- the Neuron Explorer profile `<worker>.<ns>.neuron/` (`torchneuron.profiler.export_profile`):
  `torchneuron explorer DIR` analyses the newest one, i.e. device time per op of the profiled
  engine steps.

This module owns the profiler choice of the neuron worker (worker.py builds it); it changes
nothing of vLLM's own tables or of other platforms' workers.
"""
from __future__ import annotations

import os
import time
import torch
from vllm.config import ProfilerConfig
from vllm.profiler.wrapper import TorchProfilerWrapper

from torchneuron import profiler as neuron_profiler

DEFAULT_ACTIVITIES = ("CPU", "PrivateUse1")
SUPPORTED_ACTIVITIES = frozenset(DEFAULT_ACTIVITIES)


def check_config(config: ProfilerConfig) -> None:
    """Refuses, when the engine starts, a profiler the neuron worker cannot run."""
    if config.profiler is None:
        return
    if config.profiler != "torch":
        raise ValueError(f"The neuron worker profiles with the torch profiler, not {config.profiler!r} (which needs "
                         "CUDA); pass --profiler-config.profiler=torch.")
    unsupported = set(config.torch_profiler_activities or ()) - SUPPORTED_ACTIVITIES
    if unsupported:
        raise ValueError(f"The neuron worker records the torch profiler activities {sorted(SUPPORTED_ACTIVITIES)}, "
                         f"not {sorted(unsupported)}; PrivateUse1 is the neuron device's activity.")


def disabled(config: ProfilerConfig) -> ProfilerConfig:
    """A profiler config with profiling off (what vLLM's GPU worker validates at construction)."""
    return ProfilerConfig() if config.profiler is not None else config


class NeuronTorchProfiler(TorchProfilerWrapper):
    """vLLM's torch profiler wrapper on a neuron worker: neuron device activity recorded, and each
    cycle written both as vLLM's Chrome trace and as a Neuron Explorer profile."""

    def __init__(self, config: ProfilerConfig, worker_name: str, local_rank: int) -> None:
        check_config(config)
        activities = tuple(config.torch_profiler_activities or DEFAULT_ACTIVITIES)
        super().__init__(config, worker_name=worker_name, local_rank=local_rank, activities=activities,
                         on_trace_ready=self._write)
        self._records_device = "PrivateUse1" in activities
        self.explorer_dirs: list[str] = []  # the Neuron Explorer profiles written, oldest first

    def _write(self, prof: torch.profiler.profile) -> None:
        stamp = time.time_ns()
        torch.profiler.tensorboard_trace_handler(self._torch_profiler_trace_dir, worker_name=self._worker_name,
                                                 use_gzip=self._torch_profiler_use_gzip)(prof)
        if self._records_device and neuron_profiler.captures_of(prof):
            path = os.path.join(self._torch_profiler_trace_dir, f"{self._worker_name}.{stamp}.neuron")
            # the Chrome trace (with the device tracks) is the file just written next to it
            self.explorer_dirs.append(neuron_profiler.export_profile(prof, path, trace=False))

