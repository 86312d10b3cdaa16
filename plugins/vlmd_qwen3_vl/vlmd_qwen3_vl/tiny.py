"""Deterministic random Qwen3-VL checkpoints for tests (``Qwen3VLForConditionalGeneration``).

Built from transformers' own config classes, so the checkpoint has the real architecture:
a ViT over 16-px patches of frame pairs with learned positions (interpolated to each grid),
2D RoPE, a 2x2 merger and one DeepStack merger per ``deepstack_visual_indexes`` entry; a
Qwen3 text model (q/k RMSNorm per head, GQA) with interleaved M-RoPE. Written to ``out_dir``:
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers 5
names), the tokenizer (Qwen2-VL's tiny one: the same special tokens) with Qwen3-VL's chat
template for text, images and video, the image and video processors' configs and
``vlmd_tiny.json``. Pixel limits are small (4..64 tokens an image; a video's frames together
8..256 32-px cells, at most 128 tokens).
"""

from __future__ import annotations

from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model
from vlmd_qwen2_vl.tiny import SPECIAL_TOKENS, build_tokenizer

__all__ = ["SIZES", "build_checkpoint", "build_tiny_qwen3_vl", "config_fields", "qwen3_vl_config"]

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 32: resized sides are multiples of this
IMAGE_MIN_PIXELS = 4 * FACTOR * FACTOR
IMAGE_MAX_PIXELS = 64 * FACTOR * FACTOR
# Qwen3VLVideoProcessor's limits bound all of a video's frames together.
VIDEO_MIN_PIXELS = 8 * FACTOR * FACTOR
VIDEO_MAX_PIXELS = 256 * FACTOR * FACTOR
HALF = [0.5, 0.5, 0.5]
# Low, as the Qwen2-VL tiny's (see there): every M-RoPE row turns by radians across an image.
ROPE_THETA = 100.0

# Qwen3-VL-Instruct's chat template for text, images and video (its tool and reasoning branches left
# out): no default system turn, content parts in order.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# vlmd.tiny.weights' rule; the learned position embeddings at unit scale, the vision
# attention's fused qkv and the patch embedding sharp like q/k, and the mergers (the main one
# and DeepStack's) putting image features on the scale of token embeddings.
PARAM_STD = StdRule(fixed=[(("pos_embed.weight",), 0.0, 1.0)],
                    gains=[(("attn.qkv.weight", "patch_embed.proj.weight", "merger"), 1.0)])

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 1]),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
        "mrope_section": [2, 3, 3],  # sums to head_dim / 2 = 8
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(depth=8, hidden_size=384, intermediate_size=1536, num_heads=6, num_position_embeddings=576,
                       deepstack_visual_indexes=[2, 4, 6]),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
                     num_key_value_heads=4, head_dim=64, max_position_embeddings=8192),
        "mrope_section": [12, 10, 10],  # head_dim 64
    },
}


def config_fields(spec: dict, *, vocab_size: int, ids: dict[str, int], rope: dict | None = None) -> dict:
    """The fields of a Qwen3-VL-style config at ``spec``'s sizes (text and vision configs,
    special token ids), with ``rope`` added to the text rotary's parameters (Qwen3.5's
    partial rotary)."""
    return dict(
        text_config=dict(
            vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": spec["mrope_section"],
                             "mrope_interleaved": True, **(rope or {})},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            **spec["text"],
        ),
        vision_config=dict(
            hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=spec["text"]["hidden_size"], **spec["vision"],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def qwen3_vl_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``Qwen3VLConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(**config_fields(SIZES[size], vocab_size=vocab_size, ids=ids))
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def write_processor_files(out: Path, tokenizer) -> None:
    """The tokenizer with Qwen3-VL's template, and the processors' configs: the
    ``Qwen2VLImageProcessor`` Qwen3-VL checkpoints name, at 16-px patches, mean = std = 0.5,
    and the ``Qwen3VLVideoProcessor`` (written as JSON: its class needs torchvision to run)."""
    write_tokenizer(out, tokenizer, CHAT_TEMPLATE,
                    extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
                    additional_special_tokens=SPECIAL_TOKENS[1:])
    image = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": HALF, "image_std": HALF, "merge_size": MERGE_SIZE, "patch_size": PATCH_SIZE,
        "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "size": {"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": IMAGE_MAX_PIXELS},
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    video = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": HALF, "image_std": HALF, "merge_size": MERGE_SIZE, "patch_size": PATCH_SIZE,
        "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    write_json(out / "preprocessor_config.json", {**image, "processor_class": "Qwen3VLProcessor"})
    write_json(out / "video_preprocessor_config.json", {**video, "processor_class": "Qwen3VLProcessor"})
    write_json(out / "processor_config.json", {"processor_class": "Qwen3VLProcessor", "image_processor": image,
                                               "video_processor": video})


def build_tiny_qwen3_vl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen3-VL checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")

    def dense(vocab_size: int, ids: dict[str, int]):
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration, qwen3_vl_config(size, vocab_size=vocab_size, ids=ids), PARAM_STD

    return build_checkpoint(out_dir, seed, size, "qwen3_vl", dense)


def build_checkpoint(out_dir, seed: int, size: str, family: str, make_model) -> Path:
    """The tokenizer, the weights of ``make_model(vocab_size, ids)`` -> (model class, config,
    weight rule), the processor files and ``vlmd_tiny.json`` of a Qwen3-VL checkpoint (dense
    or, ``tiny_moe.py``, with experts)."""
    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed, spec["vocab_size"], CHAT_TEMPLATE)
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    model_class, config, rule = make_model(len(tokenizer), ids)

    model = random_model(model_class, config, seed, rule, sorted(ids.values()))
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    save_checkpoint(model, out, ids["<|endoftext|>"], eos_ids, ids["<|endoftext|>"])
    write_processor_files(out, tokenizer)
    write_json(out / "vlmd_tiny.json", {
        "family": family, "size": size, "seed": int(seed),
        "num_parameters": int(sum(p.numel() for p in model.parameters())), "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "image_min_pixels": IMAGE_MIN_PIXELS,
        "image_max_pixels": IMAGE_MAX_PIXELS, "video_min_pixels": VIDEO_MIN_PIXELS, "video_max_pixels": VIDEO_MAX_PIXELS,
    })
    return out
