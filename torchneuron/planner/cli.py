"""plan a Trainium cluster training run from a model config, without the hardware

    torchneuron plan --model llama-8b.json --target trn2 --nodes 4 --tp 8 --fsdp 16 --pp 1 \\
        --seq 8192 --global-batch 512 --dtype bf16 [--compile | --adaptive] [--fp8] [--checkpoint] \\
        [--pp-schedule gpipe|1f1b|interleaved1f1b --virtual-stages V]
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a transformers config.json (no hub access)")
    parser.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=None, help="use only this many logical cores of node 0")
    parser.add_argument("--lnc", type=int, default=None, help="logical NeuronCore size (1 or 2; trn2/trn3 default 2)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pp-schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved1f1b"),
                        help="torch.distributed.pipelining schedule when --pp > 1")
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages per pipeline rank (interleaved1f1b)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=512, help="sequences a step")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true", help="price torch.compile(backend='neuron') kernels")
    mode.add_argument("--adaptive", action="store_true", help="price adaptive eager mode")
    parser.add_argument("--fp8", action="store_true", help="FP8 matmuls at the target's FP8 rate")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every layer")
    parser.add_argument("--no-sequence-parallel", action="store_true")


def run(args: argparse.Namespace) -> int:
    from torchneuron.planner.training import plan

    mode = "compiled" if args.compile else "adaptive" if args.adaptive else "eager"
    try:
        report = plan(args.model, {"tp": args.tp, "fsdp": args.fsdp, "pp": args.pp}, target=args.target,
                      nodes=args.nodes, batch=args.global_batch, seq=args.seq, dtype=args.dtype, mode=mode,
                      fp8=args.fp8, checkpointing=args.checkpoint, lnc=args.lnc, micro_batch=args.micro_batch,
                      sequence_parallel=not args.no_sequence_parallel, ranks=args.ranks,
                      pp_schedule=args.pp_schedule, virtual_stages=args.virtual_stages)
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"torchneuron plan: {error}")
        return 2
    print(report)
    return 0 if report.memory.fits else 1
