"""Tiered execution (compiler/tiered.py): a compiled graph runs with ATen kernels while its C++
builds in the background, then switches; same results, same modeled device time either way."""
import threading

import pytest
import torch
import torch.nn as nn

import torchneuron.eager
from torchneuron.compiler import NeuronCompileError, build_stats, cache, tiered, wait_for_builds
from torchneuron.hardware import estimate


@pytest.fixture
def held_builds(monkeypatch, fresh_dynamo):
    """Builds finish only when the test releases them (so the ATen tier is seen deterministically)."""
    release = threading.Event()
    original = tiered.Build._finish

    def finish(self, scope, kernels):
        release.wait(120)
        return original(self, scope, kernels)

    monkeypatch.setattr(tiered.Build, "_finish", finish)
    monkeypatch.setenv("TORCHNEURON_COMPILE_TIERED", "1")
    cache.clear()
    yield release
    release.set()
    wait_for_builds(120)
    cache.clear()


def step_fn(x, w):
    return torch.tanh(x @ w).mul(3).add(1).sum()


def test_first_calls_run_the_aten_tier_then_switch(held_builds):
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    xn, wn = x.to("neuron"), w.to("neuron").requires_grad_()
    compiled = torch.compile(step_fn, backend="neuron")
    before = build_stats()
    with estimate("trn2") as first:
        loss = compiled(xn, wn)
        loss.backward()
    during = build_stats()
    assert during["builds"] - before["builds"] == 2            # the forward and the backward graph
    assert during["aten_tier_calls"] - before["aten_tier_calls"] == 2
    assert during["pending"] >= 2
    grad_aten = wn.grad.cpu().clone()
    wc = w.clone().requires_grad_()
    reference = step_fn(x, wc)
    reference.backward()
    torch.testing.assert_close(loss.cpu(), reference.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_aten, wc.grad, rtol=1e-5, atol=1e-5)

    held_builds.set()
    assert wait_for_builds(120)
    wn.grad = None
    with estimate("trn2") as second:
        loss2 = compiled(xn, wn)
        loss2.backward()
    after = build_stats()
    assert after["switches"] - during["switches"] == 2
    assert after["aten_tier_calls"] == during["aten_tier_calls"]  # the generated code ran
    torch.testing.assert_close(loss2.cpu(), loss.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wn.grad.cpu(), grad_aten, rtol=1e-5, atol=1e-5)
    # The plan's kernels are charged either way: the same modeled device time and kernels.
    assert second.entries == first.entries > 0
    assert second.device_time_s == pytest.approx(first.device_time_s, rel=1e-9)


def test_tiered_off_runs_the_generated_code_from_the_first_call(monkeypatch, fresh_dynamo):
    monkeypatch.setenv("TORCHNEURON_COMPILE_TIERED", "0")
    cache.clear()
    x, w = torch.randn(8, 16).to("neuron"), torch.randn(16, 16).to("neuron")
    before = build_stats()
    out = torch.compile(step_fn, backend="neuron")(x, w)
    after = build_stats()
    assert after["builds"] == before["builds"] and after["aten_tier_calls"] == before["aten_tier_calls"]
    torch.testing.assert_close(out.cpu(), step_fn(x.cpu(), w.cpu()), rtol=1e-5, atol=1e-5)
    cache.clear()


def test_a_failed_build_is_a_compile_error_at_the_switch(held_builds, monkeypatch):
    def broken_load():
        raise RuntimeError("g++ exited with status 1")

    monkeypatch.setattr(tiered.BackgroundBuild, "cpp_pybinding", lambda self, argtypes, source: tiered._Kernel(broken_load))
    x, w = torch.randn(4, 16).to("neuron"), torch.randn(16, 16).to("neuron")
    compiled = torch.compile(lambda a, b: torch.sigmoid(a @ b).mul(5).sum(), backend="neuron")
    failed = build_stats()["builds_failed"]
    out = compiled(x, w)  # the ATen tier runs while the build is held
    torch.testing.assert_close(out.cpu(), torch.sigmoid(x.cpu() @ w.cpu()).mul(5).sum(), rtol=1e-5, atol=1e-5)
    held_builds.set()
    wait_for_builds(60)
    assert build_stats()["builds_failed"] == failed + 1
    with pytest.raises(NeuronCompileError, match="g\\+\\+ exited with status 1"):
        compiled(x, w)
    # The process stays usable: eager work goes on.
    torch.testing.assert_close((x @ w).cpu(), x.cpu() @ w.cpu())


def test_adaptive_programs_in_the_aten_tier_match_eager_bit_for_bit(held_builds):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)

    def train(adaptive: bool) -> list[torch.Tensor]:
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        model.load_state_dict(base.state_dict())
        model = model.to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        xn = x.to("neuron")
        torchneuron.eager.set_eager_mode("adaptive" if adaptive else "eager")
        try:
            for _ in range(4):
                model(xn).square().mean().backward()
                opt.step()
                opt.zero_grad()
                torchneuron.eager.flush()
        finally:
            torchneuron.eager.set_eager_mode("eager")
        return [p.detach().cpu() for p in model.parameters()]

    torchneuron.eager.forget_programs()
    before = build_stats()
    adaptive = train(True)
    assert build_stats()["aten_tier_calls"] > before["aten_tier_calls"]  # programs ran in the ATen tier
    eager = train(False)
    for a, e in zip(adaptive, eager):
        assert torch.equal(a, e)
    held_builds.set()
    assert wait_for_builds(120)
    switched = build_stats()["switches"]
    compiled = train(True)  # the same programs, now their generated code
    assert build_stats()["switches"] > switched
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)
