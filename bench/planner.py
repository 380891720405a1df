"""Planning time and the scaling table of Llama-3.1-8B and 70B training on trn2.48xlarge nodes.

For each model and node count, `torchneuron.planner.plan` traces the real model and parallelism on
fake tensors and prices the step (eager mode; bf16; activation checkpointing; 8192-token sequences,
512 a step). Printed: planning time on this host (goal: under 60 s each) and its ratio to the 1-node
plan of the same model (what planning a bigger cluster costs), and the plans' own figures: step time,
tokens/s, MFU and the scaling efficiency against 1 node (tokens/s per node over the 1-node tokens/s).
The configs are the public architecture numbers of Llama 3.1 (no hub access).

    python bench/planner.py [--nodes 1 4 32] [--models 8b 70b] [--mode eager] [--pp 4 --pp-schedule 1f1b]

With --pp the FSDP degree shrinks to make room for the pipeline (tp x pp x fsdp ranks a replica);
the pipeline columns show the bubble share of the step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import describe  # noqa: E402

LLAMA_3_1 = {
    "8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
TP = {"8b": 4, "70b": 8}          # one chip (LNC=2: 4 logical cores), two chips
MAX_FSDP = 64


def mesh_for(model: str, ranks: int, pp: int = 1) -> dict[str, int]:
    tp = TP[model]
    fsdp = min(MAX_FSDP, ranks // (tp * pp))
    return {"tp": tp, "fsdp": fsdp, "pp": pp}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--models", nargs="+", default=["8b", "70b"], choices=sorted(LLAMA_3_1))
    parser.add_argument("--mode", default="eager", choices=("eager", "adaptive", "compiled"))
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pp-schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved1f1b"))
    args = parser.parse_args()

    from torchneuron.planner import plan

    print(describe())
    print(f"{'model':<6} {'nodes':>5} {'mesh':<22} {'plan s':>7} {'x 1-node':>8} {'step s':>8} {'tokens/s':>12} "
          f"{'MFU':>6} {'scaling':>8} {'memory':>9} {'fits':>5} {'bubble':>7}")
    for model in args.models:
        base_time = base_tps = None
        for nodes in args.nodes:
            mesh = mesh_for(model, nodes * 64, args.pp)
            started = time.perf_counter()
            report = plan(LLAMA_3_1[model], mesh, target="trn2", nodes=nodes, batch=args.global_batch, seq=args.seq,
                          mode=args.mode, checkpointing=True, pp_schedule=args.pp_schedule)
            elapsed = time.perf_counter() - started
            base_time = base_time or elapsed
            base_tps = base_tps or report.tokens_per_s
            scaling = report.tokens_per_s / (base_tps * nodes / args.nodes[0])
            dims = f"tp{mesh['tp']} fsdp{mesh['fsdp']} dp{report.spec.dp}" + (f" pp{args.pp}" if args.pp > 1 else "")
            print(f"{model:<6} {nodes:>5} {dims:<22} {elapsed:>7.1f} {elapsed / base_time:>8.2f} "
                  f"{report.step_s:>8.3f} {report.tokens_per_s:>12,.0f} {100 * report.mfu:>5.1f}% "
                  f"{100 * scaling:>7.1f}% {report.memory.total / 2**30:>7.2f}G {str(report.memory.fits):>5} "
                  f"{100 * report.bubble_s / report.step_s:>6.1f}%",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
