"""A served diffusers pipeline: loading, request limits, and one batched generation call.

`ServedPipeline` owns one pipeline on one device. It knows what the pipeline can produce
(image or video, the size multiple, the default size, the text encoder's token limit), checks a
request against it (`check_size`, `max_images`), and runs a batch of requests as ONE pipeline
call (`generate`): prompts concatenated (diffusers then batches classifier-free guidance as
[negatives; positives]), one generator per image so each image depends on its own seed only,
and a per-step callback that reports progress and cancels at the step boundary.

Cancellation at a step boundary: when every request of the call is cancelled the call stops;
when only some are, their rows are dropped from the denoising state (the latents and the text
embeddings, both halves of a [negatives; positives] CFG batch), so the remaining steps run on
the others' images only, and the cancelled requests' results are `None`. Pipelines with only
diffusers' older `callback(step, t, latents)` (PixArt) report progress and stop when all are
cancelled, but cannot shrink their batch: their cancelled rows run to the end and are discarded.

The memory limit is measured, not guessed: the first request of a shape runs a one-image,
one-step probe and records the peak device memory above the resident weights; the most images
a call may hold is the device's free capacity over that figure.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = ["Cancelled", "GenerationJob", "RequestError", "ServedPipeline", "load_pipeline"]


class RequestError(ValueError):
    """A request the pipeline cannot serve; the message names the limit and the fix."""


class Cancelled(RuntimeError):
    """Raised inside a pipeline call when every request of the batch was cancelled."""


@dataclass
class GenerationJob:
    """One request's share of a batched call: its prompts (n of them), seed and progress sink."""

    prompt: str
    n: int
    seed: int
    negative_prompt: str = ""
    on_step: Callable[[int, int], None] | None = None  # (step done, total steps)
    cancelled: threading.Event = field(default_factory=threading.Event)
    warnings: list[str] = field(default_factory=list)


