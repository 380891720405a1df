"""Performance on models nobody tuned for: warm-up, steady state and where cold compile time goes.

Four models built from configs (transformers' Llama, GPT-2 and BERT, a resnet-style CNN written
here), each trained with AdamW, in CPU eager, Inductor-CPU, neuron eager, neuron adaptive eager
and neuron compiled (bench/compile.py's `Mode`: the compiled modes compile the model and the
optimizer step), all in one process. Prints, per model and mode:

- steady host time per step and its ratio to the CPU counterpart of the same mode (neuron eager
  and adaptive against CPU eager, neuron compiled against Inductor-CPU), median of per-round
  ratios over interleaved rounds;
- the modeled trn2 device time of a steady step and its speedup over neuron eager (what
  compiling and adaptive fusion gain on a real device);
- warm-up: the first step's time, the step after which every step is within 2x of steady
  state, the steps after the first taking over 1 s, and the programs built (Inductor graphs:
  torch.compile's, adaptive eager's fused programs), all and after step 3 (recompilations);
- for the compiled modes, where the cold compile time went (Dynamo, AOTAutograd, the device
  pipeline's passes, Inductor's code generation, C++ builds; torch._dynamo's timers), and the
  time until the last background build finished.

The warm-up of neuron compiled and adaptive runs twice, tiered execution off ("before") and on
(TORCHNEURON_COMPILE_TIERED), each against a fresh Inductor cache with Inductor's in-memory caches
and adaptive eager's programs forgotten, so both start cold. Inductor's one-off probe of the host's
vector ISA (a few g++ runs) is done first and shown apart.

With `--growth` it prints instead how a small transformers Llama's steady step grows with model
width and with sequence length (x1, x2, x4, x8; --quick: up to x4): host time (CPU eager, neuron eager, adaptive,
compiled) and modeled trn2 device time (neuron modes), each as a ratio to the x1 row of the same
mode, so that a mode whose cost grows faster than its peers' shows.

    python bench/suite.py [--quick] [--models llama,gpt2,bert,cnn] [--rounds 7] [--steps 3]
    python bench/suite.py --growth [--quick]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
import torchneuron.eager
from compile import Mode
from machine import describe

VOCAB, SEQ, BATCH = 256, 32, 4


class CausalLM(nn.Module):
    """A transformers model taking (ids, labels) and returning its loss (bench/compile.py's Mode calls forward(ids, targets))."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


class Residual(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.skip = nn.Sequential() if stride == 1 else nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False),
                                                                       nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNetish(nn.Module):
    """A small resnet: stem, four residual blocks (two downsampling), pooling, classifier; forward(images, labels) -> loss."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Residual(width, 1), Residual(width, 2), Residual(2 * width, 1), Residual(2 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], str]:
    """The model `name` (random weights, from a config), one batch, and a description."""
    import transformers

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    tokens = f"batch {BATCH} x {SEQ} tokens"
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        return CausalLM(transformers.LlamaForCausalLM(config)), (ids, ids), f"Llama 2 layers d=64 GQA 4/2, {tokens}"
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ)
        return CausalLM(transformers.GPT2LMHeadModel(config)), (ids, ids), f"GPT-2 2 layers d=64, {tokens}"
    if name == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=SEQ)
        return CausalLM(transformers.BertForMaskedLM(config)), (ids, ids), f"BERT masked LM 2 layers d=64, {tokens}"
    if name == "cnn":
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        return ResNetish(), (images, labels), "resnet-style CNN, 4 blocks, width 16, batch 8 x 3x32x32"
    raise SystemExit(f"unknown model {name!r}: choose from llama, gpt2, bert, cnn")


# (name, device, torch.compile backend, adaptive, CPU counterpart)
MODES = [("cpu eager", "cpu", None, False, None), ("cpu inductor", "cpu", "inductor", False, None),
         ("neuron eager", "neuron", None, False, "cpu eager"),
         ("neuron adaptive", "neuron", None, True, "cpu eager"),
         ("neuron compiled", "neuron", "neuron", False, "cpu inductor")]
TIERED_MODES = ("neuron adaptive", "neuron compiled")


def _programs() -> int:
    """Inductor graphs built or loaded so far (torch.compile's and adaptive eager's programs)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_miss"] + c["fxgraph_cache_hit"] + c["fxgraph_cache_bypass"])


def _timers() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def _breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Cold compile seconds by stage, from torch._dynamo's timers (nested: each stage net of the next)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    dynamo, backend = d.get("_compile.compile_inner", 0.0), d.get("OutputGraph.call_user_compiler", 0.0)
    inner = d.get("compile_fx_inner", 0.0)  # adaptive eager's programs: traced by make_fx, not Dynamo/AOT
    ours = d.get("pass.post_grad_passes.custom_backend_passes_neuron", 0.0)
    cxx = d.get("compile_file", 0.0)
    return {"dynamo": max(0.0, dynamo - backend), "aot": max(0.0, backend - inner) if backend else 0.0,
            "ours": ours, "cxx": cxx,
            "inductor": max(0.0, inner - ours - d.get("PyCodeCache.load_by_key_path", 0.0)
                            - d.get("async_compile.wait", 0.0)),
            "load": d.get("PyCodeCache.load_by_key_path", 0.0) + d.get("async_compile.wait", 0.0)}


@dataclass
class Warmup:
    steps: list[float]
    programs: int
    late_programs: int
    breakdown: dict[str, float] = field(default_factory=dict)
    builds_done_s: float = float("nan")

    def steady_after(self, steady: float) -> int:
        """The step (1-based) from which every warm-up step is within 2x of `steady`."""
        for k in range(len(self.steps)):
            if all(t <= 2 * steady for t in self.steps[k:]):
                return k + 1
        return len(self.steps) + 1

    def slow_steps(self) -> int:
        return sum(t > 1.0 for t in self.steps[1:])


def _cold(adaptive: bool) -> None:
    """Forgets the compiled things kept in memory (Inductor's code caches, the neuron backend's
    graph cache; for adaptive eager its programs) so the next warm-up compiles cold."""
    from torch._inductor.utils import clear_caches

    from torchneuron.compiler import cache

    clear_caches()
    cache.clear()
    if adaptive:
        torchneuron.eager.forget_programs()


def warm_up(mode: Mode, steps: int, tiered: bool | None) -> Warmup:
    """Runs `steps` steps one by one (each waits for the device), cold, tiered execution on or off."""
    from torchneuron.compiler import wait_for_builds

    cold = mode.name in TIERED_MODES or mode.name == "cpu inductor"
    if cold:
        _cold(mode.adaptive)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="suite-inductor-")
    if tiered is not None:
        os.environ["TORCHNEURON_COMPILE_TIERED"] = "1" if tiered else "0"
    timers, programs, start = _timers(), _programs(), time.perf_counter()
    times, late = [], 0
    try:
        for k in range(steps):
            before = _programs()
            times.append(mode.run(1))
            if k >= 3:
                late += _programs() - before
        result = Warmup(times, _programs() - programs, late)
        if mode.backend or mode.adaptive:
            wait_for_builds()
            result.builds_done_s = time.perf_counter() - start
            result.breakdown = _breakdown(timers, _timers())
        return result
    finally:
        os.environ.pop("TORCHNEURON_COMPILE_TIERED", None)


