"""Deterministic random Gemma 4 checkpoints for tests (``Gemma4ForConditionalGeneration``
with a vision tower; ``gemma4_audio`` adds an audio tower, as E2B / E4B have).

Written from transformers' own config classes, loadable offline by transformers and vlmd:
``config.json``, ``model.safetensors`` (float32), a Gemma-style tokenizer
(``vlmd/tiny/gemma_tokenizer.py``: SentencePiece-style BPE with byte fallback, single-token
newline runs) with Gemma 4's turn and media tokens and a chat template in Gemma 4's turn
format, ``preprocessor_config.json`` / ``processor_config.json`` (the PIL image processor's
settings: 4-px patches, a budget of 140 soft tokens an image) and ``vlmd_tiny.json``.

The tiny decoder keeps what makes Gemma 4 different, at sizes that make tests exercise it:
six layers, sliding, sliding, full, sliding | sliding, full, the last two reading the K/V of
layers 3 and 2 (``num_kv_shared_layers=2``) with double-wide MLPs; a 24-token window
(shorter than a test prompt, not a multiple of a KV block); heads of 32 on windowed layers
and 64 on full ones, where RoPE is proportional (a quarter of each head rotates); per-layer
embeddings of 16 per layer; each layer's ``layer_scalar`` drawn (a checkpoint's are not 1);
a soft-capped output, untied from the embeddings (a tied random model only repeats its input
token). The tower: two layers of 32, 4-px patches pooled 3 x 3, its standardization drawn.
The audio variant (``AUDIO``, its own builder so the other checkpoints stay byte-identical):
two conformer layers of 32 over the feature extractor's real 128 mel bins, the attention
window of every checkpoint (12 positions back, in chunks of 12: a test clip's 25 positions a
second run past it), a soft cap of 5 (reached by random weights), an output width of 48 (not
the decoder's 64), and every linear's clamp bounds drawn near +-1.5 (they clamp).
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.gemma_tokenizer import CORE_SPECIAL_TOKENS, build_gemma_tokenizer
from vlmd.tiny.weights import StdRule, init_buffers, random_model

__all__ = ["AUDIO", "GEMMA4_CHAT_TEMPLATE", "MOE_TEXT", "SIZES", "build_tiny_gemma4", "build_tiny_gemma4_audio",
           "build_tiny_gemma4_moe", "gemma4_config"]

# Gemma 4's turn and media-boundary tokens (after the core five), and its soft tokens.
LEADING_SPECIAL_TOKENS = (*CORE_SPECIAL_TOKENS, "<|turn>", "<turn|>", "<|image>", "<image|>", "<|audio>", "<audio|>")
TRAILING_SPECIAL_TOKENS = ("<|image|>", "<|audio|>", "<|video|>")
SPECIAL_TOKENS = (*LEADING_SPECIAL_TOKENS, *TRAILING_SPECIAL_TOKENS)
MEDIA_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "text": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=24,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention", "sliding_attention", "full_attention"],
                     num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
                     max_position_embeddings=4096, final_logit_softcapping=30.0),
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                       position_embedding_size=512, standardize=True, rms_norm_eps=1e-6),
        "max_soft_tokens": 140,
    },
    # ~104M parameters, after E2B's layout in miniature (the side by side with vLLM-CPU): 12
    # layers, five sliding (512-token window) to one global, the last six reading layers 4
    # and 5's K/V with double-wide MLPs; one K/V head of 256 on sliding layers and of 512 on
    # global ones (both sizes vLLM's CPU attention takes); per-layer embeddings of 64. The
    # tower: six layers of 384 (heads of 64), 16-px patches pooled 3 x 3, 280 soft tokens an
    # image (a 640x480 image costs 266), ``default_output_length`` (what vLLM sizes an
    # image's placeholders by) equal to the processor's budget.
    "small": {
        "vocab_size": 8192,
        "text": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                     layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
                     num_kv_shared_layers=6, use_double_wide_mlp=True, hidden_size_per_layer_input=64,
                     max_position_embeddings=8192, final_logit_softcapping=30.0),
        "vision": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                       num_key_value_heads=6, head_dim=64, patch_size=16, pooling_kernel_size=3,
                       position_embedding_size=1024, standardize=True, rms_norm_eps=1e-6,
                       default_output_length=280),
        "max_soft_tokens": 280,
    },
}
# The mixture-of-experts variant (``gemma4_moe``, after 26B-A4B: routed experts and full layers
# whose values are their keys, with their own K/V head count): 4 experts of 48, 2 a token; one
# K/V head on full layers.
MOE_TEXT = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48,
            "attention_k_eq_v": True, "num_global_key_value_heads": 1}

# The audio tower of ``gemma4_audio`` (module docstring); the first subsampling convolution has as
# many channels as there are mel bins (transformers sizes the projection by it).
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
             conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
             attention_logit_cap=5.0, output_proj_dims=48, hidden_act="silu", use_clipped_linears=True)
FEATURE_EXTRACTOR = {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
                     "sampling_rate": 16000, "padding_value": 0.0, "frame_length_ms": 20.0, "hop_length_ms": 10.0,
                     "min_frequency": 0.0, "max_frequency": 8000.0, "mel_floor": 0.001}

# A chat template in Gemma 4's turn format: <bos>, then "<|turn>{role}\n{content}<turn|>\n"
# per message (the assistant's role is "model"), an image, audio or video part as its soft token.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|image|>' }}"
    "{%- elif item['type'] == 'audio' -%}{{ '<|audio|>' }}"
    "{%- elif item['type'] == 'video' -%}{{ '<|video|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<turn|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"
)

_EXTRA_WORDS = ("user", "model", "system", "What", "Write", "Describe", "the", "and", "is", "sea", "poem")


def _build_tokenizer(seed: int, vocab_size: int):
    return build_gemma_tokenizer(
        seed=seed, vocab_size=vocab_size, extra_words=_EXTRA_WORDS,
        leading_special=LEADING_SPECIAL_TOKENS, trailing_special=TRAILING_SPECIAL_TOKENS,
        tokenizer_kwargs=dict(
            bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
            extra_special_tokens=MEDIA_TOKENS, model_max_length=32768, padding_side="left",
            clean_up_tokenization_spaces=False, chat_template=GEMMA4_CHAT_TEMPLATE,
        ),
    )


def gemma4_config(size: str, *, vocab_size: int, ids: dict[str, int], text_overrides: dict | None = None,
                  audio_config: dict | None = None):
    from transformers import Gemma4Config

    spec = SIZES[size]
    config = Gemma4Config(
        text_config=dict(
            vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000.0}},
            bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
            tie_word_embeddings=False, **{**spec["text"], **(text_overrides or {})},
        ),
        vision_config=dict(spec["vision"]), audio_config=audio_config,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"], tie_word_embeddings=False,
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


_COMMON_STD = StdRule()


def _buffer_scale(name: str) -> tuple[float, float] | None:
    """(mean, std) of the checkpoint buffers the builder draws (``init_buffers``)."""
    if name.endswith(".layer_scalar"):
        return 1.0, 0.15
    if name.endswith("vision_tower.std_bias"):
        return 0.0, 0.1
    if name.endswith("vision_tower.std_scale"):
        return 1.0, 0.1
    if name.endswith(("input_min", "output_min")):
        return -1.5, 0.2
    if name.endswith(("input_max", "output_max")):
        return 1.5, 0.2
    return None


def _param_std(name: str, shape: tuple[int, ...], is_norm: bool) -> tuple[float, float]:
    """vlmd.tiny.weights' common rule, but Gemma 4's RMSNorms scale by ``w`` (not 1 + w):
    their weights are N(1, 0.1), as the router's scales; an expert tensor's fan-in is its
    last dimension."""
    if "norm" in name and name.endswith("weight") and len(shape) == 1:
        return 1.0, 0.1
    if name.endswith(("router.scale", "router.per_expert_scale")):
        return 1.0, 0.1
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, out, in]: fan-in is the last
        return 0.0, 1.0 / math.sqrt(shape[-1])
    return _COMMON_STD(name, shape, is_norm)


def build_tiny_gemma4(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Gemma 4 checkpoint into ``out_dir`` and return its path."""
    return _build(out_dir, seed, size, "gemma4", {})


