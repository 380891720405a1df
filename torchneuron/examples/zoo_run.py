"""Running a zoo model (zoo.py): AdamW training steps, its inference call, modeled step time and MFU.

This module owns how a zoo model is run on a device, in a mode: eager or adaptive eager (the
caller's `torchneuron.set_eager_mode`), compiled (`torch.compile(backend="neuron")`) or under
bf16 autocast. The tests compare these runs with the CPU's; `torchneuron demo --model NAME`
prints them (`demo`); `python -m torchneuron.examples.zoo_run` prints the README's table of the
families with their modeled trn2 step time and MFU (`families_table`).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torchneuron.examples.zoo import FAMILIES, MODELS, ZooModel, get

__all__ = ["TrainResult", "demo", "families_table", "infer", "modeled_steps", "move", "train"]

TARGETS = ("trn1", "trn2", "trn3")


@dataclass
class TrainResult:
    """What a few training steps gave: the losses, the last step's gradients, the final parameters (host copies)."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    modeled: Any = None  # the last step's `Estimate` on the target asked for (neuron only)


def move(inputs: dict[str, Any], device: str | torch.device) -> dict[str, Any]:
    """`inputs` with every tensor moved to `device`."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def place(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """`model` on `device` with its tied weights still tied (moving to a new device type re-creates parameters)."""
    model = model.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


@contextlib.contextmanager
def _autocast(device: str, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(torch.device(device).type, dtype=dtype):
            yield


class Trainer:
    """AdamW steps of one zoo model on one device (the same batches on every device, from `seed`)."""

    def __init__(self, model: torch.nn.Module, spec: ZooModel, device: str, lr: float = 1e-2, compiled: bool = False,
                 autocast: torch.dtype | None = None, seed: int = 1) -> None:
        self.model, self.spec, self.device, self.autocast = place(model, device).train(), spec, device, autocast
        self.forward = torch.compile(self.model, backend="neuron") if compiled else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.data = torch.Generator().manual_seed(seed)

    def step(self, keep_grads: bool = False) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        """One step: the loss (on the device), the tokens it trained on and (if asked) host copies of the gradients."""
        batch = self.spec.batch(self.data)
        with _autocast(self.device, self.autocast):
            loss = self.forward(**move(batch, self.device)).loss
        loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()
                 if p.grad is not None} if keep_grads else {}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), self.spec.tokens(batch), grads


def train(model: torch.nn.Module, spec: ZooModel, device: str, steps: int = 3, measure: str | None = None,
          **options: Any) -> TrainResult:
    """`steps` AdamW steps of `model` on `device` (options: lr, compiled, autocast, seed); `measure`
    ("trn2", ...) models the last step's device time on that target."""
    from torchneuron.hardware import estimate

    trainer = Trainer(model, spec, device, **options)
    losses, grads, modeled = [], {}, None
    for i in range(steps):
        last = i == steps - 1
        with estimate(measure) if last and measure else contextlib.nullcontext() as modeled_step:
            loss, _, grads = trainer.step(keep_grads=last)
            losses.append(loss.item())  # waits for the device (and flushes adaptive eager's queue)
        modeled = modeled_step if last else modeled
    params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    return TrainResult(losses, grads, params, modeled)


def infer(model: torch.nn.Module, spec: ZooModel, device: str, autocast: torch.dtype | None = None,
          compiled: bool = False) -> torch.Tensor:
    """The model's inference call (`generate`, or the forward pass) on `device`; the result on the host.
    `compiled`: the forward pass that call makes is compiled by the neuron backend."""
    model = place(model, device).eval()
    if compiled:
        model.forward = torch.compile(model.forward, backend="neuron")
    with _autocast(device, autocast):
        return spec.infer(model, move(spec.prompt(), device)).cpu()


@dataclass
class StepReport:
    """One training step of a zoo model on neuron: host time and the modeled time of each target."""

    loss: float
    tokens: int
    host_s: float
    modeled_s: dict[str, float]
    mfu: dict[str, float]


