"""FP8 and mixture-of-experts on the modeled NeuronCore, measured in one process.

Prints, with the machine line first:
1. the modeled device time of a transformer training step (tiny Llama, AdamW) in bf16 and with
   torchao's float8 training recipe (tensor-wise scales) on trn2 and trn3, eager and compiled
   (backend "neuron"), as bf16/fp8 ratios (above 1: fp8 is faster);
2. the same ratio for a transformer MLP block (up and down projections, forward + backward,
   compiled) at realistic widths. This host computes bf16 matmuls far too slowly to run those
   sizes, so the block is compiled once with symbolic shapes (weights as graph inputs) at small
   sizes, and the compiler's kernel plans of that run are priced with the sizes bound to the
   realistic width and token count: the same graphs and cost model, only the host arithmetic is
   skipped;
3. the modeled time of a mixture-of-experts layer (Mixtral's sparse block, forward + backward)
   with transformers' eager per-expert loop vs its grouped_mm experts, and their ratio;
4. the host wall time of the same fp8 step on neuron over CPU (median of per-round ratios),
   which measures the software NeuronCore's overhead, not Trainium.

    python bench/fp8.py [--dim 512] [--layers 2] [--tokens 512] [--rounds 3]
                        [--widths 512,2048,4096] [--block-tokens 4096]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import transformers
from torchao.float8 import convert_to_float8_training

import torchneuron  # noqa: F401
from machine import describe
from torchneuron.compiler.cost import plan_costs
from torchneuron.compiler.program import recorded_plans
from torchneuron.hardware import estimate
from torchneuron.hardware.targets import TARGETS


def llama(dim: int, layers: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=dim, intermediate_size=4 * dim,
                                      num_hidden_layers=layers, num_attention_heads=dim // 64,
                                      num_key_value_heads=dim // 64, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def make_step(model: torch.nn.Module, device: str, tokens: int):
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (2, tokens // 2), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def fp8(model: torch.nn.Module) -> torch.nn.Module:
    return convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)


def modeled(step, target: str) -> float:
    step()  # warm-up: optimizer state, first-call paths
    with estimate(target) as e:
        step()
    return e.device_time_s


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="neuron")


# Small sizes the MLP block is traced at: distinct, so each size symbol's value names its role.
TRACE_TOKENS, TRACE_DIM, TRACE_HIDDEN = 48, 32, 80


def mlp_block_plans(kind: str) -> list:
    """(plan, bindings) of every graph one compiled forward + backward of an MLP block runs, traced
    with symbolic shapes: the weights are plain tensors passed as inputs, so their sizes are
    symbols too."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(TRACE_DIM, TRACE_HIDDEN, bias=False),
                                torch.nn.Linear(TRACE_HIDDEN, TRACE_DIM, bias=False)).to(torch.bfloat16)
    block = (fp8(block) if kind == "fp8" else block).to("neuron")
    weights = {name: p.detach().clone().requires_grad_() for name, p in block.named_parameters()}
    loss = torch.compile(lambda w, x: torch.func.functional_call(block, w, (x,)).float().pow(2).mean(),
                         backend="neuron", dynamic=True)
    x = torch.randn(TRACE_TOKENS, TRACE_DIM, dtype=torch.bfloat16, device="neuron", requires_grad=True)
    with recorded_plans() as charged:
        loss(weights, x).backward()
        torch.neuron.synchronize()
    return charged


def priced(plans: list, target: str, width: int, tokens: int) -> float:
    """Modeled seconds of the traced plans with their symbols bound to `width` and `tokens`."""
    sizes = {TRACE_TOKENS: tokens, TRACE_DIM: width, TRACE_HIDDEN: 4 * width}
    return sum(cost.duration_s for plan, bindings in plans
               for cost in plan_costs(plan.kernels, {k: sizes[v] for k, v in bindings.items()}, TARGETS[target]))


def moe_layer(impl: str, dim: int, tokens: int):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=dim, intermediate_size=2 * dim, num_local_experts=8,
                                        num_experts_per_tok=2, experts_implementation=impl)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).to(torch.bfloat16)
    block = block.to("neuron")
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16).to("neuron").requires_grad_()

    def step() -> None:
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

    return step


def host_seconds(step) -> float:
    start = time.perf_counter()
    step()
    torch.neuron.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", default="512,2048,4096", help="MLP block widths (section 2)")
    parser.add_argument("--block-tokens", type=int, default=4096, help="tokens a core sees per step (section 2)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(describe())
    base = llama(args.dim, args.layers)
    print(f"\n1. training step, Llama dim {args.dim} x {args.layers} layers, {args.tokens} tokens (modeled device time)")
    for mode, wrap in (("eager", lambda m: m), ("compiled", compiled)):
        steps = {kind: make_step(wrap(model), "neuron", args.tokens)
                 for kind, model in (("bf16", copy.deepcopy(base)), ("fp8", fp8(copy.deepcopy(base))))}
        for target in ("trn2", "trn3"):
            bf16, f8 = modeled(steps["bf16"], target), modeled(steps["fp8"], target)
            print(f"   {mode:>8} {target}: bf16 {bf16 * 1e3:8.3f} ms   fp8 {f8 * 1e3:8.3f} ms   bf16/fp8 = {bf16 / f8:.2f}x")

    print(f"\n2. MLP block (dim -> 4 dim -> dim), forward + backward, compiled, {args.block_tokens} tokens "
          "(modeled device time; plans traced at small sizes, priced at these)")
    plans = {kind: mlp_block_plans(kind) for kind in ("bf16", "fp8")}
    for width in (int(w) for w in args.widths.split(",")):
        cells = []
        for target in ("trn2", "trn3"):
            bf16, f8 = (priced(plans[kind], target, width, args.block_tokens) for kind in ("bf16", "fp8"))
            cells.append(f"{target} bf16 {bf16 * 1e3:8.3f} ms fp8 {f8 * 1e3:8.3f} ms bf16/fp8 = {bf16 / f8:.2f}x")
        print(f"   dim {width:>5}: " + "   ".join(cells))

    print(f"\n3. Mixtral MoE layer (8 experts, top-2, {args.tokens} tokens), forward + backward, trn2")
    loop = modeled(moe_layer("eager", args.dim, args.tokens), "trn2")
    grouped = modeled(moe_layer("grouped_mm", args.dim, args.tokens), "trn2")
    print(f"   eager loop {loop * 1e3:.3f} ms   grouped_mm {grouped * 1e3:.3f} ms   loop/grouped = {loop / grouped:.2f}x")

    print(f"\n4. host wall time of the fp8 step, neuron over cpu (median of {args.rounds} rounds, interleaved)")
    cpu_step = make_step(fp8(copy.deepcopy(base)), "cpu", args.tokens)
    neuron_step = make_step(fp8(copy.deepcopy(base)), "neuron", args.tokens)
    cpu_step(), neuron_step()  # warm-up
    ratios = [host_seconds(neuron_step) / host_seconds(cpu_step) for _ in range(args.rounds)]
    print(f"   neuron/cpu = {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
