"""The zoo's checks, shared by the family test files: a zoo model (torchneuron.examples.zoo)
trained 3 AdamW steps on neuron in a mode gives the CPU's losses and gradients, and its
inference call (`generate`, or the forward pass) gives the CPU's tokens or outputs.

Modes: `eager`, `adaptive` (adaptive eager mode), `compiled` (`torch.compile(backend="neuron")`
for the training forward and the forward passes inference makes), `bf16` (bfloat16 autocast on
both devices). Every zoo model has a case in every mode. Each family's SUBSETS dict names the
quick ones, which run by default (marked slow or not); the rest run only with `--zoo-full`
(skipped otherwise, saying so), e.g. every compiled case:

    PYTHONPATH=$PWD python -m pytest -q tests/models --zoo-full -k compiled --durations=0

A case that cannot pass for a cause outside torchneuron is a strict xfail naming that cause.
Each check records the last training step's modeled trn2 time and MFU as the
test's `zoo` property; tests/conftest.py prints them as a table at the end of the run.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchneuron.eager
from torchneuron.examples.zoo import MODELS
from torchneuron.examples.zoo_run import infer, train

MODES = ("eager", "adaptive", "compiled", "bf16")
# fp32: another device's kernels (blocking of matmuls and reductions) round a few ulps apart;
# gradients are compared against the model's largest one (a key bias's gradient is zero in exact
# arithmetic, rounding noise on both devices)
LOSS_FP32, GRAD_FP32 = dict(rel=1e-4, abs=1e-5), 1e-5
# bf16: neuron follows CUDA's autocast policy, the CPU's casts another op list (CUDA's cross entropy
# takes bf16 logits through a bf16 log_softmax, the CPU's computes it in float32) and its bf16
# matmuls accumulate differently: losses within a few bf16 ulps of the CPU's; gradients (one
# vector) no further from the float32 CPU's than the CPU's own bf16 autocast is, plus a margin
LOSS_BF16, GRAD_BF16_MARGIN = dict(rel=2e-2, abs=2e-2), 3e-2


# A case of a SUBSETS entry: False (the default run), True (the default run, marked slow) or FULL
# (marked slow and zoo_full: run with `pytest --zoo-full`, skipped otherwise; tests/conftest.py).
# A model a mode's entry does not name runs that mode as FULL.
FULL = "full"


def cases(family: str, subsets: dict[str, dict[str, bool | str]],
          xfails: dict[tuple[str, str], str] | None = None) -> list:
    """pytest params (name, mode) for the `family`'s models, one per model and mode: eager runs by
    default; `subsets[mode]` names the models that run `mode` in the default run (True: marked
    slow), and every other model runs it as FULL (slow, only with --zoo-full). `xfails` maps
    (name, mode) to the precise reason the case cannot pass (a strict xfail)."""
    params = []
    for name, spec in MODELS.items():
        if spec.family != family:
            continue
        params.append(pytest.param(name, "eager", id=f"{name}-eager"))
        for mode in MODES[1:]:
            runs = subsets.get(mode, {}).get(name, FULL)
            marks = [pytest.mark.slow] if runs else []
            if runs == FULL:
                marks.append(pytest.mark.zoo_full)
            if (name, mode) in (xfails or {}):
                marks.append(pytest.mark.xfail(strict=True, reason=xfails[name, mode]))
            params.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return params


def _options(mode: str) -> dict:
    return {"compiled": mode == "compiled", "autocast": torch.bfloat16 if mode == "bf16" else None}


def _relative_l2(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    flat_got = torch.cat([got[k].float().flatten() for k in want])
    flat_want = torch.cat([g.float().flatten() for g in want.values()])
    return ((flat_got - flat_want).norm() / flat_want.norm()).item()


def _assert_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], compiled: bool = False) -> None:
    if compiled:
        # AOTAutograd materialises the gradient of a graph output the loss does not use as zeros:
        # parameters reaching only such outputs (LLaVA's vision post_layernorm: the features come
        # from an earlier layer) get zero gradients where eager autograd leaves None, with
        # torch.compile's own CPU backends too.
        unused = {key: got[key] for key in got.keys() - want.keys()}
        assert all(not g.any() for g in unused.values()), f"nonzero gradients of unused parameters: {sorted(unused)}"
        got = {key: value for key, value in got.items() if key in want}
    assert got.keys() == want.keys(), got.keys() ^ want.keys()
    scale = max(g.abs().max().item() for g in want.values())
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=GRAD_FP32 * scale, msg=lambda m: f"{key}: {m}")


def _assert_bf16_grads(got: dict[str, torch.Tensor], cpu_bf16: dict[str, torch.Tensor],
                       cpu_fp32: dict[str, torch.Tensor]) -> None:
    assert got.keys() == cpu_fp32.keys(), got.keys() ^ cpu_fp32.keys()
    error, cpu_error = _relative_l2(got, cpu_fp32), _relative_l2(cpu_bf16, cpu_fp32)
    assert error <= cpu_error + GRAD_BF16_MARGIN, (
        f"bf16 gradients {error:.3f} from float32 (relative L2), the CPU's bf16 autocast {cpu_error:.3f}")


def check(name: str, mode: str, record=None) -> None:
    """Trains and runs zoo model `name` on neuron in `mode` and on the CPU; asserts they agree.
    `record` (pytest's `record_property`) receives the modeled trn2 step."""
    spec = MODELS[name]
    torch.manual_seed(0)
    base = spec.build()
    options = _options(mode)
    cpu = train(copy.deepcopy(base), spec, "cpu", autocast=options["autocast"])
    torchneuron.eager.set_eager_mode("adaptive" if mode == "adaptive" else "eager")
    try:
        got = train(copy.deepcopy(base), spec, "neuron", measure="trn2", **options)
        out = infer(copy.deepcopy(base), spec, "neuron", **options)
    finally:
        torchneuron.eager.set_eager_mode("eager")
    assert got.losses == pytest.approx(cpu.losses, **(LOSS_BF16 if mode == "bf16" else LOSS_FP32))
    assert any(not torch.equal(p.detach(), got.params[n]) for n, p in base.named_parameters()), "nothing trained"
    if mode == "bf16":
        _assert_bf16_grads(got.grads, cpu.grads, train(copy.deepcopy(base), spec, "cpu").grads)
    else:
        _assert_grads(got.grads, cpu.grads, compiled=mode == "compiled")
    want = infer(copy.deepcopy(base), spec, "cpu", autocast=options["autocast"])
    if spec.generates:
        prompt = spec.prompt().get("input_ids")
        assert out.shape[-1] > (1 if prompt is None else prompt.shape[-1]), "nothing was generated"
        assert torch.equal(out, want), f"generated {out.tolist()}, the CPU {want.tolist()}"
    else:
        torch.testing.assert_close(out, want, **({"atol": 3e-2, "rtol": 3e-2} if mode == "bf16" else {}))
    modeled = got.modeled
    assert modeled.device_time_s > 0 and modeled.flops > 0
    if record is not None:
        record("zoo", {"model": name, "mode": mode, "trn2_step_ms": modeled.device_time_s * 1e3,
                       "mfu": modeled.mfu})
