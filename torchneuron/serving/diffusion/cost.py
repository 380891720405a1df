"""Modeled Trainium time of a diffusion pipeline, per component.

`component_costs(pipe, ...)` runs the pipeline for one denoising step with each component's
entry point wrapped in `torchneuron.hardware.estimate()`: the text encoder(s), the denoiser
(UNet or transformer, classifier-free guidance batch included), and the VAE decode. Each gets
its modeled device time, FLOPs and MFU on the target; `per_image_s(steps)` extrapolates a whole
generation (text encoding and decode once, the denoiser once per step).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from torchneuron.hardware import estimate, get_target

__all__ = ["ComponentCost", "PipelineCost", "component_costs"]


@dataclass
class ComponentCost:
    """Summed modeled figures of every call of one component inside the measured run."""

    name: str
    calls: int = 0
    device_time_s: float = 0.0
    flops: float = 0.0
    peak_flops: float = 0.0  # the target's BF16 Tensor-engine peak of one core

    @property
    def mfu(self) -> float:
        if self.device_time_s <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.flops / self.device_time_s / self.peak_flops


@dataclass
class PipelineCost:
    """One denoising step's components; `images` is the batch the step produced."""

    target: str
    images: int
    components: dict[str, ComponentCost] = field(default_factory=dict)

    def per_image_s(self, steps: int) -> float:
        """Modeled seconds of one image (or video) of a `steps`-step generation."""
        total = 0.0
        for name, cost in self.components.items():
            total += cost.device_time_s * (steps if name == "denoiser" else 1)
        return total / max(1, self.images)

    def __str__(self) -> str:
        lines = [f"modeled on {self.target}, one denoising step, {self.images} image(s):"]
        for cost in self.components.values():
            lines.append(f"  {cost.name:<14} {cost.calls:>3} call(s) {cost.device_time_s * 1e3:>10.3f} ms "
                         f"{cost.flops / 1e9:>10.3f} GFLOP  MFU {100 * cost.mfu:5.1f}%")
        return "\n".join(lines)


@contextlib.contextmanager
def _measured(obj: Any, method: str, cost: ComponentCost) -> Iterator[None]:
    """Wrap `obj.method` (on the instance) so each call is summed into `cost`."""
    original: Callable = getattr(obj, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with estimate() as report:
            result = original(*args, **kwargs)
            torch.accelerator.synchronize()
        cost.calls += 1
        cost.device_time_s += report.device_time_s
        cost.flops += report.flops
        return result

    setattr(obj, method, wrapper)
    try:
        yield
    finally:
        delattr(obj, method)  # the class's method again


def component_costs(pipe: Any, prompt: str = "a photo", *, images: int = 1, target: str = "trn2",
                    **call_kwargs: Any) -> PipelineCost:
    """Modeled time and MFU of the text encoder(s), denoiser and VAE decode of one step.

    `call_kwargs` go to the pipeline call (height, width, num_frames, guidance_scale, ...)."""
    report = PipelineCost(target=target, images=images)
    with estimate(target):  # switch the target for the whole run
        peak = get_target().peak_flops(torch.bfloat16)
        entries: list[tuple[Any, str, str]] = []
        for attr in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(pipe, attr, None) is not None:
                entries.append((getattr(pipe, attr), "forward", attr.replace("_", " ")))
        denoiser = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet
        entries += [(denoiser, "forward", "denoiser"), (pipe.vae, "decode", "vae decode")]
        with contextlib.ExitStack() as stack:
            for obj, method, name in entries:
                cost = report.components.setdefault(name, ComponentCost(name, peak_flops=peak))
                stack.enter_context(_measured(obj, method, cost))
            generator = torch.Generator(pipe.device).manual_seed(0)
            pipe([prompt] * images, num_inference_steps=1, generator=generator, output_type="np", **call_kwargs)
    return report