def load_pipeline(directory: str, device: str = "neuron", dtype: torch.dtype | None = None) -> Any:
    """A diffusers pipeline from a local directory (no hub access), moved to `device`."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(directory, local_files_only=True, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _denoiser(pipe: Any) -> torch.nn.Module:
    return pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet


class ServedPipeline:
    """One pipeline on one device, with the limits a server checks requests against."""

    def __init__(self, pipe: Any, *, max_batch: int | None = None) -> None:
        self.pipe = pipe
        self.device = torch.device(pipe.device)
        self.denoiser = _denoiser(pipe)
        self.is_video = hasattr(pipe, "vae_scale_factor_temporal")
        params = inspect.signature(pipe.__call__).parameters
        self._accepts = set(params)
        self.size_multiple = self._size_multiple()
        self.default_size = self._default_size()
        self.default_frames = int(params["num_frames"].default) if "num_frames" in params else 1
        tokenizer = getattr(pipe, "tokenizer", None)
        self.max_tokens = int(getattr(tokenizer, "model_max_length", 0) or 0)
        self.max_batch = max_batch
        self.calls = 0  # pipeline calls made (batches), for the server's statistics
        self.dropped_images = 0  # images of cancelled requests removed from a running call
        self._per_image_bytes: dict[tuple, int] = {}
        self._lock = threading.Lock()  # one pipeline call at a time

    # ---- what the pipeline can produce -------------------------------------------------------
    def _size_multiple(self) -> int:
        spatial = int(getattr(self.pipe, "vae_scale_factor_spatial", 0) or getattr(self.pipe, "vae_scale_factor", 8))
        config = self.denoiser.config
        patch = config.get("patch_size", 1) or 1
        patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
        downs = len(config.get("down_block_types", ()) or ())  # a UNet halves the latent per block
        return spatial * int(patch) * (2 ** max(0, downs - 1))

    def _default_size(self) -> tuple[int, int]:
        config = self.denoiser.config
        sample = config.get("sample_size")
        if isinstance(sample, int) and sample > 0:
            scale = int(getattr(self.pipe, "vae_scale_factor", 8))
            side = sample * scale
            return side, side
        return 4 * self.size_multiple, 4 * self.size_multiple

    def parse_size(self, size: str | None) -> tuple[int, int]:
        """(width, height) of an OpenAI size string ("256x256", "auto"/None for the default)."""
        if size in (None, "", "auto"):
            return self.default_size
        parts = size.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise RequestError(f"size {size!r} is not WIDTHxHEIGHT (e.g. "
                               f"'{self.default_size[0]}x{self.default_size[1]}') or 'auto'")
        width, height = int(parts[0]), int(parts[1])
        self.check_size(width, height)
        return width, height

    def check_size(self, width: int, height: int) -> None:
        m = self.size_multiple
        if width <= 0 or height <= 0 or width % m or height % m:
            raise RequestError(f"size {width}x{height} cannot be produced by this pipeline: width and height "
                               f"must be positive multiples of {m} (VAE downsampling x patch size), "
                               f"e.g. {self.default_size[0]}x{self.default_size[1]}")

    def check_frames(self, frames: int) -> None:
        step = int(getattr(self.pipe, "vae_scale_factor_temporal", 1))
        if frames < 1 or (frames - 1) % step:
            raise RequestError(f"num_frames={frames} cannot be produced: this video VAE needs "
                               f"{step}k+1 frames (e.g. {self.default_frames})")

    def check_steps(self, steps: int) -> None:
        limit = int(self.pipe.scheduler.config.get("num_train_timesteps", 1000)) - 1
        if not 1 <= steps <= limit:
            raise RequestError(f"num_inference_steps={steps} is outside 1..{limit}: the scheduler was trained "
                               f"with {limit + 1} timesteps")

    def truncation_warning(self, prompt: str) -> str | None:
        """The warning diffusers logs when the prompt exceeds the text encoder's limit, or None."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        if tokenizer is None or not self.max_tokens:
            return None
        count = len(tokenizer(prompt, truncation=False).input_ids)
        if count <= self.max_tokens:
            return None
        return (f"the prompt is {count} tokens; the text encoder takes {self.max_tokens}: "
                f"it was truncated to its first {self.max_tokens} tokens")

    # ---- memory ------------------------------------------------------------------------------
    def per_image_bytes(self, shape: dict) -> int:
        """Peak device bytes one image of `shape` adds (measured once per shape by a probe)."""
        key = tuple(sorted(shape.items()))
        if key not in self._per_image_bytes:
            if self.device.type != "neuron":
                self._per_image_bytes[key] = 1
            else:
                with self._lock:
                    torch.neuron.synchronize(self.device)
                    before = torch.neuron.memory_allocated(self.device)
                    torch.neuron.reset_peak_memory_stats(self.device)
                    self._call([GenerationJob("probe", 1, 0)], dict(shape, num_inference_steps=1), count=False)
                    peak = torch.neuron.max_memory_allocated(self.device)
                self._per_image_bytes[key] = max(1, peak - before)
        return self._per_image_bytes[key]

    def max_images(self, shape: dict) -> int:
        """The most images of `shape` one call can hold in the device's free memory."""
        per_image = self.per_image_bytes(shape)
        if self.device.type == "neuron":
            free, _total = torch.neuron.mem_get_info(self.device)
            limit = max(0, int(free // per_image))
        else:
            limit = 1 << 30
        return min(limit, self.max_batch) if self.max_batch else limit

    def check_images(self, n: int, shape: dict) -> None:
        limit = self.max_images(shape)
        if n > limit:
            per_image = self.per_image_bytes(shape)
            free = torch.neuron.mem_get_info(self.device)[0] if self.device.type == "neuron" else 0
            raise RequestError(
                f"n={n} is more than this server can generate at once at {shape['width']}x{shape['height']}: "
                f"each image needs {per_image / 2**20:.1f} MiB of device memory and {self.device} has "
                f"{free / 2**20:.1f} MiB free, so at most {limit} per request; ask for n <= {limit} "
                f"or a smaller size")

    # ---- generation --------------------------------------------------------------------------
    def generate(self, jobs: Sequence[GenerationJob], shape: dict) -> list[Any]:
        """Run every job of `jobs` (same shape) as one pipeline call; returns each job's outputs
        (a list of PIL images, or of videos as [frames, H, W, 3] uint8 arrays)."""
        with self._lock:
            return self._call(jobs, shape, count=True)

    def _call(self, jobs: Sequence[GenerationJob], shape: dict, *, count: bool) -> list[Any]:
        prompts = [job.prompt for job in jobs for _ in range(job.n)]
        negatives = [job.negative_prompt for job in jobs for _ in range(job.n)]
        generators = [torch.Generator(self.device).manual_seed(job.seed + i) for job in jobs for i in range(job.n)]
        steps = int(shape["num_inference_steps"])
        running = list(jobs)  # the jobs whose rows are still in the batch, in batch order

        def step_done(step: int) -> None:
            if all(job.cancelled.is_set() for job in running):
                raise Cancelled(f"all {len(jobs)} request(s) of the batch were cancelled at step {step + 1}")
            for job in running:
                if job.on_step is not None and not job.cancelled.is_set():
                    job.on_step(step + 1, steps)

        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
            step_done(step)
            if step + 1 < steps and any(job.cancelled.is_set() for job in running):
                tensors = self._drop_cancelled(running, tensors)
            return tensors

        kwargs: dict[str, Any] = {
            "prompt": prompts, "negative_prompt": negatives, "generator": generators,
            "num_inference_steps": steps, "height": shape["height"], "width": shape["width"],
            "output_type": "np" if self.is_video else "pil",
        }
        if "callback_on_step_end" in self._accepts:
            kwargs["callback_on_step_end"] = on_step_end
            kwargs["callback_on_step_end_tensor_inputs"] = [
                name for name in ("latents", "prompt_embeds", "negative_prompt_embeds")
                if name in getattr(self.pipe, "_callback_tensor_inputs", ())]
        elif "callback" in self._accepts:  # diffusers' older per-step API (PixArt)
            kwargs["callback"] = lambda step, timestep, latents: step_done(step)
            kwargs["callback_steps"] = 1
        if shape.get("guidance_scale") is not None:
            kwargs["guidance_scale"] = float(shape["guidance_scale"])
        if self.is_video:
            kwargs["num_frames"] = int(shape.get("num_frames") or self.default_frames)
        if "use_resolution_binning" in self._accepts:  # sizes are checked here, not snapped
            kwargs["use_resolution_binning"] = False
        if count:
            self.calls += 1
        with torch.inference_mode():
            output = self.pipe(**kwargs)
        results = output.frames if self.is_video else output.images
        if self.is_video:  # float frames in [0, 1] -> uint8
            results = [(frames * 255).round().clip(0, 255).astype("uint8") for frames in results]
        per_job, start = [], 0
        for job in jobs:
            if job in running:
                per_job.append(list(results[start:start + job.n]))
                start += job.n
            else:
                per_job.append(None)
        return per_job

    def _drop_cancelled(self, running: list[GenerationJob], tensors: dict) -> dict:
        """The step's tensors without the rows of the cancelled jobs of `running` (which it updates).

        A tensor of the batch's size B keeps the remaining images' rows; one of size 2B is a
        [negatives; positives] CFG batch and keeps them in both halves."""
        keep, row = [], 0
        for job in running:
            if not job.cancelled.is_set():
                keep.extend(range(row, row + job.n))
            row += job.n
        batch = row
        for name, tensor in list(tensors.items()):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                continue
            if tensor.shape[0] == batch:
                rows = keep
            elif tensor.shape[0] == 2 * batch:
                rows = keep + [batch + i for i in keep]
            else:
                continue
            tensors[name] = tensor[torch.tensor(rows, device=tensor.device)]
        self.dropped_images += batch - len(keep)
        running[:] = [job for job in running if not job.cancelled.is_set()]
        return tensors