def build_tiny_gemma4_moe(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """The same with routed experts beside every layer's MLP (``MOE_TEXT``)."""
    return _build(out_dir, seed, size, "gemma4_moe", MOE_TEXT)


def build_tiny_gemma4_audio(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """The same with an audio tower (``AUDIO``) and the feature extractor's settings."""
    return _build(out_dir, seed, size, "gemma4_audio", {}, audio=AUDIO)


def _build(out_dir, seed: int, size: str, family: str, text_overrides: dict, audio: dict | None = None) -> Path:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import Gemma4ForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = gemma4_config(size, vocab_size=len(tokenizer), ids=ids, text_overrides=text_overrides, audio_config=audio)
    model = random_model(Gemma4ForConditionalGeneration, config, seed, _param_std, sorted(ids.values()))
    # Each layer's output scale around 1 and the tower's standardization, drawn from the seed
    # (transformers builds them at 1 and 0: a loader that dropped them would pass unseen).
    init_buffers(model, seed + 1, _buffer_scale)
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<eos>"], ids["<turn|>"]]
    save_checkpoint(model, out, ids["<bos>"], eos_ids, ids["<pad>"])
    write_tokenizer(out, tokenizer, GEMMA4_CHAT_TEMPLATE, extra_special_tokens=MEDIA_TOKENS)
    image = {"image_processor_type": "Gemma4ImageProcessorPil", "do_convert_rgb": True, "do_resize": True,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "resample": 3,
             "patch_size": spec["vision"]["patch_size"], "pooling_kernel_size": spec["vision"]["pooling_kernel_size"],
             "max_soft_tokens": spec["max_soft_tokens"]}
    write_json(out / "preprocessor_config.json", {**image, "processor_class": "Gemma4Processor"})
    # The video processor's (Gemma4VideoProcessor): frames through the same tower at their own
    # budget (70, its default), 32 frames spread over a video unless the server says otherwise.
    video = {"video_processor_type": "Gemma4VideoProcessor", "do_convert_rgb": True, "do_resize": True,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.0, 0.0, 0.0],
             "image_std": [1.0, 1.0, 1.0], "resample": 3, "do_sample_frames": True, "num_frames": 32,
             "patch_size": spec["vision"]["patch_size"], "pooling_kernel_size": spec["vision"]["pooling_kernel_size"],
             "max_soft_tokens": 70}
    processor = {"processor_class": "Gemma4Processor", "image_processor": image, "video_processor": video}
    if audio is not None:
        processor.update(feature_extractor=FEATURE_EXTRACTOR, audio_seq_length=750, audio_ms_per_token=40)
    write_json(out / "processor_config.json", processor)
    text = spec["text"]
    write_json(out / "vlmd_tiny.json", {
        "family": family, "size": size, "seed": int(seed), "num_parameters": int(num_params),
        "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<pad>"],
        "sliding_window": text["sliding_window"], "num_kv_shared_layers": text["num_kv_shared_layers"],
        "head_dims": [text["head_dim"], text["global_head_dim"]], "max_soft_tokens": spec["max_soft_tokens"],
        "num_experts": text_overrides.get("num_experts"),
        "attention_k_eq_v": bool(text_overrides.get("attention_k_eq_v")),
        "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"],
        "video_token_id": ids["<|video|>"],
        **({"audio_token_id": ids["<|audio|>"], "boa_token_id": ids["<|audio>"], "eoa_token_id": ids["<audio|>"]}
           if audio is not None else {}),
    })
    return out