_classes = iter(range(1 << 30))


def _new_mode(spec: tuple, base: nn.Module, batch: tuple) -> Mode:
    """The mode's model is of a class of its own: Dynamo guards on a module's class and structure
    (not on its identity), so each compiled mode traces and compiles its model anew."""
    name, device, backend, adaptive, _ = spec
    own = copy.deepcopy(base)
    own.__class__ = type(f"{type(base).__name__}{next(_classes)}", (type(base),), {})
    mode = Mode(name, own, device, backend, adaptive, batch)
    mode.backend = backend
    return mode


def run_model(name: str, args: argparse.Namespace) -> list[dict]:
    base, batch, description = build(name)
    print(f"\n{name}: {description}, AdamW", flush=True)
    rows, modes = [], []
    for spec in MODES:
        variants = [False, True] if spec[0] in TIERED_MODES else [None]
        for tiered in variants:
            mode = _new_mode(spec, base, batch)
            warm = warm_up(mode, args.warmup, tiered)
            label = spec[0] + ("" if tiered is None else (" (tiered)" if tiered else " (untiered)"))
            print(f"  warm-up {label:<28} first step {warm.steps[0]:6.2f} s, {warm.programs:3d} programs, "
                  f"steps {' '.join(f'{t:.2f}' for t in warm.steps)}", flush=True)
            rows.append({"model": name, "mode": label, "spec": spec, "warm": warm, "tiered": tiered})
            if tiered is not False:
                modes.append((spec, mode, rows[-1]))
    for _ in range(args.rounds):
        for _, mode, _ in modes:  # step by step, each read on the host, as in the warm-up
            mode.times.append(statistics.mean(mode.run(1) for _ in range(args.steps)))
    by_name = {spec[0]: mode for spec, mode, _ in modes}
    eager_device = by_name["neuron eager"].modeled_step("trn2")[0]
    for spec, mode, row in modes:
        row["host"] = statistics.median(mode.times)
        row["loss"] = mode.loss
        counterpart = spec[4]
        if counterpart:
            base_mode = by_name[counterpart]
            row["ratio"] = statistics.median(a / b for a, b in zip(mode.times, base_mode.times))
        modeled = mode.modeled_step("trn2")
        if modeled:
            row["device"], row["items"] = modeled
            row["speedup"] = eager_device / modeled[0]
    steady = {spec[0]: statistics.median(mode.times) for spec, mode, _ in modes}
    for row in rows:
        row["steady_after"] = row["warm"].steady_after(steady[row["spec"][0]])
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<6} {'mode':<28} {'host ms':>8} {'vs CPU':>7} {'trn2 us':>9} {'vs eager':>8} "
          f"{'1st step s':>10} {'steady@':>7} {'>1s':>4} {'progs':>5} {'late':>4}")
    for r in rows:
        w = r["warm"]
        host = f"{r['host'] * 1e3:8.2f}" if "host" in r else f"{'':8}"
        ratio = f"{r['ratio']:6.2f}x" if "ratio" in r else f"{'':7}"
        device = f"{r['device'] * 1e6:9.1f}" if "device" in r else f"{'':9}"
        speed = f"{r['speedup']:7.2f}x" if "speedup" in r else f"{'':8}"
        print(f"{r['model']:<6} {r['mode']:<28} {host} {ratio} {device} {speed} {w.steps[0]:10.2f} "
              f"{r['steady_after']:7d} {w.slow_steps():4d} {w.programs:5d} {w.late_programs:4d}")
    print("\ncold compile, seconds by stage (torch._dynamo timers; C++ builds of tiered modes run in the background):")
    print(f"{'model':<6} {'mode':<28} {'Dynamo':>7} {'AOT':>7} {'ours':>7} {'Inductor':>8} {'load+wait':>9} "
          f"{'g++':>7} {'all built':>9} {'1st step':>8}")
    for r in rows:
        b = r["warm"].breakdown
        if not b:
            continue
        print(f"{r['model']:<6} {r['mode']:<28} {b['dynamo']:7.2f} {b['aot']:7.2f} {b['ours']:7.2f} "
              f"{b['inductor']:8.2f} {b['load']:9.2f} {b['cxx']:7.2f} {r['warm'].builds_done_s:9.2f} "
              f"{r['warm'].steps[0]:8.2f}")


