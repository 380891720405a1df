"""Adaptive eager mode on realistic training programs.

Each program runs several steps (so its fused runs are compiled once seen often enough and
served from the kernel cache on later steps) twice in plain eager mode on neuron (which must
agree with itself bit for bit), once in adaptive mode and once on the CPU, every run from the
same initial state (a deep copy of one CPU model) and the same seed. Losses, parameters,
gradients, buffers and optimizer state must be adaptive == eager (bit for bit) and
close to the CPU's.

The tiny Llama and two extra programs are marked slow (about a minute together on 2 cores);
the rest runs in about a minute.
"""
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron.eager as eager
from tests.models import tiny_llama

# Plain eager against adaptive: the same bits (fused programs round as the eager kernels do).
TIGHT = dict(atol=0, rtol=0)
# Neuron against the CPU: another device's kernels (matmul and reduction blocking may differ).
CPU = dict(atol=1e-4, rtol=1e-4)


def _host(value):
    """`value` with every tensor replaced by a detached CPU copy (a host read: flushes)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


def _state(model, optimizer=None):
    """Parameters, gradients, buffers (and optimizer state) of a model, on the host."""
    state = {
        "params": {n: p for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b for n, b in model.named_buffers()},
    }
    if optimizer is not None:
        state["optimizer"] = [{k: v for k, v in s.items()} for s in optimizer.state.values()]
    return _host(state)


def _run(program, base, mode, device="neuron", seed=0):
    """`program(model, device)` on a deep copy of `base` moved to `device`, in eager `mode`, from
    `torch.manual_seed(seed)`; returns its results on the host and the adaptive stats it added."""
    eager.set_eager_mode(mode)
    try:
        before = eager.stats()
        model = copy.deepcopy(base).to(device)
        torch.manual_seed(seed)
        result = _host(program(model, device))
        eager.flush()
        after = eager.stats()
    finally:
        eager.set_eager_mode("eager")
    return result, {k: after[k] - before.get(k, 0) for k in after}


def _compare(program, base, tight=TIGHT, cpu=CPU, seed=0, fused=True):
    """Runs `program` in eager mode twice, in adaptive mode and on the CPU; checks the results
    (and, if `fused`, that fused programs ran from the cache). Returns the adaptive run's
    results and stats."""
    want, _ = _run(program, base, "eager", seed=seed)
    again, _ = _run(program, base, "eager", seed=seed)
    torch.testing.assert_close(again, want, atol=0, rtol=0, msg=lambda m: f"plain eager is not deterministic: {m}")
    got, stats = _run(program, base, "adaptive", seed=seed)
    torch.testing.assert_close(got, want, **tight)
    if cpu is not None:
        on_cpu, _ = _run(program, base, "eager", device="cpu", seed=seed)
        torch.testing.assert_close(on_cpu, want, **cpu)
    if fused:
        _assert_fused_from_cache(stats)
    assert stats["compile_failures"] == 0, stats
    return got, stats


def _assert_fused_from_cache(stats):
    """Some fused program ran from the kernel cache: every compile is followed by one fused run,
    so more fused runs than compiles means a later step reused a program (compiled here, or by
    an earlier test running the same program)."""
    assert stats["queued"] > 0 and stats["fused_runs"] > stats["compiles"], stats


def _batch(step, shape, device, classes=None):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(*shape, generator=g).to(device)
    if classes is None:
        return x
    return x, torch.randint(0, classes, (shape[0],), generator=g).to(device)


# ---------------------------------------------------------------------------------------------
# A tiny Llama: AdamW, a learning-rate schedule, gradient clipping
# ---------------------------------------------------------------------------------------------

def _train_llama(model, device, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    losses, norms = [], []
    model.train()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (2, 16), generator=g)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :3] = 0                                    # a left-padded sequence
        labels = ids.masked_fill(mask == 0, -100)          # ... whose padding the loss ignores
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        if step == steps - 1:   # the last step clips (the others must not: it rescales every grad)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
        opt.step()
        schedule.step()
        losses.append(loss.detach())
        if step < steps - 1:    # keep the last step's (clipped) gradients for the comparison
            opt.zero_grad()
    model.eval()
    with torch.no_grad():       # greedy decoding with the KV cache: prefill, then one token at a time
        generated = model.generate(torch.tensor([[1, 2, 3, 4]], device=device), max_new_tokens=6,
                                   do_sample=False, pad_token_id=0)
    return {"losses": losses, "norms": norms, "lr": schedule.get_last_lr(), "generated": generated,
            **_state(model, opt)}


@pytest.mark.slow  # compiling the Llama forward and backward runs takes ~40 s on a cold Inductor cache
def test_tiny_llama_adamw_schedule_and_clipping():
    torch.manual_seed(0)
    got, _ = _compare(_train_llama, tiny_llama(vocab_size=64))
    assert got["norms"][0] > 0.5   # the clipping step really rescaled the gradients
    assert got["lr"][0] == pytest.approx(3e-3 / 5)
    assert got["losses"][-1] < got["losses"][0]
    assert got["generated"].shape == (1, 10)


# ---------------------------------------------------------------------------------------------
# A CNN with BatchNorm and Dropout: SGD with momentum, then inference
# ---------------------------------------------------------------------------------------------

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.drop(x.flatten(1)))


def _train_cnn(model, device, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses, dropped = [], []
    # The fraction of activations dropout zeroed, per forward (computed on the device).
    model.drop.register_forward_hook(lambda m, args, out: dropped.append(((out == 0) & (args[0] != 0)).float().mean()))
    model.train()
    for step in range(steps):
        x, y = _batch(step, (4, 3, 8, 8), device, classes=10)   # no input grad: conv's output_mask[0] False
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        logits = [model(_batch(100 + i, (4, 3, 8, 8), device)) for i in range(2)]
    return {"losses": losses, "eval": logits, "dropped": dropped, **_state(model, opt)}


def test_cnn_batchnorm_dropout_sgd_momentum_then_eval():
    torch.manual_seed(0)
    got, _ = _compare(_train_cnn, SmallCNN())
    assert got["buffers"]["bn1.num_batches_tracked"].item() == 4
    assert not torch.equal(got["buffers"]["bn1.running_mean"], torch.zeros(8))    # updated in place
    assert not torch.equal(got["buffers"]["bn2.running_var"], torch.ones(8))
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in got["optimizer"])
    # Dropout (p=0.25) dropped activations in training (the same ones as eager: compared above), not in eval.
    assert all(0.05 < float(d) < 0.5 for d in got["dropped"][:4]) and not any(got["dropped"][4:])


# ---------------------------------------------------------------------------------------------
# Gradient accumulation, zero_grad(set_to_none=False), in-place ops on views
# ---------------------------------------------------------------------------------------------

class ViewEditingMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 24), nn.Linear(24, 5)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h[:, 1:].mul_(2)                                   # in place on a view of an activation
        h = h.masked_fill(h > 1.5, 1.5)
        h.masked_fill_(h < -0.1, 0.0)
        h[:, ::3] += 0.25                                  # strided view, in place
        return self.fc2(h)


def _train_accumulating(model, device, steps=4, micro_batches=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    losses, norms, grads = [], [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        if step == 1:
            grads = [p.grad for p in model.parameters()]
        for micro in range(micro_batches):
            if micro == 1 and step == steps - 1:           # a gradient half accumulated
                first = [p.grad.clone() for p in model.parameters()]
            x, y = _batch(10 * step + micro, (6, 12), device, classes=5)
            x[:, 1:].mul_(2)                               # in-place preprocessing on views of the batch
            x[x.abs() > 2.5] = 0.0                         # index_put_ with a boolean mask
            x.index_put_((torch.tensor([0, 2], device=device),), torch.ones(12, device=device), accumulate=True)
            loss = F.cross_entropy(model(x), y) / micro_batches
            loss.backward()
            losses.append(loss.detach())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
        opt.step()
        schedule.step()
        with torch.no_grad():                              # in place on a view of a parameter
            model.fc1.weight[:, :4].clamp_(-0.2, 0.2)
    # zero_grad(set_to_none=False) zeroed the gradients in place: the same tensors throughout
    kept = grads is None or all(p.grad is g for p, g in zip(model.parameters(), grads))
    return {"losses": losses, "norms": norms, "grads_kept": kept, "first_micro_batch_grads": first,
            **_state(model, opt)}


def test_gradient_accumulation_and_inplace_views():
    torch.manual_seed(0)
    base = ViewEditingMLP()
    got, _ = _compare(_train_accumulating, base)
    clamped = got["params"]["fc1.weight"][:, :4].abs()
    bound = torch.tensor(0.2)
    assert (clamped <= bound).all() and (clamped == bound).any()     # the clamp on the view was active
    assert (got["params"]["fc1.weight"][:, 4:].abs() > bound).any()   # ... and only on the view
    assert got["grads_kept"]
    assert max(got["norms"]) > 1.0      # some step clipped its accumulated gradients
    # The second micro-batch added to the first one's gradients.
    for first, final in zip(got["first_micro_batch_grads"], got["grads"].values()):
        assert first.abs().sum() > 0 and not torch.allclose(first, final)


# ---------------------------------------------------------------------------------------------
# bfloat16 autocast
# ---------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.silu(self.norm(self.fc1(x))) * 1.5)


def _train_autocast(model, device, steps=6):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, outputs = [], []
    for step in range(steps):
        x, y = _batch(step, (8, 16), device, classes=4)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        outputs.append(logits.detach())
    return {"losses": losses, "logits": outputs, **_state(model, opt)}


# On the CPU, autocast casts the same ops to bfloat16, but its bf16 matmuls may accumulate
# differently: a few bfloat16 ulps apart too.
BF16_CPU = dict(atol=3e-2, rtol=3e-2)


def test_bfloat16_autocast_training():
    torch.manual_seed(0)
    got, _ = _compare(_train_autocast, Block(), cpu=BF16_CPU)
    assert all(t.dtype == torch.bfloat16 for t in got["logits"])
    assert got["losses"][-1] < got["losses"][0]


class GatedMLP(nn.Module):
    """A SwiGLU feed-forward block: under autocast, bfloat16 matmuls with bfloat16 pointwise
    ops between them (no reductions besides the matmuls')."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 48), nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x) * 0.5)


def _autocast_forward(model, device, batches=4):
    outputs = []
    for i in range(batches):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            outputs.append(model(_batch(i, (8, 16), device)))
    assert all(y.dtype == torch.bfloat16 for y in outputs)
    return {"outputs": outputs}


def test_bfloat16_autocast_forward_rounds_like_eager():
    torch.manual_seed(0)
    # Plain eager rounds every bfloat16 op's result to bfloat16 and the matmuls are the same
    # kernels: with no float32 reduction to reorder, adaptive mode must give the same bits.
    got, _ = _compare(_autocast_forward, GatedMLP(), cpu=BF16_CPU)
    assert got["outputs"][0].abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Host reads in the middle of a step, and printing
# ---------------------------------------------------------------------------------------------

NUMBER = re.compile(r"-?\d+\.\d*(?:e[-+]?\d+)?")


def _numbers(text):
    return torch.tensor([float(n) for n in NUMBER.findall(text)], dtype=torch.float64)


def _train_with_host_reads(model, device, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, read, pending = [], [], []
    for step in range(steps):
        x, y = _batch(step, (8, 16), device, classes=4)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pending.append(eager.pending())
        read.append(loss.item())                              # host read between backward and step
        grad_norm = model.fc1.weight.grad.norm()
        print(f"step {step}: loss {read[-1]:.6f} grad norm {grad_norm:.6f}")   # formats a pending tensor
        if loss.item() > 10:                                  # data-dependent control flow
            opt.param_groups[0]["lr"] = 0.01
        opt.step()
        print(model.fc2.bias)                                 # prints a parameter just updated
        print(model.fc1.weight.grad[0, :4] * 2)
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "read": torch.tensor(read), "pending": pending, **_state(model, opt)}


def test_host_reads_and_printing_mid_step(capsys):
    torch.manual_seed(0)
    base = Block()
    want, _ = _run(_train_with_host_reads, base, "eager")
    printed = capsys.readouterr().out
    got, stats = _run(_train_with_host_reads, base, "adaptive")
    torch.testing.assert_close(got["read"], torch.stack(got["losses"]), atol=0, rtol=0)  # .item() saw the loss
    # ... while ops were queued (from the second step: the first sightings of ops may run at once)
    assert got.pop("pending")[-1] > 0 and not any(want.pop("pending"))
    torch.testing.assert_close(got, want, **TIGHT)
    # The same text printed, in the same order, with the same numbers (to float32 round-off: a
    # number printed to 6 decimals may show a last-digit difference of 1e-6).
    out = capsys.readouterr().out
    assert NUMBER.sub("#", out) == NUMBER.sub("#", printed)
    torch.testing.assert_close(_numbers(out), _numbers(printed), atol=2e-6, rtol=1e-5)
    assert printed.count("grad norm") == 4 and printed.count("Parameter containing") == 4
    on_cpu, _ = _run(_train_with_host_reads, base, "eager", device="cpu")
    on_cpu.pop("pending")
    torch.testing.assert_close(on_cpu, want, **CPU)
    _assert_fused_from_cache(stats)


# ---------------------------------------------------------------------------------------------
# Fusion of parameter updates
# ---------------------------------------------------------------------------------------------

def _train_clipped_critic(model, device, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x = _batch(step, (16, 10), device)                 # loading the batch flushes, grad mode on
        loss = model(x).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():                              # WGAN-style weight clipping
            for p in model.parameters():
                p.clamp_(-0.1, 0.1)
        losses.append(loss.detach())
    return {"losses": losses, **_state(model)}


def test_parameter_updates_fuse_when_flushed_with_grad_mode_on():
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 1))
    got, stats = _compare(_train_clipped_critic, critic, fused=False)   # results equal eager's either way,
    bound = torch.tensor(0.1)
    assert all((p.abs() <= bound).all() for p in got["params"].values())
    assert any((p.abs() == bound).any() for p in got["params"].values())
    assert stats["compile_failures"] == 0, stats                          # but the steps should fuse
    _assert_fused_from_cache(stats)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing with dropout, an EMA of the weights
