"""Hugging Face transformers v5 models train and generate on neuron exactly as on the CPU."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.models import tiny_gpt2 as _tiny_gpt2  # noqa: E402

from .training import train_losses  # noqa: E402


def tiny_llama():
    from torchneuron.examples.train_llama import tiny_llama_config

    return transformers.LlamaForCausalLM(tiny_llama_config(vocab=128))


def tiny_gpt2():
    return _tiny_gpt2(n_embd=64, n_head=4)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_training_matches_cpu(build):
    torch.manual_seed(0)
    model = build()
    cpu = train_losses(copy.deepcopy(model), "cpu")
    neuron = train_losses(model, "neuron")
    # AdamW takes its foreach path on neuron and the for-loop path on the CPU: rounding differs slightly
    assert neuron == pytest.approx(cpu, rel=1e-3, abs=1e-3)
    assert len(set(neuron)) == len(neuron)  # the weights did change between steps


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_generate_gives_the_same_tokens(build):
    torch.manual_seed(0)
    model = build().eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **kwargs)
    actual = copy.deepcopy(model).to("neuron").generate(prompt.to("neuron"), **kwargs)
    assert torch.equal(actual.cpu(), expected)