def summary(rows: list[dict]) -> None:
    """The ratios the issue sets goals for, before (untiered) and after (tiered)."""
    def pick(model: str, mode: str) -> dict:
        return next(r for r in rows if r["model"] == model and r["mode"] == mode)

    print("\nwarm-up, tiered execution off -> on (same run, each cold):")
    for model in dict.fromkeys(r["model"] for r in rows):
        eager_step = pick(model, "neuron eager")["host"]
        for mode in TIERED_MODES:
            off, on = pick(model, f"{mode} (untiered)")["warm"], pick(model, f"{mode} (tiered)")["warm"]
            print(f"  {model:<6} {mode:<16} first step {off.steps[0]:6.2f} -> {on.steps[0]:6.2f} s "
                  f"({off.steps[0] / on.steps[0]:5.2f}x faster; {on.steps[0] / eager_step:6.1f}x an eager step), "
                  f"steps > 1 s after the first {off.slow_steps()} -> {on.slow_steps()}, "
                  f"all built {off.builds_done_s:6.2f} -> {on.builds_done_s:6.2f} s")
        inductor = pick(model, "cpu inductor")["warm"]
        on = pick(model, "neuron compiled (tiered)")["warm"]
        print(f"  {model:<6} cold compile, all built: neuron {on.builds_done_s:6.2f} s / Inductor-CPU "
              f"{inductor.builds_done_s:6.2f} s = {on.builds_done_s / inductor.builds_done_s:5.2f}x (goal <= 1.5x)")


