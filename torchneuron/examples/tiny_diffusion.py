"""Tiny diffusers pipelines built from configs with random weights (no downloads).

Three pipeline families, each the smallest configuration diffusers accepts that still
exercises every component kind of the real model:

- `unet`: Stable-Diffusion-style text-to-image (CLIP text encoder, UNet2DConditionModel,
  AutoencoderKL), DDIM by default;
- `dit`: PixArt-alpha-style text-to-image (T5 encoder, PixArtTransformer2DModel), DDIM;
- `video`: Wan-style text-to-video (UMT5 encoder, WanTransformer3DModel, 3-D AutoencoderKLWan),
  flow-matching Euler.

The tokenizers are built in memory: a CLIP byte-level BPE over printable ASCII (no merges)
and a T5 unigram over the same characters. `python -m torchneuron.examples.tiny_diffusion
KIND DIR` writes one pipeline as a diffusers directory that `torchneuron serve-diffusion DIR`
serves. Weights come from `torch.manual_seed(seed)`, so two builds are identical.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import torch

__all__ = ["KINDS", "SCHEDULERS", "build_pipeline", "clip_tokenizer", "t5_tokenizer", "make_scheduler"]

KINDS = ("unet", "dit", "video")
SCHEDULERS = ("ddim", "euler", "flow")
_CHARS = [chr(c) for c in range(33, 127)]  # printable ASCII: byte-level BPE maps these to themselves


def clip_tokenizer(max_length: int = 16) -> Any:
    """A CLIP tokenizer whose vocabulary is the printable ASCII characters (word-final and not)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for char in _CHARS:
            vocab[char + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int = 16) -> Any:
    """A T5 (unigram) tokenizer over printable ASCII, with and without the word-start marker."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in _CHARS] + [("\u2581" + c, -2.5) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def make_scheduler(name: str, *, prediction_type: str = "epsilon") -> Any:
    """A fresh scheduler: `ddim`, `euler` (discrete, epsilon) or `flow` (flow-matching Euler)."""
    import diffusers

    if name == "ddim":
        return diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                       clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                                       prediction_type=prediction_type)
    if name == "euler":
        return diffusers.EulerDiscreteScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", steps_offset=1,
                                                prediction_type=prediction_type)
    if name == "flow":
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    raise ValueError(f"unknown scheduler {name!r}: choose one of {SCHEDULERS}")


def _clip_text_encoder(vocab_size: int, max_length: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_hidden_layers=2,
                            max_position_embeddings=max_length, bos_token_id=0, eos_token_id=1,
                            pad_token_id=1)
    return CLIPTextModel(config).eval()


def _t5_encoder(cls_name: str, vocab_size: int) -> Any:
    import transformers

    config_cls = transformers.UMT5Config if cls_name == "UMT5EncoderModel" else transformers.T5Config
    config = config_cls(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0)
    return getattr(transformers, cls_name)(config).eval()


def _sd_vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                         block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=32,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32).eval()


def _unet_pipeline(scheduler: str, max_length: int) -> Any:
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    tokenizer = clip_tokenizer(max_length)
    unet = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), norm_num_groups=32,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=32, attention_head_dim=8).eval()
    return StableDiffusionPipeline(vae=_sd_vae(), text_encoder=_clip_text_encoder(len(tokenizer), max_length),
                                   tokenizer=tokenizer, unet=unet, scheduler=make_scheduler(scheduler),
                                   safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def _dit_pipeline(scheduler: str, max_length: int) -> Any:
    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel

    tokenizer = t5_tokenizer(max_length)
    transformer = PixArtTransformer2DModel(
        sample_size=16, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=4,
        caption_channels=32, in_channels=4, out_channels=8, cross_attention_dim=32,
        attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
        norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6).eval()
    return PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=_t5_encoder("T5EncoderModel", len(tokenizer)),
                               vae=_sd_vae(), transformer=transformer, scheduler=make_scheduler(scheduler))


def _video_pipeline(scheduler: str, max_length: int) -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer(max_length)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    return WanPipeline(tokenizer=tokenizer, text_encoder=_t5_encoder("UMT5EncoderModel", len(tokenizer)),
                       vae=vae, transformer=transformer, scheduler=make_scheduler(scheduler))


_BUILDERS = {"unet": (_unet_pipeline, "ddim"), "dit": (_dit_pipeline, "ddim"), "video": (_video_pipeline, "flow")}


def build_pipeline(kind: str, *, scheduler: str | None = None, seed: int = 0, max_length: int = 16) -> Any:
    """A tiny pipeline of `kind` (`unet`, `dit`, `video`) on the CPU, weights from `seed`.

    `max_length` is the tokenizer's (and CLIP's position table's) limit, kept small so long
    prompts are easy to test."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown pipeline kind {kind!r}: choose one of {KINDS}")
    builder, default_scheduler = _BUILDERS[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = builder(scheduler or default_scheduler, max_length)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write a tiny random-weight diffusers pipeline to DIR")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("directory")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build_pipeline(args.kind, scheduler=args.scheduler, seed=args.seed).save_pretrained(args.directory)
    print(f"wrote a tiny {args.kind} pipeline to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
