"""Adaptive eager mode: results equal plain eager's on the same programs, host reads flush,
random numbers and streams keep eager's order, repeated sequences compile once, and fewer
dispatched kernels show up on the device timeline."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchneuron
import torchneuron.eager as eager
from torchneuron.hardware import estimate
from torchneuron.runtime import host_view

from tests.models import GeluMLP


def program(x, w):
    y = (x @ w).relu() * 2 + 1                 # matmul + epilogue
    z = y.softmax(-1).sum(0)                   # reductions
    x.add_(0.5)                                # in-place on an input
    yt = y.t()                                 # a view of a queued result, kept by the caller
    return z, yt, (yt * 3).exp()


def run(fn, iterations=3, seed=0):
    results = []
    for i in range(iterations):
        g = torch.Generator().manual_seed(seed + i)
        x, w = torch.randn(16, 16, generator=g).to("neuron"), torch.randn(16, 16, generator=g).to("neuron")
        outs = fn(x, w)
        results.append([t.cpu() for t in outs] + [x.cpu()])
    return results


def test_mode_switch_and_validation():
    assert eager.get_eager_mode() == "eager"
    with pytest.raises(ValueError, match="unknown eager mode"):
        eager.set_eager_mode("lazy")
    torchneuron.set_eager_mode("adaptive")
    assert eager.get_eager_mode() == "adaptive"
    torchneuron.set_eager_mode("eager")
    assert eager.get_eager_mode() == "eager"


def test_results_equal_eager_and_repeats_compile_once(adaptive):
    # Iteration 1 runs each op once, unqueued, to learn its outputs; iteration 2 queues the run
    # and sees it once; iteration 3 compiles it; iterations 3 and 4 run it fused.
    eager.set_eager_mode("eager")
    want = run(program, iterations=4)
    eager.set_eager_mode("adaptive")
    before = adaptive.stats()
    got = run(program, iterations=4)
    after = adaptive.stats()
    for got_step, want_step in zip(got, want):
        for g, w in zip(got_step, want_step):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert after["compiles"] - before["compiles"] == 1      # the second sighting compiles
    assert after["fused_runs"] - before["fused_runs"] == 2   # the third and fourth run fused
    assert after["outputs_skipped"] > before["outputs_skipped"]  # dead intermediates never written


def test_host_reads_flush_the_queue(adaptive, capsys):
    def steps():
        x = torch.arange(6.0, device="neuron")
        y = x * 2 + 1
        yield y
        assert y.sum().item() == 36.0
        z = (y - 1) / 2
        yield z
        assert torch.equal(z.cpu(), torch.arange(6.0))
        w = z + 10
        yield w
        print(w)
        assert "10., 11., 12." in capsys.readouterr().out
        v = w * 0
        yield v
        assert host_view(v).sum().item() == 0
        assert not adaptive.pending()

    for _ in steps():  # the first time, each op runs unqueued and shows how to queue it
        pass
    for _ in steps():  # then every op before a host read is still queued when the read comes
        assert adaptive.pending()


def test_random_numbers_and_dropout_match_eager(adaptive):
    def prog():
        x = torch.ones(64, device="neuron")
        a = x * 3
        b = torch.rand(64, device="neuron") + a
        return F.dropout(b, 0.3, training=True).sum(), torch.randn(4, device="neuron") * a[:4]

    eager.set_eager_mode("eager")
    torch.manual_seed(7)
    want = [t.cpu() for t in prog()]
    eager.set_eager_mode("adaptive")
    torch.manual_seed(7)
    got = [t.cpu() for t in prog()]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_deterministic_algorithms_turn_queueing_off(adaptive):
    torch.use_deterministic_algorithms(True)
    try:
        before = adaptive.stats()["queued"]
        x = torch.ones(8, device="neuron")
        y = (x + 1) * 2
        assert adaptive.stats()["queued"] == before
        assert y.sum().item() == 32.0
    finally:
        torch.use_deterministic_algorithms(False)


def test_side_streams_keep_their_order(adaptive):
    x = torch.ones(32, device="neuron")
    s = torch.neuron.Stream()
    for _ in range(2):                # the first time, each op runs unqueued and shows how to queue it
        a = x * 2
        flushes = adaptive.stats()["flushes"]
        with torch.neuron.stream(s):
            b = a + 1                 # another stream: the default stream's queue flushes first
        flushed_for_stream = adaptive.stats()["flushes"] > flushes
        s.synchronize()
        c = b * a
        torch.testing.assert_close(c.cpu(), torch.full((32,), 6.0))
    assert flushed_for_stream


def _train(model, steps, start=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step + start)
        x, y = torch.randn(32, 16, generator=g).to("neuron"), torch.randint(0, 4, (32,), generator=g).to("neuron")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def test_training_loop_matches_eager_compiles_once_and_dispatches_fewer_kernels(adaptive):
    torch.manual_seed(0)
    base = GeluMLP(hidden=64)
    eager.set_eager_mode("eager")
    reference = copy.deepcopy(base).to("neuron")
    want, ref_opt = _train(reference, 5)
    with estimate() as eager_step:
        _train_step(reference, ref_opt)

    eager.set_eager_mode("adaptive")
    model = copy.deepcopy(base).to("neuron")
    got, opt = _train(model, 5)
    compiles = adaptive.stats()["compiles"]
    with estimate() as adaptive_step:
        _train_step(model, opt)
    assert adaptive.stats()["compiles"] == compiles  # a repeated step pays no compilation
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=0, rtol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), q.cpu(), atol=0, rtol=0)
    # AdamW's bias corrections change every step: they are arguments of the step's fused program
    assert adaptive_step.entries < 0.85 * eager_step.entries
    assert adaptive_step.device_time_s < 0.9 * eager_step.device_time_s


def _train_step(model, opt):
    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(32, 16, generator=g).to("neuron"), torch.randint(0, 4, (32,), generator=g).to("neuron")
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_environment_variable_enables_the_mode():
    code = ("import torch, torchneuron.eager as e; x = torch.ones(4, device='neuron'); "
            "totals = [((x + 1) * 2).sum().item() for _ in range(2)]; "  # the first time each op runs unqueued
            "print(e.get_eager_mode(), totals[1], e.stats()['queued'])")
    env = {**os.environ, "TORCHNEURON_EAGER_MODE": "adaptive"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    mode, total, queued = out.stdout.split()
    assert (mode, float(total), int(queued)) == ("adaptive", 16.0, 3)  # add, mul, sum


def test_events_time_queued_work():
    """An event recorded after queued ops is timed after them: the guard flushes the queue."""
    import torchneuron

    a = torch.randn(256, 256, device="neuron")
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    torchneuron.set_eager_mode("adaptive")
    try:
        start.record()
        b = (a * 2 + 1).relu()
        end.record()
        assert start.elapsed_time(end) > 0
        assert torch.equal(b.cpu(), (a.cpu() * 2 + 1).relu())
    finally:
        torchneuron.set_eager_mode("eager")


def test_flush_from_user_code_runs_ops_as_they_were_queued(adaptive):
    """Ops queued below autograd (an optimizer's in-place update of a leaf) run at an explicit
    flush without entering autograd again: no error, no grad_fn, one version bump."""
    for _ in range(2):  # the first time, each op runs unqueued (it shows how to queue it)
        w = torch.ones(4, device="neuron", requires_grad=True)
        with torch.no_grad():
            w.mul_(3).add_(1)
    version = w._version
    assert adaptive.pending()
    adaptive.flush()
    assert w.grad_fn is None and w.is_leaf and w._version == version
    assert torch.equal(w.detach().cpu(), torch.full((4,), 4.0))


def test_compiled_functions_with_graph_breaks_run_under_adaptive_mode(adaptive):
    """Ops issued between compiled graphs (a graph break) reach the queue from frames Dynamo
    evaluates; the queue itself is never traced, and results equal plain eager's."""
    def fn(x, w):
        y = (x @ w).relu()
        torch._dynamo.graph_break()
        z = y * 2 + x.sum()
        return (z - 1).tanh()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    want = fn(x, w)
    for _ in range(3):
        xn, wn = x.to("neuron"), w.to("neuron")
        eager_part = (xn * 3).exp()             # queued before the compiled call
        got = compiled(xn, wn)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(eager_part.cpu(), (x * 3).exp())
