"""Tiny random-weight HF model directories (config, safetensors, tokenizer) built locally.

The tokenizer is a byte-level BPE trained with the `tokenizers` library on a few strings and saved
as a HF tokenizer with a chat template, so vLLM, transformers and the OpenAI server load the
directory exactly as a downloaded one (nothing comes from the hub).
"""
from __future__ import annotations

import os

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Trainium serves large language models with vLLM on the neuron device.",
    "Paged attention reads the KV cache block by block from a block table.",
    "Hello, how are you today? I am fine, thank you very much!",
    "0123456789 one two three four five six seven eight nine ten",
    "system user assistant: answer briefly and clearly.",
] * 8
VOCAB = 384
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(kind: str):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if kind == "qwen3":
        return transformers.Qwen3Config(**_COMMON)
    if kind == "qwen2":
        return transformers.Qwen2Config(**{k: v for k, v in _COMMON.items() if k != "head_dim"})
    if kind == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=None)
    if kind == "mixtral":
        return transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"unknown tiny model kind {kind!r}")


def _tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def build(directory: str, kind: str = "llama", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """Writes a tiny `kind` model (llama, qwen2, qwen3, mistral, mixtral) into `directory`."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    config = _config(kind)
    config.dtype = dtype
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # larger weights than the default init: greedy tokens then vary with context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer(directory)
    return directory
