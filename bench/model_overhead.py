"""What charging the performance model adds to eager execution: timeline on vs off.

Runs, in one process and interleaved round by round, each case on
  cpu             the baseline,
  neuron, off     the device with the work log disabled (as TORCHNEURON_TIMELINE=0),
  neuron, on      the device recording every op, pricing it with the model and advancing
                  the device timeline (the work log is drained inside the timed region, so
                  pricing is paid for, not deferred past the measurement),
and prints the median per call and the ratios on/off, on/cpu, off/cpu. Then it times the
hardware layer's own per-item costs (op_cost cache hit, timeline enqueue with and without a
listener). Prints the machine it ran on.

    .venv/bin/python bench/model_overhead.py [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from machine import describe
import torch.nn as nn
import torch.nn.functional as F

import torchneuron  # noqa: F401  (registers the device)
from torchneuron.hardware.model import Cost, op_cost
from torchneuron.hardware.timeline import DeviceTimeline, add_listener, remove_listener
from torchneuron.hardware import worklog

Step = Callable[[], object]


def tiny_add(device: str) -> Step:
    a, b = torch.randn(8, device=device), torch.randn(8, device=device)
    return lambda: torch.add(a, b)


def small_mlp_step(device: str) -> Step:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256).to(device), torch.randint(0, 10, (32,)).to(device)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


CASES: list[tuple[str, Callable[[str], Step], int]] = [
    ("add (8 elements)", tiny_add, 2000),
    ("MLP 256-512-512-10 AdamW step, batch 32", small_mlp_step, 20),
]
MODES = ("cpu", "neuron, off", "neuron, on")


def timed_round(step: Step, calls: int, mode: str) -> float:
    """Seconds per call over `calls` back-to-back calls (plus the drain when recording)."""
    if mode != "cpu":
        worklog.set_enabled(mode == "neuron, on")
    start = time.perf_counter()
    for _ in range(calls):
        step()
    if mode == "neuron, on":
        worklog.drain()  # price and enqueue everything recorded in this round
    return (time.perf_counter() - start) / calls


def run_case(make: Callable[[str], Step], calls: int, rounds: int) -> dict[str, float]:
    steps = {mode: make("cpu" if mode == "cpu" else "neuron") for mode in MODES}
    for mode, step in steps.items():  # warm up: caches, allocator, pricing cache
        timed_round(step, max(1, calls // 10), mode)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for index in range(rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        for mode in order:
            samples[mode].append(timed_round(steps[mode], calls, mode))
    return {mode: statistics.median(values) for mode, values in samples.items()}


def per_item_costs(repeats: int) -> dict[str, float]:
    """Microseconds per call of the hardware layer's hot operations."""
    sig = (torch.float32, (64, 64))
    inputs, outputs = [sig, sig], [sig]
    op_cost("aten::add.Tensor", inputs, outputs)
    timeline = DeviceTimeline(99)
    cost = Cost(1e-6, "vector", 0.0, 0.0, "latency")

    def clock(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6

    results = {
        "op_cost, cached signature": clock(lambda: op_cost("aten::add.Tensor", inputs, outputs)),
        "timeline.enqueue, no listener": clock(lambda: timeline.enqueue(0, cost, "aten::add.Tensor")),
    }
    listener = lambda entry: None  # noqa: E731
    add_listener(listener)
    try:
        results["timeline.enqueue, one listener"] = clock(lambda: timeline.enqueue(0, cost, "aten::add.Tensor"))
    finally:
        remove_listener(listener)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 rounds, a tenth of the calls")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    scale = 10 if args.quick else 1
    initially = worklog.is_enabled()
    print(f"machine: {describe()}")
    print(f"median per call over {rounds} interleaved rounds; the work log starts "
          f"{'on' if initially else 'off'} (TORCHNEURON_TIMELINE)")
    header = f"{'case':<42} " + " ".join(f"{m:>13}" for m in MODES) + f" {'on/off':>7} {'on/cpu':>7} {'off/cpu':>7}"
    print(header)
    try:
        for name, make, calls in CASES:
            t = run_case(make, max(1, calls // scale), rounds)
            cpu, off, on = (t[m] for m in MODES)
            print(f"{name:<42} " + " ".join(f"{t[m] * 1e6:>10.1f} us" for m in MODES)
                  + f" {on / off:>7.3f} {on / cpu:>7.3f} {off / cpu:>7.3f}")
    finally:
        worklog.set_enabled(initially)
    print("hardware layer, per call:")
    for name, micros in per_item_costs(20000 // scale).items():
        print(f"  {name:<34} {micros:8.3f} us")


if __name__ == "__main__":
    main()
