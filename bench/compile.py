"""Training step of a tiny transformer in five modes, timed in one process.

Modes: CPU eager, CPU `torch.compile(backend="inductor")`, neuron eager, neuron adaptive eager,
neuron `torch.compile(backend="neuron")`. Compiled modes compile the model (forward and
backward) and AdamW's step. Prints host wall time per step (median over interleaved rounds), the ratios
the issue sets goals for (medians of per-round ratios), and the modeled trn2 device time of a step in
each neuron mode with the items (kernels, copies) it puts on the device timeline. Host time measures
the software NeuronCore, whose kernels are host kernels in every mode; the modeled time is what the
modes differ by on Trainium. Adaptive eager gives eager's results bit for bit, so its fused programs
call the eager kernels for transcendentals, reductions and norms: on the host they save only the
launches of the arithmetic they fuse.

    python bench/compile.py [--steps 5] [--rounds 30] [--threads 1] [--dim 64]

Wider models (--dim 128, 256) show how the host ratios move as kernels outweigh per-op overhead.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
import torchneuron.eager
from machine import describe
from torchneuron.hardware import estimate


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


class Mode:
    """One way of running the training step."""

    def __init__(self, name: str, base: nn.Module, device: str, backend: str | None, adaptive: bool,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.name, self.device, self.adaptive = name, device, adaptive
        self.model = copy.deepcopy(base).to(device)
        self.forward = torch.compile(self.model, backend=backend) if backend else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.opt_step = torch.compile(self.opt.step, backend=backend) if backend else self.opt.step
        self.ids, self.targets = (t.to(device) for t in batch)
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self) -> torch.Tensor:
        loss = self.forward(self.ids, self.targets)
        loss.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def run(self, steps: int) -> float:
        torchneuron.eager.set_eager_mode("adaptive" if self.adaptive else "eager")
        try:
            start = time.perf_counter()
            for _ in range(steps):
                loss = self.step()
            self.loss = loss.item()  # waits for the device, and flushes adaptive eager's queue
            return (time.perf_counter() - start) / steps
        finally:
            torchneuron.eager.set_eager_mode("eager")

    def modeled_step(self, target: str) -> tuple[float, int] | None:
        """Modeled device seconds of one steady-state step on `target`, and the items (kernels, copies) it puts on the device timeline."""
        if self.device == "cpu":
            return None
        torchneuron.eager.set_eager_mode("adaptive" if self.adaptive else "eager")
        try:
            for _ in range(3):  # steady state of this loop (a step, then a host read): adaptive eager's
                self.step().item()  # queue is then one cached plan, whose programs are compiled
            with estimate(target) as est:
                self.step().item()
            return est.device_time_s, est.entries
        finally:
            torchneuron.eager.set_eager_mode("eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per mode")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per mode (compilation)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core host: 1)")
    parser.add_argument("--dim", type=int, default=64, help="model width (the vocabulary is 4x, the sequence dim/2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dim, seq, vocab = args.dim, args.dim // 2, 4 * args.dim
    base = TinyGPT(vocab=vocab, dim=dim, seq=seq)
    batch = (torch.randint(0, vocab, (8, seq)), torch.randint(0, vocab, (8, seq)))
    modes = [
        Mode("cpu eager", base, "cpu", None, False, batch),
        Mode("cpu inductor", base, "cpu", "inductor", False, batch),
        Mode("neuron eager", base, "neuron", None, False, batch),
        Mode("neuron adaptive", base, "neuron", None, True, batch),
        Mode("neuron compiled", base, "neuron", "neuron", False, batch),
    ]
    print(f"machine: {describe()}")
    print(f"model: tiny GPT (2 layers, d={dim}, 4 heads, vocab {vocab}), batch 8 x {seq} tokens, AdamW")
    for mode in modes:
        start = time.perf_counter()
        mode.run(args.warmup)
        print(f"  warm-up {mode.name:<16} {time.perf_counter() - start:7.1f} s (compilation included)")
    for _ in range(args.rounds):
        for mode in modes:
            mode.times.append(mode.run(args.steps))
    wall = {m.name: statistics.median(m.times) for m in modes}
    modeled = {m.name: m.modeled_step("trn2") for m in modes}
    print(f"\n{'mode':<18} {'host ms/step':>12} {'loss':>8} {'modeled trn2 step':>26}")
    for mode in modes:
        device = f"{modeled[mode.name][0] * 1e6:8.1f} us {modeled[mode.name][1]:4d} items" if modeled[mode.name] \
            else "-"
        print(f"{mode.name:<18} {wall[mode.name] * 1e3:12.2f} {mode.loss:8.4f} {device:>26}")

    by_name = {m.name: m for m in modes}

    def ratio(a: str, b: str) -> float:  # median of per-round ratios: robust to the host's drifts
        return statistics.median(x / y for x, y in zip(by_name[a].times, by_name[b].times))

    print("\nratios (host wall time, same process; median of per-round ratios):")
    print(f"  neuron compiled / cpu inductor    {ratio('neuron compiled', 'cpu inductor'):5.2f}x   (goal <= 1.10x)")
    print(f"  neuron eager / neuron compiled    {ratio('neuron eager', 'neuron compiled'):5.2f}x   (goal >= 1.50x)")
    print(f"  neuron adaptive / cpu eager       {ratio('neuron adaptive', 'cpu eager'):5.2f}x   (goal <= 1.00x)")
    print(f"  neuron eager / cpu eager          {ratio('neuron eager', 'cpu eager'):5.2f}x   (for reference)")
    print(f"  cpu eager / cpu inductor          {ratio('cpu eager', 'cpu inductor'):5.2f}x   (for reference: "
          "what compiling gains on the host itself)")
    eager_device = modeled["neuron eager"][0]
    print("modeled trn2 step, speedup over neuron eager (the device's own time; the host runs the software "
          "NeuronCore's kernels):")
    print(f"  neuron eager / neuron compiled    {eager_device / modeled['neuron compiled'][0]:5.2f}x   (goal >= 1.50x)")
    print(f"  neuron eager / neuron adaptive    {eager_device / modeled['neuron adaptive'][0]:5.2f}x")
    print("adaptive eager:", torchneuron.eager.stats())


if __name__ == "__main__":
    main()
