"""Eager overhead of the neuron device against the CPU, measured in one run.

Prints, as ratios against the CPU baseline measured interleaved in the same process:
- per-op overhead on tiny tensors (median of many calls) for a few common ops;
- a training step of a small MLP (AdamW) and of a tiny transformer, neuron eager vs cpu eager.
Goals (issue #2): added overhead at most 1 us an op; the MLP step at most 1.1x the CPU.
"""
from __future__ import annotations

import statistics
import time

import torch

import torchneuron  # noqa: F401
from machine import describe


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def interleaved(fns: dict[str, callable], calls: int, rounds: int = 15) -> dict[str, float]:
    """Median per-call time of each function, alternating between them every round."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        per_call_us(fn, max(1, calls // 10))  # warm up
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(per_call_us(fn, calls))
    return {k: statistics.median(v) for k, v in samples.items()}


def tiny_op_cases():
    def make(device):
        a, b = torch.randn(8, device=device), torch.randn(8, device=device)
        m = torch.randn(4, 4, device=device)
        return {
            "add_": lambda: a.add_(b),
            "mul (new output)": lambda: a * b,
            "relu": lambda: torch.relu(a),
            "sum": lambda: a.sum(),
            "mm 4x4": lambda: m @ m,
            "view + index": lambda: m.view(16)[3],
        }
    return make("cpu"), make("neuron")


def mlp_step(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # the same op sequence on both devices
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def transformer_step(device: str):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # the same op sequence on both devices
    x = torch.randn(4, 32, 64, device=device)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    print(f"machine: {describe()}; timeline {'on' if torchneuron.hardware.worklog.is_enabled() else 'off'}")
    cpu, neuron = tiny_op_cases()
    print(f"{'tiny op':<20}{'cpu us':>10}{'neuron us':>12}{'added us':>10}{'ratio':>8}")
    added = []
    for name in cpu:
        t = interleaved({"cpu": cpu[name], "neuron": neuron[name]}, calls=2000)
        added.append(t["neuron"] - t["cpu"])
        print(f"{name:<20}{t['cpu']:>10.2f}{t['neuron']:>12.2f}{added[-1]:>10.2f}{t['neuron'] / t['cpu']:>8.2f}")
    print(f"median added overhead per op: {statistics.median(added):.2f} us (goal <= 1 us)")
    for label, make in (("small MLP AdamW step", mlp_step), ("tiny transformer step", transformer_step)):
        t = interleaved({"cpu": make("cpu"), "neuron": make("neuron")}, calls=5, rounds=9)
        print(f"{label}: cpu {t['cpu'] / 1e3:.2f} ms, neuron {t['neuron'] / 1e3:.2f} ms, "
              f"neuron/cpu = {t['neuron'] / t['cpu']:.3f}x" + (" (goal <= 1.1x)" if "MLP" in label else ""))


if __name__ == "__main__":
    main()
