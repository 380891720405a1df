"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) train and
generate on neuron as on the CPU, with each experts implementation transformers offers."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from .training import train_losses  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mixtral(impl):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, experts_implementation=impl))


def qwen2_moe(impl):
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, experts_implementation=impl))


def qwen3_moe(impl):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, experts_implementation=impl))


def deepseek_v3(impl):
    """Shared expert, grouped top-k routing, a dense first layer, multi-head latent attention."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, experts_implementation=impl))


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def train(model, device: str) -> list[float]:
    return train_losses(model, device, vocab=VOCAB, lr=1e-2, shape=(2, 12), low=3)


def cases():
    for name in MODELS:
        for impl in IMPLEMENTATIONS:
            slow = (name, impl) not in {("mixtral", "grouped_mm"), ("deepseek_v3", "grouped_mm")}
            yield pytest.param(name, impl, id=f"{name}-{impl}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name,impl", list(cases()))
def test_moe_trains_and_generates_as_on_cpu(name, impl):
    torch.manual_seed(0)
    model = MODELS[name](impl)
    assert model.config._experts_implementation == impl
    reference = copy.deepcopy(model)
    cpu = train(reference, "cpu")
    neuron = train(model, "neuron")
    assert neuron == pytest.approx(cpu, rel=1e-4, abs=1e-4)
    assert len(set(neuron)) == len(neuron)  # the experts' weights did change
    for (key, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4, msg=key)

    prompt = torch.tensor([[5, 17, 42, 7, 9]])
    kwargs = dict(max_new_tokens=6, do_sample=False)
    expected = reference.eval().generate(prompt, **kwargs)
    actual = model.eval().generate(prompt.to("neuron"), **kwargs)
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_experts_run_without_a_host_fallback(impl):
    """The grouped_mm implementation (histc on int ids, _grouped_mm) stays on the device, and so
    does the eager loop over experts, whose routing is a data-dependent nonzero (a device
    compaction: tests/ops/test_data_dependent_shapes.py)."""
    import torchneuron

    torch.manual_seed(0)
    model = mixtral(impl).to("neuron")
    ids = torch.randint(3, VOCAB, (2, 12)).to("neuron")
    torchneuron.reset_fallback_counts()
    torchneuron.set_strict(True)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        torchneuron.set_strict(False)
    assert torchneuron.fallback_counts() == {}
