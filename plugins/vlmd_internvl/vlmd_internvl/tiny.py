"""Deterministic random InternVL3 checkpoints for tests (``InternVLForConditionalGeneration``).

Layout written to ``out_dir`` (byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers 5 names)
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
* ``processor_config.json`` (transformers 5: the processor with its image and video processors
  nested), ``preprocessor_config.json`` (the image processor, what transformers 4.x reads) and
  ``video_preprocessor_config.json`` (the video processor)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

Architecture as InternVL3: an InternViT tower (CLS + absolute positions, layer scale,
pre-norm attention and MLP) over square tiles, pixel shuffle 0.5, a LayerNorm + 2-layer MLP
projector and a Qwen2 text model (q/k/v bias, GQA). Tiles are 112 px (8x8 patches of 14 px, 16
tokens per tile after the shuffle) and an image takes at most 6 tiles plus the thumbnail, so
tests are fast while every grid rule (ties, thumbnails, thin strips) is exercised.
"""

from __future__ import annotations

from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model

__all__ = ["SIZES", "INTERNVL_CHAT_TEMPLATE", "build_tiny_internvl", "internvl_config"]

TILE_SIZE = 112
PATCH_SIZE = 14
MAX_PATCHES = 6
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2 // 4  # pixel shuffle 0.5
IMAGENET_MEAN = [0.485, 0.456, 0.406]  # what InternVL3 checkpoints normalise with
IMAGENET_STD = [0.229, 0.224, 0.225]

# After the trained vocabulary, in the order InternVL3's Qwen2 vocabulary has them.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
IMAGE_TOKENS = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
                "video_token": "<video>"}

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096),
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, intermediate_size=1536),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
                     num_key_value_heads=4, max_position_embeddings=8192),
    },
}

# The chat template transformers' InternVL conversion script writes, verbatim.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)

_EXTRA_WORDS = ("system", "user", "assistant", "You", "are", "helpful", "What", "Describe", "image", "Frame")

# vlmd.tiny.weights' rule; layer scales at 0.5 so the blocks change the residual stream
# visibly, the CLS token and positions at 0.5, the patch embedding sharp like q/k and the
# projector putting image features on the scale of token embeddings.
PARAM_STD = StdRule(fixed=[(("lambda_1", "lambda_2"), 0.5, 0.1), (("cls_token", "position_embeddings"), 0.0, 0.5)],
                    gains=[(("projection.weight", ".multi_modal_projector."), 1.0)])


def _build_tokenizer(seed: int, vocab_size: int):
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, trailing_special_tokens=SPECIAL_TOKENS, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=IMAGE_TOKENS,
                              model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
                              chat_template=INTERNVL_CHAT_TEMPLATE),
    )


def internvl_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``InternVLConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import InternVLConfig

    spec = SIZES[size]
    config = InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False,
                         tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], **spec["text"]),
        vision_config=dict(image_size=TILE_SIZE, patch_size=PATCH_SIZE, hidden_act="gelu", norm_type="layer_norm",
                           attention_bias=True, use_qk_norm=False, use_mean_pooling=True, **spec["vision"]),
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5,
        projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    config.architectures = ["InternVLForConditionalGeneration"]
    return config


def _image_processor_settings() -> dict:
    return {
        "crop_to_patches": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
        "image_processor_type": "GotOcr2ImageProcessor", "max_patches": MAX_PATCHES, "min_patches": 1,
        "resample": 3, "rescale_factor": 1 / 255, "size": {"height": TILE_SIZE, "width": TILE_SIZE},
    }


def _video_processor_settings() -> dict:
    """Frames resized to one tile each, as InternVL3's video processor config says."""
    return {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "do_sample_frames": False, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD, "resample": 3,
        "rescale_factor": 1 / 255, "size": {"height": TILE_SIZE, "width": TILE_SIZE},
        "video_processor_type": "InternVLVideoProcessor",
    }


def _write_processor_files(out: Path, tokenizer) -> None:
    """Tokenizer, chat template and processor configs (as JSON: transformers' video processor
    for InternVL needs torchvision, so the processor is not saved through its class)."""
    write_tokenizer(out, tokenizer, INTERNVL_CHAT_TEMPLATE, extra_special_tokens=IMAGE_TOKENS,
                    additional_special_tokens=SPECIAL_TOKENS[1:])
    image = _image_processor_settings()
    write_json(out / "preprocessor_config.json", {**image, "processor_class": "InternVLProcessor"})
    video = _video_processor_settings()
    write_json(out / "video_preprocessor_config.json", {**video, "processor_class": "InternVLProcessor"})
    write_json(out / "processor_config.json", {"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE,
                                                 "image_processor": image, "video_processor": video})


def build_tiny_internvl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random InternVL3 checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import InternVLForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = internvl_config(size, vocab_size=len(tokenizer), ids=ids)

    model = random_model(InternVLForConditionalGeneration, config, seed, PARAM_STD, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    save_checkpoint(model, out, ids["<|endoftext|>"], eos_ids, ids["<|endoftext|>"])
    _write_processor_files(out, tokenizer)
    write_json(out / "vlmd_tiny.json", {
        "family": "internvl", "size": size, "seed": int(seed), "num_parameters": int(num_params),
        "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<IMG_CONTEXT>"], "start_image_token_id": ids["<img>"],
        "end_image_token_id": ids["</img>"], "video_token_id": ids["<video>"], "tile_size": TILE_SIZE,
        "max_patches": MAX_PATCHES, "tokens_per_tile": TOKENS_PER_TILE,
    })
    return out
