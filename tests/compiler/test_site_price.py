"""compiler/site_price.py: a matched site becomes its NKI kernel only where the kernel's plan is
modeled cheaper than the generic ops' plan, forward and backward."""
from __future__ import annotations

import pytest
import torch

from torchneuron import settings
from torchneuron.compiler import site_price
from torchneuron.compiler.patterns_rope_ce import rope_reference
from torchneuron.kernels import rope_ce_ops

BF16 = torch.bfloat16


def _rope_signatures(seq: int, grad: bool) -> list[site_price.Signature]:
    return [((1, 8, seq, 128), BF16, grad), ((1, 1, seq, 128), BF16, False), ((1, 1, seq, 128), BF16, False)]


def test_training_prices_the_backward_too_and_work_grows_with_the_site():
    inference = site_price.traced_seconds(rope_reference, _rope_signatures(512, grad=False))
    training = site_price.traced_seconds(rope_reference, _rope_signatures(512, grad=True))
    longer = site_price.traced_seconds(rope_reference, _rope_signatures(2048, grad=True))
    assert 0 < inference < training < longer
    kernel = site_price.traced_seconds(rope_ce_ops.apply_rope, _rope_signatures(512, grad=True))
    # the kernel's backward is the kernel again (the inverse rotation): twice its forward
    assert kernel == pytest.approx(2 * site_price.traced_seconds(rope_ce_ops.apply_rope,
                                                                 _rope_signatures(512, grad=False)))


def _matmuls(x: torch.Tensor) -> torch.Tensor:
    return (x @ x.T) @ x


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize("mode, expected", [("price", (True, False)), ("1", (True, True)), ("0", (False, False))])
def test_the_cheaper_plan_wins_unless_forced(monkeypatch, mode, expected):
    monkeypatch.setenv("TORCHNEURON_COMPILE_ROPE_CE_KERNELS", mode)
    x = torch.randn(256, 256, device="neuron", requires_grad=True)
    cheap_kernel = site_price.kernel_chosen("test_cheap", _matmuls, _scale, [x])
    dear_kernel = site_price.kernel_chosen("test_dear", _scale, _matmuls, [x])
    assert (cheap_kernel, dear_kernel) == expected


def test_the_switch_reads_price_on_and_off():
    read = lambda text: settings.Settings.from_environ({"TORCHNEURON_COMPILE_ROPE_CE_KERNELS": text})  # noqa: E731
    assert settings.Settings().compile_rope_ce_kernels == "price"
    assert [read(t).compile_rope_ce_kernels for t in ("price", "1", "on", "0", "false")] == \
        ["price", "on", "on", "off", "off"]
    with pytest.raises(ValueError, match="TORCHNEURON_COMPILE_ROPE_CE_KERNELS='sometimes'.*price"):
        read("sometimes")


def test_rmsnorm_and_its_projections_become_one_kernel_and_match_cpu(monkeypatch):
    import copy

    transformers = pytest.importorskip("transformers")
    from torchneuron.compiler import patterns

    monkeypatch.setenv("TORCHNEURON_COMPILE_ROPE_CE_KERNELS", "1")
    counts, substitute = [], patterns.substitute
    monkeypatch.setattr(patterns, "substitute", lambda gm: counts.append(substitute(gm)) or counts[-1])
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=256)
    cpu = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 256, (1, 128))
    torch._dynamo.reset()
    loss = torch.compile(model, backend="neuron")(input_ids=ids.to("neuron"), labels=ids.to("neuron")).loss
    loss.backward()
    reference = cpu(input_ids=ids, labels=ids).loss
    reference.backward()
    # q/k/v after the input norm; the post-attention norm's gate/up are the SwiGLU kernel's
    assert counts[0]["rmsnorm_linear"] == 1 and counts[0]["swiglu"] == 1
    torch.testing.assert_close(loss.cpu(), reference, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4, msg=name)
