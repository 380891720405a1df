"""torchneuron.serving: inference servers on the neuron device.

`llm/` is the vLLM platform plugin `neuron` (vLLM's engine and OpenAI server on neuron tensors);
`diffusion/` serves diffusers pipelines (OpenAI's images API, vLLM-Omni's videos API).
"""
