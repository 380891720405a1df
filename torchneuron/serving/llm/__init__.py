"""The vLLM platform plugin `neuron`: vLLM's engine, scheduler and OpenAI server on neuron tensors.

Installed with the `serve` extra, the entry point `vllm.platform_plugins: neuron =
torchneuron.serving.llm:register` makes vLLM pick the neuron platform by itself (`LLM(dir)`,
`python -m vllm.entrypoints.openai.api_server --model DIR`, `torchneuron serve DIR`);
VLLM_TARGET_DEVICE=cpu still selects vLLM's own CPU platform.

Modules: platform (the Platform vLLM asks), worker (worker and model runner on neuron:<rank>),
attention (the paged-attention backend), kernels (the device kernels behind attention and the
fused layers), layers (vLLM's fused layers as neuron kernels), communicator (tensor parallelism
over the neuron c10d backend), timing (modeled Trainium time per request), server (the
`torchneuron serve` command and its usage/metrics middleware).
"""
from __future__ import annotations


def register() -> str | None:
    """vLLM's platform-plugin hook: the qualified name of the neuron Platform."""
    return "torchneuron.serving.llm.platform.NeuronPlatform"
