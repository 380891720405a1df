"""Small models shared by test files: each test compares the neuron device (eager, adaptive eager
or compiled) with the CPU on the same model, built from the same seed. The transformers are built
from configs (no hub download); a test that builds one is skipped without transformers."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F


class GeluMLP(torch.nn.Module):
    """Linear -> GELU -> (LayerNorm) -> Linear."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, norm: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d_in, hidden), torch.nn.Linear(hidden, d_out)
        self.norm = torch.nn.LayerNorm(hidden) if norm else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


_TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
_TINY_GPT2 = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0)


def tiny_llama(**config: Any) -> torch.nn.Module:
    """A two-layer LlamaForCausalLM (hidden 32, vocabulary 128 unless `config` says otherwise)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_TINY_LLAMA, **config}))


def tiny_gpt2(**config: Any) -> torch.nn.Module:
    """A two-layer GPT2LMHeadModel without dropout (width 32, vocabulary 128 unless `config` says
    otherwise)."""
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**_TINY_GPT2, **config}))


def compiled_llama_against_eager(base: torch.nn.Module, ids: torch.Tensor, monkeypatch: Any) -> list[dict[str, int]]:
    """Trains one step of a copy of the causal LM `base` on the CPU eagerly and one of a copy on
    neuron compiled with backend "neuron" (labels = ids), asserts the losses and every
    parameter's gradient agree, and returns the substitution counts of each captured graph."""
    import copy

    from torchneuron.compiler import patterns

    counts: list[dict[str, int]] = []
    substitute = patterns.substitute
    monkeypatch.setattr(patterns, "substitute", lambda gm: counts.append(substitute(gm)) or counts[-1])

    def loss_and_grads(model: torch.nn.Module, compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = next(model.parameters()).device
        forward = torch.compile(model, backend="neuron") if compiled else model
        loss = forward(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}

    torch._dynamo.reset()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base), compiled=False)
    moved = copy.deepcopy(base).to("neuron")
    moved.tie_weights()
    loss, grads = loss_and_grads(moved, compiled=True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    return counts
