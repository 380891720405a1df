"""Backports of the PyTorch APIs after 2.13 that torchtitan 0.3.0 calls, onto PyTorch 2.13's own
implementations; each is installed only where torch lacks it (`install`), on neuron and CPU ranks
alike, so a newer torch runs torchtitan untouched.

- `torch.distributed.set_timeout`: torch 2.13 has it as `distributed_c10d._set_pg_timeout`.
- Pre-split pipeline micro-batches: torchtitan's trainer calls
  `schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)`
  (torchtitan/trainer.py, `pp_forward_backward_step`; also components/validate.py), the
  keyword-only API of pytorch/pytorch#188500, merged after the 2.13 branch cut (`eval` too, which
  2.13 implements through `step`). Torch 2.13's
  `step(*args, target=None, **kwargs)` takes whole batches: those keywords land among the model's
  kwargs and are split again ("Expecting 2 arg_mbs but got 1"). Its schedules already run lists of
  micro-batches (`_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, ...)`, what `step` calls after
  splitting), so the backport hands the given lists to that, through 2.13's own `step` (its
  per-step stage reset and output merge stay torch's).
"""
from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any, Callable

import torch.distributed as dist

_PRESPLIT = ("arg_mbs", "kwarg_mbs", "target_mbs")
_STEP_OPTIONS = {"losses", "return_outputs", "loss_kwargs"}


def _set_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup | None = None) -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


def _with_presplit_microbatches(whole_batch_step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` that also takes `arg_mbs`/`kwarg_mbs`/`target_mbs` (lists of one entry a micro-batch;
    any of them selects that mode and cannot be mixed with whole-batch inputs or `target`)."""

    @functools.wraps(whole_batch_step)
    def step(self: Any, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(self, *args, **kwargs)
        if kwargs.get("target", ()) is None:  # 2.13's `eval` passes target=None on
            del kwargs["target"]
        mixed = sorted(set(kwargs) - _STEP_OPTIONS) + (["positional inputs"] if args else [])
        if mixed:
            raise TypeError(f"schedule.step: pre-split micro-batches ({', '.join(_PRESPLIT)}) cannot be mixed with "
                            f"whole-batch inputs ({', '.join(mixed)}); pass every input as micro-batch lists")
        run_microbatches = self._step_microbatches

        def run_given_microbatches(_args_split: list, _kwargs_split: list, _targets_split: list | None,
                                   losses: list | None, return_outputs: bool = True,
                                   loss_kwargs: dict | None = None) -> Any:
            return run_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)

        self._step_microbatches = run_given_microbatches  # 2.13's step, with no inputs to split, calls it
        try:
            return whole_batch_step(self, **kwargs)
        finally:
            del self._step_microbatches

    step.presplit_backport = True  # type: ignore[attr-defined]
    return step


def _step_takes_presplit(step: Callable[..., Any]) -> bool:
    return getattr(step, "presplit_backport", False) or "arg_mbs" in inspect.signature(step).parameters


def install() -> None:
    """Adds each backport this torch lacks (idempotent)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout
    for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
        if not _step_takes_presplit(schedule.step):
            schedule.step = _with_presplit_microbatches(schedule.step)
