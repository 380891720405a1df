"""The KV cache is sized against the device: one that cannot fit is a clear error at start."""
from __future__ import annotations

import gc

import torch

from tests.serving.engine import in_process_llm


def test_kv_cache_larger_than_the_device_is_refused_at_start(tiny_model):
    model = tiny_model("llama", torch.float32)
    capacity = torch.neuron.get_device_properties(0).total_memory
    message = ""
    try:
        with in_process_llm(model, dtype="float32", kv_cache_memory_bytes=2 * capacity):
            pass
    except Exception as e:  # noqa: BLE001  (vLLM may wrap the worker's error)
        message = str(e)
    gc.collect()  # the failed engine's model must not be freed during the next module's memory profile
    torch.neuron.empty_cache()
    assert "exceeds the free memory of neuron:0" in message