def modeled_steps(model: torch.nn.Module, spec: ZooModel, targets: tuple[str, ...] = TARGETS, warmup: int = 1,
                  **options: Any) -> StepReport:
    """Trains `model` on neuron: `warmup` steps, then one step per target under `estimate(target)`."""
    from torchneuron.hardware import estimate

    trainer = Trainer(model, spec, "neuron", **options)
    for _ in range(warmup):
        trainer.step()[0].item()
    modeled, mfu, host, loss, tokens = {}, {}, [], 0.0, 0
    for target in targets:
        start = time.perf_counter()
        with estimate(target) as report:
            value, tokens, _ = trainer.step()
            loss = value.item()  # waits for the device (and flushes adaptive eager's queue)
        host.append(time.perf_counter() - start)
        modeled[target], mfu[target] = report.device_time_s, report.mfu
    return StepReport(loss, tokens, min(host), modeled, mfu)


def demo(name: str, steps: int = 5) -> int:
    """`torchneuron demo --model NAME`: a few training steps, then the model's inference call, on neuron."""
    import torchneuron

    spec = get(name)
    torch.manual_seed(0)
    model = spec.build()
    params = sum(p.numel() for p in model.parameters())
    print(f"{spec.name} ({spec.family}, {params / 1e6:.3f}M parameters): {steps} AdamW steps on neuron, then inference")
    torchneuron.reset_fallback_counts()
    trainer = Trainer(model, spec, "neuron")
    losses, tokens, start = [], 0, time.perf_counter()
    for _ in range(steps):
        loss, n, _ = trainer.step()
        losses.append(loss.item())
        tokens += n
    host_s = time.perf_counter() - start
    print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f}")
    print(f"host throughput: {tokens / host_s:,.0f} tokens/s ({host_s / steps * 1e3:.1f} ms/step)")
    report = modeled_steps(trainer.model, spec, warmup=0)
    print("modeled step time: " + "  ".join(
        f"{t} {report.modeled_s[t] * 1e3:.3f} ms (MFU {report.mfu[t] * 100:.2g}%)" for t in TARGETS))
    out = infer(trainer.model, spec, "neuron")
    shown = out[0].tolist() if spec.generates else [round(v, 4) for v in out.flatten()[:6].tolist()]
    print(f"inference ({'generated tokens' if spec.generates else 'outputs'}): {shown}")
    fallbacks = torchneuron.fallback_counts()
    print(f"CPU fallbacks: {sum(fallbacks.values())} calls" + (f" ({', '.join(sorted(fallbacks))})" if fallbacks else ""))
    # a few steps on fresh random batches need not lower the loss; they must keep it finite
    return 0 if all(math.isfinite(v) for v in losses) else 1


def families_table(names: tuple[str, ...] | None = None) -> str:
    """The README's table: each zoo model's family, parameters, modeled trn2 step time and MFU (eager, fp32)."""
    lines = ["| family | model | parameters | tokens a step | modeled trn2 step | trn2 MFU |", "|---|---|---|---|---|---|"]
    for family in FAMILIES:
        for spec in MODELS.values():
            if spec.family != family or (names is not None and spec.name not in names):
                continue
            torch.manual_seed(0)
            model = spec.build()
            params = sum(p.numel() for p in model.parameters())
            report = modeled_steps(model, spec, targets=("trn2",))
            lines.append(f"| {family} | {spec.name} | {params / 1e3:.0f}K | {report.tokens} | "
                         f"{report.modeled_s['trn2'] * 1e3:.3f} ms | {report.mfu['trn2'] * 100:.3g}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="print the README's table of the zoo's families (modeled trn2)")
    parser.add_argument("models", nargs="*", help="zoo models to include (default: all)")
    args = parser.parse_args()
    print(families_table(tuple(args.models) or None))


if __name__ == "__main__":
    main()