# ---------------------------------------------------------------------------------------------

class CheckpointedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def block(self, h):
        return F.dropout(F.gelu(self.fc2(h)), 0.3, training=self.training)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, F.relu(self.fc1(x)), use_reentrant=False)
        return self.fc3(h)


def _train_checkpointed(model, device, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.parameters()]
    losses = []
    for step in range(steps):
        x, y = _batch(step, (8, 12), device, classes=3)
        loss = F.cross_entropy(model(x), y)
        loss.backward()                                    # recomputes the block, dropout included
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.1)
        losses.append(loss.detach())
    return {"losses": losses, "ema": ema, **_state(model)}


def test_activation_checkpointing_with_dropout():
    torch.manual_seed(0)
    # The CPU run checks the recomputation's dropout mask too: torch.utils.checkpoint restores the
    # neuron generator only if torch.neuron has `_initialized`.
    got, _ = _compare(_train_checkpointed, CheckpointedMLP())
    assert all(torch.isfinite(l) for l in got["losses"])
    assert not torch.equal(got["ema"][0], got["params"]["fc1.weight"])


# ---------------------------------------------------------------------------------------------
# Double backward (a gradient penalty) and scatter-style aggregation
# ---------------------------------------------------------------------------------------------

def _train_gradient_penalty(model, device, steps=6):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, penalties = [], []
    for step in range(steps):
        x = _batch(step, (8, 12), device).requires_grad_(True)
        out = model(x).sum()
        g, = torch.autograd.grad(out, x, create_graph=True)     # WGAN-GP: differentiate through a grad
        penalty = ((g.norm(dim=1) - 1) ** 2).mean()
        loss = out / 8 + 10 * penalty
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        penalties.append(penalty.detach())
    return {"losses": losses, "penalties": penalties, **_state(model, opt)}


