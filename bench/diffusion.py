"""Tiny diffusion pipelines on neuron against the same pipelines on the CPU, in one process.

For the tiny UNet (Stable-Diffusion-style) and DiT (PixArt-style) pipelines: images/s at batch
1 and 8 on the CPU and on neuron (eager), the neuron/CPU host-time ratio (goal <= 1.1), the
compiled denoiser's host time against the CPU counterpart of that mode (Inductor-CPU) and its
modeled trn2 time against the eager denoiser's (one CFG-batched denoising step),
and for every pipeline (video included) the modeled trn2 seconds per image / per video second
of a whole generation, per component. Host times are medians over interleaved rounds.

    python bench/diffusion.py [--steps 4] [--rounds 3] [--no-compile]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchneuron  # noqa: F401
from machine import describe
from torchneuron.examples.tiny_diffusion import build_pipeline
from torchneuron.hardware import estimate
from torchneuron.serving.diffusion.cost import component_costs

CALLS = {"unet": dict(height=32, width=32), "dit": dict(height=32, width=32, use_resolution_binning=False),
         "video": dict(height=16, width=16, num_frames=9)}
VIDEO_FPS = 8.0


def _run(pipe, kind: str, batch: int, steps: int) -> float:
    generator = torch.Generator(pipe.device).manual_seed(0)
    start = time.perf_counter()
    pipe(["a photo"] * batch, num_inference_steps=steps, generator=generator, output_type="np", **CALLS[kind])
    torch.accelerator.synchronize() if pipe.device.type == "neuron" else None
    return time.perf_counter() - start


def _denoiser(pipe):
    return pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet


def _step_inputs(pipe, kind: str, batch: int):
    device = pipe.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * batch, 4, 16, 16, generator=gen).to(device)
    text = torch.randn(2 * batch, 8, 32, generator=gen).to(device)
    t = torch.full((2 * batch,), 500).to(device)
    if kind == "unet":
        return lambda model: model(x, t, encoder_hidden_states=text)
    return lambda model: model(x, encoder_hidden_states=text, timestep=t,
                               added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def _step_times(pipe, kind: str, batch: int, rounds: int, model) -> tuple[float, float]:
    """Host median and modeled trn2 time of one CFG-batched denoiser call."""
    call = _step_inputs(pipe, kind, batch)
    with torch.no_grad():
        call(model)  # warm up (compiles)
        torch.accelerator.synchronize()
        host = []
        for _ in range(rounds):
            start = time.perf_counter()
            call(model)
            torch.accelerator.synchronize()
            host.append(time.perf_counter() - start)
        with estimate("trn2") as report:
            call(model)
            torch.accelerator.synchronize()
    return statistics.median(host), report.device_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    print(describe())
    print(f"{args.steps} denoising steps, classifier-free guidance on (batch x2 in the denoiser)")
    print(f"{'pipeline':<8} {'batch':>5} {'cpu img/s':>10} {'neuron img/s':>13} {'neuron/cpu host time':>21}")
    for kind in ("unet", "dit"):
        pipes = {device: build_pipeline(kind).to(device) for device in ("cpu", "neuron")}
        for batch in (1, 8):
            times: dict[str, list[float]] = {"cpu": [], "neuron": []}
            for device in times:
                _run(pipes[device], kind, batch, 1)  # warm up
            for _ in range(args.rounds):
                for device in times:
                    times[device].append(_run(pipes[device], kind, batch, args.steps))
            cpu, neuron = statistics.median(times["cpu"]), statistics.median(times["neuron"])
            print(f"{kind:<8} {batch:>5} {batch / cpu:>10.2f} {batch / neuron:>13.2f} {neuron / cpu:>20.2f}x")
        if not args.no_compile:
            pipe = pipes["neuron"]
            eager = _step_times(pipe, kind, 8, args.rounds, _denoiser(pipe))
            compiled = _step_times(pipe, kind, 8, args.rounds, torch.compile(_denoiser(pipe), backend="neuron"))
            inductor = _step_times(pipes["cpu"], kind, 8, args.rounds, torch.compile(_denoiser(pipes["cpu"])))
            print(f"{kind:<8} compiled denoiser step at batch 8: host neuron/Inductor-CPU {compiled[0] / inductor[0]:.2f}x "
                  f"(compiled/eager on neuron {compiled[0] / eager[0]:.2f}x); modeled trn2 compiled/eager "
                  f"{compiled[1] / eager[1]:.2f}x ({eager[1] * 1e3:.3f} -> {compiled[1] * 1e3:.3f} ms)")
    print(f"modeled trn2 time of a {args.steps}-step generation (eager, fp32 weights; MFU against the BF16 peak):")
    for kind in ("unet", "dit", "video"):
        pipe = build_pipeline(kind).to("neuron")
        report = component_costs(pipe, images=1, guidance_scale=5.0, **CALLS[kind])
        per_item = report.per_image_s(args.steps)
        if kind == "video":
            seconds = CALLS[kind]["num_frames"] / VIDEO_FPS
            print(f"  {kind}: {per_item / seconds * 1e3:.3f} ms per video second "
                  f"({CALLS[kind]['num_frames']} frames at {VIDEO_FPS:g} fps)")
        else:
            print(f"  {kind}: {per_item * 1e3:.3f} ms per image")
        for cost in report.components.values():
            print(f"    {cost.name:<13} {cost.calls} call(s) {cost.device_time_s * 1e3:>9.3f} ms  MFU {100 * cost.mfu:5.2f}%")


if __name__ == "__main__":
    main()
