"""Recurrent modules on neuron match the CPU: every nn.LSTM / nn.GRU / nn.RNN mode and the cells.

On any device but the CPU, ATen runs the LSTM and GRU cells as the fused ops
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` (and their backward ops), which have no CPU kernel:
the device implements them (runtime/csrc/rnn.cpp). Each test runs the same module, inputs and
gradients on both devices.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

DEV = "neuron"


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def _leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value for t in _leaves(v)]
    return []


def _compare(module: nn.Module, *inputs, atol: float = 1e-5, rtol: float = 1.3e-6, train: bool = False):
    """Forward and backward of `module` on CPU and neuron: outputs, input and parameter gradients."""
    cpu = copy.deepcopy(module).train(train)
    dev = copy.deepcopy(module).to(DEV).train(train)
    cpu_in = [_to(x, "cpu") for x in inputs]
    dev_in = [_to(x, DEV) for x in inputs]
    for x in _leaves(tuple(cpu_in)) + _leaves(tuple(dev_in)):
        if x.is_floating_point():
            x.requires_grad_(True)
    out_cpu, out_dev = cpu(*cpu_in), dev(*dev_in)
    flat_cpu, flat_dev = _leaves(out_cpu), _leaves(out_dev)
    assert len(flat_cpu) == len(flat_dev)
    torch.manual_seed(1)
    weights = [torch.randn(t.shape) for t in flat_cpu]
    sum(((t * w).sum() for t, w in zip(flat_cpu, weights))).backward()
    sum(((t * w.to(DEV)).sum() for t, w in zip(flat_dev, weights))).backward()
    for a, b in zip(flat_cpu, flat_dev):
        torch.testing.assert_close(b.cpu(), a, atol=atol, rtol=rtol)
    for a, b in zip(_leaves(tuple(cpu_in)), _leaves(tuple(dev_in))):
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, atol=atol, rtol=rtol)
    for (name, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


MODES = [
    dict(num_layers=1),
    dict(num_layers=2),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=1, batch_first=True),
    dict(num_layers=2, bias=False),
]


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_recurrent_module_matches_cpu(kind, mode):
    torch.manual_seed(0)
    module = getattr(nn, kind)(5, 6, **mode)
    shape = (2, 4, 5) if mode.get("batch_first") else (4, 2, 5)
    _compare(module, torch.randn(shape))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_initial_state_and_final_state(kind):
    torch.manual_seed(0)
    module = getattr(nn, kind)(3, 4, num_layers=2, bidirectional=True)
    h0 = torch.randn(4, 2, 4)
    state = (h0, torch.randn(4, 2, 4)) if kind == "LSTM" else h0
    _compare(module, torch.randn(5, 2, 3), state)


def test_lstm_proj_size():
    torch.manual_seed(0)
    _compare(nn.LSTM(4, 6, num_layers=2, proj_size=3), torch.randn(3, 2, 4))


class _Packed(nn.Module):
    """A recurrent module over a packed batch of sequences of different lengths."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        return padded


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_packed_sequences(kind):
    torch.manual_seed(0)
    module = _Packed(getattr(nn, kind)(3, 4, num_layers=2, bidirectional=True, batch_first=True))
    _compare(module, torch.randn(3, 5, 3), [5, 2, 4])  # lengths stay on the host, as with CUDA


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell", "RNNCell"])
def test_cells(cell):
    torch.manual_seed(0)
    module = getattr(nn, cell)(4, 5)
    _compare(module, torch.randn(3, 4))
    hidden = torch.randn(3, 5)
    _compare(module, torch.randn(3, 4), (hidden, torch.randn(3, 5)) if cell == "LSTMCell" else hidden)


def test_unbatched_input():
    torch.manual_seed(0)
    _compare(nn.LSTM(3, 4, num_layers=2), torch.randn(5, 3))


def test_dropout_between_layers():
    """Eval mode drops nothing; in training, the same seed draws the same masks on both devices
    (the device generator is an mt19937 engine like the CPU's)."""
    torch.manual_seed(0)
    module = nn.LSTM(3, 8, num_layers=3, dropout=0.5)
    x = torch.randn(4, 2, 3)
    _compare(module, x)
    torch.manual_seed(7)
    cpu_out = copy.deepcopy(module).train()(x)[0]
    torch.manual_seed(7)
    dev_out = copy.deepcopy(module).to(DEV).train()(x.to(DEV))[0]
    torch.testing.assert_close(dev_out.cpu(), cpu_out)


def test_half_precision_lstm():
    torch.manual_seed(0)
    module = nn.LSTM(4, 8, num_layers=2).to(torch.bfloat16)
    _compare(module, torch.randn(3, 2, 4, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)


def test_fused_cell_ops_directly():
    """The fused ops' own contract (CUDA's workspace layout), against the unfused cell on the CPU."""
    torch.manual_seed(0)
    batch, hidden = 3, 4
    ig, hg = torch.randn(batch, 4 * hidden), torch.randn(batch, 4 * hidden)
    cx, bi, bh = torch.randn(batch, hidden), torch.randn(4 * hidden), torch.randn(4 * hidden)
    hy, cy, workspace = torch.ops.aten._thnn_fused_lstm_cell(ig.to(DEV), hg.to(DEV), cx.to(DEV), bi.to(DEV), bh.to(DEV))
    i, f, g, o = (hg + bh + ig + bi).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    torch.testing.assert_close(cy.cpu(), f * cx + i * g)
    torch.testing.assert_close(hy.cpu(), o * (f * cx + i * g).tanh())
    torch.testing.assert_close(workspace.cpu(), torch.cat([i, f, g, o], 1))
    with pytest.raises(RuntimeError, match="do not match a state"):
        torch.ops.aten._thnn_fused_lstm_cell(ig.to(DEV), hg.to(DEV), torch.randn(batch, hidden + 1, device=DEV))


class _LanguageModel(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def test_lstm_language_model_trains_as_on_cpu():
    """A few optimizer steps of a small LSTM language model: losses and gradients match the CPU's."""
    torch.manual_seed(0)
    model = _LanguageModel()
    tokens = torch.randint(0, 50, (4, 12))
    models = {"cpu": copy.deepcopy(model), DEV: copy.deepcopy(model).to(DEV)}
    optims = {d: torch.optim.Adam(m.parameters(), lr=1e-2) for d, m in models.items()}
    losses = {d: [] for d in models}
    for _ in range(4):
        grads = {}
        for d, m in models.items():
            x = tokens.to(d)
            logits = m(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 50), x[:, 1:].reshape(-1))
            optims[d].zero_grad()
            loss.backward()
            optims[d].step()
            losses[d].append(loss.item())
            grads[d] = [p.grad.cpu() for p in m.parameters()]
        for a, b in zip(grads["cpu"], grads[DEV]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert losses["cpu"][-1] < losses["cpu"][0]
    torch.testing.assert_close(torch.tensor(losses[DEV]), torch.tensor(losses["cpu"]), atol=1e-5, rtol=1e-5)
