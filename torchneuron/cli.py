"""The `torchneuron` command: `demo` (train a small model on neuron), `info` (target, devices, env),
`serve` (vLLM's OpenAI server for a local model on neuron).

Other folders add subcommands through `SUBCOMMANDS` (name -> module with add_arguments/run).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Sequence

from torchneuron import settings
from torchneuron.examples.zoo import MODELS as ZOO_MODELS

def _info(args: argparse.Namespace) -> int:
    import torch

    import torchneuron
    from torchneuron.hardware import get_target

    target = get_target()
    print(f"torchneuron {torchneuron.__version__} on torch {torch.__version__}, Python {platform.python_version()}")
    print(f"target: {target.name} ({target.core_type}, {target.cores_per_chip} cores per chip)")
    print(f"  peak per core: bf16 {target.peak_flops(torch.bfloat16) / 1e12:.1f} TFLOPS, "
          f"fp32 {target.peak_flops(torch.float32) / 1e12:.1f} TFLOPS, HBM {target.hbm_bytes_per_s / 1e9:.0f} GB/s")
    print(f"devices: {torch.neuron.device_count()}")
    for i in range(torch.neuron.device_count()):
        free, total = torch.neuron.mem_get_info(i)
        print(f"  neuron:{i}  capacity {total / 2**30:.2f} GiB, free {free / 2**30:.2f} GiB")
    print("environment:")
    for field in settings.variables():
        name, value = field.metadata["env"], os.environ.get(field.metadata["env"])
        meaning = field.metadata["meaning"].replace("`", "")
        print(f"  {name:<34} {value if value is not None else '(unset)':<8}  {meaning}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.model is not None:  # a model of the zoo: a few training steps, then its inference call
        from torchneuron.examples.zoo_run import demo as zoo_demo

        return zoo_demo(args.model, steps=args.zoo_steps)
    from torchneuron.examples.train_llama import main as train

    return train(steps=args.steps, batch=args.batch, seq=args.seq)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama-style model on the neuron device")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=64)
    demo.add_argument("--model", default=None, choices=sorted(ZOO_MODELS),
                      help="run a model of the zoo instead (tiny config of a family: text, vision-language, "
                           "state-space, audio): training steps, then generate or inference")
    demo.add_argument("--zoo-steps", type=int, default=5, help="training steps of --model")
    demo.set_defaults(func=_demo)
    info = sub.add_parser("info", help="print the target, devices, capacities and environment")
    info.set_defaults(func=_info)
    for name, module_name in SUBCOMMANDS.items():  # a command that cannot import is a broken install: raise
        module = __import__(module_name, fromlist=["add_arguments"])
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)
    return parser


# name -> module providing add_arguments(parser) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "explorer": "torchneuron.profiler.explorer_cli",
    "plan": "torchneuron.planner.cli",
    "serve": "torchneuron.serving.llm.server",
    "serve-diffusion": "torchneuron.serving.diffusion.cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
