"""serve a local diffusers pipeline directory over HTTP (OpenAI images, vLLM-Omni videos)"""
from __future__ import annotations

import argparse

import torch

from torchneuron.serving import require_extra

__all__ = ["add_arguments", "run"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a diffusers pipeline directory (model_index.json and components)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="neuron", help="device to run on (default neuron)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--compile", action="store_true", help='torch.compile(backend="neuron") the denoiser')
    parser.add_argument("--batch-window-ms", type=float, default=50.0,
                        help="how long a request waits for others of its shape to share a call")
    parser.add_argument("--max-batch", type=int, default=None, help="most images in one pipeline call")
    parser.add_argument("--model-name", default=None, help="the model id reported (default: the directory name)")


def run(args: argparse.Namespace) -> int:
    import os

    require_extra("serve-diffusion", "diffusion", ("diffusers", "fastapi", "uvicorn"))

    import uvicorn

    from .app import create_app
    from .pipelines import ServedPipeline, load_pipeline

    pipe = load_pipeline(args.directory, args.device, _DTYPES[args.dtype])
    served = ServedPipeline(pipe, max_batch=args.max_batch)
    if args.compile:
        served.denoiser.compile(backend="neuron")
    name = args.model_name or os.path.basename(os.path.normpath(args.directory))
    app = create_app(served, model_name=name, window_s=args.batch_window_ms / 1000)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
