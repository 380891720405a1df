"""Serving diffusers pipelines on neuron: OpenAI images and vLLM-Omni video endpoints.

`pipelines` (a served pipeline, its limits, one batched call), `batching` (concurrent requests
into single calls), `media` (PNG, MP4), `app` (the FastAPI routes), `cost` (modeled Trainium
time per component), `cli` (`torchneuron serve-diffusion DIR`). Importing this package imports
neither FastAPI nor diffusers; its modules do.
"""
