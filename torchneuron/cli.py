"""The `torchneuron` command: `demo` (train a small model on neuron), `info` (target, devices, env).

Other folders add subcommands through `SUBCOMMANDS` (name -> module with add_arguments/run).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Sequence

ENVIRONMENT_VARIABLES = {
    "TORCHNEURON_TARGET": "trn1 | trn2 (default) | trn3: the Trainium generation modeled",
    "TORCHNEURON_DEVICE_COUNT": "number of logical neuron devices in a process (default 2)",
    "TORCHNEURON_MEMORY_CAPACITY": "modeled HBM per device, e.g. 8GiB (default: the target's HBM per core)",
    "TORCHNEURON_STRICT": "1: an op that would fall back to the CPU raises instead",
    "TORCHNEURON_TIMELINE": "0: do not record device work (no modeled timing)",
    "TORCHNEURON_AUTOGRAD_THREADS": "1: keep autograd's per-device worker threads (off by default: slower here)",
    "TORCHNEURON_PROFILER_MAX_EVENTS": "most device events one profile keeps (default 1,000,000)",
    "TORCHNEURON_EAGER_MODE": "adaptive: queue eager ops and dispatch fused runs",
    "TORCHNEURON_COMPILE_FALLBACK": "eager: run graphs that fail to compile eagerly (default raise)",
    "TORCHNEURON_COMPILE_DUMP_DIR": "directory for each compiled graph's artifacts",
    "TORCHNEURON_COMPILE_CACHE_DIR": "on-disk cache of compiled graphs",
    "TORCHNEURON_NKI_ALIAS": "1: neuronxcc.nki / nki import this package's NKI",
    "TORCHNEURON_DIST_CHECKS": "0: skip the per-collective cross-rank shape check",
    "TORCHNEURON_DIST_OVERLAP": "0: charge collectives on the issuing stream",
}


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
    for name, meaning in ENVIRONMENT_VARIABLES.items():
        value = os.environ.get(name)
        print(f"  {name:<30} {value if value is not None else '(unset)':<8}  {meaning}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torchneuron.examples.train_llama import main as train

    return train(steps=args.steps, batch=args.batch, seq=args.seq)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama-style model on the neuron device")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=64)
    demo.set_defaults(func=_demo)
    info = sub.add_parser("info", help="print the target, devices, capacities and environment")
    info.set_defaults(func=_info)
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = __import__(module_name, fromlist=["add_arguments"])
        except ImportError:
            continue
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)
    return parser


# name -> module providing add_arguments(parser) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "explorer": "torchneuron.profiler.explorer_cli",
    "serve-diffusion": "torchneuron.serving.diffusion.cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
