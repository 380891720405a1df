"""A compiled float32 mixture-of-experts layer on the modeled NeuronCore, measured in one process.

transformers sends non-bfloat16 experts under torch.compile to its `grouped_mm_fallback` op,
which the neuron compiler turns into the device's grouped matmul (compiler/patterns_moe.py).
Prints, with the machine line first, for Mixtral's sparse block (8 experts, top-2) in float32,
forward + backward, on trn2 (modeled device time of the second step):

- eager with transformers' per-expert loop (the baseline), eager with its grouped_mm experts,
  compiled with its grouped_mm experts, and each one's speed-up over the baseline;
- in the compiled step, the grouped-matmul kernels' share of the time and their FLOP/s as a
  percentage of the Tensor engine's float32 peak (their roofline).

    python bench/moe_compiled.py [--dim 256] [--tokens 512]
"""
from __future__ import annotations

import argparse
import warnings

import torch
import transformers

import torchneuron  # noqa: F401
from machine import describe
from torchneuron.hardware import estimate

TARGET = "trn2"


def moe_step(impl: str, dim: int, tokens: int, compiled: bool):
    """One forward + backward of Mixtral's sparse block on neuron, float32."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=dim, intermediate_size=2 * dim, num_local_experts=8,
                                        num_experts_per_tok=2, experts_implementation=impl)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).to("neuron")
    forward = torch.compile(block, backend="neuron") if compiled else block
    x = torch.randn(1, tokens, dim).to("neuron").requires_grad_()

    def step() -> None:
        out = forward(x)
        (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()

    return step


def modeled(step):
    step()  # warm-up: compilation, first-call paths
    with estimate(TARGET) as e:
        step()
        torch.neuron.synchronize()
    return e


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(describe())
    print(f"\nMixtral MoE block, float32, dim {args.dim}, {args.tokens} tokens, 8 experts top-2, "
          f"forward + backward, {TARGET} (modeled device time)")
    runs = {"eager, per-expert loop": modeled(moe_step("eager", args.dim, args.tokens, compiled=False)),
            "eager, grouped_mm": modeled(moe_step("grouped_mm", args.dim, args.tokens, compiled=False)),
            "compiled, grouped_mm": modeled(moe_step("grouped_mm", args.dim, args.tokens, compiled=True))}
    baseline = runs["eager, per-expert loop"].device_time_s
    for name, e in runs.items():
        print(f"   {name:<24} {e.device_time_s * 1e3:8.3f} ms   loop/this = {baseline / e.device_time_s:5.2f}x")
    compiled = runs["compiled, grouped_mm"]
    grouped = [row for row in compiled.per_op if "grouped_mm" in row.name]
    seconds, flops = sum(r.time_s for r in grouped), sum(r.flops for r in grouped)
    peak = compiled.target.peak_flops(torch.float32)
    print(f"   compiled: {sum(r.count for r in grouped)} grouped-matmul kernels, "
          f"{100 * seconds / compiled.device_time_s:.1f}% of the step, "
          f"{100 * flops / seconds / peak:.1f}% of the fp32 Tensor-engine peak")


if __name__ == "__main__":
    main()
