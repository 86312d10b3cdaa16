"""Deterministic random Llama 3.2 Vision checkpoints for tests (``MllamaForConditionalGeneration``).

Layout written to ``out_dir`` (byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, in the published
  checkpoints' layout, which transformers 5 writes: ``language_model.model.``, ``vision_model.``)
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
* ``processor_config.json`` (transformers 5: the processor with its image processor nested) and
  ``preprocessor_config.json`` (the image processor, what transformers 4.x reads)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

Architecture as Llama 3.2 Vision: a vision tower of 56-px tiles (4x4 patches of 14 px and a
class token: 17 vectors a tile), at most 2 tiles an image, a local and a gated global
transformer, intermediate layers concatenated, a linear projector; a Llama 3 text model
(GQA, llama3 rope scaling) whose layers 1 and 3 of 5 are gated cross-attention layers. The
image token is the last id, past the text vocabulary (the embeddings have 8 rows more than the
head, as the published checkpoints). The gates, which transformers initialises to zero (a
cross-attention layer would then do nothing), are drawn away from zero.
"""

from __future__ import annotations

from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model

__all__ = ["SIZES", "MLLAMA_CHAT_TEMPLATE", "build_tiny_mllama", "mllama_config"]

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|python_tag|>", "<|finetune_right_pad_id|>", "<|image|>")  # the image token last, as published

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(hidden_size=32, num_hidden_layers=3, num_global_layers=1, attention_heads=4,
                       intermediate_size=64, intermediate_layers_indices=[0, 2], image_size=56, max_num_tiles=2),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=5, cross_attention_layers=[1, 3],
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(hidden_size=384, num_hidden_layers=8, num_global_layers=2, attention_heads=6,
                       intermediate_size=1536, intermediate_layers_indices=[3, 5, 7], image_size=224, max_num_tiles=4),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=10, cross_attention_layers=[2, 6],
                     num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192),
    },
}

# Llama 3.2 Vision's chat template, without its tool-calling and date preamble.
MLLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

_EXTRA_WORDS = ("system", "user", "assistant", "You", "are", "helpful", "What", "Describe", "image", "picture")


def _build_tokenizer(seed: int, vocab_size: int):
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, trailing_special_tokens=SPECIAL_TOKENS, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                              pad_token="<|finetune_right_pad_id|>", extra_special_tokens={"image_token": "<|image|>"},
                              model_max_length=131072, clean_up_tokenization_spaces=False,
                              chat_template=MLLAMA_CHAT_TEMPLATE),
    )


def mllama_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``MllamaConfig`` of a ``size`` ("tiny" or "small") checkpoint; ``vocab_size`` is the
    tokenizer's, the image token its last id."""
    from transformers import MllamaConfig

    spec = SIZES[size]
    vision = dict(spec["vision"])
    tiles = vision["max_num_tiles"]
    vision["supported_aspect_ratios"] = [[a, b] for a in range(1, tiles + 1) for b in range(1, tiles + 1) if a * b <= tiles]
    vision["vision_output_dim"] = vision["hidden_size"] * (len(vision["intermediate_layers_indices"]) + 1)
    config = MllamaConfig(
        vision_config=dict(patch_size=14, hidden_act="gelu", norm_eps=1e-5, **vision),
        text_config=dict(vocab_size=vocab_size - 1, hidden_act="silu", rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": spec["text"]["max_position_embeddings"] // 4},
                         tie_word_embeddings=False, bos_token_id=ids["<|begin_of_text|>"],
                         eos_token_id=ids["<|eot_id|>"], pad_token_id=ids["<|finetune_right_pad_id|>"], **spec["text"]),
        image_token_index=ids["<|image|>"],
    )
    config.architectures = ["MllamaForConditionalGeneration"]
    return config


# The common tiny rule (vlmd/tiny/weights.py) with Mllama's gates and tile embeddings.
WEIGHT_RULE = StdRule(
    fixed=(
        # tanh(gate) ~ 0.5: every gated path (cross-attention, tile and position embeddings,
        # the global transformer) shows in the output
        (("cross_attn_attn_gate", "cross_attn_mlp_gate", "embedding.gate", "gate_attn", "gate_ffn"), 0.6, 0.2),
        (("class_embedding", "positional_embedding.embedding", "tile_embedding"), 0.0, 0.5),
    ),
    gains=((("multi_modal_projector",), 1.0),),
)


def _image_processor_settings(tile: int, max_tiles: int) -> dict:
    return {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "image_processor_type": "MllamaImageProcessor",
        "max_image_tiles": max_tiles, "resample": 2, "rescale_factor": 1 / 255, "size": {"height": tile, "width": tile},
    }


def _write_processor_files(out: Path, tokenizer, tile: int, max_tiles: int) -> None:
    write_tokenizer(out, tokenizer, MLLAMA_CHAT_TEMPLATE, extra_special_tokens={"image_token": "<|image|>"},
                    additional_special_tokens=list(SPECIAL_TOKENS[2:]))
    image = _image_processor_settings(tile, max_tiles)
    write_json(out / "preprocessor_config.json", {**image, "processor_class": "MllamaProcessor"})
    write_json(out / "processor_config.json", {"processor_class": "MllamaProcessor", "image_processor": image})


def build_tiny_mllama(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Llama 3.2 Vision checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import MllamaForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    if ids["<|image|>"] != len(tokenizer) - 1:
        raise RuntimeError("the image token must be the tokenizer's last id")
    config = mllama_config(size, vocab_size=len(tokenizer), ids=ids)

    # The image token has an embedding but no row in the head.
    model = random_model(MllamaForConditionalGeneration, config, seed, WEIGHT_RULE,
                         sorted(i for i in ids.values() if i != ids["<|image|>"]))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|eot_id|>"], ids["<|end_of_text|>"]]
    save_checkpoint(model, out, ids["<|begin_of_text|>"], eos_ids, ids["<|finetune_right_pad_id|>"])
    vision = spec["vision"]
    _write_processor_files(out, tokenizer, vision["image_size"], vision["max_num_tiles"])
    tokens_per_tile = (vision["image_size"] // 14) ** 2 + 1
    write_json(out / "vlmd_tiny.json", {
        "family": "mllama", "size": size, "seed": int(seed), "num_parameters": int(num_params),
        "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<|finetune_right_pad_id|>"],
        "image_token_id": ids["<|image|>"], "tile_size": vision["image_size"], "max_image_tiles": vision["max_num_tiles"],
        "tokens_per_tile": tokens_per_tile,
    })
    return out
