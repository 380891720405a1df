"""What profiling costs a training step on neuron: torch.profiler off vs on, as ratios.

Runs, in one process and interleaved round by round, the same training step
  off                  no profiler (the baseline),
  cpu                  torch.profiler with ProfilerActivity.CPU only (Kineto's own cost),
  cpu+neuron           torch.profiler with CPU and PrivateUse1: neuron device capture with
                       source lines, module paths and device time per op (issue #7),
and prints the median CPU time of this process per step (process_time: steadier than wall time
on a shared machine; with one intra-op thread the two agree on an idle one) and the ratios
cpu+neuron/off (goal: at most 1.3x on the tiny-op MLP) and cpu+neuron/cpu (what the neuron capture adds to
Kineto). The profile's post-processing (linking into key_averages, Parquet export) happens
after the profiled steps and is timed separately, per step recorded. Prints the machine.

    .venv/bin/python bench/profiler_overhead.py [--rounds 7] [--steps 10] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from typing import Callable

import torch

from machine import describe
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torchneuron  # noqa: F401  (registers the device)
import torchneuron.profiler as neuron_profiler
from torchneuron.hardware import worklog

Step = Callable[[], None]
MODES = {"off": None, "cpu": [ProfilerActivity.CPU],
         "cpu+neuron": [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def training_step(width: int, depth: int, batch: int) -> Step:
    """An AdamW step of a residual MLP (LayerNorm, Linear, GELU, Linear) with cross-entropy loss."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 10)).to("neuron")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, device="neuron"), torch.randint(0, 10, (batch,), device="neuron")

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


CASES = [
    ("residual MLP 512x4 layers, batch 64, AdamW", lambda: training_step(512, 4, 64)),
    ("residual MLP 128x2 layers, batch 16, AdamW (tiny ops)", lambda: training_step(128, 2, 16)),
]


def timed_round(step: Step, steps: int, activities: list | None) -> tuple[float, float, int]:
    """(seconds per step while profiling, post-processing seconds per step, device events)."""
    if activities is None:
        start = time.process_time()
        for _ in range(steps):
            step()
        worklog.drain()
        return (time.process_time() - start) / steps, 0.0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile(activities=activities)
        prof.start()
        start = time.process_time()
        for _ in range(steps):
            step()
        worklog.drain()
        elapsed = time.process_time() - start
        prof.stop()
    post = time.process_time()
    prof.key_averages()
    events = len(neuron_profiler.device_events(prof))
    if events:
        with tempfile.TemporaryDirectory() as tmp:
            neuron_profiler.export_profile(prof, os.path.join(tmp, "p"), trace=False)
    return elapsed / steps, (time.process_time() - post) / steps, events


def run_case(make: Callable[[], Step], steps: int, rounds: int) -> dict[str, tuple[float, float, int]]:
    step = make()
    for activities in MODES.values():  # warm up: allocator, pricing cache, Kineto
        timed_round(step, 2, activities)
    samples: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in MODES}
    names = list(MODES)
    for index in range(rounds):
        for mode in (names if index % 2 == 0 else names[::-1]):
            samples[mode].append(timed_round(step, steps, MODES[mode]))
    return {mode: (statistics.median(s[0] for s in values), statistics.median(s[1] for s in values), values[0][2])
            for mode, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="training steps per profiled round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: parallel CPU kernels on a shared machine time noise)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, steps = (3, 4) if args.quick else (args.rounds, args.steps)
    print(f"machine: {describe()}")
    print(f"median process CPU time per step over {rounds} interleaved rounds of {steps} steps")
    print(f"{'case':<56} {'off':>10} {'cpu':>10} {'cpu+neuron':>11} {'neuron/off':>10} {'neuron/cpu':>10}"
          f" {'events/step':>11} {'post/step':>10}")
    for name, make in CASES:
        t = run_case(make, steps, rounds)
        off, cpu, neuron = t["off"][0], t["cpu"][0], t["cpu+neuron"][0]
        print(f"{name:<56} {off * 1e3:>7.2f} ms {cpu * 1e3:>7.2f} ms {neuron * 1e3:>8.2f} ms {neuron / off:>10.3f} "
              f"{neuron / cpu:>10.3f} {t['cpu+neuron'][2] / steps:>11.0f} {t['cpu+neuron'][1] * 1e3:>7.2f} ms")
    print("goal: neuron/off <= 1.3 on the tiny ops (issue 25; post/step: key_averages + Parquet export after the profile, not in the step)")


if __name__ == "__main__":
    main()