# ------------------------------------------------------------------------------------------------
# Growth with width and sequence length
# ------------------------------------------------------------------------------------------------
GROWTH_MODES = ("cpu eager", "neuron eager", "neuron adaptive", "neuron compiled")


@dataclass(frozen=True)
class GrowthConfig:
    """A small Llama scaled along one dimension: width multiplies hidden and MLP sizes (heads
    stay 4/2, so the head dimension grows), seq multiplies the sequence length."""

    dim: str      # "width" | "seq"
    scale: int
    hidden: int
    seq: int
    batch: int = 2
    layers: int = 2

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                                          num_hidden_layers=self.layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=self.seq)
        ids = torch.randint(0, VOCAB, (self.batch, self.seq))
        return CausalLM(transformers.LlamaForCausalLM(config)), (ids, ids)


def growth_configs(hidden: int, seq: int, scales: tuple[int, ...]) -> list[GrowthConfig]:
    """x1 once, then each larger scale along width and along sequence length."""
    configs = [GrowthConfig("base", 1, hidden, seq)]
    for dim in ("width", "seq"):
        for s in scales:
            if s != 1:
                configs.append(GrowthConfig(dim, s, hidden * s if dim == "width" else hidden,
                                            seq * s if dim == "seq" else seq))
    return configs


def growth(hidden: int = 32, seq: int = 16, scales: tuple[int, ...] = (1, 2, 4, 8), modes: tuple[str, ...] = GROWTH_MODES,
           warmup: int = 4, rounds: int = 3, steps: int = 2) -> list[dict]:
    """Steady host seconds per step and modeled trn2 seconds per step of each mode on each config,
    and their ratios to the x1 config of the same mode. One dict per (config, mode)."""
    from torchneuron.compiler import wait_for_builds

    specs = {spec[0]: spec for spec in MODES}
    rows = []
    for config in growth_configs(hidden, seq, scales):
        # Each scale compiles anew, as a process of its own would: otherwise Dynamo recompiles the
        # optimizer step with dynamic shapes (not what is being measured), and the neuron backend
        # turns Dynamo's TensorifyScalarRestartAnalysis on that recompile into a compile error.
        torch._dynamo.reset()
        base, batch = config.build()
        built = []
        for name in modes:
            mode = _new_mode(specs[name], base, batch)
            for _ in range(warmup):  # compiles (tiered: the fused host code builds in the background)
                mode.run(1)
            if mode.backend or mode.adaptive:
                wait_for_builds()
                mode.run(1)
            built.append(mode)
        for _ in range(rounds):  # interleaved, as the main table
            for mode in built:
                mode.times.append(statistics.mean(mode.run(1) for _ in range(steps)))
        for mode in built:
            modeled = mode.modeled_step("trn2")
            rows.append({"dim": config.dim, "scale": config.scale, "hidden": config.hidden, "seq": config.seq,
                         "mode": mode.name, "host": statistics.median(mode.times),
                         "device": modeled[0] if modeled else None})
    first = {r["mode"]: r for r in rows if r["dim"] == "base"}
    for r in rows:
        x1 = first[r["mode"]]
        r["host_x"] = r["host"] / x1["host"]
        r["device_x"] = r["device"] / x1["device"] if r["device"] is not None else None
    return rows


