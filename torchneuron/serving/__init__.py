"""Inference on the neuron device: the vLLM platform plugin and the diffusion pipelines' server."""
