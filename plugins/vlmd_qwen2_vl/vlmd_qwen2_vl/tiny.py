"""Deterministic random Qwen2-VL checkpoints for tests (``Qwen2VLForConditionalGeneration``).

Layout written to ``out_dir`` (byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers 5 names)
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
* ``processor_config.json`` (transformers 5), ``preprocessor_config.json`` (image processor, also
  what transformers 4.x reads) and ``video_preprocessor_config.json`` (video processor)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

Architecture as Qwen2-VL: a ViT with 2D rotary attention over 14-px patches of frame pairs
(temporal patch 2), a 2x2 patch merger into the text width, and a Qwen2 text model (q/k/v bias,
GQA) with M-RoPE (``mrope_section`` splits the rotary dims among time, height and width).
Pixel limits are small (images 4..128 merged tokens, video frames 4..64) so tests stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmd.tiny.checkpoint_io import restamp_json, save_model, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model

__all__ = [
    "PARAM_STD", "QWEN2_VL_CHAT_TEMPLATE", "SIZES", "build_qwen_vl_checkpoint", "build_tiny_qwen2_vl",
    "build_tokenizer", "processor_settings", "qwen2_vl_config", "write_processor_files",
]

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: resized sides are multiples of this
IMAGE_MIN_PIXELS = 4 * FACTOR * FACTOR
IMAGE_MAX_PIXELS = 128 * FACTOR * FACTOR
VIDEO_MIN_PIXELS = 4 * FACTOR * FACTOR
VIDEO_MAX_PIXELS = 64 * FACTOR * FACTOR

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# After the trained vocabulary, in the order Qwen2 vocabularies have them.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}  # the tokenizer's named tokens

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096),
        "mrope_section": [2, 3, 3],  # sums to head_dim / 2 = 8
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(depth=8, embed_dim=384, num_heads=6, mlp_ratio=4),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
                     num_key_value_heads=4, max_position_embeddings=8192),
        "mrope_section": [8, 12, 12],  # head_dim 64
    },
}

# Qwen2 uses 1e6. With 8 rotary frequencies that would leave the height and width sections
# (the slowest frequencies) nearly still over test-length prompts, and a wrong M-RoPE row
# could pass the parity tests; at 100 every section turns by radians across an image.
ROPE_THETA = 100.0

# The chat template of Qwen/Qwen2-VL-7B-Instruct, verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_EXTRA_WORDS = ("system", "user", "assistant", "You", "are", "helpful", "What", "Describe", "image", "video")

# vlmd.tiny.weights' rule; the vision attention's fused qkv and the patch embedding are sharp
# like q/k, and the merger's MLP puts image features on the scale of token embeddings.
PARAM_STD = StdRule(gains=[(("attn.qkv.weight", "patch_embed.proj.weight", ".merger.mlp."), 1.0)])


def build_tokenizer(seed: int, vocab_size: int, chat_template: str = QWEN2_VL_CHAT_TEMPLATE):
    """Qwen's special tokens after a trained vocabulary; Qwen2-VL's chat template unless
    another family of Qwen vision models gives its own."""
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, trailing_special_tokens=SPECIAL_TOKENS, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(
            eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=IMAGE_TOKENS,
            model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
            chat_template=chat_template,
        ),
    )


def qwen2_vl_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``Qwen2VLConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import Qwen2VLConfig

    spec = SIZES[size]
    text_hidden = spec["text"]["hidden_size"]
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": spec["mrope_section"]},
            use_sliding_window=False,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            **spec["text"],
        ),
        vision_config=dict(
            hidden_size=text_hidden,  # the merger projects into the text width
            hidden_act="quick_gelu",
            in_channels=3,
            patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            **spec["vision"],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def processor_settings(min_pixels: int, max_pixels: int) -> dict:
    """Image/video processor fields shared by transformers 4.x and 5.x readers."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "merge_size": MERGE_SIZE,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": PATCH_SIZE,
        "resample": 3,  # PIL bicubic
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }


def write_processor_files(out: Path, tokenizer, processor_class: str) -> None:
    """Tokenizer, chat template and processor configs, naming ``processor_class`` (Qwen2.5-VL's
    image and video processors are Qwen2-VL's).

    transformers' ``Qwen2VLVideoProcessor`` needs torchvision, which is not installed here, so
    the video processor config is written as JSON rather than through the class; readers that
    have torchvision load it as usual.
    """
    write_tokenizer(out, tokenizer, QWEN2_VL_CHAT_TEMPLATE,
                    extra_special_tokens=IMAGE_TOKENS, additional_special_tokens=SPECIAL_TOKENS[1:])
    image = {**processor_settings(IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS), "image_processor_type": "Qwen2VLImageProcessor"}
    video = {**processor_settings(VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS), "video_processor_type": "Qwen2VLVideoProcessor"}
    write_json(out / "preprocessor_config.json", {**image, "processor_class": processor_class})
    write_json(out / "video_preprocessor_config.json", {**video, "processor_class": processor_class})
    write_json(out / "processor_config.json", {"processor_class": processor_class, "image_processor": image})


def build_tiny_qwen2_vl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen2-VL checkpoint into ``out_dir`` and return its path."""
    return build_qwen_vl_checkpoint(out_dir, seed, size, family="qwen2_vl", sizes=SIZES, make_config=qwen2_vl_config,
                                    model_class="Qwen2VLForConditionalGeneration", processor_class="Qwen2VLProcessor")


def build_qwen_vl_checkpoint(out_dir, seed: int, size: str, *, family: str, sizes: dict, make_config,
                             model_class: str, processor_class: str, summary: dict | None = None) -> Path:
    """A random checkpoint of Qwen2-VL's layout (tokenizer, weights, processor files) for
    ``family``: ``make_config(size, vocab_size=..., ids=...)`` gives its config,
    ``model_class`` names its transformers class and ``summary`` adds to ``vlmd_tiny.json``."""
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(sizes)}")
    import transformers
    from transformers import GenerationConfig

    spec = sizes[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = make_config(size, vocab_size=len(tokenizer), ids=ids)
    model = random_model(getattr(transformers, model_class), config, seed, PARAM_STD, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"]
    )
    save_model(model, out)

    # Stable bytes, and the 4.x spelling of M-RoPE (rope_scaling.type "mrope") beside 5.x's.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    rope = cfg["text_config"]["rope_parameters"]
    cfg["text_config"]["rope_theta"] = rope["rope_theta"]
    cfg["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    write_json(cfg_path, cfg)
    restamp_json(out, "generation_config.json")
    write_processor_files(out, tokenizer, processor_class)

    write_json(
        out / "vlmd_tiny.json",
        {
            "family": family, "size": size, "seed": int(seed), "num_parameters": int(num_params),
            "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"],
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "image_min_pixels": IMAGE_MIN_PIXELS, "image_max_pixels": IMAGE_MAX_PIXELS,
            "video_min_pixels": VIDEO_MIN_PIXELS, "video_max_pixels": VIDEO_MAX_PIXELS, **(summary or {}),
        },
    )
    return out