def print_growth(rows: list[dict]) -> None:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    x1 = next(r for r in rows if r["dim"] == "base")
    print(f"\ngrowth of a steady step (Llama 2 layers, d={x1['hidden']}, seq {x1['seq']}, batch 2, AdamW), "
          "as ratios to the x1 row of the same mode")
    print("host: host time per step; trn2: modeled trn2 device time per step (neuron modes)")
    header = " ".join(f"{'host ' + m:>22}" for m in modes) + " " + " ".join(
        f"{'trn2 ' + m:>22}" for m in modes if m != "cpu eager")
    print(f"{'scale':<12} {'d':>5} {'seq':>5} {header}")
    by = {(r["dim"], r["scale"], r["mode"]): r for r in rows}
    for dim, scale in dict.fromkeys((r["dim"], r["scale"]) for r in rows):
        any_row = by[dim, scale, modes[0]]
        label = "x1" if dim == "base" else f"{dim} x{scale}"
        cells = [f"{by[dim, scale, m]['host_x']:21.2f}x" for m in modes]
        cells += [f"{by[dim, scale, m]['device_x']:21.2f}x" for m in modes if m != "cpu eager"]
        print(f"{label:<12} {any_row['hidden']:>5} {any_row['seq']:>5} {' '.join(cells)}")
    print("x1 absolute: " + ", ".join(
        f"{m} host {by['base', 1, m]['host'] * 1e3:.2f} ms" + (
            f" trn2 {by['base', 1, m]['device'] * 1e6:.1f} us" if by['base', 1, m]['device'] is not None else "")
        for m in modes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama and cnn only, 3 rounds")
    parser.add_argument("--models", default="llama,gpt2,bert,cnn")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved steady-state rounds per model")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=8, help="steps timed one by one from cold")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core host: 1)")
    parser.add_argument("--growth", action="store_true",
                        help="only the growth table: width and sequence length x1, x2, x4, x8 of a small Llama "
                             "(--quick: x1, x2, x4, 2 rounds)")
    args = parser.parse_args()
    if args.growth:
        torch.set_num_threads(args.threads)
        from torch._dynamo import config as dynamo_config

        dynamo_config.recompile_limit = 64
        dynamo_config.accumulated_recompile_limit = 4096
        print(f"machine: {describe()}")
        rows = growth(hidden=32, seq=16, scales=(1, 2, 4) if args.quick else (1, 2, 4, 8),
                      rounds=2 if args.quick else args.rounds,
                      warmup=3 if args.quick else 4, steps=1 if args.quick else args.steps)
        print(f"\nmachine: {describe()}")
        print_growth(rows)
        return
    if args.quick:
        args.models, args.rounds, args.warmup = "llama,cnn", 3, 6
    torch.set_num_threads(args.threads)
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = 64  # one compiled optimizer step per model and mode
    dynamo_config.accumulated_recompile_limit = 4096
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    print(f"machine: {describe()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="suite-inductor-")
    start = time.perf_counter()
    isa = pick_vec_isa()
    print(f"Inductor's probe of the host's vector ISA ({isa}), once per process and cache: "
          f"{time.perf_counter() - start:.1f} s (not counted below)")
    rows = []
    for name in args.models.split(","):
        rows += run_model(name.strip(), args)
    print(f"\nmachine: {describe()}")
    print_table(rows)
    summary(rows)


if __name__ == "__main__":
    main()
