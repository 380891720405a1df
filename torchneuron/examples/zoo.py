"""The model zoo: tiny transformers-5 models of the families people train, each with its inputs.

This module owns the catalogue (`MODELS`, `get`): for every model, a builder from a config with
random weights (nothing is downloaded), the training batch it learns from (with labels, so the
model returns its loss), and its inference call (`generate`, or the forward pass for encoders
such as SigLIP). Images and audio features are tensors built here; token ids stand in for a
tokenizer's output. Running a model (training steps, modeled step time) is `zoo_run.py`.

Families: text (Llama, Qwen3, Gemma 3, Phi-3, GPT-OSS, DeepSeek-V3 with MLA), vision-language
(Qwen2-VL, LLaVA, SigLIP), state-space (Mamba2, Jamba, Falcon-Mamba), audio (Whisper).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["FAMILIES", "MODELS", "ZooModel", "get"]

VOCAB = 96
BATCH, SEQ = 2, 12
# pad 0, bos 1, eos 2: training and prompt tokens are drawn from 3.. so generation never stops early
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)
PROMPT = [5, 17, 42, 7, 9]


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: how to build it, what it trains on, how it infers."""

    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]  # training inputs (CPU), labels included
    prompt: Callable[[], dict[str, torch.Tensor]]  # inference inputs (CPU)
    infer: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]  # tokens, or the outputs compared
    tokens: Callable[[dict[str, torch.Tensor]], int]  # tokens a training batch holds (for tokens/s)
    generates: bool = True  # `infer` returns token ids (compared exactly); False: float outputs


def _transformers():
    import transformers

    return transformers


def _ids(gen: torch.Generator, shape: tuple[int, int] = (BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=gen)


def _lm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _ids(gen)
    return {"input_ids": ids, "labels": ids}


def _lm_prompt() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([PROMPT])}


def _generate(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return model.generate(**inputs, max_new_tokens=6, do_sample=False)


def _ids_count(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].numel()


def _text(name: str, build: Callable[[], torch.nn.Module]) -> ZooModel:
    return ZooModel(name, "text", build, _lm_batch, _lm_prompt, _generate, _ids_count)


# ---- text ----------------------------------------------------------------------------------------
def llama() -> torch.nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(**TEXT))


def qwen3() -> torch.nn.Module:
    t = _transformers()
    return t.Qwen3ForCausalLM(t.Qwen3Config(**TEXT, head_dim=8))


def gemma3() -> torch.nn.Module:
    """Sliding-window and global layers, query/key norms, soft-capped logits, tied embeddings."""
    t = _transformers()
    return t.Gemma3ForCausalLM(t.Gemma3TextConfig(
        **TEXT, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0))


def phi3() -> torch.nn.Module:
    t = _transformers()
    return t.Phi3ForCausalLM(t.Phi3Config(**TEXT, resid_pdrop=0.0, embd_pdrop=0.0))


def gpt_oss(experts: str | None = None) -> torch.nn.Module:
    """Mixture of experts with attention sinks and alternating sliding/full attention."""
    t = _transformers()
    extra = {} if experts is None else {"experts_implementation": experts}
    return t.GptOssForCausalLM(t.GptOssConfig(
        **TEXT, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], **extra))


def deepseek_v3(experts: str | None = None) -> torch.nn.Module:
    """Multi-head latent attention, a dense first layer, shared and grouped top-k routed experts."""
    t = _transformers()
    extra = {} if experts is None else {"experts_implementation": experts}
    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **{**TEXT, "num_key_value_heads": 4, "intermediate_size": 48}, moe_intermediate_size=16,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, **extra))


# ---- vision-language -----------------------------------------------------------------------------
IMAGE_TOKEN = VOCAB - 1  # token ids the vision features replace
QWEN_GRID = (1, 4, 4)  # temporal, height, width patches of one image: 16 patches, 4 tokens after the 2x2 merge
QWEN_PATCH, QWEN_TEMPORAL = 2, 2


def qwen2_vl() -> torch.nn.Module:
    t = _transformers()
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}
    vision = dict(depth=2, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=2, mlp_ratio=2,
                  patch_size=QWEN_PATCH, temporal_patch_size=QWEN_TEMPORAL, spatial_merge_size=2)
    return t.Qwen2VLForConditionalGeneration(t.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4))


def _qwen_inputs(gen: torch.Generator, text: torch.Tensor) -> dict[str, torch.Tensor]:
    """`text` rows prefixed with one image each: the image's patches as Qwen2-VL's processor lays them out."""
    n_tokens = QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2] // 4
    rows = text.shape[0]
    image = torch.full((rows, n_tokens), IMAGE_TOKEN)
    start, end = torch.full((rows, 1), VOCAB - 3), torch.full((rows, 1), VOCAB - 4)
    ids = torch.cat([start, image, end, text], dim=1)
    patches = rows * QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2]
    pixels = torch.randn(patches, 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH, generator=gen)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor([QWEN_GRID] * rows),
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


def _qwen_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    inputs = _qwen_inputs(gen, torch.randint(3, VOCAB - 4, (BATCH, 8), generator=gen))
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] >= VOCAB - 4, -100)  # no loss on the image
    return {**inputs, "labels": labels}


