"""The main job: train a small Llama-style model on the neuron device and report the results.

The model is built from a transformers config with random weights (no downloads); the data is a
synthetic next-token task with learnable structure, so the loss visibly falls.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm


def tiny_llama_config(vocab: int = 256):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False)


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token sequences that count upward from a random start: the next token is predictable."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(seq)) % vocab


def main(steps: int = 30, batch: int = 8, seq: int = 64, device: str = "neuron") -> int:
    from transformers import LlamaForCausalLM

    import torchneuron
    from torchneuron.hardware import estimate, get_target

    torch.manual_seed(0)
    config = tiny_llama_config()
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data_rng = torch.Generator().manual_seed(0)
    torchneuron.reset_fallback_counts()
    params = sum(p.numel() for p in model.parameters())
    print(f"Training a {params / 1e6:.2f}M-parameter Llama on {device} (modeled target {get_target().name}), "
          f"{steps} steps of {batch}x{seq} tokens")
    losses: list[float] = []
    start = time.perf_counter()
    with estimate() as modeled:
        for _ in tqdm(range(steps), desc="train", unit="step"):
            ids = synthetic_batch(batch, seq, config.vocab_size, data_rng).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    host_seconds = time.perf_counter() - start
    fallbacks = torchneuron.fallback_counts()
    print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f}")
    print(f"host throughput: {steps * batch * seq / host_seconds:,.0f} tokens/s ({host_seconds / steps * 1e3:.1f} ms/step)")
    print(f"modeled {get_target().name} device time: {modeled.device_time_s / steps * 1e3:.3f} ms/step, "
          f"MFU {modeled.mfu * 100:.1f}%")
    print(f"CPU fallbacks: {sum(fallbacks.values())} calls" + (f" ({', '.join(sorted(fallbacks))})" if fallbacks else ""))
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