@pytest.mark.slow  # keeps the module's default run near a minute on 2 cores (this one takes ~6 s)
def test_double_backward_gradient_penalty():
    torch.manual_seed(0)
    got, _ = _compare(_train_gradient_penalty, nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 1)))
    assert all(p > 0 for p in got["penalties"])


class MessagePassing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, src, dst):
        msg = self.lin(x).index_select(0, src)
        agg = torch.zeros_like(x).index_add(0, dst, msg)                   # duplicate destinations
        agg = agg.scatter_add(0, dst[:, None].expand(-1, 8), msg * 0.5)
        return self.out(F.relu(agg + x))


def _train_message_passing(model, device, steps=6):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(10, 8, generator=g).to(device)
        src, dst = (torch.randint(0, 10, (30,), generator=g).to(device) for _ in range(2))
        y = torch.randint(0, 2, (10,), generator=g).to(device)
        loss = F.cross_entropy(model(x, src, dst), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, **_state(model, opt)}


@pytest.mark.slow  # keeps the module's default run near a minute on 2 cores (this one takes ~5 s)
def test_scatter_aggregation_training():
    torch.manual_seed(0)
    got, _ = _compare(_train_message_passing, MessagePassing())
    assert got["losses"][-1] < got["losses"][0]


# ---------------------------------------------------------------------------------------------
# Prefetching batches on a side stream
# ---------------------------------------------------------------------------------------------

def _train_prefetching(model, device, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    side, main = torch.neuron.Stream(), torch.neuron.current_stream()

    def load(step):       # the next batch is copied and normalised on the side stream
        x, y = _batch(step, (8, 16), "cpu", classes=4)
        with torch.neuron.stream(side):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            return (x - x.mean(0)) / (x.std(0) + 1e-5), y

    losses, upcoming = [], load(0)
    for step in range(steps):
        main.wait_stream(side)
        x, y = upcoming
        x.record_stream(main)
        y.record_stream(main)
        if step + 1 < steps:
            upcoming = load(step + 1)     # queued on the side stream while this step's ops wait
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, **_state(model, opt)}


def test_side_stream_prefetching_training():
    torch.manual_seed(0)
    got, stats = _compare(_train_prefetching, Block(), cpu=None)   # neuron streams: no CPU run
    assert stats["flushes"] >= 4     # every switch of stream flushed the other stream's queued ops
    assert got["losses"][-1] < got["losses"][0]