def _qwen_prompt() -> dict[str, torch.Tensor]:
    return _qwen_inputs(torch.Generator().manual_seed(2), torch.tensor([PROMPT]))


LLAVA_IMAGE, LLAVA_PATCH = 8, 4  # 8x8 images in 4x4 patches: 4 image tokens (the class token is dropped)


def llava() -> torch.nn.Module:
    t = _transformers()
    vision = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=LLAVA_IMAGE, patch_size=LLAVA_PATCH)
    return t.LlavaForConditionalGeneration(t.LlavaConfig(
        vision_config=vision, text_config=t.LlamaConfig(**TEXT), image_token_index=IMAGE_TOKEN,
        image_seq_length=(LLAVA_IMAGE // LLAVA_PATCH) ** 2, vision_feature_layer=-1))


def _llava_inputs(gen: torch.Generator, text: torch.Tensor) -> dict[str, torch.Tensor]:
    rows = text.shape[0]
    image = torch.full((rows, (LLAVA_IMAGE // LLAVA_PATCH) ** 2), IMAGE_TOKEN)
    return {"input_ids": torch.cat([image, text], dim=1),
            "pixel_values": torch.randn(rows, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=gen)}


def _llava_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    inputs = _llava_inputs(gen, torch.randint(3, VOCAB - 1, (BATCH, 8), generator=gen))
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["input_ids"] == IMAGE_TOKEN, -100)}


def _llava_prompt() -> dict[str, torch.Tensor]:
    return _llava_inputs(torch.Generator().manual_seed(2), torch.tensor([PROMPT]))


SIGLIP_IMAGE = 8


def siglip() -> torch.nn.Module:
    t = _transformers()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return t.SiglipModel(t.SiglipConfig(
        text_config=dict(common, vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0),
        vision_config=dict(common, image_size=SIGLIP_IMAGE, patch_size=4)))


def _siglip_inputs(gen: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(3, VOCAB, (rows, 8), generator=gen),
            "pixel_values": torch.randn(rows, 3, SIGLIP_IMAGE, SIGLIP_IMAGE, generator=gen)}


def _siglip_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_siglip_inputs(gen, 4), "return_loss": True}  # the sigmoid contrastive loss over 4 pairs


def _siglip_prompt() -> dict[str, torch.Tensor]:
    return _siglip_inputs(torch.Generator().manual_seed(2), 3)


def _siglip_infer(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits_per_image


# ---- state-space ---------------------------------------------------------------------------------
def mamba2() -> torch.nn.Module:
    t = _transformers()
    return t.Mamba2ForCausalLM(t.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=16, n_groups=2,
        expand=2, conv_kernel=4, chunk_size=8, **SPECIAL))


def jamba() -> torch.nn.Module:
    """Hybrid: a Mamba layer then an attention layer, mixture-of-experts MLP on the second."""
    t = _transformers()
    return t.JambaForCausalLM(t.JambaConfig(
        **TEXT, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, mamba_expand=2))


def falcon_mamba() -> torch.nn.Module:
    t = _transformers()
    return t.FalconMambaForCausalLM(t.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        use_mambapy=False, tie_word_embeddings=False, **SPECIAL))


# ---- audio ---------------------------------------------------------------------------------------
MELS, FRAMES = 16, 32  # log-mel features of a clip; the encoder's two convolutions halve the frames


def whisper() -> torch.nn.Module:
    t = _transformers()
    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=4, decoder_layers=2,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32,
        max_source_positions=FRAMES // 2, max_target_positions=32, decoder_start_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None, tie_word_embeddings=False, **SPECIAL))


def _whisper_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(BATCH, MELS, FRAMES, generator=gen), "labels": _ids(gen, (BATCH, 8))}


def _whisper_prompt() -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(1, MELS, FRAMES, generator=torch.Generator().manual_seed(2))}


def _labels_count(batch: dict[str, torch.Tensor]) -> int:
    return batch["labels"].numel()


MODELS: dict[str, ZooModel] = {m.name: m for m in [
    _text("llama", llama),
    _text("qwen3", qwen3),
    _text("gemma3", gemma3),
    _text("phi3", phi3),
    _text("gpt_oss", gpt_oss),
    _text("deepseek_v3", deepseek_v3),
    ZooModel("qwen2_vl", "vision-language", qwen2_vl, _qwen_batch, _qwen_prompt, _generate, _ids_count),
    ZooModel("llava", "vision-language", llava, _llava_batch, _llava_prompt, _generate, _ids_count),
    ZooModel("siglip", "vision-language", siglip, _siglip_batch, _siglip_prompt, _siglip_infer, _ids_count,
             generates=False),
    ZooModel("mamba2", "state-space", mamba2, _lm_batch, _lm_prompt, _generate, _ids_count),
    ZooModel("jamba", "state-space", jamba, _lm_batch, _lm_prompt, _generate, _ids_count),
    ZooModel("falcon_mamba", "state-space", falcon_mamba, _lm_batch, _lm_prompt, _generate, _ids_count),
    ZooModel("whisper", "audio", whisper, _whisper_batch, _whisper_prompt, _generate, _labels_count),
]}
FAMILIES = ("text", "vision-language", "state-space", "audio")


def get(name: str) -> ZooModel:
    """The zoo model called `name`; a clear error listing the names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"no zoo model {name!r}: choose one of {', '.join(MODELS)}") from None
