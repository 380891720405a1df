"""torchneuron.serving: inference servers on the neuron device.

`llm/` is the vLLM platform plugin `neuron` (vLLM's engine and OpenAI server on neuron tensors).
"""
